"""``ChatSpecDecode(base_url=...)`` against a real ``agentspec serve`` process on 127.0.0.1.

One server for the module (the embedded SmolLM2, one torch thread, an API key), started through
``agentspec.cli.main`` in a process whose OpenTelemetry SDK writes its spans to a file, one JSON
object a line (how an operator who wants the server's spans runs it), and always stopped after the
tests. The in-process ``ChatSpecDecode`` on the same thread count is the reference the remote
greedy replies must equal. Retries go through ``Gate``, a small HTTP proxy on 127.0.0.1 that fails
the requests it is told to (an error status, or a connection dropped unanswered) and forwards the
rest, recording the headers it saw: the tests count requests, they never wait for a retry.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_core.tools import tool
from pydantic import BaseModel

import agentspec

openai = pytest.importorskip("openai", reason="the remote path's client (the [remote] extra)")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn", reason="agentspec serve's web stack (the serve extra)")
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.trace import SpanKind  # noqa: E402

import agentspec.serve  # noqa: E402  (the project's own: a broken import fails, never skips)
from langchain_agentspec import ChatSpecDecode  # noqa: E402
from langchain_agentspec.remote import SESSION_HEADERS  # noqa: E402

pytestmark = [pytest.mark.model, pytest.mark.usefixtures("one_thread")]

KEY = "remote-client-test-key"
MODEL = "SmolLM2-135M-Instruct"  # the embedded target's name, which the server serves
STARTUP_TIMEOUT_S = 300.0  # imports and the model load; about 15 s on an idle 2-core machine
CALL_TIMEOUT_S = 120.0
# the server: agentspec serve through its CLI, with an SDK that writes each ended span to a file
LAUNCH = textwrap.dedent(
    """
    import os, sys
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor

    out = open(os.environ["SPANS_FILE"], "a", buffering=1)
    exporter = ConsoleSpanExporter(out=out, formatter=lambda s: s.to_json(indent=None) + "\\n")
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    from agentspec.cli import main
    sys.exit(main(sys.argv[1:]))
    """
)


@tool
def square(x: int) -> int:
    """Square an integer."""
    return x * x


class City(BaseModel):
    name: str
    country: str


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``(url, spans file)`` of a running ``agentspec serve`` (stopped, killed if need be, afterwards)."""
    port, folder = _free_port(), tmp_path_factory.mktemp("serve")
    log_path, spans = folder / "serve.log", folder / "spans.jsonl"
    command = [sys.executable, "-c", LAUNCH, "serve", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--threads", "1", "--api-key", KEY, "--log-level", "warning"]
    # the server runs the agentspec these tests import (a checkout's, not an installed copy's)
    root = str(Path(agentspec.__file__).resolve().parent.parent)
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_WAIT_POLICY": "PASSIVE", "SPANS_FILE": str(spans)}
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        try:
            deadline = time.monotonic() + STARTUP_TIMEOUT_S
            while not _healthy(url):
                if process.poll() is not None or time.monotonic() > deadline:
                    tail = log_path.read_text(errors="replace")[-3000:]
                    raise RuntimeError(
                        f"agentspec serve did not come up ({process.returncode=}); log:\n{tail}"
                    )
                time.sleep(0.5)
            yield url, spans
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=30)


@pytest.fixture(scope="module")
def local():
    """The in-process pair: the reference replies."""
    return agentspec.load_pair()


def _remote(url: str, **options) -> ChatSpecDecode:
    options = {"api_key": KEY, "max_tokens": 16, "timeout": CALL_TIMEOUT_S, **options}
    return ChatSpecDecode(base_url=f"{url}/v1", **options)


def _unique_system() -> str:
    return f"You help the customers of shop {uuid.uuid4().hex[:8]}. Answer briefly and politely."


class Gate:
    """An HTTP proxy on 127.0.0.1 in front of the server: it answers the first requests with the
    failures in ``script`` (status, body; a None status drops the connection unanswered, which the
    client sees as a connection error) and forwards the others, recording each request's headers."""

    def __init__(self, upstream: str, script: list[tuple[int | None, bytes]]):
        self.upstream, self.script, self.headers = upstream, list(script), []
        gate = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.do_POST()

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                gate.headers.append(dict(self.headers))
                if gate.script:
                    status, text = gate.script.pop(0)
                    if status is None:
                        self.close_connection = True
                        return
                    kind = "text/event-stream" if text.startswith(b"data:") else "text/plain"
                    self._answer(status, text, {"content-type": kind})
                    return
                sent = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")}
                reply = httpx.request(
                    self.command,
                    gate.upstream + self.path,
                    content=body,
                    headers=sent,
                    timeout=CALL_TIMEOUT_S,
                )
                self._answer(
                    reply.status_code, reply.content, {"content-type": reply.headers["content-type"]}
                )

            def _answer(self, status: int, body: bytes, headers: dict) -> None:
                self.send_response(status)
                for name, value in {**headers, "content-length": str(len(body))}.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)

    def __enter__(self) -> Gate:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.http.shutdown()
        self.http.server_close()
        self.thread.join(timeout=10)


def test_greedy_replies_equal_in_process_ones(server, local):
    url, _ = server
    remote, here = _remote(url, max_tokens=16), ChatSpecDecode(pair=local, max_tokens=16)
    messages = [("system", "You are terse."), ("user", "Name three colours.")]
    assert remote.invoke(messages).content == here.invoke(messages).content

    ask = "Square 7."
    remote_call = _remote(url, max_tokens=40).bind_tools([square], tool_choice="square").invoke(ask)
    local_call = (
        ChatSpecDecode(pair=local, max_tokens=40).bind_tools([square], tool_choice="square").invoke(ask)
    )
    assert [(c["name"], c["args"]) for c in remote_call.tool_calls] == [
        (c["name"], c["args"]) for c in local_call.tool_calls
    ]
    assert remote_call.tool_calls[0]["id"].startswith("call_")  # the server's id


def test_a_sessions_second_turn_reads_the_cache_and_reports_speculation(server, local):
    url, _ = server
    llm = _remote(url, max_tokens=8)
    config = {"metadata": {"thread_id": f"t-{uuid.uuid4().hex}"}}
    turn1 = [("system", _unique_system()), ("user", "Hi!")]
    first = llm.invoke(turn1, config=config)
    # a new system prompt: only the template's opening tokens can come from earlier calls
    assert first.usage_metadata["input_token_details"]["cache_read"] < 8
    second = llm.invoke([*turn1, first, ("user", "What do you sell?")], config=config)
    # turn 1's prompt is a token prefix of turn 2's: the server restores it from its cache
    cached = second.usage_metadata["input_token_details"]["cache_read"]
    assert cached >= first.usage_metadata["input_tokens"] - 1, (cached, first.usage_metadata)
    meta = second.response_metadata
    assert meta["id"].startswith("chatcmpl-") and meta["model_name"] == local.name
    here = ChatSpecDecode(pair=local, max_tokens=8).invoke(turn1).response_metadata["speculative"]
    assert set(meta["speculative"]) == set(here)  # one shape, local or remote
    spec = meta["speculative"]
    assert sum(spec["acceptance_histogram"]) == spec["verify_steps"] > 0
    assert spec["accepted_tokens"] <= spec["draft_tokens"]
    assert meta["agentspec"]["cached_tokens"] == cached and "latency_saved_s" in meta["agentspec"]
    assert "speculative_decoding" in meta["metrics"]


def test_streaming_tool_calls_and_usage(server):
    url, _ = server
    llm = _remote(url, max_tokens=40).bind_tools([square], tool_choice="any")
    chunks = list(llm.stream("Square 9."))
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged += chunk
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [("square", {"x": 9})]
    assert merged.tool_calls[0]["id"].startswith("call_")
    last = chunks[-1]
    assert last.chunk_position == "last" and last.usage_metadata["output_tokens"] > 0
    assert last.response_metadata["finish_reason"] == "tool_calls"
    assert "speculative" in last.response_metadata

    async def both():
        whole = await _remote(url, max_tokens=8).ainvoke("Say hello to Ada.")
        parts = [c async for c in _remote(url, max_tokens=8).astream("Say hello to Ada.")]
        return whole, parts

    whole, parts = asyncio.run(both())
    assert "".join(p.content for p in parts) == whole.content and parts[-1].usage_metadata is not None


def test_structured_output(server):
    url, _ = server
    city = (
        _remote(url, max_tokens=40).with_structured_output(City).invoke("Paris is a city in which country?")
    )
    assert isinstance(city, City) and city.name


def test_spans_join_across_the_two_processes(server):
    url, spans_file = server
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    thread = f"t-{uuid.uuid4().hex}"
    with Gate(url, []) as gate:
        llm = ChatSpecDecode(base_url=f"{gate.url}/v1", api_key=KEY, max_tokens=6, tracer_provider=provider)
        reply = llm.invoke("Hello!", config={"metadata": {"thread_id": thread}})
    (span,) = exporter.get_finished_spans()
    attrs = span.attributes
    assert span.kind == SpanKind.CLIENT and span.name == f"chat {reply.response_metadata['model_name']}"
    assert attrs["server.address"] == "127.0.0.1" and attrs["server.port"] == int(gate.url.rsplit(":", 1)[1])
    assert attrs["gen_ai.conversation.id"] == thread
    assert attrs["gen_ai.response.id"] == reply.response_metadata["id"]
    assert attrs["gen_ai.usage.input_tokens"] == reply.usage_metadata["input_tokens"]
    assert "agentspec.latency_saved_s" in attrs and "agentspec.draft_tokens" in attrs
    sent = {k.lower(): v for k, v in gate.headers[-1].items()}
    trace_id, span_id = f"{span.context.trace_id:032x}", f"{span.context.span_id:016x}"
    assert sent["traceparent"].startswith(f"00-{trace_id}-{span_id}-")  # then the flags (sampled)
    assert all(sent[name.lower()] == thread for name in SESSION_HEADERS)
    # the server's spans, written by the other process, in the client's trace
    deadline, theirs = time.monotonic() + 10, []
    while not theirs and time.monotonic() < deadline:
        lines = spans_file.read_text().splitlines() if spans_file.exists() else []
        theirs = [s for s in map(json.loads, lines) if s["context"]["trace_id"] == f"0x{trace_id}"]
        time.sleep(0.1)
    # the engine's span among them, and under the client's (the web framework may add its own)
    assert any(s["parent_id"] == f"0x{span_id}" for s in theirs), theirs
    (engine,) = [s for s in theirs if s["name"] == span.name]
    assert engine["attributes"]["gen_ai.conversation.id"] == thread  # the session header, read there


def test_retries_before_the_first_chunk(server):
    url, _ = server
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    failures = [
        (None, b""),  # dropped unanswered: a connection error
        (503, b"busy"),
        (502, b"bad gateway"),
        (500, b"Request failed: error sending request for url"),  # a router that lost its worker
    ]
    with Gate(url, failures) as gate:
        llm = ChatSpecDecode(
            base_url=f"{gate.url}/v1",
            api_key=KEY,
            max_tokens=6,
            model=MODEL,
            max_retries=len(failures),  # exactly enough
            timeout=CALL_TIMEOUT_S,
            tracer_provider=provider,
        )
        chunks = list(llm.stream("Hello!"))
    assert chunks[-1].usage_metadata["output_tokens"] > 0
    assert len(gate.headers) == len(failures) + 1  # each failure, then the request that got through
    (span,) = exporter.get_finished_spans()  # one span for the call, an event per retried attempt
    retries = [e.attributes["error.type"] for e in span.events if e.name == "retry"]
    assert retries == ["APIConnectionError"] + ["InternalServerError"] * 3, retries
    assert span.status.is_ok and span.attributes["gen_ai.usage.output_tokens"] > 0

    # a model server's own error (OpenAI's error object) is not retried
    error = json.dumps({"error": {"message": "decoding failed", "type": "server_error"}}).encode()
    with Gate(url, [(500, error)]) as gate:
        llm = ChatSpecDecode(base_url=f"{gate.url}/v1", api_key=KEY, max_tokens=6, model=MODEL, max_retries=5)
        with pytest.raises(openai.InternalServerError, match="decoding failed"):
            llm.invoke("Hello!")
        assert len(gate.headers) == 1

    # a stream that fails after its first chunk is not retried: the caller has seen part of a reply
    first = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": MODEL}
    first["choices"] = [{"index": 0, "delta": {"role": "assistant", "content": "Hel"}, "finish_reason": None}]
    broken = f"data: {json.dumps(first)}\n\ndata: {json.dumps({'error': {'message': 'worker lost'}})}\n\n"
    with Gate(url, [(200, broken.encode())]) as gate:
        llm = ChatSpecDecode(base_url=f"{gate.url}/v1", api_key=KEY, max_tokens=6, model=MODEL, max_retries=5)
        seen = []
        with pytest.raises(openai.APIError, match="worker lost"):
            seen.extend(c.content for c in llm.stream("Hello!"))
        assert seen == ["Hel"] and len(gate.headers) == 1


def test_a_wrong_key_is_a_clear_error(server):
    url, _ = server
    with pytest.raises(openai.AuthenticationError, match="API key"):
        _remote(url, api_key="not-the-key").invoke("Hello!")


NO_ENGINE = textwrap.dedent(
    """
    import json
    import sys

    blocked, tried = ("torch", "transformers", "xgrammar", "agentspec"), []

    class Block:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in blocked:
                tried.append(name)
                raise ImportError(f"{name} is blocked in this test")
            return None

    sys.meta_path.insert(0, Block())
    from langchain_agentspec import ChatSpecDecode

    llm = ChatSpecDecode(base_url=sys.argv[1], api_key=sys.argv[2], max_tokens=6)
    text = llm.invoke("Hello!").content
    streamed = "".join(c.content for c in llm.stream("Hello!"))
    engine = [name for name in sys.modules if name.split(".")[0] in blocked]
    print(json.dumps({"text": text, "streamed": streamed, "tried": tried, "imported": engine}))
    """
)


def test_remote_mode_imports_no_torch(server):
    url, _ = server
    done = subprocess.run(
        [sys.executable, "-c", NO_ENGINE, f"{url}/v1", KEY],
        capture_output=True,
        text=True,
        timeout=CALL_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["tried"] == [] and seen["imported"] == [], seen
    assert seen["text"] and seen["text"] == seen["streamed"], seen  # greedy: the same reply both ways


def test_remote_token_counts_are_the_servers_and_equal_the_local_ones(server, local):
    """``get_num_tokens_from_messages`` and ``get_token_ids`` through the server's ``/tokenize``: the
    prompt a call with these messages and tools makes there, as in process."""
    url, _ = server
    messages = [SystemMessage("Be terse."), HumanMessage("What is 7 squared?")]
    remote, here = _remote(url), ChatSpecDecode(pair=local)
    assert remote.get_num_tokens_from_messages(messages) == here.get_num_tokens_from_messages(messages)
    with_tools = remote.get_num_tokens_from_messages(messages, tools=[square])
    assert with_tools == here.get_num_tokens_from_messages(messages, tools=[square]) > 0
    assert remote.get_token_ids("Hello there") == here.get_token_ids("Hello there") != []
    reply = remote.bind_tools([square]).invoke(messages)
    assert reply.usage_metadata["input_tokens"] == with_tools
    assert reply.response_metadata["model_provider"] == "agentspec"
