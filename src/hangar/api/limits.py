"""A cap on request bodies: ``BodyLimit``, an ASGI middleware.

Every request body is bounded by ``Settings.max_json_bytes`` (default 8 MiB)
except on the routes each router module lists in ``RAW_BODY`` (method, path
template), whose handlers stream the body on to a guest chunk by chunk
(file uploads) and so never hold it whole. A body over the limit gets 413
``too_large`` naming the limit: at once when its ``Content-Length`` says
so, else as soon as the bytes read pass it (chunked uploads), before the
JSON is parsed. A JSON body (or one without a ``Content-Type``, which FastAPI parses
as JSON) is also counted as it is read (``hangar.json_items``): past ``MAX_ITEMS``
values, 413 ``too_large`` naming that limit, before the parse that would build them all
(8 MiB of ``[{},...]`` is about 200 MiB of objects).

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
from hangar.json_items import MAX_ITEMS, Items

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


class TooManyItems(HTTPException):
    """413: the JSON body holds more than ``limit`` values (``hangar.json_items``).

    ``context`` (``{"limit_items": limit}``) goes into the JSON error body.
    """

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the JSON body holds more than {limit} values (commas and "
                              "brackets outside strings), the server's limit: send fewer")
        self.limit = limit
        self.context = {"limit_items": limit}


def _json_body(scope: Scope) -> bool:
    """Whether FastAPI would parse the request's body as JSON: a JSON ``Content-Type``
    (``application/json``, ``...+json``) or none."""
    for name, value in scope.get("headers", ()):
        if name == b"content-type":
            kind = value.partition(b";")[0].strip().lower()
            return kind == b"application/json" or kind.endswith(b"+json")
    return True


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
        counter = Items(MAX_ITEMS) if _json_body(scope) else None

        async def capped() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                body = message.get("body", b"")
                seen += len(body)
                if seen > limit:
                    raise BodyTooLarge(limit)
                if counter is not None and counter.feed(body):
                    raise TooManyItems(MAX_ITEMS)
            return message

        await self.app(scope, capped, send)
