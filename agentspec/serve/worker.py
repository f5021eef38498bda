"""One choice's call on a worker thread of its own, its deltas handed to the event loop through a queue.

Every admitted request decodes at once: its call is a sequence in the pair's scheduler
(``agentspec.scheduler``), whose thread runs one target forward per pass over the new rows of every
running call. The request's own worker thread (``Job.run``) prepares it, joins the scheduler
(restoring the prefix cache under the pair's lock), blocks on the queue its Steps arrive on, and
leaves (saving the verified state), as ``ChatSpecDecode._astream`` arranges for LangChain; its
deltas reach the event loop through an ``asyncio.Queue`` (``loop.call_soon_threadsafe``). The
server's executor has a thread for every request ``Admission`` lets in, so an admitted request never
waits for a thread, only for the lock between passes to join.

A consumer that goes away (the client disconnected) sets ``Job.cancelled``: the call leaves after
the pass in progress and closes its stream in its own thread, which saves the verified part to the
prefix cache, as for any closed stream.

Events a job puts on its queue, in order: ("ready", None) once the request is prepared (or
("error", exc) instead), then ("delta", Delta) for each delta but the last, then ("finish",
(Delta, CallRecord)) once the stream is closed (the cache saved, the span ended), or ("closed", None)
after a cancelled decode, or ("error", exc).
"""

from __future__ import annotations

import asyncio
import enum
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.trace import SpanKind

from agentspec.chat import ChatCall, new_response_id, prepare_call
from agentspec.chat import run as run_call
from agentspec.chat.completion import prepare_completion
from agentspec.config import GenerationConfig
from agentspec.decode import CallRecord, ContextLengthExceeded, prefill
from agentspec.models import ModelPair
from agentspec.serve.protocol import (
    DEFAULT_TEMPERATURE,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
)
from agentspec.telemetry import Telemetry
from agentspec.telemetry.otel import CallInfo


@dataclass
class Engine:
    """What every request of one server shares: the pair, how it drafts, where calls are recorded."""

    pair: ModelPair
    model: str  # the name requests give as ``model`` and responses carry
    drafter: Any  # agentspec.stream's drafter (a name: built per call, learning per namespace)
    telemetry: Telemetry


def generation_config(body: GenerationRequest, index: int = 0) -> GenerationConfig:
    """Choice ``index``'s options: a seeded request's choices draw from seeds ``seed + index``, each
    keyed by position (``GenerationConfig.reproducible``), so the request gives the same n choices
    each time, whatever the drafters learned or the cache holds by then, choice i is the reply that
    seed + i gives alone, and the choices differ from one another."""
    temperature = body.temperature if body.temperature is not None else DEFAULT_TEMPERATURE
    limit = body.length_limit
    return GenerationConfig(
        max_new_tokens=limit if limit is not None else 1 << 30,  # cut to the context's room by fitted()
        temperature=temperature,
        top_p=body.top_p,
        top_k=body.top_k_or_none,
        stop=body.stop_strings,
        seed=None if body.seed is None else (body.seed + index) % 2**64,
        reproducible=body.seed is not None,
        logprobs=body.logprob_count,
        priority=body.priority,
    )


class SharedPrefill:
    """The prompt of one request's n choices, prefilled once (``agentspec.decode.prefill``) by the
    first choice's thread to get here; the others wait for it, then restore it from the prefix cache
    as the first does, and every choice decodes as it would alone."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.restored: int | None = None  # prompt tokens the cache held before the request

    def run(self, pair: ModelPair, ids: list[int], namespace: str | None) -> None:
        with self._lock:
            if self.restored is None:
                self.restored, _ = prefill(pair, ids, True, namespace)


def prepared(engine: Engine, body: ChatCompletionRequest, index: int = 0) -> ChatCall:
    """``body`` prepared as ``ChatSpecDecode`` prepares a call with the same messages and options
    (``agentspec.chat.prepare_call``: greedy replies are the same); what is wrong with it is an
    ``APIError`` 400."""
    try:
        return prepare_call(
            engine.pair,
            body.messages,
            generation_config(body, index),
            body.tools,
            body.tool_choice,
            body.response_format,
            parallel_tool_calls=body.parallel_tool_calls is not False,
        )
    except ContextLengthExceeded as exc:
        raise APIError(400, str(exc), param="messages", code="context_length_exceeded") from exc
    except (ValueError, TypeError, KeyError) as exc:  # the request's content, not the server
        raise APIError(400, f"{type(exc).__name__}: {exc}", param="messages") from exc


def prepared_completion(
    engine: Engine, body: CompletionRequest, prompt: str | list[int], index: int = 0
) -> ChatCall:
    """One of ``body``'s prompts prepared as it is (``agentspec.chat.completion``: no template, no
    grammar), with choice ``index``'s options; what is wrong with it is an ``APIError`` 400."""
    try:
        return prepare_completion(engine.pair, prompt, generation_config(body, index))
    except ContextLengthExceeded as exc:
        raise APIError(400, str(exc), param="prompt", code="context_length_exceeded") from exc
    except ValueError as exc:  # an empty prompt, an id outside the vocabulary
        raise APIError(400, str(exc), param="prompt") from exc


@dataclass(eq=False)  # one job is equal only to itself (the server keeps a set of them)
class Job:
    """One choice of a request: its call prepared and decoded by ``run`` on a worker thread, read by
    ``events`` on the loop. ``prepare`` makes the call (a chat request's or a completion's prompt, with
    the choice's options), on the worker thread: rendering and compiling a grammar keep the loop free."""

    engine: Engine
    prepare: Callable[[], ChatCall]  # the call to decode; what is wrong with the request: an APIError
    streamed: bool  # the client reads the reply as it comes (recorded on the span)
    namespace: str | None  # the tenant's prefix-cache namespace and drafting memory (None: shared)
    parent: Any  # the OpenTelemetry Context of the caller's traceparent (the span's parent)
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    closed_early: bool = False  # cancelled before the reply finished
    record: CallRecord | None = None  # the call's record, once its decode is closed
    conversation_id: str | None = None  # the caller's session (its X-Session-ID header), on the span
    request_id: str | None = None  # the request's X-Request-Id (taken or made), on the span too
    response_id: str = field(default_factory=new_response_id)  # the response's id, on the span too
    ended: asyncio.Future | None = None  # done when ``run`` has returned (``start``)
    index: int = 0  # the choice this job decodes, in the response
    shared: SharedPrefill | None = None  # with n > 1: the prompt's choices' one prefill
    call: ChatCall | None = None  # what it decodes, once prepared (set before "ready")

    def start(self, executor: Executor) -> asyncio.Future:
        """Run the request on a thread of ``executor``; the future is ``ended``."""
        self.ended = self.loop.run_in_executor(executor, self.run)
        return self.ended

    def run(self) -> None:
        """The whole request, in the calling (worker) thread; every outcome ends up on the queue."""
        try:
            self.call = self.prepare()
            self._put("ready", None)
            self._decode(self.call)
        except BaseException as exc:  # handed to the loop, which answers with it
            self._put("error", exc)

    def _put(self, kind: str, value: Any) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, value))

    def _decode(self, call: ChatCall) -> None:
        engine = self.engine
        if self.cancelled.is_set():  # gone before it joined (once joined, it leaves after a pass)
            self.closed_early = True
            self._put("closed", None)
            return
        info = CallInfo(
            engine.model,
            call.config,
            True,
            streamed=self.streamed,
            parent=self.parent,
            conversation_id=self.conversation_id,
            request_id=self.request_id,
            response_id=self.response_id,
            request=call.request,
            kind=SpanKind.SERVER,
        )
        trace = engine.telemetry.call(info)
        if self.shared is not None:
            self.shared.run(engine.pair, call.request.prompt.ids, self.namespace)
        deltas = run_call(call, engine.drafter, True, self.namespace, self.cancelled)
        last = None
        try:
            for delta in deltas:
                if delta.finish_reason is not None:
                    last = delta  # sent once the stream is closed, with the call's record
                    break
                self._put("delta", delta)
        except BaseException as exc:
            trace.fail(exc)
            raise
        finally:
            self.record = record = deltas.close()  # in this thread: leaves the scheduler, saves the cache
            trace.end(record)
        if last is None:  # cancelled
            self.closed_early = True
            self._put("closed", None)
        else:
            self._put("finish", (last, record))

    async def events(self) -> AsyncIterator[tuple[str, Any]]:
        """The job's events as the loop receives them, up to "finish" (none after a cancelled decode
        closed); leaving early cancels the decode. The last one comes once ``run`` has returned: the
        request's admission slot, freed when it does, is free before its client has the reply (a
        key at its share may send its next request at once)."""
        assert self.ended is not None, "the job was not started"
        try:
            while True:
                kind, value = await self.queue.get()
                if kind in ("finish", "closed", "error"):  # the last: run has only to return
                    await asyncio.wait({self.ended})  # (not cancelled with the consumer: it counts)
                if kind == "error":
                    raise value
                if kind == "closed":
                    return
                yield kind, value
                if kind == "finish":
                    return
        finally:
            self.cancelled.set()


class Verdict(enum.Enum):
    """What ``Admission.enter`` says of a request."""

    ADMITTED = "admitted"
    FULL = "full"  # the server holds ``limit`` requests: 503
    OVER_SHARE = "over_share"  # the request's key holds its share: 429, while other keys are served


class Admission:
    """The bound on requests in the server, counted in sequences: every admitted request decodes at
    once, a sequence in the pair's passes (``agentspec.scheduler``), so ``limit`` bounds the
    sequences running (and joining or leaving) on the pair.

    With ``keys`` API keys, a key holds at most ``share`` = ceil(limit / keys) of the slots (at
    least 1), computed rather than an option: a lone key (or a server without keys) may use every
    slot; with more keys one key leaves at least ``limit - share`` slots to the others; and the
    shares together cover the limit (a floor would leave the remainder idle while every key is at
    its share).

    Used from the event loop only (a job leaves in its future's done callback, which runs there).
    """

    def __init__(self, limit: int, keys: int = 0):
        if limit < 1:
            raise ValueError(f"the limit on running sequences must be >= 1, got {limit}")
        self.limit = limit
        self.share = max(1, -(-limit // max(keys, 1)))  # ceil(limit / keys)
        self.active = 0
        self.held: dict[str | None, int] = {}  # requests admitted, by tenant (None: no key)

    def enter(self, tenant: str | None, n: int = 1) -> Verdict:
        """Admit a request of ``tenant`` (its key's id; None without keys) with ``n`` sequences (its
        choices), or say why not. A full server is checked first: with one key or none the share
        is the whole limit, and a full server is the answer."""
        held = self.held.get(tenant, 0)
        if self.active + n > self.limit:
            return Verdict.FULL
        if held + n > self.share:
            return Verdict.OVER_SHARE
        self.active += n
        self.held[tenant] = held + n
        return Verdict.ADMITTED

    def leave(self, tenant: str | None) -> None:
        self.active -= 1
        self.held[tenant] -= 1
        if not self.held[tenant]:
            del self.held[tenant]  # a key with nothing in flight keeps no entry
