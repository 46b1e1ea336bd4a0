"""Exposed ports: HTTP and WebSocket requests forwarded to a guest's TCP port.

Flow::

    client ──HTTP /sandboxes/{id}/ports/{port}/<path>──────┐  path-routed
    client ──HTTP Host: {port}-{id}.<HANGAR_DOMAIN> /<path>─┤  host-routed (E2B's form)
                                                           ▼
                      PortProxy (outermost ASGI middleware of the app)
                          │ exposure? (hangar.core.ports) → 404
                          │ private: X-API-Key, or a token (?hangar_token= or cookie) → 401
                          │ SandboxManager.tunnel(id, port) (a sleeping sandbox is woken)
                          ▼
                      guest: 127.0.0.1:{port}, one TCP connection per request

The request is re-serialized for the guest with h11 (HTTP/1.1, one request
per connection, ``Connection: close``) and the answer parsed with h11 and
streamed back as it arrives (server-sent events and long downloads pass
through; so does a request body, streamed while the answer may already
come). WebSocket upgrades are carried by ``websockets``' sans-I/O client
protocol on the guest side: the handshake's answer is relayed (a refusal
too, with its status and body), then messages both ways, pings answered,
closes passed on with their code. The guest's leg is never compressed.

What the app in the guest sees:

* the path after the prefix (path-routed) or the whole path (host-routed),
  and ``X-Forwarded-Prefix: /sandboxes/{id}/ports/{port}`` (path-routed),
  so it can build links; a ``Location`` that is an absolute path is given
  the prefix back on the way out;
* the client's ``Host`` (apps that check it may need to allow Hangar's
  name), ``X-Forwarded-For``, ``-Proto`` and ``-Host``;
* never Hangar's credentials: ``X-API-Key``, E2B's ``X-Access-Token`` and
  ``E2B-Traffic-Access-Token``, an ``Authorization`` that carries any of
  Hangar's keys or tokens, the ``hangar_token`` query parameter and the
  token cookie under either name (``hangar_port_token``,
  ``__Host-hangar_port_token``) are removed, as are hop-by-hop headers; on
  every path (path- and host-routed, E2B's ``E2b-Sandbox-Port``).

A request that brings a valid token in its query gets the token back as
a cookie (``HttpOnly; SameSite=Lax``; path-scoped to the port's prefix, or
host-only for host-routed ports), so a browser's later requests (assets,
links, WebSockets) carry it. A host-routed port over HTTPS names it
``__Host-hangar_port_token`` (``Secure; Path=/``, no ``Domain``): every
``{port}-{id}.<domain>`` is one site, and a page of another port could toss
a ``hangar_port_token`` cookie for the whole domain that shadows the
browser's own, but browsers let no host set another's ``__Host-`` cookie.
There the unprefixed name is ignored (``routing.cookie_name``). Answers of
Hangar itself (404 not exposed, 401, 409/410 sandbox not running, 502
nothing listens or the answer was not HTTP) use the JSON error shape; the
guest's own answers pass as they are.

Modules: ``routing`` (where a request goes, the guest's headers, tokens in
queries and cookies), ``exchange`` (admission, the tunnel, ``Refused``),
``http`` and ``websocket`` (the two kinds of exchange); ``PortProxy`` here.

Modules: ``origin`` (what a path-routed answer may not do on Hangar's origin).

Path-routed ports share Hangar's origin: their answers lose the headers that
reach beyond the port (``Service-Worker-Allowed``, ``Clear-Site-Data``, a
``Set-Cookie`` outside the prefix) and get ``Content-Security-Policy:
sandbox`` (an opaque origin; ``HANGAR_PORT_PATH_SANDBOX=0`` opts out):
``hangar.api.proxy.origin``. Serve web apps that need an origin of their own
on host-routed URLs (``HANGAR_DOMAIN``), where each port is one. See
docs/security.md.
"""

from __future__ import annotations

from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from hangar.api.proxy.exchange import Refused
from hangar.api.proxy.http import MAX_HEADER_BYTES, BrokenAnswer, HttpExchange
from hangar.api.proxy.routing import (
    COOKIE, HOST_COOKIE, TOKEN_PARAM, Target, guest_headers, host_url, path_prefix, route,
)
from hangar.api.proxy.websocket import WS_MAX_MESSAGE, WebSocketExchange
from hangar.core.service import SandboxManager

__all__ = [
    "COOKIE", "HOST_COOKIE", "MAX_HEADER_BYTES", "TOKEN_PARAM", "WS_MAX_MESSAGE", "BrokenAnswer",
    "PortProxy", "Refused", "Target", "forward_admitted", "guest_headers", "host_url",
    "path_prefix", "route",
]


class PortProxy:
    """ASGI middleware: requests for exposed ports go to the guest; others to ``app``.

    Placed outermost, so the API's body cap and idempotency middleware never
    see proxied requests. Finds the manager and key ring in
    ``scope["app"].state``.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        state = scope["app"].state
        manager: SandboxManager | None = getattr(state, "manager", None)
        target = route(scope, manager.settings.domain if manager is not None else None)
        if target is None or manager is None:
            await self.app(scope, receive, send)
            return
        if scope["type"] == "http":
            await HttpExchange(scope, receive, send, target, manager, state).run()
        else:
            await WebSocketExchange(scope, receive, send, target, manager, state).run()


async def forward_admitted(scope: Scope, receive: Receive, send: Send, target: Target,
                           manager: SandboxManager, state: Any,
                           host: bytes | None = None) -> None:
    """Forward one request (HTTP or WebSocket) to ``target``, its caller having admitted it
    already (E2B's data plane, by the sandbox's access token): no exposure is needed.
    ``host``: the ``Host`` the guest gets instead of the client's."""
    cls = HttpExchange if scope["type"] == "http" else WebSocketExchange
    exchange = cls(scope, receive, send, target, manager, state)
    exchange.host = host
    exchange.admit = lambda: None  # type: ignore[assignment, method-assign, return-value]
    await exchange.run()
