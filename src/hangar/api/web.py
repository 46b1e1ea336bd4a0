"""The web page: ``/ui/`` (Hangar's page) and ``/novnc/`` (noVNC), static files.

``/`` redirects to ``/ui/``. The page lists the sandboxes and shows a live
desktop. Neither path needs the API key: they serve only static files. The
page asks the user for the key, keeps it in ``sessionStorage`` (gone when
the tab closes) and sends it as the ``X-API-Key`` header on every API call;
it never puts the key in a URL. For the live view it asks the API for a
single-use VNC ticket (``hangar.api.vnc``) and gives noVNC the WebSocket URL
with that ticket.

noVNC comes from Debian's ``novnc`` package (``/usr/share/novnc``, version
1.3: ES modules under ``core/``), or from ``HANGAR_NOVNC_DIR``. Without it
``/novnc/`` answers 404 with a hint, and the rest of the page still works.

Every response of these paths carries a strict Content-Security-Policy
(scripts, styles, images and connections from this origin only; WebSocket
to this host), ``X-Frame-Options: DENY``, ``Referrer-Policy: no-referrer``
and ``X-Content-Type-Options: nosniff``.
"""

from __future__ import annotations

import os
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import RedirectResponse, Response
from starlette.staticfiles import StaticFiles
from starlette.types import Receive, Scope, Send

from hangar.api.errors import error_response

WEB_DIR = Path(__file__).resolve().parent.parent / "web"
"""Hangar's page: index.html, app.js, style.css."""
NOVNC_DIRS = (Path("/usr/share/novnc"),)
NOVNC_ENV = "HANGAR_NOVNC_DIR"

SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
        "img-src 'self' data: blob:; connect-src 'self' ws: wss:; font-src 'self'; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"),
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def novnc_dir() -> Path | None:
    """Where noVNC is: ``HANGAR_NOVNC_DIR``, else /usr/share/novnc; None if absent."""
    env = os.environ.get(NOVNC_ENV)
    for d in ([Path(env)] if env else list(NOVNC_DIRS)):
        if (d / "core" / "rfb.js").is_file():
            return d
    return None


class SecureStatic(StaticFiles):
    """StaticFiles adding ``SECURITY_HEADERS`` to every response."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_with_headers(message: dict) -> None:  # type: ignore[type-arg]
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers += [(k.lower().encode(), v.encode()) for k, v in SECURITY_HEADERS.items()]
                message = {**message, "headers": headers}
            await send(message)

        await super().__call__(scope, receive, send_with_headers)


def install(app: FastAPI) -> None:
    """Add ``/`` (redirect), ``/ui/`` and ``/novnc/`` to ``app``."""

    @app.get("/", include_in_schema=False)
    async def root() -> Response:
        return RedirectResponse("/ui/", status_code=307)

    app.mount("/ui", SecureStatic(directory=WEB_DIR, html=True), name="ui")
    d = novnc_dir()
    if d is not None:
        app.mount("/novnc", SecureStatic(directory=d), name="novnc")
    else:
        @app.get("/novnc/{path:path}", include_in_schema=False)
        async def no_novnc(path: str, request: Request) -> Response:
            return error_response(404, "not_found", "noVNC is not installed on this server: "
                                  "apt-get install novnc (or set HANGAR_NOVNC_DIR)")
