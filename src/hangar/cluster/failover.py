"""The failover reconciler: what happens to the sandboxes of a node whose lease expired.

It runs on one node at a time, the one elected through etcd
(``hangar.cluster.membership``). Every second it looks for records whose
``nodeName`` holds no lease; ``failover_after_s`` seconds after it first
saw such a node gone (a margin over the fencing of a node that is only
cut off: it stops its VMMs before its lease ends), or ``restart_grace_s``
when the node left a restart mark at a graceful stop (its VMMs run on while
it restarts: ``hangar.cluster.membership``), it rewrites each of
that node's records by compare-and-set, raising the epoch so that the
lost node, if it comes back, knows its VMMs are stale. Each state change
is one edge of ``hangar.core.lifecycle.MOVES`` (``landing``), the ones only
a failover makes under their guard:

=========================================  ==========================================
the record was                             it becomes (edge, guard)
=========================================  ==========================================
``sleeping``, ``failed``                   the same, no owner: any node may wake it
``waking`` with a shared snapshot          ``sleeping`` (nothing ran since)
a machine with a shared snapshot, in       ``sleeping`` at that snapshot, no owner
``running``, ``unresponsive``,             (``back_to_snapshot``: what ran since is
``snapshotting`` or ``restoring``          lost)
``stopping``                               ``failed`` (it can be deleted)
``creating`` (or a tombstone)              removed (the create's caller got an error)
anything else                              ``failed``, no owner (``node_lost``;
                                           ``error`` says why); it can be deleted
=========================================  ==========================================

and the node's VM slots are freed. A record that cannot be read or moved is
left as it is and logged; the others are still handed on.
"""

from __future__ import annotations

import logging
import time

from hangar.cluster import records as R
from hangar.cluster.directory import Directory
from hangar.cluster.membership import Membership
from hangar.cluster.records import SandboxObject
from hangar.core.service import GONE, Guard, IllegalTransition, State, Tasks, every
from hangar.errors import Conflict

log = logging.getLogger("hangar.cluster.failover")

INTERVAL_S = 1.0


class Failover:
    """Hands on the sandboxes of lost nodes; acts only while this node is the leader."""

    def __init__(self, directory: Directory, membership: Membership, after_s: float,
                 grace_s: float = 0.0) -> None:
        self.directory = directory
        self.membership = membership
        self.after_s = after_s
        self.grace_s = grace_s
        """Seconds to wait instead for a node that left a restart mark (at least after_s)."""
        self._gone_since: dict[str, float] = {}
        self._tasks = Tasks("failover")

    def start(self) -> None:
        self._tasks.start("run", every(INTERVAL_S, self._pass, log, "failover pass failed"))

    async def close(self) -> None:
        await self._tasks.stop()

    async def _pass(self) -> None:
        if not self.membership.leader or not self.membership.writable():
            self._gone_since.clear()
            return
        await self.tick()

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
            wait = self.after_s
            if name in self.directory.restarting:
                wait = max(wait, self.grace_s)
            if now - since >= wait:
                await self.hand_on(name)

    async def hand_on(self, node: str) -> None:
        """Rewrite every record of lost ``node`` (see the module docstring), free its slots."""
        d = self.directory
        moved = 0
        for sid in [s for s, r in d.sandboxes.items() if r.node == node]:
            try:
                rec = await d.fresh(sid)
                if rec is None or rec.node != node:
                    continue
                if rec.state in UNFINISHED:
                    await d.remove(rec)
                    moved += 1
                    continue
                if await d.update(sid, lambda r: hand_on(r, node)) is not None:
                    moved += 1
            except (Conflict, IllegalTransition) as exc:
                log.error("lost node's record not handed on", extra={
                    "sandbox_id": sid, "node": node, "error": str(exc)})
        if d.slots.get(node):
            await d.etcd.delete(f"{R.SLOTS}{node}/", prefix=True)
        d.slots.pop(node, None)
        self._gone_since.pop(node, None)
        log.warning("lost node's sandboxes handed on", extra={"node": node, "count": moved})


UNFINISHED: frozenset[State] = frozenset({State.CREATING, State.POOLED}) | GONE
"""States whose record a failover removes: a create that never finished (its caller got an
error), or records no node should have written (tombstones, pool VMs)."""


def landing(rec: SandboxObject) -> tuple[State, Guard | None]:
    """Where a record of a lost node goes, and the guard of that move (module docstring)."""
    was = rec.state
    if was in (State.SLEEPING, State.FAILED):
        return was, None
    if was == State.WAKING and rec.snapshot:
        return State.SLEEPING, None
    if was == State.STOPPING:
        return State.FAILED, None
    if rec.user and rec.snapshot and was in (State.RUNNING, State.UNRESPONSIVE,
                                             State.SNAPSHOTTING, State.RESTORING):
        return State.SLEEPING, Guard.BACK_TO_SNAPSHOT
    return State.FAILED, Guard.NODE_LOST


def hand_on(rec: SandboxObject, node: str) -> bool:
    """Edit ``rec`` of lost ``node`` as the module docstring says; False: not that node's.
    Raises ``IllegalTransition`` for a state a failover has no edge from."""
    if rec.node != node:
        return False
    was = rec.state
    to, guard = landing(rec)
    rec.move(to, guard)
    st = rec.status
    st.update(nodeName=None, epoch=rec.epoch + 1, slot=None, podIPs=[])
    if to != was:
        why = (f"node {node} was lost; back to its last snapshot" if to == State.SLEEPING
               else f"node {node} was lost while the sandbox was {was.value}")
        st["view"] = {**(st.get("view") or {}), "error": why}
    return True
