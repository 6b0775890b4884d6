"""The request gate: ASGI middleware that runs before any route sees a request.

Owns: the API key check on ``/v1/*`` and the API's own description (``/docs``, ``/redoc``,
``/openapi.json``) (401), the request body size limit (413), and reading
the body once (bounded) so that the app never buffers more than the limit. Never: parsing
the body, or anything on routes outside ``/v1`` except the size limit.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from longctx.entrypoints.server.errors import APIError

# A client that announces a body larger than this is answered without reading it; up to it,
# the body is read and dropped first, so the client gets the 413 instead of a reset socket.
DRAIN_FACTOR = 8
DOC_PATHS = ("/docs", "/redoc", "/openapi.json")  # behind the key too: they map the whole API


class RequestGate:
    def __init__(self, app: ASGIApp, *, api_key: str, max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key.encode()
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        guarded = scope["path"].startswith("/v1") or scope["path"].startswith(DOC_PATHS)
        if self.api_key and guarded and not self._authorized(headers):
            await _reply(APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                  code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}),
                         scope, receive, send)
            return
        try:
            declared = int(headers.get(b"content-length", b"0"))
        except ValueError:
            await _reply(APIError(400, "the Content-Length header is not a number"), scope, receive, send)
            return
        if declared > self.max_body_bytes:
            if declared <= DRAIN_FACTOR * self.max_body_bytes:
                await _drain(receive)
            await _reply(self._too_large(), scope, receive, send)
            return
        body, complete = await self._read_body(receive)
        if body is None:
            if complete:  # over the limit (chunked upload): read the rest, then say so
                await _drain(receive, DRAIN_FACTOR * self.max_body_bytes)
                await _reply(self._too_large(), scope, receive, send)
            return  # the client went away while sending
        await self.app(scope, _replay(body, receive), send)

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body is larger than {self.max_body_bytes} bytes "
                             f"(the server's --max-request-bytes)", code="request_too_large")

    async def _read_body(self, receive: Receive) -> tuple[bytes | None, bool]:
        """(body, True); (None, True) when it passes the limit; (None, False) on disconnect."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None, False
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return None, True
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), True


async def _drain(receive: Receive, limit: int | None = None) -> None:
    size = 0
    while limit is None or size <= limit:
        message = await receive()
        size += len(message.get("body", b""))
        if message["type"] == "http.disconnect" or not message.get("more_body", False):
            return


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that yields the already-read body once, then the real channel (so the
    app still hears ``http.disconnect``)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _reply(error: APIError, scope: Scope, receive: Receive, send: Send) -> None:
    await error.response()(scope, receive, send)
