"""``agentspec serve`` on the embedded SmolLM2, driven by the ``openai`` client over 127.0.0.1.

One server process for the module (``agentspec serve`` on a free port, one torch thread, two
sequences at once, two API keys), started before the tests and always stopped after them; the in-process
``ChatSpecDecode`` on the same thread count is the reference its greedy replies must equal. The
trace test runs the app in this process (``create_app`` and FastAPI's TestClient) to read its spans
from an in-memory exporter. The server's failures (a decode that fails, a whole reply's client that
goes away) are ``test_serve_errors.py``: they need hooks inside the server, so they run it in-process.
"""

from __future__ import annotations

import json
import threading
import time
import uuid

import httpx
import pytest
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool

import agentspec
from agentspec.fleet.process import ServerProcess, agentspec_serve_command, checkout_env, free_port

openai = pytest.importorskip("openai", reason="the openai client (a dev dependency) is not installed")

pytestmark = [pytest.mark.model, pytest.mark.usefixtures("one_thread")]

KEYS = ("test-key-one", "test-key-two")
STARTUP_TIMEOUT_S = 300.0  # imports and the model load; about 15 s on an idle 2-core machine
CALL_TIMEOUT_S = 120.0


@tool
def square(x: int) -> int:
    """Square an integer."""
    return x * x


SQUARE = convert_to_openai_tool(square)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The base URL of a running ``agentspec serve`` (stopped, and killed if need be, afterwards)."""
    port = free_port()
    command = agentspec_serve_command(port, "--threads", "1", "--max-num-seqs", "2", "--api-key", KEYS[0])
    command += ["--log-level", "warning"]
    # the server runs the agentspec these tests import (a checkout's, not an installed copy's)
    env = checkout_env({"AGENTSPEC_API_KEYS": KEYS[1]})
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with ServerProcess(command, port, env=env, log=log, startup_timeout_s=STARTUP_TIMEOUT_S) as process:
        yield process.url


@pytest.fixture(scope="module")
def local():
    """The in-process pair: the reference replies, and the app of the trace test."""
    return agentspec.load_pair()


def _client(server: str, key: str = KEYS[0]) -> openai.OpenAI:
    # no retries: a 503 or a 401 must reach the test as it was sent
    return openai.OpenAI(base_url=f"{server}/v1", api_key=key, max_retries=0, timeout=CALL_TIMEOUT_S)


def _chat(server: str, messages: list[dict], key: str = KEYS[0], **options):
    options = {"temperature": 0, "max_tokens": 12, **options}
    return _client(server, key).chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, **options
    )


def _salt() -> str:
    return uuid.uuid4().hex  # a namespace no earlier call of the module has touched


TOOL_TURN = [
    {"role": "user", "content": "What is 12 squared? Use the tool."},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_a1", "type": "function", "function": {"name": "square", "arguments": '{"x": 12}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_a1", "content": "144"},
]


def test_greedy_replies_equal_in_process_ones(server, local):
    from langchain_agentspec import ChatSpecDecode

    llm = ChatSpecDecode(pair=local, max_tokens=12)
    texts = [
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}],
        TOOL_TURN,  # assistant tool_calls and a tool result in the history
    ]
    for messages in texts:
        remote = _chat(server, messages, tools=[SQUARE]).choices[0].message
        assert remote.content == llm.bind_tools([square]).invoke(messages).content, messages

    ask = [{"role": "user", "content": "Square 7."}]
    named = {"type": "function", "function": {"name": "square"}}
    reply = _chat(server, ask, tools=[SQUARE], tool_choice=named, max_tokens=40)
    choice = reply.choices[0]
    llm = ChatSpecDecode(pair=local, max_tokens=40)  # room for the whole call
    here = llm.bind_tools([square], tool_choice="square").invoke(ask)
    expected = here.tool_calls
    # one count per reply: the same tokens on both sides (the call ends at its closing tag in both)
    assert reply.usage.completion_tokens == here.usage_metadata["output_tokens"]
    assert reply.usage.prompt_tokens == here.usage_metadata["input_tokens"]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert calls == [(c["name"], c["args"]) for c in expected]
    assert choice.message.tool_calls[0].id.startswith("call_")
    spec = reply.model_extra["metrics"]["speculative_decoding"]
    assert sum(spec["acceptance_histogram"]) == spec["num_spec_steps"]
    assert spec["num_accepted_draft_tokens"] <= spec["num_draft_tokens"]
    assert "latency_saved_s" in reply.model_extra["metrics"]["agentspec"]


def test_a_sessions_later_turns_read_the_cache(server):
    salt = _salt()
    turn1 = [
        {"role": "system", "content": "You answer questions about a bakery. " * 4},
        {"role": "user", "content": "Hi!"},
    ]
    first = _chat(server, turn1, max_tokens=6, extra_body={"cache_salt": salt})
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    turn2 = [*turn1, {"role": "assistant", "content": first.choices[0].message.content}]
    turn2.append({"role": "user", "content": "What do you sell?"})
    second = _chat(server, turn2, max_tokens=6, extra_body={"cache_salt": salt})
    # turn 1's prompt is a token prefix of turn 2's: all of it comes back from the cache
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens


def test_salts_and_keys_read_nothing_of_each_others_cache(server):
    prompt = [{"role": "user", "content": f"Tell me about the number {uuid.uuid4().int % 997}."}]
    salt_a, salt_b = _salt(), _salt()
    cached = lambda key, salt: (  # noqa: E731
        _chat(
            server, prompt, key=key, max_tokens=2, extra_body={"cache_salt": salt}
        ).usage.prompt_tokens_details.cached_tokens
    )
    assert cached(KEYS[0], salt_a) == 0
    assert cached(KEYS[0], salt_a) > 0  # the same tenant and salt again: its own cache
    assert cached(KEYS[0], salt_b) == 0  # another salt shares the prompt, none of the cache
    assert cached(KEYS[1], salt_a) == 0  # the same salt under another key is another tenant


def test_streaming_with_usage(server):
    messages = [{"role": "user", "content": "Say hello to Ada."}]
    whole = _chat(server, messages, max_tokens=8)
    chunks = list(_chat(server, messages, max_tokens=8, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finish] == [whole.choices[0].finish_reason]
    assert "speculative_decoding" in finish[0].model_extra["metrics"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the same prompt as the whole call

    ask = [{"role": "user", "content": "Square 9."}]
    streamed = list(_chat(server, ask, max_tokens=40, stream=True, tools=[SQUARE], tool_choice="required"))
    deltas = [call for c in streamed if c.choices for call in c.choices[0].delta.tool_calls or []]
    assert [(d.index, d.function.name) for d in deltas] == [(0, "square")]
    assert json.loads(deltas[0].function.arguments) == {"x": 9} and deltas[0].id.startswith("call_")


def test_structured_output_and_sampling_options(server):
    ask = [{"role": "user", "content": "Which city is the capital of France? Answer in JSON."}]
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    answer = _chat(server, ask, max_tokens=24, response_format=response_format).choices[0].message.content
    assert isinstance(json.loads(answer)["city"], str)  # the grammar admits nothing else
    loose = _chat(server, ask, max_tokens=24, response_format={"type": "json_object"}).choices[0]
    assert loose.finish_reason == "length" or isinstance(json.loads(loose.message.content), dict)

    story = [{"role": "user", "content": "Tell me a story."}]
    # a seed reproduces its sample whatever the namespace's drafts learned or its cache holds by then
    # (draws keyed by position): a fresh salt, then the same one again
    salt = _salt()
    sampled = [
        _chat(
            server,
            story,
            temperature=0.9,
            top_p=0.9,
            seed=7,
            max_tokens=8,
            extra_body={"cache_salt": s},
        )
        for s in (_salt(), salt, salt)
    ]
    assert len({r.choices[0].message.content for r in sampled}) == 1
    greedy = _chat(server, story, max_completion_tokens=8).choices[0].message.content
    word = greedy.split()[1]
    stopped = _chat(server, story, max_completion_tokens=8, stop=[word]).choices[0]
    assert stopped.finish_reason == "stop" and stopped.message.content == greedy[: greedy.index(word)]


def test_bad_requests_get_openai_400_bodies(server):
    auth = {"Authorization": f"Bearer {KEYS[0]}"}
    user = [{"role": "user", "content": "hi"}]
    bad = [
        {"messages": []},
        {"messages": "hi"},
        {"messages": user, "temperature": -1},
        {"messages": user, "n": 2},
        {"messages": [{"role": "tool", "tool_call_id": "nope", "content": "1"}]},
        {
            "messages": user,
            "tools": [SQUARE],
            "tool_choice": {"type": "function", "function": {"name": "cube"}},
        },
        {"messages": user, "response_format": {"type": "json_schema"}},
        {"messages": user, "tool_choice": "required"},  # no tools to call
        {
            "messages": [{"role": "tool", "tool_call_id": "x", "content": "1"}],
            "stream": True,
        },  # before any chunk
    ]
    for body in bad:
        response = httpx.post(
            f"{server}/v1/chat/completions", json=body, headers=auth, timeout=CALL_TIMEOUT_S
        )
        assert response.status_code == 400, (body, response.text)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
        assert error["message"], body
    broken = httpx.post(
        f"{server}/v1/chat/completions",
        content=b"{not json",
        headers={**auth, "Content-Type": "application/json"},
    )
    assert broken.status_code == 400
    with pytest.raises(openai.BadRequestError) as err:
        _chat(server, user, max_tokens=0)
    assert err.value.status_code == 400 and err.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        _client(server).chat.completions.create(model="gpt-4o", messages=user)


def test_a_missing_or_wrong_key_gets_401(server):
    assert httpx.get(f"{server}/health").status_code == 200  # the one route without a key
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEYS[0]}):
        for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/chat/completions")):
            response = httpx.request(method, f"{server}{path}", headers=headers, json={"messages": []})
            assert response.status_code == 401, (headers, path)
            assert response.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        _chat(server, [{"role": "user", "content": "hi"}], key="not-a-key")
    models = _client(server, KEYS[1]).models.list()  # the key from AGENTSPEC_API_KEYS
    assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct"]


def _metric(server: str, name: str) -> float:
    text = httpx.get(f"{server}/metrics", headers={"Authorization": f"Bearer {KEYS[0]}"}).text
    line = next(x for x in text.splitlines() if x.startswith(name + "{"))
    return float(line.rsplit(" ", 1)[1])


def _in_flight(server: str) -> float:
    return _metric(server, "agentspec_requests_in_flight")


def _wait_for(condition, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_full_queue_then_a_disconnect_frees_the_pair(server):
    """Two sequences at once, two keys (a share of ceil(2 / 2) = 1 each): a long stream decodes, a
    second request (the other key's) joins it, a third gets 503 (a full server is checked before a
    key's share); the stream's client goes away mid-reply, and the second request and a later one
    are answered."""
    salt, closed = _salt(), _metric(server, "agentspec_requests_closed_early_total")
    story = [{"role": "user", "content": "Write a long story about a dragon who learns to bake bread."}]
    long_stream = _chat(server, story, max_tokens=400, stream=True, extra_body={"cache_salt": salt})
    first = next(c for c in long_stream if c.choices and c.choices[0].delta.content)
    assert first.choices[0].finish_reason is None

    waiting: dict = {}
    behind = threading.Thread(
        target=lambda: waiting.update(
            reply=_chat(server, [{"role": "user", "content": "Hi"}], key=KEYS[1], max_tokens=3)
        )
    )
    behind.start()
    try:
        _wait_for(lambda: _in_flight(server) == 2, "the second request to be admitted")
        full = httpx.post(
            f"{server}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
            headers={"Authorization": f"Bearer {KEYS[0]}"},
        )
        assert full.status_code == 503 and int(full.headers["Retry-After"]) >= 1
        assert full.json()["error"]["code"] == "queue_full"
        long_stream.close()  # the client goes away mid-reply
    finally:
        behind.join(timeout=CALL_TIMEOUT_S)
    assert not behind.is_alive(), "the second request was never answered"
    assert waiting["reply"].usage.completion_tokens == 3
    _wait_for(lambda: _in_flight(server) == 0, "the closed stream's decode to end", timeout_s=30)
    # it stopped where its client left, long before its 400 tokens
    assert _metric(server, "agentspec_requests_closed_early_total") == closed + 1
    again = _chat(server, story, max_tokens=2, extra_body={"cache_salt": salt})
    # the closed stream saved its verified part: its whole prompt comes back from the cache
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1


def test_traceparent_makes_the_servers_span_a_child(local):
    from fastapi.testclient import TestClient
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import SpanKind

    from agentspec.serve import create_app

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace_id, parent_id = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}
    with TestClient(create_app(local, tracer_provider=provider)) as client:
        headers = {"traceparent": f"00-{trace_id}-{parent_id}-01", "X-Session-ID": "thread-7"}
        traced = client.post("/v1/chat/completions", json=body, headers=headers)
        untraced = client.post("/v1/chat/completions", json=body)
    assert traced.status_code == untraced.status_code == 200
    child, root = exporter.get_finished_spans()
    assert child.name == root.name == f"chat {local.name}"
    assert format(child.context.trace_id, "032x") == trace_id
    assert format(child.parent.span_id, "016x") == parent_id and child.parent.is_remote
    assert root.parent is None  # no traceparent: a trace of its own
    assert child.attributes["gen_ai.usage.input_tokens"] == traced.json()["usage"]["prompt_tokens"]
    assert child.kind == root.kind == SpanKind.SERVER
    # the session the caller named, and the id its response carries
    assert child.attributes["gen_ai.conversation.id"] == "thread-7"
    assert "gen_ai.conversation.id" not in root.attributes
    assert child.attributes["gen_ai.response.id"] == traced.json()["id"]
