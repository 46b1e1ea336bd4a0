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

A cluster's directory records (``hangar.cluster.records``) carry the same
states and move by the same table: a node mirrors its local record's moves
into the directory (``walk``: each step an edge), and the few moves only a
cluster makes are edges too, with a *guard*: a condition the caller must
state holds (``Guard``), so the store's local moves can never take them.
When a node is lost, the failover reconciler moves each of its records by
one guarded edge (``check(..., guard=...)``): a sandbox that ran there is
``failed`` (``Guard.NODE_LOST``), a user's machine with a snapshot in shared
storage goes back to it, ``sleeping`` (``Guard.BACK_TO_SNAPSHOT``). A sandbox
another node takes over (adopts) starts there as a new record in
``sleeping`` (``INITIAL``).

The desired state is checked too: ``DESIRED[s]`` holds what a record in
state ``s`` may want, and every write of a desired state goes through
``check_desired``.

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
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hangar.core.store import SandboxRecord


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
    State.CREATING: "the VMM is starting (template restore, warm-pool take, cold boot or "
                    "fork); the guest agent has not answered yet",
    State.POOLED: "a warm-pool VM, restored (or booted) and paused, waiting for its one "
                  "owner; never listed",
    State.RUNNING: "the agent answered; exec and file calls are served",
    State.UNRESPONSIVE: "the VMM runs but the guest stopped answering",
    State.SNAPSHOTTING: "paused while its memory and disk are saved (a snapshot, or before "
                        "sleeping); calls wait",
    State.SLEEPING: "no VMM: the sandbox lives in its sleep snapshot (memory and disk, or "
                    "its disk alone); any call wakes it",
    State.WAKING: "restoring from the sleep snapshot (or booting cold from a disk-only "
                  "one); calls wait",
    State.RESTORING: "its VM is being replaced by one restored from a snapshot",
    State.STOPPING: "the VMM is being ended and its files removed; the desired state names "
                    "the end: deleted, expired or failed",
    State.DELETED: "gone; the record stays as a tombstone so calls get a clear 404",
    State.EXPIRED: "removed when its time to live ran out; calls get 410",
    State.FAILED: "the VMM died or a restore failed; resources released; it can be restored "
                  "or deleted",
}


class Guard(str, enum.Enum):
    """A condition a guarded move needs besides its end points; the mover states it holds
    (what each means: ``GUARDS``)."""

    NODE_LOST = "node_lost"
    BACK_TO_SNAPSHOT = "back_to_snapshot"

    def __str__(self) -> str:
        return self.value


GUARDS: dict[Guard, str] = {
    Guard.NODE_LOST: "the record's node lost its lease (or, at its own audit, no longer has "
                     "the sandbox); its VMM is gone with it.",
    Guard.BACK_TO_SNAPSHOT: "`node_lost`, and the record is a user's machine whose last "
                            "snapshot is in shared storage; it goes back to that snapshot "
                            "(what ran since is lost).",
}
"""What each guard means (shown under the diagram)."""


@dataclass(frozen=True)
class Move:
    """One allowed state change, why it happens, and the guard it needs (None: none)."""

    frm: State
    to: State
    why: str
    guard: Guard | None = None


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
    # A cluster's failover (hangar.cluster.failover): the node that ran the VMM is lost.
    Move(State.RUNNING, State.FAILED, "cluster node lost", Guard.NODE_LOST),
    Move(State.UNRESPONSIVE, State.FAILED, "cluster node lost", Guard.NODE_LOST),
    Move(State.SNAPSHOTTING, State.FAILED, "cluster node lost", Guard.NODE_LOST),
    Move(State.WAKING, State.FAILED, "cluster node lost, no shared snapshot",
         Guard.NODE_LOST),
    Move(State.RUNNING, State.SLEEPING, "cluster node lost, a machine back to its shared "
         "snapshot", Guard.BACK_TO_SNAPSHOT),
    Move(State.UNRESPONSIVE, State.SLEEPING, "cluster node lost, a machine back to its "
         "shared snapshot", Guard.BACK_TO_SNAPSHOT),
    Move(State.RESTORING, State.SLEEPING, "cluster node lost, a machine back to its shared "
         "snapshot", Guard.BACK_TO_SNAPSHOT),
)
"""Every allowed move. A failed create or fork, and a retired pool VM, leave no
record at all (``Store.discard``), so nothing half-made is ever listed; a
cluster's record of a create whose node was lost is removed the same way.
Moves with a guard are made only by a caller that names it (``check``)."""

INITIAL: tuple[State, ...] = (State.CREATING, State.POOLED, State.SLEEPING)
"""States a new record starts in: ``sleeping`` only for a sandbox adopted from another
cluster node, at its last shared snapshot (``hangar.core.handover``)."""

NEXT: dict[State, frozenset[State]] = {
    s: frozenset(m.to for m in MOVES if m.frm == s) for s in State
}
"""``NEXT[a]``: the states ``a`` may move to, guarded moves included."""

_EDGES: dict[tuple[State, State], frozenset[Guard | None]] = {}
for _m in MOVES:
    _EDGES[(_m.frm, _m.to)] = _EDGES.get((_m.frm, _m.to), frozenset()) | {_m.guard}

WANTABLE: frozenset[State] = frozenset({State.RUNNING, State.SLEEPING})

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


MOVING: frozenset[State] = TRANSIENT - {State.STOPPING}
"""States an operation holds on its way to a state a caller can act on (``running``,
``sleeping``, ``failed``); ``settled`` (``hangar.core.sleep``) waits them out. ``stopping``
is not among them: it leads out of existence, and a caller is told so at once."""


class OnExpiry(str, enum.Enum):
    """What the end of a sandbox's time to live does (its record's ``on_expiry``; None is
    ``delete``): ``delete`` ends it (``expired``); ``sleep`` puts a running sandbox to sleep
    with its clock stopped, as ``pause`` does (asleep it has no time limit; woken, it gets
    its time to live back). The reconcile loop reads it; E2B's ``autoPause`` is ``sleep``."""

    DELETE = "delete"
    SLEEP = "sleep"

    def __str__(self) -> str:
        return self.value


# -- the clock across a sleep (``hangar.core.sleep``) ------------------------------------

def stopped_clock(rec: SandboxRecord) -> dict[str, Any]:
    """The fields a move into ``sleeping`` sets beside the state: no time limit when a
    pause armed ``wake_ttl_s``; nothing else (a plain sleep's clock runs on)."""
    return {"expires_at": None} if rec.wake_ttl_s is not None else {}


def restarted_clock(rec: SandboxRecord, ttl_s: float | None, now: float) -> dict[str, Any]:
    """The fields the ``waking -> running`` move sets beside the state: ``ttl_s`` (a
    connect's: seconds from ``now``, 0 no limit) when given; else a clock a pause stopped
    runs again with ``wake_ttl_s`` (unless a limit was set while it slept); disarmed."""
    if ttl_s is not None:
        return {"expires_at": now + ttl_s if ttl_s else None, "wake_ttl_s": None}
    if rec.wake_ttl_s is None:
        return {}
    if rec.expires_at is None and rec.wake_ttl_s:
        return {"expires_at": now + rec.wake_ttl_s, "wake_ttl_s": None}
    return {"wake_ttl_s": None}


class IllegalTransition(ValueError):
    """A move that ``MOVES`` does not hold: a bug in the caller."""


def allowed(frm: State, to: State, guard: Guard | None = None) -> bool:
    """True when ``MOVES`` holds ``frm -> to`` with no guard, or with ``guard``."""
    guards = _EDGES.get((frm, to), frozenset())
    return None in guards or (guard is not None and guard in guards)


def check(expect: Collection[State], to: State, guard: Guard | None = None) -> None:
    """Raise ``IllegalTransition`` unless every ``e -> to`` for ``e`` in ``expect`` is allowed
    (with ``guard``, when the caller states that condition holds)."""
    bad = [e for e in expect if not allowed(e, to, guard)]
    if bad or not expect:
        raise IllegalTransition(
            f"no move {'|'.join(s.value for s in bad) or '(nothing)'} -> {to.value}"
            + (f" under guard {guard.value}" if guard else ""))


def walk(frm: State, to: State) -> list[State]:
    """The shortest chain of unguarded moves from ``frm`` to ``to``: ``[frm, ..., to]``
    (``[frm]`` when equal). Each step passes ``check``.

    A cluster node mirrors its local record into the directory with it: between two
    pushes the local record may have made several moves, and the directory's record
    follows them edge by edge. Raises ``IllegalTransition`` when no chain exists (e.g.
    out of a tombstone).
    """
    paths: dict[State, list[State]] = {frm: [frm]}
    todo = [frm]
    while todo and to not in paths:
        nxt: list[State] = []
        for a in todo:
            for m in MOVES:
                if m.frm == a and m.guard is None and m.to not in paths:
                    paths[m.to] = [*paths[a], m.to]
                    nxt.append(m.to)
        todo = nxt
    if to not in paths:
        raise IllegalTransition(f"no chain of moves {frm.value} -> {to.value}")
    chain = paths[to]
    for a, b in zip(chain, chain[1:]):
        check({a}, b)
    return chain


DESIRED: dict[State, frozenset[State]] = {
    **{s: WANTABLE for s in State},
    State.STOPPING: ENDINGS, State.DELETED: ENDINGS, State.EXPIRED: ENDINGS,
    State.FAILED: ENDINGS | WANTABLE,
}
"""``DESIRED[s]``: what a record in state ``s`` may want. A sandbox that exists wants
``running`` or ``sleeping``; from ``stopping`` on, the desired state names its end. A
``failed`` one keeps what it wanted when a restore failed (a restore brings it back to
``running``), or names its end when it failed through ``stopping``."""


def check_desired(state: State, desired: State) -> None:
    """Raise ``IllegalTransition`` unless a record in ``state`` may want ``desired``."""
    if desired not in DESIRED[state]:
        raise IllegalTransition(f"a {state.value} sandbox cannot want {desired.value}")


# -- public names -------------------------------------------------------------------

class Face(str, enum.Enum):
    """Who shows a sandbox's state: Hangar's own API (``native``), its machines API
    (``machine``), E2B's control plane (``e2b``), a cluster's directory record (``cluster``:
    agent-sandbox's ``spec.operatingMode``)."""

    NATIVE = "native"
    MACHINE = "machine"
    E2B = "e2b"
    CLUSTER = "cluster"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Names:
    """A state's public name in each ``Face``; None: that face never shows it (E2B: a call
    naming such a sandbox is a 404 saying its state; cluster: only a desired state has a
    name, ``operatingMode``)."""

    native: str
    machine: str
    e2b: str | None
    cluster: str | None


PUBLIC: dict[State, Names] = {
    State.CREATING: Names("creating", "creating", "running", None),
    State.POOLED: Names("pooled", "pooled", None, None),
    State.RUNNING: Names("running", "active", "running", "Running"),
    State.UNRESPONSIVE: Names("unresponsive", "unresponsive", "running", None),
    State.SNAPSHOTTING: Names("snapshotting", "snapshotting", "running", None),
    State.SLEEPING: Names("sleeping", "sleeping", "paused", "Suspended"),
    State.WAKING: Names("waking", "waking", "running", None),
    State.RESTORING: Names("restoring", "restoring", "running", None),
    State.STOPPING: Names("stopping", "stopping", None, None),
    State.DELETED: Names("deleted", "deleted", None, None),
    State.EXPIRED: Names("expired", "expired", None, None),
    State.FAILED: Names("failed", "failed", None, None),
}
"""The one table of public state names. One rule besides: E2B shows a sandbox on its way
to sleep (``snapshotting``, wanting ``sleeping``) as ``paused`` (``public_name``)."""


def public_name(state: State, face: Face, desired: State | None = None) -> str | None:
    """``state``'s name in ``face`` (``PUBLIC``), given the ``desired`` state for E2B's
    rule; None when that face does not show it."""
    if face == Face.E2B and state == State.SNAPSHOTTING and desired == State.SLEEPING:
        state = State.SLEEPING
    names = PUBLIC[state]
    return {Face.NATIVE: names.native, Face.MACHINE: names.machine, Face.E2B: names.e2b,
            Face.CLUSTER: names.cluster}[face]


def from_public(name: str, face: Face) -> State:
    """The state ``name`` stands for in ``face`` (the first in ``State``'s order: E2B's
    ``running`` is ``creating``... so ask it only of names that stand for one state, e.g.
    a cluster's ``operatingMode``). Raises ValueError for a name the face never shows."""
    for state in State:
        if public_name(state, face) == name:
            return state
    raise ValueError(f"{name!r} is no {face.value} state name")


# -- the diagram ------------------------------------------------------------------

BEGIN = "<!-- state-diagram:begin (generated by python -m hangar.core.lifecycle) -->"
END = "<!-- state-diagram:end -->"


def render_diagram(moves: Iterable[Move] = MOVES) -> str:
    """The state diagram as Markdown: a Mermaid ``stateDiagram-v2`` and a table of states."""
    lines = ["```mermaid", "stateDiagram-v2"]
    lines += [f"    [*] --> {s.value}" for s in INITIAL]
    lines += [f"    {m.frm.value} --> {m.to.value}: {m.why}"
              + (f" [guard {m.guard.value}]" if m.guard else "") for m in moves]
    lines += [f"    {s.value} --> [*]" for s in sorted(GONE, key=list(State).index)]
    lines += ["```", "", "Guards (moves only a cluster makes, `hangar.cluster.failover`):", ""]
    lines += [f"- `{g.value}`: {' '.join((GUARDS[g]).split())}" for g in Guard]
    lines += ["", "| state | meaning | may move to | may want |", "|---|---|---|---|"]
    for s in State:
        nxt = ", ".join(t.value for t in State if t in NEXT[s]) or "(final)"
        want = ", ".join(t.value for t in State if t in DESIRED[s])
        lines.append(f"| `{s.value}` | {MEANING[s]} | {nxt} | {want} |")
    lines += ["", "Public names (`PUBLIC`; `-`: not shown; E2B shows a sandbox on its way to "
              "sleep as `paused`; a cluster names only desired states):", "",
              "| state | " + " | ".join(f.value for f in Face) + " |",
              "|---|" + "---|" * len(Face)]
    for s in State:
        cells = [public_name(s, f) for f in Face]
        lines.append(f"| `{s.value}` | " + " | ".join(f"`{c}`" if c else "-" for c in cells)
                     + " |")
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
