"""Events published from state changes: one listener on ``Store.transition``.

Because every state change goes through ``Store.transition``, the events
that follow a move are published here, once, after it is committed:

===================================  ==========================================
move                                  event (``data``)
===================================  ==========================================
any ``-> deleted``                    ``sandbox.deleted``
any ``-> expired``                    ``sandbox.expired``
any ``-> failed``                     ``sandbox.crashed`` (error)
``running -> unresponsive``           ``sandbox.unresponsive`` (error)
``unresponsive -> running``           ``sandbox.responsive``
``-> snapshotting``, wants to sleep   ``machine.sleeping`` (user_id)
any ``-> sleeping``                   ``machine.asleep`` (user_id)
any ``-> waking``                     ``machine.waking`` (user_id)
``waking -> running``                 ``machine.awake`` (user_id)
===================================  ==========================================

Warm-pool VMs publish none of these (``pool.take`` and ``pool.refill`` come
from the pool). Events that need more than the record (``sandbox.created``
with its source and duration, ``exec.*``, ``snapshot.*``) are published
where they happen.
"""

from __future__ import annotations

from hangar.core.context import Context
from hangar.core.lifecycle import State
from hangar.core.store import SandboxRecord

POOL_MARK = "pool"
"""The metadata key where older servers marked a warm-pool VM (now the ``pooled`` column);
kept for imports."""


def announce(ctx: Context, rec: SandboxRecord, frm: frozenset[State], to: State) -> None:
    """Publish the events that follow ``rec``'s move from one of ``frm`` to ``to``."""
    if rec.pooled:
        return
    sid = rec.id
    if to == State.DELETED:
        ctx.publish("sandbox.deleted", sid)
    elif to == State.EXPIRED:
        ctx.publish("sandbox.expired", sid)
    elif to == State.FAILED:
        ctx.publish("sandbox.crashed", sid, error=rec.error)
    elif to == State.SNAPSHOTTING and rec.desired_state == State.SLEEPING:
        ctx.publish("machine.sleeping", sid, user_id=rec.user_id)
    elif to == State.SLEEPING:
        ctx.publish("machine.asleep", sid, user_id=rec.user_id)
    elif to == State.WAKING:
        ctx.publish("machine.waking", sid, user_id=rec.user_id)
    elif to == State.RUNNING and frm == {State.WAKING}:
        ctx.publish("machine.awake", sid, user_id=rec.user_id)
    elif to == State.UNRESPONSIVE:
        ctx.publish("sandbox.unresponsive", sid, error=rec.error)
    elif to == State.RUNNING and frm == {State.UNRESPONSIVE}:
        ctx.publish("sandbox.responsive", sid)
