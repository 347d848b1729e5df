"""ASGI middleware: the API key check, admission under overload and a cap on request body
size (401, 503 and 413 with OpenAI's error body), all before the body is parsed.

Pure ASGI rather than Starlette's ``BaseHTTPMiddleware``, which would buffer streamed
responses and hide client disconnects from the routes.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from inflight.errors import EngineError
from inflight.server.error_responses import error_body, to_openai
from inflight.server.tenants import TenantKeys


class ApiKeyMiddleware:
    """401 unless ``Authorization: Bearer <key>`` with one of ``keys`` on the paths
    ``protected(path)`` names; the key's tenant goes to the route as ``request.state.tenant``
    (``server/tenants.py``).

    Checked ahead of the route, so a wrong key gets 401 whatever the body holds (malformed
    JSON, a huge body): a route dependency would run only after FastAPI parsed the body,
    and its 400 or 413 would tell an unauthenticated client about the API (vLLM checks
    the key in a middleware too).
    """

    def __init__(self, app: ASGIApp, keys: TenantKeys, protected: Callable[[str], bool]) -> None:
        self.app = app
        self.keys = keys
        self.protected = protected

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.protected(scope["path"]):
            got = dict(scope.get("headers") or ()).get(b"authorization", b"")
            tenant = self.keys.tenant(got)
            scope.setdefault("state", {})["tenant"] = tenant
            if tenant is None:
                await _reply(send, 401, "Incorrect or missing API key (send Authorization: "
                             "Bearer <key>).", code="invalid_api_key",
                             headers=[(b"www-authenticate", b"Bearer")])
                return
        await self.app(scope, receive, send)


class AdmissionMiddleware:
    """503 (``Retry-After``) for a generation request while the engine has no room for even
    one more sequence, before its body is read: under a burst, refusals cost a lock and a
    few comparisons instead of JSON parsing, validation, templating and tokenizing, and do
    not wait behind the accepted requests' work. The route's own ``reserve`` still decides
    for the request's real size (``n``, several prompts) once the body is parsed.

    Args:
        app: the ASGI app.
        refusal: ``AsyncEngine.refusal``: the error a one-sequence request would get now,
            else None.
        paths: the routes that queue sequences.
    """

    def __init__(self, app: ASGIApp, refusal: Callable[[], EngineError | None],
                 paths: frozenset[str]) -> None:
        self.app = app
        self.refusal = refusal
        self.paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in self.paths:
            error = self.refusal()
            if error is not None:
                await to_openai(error).response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    """Rejects bodies over ``max_bytes``: at once when ``Content-Length`` says so, else
    while reading a chunked body. The accepted body is replayed to the app, and later
    ``receive()`` calls (disconnect notices) pass through.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                await _reply(send, 400, "invalid Content-Length header")
                return
            if declared > self.max_bytes:
                await self._too_large(send)
                return
        body = bytearray()
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                return
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                await self._too_large(send)
                return
            more = message.get("more_body", False)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, send: Send) -> None:
        await _reply(send, 413, f"request body exceeds {self.max_bytes} bytes",
                     code="request_too_large")


async def _reply(send: Send, status: int, message: str, code: str | None = None,
                 headers: list[tuple[bytes, bytes]] | None = None) -> None:
    # Serialised as Starlette's JSONResponse does, so every error body reads the same.
    payload = json.dumps(error_body(message, "invalid_request_error", None, code), ensure_ascii=False,
                         separators=(",", ":")).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode()),
                            (b"connection", b"close"), *(headers or [])]})
    await send({"type": "http.response.body", "body": payload})
