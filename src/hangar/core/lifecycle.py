"""The sandbox lifecycle: its states and the one table of allowed moves.

Every state change of a sandbox is one move of ``MOVES``, made by
``Store.transition`` as a compare-and-set in one transaction (``UPDATE ...
WHERE id = ? AND state IN (expected)``): a caller that lost a race gets
``Conflict`` instead of overwriting another's move, and a move the table
does not hold raises ``IllegalTransition`` (a bug, never a user error).

Each record also holds a *desired* state. For a sandbox that exists it is
``running`` or ``sleeping`` (the reconcile loop moves the current state
toward it); while ``stopping`` it names where the sandbox ends: ``deleted``,
``expired`` or ``failed``, so that a server killed midway finishes the job.

Transient states (``creating``, ``snapshotting``, ``waking``, ``restoring``,
``stopping``) are held only by the operation that set them, under the
sandbox's lock; met at start-up they mean the server died midway, and
``hangar.core.recovery`` resolves each one.

The state diagram in docs/architecture.md is generated from ``MOVES``
(``render_diagram``); regenerate it with::

    python -m hangar.core.lifecycle docs/architecture.md
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path


class State(str, enum.Enum):
    """A sandbox's current (or desired) state; the value is what the API shows."""

    CREATING = "creating"
    POOLED = "pooled"
    RUNNING = "running"
    UNRESPONSIVE = "unresponsive"
    SNAPSHOTTING = "snapshotting"
    SLEEPING = "sleeping"
    WAKING = "waking"
    RESTORING = "restoring"
    STOPPING = "stopping"
    DELETED = "deleted"
    EXPIRED = "expired"
    FAILED = "failed"

    def __str__(self) -> str:
        return self.value


MEANING: dict[State, str] = {
    State.CREATING: "the VMM is starting (cold boot, warm-pool take or fork); the guest agent "
                    "has not answered yet",
    State.POOLED: "a warm-pool VM, booted and paused, waiting for its one owner; never listed",
    State.RUNNING: "the agent answered; exec and file calls are served",
    State.UNRESPONSIVE: "the VMM runs but the guest stopped answering",
    State.SNAPSHOTTING: "paused while its memory and disk are saved (a snapshot, or before "
                        "sleeping); calls wait",
    State.SLEEPING: "no VMM: the sandbox lives in its sleep snapshot; any call wakes it",
    State.WAKING: "restoring from the sleep snapshot; calls wait",
    State.RESTORING: "its VM is being replaced by one restored from a snapshot",
    State.STOPPING: "the VMM is being ended and its files removed; the desired state names "
                    "the end: deleted, expired or failed",
    State.DELETED: "gone; the record stays as a tombstone so calls get a clear 404",
    State.EXPIRED: "removed when its time to live ran out; calls get 410",
    State.FAILED: "the VMM died or a restore failed; resources released; it can be restored "
                  "or deleted",
}


@dataclass(frozen=True)
class Move:
    """One allowed state change and why it happens."""

    frm: State
    to: State
    why: str


MOVES: tuple[Move, ...] = (
    Move(State.CREATING, State.RUNNING, "agent answered"),
    Move(State.CREATING, State.STOPPING, "deleted while being created"),
    Move(State.POOLED, State.CREATING, "taken by a create"),
    Move(State.POOLED, State.STOPPING, "retired or server stopping"),
    Move(State.RUNNING, State.SNAPSHOTTING, "snapshot or sleep"),
    Move(State.RUNNING, State.RESTORING, "restore"),
    Move(State.RUNNING, State.UNRESPONSIVE, "guest stopped answering"),
    Move(State.RUNNING, State.STOPPING, "delete, expiry, VMM died"),
    Move(State.UNRESPONSIVE, State.RUNNING, "guest answers again"),
    Move(State.UNRESPONSIVE, State.STOPPING, "delete, expiry, given up"),
    Move(State.SNAPSHOTTING, State.RUNNING, "snapshot saved, resumed"),
    Move(State.SNAPSHOTTING, State.SLEEPING, "sleep snapshot saved, VMM ended"),
    Move(State.SNAPSHOTTING, State.STOPPING, "VMM died midway"),
    Move(State.SLEEPING, State.WAKING, "a call or the reconcile loop wakes it"),
    Move(State.SLEEPING, State.STOPPING, "delete, expiry"),
    Move(State.WAKING, State.RUNNING, "restored, agent answered"),
    Move(State.WAKING, State.SLEEPING, "wake failed or interrupted"),
    Move(State.RESTORING, State.RUNNING, "restored, agent answered"),
    Move(State.RESTORING, State.FAILED, "restore failed"),
    Move(State.RESTORING, State.STOPPING, "delete, expiry"),
    Move(State.STOPPING, State.DELETED, "VMM and files gone"),
    Move(State.STOPPING, State.EXPIRED, "VMM and files gone"),
    Move(State.STOPPING, State.FAILED, "VMM and files gone"),
    Move(State.FAILED, State.RESTORING, "restore"),
    Move(State.FAILED, State.STOPPING, "delete"),
)
"""Every allowed move. A failed create or fork, and a retired pool VM, leave no
record at all (``Store.discard``), so nothing half-made is ever listed."""

INITIAL: tuple[State, ...] = (State.CREATING, State.POOLED)
"""States a new record starts in."""

NEXT: dict[State, frozenset[State]] = {
    s: frozenset(m.to for m in MOVES if m.frm == s) for s in State
}
"""``NEXT[a]``: the states ``a`` may move to."""

VMM_STATES: frozenset[State] = frozenset({
    State.CREATING, State.POOLED, State.RUNNING, State.UNRESPONSIVE, State.SNAPSHOTTING,
    State.WAKING, State.RESTORING, State.STOPPING})
"""States in which a VMM process may exist: these count against the VM cap."""

LIVE: frozenset[State] = VMM_STATES | {State.SLEEPING}
"""States of sandboxes that still exist (reconciled, recovered at start-up)."""

GONE: frozenset[State] = frozenset({State.DELETED, State.EXPIRED})
"""Tombstones: the sandbox is gone for good."""

ENDINGS: frozenset[State] = frozenset({State.DELETED, State.EXPIRED, State.FAILED})
"""Where ``stopping`` may lead; stored as the desired state while stopping."""

TRANSIENT: frozenset[State] = frozenset({
    State.CREATING, State.SNAPSHOTTING, State.WAKING, State.RESTORING, State.STOPPING})
"""States held only by an operation in progress (or left by a server that died)."""


class IllegalTransition(ValueError):
    """A move that ``MOVES`` does not hold: a bug in the caller."""


def allowed(frm: State, to: State) -> bool:
    """True when ``MOVES`` holds ``frm -> to``."""
    return to in NEXT[frm]


def check(expect: Collection[State], to: State) -> None:
    """Raise ``IllegalTransition`` unless every ``e -> to`` for ``e`` in ``expect`` is allowed."""
    bad = [e for e in expect if not allowed(e, to)]
    if bad or not expect:
        raise IllegalTransition(
            f"no move {'|'.join(s.value for s in bad) or '(nothing)'} -> {to.value}")


# -- the diagram ------------------------------------------------------------------

BEGIN = "<!-- state-diagram:begin (generated by python -m hangar.core.lifecycle) -->"
END = "<!-- state-diagram:end -->"


def render_diagram(moves: Iterable[Move] = MOVES) -> str:
    """The state diagram as Markdown: a Mermaid ``stateDiagram-v2`` and a table of states."""
    lines = ["```mermaid", "stateDiagram-v2"]
    lines += [f"    [*] --> {s.value}" for s in INITIAL]
    lines += [f"    {m.frm.value} --> {m.to.value}: {m.why}" for m in moves]
    lines += [f"    {s.value} --> [*]" for s in sorted(GONE, key=list(State).index)]
    lines += ["```", "", "| state | meaning | may move to |", "|---|---|---|"]
    for s in State:
        nxt = ", ".join(t.value for t in State if t in NEXT[s]) or "(final)"
        lines.append(f"| `{s.value}` | {MEANING[s]} | {nxt} |")
    return "\n".join(lines) + "\n"


def splice(doc: str, block: str) -> str:
    """``doc`` with the text between ``BEGIN`` and ``END`` replaced by ``block``.

    Raises ValueError when the markers are missing.
    """
    try:
        head, rest = doc.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
    except ValueError:
        raise ValueError(f"the document has no {BEGIN!r} ... {END!r} block") from None
    return f"{head}{BEGIN}\n{block}{END}{tail}"


def diagram_in(doc: str) -> str:
    """The text between the markers of ``doc`` (what ``splice`` put there)."""
    return doc.split(BEGIN, 1)[1].split(END, 1)[0].removeprefix("\n")


def main(argv: list[str] | None = None) -> int:
    """``python -m hangar.core.lifecycle [DOC]``: rewrite DOC's diagram, or print it."""
    args = sys.argv[1:] if argv is None else argv
    if not args:
        sys.stdout.write(render_diagram())
        return 0
    path = Path(args[0])
    path.write_text(splice(path.read_text(), render_diagram()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
