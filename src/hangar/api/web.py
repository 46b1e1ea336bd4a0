"""The dashboard: ``/ui/`` (Hangar's page), ``/novnc/`` (noVNC) and ``/xterm/`` (xterm.js).

``/`` redirects to ``/ui/``. The page shows sandboxes, machines, snapshots,
the pool, live events and agent tasks, and per sandbox a terminal, the live
desktop and exposed ports. None of these paths needs the API key: they
serve only static files. The page asks the user for the key, keeps it in
``sessionStorage`` (gone when the tab closes) and sends it as the
``X-API-Key`` header on every API call, the event stream included (read
with ``fetch``, since ``EventSource`` cannot send headers); it never puts
the key in a URL. For the live desktop and the terminal it asks the API for
a single-use ticket (``hangar.api.tickets``) and opens the WebSocket with
that ticket.

noVNC comes from Debian's ``novnc`` package (``/usr/share/novnc``, version
1.3: ES modules under ``core/``), or from ``HANGAR_NOVNC_DIR``. Without it
``/novnc/`` answers 404 with a hint, and the rest of the page still works.

xterm.js comes from Debian's ``node-xterm`` (``/usr/share/nodejs/xterm/lib``,
version 3.8: CommonJS modules) and ``libjs-xterm`` (its stylesheet and the
``fit`` addon), or ``HANGAR_XTERM_DIR`` (a folder holding ``lib/``,
``xterm.css`` and ``addons/fit/fit.js``). Debian 12's browser bundle of it
(``libjs-xterm``'s ``xterm.js``) is an unbundled stub that only ``require``s
``./public/Terminal``, so ``/xterm/xterm.js`` is made here once per process
from the CommonJS modules: each wrapped in a function, joined with a
20-line ``require`` and exported as an ES module (``Terminal``, ``fit``).
Without the packages ``/xterm/`` answers 404 with a hint and the page shows
no terminal.

Every response of these paths carries a strict Content-Security-Policy
(scripts, styles, images and connections from this origin only; WebSocket
to this host), ``X-Frame-Options: DENY``, ``Referrer-Policy: no-referrer``
and ``X-Content-Type-Options: nosniff``.
"""

from __future__ import annotations

import json
import os
from functools import cache
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
XTERM_ENV = "HANGAR_XTERM_DIR"
XTERM_LIB = Path("/usr/share/nodejs/xterm/lib")
"""node-xterm's CommonJS modules."""
XTERM_WEB = Path("/usr/share/javascript/xterm")
"""libjs-xterm: xterm.css and addons/fit/fit.js."""

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


def xterm_files() -> tuple[Path, Path, Path] | None:
    """(lib folder, xterm.css, fit.js) of xterm.js, or None when not installed."""
    env = os.environ.get(XTERM_ENV)
    lib, web = (Path(env) / "lib", Path(env)) if env else (XTERM_LIB, XTERM_WEB)
    css, fit = web / "xterm.css", web / "addons" / "fit" / "fit.js"
    if (lib / "public" / "Terminal.js").is_file() and css.is_file() and fit.is_file():
        return lib, css, fit
    return None


LOADER = """
const cache = {};
function resolve(from, spec) {
  const parts = from.split("/");
  parts.pop();
  for (const p of spec.split("/")) {
    if (p === "..") parts.pop(); else if (p !== ".") parts.push(p);
  }
  return parts.join("/").replace(/\\.js$/, "");
}
function load(id) {
  if (cache[id]) return cache[id].exports;
  if (!modules[id]) throw new Error("xterm bundle: no module " + id);
  const module = { exports: {} };
  cache[id] = module;
  modules[id].call(module.exports, (spec) => load(resolve(id, spec)), module, module.exports);
  return module.exports;
}
export const Terminal = load("public/Terminal").Terminal;
export const fit = load("addons/fit/fit").fit;
"""


def xterm_bundle(lib: Path, fit: Path) -> bytes:
    """xterm.js as one ES module made from node-xterm's CommonJS files (see the module
    docstring); tests (``*.test.js``) left out."""
    sources = {p.relative_to(lib).with_suffix("").as_posix(): p
               for p in sorted(lib.rglob("*.js")) if not p.name.endswith(".test.js")}
    sources["addons/fit/fit"] = fit
    parts = ["// xterm.js from Debian's node-xterm and libjs-xterm, joined by Hangar.\n",
             "const modules = {\n"]
    for name, path in sources.items():
        parts.append(f"{json.dumps(name)}: function (require, module, exports) {{\n")
        parts.append(path.read_text(encoding="utf-8"))
        parts.append("\n},\n")
    parts.append("};\n")
    parts.append(LOADER)
    return "".join(parts).encode()


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

    found = xterm_files()

    @cache
    def bundle() -> bytes:
        assert found is not None
        return xterm_bundle(found[0], found[2])

    @app.get("/xterm/{name}", include_in_schema=False)
    async def xterm(name: str) -> Response:
        if found is None:
            return error_response(404, "not_found", "xterm.js is not installed on this server: "
                                  "apt-get install node-xterm (or set HANGAR_XTERM_DIR)")
        if name == "xterm.js":
            return Response(bundle(), media_type="text/javascript", headers=SECURITY_HEADERS)
        if name == "xterm.css":
            return Response(found[1].read_bytes(), media_type="text/css",
                            headers=SECURITY_HEADERS)
        return error_response(404, "not_found", f"no file {name[:100]} under /xterm/")
