"""``X-Request-Id`` on every response: the id the request carried, or one made for it.

vLLM does the same behind ``--enable-request-id-headers`` (``XRequestIdMiddleware`` in
``vllm/entrypoints/serve/middleware/x_request_id.py``): a uuid4 in hex when the request has none.
The id is made when the request arrives and kept in its ASGI scope, so whatever answers it (a
route, an error handler) reads the same id the response carries.
"""

from __future__ import annotations

import uuid
from typing import Any

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = "X-Request-Id"
SCOPE_KEY = "agentspec.request_id"  # where the request's id waits in its scope


def of(scope: Scope | dict[str, Any]) -> str | None:
    """The id of the request ``scope`` belongs to (None: it never reached the middleware)."""
    return scope.get(SCOPE_KEY)


def header(scope: Scope | dict[str, Any]) -> dict[str, str]:
    """The ``X-Request-Id`` header of the request ``scope`` belongs to, for a response sent around
    the middleware (FastAPI sends an unhandled exception's 500 from outside every middleware); none
    when the request never reached the middleware."""
    given = scope.get(SCOPE_KEY)
    return {HEADER: given} if given else {}


class RequestIdMiddleware:
    """Adds ``X-Request-Id`` to the start of every HTTP response. Plain ASGI rather than Starlette's
    ``BaseHTTPMiddleware``: only the start message is touched and every body message passes as it
    was sent, so a streamed reply (SSE) reaches its client chunk by chunk, and ``receive`` is the
    server's own (a route that waits for the client's disconnect still sees it)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan
            await self.app(scope, receive, send)
            return
        request_id = Headers(scope=scope).get(HEADER) or uuid.uuid4().hex
        scope[SCOPE_KEY] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message).append(HEADER, request_id)
            await send(message)

        await self.app(scope, receive, send_with_id)
