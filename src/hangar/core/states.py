"""The sandbox state machine, in one place.

::

    creating ──► running ──► stopping ──► deleted | expired
        │           │  ▲
        │           ▼  │
        │         paused
        ▼           │
      failed ◄──────┘ (VMM died, boot failed)

``creating``  the VMM is starting and the guest agent has not answered yet
``running``   the agent answered; exec and file calls are served
``paused``    vCPUs stopped (snapshots, later the warm pool)
``stopping``  the VMM is being ended and its files removed
``deleted``   gone; the record stays as a tombstone so calls get a clear 404
``expired``   removed when its time to live ran out; calls get 410
``failed``    the VMM died or never came up; resources are already released

A failed create leaves no record at all: nothing half-created.
"""

from __future__ import annotations

import enum

from hangar.errors import Conflict


class State(str, enum.Enum):
    CREATING = "creating"
    RUNNING = "running"
    PAUSED = "paused"
    STOPPING = "stopping"
    DELETED = "deleted"
    EXPIRED = "expired"
    FAILED = "failed"


TRANSITIONS: dict[State, set[State]] = {
    State.CREATING: {State.RUNNING, State.FAILED, State.STOPPING},
    State.RUNNING: {State.PAUSED, State.STOPPING, State.FAILED},
    State.PAUSED: {State.RUNNING, State.STOPPING, State.FAILED},
    State.STOPPING: {State.DELETED, State.EXPIRED, State.FAILED},
    State.DELETED: set(),
    State.EXPIRED: set(),
    State.FAILED: {State.STOPPING, State.DELETED},
}

LIVE = {State.CREATING, State.RUNNING, State.PAUSED, State.STOPPING}
"""States in which a VMM process may exist and counts against the VM cap."""


def check(current: State, new: State, sandbox_id: str) -> None:
    """Raise ``Conflict`` unless ``current`` may move to ``new``."""
    if new not in TRANSITIONS[current]:
        raise Conflict(f"sandbox {sandbox_id} is {current.value}; cannot become {new.value}",
                       sandbox_id=sandbox_id, state=current.value)
