"""A cap on request bodies: ``BodyLimit``, an ASGI middleware.

Every request body is bounded by ``Settings.max_json_bytes`` (default 8 MiB)
except on the routes each router module lists in ``RAW_BODY`` (method, path
template), whose handlers stream the body on to a guest chunk by chunk
(file uploads) and so never hold it whole. A body over the limit gets 413
``too_large`` naming the limit: at once when its ``Content-Length`` says
so, else as soon as the bytes read pass it (chunked uploads), before the
JSON is parsed.

The error is raised from inside ``receive`` as ``BodyTooLarge``, an
``HTTPException``, because FastAPI turns any other exception met while it
reads a body into a generic 400.
"""

from __future__ import annotations

from collections.abc import Iterable

from starlette.exceptions import HTTPException
from starlette.routing import compile_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hangar.api.errors import error_response

WS_MAX_BYTES = 4 << 20
"""Largest WebSocket message a client may send (the tunnel, VNC), bytes. uvicorn takes one
message at a time from a connection, so this bounds what one client makes the server hold
(uvicorn's own default is 16 MiB). ``hangar serve`` passes it as ``ws_max_size``."""


class BodyTooLarge(HTTPException):
    """413: the request body is larger than ``limit`` bytes.

    ``context`` (``{"limit_bytes": limit}``) goes into the JSON error body
    (``hangar.api.errors``).
    """

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than {limit} bytes, the server's "
                              f"limit for JSON bodies (HANGAR_MAX_JSON_BYTES); send large data "
                              f"as a file (PUT /sandboxes/{{id}}/files) instead")
        self.limit = limit
        self.context = {"limit_bytes": limit}


class BodyLimit:
    """ASGI middleware: 413 for HTTP bodies over ``limit`` bytes.

    ``raw`` lists the (method, path template) of routes that stream their
    body themselves, e.g. ``("PUT", "/sandboxes/{sandbox_id}/files")``;
    their bodies are not capped.
    """

    def __init__(self, app: ASGIApp, limit: int, raw: Iterable[tuple[str, str]] = ()) -> None:
        self.app = app
        self.limit = limit
        self.raw = [(method.upper(), compile_path(path)[0]) for method, path in raw]

    def _is_raw(self, scope: Scope) -> bool:
        return any(scope.get("method") == method and regex.match(scope.get("path", ""))
                   for method, regex in self.raw)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._is_raw(scope):
            await self.app(scope, receive, send)
            return
        limit = self.limit
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > limit:
                    exc = BodyTooLarge(limit)
                    resp = error_response(413, "too_large", str(exc.detail), limit_bytes=limit)
                    await resp(scope, receive, send)
                    return
        seen = 0

        async def capped() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
            return message

        await self.app(scope, capped, send)
