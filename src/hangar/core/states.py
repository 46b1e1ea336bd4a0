"""The sandbox state machine, in one place.

::

                   ┌────────── pooled (booted ahead, paused; never listed)
                   ▼
    creating ──► running ──► stopping ──► deleted | expired
        │         │  ▲  ▲
        │         │  │  └──────── waking ◄── sleeping ◄── snapshotting ◄─┐
        │         │  │                                                    │
        │         │  └──────────────────────────────────────── (running) ─┘
        ▼         ▼
      failed ◄── (the VMM died, a boot or wake failed)

``creating``      the VMM is starting; the guest agent has not answered yet
``pooled``        a warm-pool VM, booted and paused, waiting for its one owner
``running``       the agent answered; exec and file calls are served
``snapshotting``  saving memory and disk before sleeping; calls wait
``sleeping``      no VMM: the sandbox lives in a snapshot; any call wakes it
``waking``        restoring from the sleep snapshot; calls wait
``stopping``      the VMM is being ended and its files removed
``deleted``       gone; the record stays as a tombstone so calls get a clear 404
``expired``       removed when its time to live ran out; calls get 410
``failed``        the VMM died or never came up; its resources are released

Each record also holds a *desired* state (``running`` or ``sleeping``);
the reconcile loop in ``SandboxManager`` moves the current state toward
it. A failed create leaves no record at all: nothing half-created.
"""

from __future__ import annotations

import enum


class State(str, enum.Enum):
    CREATING = "creating"
    POOLED = "pooled"
    RUNNING = "running"
    SNAPSHOTTING = "snapshotting"
    SLEEPING = "sleeping"
    WAKING = "waking"
    STOPPING = "stopping"
    DELETED = "deleted"
    EXPIRED = "expired"
    FAILED = "failed"


VMM_STATES = {State.CREATING, State.POOLED, State.RUNNING, State.SNAPSHOTTING, State.WAKING,
              State.STOPPING}
"""States in which a VMM process may exist: these count against the VM cap."""

LIVE = VMM_STATES | {State.SLEEPING}
"""States of sandboxes that still exist (listed, reconciled at start-up)."""

GONE = {State.DELETED, State.EXPIRED}
