"""The one rendering of an error answer, for every ASGI layer of the server.

Used by the API's exception handlers and WebSocket denials
(``hangar.api.errors``), the port proxy (``hangar.api.proxy``) and the
cluster gateway, so an error looks the same whichever layer answers it::

    HTTP/1.1 <status>
    content-type: application/json
    content-length: <n>
    retry-after: <whole seconds>          only when the error has ``retry_after``

    {"error": {"code": "<code>", "message": "<message>", <context>...}}

``context`` holds the error's ids and figures (strings, numbers and
booleans only; ``details`` of a validation error is a list). A
``retry_after`` in it (seconds, any number) is kept as given in the body,
and becomes the ``Retry-After`` header by one rule: rounded up to whole
seconds, at least 1 (``retry_after_header``). For a ``HangarError`` the
context is its own plus the ``retry_after`` of retryable errors (``Busy``,
``LimitExceeded``, or one set in the context, as an unresponsive sandbox's
``Timeout`` does).

Pure Python (no FastAPI), so layers that do not import the API use it too.
"""

from __future__ import annotations

import json
import math
from typing import Any

from hangar.errors import HangarError

Headers = list[tuple[bytes, bytes]]
Rendered = tuple[int, Headers, bytes]
"""(status, raw ASGI headers, body bytes)."""


def retry_after_header(seconds: Any) -> str:
    """The ``Retry-After`` value for ``seconds``: rounded up to whole seconds, at least 1."""
    try:
        value = float(seconds)
    except (TypeError, ValueError):
        return "1"
    if not math.isfinite(value):
        return "1"
    return str(max(1, math.ceil(value)))


def context_of(exc: HangarError) -> dict[str, Any]:
    """The context an error's answer carries: its plain values, and ``retry_after``."""
    ctx = {k: v for k, v in exc.context.items() if isinstance(v, (str, int, float, bool))}
    retry_after = getattr(exc, "retry_after", None)
    if retry_after is not None:
        ctx["retry_after"] = retry_after
    return ctx


def body(code: str, message: str, **context: Any) -> bytes:
    """The JSON body ``{"error": {"code", "message", **context}}`` (UTF-8)."""
    return json.dumps({"error": {"code": code, "message": message, **context}},
                      ensure_ascii=False, separators=(",", ":")).encode()


def headers(context: dict[str, Any]) -> dict[str, str]:
    """Headers besides the framing: ``Retry-After`` when the context has ``retry_after``."""
    if context.get("retry_after") is None:
        return {}
    return {"Retry-After": retry_after_header(context["retry_after"])}


def render(status: int, code: str, message: str, **context: Any) -> Rendered:
    """An error answer as (status, raw headers, body), ready for ``http.response.start``."""
    data = body(code, message, **context)
    raw: Headers = [(b"content-type", b"application/json"),
                    (b"content-length", str(len(data)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in headers(context).items()]
    return status, raw, data


def render_error(exc: HangarError) -> Rendered:
    """``render`` of a ``HangarError``: its status, code, message and ``context_of``."""
    return render(exc.status, exc.code, exc.message, **context_of(exc))
