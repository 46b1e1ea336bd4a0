"""E2B's error answers: ``{"code": <HTTP status>, "message": "..."}``, for every ``/e2b`` route.

``E2BRoute`` is the route class of every ``/e2b`` router: whatever a route
raises (a ``HangarError`` from the core, a failed key check, a body that does
not validate) is answered in E2B's shape, which its SDK turns into its own
exceptions (401: ``AuthenticationException``; 429: ``RateLimitException``;
503: ``ServiceBusyException``, retried by the SDK; others: ``SandboxException``
with the status and message). Hangar's errors map onto E2B's statuses:

==========================  =====  ===============================================
Hangar                      E2B    why
==========================  =====  ===============================================
InvalidRequest, validation  400    E2B answers bad bodies and parameters with 400
Unauthorized                401
NotFound, Gone              404    an expired sandbox is gone for E2B's SDK too
Busy                        503    a call is in flight: retry (``Retry-After``)
Conflict                    409
LimitExceeded               429    with ``Retry-After``
other                       their own status
==========================  =====  ===============================================

Unexpected exceptions are logged and answered 500 with a generic message.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from hangar.api.errors import level_of
from hangar.errors import Busy, Gone, HangarError

log = logging.getLogger("hangar.api.e2b")

__all__ = ["E2BRoute", "e2b_error"]


def e2b_error(status: int, message: str, retry_after: float | None = None) -> JSONResponse:
    """An answer in E2B's error shape; ``Retry-After`` (whole seconds, at least 1) when
    ``retry_after`` is given."""
    headers = {}
    if retry_after is not None:
        headers["Retry-After"] = str(max(1, math.ceil(retry_after)))
    return JSONResponse({"code": status, "message": message}, status_code=status,
                        headers=headers)


def from_hangar(exc: HangarError) -> JSONResponse:
    """The E2B answer of one of Hangar's errors (see the module docstring)."""
    retry_after = getattr(exc, "retry_after", None)
    if isinstance(exc, Busy):
        return e2b_error(503, exc.message, retry_after or 1.0)
    if isinstance(exc, Gone):
        return e2b_error(404, exc.message)
    return e2b_error(exc.status, exc.message, retry_after)


def from_validation(exc: RequestValidationError) -> JSONResponse:
    """A 400 naming the first field that failed and why."""
    errors = exc.errors()
    if not errors:
        return e2b_error(400, "invalid request")
    first = errors[0]
    where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
    what = str(first.get("msg", "invalid")).removeprefix("Value error, ")
    if first.get("type") == "json_invalid":
        return e2b_error(400, "the request body is not valid JSON")
    return e2b_error(400, f"{where}: {what}" if where else what)


class E2BRoute(APIRoute):
    """A route whose errors are answered in E2B's shape (see the module docstring)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def run(request: Request) -> Response:
            try:
                return await handler(request)
            except HangarError as exc:
                level = level_of(exc)  # ERROR only when the server is at fault
                if level is not None:
                    log.log(level, "E2B request failed", extra={"path": request.url.path,
                                                                "error": exc.message})
                return from_hangar(exc)
            except RequestValidationError as exc:
                return from_validation(exc)
            except HTTPException as exc:
                return e2b_error(exc.status_code, str(exc.detail))
            except Exception:
                log.exception("unexpected error", extra={"path": request.url.path})
                return e2b_error(500, "internal error; see the server log")

        return run
