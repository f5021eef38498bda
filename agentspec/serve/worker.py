"""One request's decode on a worker thread of its own, handed to the event loop through a queue.

``agentspec.stream`` holds the pair's lock from its first step until it is closed, and the lock must
be released by the thread that took it; so a request's whole decode (prepare, stream, close) runs in
one worker thread (``Job.run``), as ``ChatSpecDecode._astream`` arranges for LangChain, and its
deltas reach the event loop through an ``asyncio.Queue`` (``loop.call_soon_threadsafe``). The
server's executor has a thread for every request ``Admission`` lets in, so an admitted request
never waits for a thread, only for the pair's lock: the queue in front of one pair is that lock's,
shared by every tenant by design.

A consumer that goes away (the client disconnected) sets ``Job.cancelled``: the worker stops after
the pass in progress and closes the stream in its own thread, which releases the lock and saves the
verified part to the prefix cache, as for any closed stream.

Events a job puts on its queue, in order: ("ready", None) once the request is prepared (or
("error", exc) instead), then ("delta", Delta) for each delta but the last, then ("finish",
(Delta, figures)) once the stream is closed (the cache saved, the span ended), or ("closed", None)
after a cancelled decode, or ("error", exc).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.trace import SpanKind

from agentspec.chat import Delta, PreparedRequest, new_response_id, prepare, reply_deltas
from agentspec.config import GenerationConfig
from agentspec.decode import Step, stream
from agentspec.grammar import Constraint
from agentspec.models import ModelPair
from agentspec.serve.protocol import DEFAULT_TEMPERATURE, APIError, ChatCompletionRequest
from agentspec.telemetry import Telemetry, baseline_seconds, cost_model


@dataclass
class Engine:
    """What every request of one server shares: the pair, how it drafts, where calls are recorded."""

    pair: ModelPair
    model: str  # the name requests give as ``model`` and responses carry
    drafter: Any  # agentspec.stream's drafter (a name: built per call, learning per namespace)
    telemetry: Telemetry


@dataclass
class Prepared:
    """A request ready for ``agentspec.stream``."""

    request: PreparedRequest
    config: GenerationConfig  # the request's options, its stop strings and the context's room applied
    grammar: Constraint | None


def generation_config(body: ChatCompletionRequest) -> GenerationConfig:
    temperature = body.temperature if body.temperature is not None else DEFAULT_TEMPERATURE
    limit = body.length_limit
    return GenerationConfig(
        max_new_tokens=limit if limit is not None else 1 << 30,  # cut to the context's room by fitted()
        temperature=temperature,
        top_p=body.top_p,
        stop=body.stop_strings,
        seed=body.seed,
    )


def prepared(engine: Engine, body: ChatCompletionRequest) -> Prepared:
    """``body`` prepared as ``ChatSpecDecode._prepare`` prepares a call with the same messages and
    options (so greedy replies are the same); what is wrong with it is an ``APIError`` 400."""
    pair = engine.pair
    try:
        request = prepare(
            pair.tokenizer,
            body.messages,
            body.tools,
            body.tool_choice,
            body.response_format,
            parallel_tool_calls=body.parallel_tool_calls is not False,
        )
        config = request.fitted(pair, generation_config(body))
        grammar = request.constraint(pair)
    except (ValueError, TypeError, KeyError) as exc:  # the request's content, not the server
        raise APIError(400, f"{type(exc).__name__}: {exc}", param="messages") from exc
    if len(request.prompt.ids) >= pair.max_context:
        raise APIError(
            400,
            f"the prompt has {len(request.prompt.ids)} tokens; this model's context is {pair.max_context}",
            param="messages",
            code="context_length_exceeded",
        )
    return Prepared(request, config, grammar)


@dataclass(eq=False)  # one job is equal only to itself (the server keeps a set of them)
class Job:
    """One request: prepared and decoded by ``run`` on a worker thread, read by ``events`` on the loop."""

    engine: Engine
    body: ChatCompletionRequest
    namespace: str | None  # the tenant's prefix-cache namespace and drafting memory (None: shared)
    parent: Any  # the OpenTelemetry Context of the caller's traceparent (the span's parent)
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    steps: list[Step] = field(default_factory=list)  # the passes seen so far
    closed_early: bool = False  # cancelled before the reply finished
    conversation_id: str | None = None  # the caller's session (its X-Session-ID header), on the span
    response_id: str = field(default_factory=new_response_id)  # the response's id, on the span too

    def run(self) -> None:
        """The whole request, in the calling (worker) thread; every outcome ends up on the queue."""
        try:
            call = prepared(self.engine, self.body)
            self._put("ready", None)
            self._decode(call)
        except BaseException as exc:  # handed to the loop, which answers with it
            self._put("error", exc)

    def _put(self, kind: str, value: Any) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, value))

    def _decode(self, call: Prepared) -> None:
        engine, pair = self.engine, self.engine.pair
        if self.cancelled.is_set():  # gone before its turn (once in the lock's queue, the first pass runs)
            self.closed_early = True
            self._put("closed", None)
            return
        trace = engine.telemetry.call(
            pair,
            engine.model,
            call.config,
            True,
            streamed=self.body.stream,
            parent=self.parent,
            conversation_id=self.conversation_id,
            response_id=self.response_id,
            request=call.request,
            kind=SpanKind.SERVER,
        )
        started = time.perf_counter()
        steps = trace.watch(
            stream(
                pair,
                call.request.prompt.ids,
                engine.drafter,
                True,
                call.grammar,
                self.namespace,
                config=call.config,
            )
        )
        last = None
        try:
            for delta in reply_deltas(call.request, self._watched(steps), started):
                if delta.finish_reason is not None:
                    last = delta  # sent once the stream is closed, with the call's final figures
                    break
                self._put("delta", delta)
        except BaseException as exc:
            trace.fail(exc)
            raise
        finally:
            steps.close()  # in this thread: releases the pair's lock, saves the verified part
            trace.end()
        measured = time.perf_counter() - started
        if last is None:  # cancelled
            self.closed_early = True
            self._put("closed", None)
        else:
            self._put("finish", (last, self._figures(trace.enabled, last, measured)))

    def _watched(self, steps: Iterable[Step]) -> Iterator[Step]:
        for step in steps:
            self.steps.append(step)
            yield step
            if self.cancelled.is_set():
                return

    def _figures(self, traced: bool, last: Delta, measured: float) -> dict[str, Any]:
        """The longest draft and the latency-saved estimate (``agentspec.telemetry.latency``): the
        baseline (plain decoding, no cache) minus ``measured``, the time inside the decoder from the
        first step's request to the close, the wait for the pair's lock included, as on the span."""
        cost = cost_model(self.engine.pair)
        if not traced:  # a traced call's passes taught the estimate in trace.end(); teach it here
            cost.refresh(self.steps)
        baseline = baseline_seconds(cost, last.stats)
        return {
            "longest_draft": max((s.drafted for s in self.steps), default=0),
            "latency_saved_s": baseline - measured,
            "baseline_s": baseline,
            "decode_s": measured,
            "cost_source": cost.source,
        }

    async def events(self) -> AsyncIterator[tuple[str, Any]]:
        """The job's events as the loop receives them, up to "finish" (none after a cancelled decode
        closed); leaving early cancels the decode."""
        try:
            while True:
                kind, value = await self.queue.get()
                if kind == "error":
                    raise value
                if kind == "closed":
                    return
                yield kind, value
                if kind == "finish":
                    return
        finally:
            self.cancelled.set()


class Admission:
    """The bound on requests in the server: one decoding and ``queue_size`` waiting for the pair.

    Used from the event loop only (a job leaves in its future's done callback, which runs there).
    """

    def __init__(self, queue_size: int):
        if queue_size < 0:
            raise ValueError(f"queue_size must be >= 0, got {queue_size}")
        self.limit = queue_size + 1
        self.active = 0

    def enter(self) -> bool:
        if self.active >= self.limit:
            return False
        self.active += 1
        return True

    def leave(self) -> None:
        self.active -= 1
