"""Merged lists: ``GET /sandboxes``, ``/machines`` and ``/snapshots`` across every node.

Each live node is asked for its own list (``X-Hangar-Local``, with the node
token); an item counts only from the node its record names, so a sandbox
met twice during a move is listed once. Records of lost nodes are added
from the directory: a sandbox as its node last showed it (``status.view``,
in the state the failover moved it to), a machine from its record, and
every shared user snapshot. A team's key (or an operator's acting for a
team) gets its team's items only: each node's part is filtered by that
node's API, the records added here by their team (``hangar.dev/team``, a
snapshot's ``team``, a machine's ``TEAM/`` user id). A node that does not
answer within ``NODE_TIMEOUT_S`` adds nothing.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from hangar.cluster.directory import Directory
from hangar.cluster.forwarding import H_LOCAL, H_TOKEN, Answer, json_answer, passed
from hangar.cluster.records import NodeInfo, SandboxObject
from hangar.core.service import NAMES, State, acting, desired_name, name_visible, unscoped
from hangar.images import image_id

NODE_TIMEOUT_S = 10.0
"""How long a merged list waits for one node's part, seconds."""

LISTS = {"/sandboxes": "sandboxes", "/machines": "machines", "/snapshots": "snapshots"}
"""Merged paths and the field of their answer that holds the items."""


def machine_view(rec: SandboxObject, m: dict[str, Any]) -> dict[str, Any]:
    """A machine (``MachineInfo``'s fields) from its sandbox's record and machine record."""
    t = rec.spec.get("template") or {}
    asleep = rec.desired == State.SLEEPING or rec.state == State.SLEEPING
    return {"user_id": unscoped(rec.user or ""), "sandbox_id": rec.name,
            "state": NAMES[rec.state],
            "desired_state": desired_name(State.SLEEPING if asleep else State.RUNNING),
            "idle_timeout_s": float(m.get("idleTimeoutSeconds") or 0),
            "last_active_at": float(t.get("lastActiveAt") or rec.created_at),
            "created_at": float(m.get("createdAt") or rec.created_at)}


def snapshot_view(meta: dict[str, Any]) -> dict[str, Any]:
    """A shared snapshot (``Snapshot``'s fields) from its metadata in etcd."""
    return {"id": meta["id"], "sandbox_id": meta.get("sandboxId"),
            "size_bytes": int(meta.get("sizeBytes", 0)), "created_at": meta.get("createdAt"),
            "image": meta.get("image"),
            "image_id": image_id(str(meta.get("image", "")), str(meta.get("imageDigest", ""))),
            "vcpus": meta.get("vcpus"), "memory_mib": meta.get("memoryMiB"),
            "disk_mib": meta.get("diskMiB")}


class Merger:
    """Builds the merged lists of a cluster."""

    def __init__(self, directory: Directory, http: httpx.AsyncClient, token: Any) -> None:
        self.directory = directory
        self.http = http
        self.token = token

    async def merged(self, scope: dict[str, Any], headers: dict[str, str],
                     path: str) -> Answer:
        """The answer to ``GET path`` (one of ``LISTS``) for the whole cluster."""
        d = self.directory
        field = LISTS[path]
        query = scope.get("query_string", b"").decode("latin-1")
        fwd = {k: v for k, v in headers.items() if passed(k)}
        fwd[H_LOCAL] = "1"
        fwd[H_TOKEN] = self.token()

        async def one(n: NodeInfo) -> tuple[str, list[dict[str, Any]]]:
            try:
                r = await self.http.get(f"{n.url}{path}" + (f"?{query}" if query else ""),
                                        headers=fwd, timeout=NODE_TIMEOUT_S)
                if r.status_code == 200:
                    items = r.json().get(field, [])
                    return n.name, [i for i in items if isinstance(i, dict)]
            except (httpx.HTTPError, ValueError, AttributeError):
                pass
            return n.name, []

        results = await asyncio.gather(*(one(n) for n in list(d.nodes.values())))
        items: dict[str, dict[str, Any]] = {}
        for node, lst in results:
            for item in lst:
                key = str(item.get("id") or item.get("user_id") or "")
                sid = str(item.get("sandbox_id") if field == "machines" else key)
                rec = d.sandboxes.get(sid) if field != "snapshots" else None
                if field != "snapshots" and rec is not None and rec.node != node:
                    continue
                items[key] = item
        team = acting()  # a team sees its own only, as each node's part shows it
        if field == "sandboxes":
            for sid, rec in d.sandboxes.items():
                view = rec.status.get("view")
                if sid not in items and not d.alive(rec.node) and isinstance(view, dict) \
                        and (team is None or rec.team == team):
                    items[sid] = view
        elif field == "machines":
            for user, m in d.machines.items():
                rec = d.sandboxes.get(m.get("sandboxId", ""))
                shown = unscoped(user)
                if shown not in items and rec is not None and not d.alive(rec.node) \
                        and name_visible(user):
                    items[shown] = machine_view(rec, m)
        else:
            for sid, meta in d.snapshots.items():
                if team is None or meta.get("team") == team:
                    items.setdefault(sid, snapshot_view({**meta, "id": sid}))
        out = sorted(items.values(), key=lambda i: i.get("created_at") or 0)
        return json_answer(200, {field: out})
