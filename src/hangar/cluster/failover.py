"""The failover reconciler: what happens to the sandboxes of a node whose lease expired.

It runs on one node at a time, the one elected through etcd
(``hangar.cluster.membership``). Every second it looks for records whose
``nodeName`` holds no lease; ``failover_after_s`` seconds after it first
saw such a node gone (a margin over the fencing of a node that is only
cut off: it stops its VMMs before its lease ends), it rewrites each of
that node's records by compare-and-set, raising the epoch so that the
lost node, if it comes back, knows its VMMs are stale:

====================================  =============================================
the record was                         it becomes
====================================  =============================================
``sleeping``                           ``sleeping``, no owner: any node may wake it
a machine that had been asleep once    ``sleeping`` at its last snapshot in shared
(any state but sleeping)               storage, no owner (what ran since is lost)
``creating``                           removed (the create's caller got an error)
anything else                          ``failed``, no owner (``error`` says why);
                                       it can be deleted
====================================  =============================================

and the node's VM slots are freed.
"""

from __future__ import annotations

import asyncio
import logging
import time

from hangar.cluster import records as R
from hangar.cluster.directory import Directory
from hangar.cluster.membership import Membership
from hangar.cluster.records import SandboxObject

log = logging.getLogger("hangar.cluster.failover")

INTERVAL_S = 1.0


class Failover:
    """Hands on the sandboxes of lost nodes; acts only while this node is the leader."""

    def __init__(self, directory: Directory, membership: Membership, after_s: float) -> None:
        self.directory = directory
        self.membership = membership
        self.after_s = after_s
        self._gone_since: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="failover")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(INTERVAL_S)
            if not self.membership.leader or not self.membership.writable():
                self._gone_since.clear()
                continue
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("failover pass failed")

    def lost_nodes(self) -> set[str]:
        """Nodes named by a record or a slot that hold no lease."""
        d = self.directory
        named = {r.node for r in d.sandboxes.values() if r.node}
        named |= {n for n, slots in d.slots.items() if slots}
        return {n for n in named if not d.alive(n)}

    async def tick(self) -> None:
        now = time.monotonic()
        lost = self.lost_nodes()
        for name in list(self._gone_since):
            if name not in lost:
                del self._gone_since[name]
        for name in lost:
            since = self._gone_since.setdefault(name, now)
            if now - since >= self.after_s:
                await self.hand_on(name)

    async def hand_on(self, node: str) -> None:
        """Rewrite every record of lost ``node`` (see the module docstring), free its slots."""
        d = self.directory
        moved = 0
        for sid in [s for s, r in d.sandboxes.items() if r.node == node]:
            rec = await d.fresh(sid)
            if rec is None or rec.node != node:
                continue
            if rec.state == "creating":
                await d.remove(rec)
                moved += 1
                continue
            if await d.update(sid, lambda r: hand_on(r, node)) is not None:
                moved += 1
        if d.slots.get(node):
            await d.etcd.delete(f"{R.SLOTS}{node}/", prefix=True)
        d.slots.pop(node, None)
        self._gone_since.pop(node, None)
        log.warning("lost node's sandboxes handed on", extra={"node": node, "count": moved})


def hand_on(rec: SandboxObject, node: str) -> bool:
    """Edit ``rec`` of lost ``node`` as the module docstring says; False: not that node's."""
    if rec.node != node:
        return False
    st = rec.status
    was = rec.state
    st["nodeName"] = None
    st["epoch"] = rec.epoch + 1
    st["slot"] = None
    st["podIPs"] = []
    view = dict(st.get("view") or {})
    if was == "sleeping" or (rec.user and rec.snapshot):
        st["state"] = "sleeping"
        view.update(state="sleeping",
                    error=None if was == "sleeping" else
                    f"node {node} was lost; back to its last snapshot")
    else:
        st["state"] = "failed"
        view.update(state="failed", error=f"node {node} was lost while the sandbox was {was}")
    st["view"] = view
    return True
