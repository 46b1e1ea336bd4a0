"""Any node is a gateway: route each request to the node that owns its sandbox.

An ASGI middleware in front of the whole app (``install``). For a path
that names a sandbox (``/sandboxes/{id}`` and everything under it, HTTP
and WebSocket alike, so routes added later are covered too) or a machine
(``/machines/{user}...``), it looks the owner up in the directory cache
(fed by an etcd watch: no round trip in the common case) and:

==========================================  =======================================
the owner is                                the request is
==========================================  =======================================
this node                                   served here
another live node                           forwarded there (body and answer
                                            streamed; WebSockets relayed frame by frame)
lost or drained, the sandbox sleeping,      a wake: this node adopts it (or the best
and the call would wake it                  node does, forwarded with an adopt mark)
lost, the sandbox failed or sleeping,       answered from its record (GET), removed
and the call reads or deletes it            (DELETE); other calls 409
==========================================  =======================================

Creates (``POST /sandboxes``, ``POST /machines/{user}`` for a new user,
``POST /snapshots/{id}/sandboxes``) are placed (``hangar.cluster.placement``)
and claimed first (sandbox id, VM slot, machine key: one compare-and-set),
then made on the chosen node; a refused create gives its claim back.
``GET /sandboxes``, ``/machines`` and ``/snapshots`` merge every node's list.

Control writes (creates, deletes, snapshot, restore, sleep, wake, timeout)
need etcd: while this node cannot write to it they get 503 (retryable)
at once. Guest calls (exec, files, desktop, tunnels) need no etcd and keep
working for running sandboxes while quorum is lost.

Between nodes: a forwarded request carries the client's own headers (the
API key is checked here first, so wrong keys are throttled by the
client's real address, and again by the owner), ``X-Forwarded-For``, and,
for placements and adoptions, ``X-Hangar-Node-Token`` (from the cluster
config) that only nodes know.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any
import httpx

from hangar.cluster import records as R
from hangar.cluster.etcd import cmp_version, op_put
from hangar.cluster.node import ClusterNode
from hangar.cluster.placement import Need, rank
from hangar.cluster.records import NodeInfo, SandboxObject
from hangar.core.admission import new_id, placed_id
from hangar.core.machines import NAMES
from hangar.core.lifecycle import State
from hangar.core.store import SnapshotRecord
from hangar.errors import Conflict, HangarError, NotFound, TooLarge, Unavailable

log = logging.getLogger("hangar.cluster.gateway")

H_LOCAL = "x-hangar-local"
H_TOKEN = "x-hangar-node-token"
H_PLACED = "x-hangar-sandbox-id"
H_ADOPT = "x-hangar-adopt"
HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
       "proxy-authorization", "proxy-authenticate", "host", "content-length"}

SANDBOX = re.compile(r"^/sandboxes/(?P<id>[^/]+)(?P<rest>/.*)?$")
MACHINE = re.compile(r"^/machines/(?P<user>[^/]+)(?P<rest>/.*)?$")
SNAPSHOT = re.compile(r"^/snapshots/(?P<id>[^/]+)(?P<rest>/sandboxes)?/?$")
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


def _error(status: int, code: str, message: str, **ctx: Any) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    body = json.dumps({"error": {"code": code, "message": message, **ctx}}).encode()
    headers = [(b"content-type", b"application/json")]
    if "retry_after" in ctx:
        headers.append((b"retry-after", str(int(float(ctx["retry_after"]) + 0.999)).encode()))
    return status, headers, body


def _hangar_error(exc: HangarError) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    ctx = {k: v for k, v in exc.context.items() if isinstance(v, (str, int, float, bool))}
    if hasattr(exc, "retry_after"):
        ctx["retry_after"] = exc.retry_after  # type: ignore[attr-defined]
    return _error(exc.status, exc.code, exc.message, **ctx)


class Gateway:
    """The routing middleware of a cluster node."""

    def __init__(self, app: Any, node: ClusterNode, state: Any) -> None:
        self.app = app
        self.node = node
        self.state = state
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=2.0),
                                      limits=httpx.Limits(max_keepalive_connections=64))

    # -- entry ------------------------------------------------------------------------------

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or self.node.manager is None:
            await self.app(scope, receive, send)
            return
        headers = {k.decode().lower(): v.decode("latin-1") for k, v in scope["headers"]}
        path = scope["path"]
        method = scope.get("method", "GET") if scope["type"] == "http" else "WS"
        token_ok = self._token_ok(headers)
        if token_ok and H_PLACED in headers:
            tok = placed_id.set(headers[H_PLACED])
            try:
                await self.app(scope, receive, send)
            finally:
                placed_id.reset(tok)
            return
        if H_LOCAL in headers and token_ok:
            await self.app(scope, receive, send)
            return
        try:
            if path == "/cluster/health":
                await self._respond(send, 200, [(b"content-type", b"application/json")],
                                    json.dumps({"node": self.node.name,
                                                "writable": self.node.writable()}).encode())
                return
            if method != "WS" and any(m == method and rx.match(path) for m, rx in CONTROL) \
                    and not self.node.writable():
                raise Unavailable("the cluster store (etcd) takes no writes now (no quorum, or "
                                  "this node is cut off); retry shortly", retry_after=2)
            if method != "WS" and not self._auth(scope, headers, path):
                return await self.app(scope, receive, send)  # the route answers 401
            await self._route(scope, receive, send, headers, path, method, token_ok)
        except HangarError as exc:
            status, hdrs, body = _hangar_error(exc)
            if scope["type"] == "websocket":
                await self._deny_ws(receive, send, status, hdrs, body)
            else:
                await self._respond(send, status, hdrs, body)

    def _token_ok(self, headers: dict[str, str]) -> bool:
        cfg = self.node.config
        given = headers.get(H_TOKEN)
        return bool(given and cfg and secrets.compare_digest(given, cfg.node_token))

    def _auth(self, scope: dict[str, Any], headers: dict[str, str], path: str) -> bool:
        """Check the key before forwarding: True when it is good (or the route needs none)."""
        from hangar.api.auth import authenticate

        if path in ("/health", "/", "/docs", "/openapi.json") or path.startswith(("/web", "/static")):
            return True
        client = scope.get("client")
        authenticate(self.state, headers.get("x-api-key"), client[0] if client else "unknown")
        return True

    # -- routing -------------------------------------------------------------------------

    async def _route(self, scope: dict[str, Any], receive: Any, send: Any,
                     headers: dict[str, str], path: str, method: str, token_ok: bool) -> None:
        d = self.node.directory
        if method == "GET" and path.rstrip("/") in ("/sandboxes", "/machines", "/snapshots"):
            await self._merged(scope, send, headers, path.rstrip("/"))
            return
        if method == "POST" and path.rstrip("/") == "/sandboxes":
            await self._create(scope, receive, send, headers, None)
            return
        m = SNAPSHOT.match(path)
        if m:
            await self._snapshot(scope, receive, send, headers, method, m["id"], bool(m["rest"]))
            return
        sid = None
        m = SANDBOX.match(path)
        if m:
            sid = m["id"]
        else:
            m = MACHINE.match(path)
            if m:
                sid = await d.machine_sandbox(m["user"])
                if sid is None:
                    if method == "POST" and not m["rest"]:
                        await self._create(scope, receive, send, headers, m["user"])
                        return
                    await self.app(scope, receive, send)  # 404 from the route
                    return
        if sid is None:
            await self.app(scope, receive, send)
            return
        rec = await d.lookup(sid)
        if rec is None or self.node.owns(rec) and self._local(sid):
            await self.app(scope, receive, send)
            return
        if rec.node and d.alive(rec.node) and rec.node != self.node.name and not (
                rec.node in d.draining and rec.state == "sleeping" and _wakes(method, path)):
            await self._forward(scope, receive, send, headers, d.nodes[rec.node])
            return
        # Owner lost, drained (and this call wakes it), or this node without local records.
        if rec.state == "sleeping" and _wakes(method, path):
            await self._adopt_and_serve(scope, receive, send, headers, rec, token_ok)
            return
        if rec.node == self.node.name:
            await self.app(scope, receive, send)
            return
        await self._ownerless(scope, send, method, path, rec)

    def _local(self, sid: str) -> bool:
        m = self.node.manager
        rec = m.store.get(sid) if m else None
        return rec is not None and rec.state not in (State.DELETED, State.EXPIRED)

    async def _adopt_and_serve(self, scope: dict[str, Any], receive: Any, send: Any,
                               headers: dict[str, str], rec: SandboxObject, token_ok: bool) -> None:
        d = self.node.directory
        me = self.node.name
        here = self.node.info()  # this node's own figures, not the cache's
        if token_ok and H_ADOPT in headers or d.usable(me) and here.free > 0:
            if await self.node.adopt(rec.name):
                await self.app(scope, receive, send)
                return
            rec = await d.fresh(rec.name) or rec
            if rec.node and d.alive(rec.node):
                await self._forward(scope, receive, send, headers, d.nodes[rec.node])
                return
            raise Conflict(f"sandbox {rec.name} is being moved; retry", sandbox_id=rec.name)
        t = rec.spec.get("template") or {}
        need = Need(image_id=f"{t.get('image')}-{t.get('imageDigest')}", engine=t.get("engine"),
                    accel=t.get("accel"))
        nodes = rank([n for n in d.nodes.values() if d.usable(n.name) and n.free > 0], need,
                     here=me)
        if not nodes:
            raise Unavailable("no node can wake this sandbox now (every usable node is full "
                              "or drained); retry later", sandbox_id=rec.name, retry_after=5)
        await self._forward(scope, receive, send, headers, nodes[0], {H_ADOPT: "1"})

    async def _ownerless(self, scope: dict[str, Any], send: Any, method: str, path: str,
                         rec: SandboxObject) -> None:
        d = self.node.directory
        m = MACHINE.match(path)
        rest = (m or SANDBOX.match(path))["rest"] or ""  # type: ignore[index]
        if method == "GET" and rest in ("", "/"):
            body = _machine_view(rec, d.machines.get(m["user"], {})) if m else rec.status.get("view")
            await self._respond(send, 200, [(b"content-type", b"application/json")],
                                json.dumps(body).encode())
            return
        if method == "DELETE" and rest in ("", "/"):
            await d.remove(rec)
            if rec.snapshot:
                await self.node._drop_shared(rec.snapshot["id"])
            await self._respond(send, 204, [], b"")
            return
        raise Conflict(f"sandbox {rec.name} is {rec.state} (its node {rec.node or 'was lost'})",
                       sandbox_id=rec.name, state=rec.state)

    # -- creates ---------------------------------------------------------------------------

    async def _read_body(self, receive: Any) -> bytes:
        limit = self.node.settings.max_json_bytes
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if len(body) > limit:
                raise TooLarge(f"request body over {limit} bytes", limit_bytes=limit)
            if not msg.get("more_body"):
                return body

    async def _create(self, scope: dict[str, Any], receive: Any, send: Any,
                      headers: dict[str, str], user: str | None,
                      snapshot: dict[str, Any] | None = None) -> None:
        d = self.node.directory
        body = await self._read_body(receive)
        try:
            req = json.loads(body) if body.strip() else {}
        except ValueError:
            req = {}
        if not isinstance(req, dict):
            req = {}
        image = snapshot["image"] if snapshot else (req.get("image") or
                                                     self.node.settings.default_image)
        need = Need(image_name=str(image), engine=snapshot.get("engine") if snapshot else None,
                    accel=snapshot.get("accel") if snapshot else None,
                    prefer=snapshot.get("node") if snapshot else None)
        nodes = rank([n for n in d.nodes.values() if d.usable(n.name)], need,
                     here=self.node.name, limit=len(d.nodes))
        if not nodes:
            raise Unavailable("no usable node in the cluster (all drained or lost)",
                              retry_after=5)
        sid = new_id()
        labels = {"hangar.dev/user": user} if user else {}
        compare = [cmp_version(R.machine_key(user), 0)] if user else []

        def record(node: NodeInfo, k: int) -> SandboxObject:
            return SandboxObject(
                name=sid, labels=labels,
                spec={"operatingMode": "Running", "template": {"image": image}},
                status={"nodeName": node.name, "epoch": 1, "slot": k, "state": "creating"})

        def extra(node: NodeInfo) -> list[dict[str, Any]]:
            if not user:
                return []
            idle = req.get("idle_timeout") or self.node.settings.machine_idle_s
            return [op_put(R.machine_key(user), {"sandboxId": sid, "idleTimeoutSeconds": idle,
                                                 "createdAt": time.time()})]

        try:
            node, _ = await d.claim(sid, nodes, record, compare, extra)
        except Conflict:
            if user:  # another node made this user's machine meanwhile: route to it
                scope = dict(scope)
                again = await d.machine_sandbox(user)
                if again:
                    rec = await d.lookup(again)
                    if rec and rec.node and d.alive(rec.node) and rec.node != self.node.name:
                        await self._forward(scope, _replay(body), send, headers, d.nodes[rec.node])
                        return
                await self.app(scope, _replay(body), send)
                return
            raise
        status = await self._forward(scope, _replay(body), send, headers, node,
                                     {H_PLACED: sid}, local=node.name == self.node.name)
        if status not in (200, 201):
            cur = await d.fresh(sid)
            if cur is not None and cur.state == "creating":
                await d.remove(cur)

    async def _snapshot(self, scope: dict[str, Any], receive: Any, send: Any,
                        headers: dict[str, str], method: str, snap_id: str, fork: bool) -> None:
        d = self.node.directory
        meta = d.snapshots.get(snap_id)
        if meta is None:
            kv = await self.node.etcd.get(R.snapshot_key(snap_id))
            meta = kv.json() if kv else None
        if meta is None:
            await self.app(scope, receive, send)
            return
        if fork and method == "POST":
            await self._create(scope, receive, send, headers, None, snapshot=meta)
            return
        owner = meta.get("node")
        if owner and owner != self.node.name and d.alive(owner):
            status = await self._forward(scope, receive, send, headers, d.nodes[owner])
        else:
            m = self.node.manager
            if m is not None and m.store.find(SnapshotRecord, snap_id) is None:
                if method == "GET":
                    await self._respond(send, 200, [(b"content-type", b"application/json")],
                                        json.dumps(_snapshot_view(meta)).encode())
                    return
                if method == "DELETE":
                    status = 204
                    await self._respond(send, 204, [], b"")
                else:
                    raise NotFound(f"no snapshot {snap_id}", snapshot_id=snap_id)
            else:
                status = await self._forward(scope, receive, send, headers, None, local=True)
        if method == "DELETE" and status == 204:
            await self.node.etcd.delete(R.snapshot_key(snap_id))
            await self.node._drop_shared(snap_id)

    # -- merged lists ------------------------------------------------------------------------

    async def _merged(self, scope: dict[str, Any], send: Any, headers: dict[str, str],
                      path: str) -> None:
        d = self.node.directory
        field = {"/sandboxes": "sandboxes", "/machines": "machines",
                 "/snapshots": "snapshots"}[path]
        query = scope.get("query_string", b"").decode()
        fwd = {k: v for k, v in headers.items() if k not in HOP}
        fwd[H_LOCAL] = "1"
        fwd[H_TOKEN] = self.node.config.node_token if self.node.config else ""

        async def one(n: NodeInfo) -> tuple[str, list[dict[str, Any]]]:
            try:
                r = await self.http.get(f"{n.url}{path}" + (f"?{query}" if query else ""),
                                        headers=fwd, timeout=10)
                if r.status_code == 200:
                    return n.name, r.json().get(field, [])
            except (httpx.HTTPError, ValueError):
                pass
            return n.name, []

        results = await asyncio.gather(*(one(n) for n in list(d.nodes.values())))
        items: dict[str, dict[str, Any]] = {}
        for node, lst in results:
            for item in lst:
                key = item.get("id") or item.get("user_id")
                sid = item.get("sandbox_id") if field == "machines" else item.get("id")
                rec = d.sandboxes.get(sid) if field != "snapshots" else None
                if field != "snapshots" and rec is not None and rec.node != node:
                    continue
                items[key] = item
        if field == "sandboxes":
            for sid, rec in d.sandboxes.items():
                if sid not in items and not d.alive(rec.node) and rec.status.get("view"):
                    items[sid] = rec.status["view"]
        elif field == "machines":
            for user, m in d.machines.items():
                rec = d.sandboxes.get(m.get("sandboxId", ""))
                if user not in items and rec is not None and not d.alive(rec.node):
                    items[user] = _machine_view(rec, m)
        elif field == "snapshots":
            for sid, meta in d.snapshots.items():
                items.setdefault(sid, _snapshot_view(meta))
        out = sorted(items.values(), key=lambda i: i.get("created_at") or 0)
        await self._respond(send, 200, [(b"content-type", b"application/json")],
                            json.dumps({field: out}).encode())

    # -- forwarding ------------------------------------------------------------------------

    async def _forward(self, scope: dict[str, Any], receive: Any, send: Any,
                       headers: dict[str, str], node: NodeInfo | None,
                       extra: dict[str, str] | None = None, local: bool = False) -> int:
        """Serve the request on ``node`` (or here, ``local``); returns the answer's status."""
        if local or node is None or node.name == self.node.name:
            status = {"code": 0}

            async def send_status(msg: dict[str, Any]) -> None:
                if msg["type"] == "http.response.start":
                    status["code"] = msg["status"]
                await send(msg)

            tok = placed_id.set((extra or {}).get(H_PLACED)) if extra and H_PLACED in extra \
                else None
            try:
                await self.app(scope, receive, send_status)
            finally:
                if tok is not None:
                    placed_id.reset(tok)
            return status["code"]
        hdrs = [(k, v) for k, v in headers.items() if k not in HOP]
        client = scope.get("client")
        if client:
            prior = headers.get("x-forwarded-for")
            hdrs = [(k, v) for k, v in hdrs if k != "x-forwarded-for"]
            hdrs.append(("x-forwarded-for", f"{prior}, {client[0]}" if prior else client[0]))
        if extra:
            hdrs += list(extra.items())
            if self.node.config:
                hdrs.append((H_TOKEN, self.node.config.node_token))
        if "host" in headers:
            hdrs.append(("host", headers["host"]))
        qs = scope.get("query_string", b"").decode()
        target = f"{node.url}{_quote_path(scope['path'])}" + (f"?{qs}" if qs else "")
        if scope["type"] == "websocket":
            from hangar.cluster.wsproxy import relay

            await relay(scope, receive, send, target.replace("http://", "ws://", 1), hdrs)
            return 101
        if "content-length" in headers:
            hdrs.append(("content-length", headers["content-length"]))

        async def body() -> AsyncIterator[bytes]:
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    return
                chunk = msg.get("body", b"")
                if chunk:
                    yield chunk
                if not msg.get("more_body"):
                    return

        method = scope["method"]
        has_body = method in ("POST", "PUT", "PATCH", "DELETE")
        req = self.http.build_request(method, target, headers=hdrs,
                                      content=body() if has_body else None)
        try:
            resp = await self.http.send(req, stream=True)
        except httpx.HTTPError as exc:
            raise Unavailable(f"node {node.name} ({node.address}) did not answer: "
                              f"{type(exc).__name__}; retry", node=node.name,
                              retry_after=2) from None
        try:
            out = [(k.encode(), v.encode("latin-1")) for k, v in resp.headers.multi_items()
                   if k.lower() not in HOP or k.lower() == "content-length"]
            await send({"type": "http.response.start", "status": resp.status_code,
                        "headers": out})
            async for chunk in resp.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await resp.aclose()
        return resp.status_code

    @staticmethod
    async def _respond(send: Any, status: int, headers: list[tuple[bytes, bytes]],
                       body: bytes) -> None:
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    @staticmethod
    async def _deny_ws(receive: Any, send: Any, status: int, headers: list[tuple[bytes, bytes]],
                       body: bytes) -> None:
        msg = await receive()
        if msg["type"] != "websocket.connect":
            return
        await send({"type": "websocket.http.response.start", "status": status,
                    "headers": headers})
        await send({"type": "websocket.http.response.body", "body": body})


def _quote_path(path: str) -> str:
    from urllib.parse import quote

    return quote(path, safe="/:@!$&'()*+,;=-._~")


def _replay(body: bytes) -> Any:
    sent = {"done": False}

    async def receive() -> dict[str, Any]:
        if sent["done"]:
            await asyncio.Event().wait()
        sent["done"] = True
        return {"type": "http.request", "body": body, "more_body": False}

    return receive


def _wakes(method: str, path: str) -> bool:
    """True when the call needs the sandbox running (anything but reading or deleting it)."""
    m = SANDBOX.match(path) or MACHINE.match(path)
    rest = (m["rest"] or "") if m else ""
    if rest in ("", "/"):
        return method not in ("GET", "DELETE")
    return True


def _machine_view(rec: SandboxObject, m: dict[str, Any]) -> dict[str, Any]:
    t = rec.spec.get("template") or {}
    state = State(rec.state) if rec.state in State._value2member_map_ else None
    return {"user_id": rec.user, "sandbox_id": rec.name,
            "state": NAMES.get(state, rec.state) if state else rec.state,
            "desired_state": "sleeping" if rec.spec.get("operatingMode") == "Suspended"
            or rec.state == "sleeping" else "active",
            "idle_timeout_s": float(m.get("idleTimeoutSeconds") or 0),
            "last_active_at": float(t.get("lastActiveAt") or rec.created_at),
            "created_at": float(m.get("createdAt") or rec.created_at)}


def _snapshot_view(meta: dict[str, Any]) -> dict[str, Any]:
    from hangar.images import image_id

    return {"id": meta["id"], "sandbox_id": meta.get("sandboxId"),
            "size_bytes": int(meta.get("sizeBytes", 0)), "created_at": meta.get("createdAt"),
            "image": meta.get("image"),
            "image_id": image_id(meta.get("image", ""), meta.get("imageDigest", "")),
            "vcpus": meta.get("vcpus"), "memory_mib": meta.get("memoryMiB"),
            "disk_mib": meta.get("diskMiB")}


def install(app: Any, node: ClusterNode) -> Any:
    """Wrap ``app`` (the FastAPI app) with the gateway; returns the ASGI app to serve."""
    return Gateway(app, node, app.state)
