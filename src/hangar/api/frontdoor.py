"""The front door: the outermost ASGI layer, which authenticates from headers alone.

Nothing of a request's body is read, and nothing parsed, before its sender
is known. For each HTTP request the front door decides from the method,
path and headers only:

==============================  ==================================================
request                         who checks it, before any body is read
==============================  ==================================================
an open route (``/health``,     nobody: no key needed (``OPEN_PATHS`` and
``/e2b/health``, the web page,  ``OPEN_PREFIXES``, GET and HEAD only)
``/docs``, ``/openapi.json``,
``/cluster/health``)
an exposed port (path- or       ``hangar.api.proxy`` (``Exchange.admit``): the key,
host-routed)                    or the port's token (query or cookie)
``/e2b/envd/...``, a signed     ``hangar.api.envd.gateway``: the sandbox's access
``/files`` URL                  token, a key, or the URL's signature
a build's signed upload URL     ``hangar.api.e2b.builds``: its signature, for that
(PUT)                           one archive only
anything else (the REST API,    here: ``X-API-Key`` (E2B's ``X-API-KEY`` is the same
``/e2b`` control plane,         header), by ``hangar.keys.authenticate``; 401 or 429
``/metrics``, unknown paths)    answered at once (E2B's error shape under ``/e2b``)
==============================  ==================================================

WebSocket handshakes carry no body: each WebSocket route checks its
credential (a single-use ticket, or the key) before it accepts, and a
refusal is an HTTP answer (``hangar.api.tickets``).

The accepted key's name goes into the request's state (``key_name``), where
``hangar.api.auth.require_key`` finds it, so the key is checked once. The
idempotency middleware runs inside this layer: a stored answer is replayed
only to a key the server accepts now.

A refused request's body is never parsed. After its answer the front door
reads and discards at most ``DRAIN_BYTES`` of it for at most ``DRAIN_S``
(a "lingering close", as web servers do): a client still sending would
otherwise see its connection reset instead of the 401. Reading without
parsing costs microseconds per 64 KiB.

Bodies of authenticated requests are parsed as JSON off the event loop when
they are larger than ``OFFLOOP_JSON_BYTES`` (``install_offloop_json``), so a
client's 8 MiB body does not stall other clients' calls.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

import anyio
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from hangar.api.errors import render_error, retry_after_header, send_error
from hangar.api.proxy.routing import route as port_route
from hangar.api.envd.versions import PREFIX as ENVD_PREFIX
from hangar.api.team_gate import ACT_FOR_HEADER, team_for
from hangar.core.service import acting_for
from hangar.errors import HangarError
from hangar.keys import authenticate, client_identity

DRAIN_BYTES = 16 << 20
"""Bytes of a refused request's body read and dropped after its answer, at most."""
DRAIN_S = 5.0
"""Seconds spent draining a refused request's body, at most."""
OFFLOOP_JSON_BYTES = 64 << 10
"""JSON bodies larger than this (bytes) are parsed in a worker thread."""
E2B_PREFIX = "/e2b"
UPLOAD_PATH = re.compile(r"/e2b/templates/[^/]+/files/[0-9a-f]{64}/upload")
"""A template build's upload (``hangar.api.e2b.builds``): its route checks its token."""

__all__ = ["DRAIN_BYTES", "DRAIN_S", "OFFLOOP_JSON_BYTES", "OPEN_PATHS", "OPEN_PREFIXES",
           "FrontDoor", "OffLoopJsonRequest", "install_offloop_json"]


def _header(scope: Scope, name: bytes) -> str | None:
    for k, v in scope.get("headers", ()):
        if k == name:
            return bytes(v).decode("latin-1")
    return None


OPEN_PATHS = frozenset({"/health", "/e2b/health", "/", "/docs", "/docs/oauth2-redirect",
                        "/redoc", "/openapi.json", "/ui", "/cluster/health"})
"""Paths served without a key (GET and HEAD only). ``/cluster/health`` is what a cluster's
nodes ask each other (``hangar.cluster.membership``), answered by its gateway."""
OPEN_PREFIXES = ("/ui/", "/novnc/", "/xterm/")
"""Static files of the web page, noVNC and xterm.js (GET and HEAD only; no key: the page
asks for it)."""


class FrontDoor:
    """ASGI middleware, outermost: authenticate before anything reads the body.

    Finds the key ring, throttle and manager in ``scope["app"].state``. What needs no key
    is listed here (``OPEN_PATHS``, ``OPEN_PREFIXES``): a new route needs a key unless it
    is added to them (tests/test_front_door.py: every route of the OpenAPI document but
    ``/health`` answers 401 without a key).
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    @staticmethod
    def _open_path(scope: Scope) -> bool:
        if scope.get("method") not in ("GET", "HEAD"):
            return False
        path = scope.get("path", "")
        return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)

    @staticmethod
    def _delegated(scope: Scope, state: Any) -> bool:
        """Requests whose own layer authenticates them from headers (ports, envd)."""
        path = scope.get("path", "")
        if path == ENVD_PREFIX or path.startswith(ENVD_PREFIX + "/"):
            return True
        if path == "/files" and b"signature=" in bytes(scope.get("query_string", b"")):
            return True
        if scope.get("method") == "PUT" and UPLOAD_PATH.fullmatch(path) \
                and b"signature=" in bytes(scope.get("query_string", b"")):
            return True
        manager = getattr(state, "manager", None)
        domain = manager.settings.domain if manager is not None else None
        return port_route(scope, domain) is not None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope["app"].state
        if getattr(state, "keys", None) is None or self._delegated(scope, state) \
                or self._open_path(scope):
            await self.app(scope, receive, send)
            return
        try:
            name = authenticate(state, _header(scope, b"x-api-key"), client_identity(scope))
            team = team_for(state, name, _header(scope, ACT_FOR_HEADER.encode()))
        except HangarError as exc:
            await self._refuse(scope, receive, send, exc)
            return
        scope.setdefault("state", {}).update(key_name=name, team=team)
        with acting_for(team):  # core scopes what this request sees (hangar.core.teams)
            await self.app(scope, receive, send)

    @staticmethod
    async def _refuse(scope: Scope, receive: Receive, send: Send, exc: HangarError) -> None:
        """Answer ``exc`` without reading the body, then drain what the client still sends."""
        metrics = getattr(scope["app"].state, "metrics", None)
        if metrics is not None:
            metrics.errors.labels(exc.code).inc()
        path = scope.get("path", "")
        if path == E2B_PREFIX or path.startswith(E2B_PREFIX + "/"):
            body = json.dumps({"code": exc.status, "message": exc.message}).encode()
            headers = [(b"content-type", b"application/json")]
            retry = getattr(exc, "retry_after", None)
            if retry is not None:
                headers.append((b"retry-after", retry_after_header(retry).encode()))
            rendered = (exc.status, headers, body)
        else:
            rendered = render_error(exc)
        await send_error(send, rendered)
        await drain(receive)


async def drain(receive: Receive, limit: int = DRAIN_BYTES, deadline_s: float = DRAIN_S) -> None:
    """Read and drop a request body already answered: at most ``limit`` bytes and
    ``deadline_s`` seconds, never parsed."""
    seen = 0
    end = time.monotonic() + deadline_s
    with anyio.move_on_after(deadline_s):
        while seen <= limit and time.monotonic() < end:
            msg = await receive()
            if msg["type"] != "http.request":
                return
            seen += len(msg.get("body", b""))
            if not msg.get("more_body", False):
                return


class OffLoopJsonRequest(Request):
    """A Starlette request whose ``json()`` parses bodies over ``OFFLOOP_JSON_BYTES`` in a
    worker thread (``anyio.to_thread``). Raises ``json.JSONDecodeError`` for a body that
    is not JSON or is nested too deeply for the parser, which the API answers with 400."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            if len(body) > OFFLOOP_JSON_BYTES:
                self._json = await anyio.to_thread.run_sync(_loads, body)
            else:
                self._json = _loads(body)
        return self._json


def _loads(body: bytes) -> Any:
    try:  # UTF-8 only (RFC 8259), as the value count reads it: json.loads takes UTF-16 too
        return json.loads(body.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise json.JSONDecodeError(f"the body is not UTF-8: {exc.reason}", "", 0) from None
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply", "", 0) from None
    except json.JSONDecodeError:
        raise
    except ValueError as exc:  # e.g. an integer of more digits than Python converts
        raise json.JSONDecodeError(str(exc)[:200], "", 0) from None


def install_offloop_json() -> None:
    """Make FastAPI's routes build ``OffLoopJsonRequest``s.

    FastAPI (pinned, 0.165) builds each route's request as ``Request(scope, receive,
    send)`` in ``fastapi.routing`` and parses a JSON body with ``await request.json()``;
    the module's ``Request`` name is pointed at the subclass. Idempotent.
    """
    import fastapi.routing

    current = getattr(fastapi.routing, "Request", None)
    if current is OffLoopJsonRequest:
        return
    if current is not Request:
        raise RuntimeError("fastapi.routing.Request is not Starlette's Request: FastAPI "
                           "changed; hangar.api.frontdoor.install_offloop_json needs a look")
    fastapi.routing.Request = OffLoopJsonRequest  # type: ignore[misc]
