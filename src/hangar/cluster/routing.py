"""Routing: which node serves a request, by the owner of the sandbox it names.

For a path that names a sandbox (``/sandboxes/{id}`` and everything under
it, HTTP and WebSocket alike, so routes added later are covered too) or a
machine (``/machines/{user}...``), the owner comes from the directory cache
(fed by an etcd watch: no round trip in the common case):

==========================================  =======================================
the owner is                                the request is
==========================================  =======================================
this node                                   served here
another live node                           forwarded there (``hangar.cluster
                                            .forwarding``)
lost or drained, the sandbox sleeping,      a wake: this node adopts it (or the best
and the call would wake it                  node does, forwarded with an adopt mark)
lost, the sandbox failed or sleeping,       answered from its record (GET), removed
and the call reads or deletes it            (DELETE); other calls 409
==========================================  =======================================

Creates (``POST /sandboxes``, ``POST /machines/{user}`` for a new user,
``POST /snapshots/{id}/sandboxes``) are placed (``hangar.cluster.placement``)
and claimed first (sandbox id, VM slot, machine key: one compare-and-set),
then made on the chosen node with that placement; a refused create gives its
claim back. A shared snapshot is served by the node that made it while it
lives, else from its metadata here.

Teams (``hangar.cluster.teams``): a request acting for a team (its key's, or
an operator's ``X-Hangar-Team``) finds its machines under ``TEAM/user``, gets
404 for a sandbox or snapshot of another team (worded as the owner words a
missing one) before anything is forwarded, adopted or answered from a record,
and its creates carry the label ``hangar.dev/team`` and are claimed within
the team's quotas (``within_quota``: counted on every node's records).
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

from hangar import json_items
from hangar.cluster import records as R
from hangar.cluster.etcd import cmp_version, op_put
from hangar.cluster.forwarding import (
    H_ADOPT, H_PLACED, Forwarder, json_answer, replay, respond,
)
from hangar.cluster.merging import machine_view, snapshot_view
from hangar.cluster.node import ClusterNode
from hangar.cluster.placement import Need, rank
from hangar.cluster.records import NodeInfo, SandboxObject
from hangar.cluster.teams import within_quota
from hangar.core.service import GONE, USER_ID, State, Usage, acting, new_id, scoped
from hangar.errors import Conflict, InvalidRequest, NotFound, TooLarge, Unavailable

CREATE_ITEMS = json_items.MAX_ITEMS
"""Most JSON values of a create's body (the limit each node's API applies to every body)."""
SANDBOX = re.compile(r"^/sandboxes/(?P<id>[^/]+)(?P<rest>/.*)?$")
MACHINE = re.compile(r"^/machines/(?P<user>[^/]+)(?P<rest>/.*)?$")
SNAPSHOT = re.compile(r"^/snapshots/(?P<id>[^/]+)(?P<rest>/sandboxes)?/?$")


def wakes(method: str, path: str) -> bool:
    """True when the call needs the sandbox running (anything but reading or deleting it)."""
    m = SANDBOX.match(path) or MACHINE.match(path)
    rest = (m["rest"] or "") if m else ""
    if rest in ("", "/"):
        return method not in ("GET", "DELETE")
    return True


class Router:
    """Sends each request to the node that should serve it."""

    def __init__(self, app: Any, node: ClusterNode, forwarder: Forwarder) -> None:
        self.app = app
        self.node = node
        self.fwd = forwarder

    async def route(self, scope: dict[str, Any], receive: Any, send: Any,
                    headers: dict[str, str], path: str, method: str, token_ok: bool) -> None:
        """Serve, forward, adopt, or answer from the record (module docstring)."""
        d = self.node.directory
        team = acting()
        if method == "POST" and path.rstrip("/") == "/sandboxes":
            await self.create(scope, receive, send, headers, None)
            return
        m = SNAPSHOT.match(path)
        if m:
            await self.snapshot(scope, receive, send, headers, method, m["id"], bool(m["rest"]))
            return
        sid = None
        m = SANDBOX.match(path)
        if m:
            sid = m["id"]
        else:
            m = MACHINE.match(path)
            if m and not USER_ID.fullmatch(m["user"]):
                await self.app(scope, receive, send)  # the route's own 400 or 404
                return
            if m:
                sid = await d.machine_sandbox(scoped(m["user"], team))
                if sid is None:
                    if method == "POST" and not m["rest"]:
                        await self.create(scope, receive, send, headers,
                                          scoped(m["user"], team))
                        return
                    await self.app(scope, receive, send)  # 404 from the route
                    return
        if sid is None:
            await self.app(scope, receive, send)
            return
        rec = await d.lookup(sid)
        if rec is not None and team is not None and rec.team != team:
            raise NotFound(f"no sandbox {sid}", sandbox_id=sid)  # as the owner words it
        if rec is None or self.node.owns(rec) and self._local(sid):
            await self.app(scope, receive, send)
            return
        if rec.node and d.alive(rec.node) and rec.node != self.node.name and not (
                rec.node in d.draining and rec.state == State.SLEEPING and wakes(method, path)):
            await self.fwd.forward(scope, receive, send, headers, d.nodes[rec.node])
            return
        # Owner lost, drained (and this call wakes it), or this node without local records.
        if rec.state == State.SLEEPING and wakes(method, path):
            await self._adopt_and_serve(scope, receive, send, headers, rec, token_ok)
            return
        if rec.node == self.node.name:
            await self.app(scope, receive, send)
            return
        await self._ownerless(send, method, path, rec)

    def _local(self, sid: str) -> bool:
        m = self.node.manager
        rec = m.find(sid) if m else None
        return rec is not None and rec.state not in GONE

    async def _adopt_and_serve(self, scope: dict[str, Any], receive: Any, send: Any,
                               headers: dict[str, str], rec: SandboxObject,
                               token_ok: bool) -> None:
        d = self.node.directory
        me = self.node.name
        here = self.node.info()  # this node's own figures, not the cache's
        if token_ok and H_ADOPT in headers or d.usable(me) and here.free > 0:
            if await self.node.adopt(rec.name):
                await self.app(scope, receive, send)
                return
            rec = await d.fresh(rec.name) or rec
            if rec.node and d.alive(rec.node):
                await self.fwd.forward(scope, receive, send, headers, d.nodes[rec.node])
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
        await self.fwd.forward(scope, receive, send, headers, nodes[0], {H_ADOPT: "1"})

    async def _ownerless(self, send: Any, method: str, path: str, rec: SandboxObject) -> None:
        d = self.node.directory
        m = MACHINE.match(path)
        rest = (m or SANDBOX.match(path))["rest"] or ""  # type: ignore[index]
        if method == "GET" and rest in ("", "/"):
            view = rec.status.get("view")
            body = machine_view(rec, d.machines.get(rec.user or "", {})) if m else view
            if not isinstance(body, dict):
                raise Conflict(f"sandbox {rec.name} has no view in its cluster record",
                               sandbox_id=rec.name)
            await respond(send, json_answer(200, body))
            return
        if method == "DELETE" and rest in ("", "/"):
            await d.remove(rec)
            if rec.snapshot:
                await self.node.drop_shared(rec.snapshot["id"])
            await respond(send, (204, [], b""))
            return
        raise Conflict(f"sandbox {rec.name} is {rec.state.value} (its node "
                       f"{rec.node or 'was lost'})", sandbox_id=rec.name,
                       state=rec.state.value)

    # -- creates ---------------------------------------------------------------------------

    async def _read_body(self, receive: Any) -> bytes:
        """The create's body, whatever its content type, at most ``max_json_bytes`` and
        ``CREATE_ITEMS`` JSON values (counted as it arrives: it is parsed here, on the
        loop; review 29g G-M1). Raises TooLarge."""
        limit = self.node.settings.max_json_bytes
        body = bytearray()
        counter = json_items.Items(CREATE_ITEMS)
        while True:
            msg = await receive()
            piece = msg.get("body", b"")
            body += piece
            if len(body) > limit:
                raise TooLarge(f"request body over {limit} bytes", limit_bytes=limit)
            if counter.feed(piece):
                raise TooLarge(f"the create's JSON body holds more than {CREATE_ITEMS} "
                               "values (or is not UTF-8), the limit", limit_items=CREATE_ITEMS)
            if not msg.get("more_body"):
                return bytes(body)

    async def create(self, scope: dict[str, Any], receive: Any, send: Any,
                     headers: dict[str, str], user: str | None,
                     snapshot: dict[str, Any] | None = None) -> None:
        """Place a create (a new sandbox, a user's first machine, a fork of ``snapshot``):
        claim an id and a VM slot on the best node, then make it there; a create that
        fails gives the claim back. Raises Unavailable (no usable node), LimitExceeded
        (no free slot), Conflict (another node acted first), TooLarge."""
        d = self.node.directory
        body = await self._read_body(receive)
        try:
            req = json.loads(body.decode("utf-8")) if body.strip() else {}
        except (ValueError, RecursionError):  # the route answers the bad body
            req = {}
        if not isinstance(req, dict):
            req = {}
        image = snapshot.get("image") if snapshot else (req.get("image") or
                                                         self.node.settings.default_image)
        if not image:
            raise Conflict("the snapshot's cluster record names no image")
        if not isinstance(image, str) or not R.IMAGE_NAME.fullmatch(image):
            raise InvalidRequest(f"bad image name {str(image)[:80]!r}")
        need = Need(image_name=str(image), engine=snapshot.get("engine") if snapshot else None,
                    accel=snapshot.get("accel") if snapshot else None,
                    prefer=snapshot.get("node") if snapshot else None)
        nodes = rank([n for n in d.nodes.values() if d.usable(n.name)], need,
                     here=self.node.name, limit=len(d.nodes))
        if not nodes:
            raise Unavailable("no usable node in the cluster (all drained or lost)",
                              retry_after=5)
        sid = new_id()
        team = acting()
        labels = {**({R.USER_LABEL: user} if user else {}),
                  **({R.TEAM_LABEL: team} if team else {})}
        compare = [cmp_version(R.machine_key(user), 0)] if user else []
        need = self._need(req, snapshot)

        def record(node: NodeInfo, k: int) -> SandboxObject:
            rec = SandboxObject(
                name=sid, labels=labels,
                spec={"template": {"image": image, "vcpus": need.vcpus,
                                   "memoryMiB": need.memory_mib, "diskMiB": need.disk_mib}},
                status={"nodeName": node.name, "epoch": 1, "slot": k,
                        "state": State.CREATING.value})
            rec.want(State.RUNNING)
            return rec

        def extra(node: NodeInfo) -> list[dict[str, Any]]:
            if not user:
                return []
            idle = req.get("idle_timeout")
            if isinstance(idle, bool) or not isinstance(idle, (int, float)) \
                    or not 0 < idle <= 10 ** 8:
                idle = self.node.settings.machine_idle_s  # the route refuses a bad one
            return [op_put(R.machine_key(user), {"sandboxId": sid, "idleTimeoutSeconds": idle,
                                                 "createdAt": time.time()})]

        try:
            node, _ = await within_quota(
                self.node.etcd, team, need,
                lambda q_compare, q_ops: d.claim(sid, nodes, record, compare + q_compare,
                                                 lambda n: extra(n) + q_ops))
        except Conflict:
            if user:  # another node made this user's machine meanwhile: route to it
                again = await d.machine_sandbox(user)
                if again:
                    rec = await d.lookup(again)
                    if rec and rec.node and d.alive(rec.node) and rec.node != self.node.name:
                        await self.fwd.forward(scope, replay(body), send, headers,
                                               d.nodes[rec.node])
                        return
                await self.app(scope, replay(body), send)
                return
            raise
        status = await self.fwd.forward(scope, replay(body), send, headers, node,
                                        {H_PLACED: sid}, local=node.name == self.node.name)
        if status not in (200, 201):
            cur = await d.fresh(sid)
            if cur is not None and cur.state == State.CREATING:
                await d.remove(cur)

    def _need(self, req: dict[str, Any], snapshot: dict[str, Any] | None) -> Usage:
        """What the create asks of its team's quotas: one sandbox, with the vCPUs, memory and
        disk its body (or the snapshot forked) names, the node's defaults for those left
        out (the route refuses bad ones)."""
        s = self.node.settings
        src = ({"vcpus": snapshot.get("vcpus"), "memory_mib": snapshot.get("memoryMiB"),
                "disk_mib": snapshot.get("diskMiB")} if snapshot else req)

        def n(k: str, default: int) -> int:
            v = src.get(k)
            return v if isinstance(v, int) and not isinstance(v, bool) and 0 < v < 1 << 30 \
                else default
        return Usage(1, n("vcpus", s.default_vcpus), n("memory_mib", s.default_memory_mib),
                     n("disk_mib", s.default_disk_mib))

    # -- shared snapshots ---------------------------------------------------------------------

    async def snapshot(self, scope: dict[str, Any], receive: Any, send: Any,
                       headers: dict[str, str], method: str, snap_id: str, fork: bool) -> None:
        """A request about snapshot ``snap_id``: a fork is a create; others go to the node
        that made it, else are answered from its shared metadata."""
        d = self.node.directory
        meta = d.snapshots.get(snap_id) if R.SNAPSHOT_ID.fullmatch(snap_id) else None
        if meta is None and R.SNAPSHOT_ID.fullmatch(snap_id):
            kv = await self.node.etcd.get(R.snapshot_key(snap_id))
            if kv is not None:
                try:
                    meta = R.snapshot_meta(R.load_json(kv.value), snap_id)
                except R.BadRecord as exc:
                    raise Conflict(f"snapshot {snap_id}'s cluster record is unreadable "
                                   f"({exc}); an operator must fix or delete "
                                   f"{R.snapshot_key(snap_id)}", snapshot_id=snap_id) from None
        if not isinstance(meta, dict):
            await self.app(scope, receive, send)
            return
        team = acting()
        if team is not None and meta.get("team") != team:
            raise NotFound(f"no snapshot {snap_id}", snapshot_id=snap_id)  # as a node words it
        if fork and method == "POST":
            await self.create(scope, receive, send, headers, None, snapshot=meta)
            return
        owner = meta.get("node")
        if owner and owner != self.node.name and d.alive(owner):
            status = await self.fwd.forward(scope, receive, send, headers, d.nodes[owner])
        else:
            m = self.node.manager
            if m is not None and not m.has_snapshot(snap_id):
                if method == "GET":
                    await respond(send, json_answer(200, snapshot_view({**meta, "id": snap_id})))
                    return
                if method == "DELETE":
                    status = 204
                    await respond(send, (204, [], b""))
                else:
                    raise NotFound(f"no snapshot {snap_id}", snapshot_id=snap_id)
            else:
                status = await self.fwd.forward(scope, receive, send, headers, None, local=True)
        if method == "DELETE" and status == 204:
            await self.node.etcd.delete(R.snapshot_key(snap_id))
            await self.node.drop_shared(snap_id)
