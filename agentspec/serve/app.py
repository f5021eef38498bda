"""The FastAPI app: OpenAI's chat-completions and completions APIs over one model pair (``create_app``).

Routes: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (whole or streamed as SSE),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus), and vLLM's ``POST /tokenize`` and
``/detokenize`` (``tokenize``). Every response carries ``X-Request-Id``, the request's own or one
made for it (``request_id``). With API keys, every route but ``/health`` wants ``Authorization:
Bearer <key>`` (401 otherwise, as vLLM's ``--api-key``).

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

Both completion routes run the same way: each choice is a ``worker.Job`` decoding a prepared
``ChatCall`` (a chat request's, or a completion's prompt as it is), admitted together
(``Server.admit``), their events merged into one response or one stream (``answer``); only the
shape of the replies is the route's own (``replies.ChatForm``, ``replies.TextForm``).

Errors have OpenAI's body, ``{"error": {"message", "type", "param", "code"}}``: 400 for a request
that cannot be served as sent (FastAPI's 422 included: OpenAI clients expect 400), 401, 404 for
another model's name, 429 for a key over its share, 503 for a full server, 500 for a failure while
decoding (inside a stream: an error event, its status line being already sent).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import propagate
from starlette.exceptions import HTTPException as StarletteHTTPException

from agentspec.chat import ChatCall, new_response_id
from agentspec.models import ModelPair
from agentspec.serve import protocol as P
from agentspec.serve import request_id, tokenize
from agentspec.serve.metrics import CONTENT_TYPE, ServerMetrics
from agentspec.serve.replies import ChatForm, Form, Metrics, Reply, TextForm, take
from agentspec.serve.worker import (
    Admission,
    Engine,
    Job,
    SharedPrefill,
    Verdict,
    prepared,
    prepared_completion,
)
from agentspec.telemetry import Telemetry

log = logging.getLogger(__name__)

# sequences running on the pair at once: room for 16 concurrent agent sessions
DEFAULT_MAX_NUM_SEQS = 16
SESSION_HEADER = "x-session-id"  # the caller's conversation id, as routers read it for session affinity
RETRY_AFTER_S = 1  # a full server's (or a key's full share's) hint: a request decodes in seconds here
Prepare = Callable[[int], ChatCall]  # one prompt's call for choice j of its n (j: the seed's offset)


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

    def admit(
        self,
        body: P.GenerationRequest,
        request: Request,
        tenant: str | None,
        prompts: Sequence[Prepare],
        response_id: str,
    ) -> list[Job]:
        """The request's jobs, ``body.n`` per prompt (``prompts``: each one's call for choice ``j`` of
        its n), started on worker threads; 400/404/429/503 when they cannot be. Choice ``j`` of
        prompt ``p`` is the response's choice ``p * n + j``, and a prompt's choices share its prefill."""
        bad = body.unsupported()
        if bad is not None:
            raise P.APIError(400, f"{bad} is not supported by this server", param=bad, code="unsupported")
        if body.model is not None and body.model != self.engine.model:
            raise P.APIError(
                404, f"The model `{body.model}` does not exist.", param="model", code="model_not_found"
            )
        n, sequences = body.n, body.n * len(prompts)
        if sequences > self.admission.share:  # it could never be admitted: not a matter of retrying
            most = f"this server decodes at most {self.admission.share} sequences per key"
            what, param = (
                (f"n={n}", "n") if len(prompts) == 1 else (f"{len(prompts)} prompts, n={n}", "prompt")
            )
            raise P.APIError(400, f"{what}: {most}", param=param)
        self._enter(tenant, sequences)
        loop = asyncio.get_running_loop()
        jobs = []
        for p, prepare in enumerate(prompts):
            shared = SharedPrefill() if n > 1 else None
            for j in range(n):
                self.metrics.admitted()
                job = Job(
                    self.engine,
                    functools.partial(prepare, j),
                    body.stream,
                    namespace(tenant, body.cache_salt),
                    propagate.extract(request.headers),
                    loop,
                    conversation_id=request.headers.get(SESSION_HEADER) or None,
                    request_id=request_id.of(request.scope),
                    response_id=response_id,
                    index=p * n + j,
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

    def finished(self, reply: Reply, started: float) -> dict[str, Any]:
        """The response's ``metrics`` of a finished reply (a choice), counted in ``/metrics`` too."""
        metrics = reply.metrics()
        spec_steps = metrics["speculative_decoding"]["num_spec_steps"]
        duration = time.perf_counter() - started
        self.metrics.decoded(reply.last.stats, spec_steps, reply.record.latency_saved_s, duration)
        return metrics

    def close(self) -> None:
        """Stop every decode after its pass in progress (each saves its verified part) and wait."""
        for job in list(self.jobs):
            job.cancelled.set()
        self.executor.shutdown(wait=True)


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


async def answer(
    server: Server, jobs: list[Job], request: Request, form: Form, streamed: bool
) -> dict[str, Any] | StreamingResponse:
    """The response to a request whose ``jobs`` (its choices) were admitted, shaped by its route's
    ``form``: once every job's call is prepared (an error in preparing one is raised here, before
    any status line is sent, and cancels the others), the whole response or its stream of events."""
    streams = [job.events() for job in jobs]
    try:
        for events in streams:
            await _first(events)
    except BaseException:
        for events in streams:  # the other choices' jobs are cancelled
            await events.aclose()
        raise
    replies = [form.reply(job) for job in jobs]
    if streamed:
        server.metrics.answered(200)
        return StreamingResponse(_sse(form, replies, streams), media_type="text/event-stream")
    await _whole(jobs, replies, streams, request)
    response = form.whole(replies)
    server.metrics.answered(200)
    return response


async def _whole(
    jobs: list[Job], replies: list[Reply], streams: list[AsyncIterator], request: Request
) -> None:
    """Every choice's events taken into its reply, to the end; a client that goes away cancels the jobs."""
    watcher = asyncio.ensure_future(_until_disconnected(request, jobs))
    merged = _merged(streams)
    try:
        async for index, kind, value in merged:
            take(replies[index], kind, value)
    finally:
        watcher.cancel()
        await _close(merged, streams)
    if any(r.record is None for r in replies):  # the client went away: nobody reads this
        raise P.APIError(499, "the client closed the request", code="client_closed")


async def _sse(form: Form, replies: list[Reply], streams: list[AsyncIterator]) -> AsyncIterator[str]:
    """The reply's choices as SSE events; a client that goes away cancels this generator, and so
    the jobs."""
    merged = _merged(streams)
    try:
        for reply in replies:
            for event in form.start(reply):
                yield event
        async for index, kind, value in merged:
            for event in form.events(replies[index], kind, value):
                yield event
        for event in form.end(replies):
            yield event
    except P.APIError as exc:
        yield P.Events.error(exc)
    except Exception as exc:
        log.exception("decoding failed mid-stream")
        yield P.Events.error(P.APIError(500, f"{type(exc).__name__}: {exc}", type="server_error"))
    finally:
        await _close(merged, streams)


async def _close(merged: AsyncIterator, streams: list[AsyncIterator]) -> None:
    """Close the merged events (their pumps stop, each closing its choice's events) and then every
    choice's events, those no pump ran included: each job left running is cancelled."""
    await merged.aclose()
    for events in streams:
        await events.aclose()


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

    def finished(started: float) -> Metrics:
        return lambda reply: server.finished(reply, started)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(
        body: P.ChatCompletionRequest, request: Request, who: str | None = Depends(tenant)
    ) -> Any:
        started = time.perf_counter()
        prompt = functools.partial(prepared, server.engine, body)
        jobs = server.admit(body, request, who, [prompt], new_response_id())
        form = ChatForm(jobs, body, server.engine.model, finished(started))
        return await answer(server, jobs, request, form, body.stream)

    @app.post("/v1/completions", response_model=None)
    async def completions(
        body: P.CompletionRequest, request: Request, who: str | None = Depends(tenant)
    ) -> Any:
        started = time.perf_counter()
        prompts = [functools.partial(prepared_completion, server.engine, body, p) for p in body.prompts]
        jobs = server.admit(body, request, who, prompts, f"cmpl-{uuid.uuid4().hex}")
        form = TextForm(jobs, body, server.engine.model, finished(started))
        return await answer(server, jobs, request, form, body.stream)


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
