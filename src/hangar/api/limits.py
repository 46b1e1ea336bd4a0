"""A cap on request bodies: ``BodyLimit`` (ASGI middleware) and ``raw_body`` routes.

Every request body is bounded by ``Settings.max_json_bytes`` (default 8 MiB)
except on routes marked ``@raw_body``, whose handlers stream the body on to
a guest chunk by chunk (file uploads) and so never hold it whole. A body
over the limit gets 413 ``too_large`` naming the limit: at once when its
``Content-Length`` says so, else as soon as the bytes read pass it (chunked
uploads), before the JSON is parsed.

The error is raised from inside ``receive`` as ``BodyTooLarge``, an
``HTTPException``, because FastAPI turns any other exception met while it
reads a body into a generic 400.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from starlette.exceptions import HTTPException
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

F = TypeVar("F", bound=Callable[..., Any])
_MARK = "__hangar_raw_body__"


def raw_body(fn: F) -> F:
    """Mark a route handler that streams its request body itself (not capped)."""
    setattr(fn, _MARK, True)
    return fn


class BodyTooLarge(HTTPException):
    """413: the request body is larger than ``limit`` bytes."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than {limit} bytes, the server's "
                              f"limit for JSON bodies (HANGAR_MAX_JSON_BYTES); send large data "
                              f"as a file (PUT /sandboxes/{{id}}/files) instead")
        self.limit = limit


def _is_raw(scope: Scope) -> bool:
    app = scope.get("app")
    router = getattr(app, "router", None)
    for route in getattr(router, "routes", ()):
        match, _ = route.matches(scope)
        if match == Match.FULL:
            return bool(getattr(getattr(route, "endpoint", None), _MARK, False))
    return False


class BodyLimit:
    """ASGI middleware: 413 for HTTP bodies over ``limit`` bytes, except on ``raw_body`` routes."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _is_raw(scope):
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
                    from hangar.api.errors import error_response

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
