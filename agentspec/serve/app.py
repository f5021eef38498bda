"""The FastAPI app: OpenAI's chat-completions API over one model pair (``create_app``).

Routes: ``POST /v1/chat/completions`` (whole or streamed as SSE), ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (Prometheus), and vLLM's ``POST /tokenize`` and ``/detokenize`` (``tokenize``). Every
response carries ``X-Request-Id``, the request's own or one made for it (``request_id``). With API
keys, every route but ``/health`` wants ``Authorization: Bearer <key>`` (401 otherwise, as vLLM's
``--api-key``).

Tenants: each API key, and within it each request's ``cache_salt`` (vLLM's field), is a namespace
of its own for the prefix cache and the drafting memory (``agentspec.stream``'s ``namespace``), so
one tenant's prompts never speed up another's calls nor show through their timing. Requests without
a key or a salt share the default namespace, as in-process calls do.

Admission counts sequences: every admitted request decodes at once, its call a sequence sharing the
pair's passes with the others (``agentspec.scheduler``). ``max_num_seqs`` (vLLM's name) bounds them,
and a request past it gets 503 with ``Retry-After``. With API keys, one key holds at most its share
of those slots, ceil(max_num_seqs / number of keys) (``worker.Admission``): a request past its key's
share gets 429 with ``Retry-After``, while the other keys' requests are admitted.

Tracing: the W3C ``traceparent`` (and ``tracestate``) of a request is the parent of the call's span
(``agentspec.telemetry``), so the span joins the caller's trace. Usage is counted on this side, in
the span's metrics and in ``/metrics``; a client must not count the same tokens again.

Errors have OpenAI's body, ``{"error": {"message", "type", "param", "code"}}``: 400 for a request
that cannot be served as sent (FastAPI's 422 included: OpenAI clients expect 400), 401, 404 for
another model's name, 429 for a key over its share, 503 for a full server, 500 for a failure while
decoding (inside a stream: an error event, its status line being already sent).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import propagate
from starlette.exceptions import HTTPException as StarletteHTTPException

from agentspec.chat import Delta, new_response_id, speculative_metadata
from agentspec.decode import CallRecord
from agentspec.models import ModelPair
from agentspec.serve import protocol as P
from agentspec.serve import request_id, tokenize
from agentspec.serve.metrics import CONTENT_TYPE, ServerMetrics
from agentspec.serve.worker import Admission, Engine, Job, SharedPrefill, Verdict
from agentspec.telemetry import Telemetry

log = logging.getLogger(__name__)

# sequences running on the pair at once: room for the 16 concurrent agent sessions
DEFAULT_MAX_NUM_SEQS = 16
SESSION_HEADER = "x-session-id"  # the caller's conversation id, as routers read it for session affinity
RETRY_AFTER_S = 1  # a full server's (or a key's full share's) hint: a request decodes in seconds here


def key_id(key: str) -> str:
    """A tenant's name for an API key: its hash, so the key itself is kept nowhere but in the check."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def namespace(tenant: str | None, salt: str | None) -> str | None:
    """The prefix-cache namespace and drafting memory of a key's tenant and a request's salt (None:
    the shared default). A salt under one key never meets the same salt under another."""
    return None if tenant is None and salt is None else json.dumps([tenant, salt])


class Server:
    """One app's state: the engine, the keys, the bound on sequences, the executor, the metrics."""

    def __init__(self, engine: Engine, api_keys: Sequence[str], max_num_seqs: int):
        self.engine = engine
        self.keys = {key_id(k): k for k in api_keys if k}
        self.admission = Admission(max_num_seqs, len(self.keys))
        pair = engine.pair
        self.metrics = ServerMetrics(engine.model, pair.tenants, pair.scheduler.stats)
        # a thread for every admitted request: none waits for a thread, only for its turn to join
        self.executor = ThreadPoolExecutor(self.admission.limit, thread_name_prefix="agentspec-decode")
        self.jobs: set[Job] = set()
        self.started = int(time.time())

    def tenant(self, authorization: str | None) -> str | None:
        """The tenant an ``Authorization`` header names (None: no keys are required); 401 otherwise."""
        if not self.keys:
            return None
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() == "bearer" and given:
            for tenant, key in self.keys.items():
                if hmac.compare_digest(given.strip().encode(), key.encode()):
                    return tenant
        raise P.APIError(
            401,
            "Missing or incorrect API key: send Authorization: Bearer <key>",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )

    def admit(self, body: P.ChatCompletionRequest, request: Request, tenant: str | None) -> list[Job]:
        """The request's jobs, one per choice, started on worker threads; 400/404/429/503 when they
        cannot be."""
        bad = body.unsupported()
        if bad is not None:
            raise P.APIError(400, f"{bad} is not supported by this server", param=bad, code="unsupported")
        if body.model is not None and body.model != self.engine.model:
            raise P.APIError(
                404, f"The model `{body.model}` does not exist.", param="model", code="model_not_found"
            )
        if body.n > self.admission.share:  # it could never be admitted: not a matter of retrying
            most = f"this server decodes at most {self.admission.share} sequences per key"
            raise P.APIError(400, f"n={body.n}: {most}", param="n")
        self._enter(tenant, body.n)
        loop = asyncio.get_running_loop()
        shared = SharedPrefill() if body.n > 1 else None
        response_id = new_response_id()
        jobs = []
        for index in range(body.n):
            self.metrics.admitted()
            job = Job(
                self.engine,
                body,
                namespace(tenant, body.cache_salt),
                propagate.extract(request.headers),
                loop,
                conversation_id=request.headers.get(SESSION_HEADER) or None,
                response_id=response_id,
                index=index,
                shared=shared,
            )
            self.jobs.add(job)
            job.start(self.executor).add_done_callback(lambda _, job=job: self._left(job, tenant))
            jobs.append(job)
        return jobs

    def _enter(self, tenant: str | None, n: int) -> None:
        """Count the request in ``admission``; 503 when the server is full, 429 when its key is over
        its share (both with ``Retry-After``: a slot frees when a request finishes)."""
        verdict = self.admission.enter(tenant, n)
        retry = {"Retry-After": str(RETRY_AFTER_S)}
        if verdict is Verdict.FULL:
            raise P.APIError(
                503,
                f"the server is full ({self.admission.limit} requests decoding); retry later",
                type="server_error",
                code="queue_full",
                headers=retry,
            )
        if verdict is Verdict.OVER_SHARE:  # OpenAI's type and code for a rate limit
            share = self.admission.share
            raise P.APIError(
                429,
                f"this API key has {share} requests decoding, its share of the server's "
                f"{self.admission.limit}; retry when one of them finishes",
                type="requests",
                code="rate_limit_exceeded",
                headers=retry,
            )

    def _left(self, job: Job, tenant: str | None) -> None:
        self.jobs.discard(job)
        self.admission.leave(tenant)
        self.metrics.left(job.closed_early)

    def finished(self, reply: Reply, last: Delta, record: CallRecord, started: float) -> dict[str, Any]:
        """The response's ``metrics`` of a finished reply (a choice), counted in ``/metrics`` too."""
        metrics = reply.metrics(last, record)
        spec_steps = metrics["speculative_decoding"]["num_spec_steps"]
        duration = time.perf_counter() - started
        self.metrics.decoded(last.stats, spec_steps, record.latency_saved_s, duration)
        return metrics

    def close(self) -> None:
        """Stop every decode after its pass in progress (each saves its verified part) and wait."""
        for job in list(self.jobs):
            job.cancelled.set()
        self.executor.shutdown(wait=True)


class Reply:
    """A reply (one choice) being put together from its deltas: content, valid calls, invalid calls."""

    def __init__(self, index: int = 0) -> None:
        self.index = index
        self.text: list[str] = []
        self.calls: list[dict] = []
        self.invalid: list[dict] = []  # not OpenAI's: reported under metrics.agentspec
        self.logprobs: list[dict] | None = None  # OpenAI's entries, when the request asked
        self.last: Delta | None = None  # the delta with the finish reason, once it came
        self.record: CallRecord | None = None  # the choice's record, once its decode is closed

    def add(self, delta: Delta) -> list[dict]:
        """Take ``delta``; returns its valid calls, each with its index among the reply's valid calls."""
        self.text.append(delta.text)
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs
        fresh = []
        for call in delta.calls:
            if "error" in call:
                self.invalid.append(call)
            else:
                fresh.append((len(self.calls), call))
                self.calls.append(call)
        return fresh

    def finish_reason(self, delta: Delta) -> str:
        return P.finish_reason(delta.finish_reason or "stop", self.calls)

    def choice(self) -> dict[str, Any]:
        assert self.last is not None
        text, reason = "".join(self.text), self.finish_reason(self.last)
        return P.choice(self.index, text, self.calls, reason, self.logprobs)

    def metrics(self, delta: Delta, record: CallRecord) -> dict[str, Any]:
        """The response's ``metrics``: the call's record, as the span reports it."""
        stats = delta.stats
        own = {
            **speculative_metadata(stats),
            "cached_tokens": stats.cached_tokens,
            "prefill_tokens": stats.prefill_tokens,
            "forced_tokens": stats.forced_tokens,
            "time_to_first_token_s": stats.time_to_first_token_s,
            "latency_saved_s": record.latency_saved_s,
            "baseline_s": record.baseline_s,
            "decode_s": record.decode_s,
            "cost_source": record.cost_source,
        }
        if self.invalid:
            own["invalid_tool_calls"] = self.invalid
        return {
            "speculative_decoding": P.speculative_decoding(stats, record.longest_draft),
            "agentspec": own,
        }


def usage(jobs: list[Job], replies: list[Reply]) -> dict[str, Any]:
    """The request's usage: its prompt once, every choice's tokens, and the prompt tokens the prefix
    cache held before it (with n > 1: before the choices' one prefill)."""
    stats = replies[0].last.stats
    shared = jobs[0].shared
    cached = shared.restored if shared is not None else None
    return P.usage(stats, sum(r.last.stats.output_tokens for r in replies), cached)


async def _first(events: AsyncIterator) -> None:
    """Wait for the job's "ready" (an error in preparing the request is raised here, before any
    status line is sent)."""
    try:
        await anext(events)
    except BaseException:
        await events.aclose()
        raise


async def _until_disconnected(request: Request, jobs: list[Job]) -> None:
    """Cancel ``jobs`` when the client of a whole (not streamed) reply goes away."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    for job in jobs:
        job.cancelled.set()


async def _pump(index: int, events: AsyncIterator, queue: asyncio.Queue) -> None:
    """Choice ``index``'s events onto ``queue`` as (index, kind, value), then (index, None, None);
    its error as (index, "error", exc). Closing the events on the way out cancels its job."""
    try:
        async for kind, value in events:
            await queue.put((index, kind, value))
        await queue.put((index, None, None))
    except Exception as exc:
        await queue.put((index, "error", exc))
    finally:
        await events.aclose()


async def _merged(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, str, Any]]:
    """The choices' events as they come, each with its choice's index; the first error is raised,
    and leaving (done, failed or cancelled) closes every choice's events, which cancels its job."""
    queue: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.ensure_future(_pump(i, events, queue)) for i, events in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, kind, value = await queue.get()
            if kind is None:
                running -= 1
            elif kind == "error":
                raise value
            else:
                yield index, kind, value
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _take(reply: Reply, kind: str, value: Any) -> tuple[Delta, list]:
    """A job's "delta" or "finish" event taken into its reply: (the delta, its fresh valid calls)."""
    delta, record = value if kind == "finish" else (value, None)
    calls = reply.add(delta)
    if record is not None:
        reply.last, reply.record = delta, record
    return delta, calls


async def _whole(server: Server, jobs: list[Job], request: Request, started: float) -> dict[str, Any]:
    replies = [Reply(job.index) for job in jobs]
    streams = [job.events() for job in jobs]
    watcher = asyncio.ensure_future(_until_disconnected(request, jobs))
    merged = _merged(streams)
    try:
        for events in streams:
            await _first(events)
        async for index, kind, value in merged:
            _take(replies[index], kind, value)
    finally:
        watcher.cancel()
        await _close(merged, streams)
    if any(r.record is None for r in replies):  # the client went away: nobody reads this
        raise P.APIError(499, "the client closed the request", code="client_closed")
    metrics = [server.finished(r, r.last, r.record, started) for r in replies]
    choices = [r.choice() for r in replies]
    # with n > 1 the metrics are the first choice's (each choice is counted in /metrics)
    return P.completion(jobs[0].response_id, server.engine.model, choices, usage(jobs, replies), metrics[0])


async def _sse(
    server: Server, jobs: list[Job], streams: list[AsyncIterator], chunks: P.Chunks, started: float
) -> AsyncIterator[str]:
    """The reply's choices as SSE events; a client that goes away cancels this generator, and so
    the jobs."""
    replies = [Reply(job.index) for job in jobs]
    merged = _merged(streams)
    try:
        for reply in replies:
            yield chunks.start(reply.index)
        async for index, kind, value in merged:
            for event in _events(server, chunks, replies[index], kind, value, started):
                yield event
        for event in chunks.end(usage(jobs, replies)):
            yield event
    except P.APIError as exc:
        yield chunks.error(exc)
    except Exception as exc:
        log.exception("decoding failed mid-stream")
        yield chunks.error(P.APIError(500, f"{type(exc).__name__}: {exc}", type="server_error"))
    finally:
        await _close(merged, streams)


async def _close(merged: AsyncIterator, streams: list[AsyncIterator]) -> None:
    """Close the merged events (their pumps stop, each closing its choice's events) and then every
    choice's events, those no pump ran included: each job left running is cancelled."""
    await merged.aclose()
    for events in streams:
        await events.aclose()


def _events(server: Server, chunks: P.Chunks, reply: Reply, kind: str, value: Any, started: float) -> list:
    """The SSE events of one of a choice's job events; its log-probabilities ride on the first."""
    delta, calls = _take(reply, kind, value)
    out, logprobs, i = [], delta.logprobs, reply.index
    if delta.text:
        out.append(chunks.text(delta.text, i, logprobs))
        logprobs = None
    if calls:
        out.append(chunks.calls([c for _, c in calls], calls[0][0], i, logprobs))
        logprobs = None
    if reply.record is not None:
        metrics = server.finished(reply, delta, reply.record, started)
        out.append(chunks.finish(reply.finish_reason(delta), metrics, i, logprobs))
    elif logprobs:  # tokens whose text is held back still: their entries come now
        out.append(chunks.text("", i, logprobs))
    return out


def _routes(app: FastAPI, server: Server) -> None:
    def tenant(request: Request) -> str | None:
        return server.tenant(request.headers.get("authorization"))

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models", dependencies=[Depends(tenant)])
    async def models() -> dict:
        card = {
            "id": server.engine.model,
            "object": "model",
            "created": server.started,
            "owned_by": "agentspec",
            "max_model_len": server.engine.pair.max_context,
        }
        return {"object": "list", "data": [card]}

    @app.get("/metrics", dependencies=[Depends(tenant)])
    async def metrics() -> Response:
        return Response(server.metrics.exposition(), media_type=CONTENT_TYPE)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(
        body: P.ChatCompletionRequest, request: Request, who: str | None = Depends(tenant)
    ) -> Any:
        started = time.perf_counter()
        jobs = server.admit(body, request, who)
        if not body.stream:
            response = await _whole(server, jobs, request, started)
            server.metrics.answered(200)
            return response
        streams = [job.events() for job in jobs]
        try:
            for events in streams:
                await _first(events)
        except BaseException:
            for events in streams:  # the other choices' jobs are cancelled
                await events.aclose()
            raise
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        chunks = P.Chunks(jobs[0].response_id, server.engine.model, include_usage)
        server.metrics.answered(200)
        replies = _sse(server, jobs, streams, chunks, started)
        return StreamingResponse(replies, media_type="text/event-stream")


def _error_handlers(app: FastAPI, server: Server) -> None:
    def answer(exc: P.APIError) -> JSONResponse:
        server.metrics.answered(exc.status)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(P.APIError)
    async def api_error(request: Request, exc: P.APIError) -> JSONResponse:
        return answer(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        where = f" ({param})" if param else ""
        return answer(P.APIError(400, f"{first.get('msg', 'invalid request')}{where}", param=param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return answer(P.APIError(exc.status_code, str(exc.detail), type=kind))

    @app.exception_handler(Exception)
    async def failed(request: Request, exc: Exception) -> JSONResponse:
        log.exception("request failed")
        # sent from outside every middleware (FastAPI's last resort), so the id is added here
        headers = request_id.header(request.scope)
        return answer(P.APIError(500, f"{type(exc).__name__}: {exc}", type="server_error", headers=headers))


def create_app(
    pair: ModelPair,
    *,
    api_keys: Sequence[str] = (),
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
    drafter: Any = "auto",
    model_name: str | None = None,
    tracer_provider: Any = None,
    meter_provider: Any = None,
) -> FastAPI:
    """An OpenAI-compatible app over ``pair`` (see the module doc).

    ``api_keys``: the keys a request may bear (none: no key is asked for), each holding at most
    ceil(max_num_seqs / len(api_keys)) requests at once; ``max_num_seqs``: the requests admitted at
    once, each a sequence running in the pair's passes (vLLM's option of that name); ``drafter``:
    ``agentspec.stream``'s, as ``ChatSpecDecode`` takes it; ``model_name``: the name requests give
    and responses carry (default: the pair's); ``tracer_provider`` / ``meter_provider``: where
    calls are recorded (None: the global ones).
    """
    engine = Engine(pair, model_name or pair.name, drafter, Telemetry(tracer_provider, meter_provider))
    server = Server(engine, api_keys, max_num_seqs)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await asyncio.get_running_loop().run_in_executor(None, server.close)

    # no /docs or /openapi.json: every route but /health is behind the keys
    app = FastAPI(title="agentspec", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.server = server
    _routes(app, server)
    tokenize.register(app, engine, server.tenant)
    _error_handlers(app, server)
    app.add_middleware(request_id.RequestIdMiddleware)
    return app
