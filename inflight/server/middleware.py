"""ASGI middleware: a cap on request body size (413 with OpenAI's error body).

Pure ASGI rather than Starlette's ``BaseHTTPMiddleware``, which would buffer streamed
responses and hide client disconnects from the routes.
"""

from __future__ import annotations

import json

from inflight.server.errors import error_body


class BodySizeLimitMiddleware:
    """Rejects bodies over ``max_bytes``: at once when ``Content-Length`` says so, else
    while reading a chunked body. The accepted body is replayed to the app, and later
    ``receive()`` calls (disconnect notices) pass through.
    """

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
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

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, send) -> None:
        await _reply(send, 413, f"request body exceeds {self.max_bytes} bytes",
                     code="request_too_large")


async def _reply(send, status: int, message: str, code: str | None = None) -> None:
    payload = json.dumps(error_body(message, "invalid_request_error", None, code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": payload})
