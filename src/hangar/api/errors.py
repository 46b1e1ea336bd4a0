"""Maps ``hangar.errors`` and validation failures to JSON error responses.

Body: ``{"error": {"code": ..., "message": ..., <context>}}``, rendered by
``hangar.error_body`` (the one renderer every ASGI layer uses); 429, a
``busy`` 409, and a 504 for an ``unresponsive`` sandbox carry
``Retry-After`` (whole seconds, rounded up, at least 1). Unexpected
exceptions become a 500 with a generic message and are logged, never
echoed.

Log levels of error answers (``level_of``): ERROR only when the server is
at fault (a 500: an engine, image or config error, or an unexpected
exception); 503 (the server cannot serve now) is a WARNING; a guest's fault
or an unresponsive sandbox (502, 504) is INFO on each call: it is reported
once, where it is found, not once per caller. A client that goes away in
the middle of its request body (an aborted upload) is INFO, never an
"Exception in ASGI application".
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Send

from hangar import error_body
from hangar.error_body import context_of, render, render_error, retry_after_header
from hangar.errors import HangarError

__all__ = ["context_of", "count", "error_response", "install", "level_of", "render",
           "render_error", "retry_after_header", "send_error"]

log = logging.getLogger("hangar.api")


def error_response(status: int, code: str, message: str, **context: Any) -> Response:
    """An error answer for a route or a WebSocket denial (see ``hangar.error_body``)."""
    return Response(error_body.body(code, message, **context), status_code=status,
                    headers=error_body.headers(context), media_type="application/json")


async def send_error(send: Send, rendered: tuple[int, list[tuple[bytes, bytes]], bytes]
                     ) -> None:
    """Send a ``render``-ed error as a whole HTTP answer on a raw ASGI ``send``."""
    status, headers, data = rendered
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


def count(request: Request, code: str) -> None:
    """Count an error answer in ``hangar_errors_total{code}`` (once the server runs)."""
    metrics = getattr(request.app.state, "metrics", None)
    if metrics is not None:
        metrics.errors.labels(code).inc()


def level_of(exc: HangarError) -> int | None:
    """The log level of an error answer (see the module docstring); None: not logged."""
    if exc.status < 500:
        return None
    if exc.status == 500:
        return logging.ERROR
    if exc.status == 503:
        return logging.WARNING
    return logging.INFO


def install(app: FastAPI) -> None:
    @app.exception_handler(HangarError)
    async def _hangar(request: Request, exc: HangarError) -> Response:
        count(request, exc.code)
        ctx = context_of(exc)
        level = level_of(exc)
        if level is not None:
            log.log(level, "request failed", extra={"path": request.url.path,
                                                    "status": exc.status, "error": exc.message})
        return error_response(exc.status, exc.code, exc.message, **ctx)

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, exc: ClientDisconnect) -> Response:
        log.info("client went away before its request body ended",
                 extra={"path": request.url.path, "method": request.method})
        count(request, "client_disconnected")
        return Response(status_code=400)  # nobody reads it

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        count(request, "invalid_request")
        errors = exc.errors()
        bad_json = next((e for e in errors if e.get("type") == "json_invalid"), None)
        if bad_json is not None:  # the body is not JSON at all: 400, with where it broke
            loc = bad_json.get("loc", ())
            where = f" at character {loc[1]}" if len(loc) > 1 and isinstance(loc[1], int) else ""
            reason = str((bad_json.get("ctx") or {}).get("error", "")) or "JSON decode error"
            return error_response(400, "invalid_request",
                                  f"the request body is not valid JSON{where}: {reason}")
        content_type = request.headers.get("content-type", "")
        if "json" not in content_type and any(tuple(e.get("loc", ())) == ("body",)
                                              for e in errors):
            return error_response(
                400, "invalid_request",
                f"the request body must be JSON sent with Content-Type: application/json "
                f"(got {content_type[:60] or 'no Content-Type'})")
        details = [
            {"loc": [str(x) for x in e.get("loc", ())], "msg": e.get("msg", "")}
            for e in errors
        ]
        for d in details:  # pydantic's prefix for a validator's own message
            d["msg"] = str(d["msg"]).removeprefix("Value error, ")
        first = details[0] if details else {"loc": [], "msg": "invalid request"}
        message = f"{'.'.join(first['loc'])}: {first['msg']}" if first["loc"] else first["msg"]
        return error_response(422, "invalid_request", message, details=details)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> Response:
        code = {401: "unauthorized", 403: "forbidden", 404: "not_found",
                405: "method_not_allowed", 413: "too_large"}.get(exc.status_code, "http_error")
        count(request, code)
        # An HTTPException of ours may carry its error's context (limits.BodyTooLarge).
        context = dict(getattr(exc, "context", None) or {})
        return error_response(exc.status_code, code, str(exc.detail), **context)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unexpected error", extra={"path": request.url.path})
        count(request, "internal")
        return error_response(500, "internal", "internal error; see the server log")
