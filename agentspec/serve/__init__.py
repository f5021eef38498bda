"""``agentspec serve``: OpenAI's chat-completions and completions APIs over one model pair (FastAPI +
uvicorn).

The engine side of the HTTP path, part of the core (its web dependencies are the ``serve`` extra:
the ``serve`` extra, docs/install.md). A request goes through the same request layer as the
in-process LangChain chat model (``agentspec.chat``: ``prepare``, ``reply_deltas``), so greedy
replies over HTTP are the ones ``ChatSpecDecode`` gives for the same messages.

protocol.py    the wire formats: the request models, response and chunk bodies, vLLM's metrics names
worker.py      one choice's decode on a worker thread of its own; the bound on admitted requests
replies.py     the choices put together from their deltas, shaped as each route answers
metrics.py     Prometheus counters at /metrics (usage is counted on the server)
tokenize.py    vLLM's /tokenize and /detokenize, a conversation rendered as the chat route renders it
request_id.py  X-Request-Id on every response (the request's, or one made for it)
app.py         create_app(pair, ...): routes, API keys and tenants, errors, streaming
"""

from agentspec.serve.app import create_app

__all__ = ["create_app"]
