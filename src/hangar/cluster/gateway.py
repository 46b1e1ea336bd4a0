"""Any node is a gateway: the ASGI middleware in front of a cluster node's app.

It checks what every request needs before it goes anywhere, then hands it
on:

1. the node token (``X-Hangar-Node-Token``, sent by other nodes on every call)
   is read from the raw headers and compared in constant time; present but
   malformed or wrong, the request gets 401 before anything else;
2. a request from another node with the node token passes straight to the
   app: a placed create (``X-Hangar-Sandbox-Id``, made under that id: the
   placement travels in the ASGI scope, ``hangar.core.handover``) or a part
   of a merged list (``X-Hangar-Local``);
3. the API key is checked here (``hangar.keys.authenticate``), so wrong
   keys are throttled by the client's real address, and again by the owner;
   a node's call with the token needs none here;
4. ``/cluster/health`` (the peer probe of ``membership``) is answered here,
   to a node or a client with a key;
5. control writes (creates, deletes, snapshot, restore, sleep, wake,
   timeout) need etcd: while this node cannot write to it they get 503
   (retryable) at once. Guest calls (exec, files, desktop, tunnels) need no
   etcd and keep working for running sandboxes while quorum is lost;
6. ``/teams`` is answered here, on the teams in etcd
   (``hangar.cluster.team_routes``);
7. ``GET /sandboxes``, ``/machines`` and ``/snapshots`` are merged from
   every node (``hangar.cluster.merging``); everything else is routed to
   the node that owns its sandbox (``hangar.cluster.routing``) and
   forwarded there (``hangar.cluster.forwarding``).

An error on the way is answered as the API answers it (the same JSON body
and ``Retry-After``), before a WebSocket upgrade too.
"""

from __future__ import annotations

import re
import secrets
from typing import Any

from hangar.cluster.forwarding import (
    H_LOCAL, H_PLACED, H_TOKEN, Forwarder, deny_ws, error_answer, json_answer, respond,
    with_placement,
)
from hangar.cluster.merging import LISTS, Merger
from hangar.cluster.node import ClusterNode
from hangar.cluster.records import SANDBOX_ID
from hangar.cluster.routing import Router
from hangar.cluster.team_routes import TeamRoutes, served
from hangar.errors import HangarError, InvalidRequest, Unauthorized, Unavailable
from hangar.keys import authenticate

CONTROL = [
    ("POST", re.compile(r"^/sandboxes/?$")),
    ("DELETE", re.compile(r"^/sandboxes/[^/]+/?$")),
    ("POST", re.compile(r"^/sandboxes/[^/]+/(timeout|snapshot|restore)/?$")),
    ("POST", re.compile(r"^/snapshots/[^/]+/sandboxes/?$")),
    ("DELETE", re.compile(r"^/snapshots/[^/]+/?$")),
    ("POST", re.compile(r"^/machines/[^/]+(/snapshot|/wake)?/?$")),
    ("DELETE", re.compile(r"^/machines/[^/]+/?$")),
]
"""Requests that change the cluster's records: refused with 503 while etcd takes no writes."""

OPEN = ("/health", "/", "/docs", "/openapi.json")
"""Paths that need no key (besides ``/web`` and ``/static``)."""

PLACED_ID = SANDBOX_ID
"""What a placed sandbox id may look like (``hangar.core.admission.new_id`` makes them)."""


TOKEN_CHARS = re.compile(rb"^[A-Za-z0-9_-]{1,128}$")


def node_token(raw_headers: list[tuple[bytes, bytes]], token: str) -> bool:
    """Whether the request carries this cluster's node token (``X-Hangar-Node-Token``), read
    from the raw headers alone and compared in constant time.

    False when there is none. Raises ``Unauthorized`` (401) when one is there but
    malformed (not 1-128 of ``[A-Za-z0-9_-]``, or given twice) or wrong, so a bad
    token is refused before anything else is read; never an error of another kind.
    """
    given = [v for k, v in raw_headers if k.lower() == H_TOKEN.encode()]
    if not given:
        return False
    if len(given) > 1 or not TOKEN_CHARS.fullmatch(given[0]) or not token:
        raise Unauthorized("malformed or unexpected X-Hangar-Node-Token header")
    if not secrets.compare_digest(given[0], token.encode()):
        raise Unauthorized("wrong X-Hangar-Node-Token header")
    return True


class Gateway:
    """The middleware of a cluster node: checks, then merges, routes and forwards."""

    def __init__(self, app: Any, node: ClusterNode, state: Any) -> None:
        self.app = app
        self.node = node
        self.state = state
        """The app's state: ``keys`` and ``throttle`` for ``authenticate``."""
        self.forwarder = Forwarder(app, node.name, self._token)
        self.router = Router(app, node, self.forwarder)
        self.merger = Merger(node.directory, self.forwarder.http, self._token)
        self.teams = TeamRoutes(node)

    def _token(self) -> str:
        cfg = self.node.config
        return cfg.node_token if cfg else ""

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or self.node.manager is None:
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        path = scope["path"]
        method = scope.get("method", "GET") if scope["type"] == "http" else "WS"
        try:
            token_ok = node_token(scope["headers"], self._token())
            if token_ok and H_PLACED in headers:
                if not PLACED_ID.fullmatch(headers[H_PLACED]):
                    raise InvalidRequest("malformed X-Hangar-Sandbox-Id from a node")
                await self.app(with_placement(scope, headers[H_PLACED]), receive, send)
                return
            if H_LOCAL in headers and token_ok:
                await self.app(scope, receive, send)
                return
            if method != "WS" and not token_ok and not self._open(path):
                client = scope.get("client")
                authenticate(self.state, headers.get("x-api-key"),
                             client[0] if client else "unknown")
            if path == "/cluster/health":  # the peer probe: a node's token, or a client's key
                await respond(send, json_answer(200, {"node": self.node.name,
                                                      "writable": self.node.writable()}))
                return
            if method != "WS" and any(m == method and rx.match(path) for m, rx in CONTROL) \
                    and not self.node.writable():
                raise Unavailable("the cluster store (etcd) takes no writes now (no quorum, or "
                                  "this node is cut off); retry shortly", retry_after=2)
            if method != "WS" and served(method, path):  # teams live in etcd
                await respond(send, await self.teams.answer(method, path, receive))
                return
            if method == "GET" and path.rstrip("/") in LISTS:
                await respond(send, await self.merger.merged(scope, headers, path.rstrip("/")))
                return
            await self.router.route(scope, receive, send, headers, path, method, token_ok)
        except HangarError as exc:
            if scope["type"] == "websocket":
                await deny_ws(receive, send, error_answer(exc))
            else:
                await respond(send, error_answer(exc))

    @staticmethod
    def _open(path: str) -> bool:
        return path in OPEN or path.startswith(("/web", "/static"))


def install(app: Any, node: ClusterNode) -> Any:
    """Wrap ``app`` (the FastAPI app) with the gateway; returns the ASGI app to serve."""
    return Gateway(app, node, app.state)
