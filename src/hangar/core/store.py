"""Persistent records in SQLite (SQLAlchemy 2 ORM): sandboxes, snapshots, machines, ports,
volumes and their attachments. The rows are declared in ``hangar.core.records`` (and
re-exported here); this module reads and writes them.

The store is the source of truth across server restarts: on start the
orchestrator reads every live record and adopts or cleans up its VM
(``hangar.core.recovery``). Each call is one short session and one
transaction.

A sandbox's state changes only through ``Store.transition``: a
compare-and-set (``UPDATE ... WHERE id = ? AND state IN (...)``) of a move
that ``hangar.core.lifecycle.MOVES`` allows. ``update`` changes any other
field and refuses ``state``. Listeners registered with ``on_transition``
hear every move once it is committed (the event bus uses this).

Tables added since a data directory was made are created at start
(``create_all`` makes only the missing ones, e.g. ``volumes`` and
``volume_attachments``), and the rest is brought up to date in place
(``hangar.core.migrations``: columns added since, state moved to its
columns), so old databases keep working.

A sandbox's ``metadata`` is the client's and opaque: nothing in Hangar reads
it as state. What the server keeps of its own (a machine's user and idle
timeout, the warm-pool mark, E2B's options) lives in columns of its own
(``user_id``, ``idle_timeout_s``, ``pooled``, ``e2b``, and the clock's
``on_expiry``, ``auto_resume``, ``ttl_s``, ``wake_ttl_s``), which no request
writes. Tombstones (``deleted``, ``expired``) are
kept ``purge_retention_s`` and then removed (``purge``); the hot paths
(``live``, ``visible``, ``state_counts``) read only the rows they need by the
``state`` index.
"""

from __future__ import annotations

import builtins
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Collection, Iterable
from pathlib import Path
from typing import Any

from sqlalchemy import bindparam, create_engine, delete, event, func, select, text, update
from sqlalchemy.orm import Session, sessionmaker

from hangar.core.lifecycle import (
    DESIRED, GONE, LIVE, VMM_STATES, State, check, check_desired,
)
from hangar.core.migrations import migrate
from hangar.core.records import (  # noqa: F401  (re-exported: the rows Store keeps)
    Base, CounterRecord, MachineRecord, PortRecord, R, SandboxRecord, SnapshotRecord,
    VolumeAttachmentRecord, VolumeRecord, unsound,
)
from hangar.errors import Conflict, NotFound
from hangar.images import image_id  # noqa: F401  (re-exported: a record's build id)

log = logging.getLogger("hangar.store")

_STATE_OF = select(SandboxRecord.state).where(SandboxRecord.id == bindparam("id"))


TransitionListener = Callable[[SandboxRecord, frozenset[State], State], None]
"""Called with (the record after the move, the states it was expected in, the new state)."""
ChangeListener = Callable[[str], None]
"""Called with a sandbox's id after it moved or its record was removed."""

class Store:
    """Access to the records; one short session and transaction per call."""

    def __init__(self, path: Path) -> None:
        self.engine = create_engine(f"sqlite:///{path}", connect_args={"check_same_thread": False})
        self._path = str(path)
        self._reader: sqlite3.Connection | None = None
        self._reading = threading.Lock()

        @event.listens_for(self.engine, "connect")
        def _pragmas(conn: Any, _: Any) -> None:
            cur = conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.close()

        Base.metadata.create_all(self.engine)
        migrate(self.engine, Base.metadata)
        self._session = sessionmaker(self.engine, expire_on_commit=False)
        self._listeners: list[TransitionListener] = []
        self._watchers: list[ChangeListener] = []
        self.unreadable: set[str] = set()
        """Ids of sandbox rows that could not be read (``in_states``), logged once each."""

    def session(self) -> Session:
        return self._session()

    def on_transition(self, listener: TransitionListener) -> None:
        """Call ``listener`` after every committed move (it must not raise or block)."""
        self._listeners.append(listener)

    def on_change(self, listener: ChangeListener) -> None:
        """Call ``listener`` with a sandbox's id after every committed move and every
        removal of its record (``discard``); it must not raise or block. ``settled``
        (``hangar.core.sleep``) waits on it."""
        self._watchers.append(listener)

    def _changed(self, sandbox_id: str) -> None:
        for watcher in self._watchers:
            try:
                watcher(sandbox_id)
            except Exception:  # a watcher never undoes or blocks a change
                log.exception("change listener failed")

    # -- sandboxes: state ----------------------------------------------------

    def transition(self, sandbox_id: str, expect: State | Collection[State], to: State,
                   **fields: Any) -> SandboxRecord:
        """Move the sandbox to ``to`` if it is in ``expect``, setting ``fields`` too, atomically.

        Returns the record after the move. Raises ``IllegalTransition`` when
        a move ``expect -> to`` is not in ``lifecycle.MOVES`` (or a ``desired_state`` does
        not suit ``to``: ``lifecycle.check_desired``), ``NotFound``
        when there is no such record, and ``Conflict`` (with the current
        ``state``) when it is in another state: someone else moved it first.
        """
        exp = frozenset({expect} if isinstance(expect, State) else expect)
        check(exp, to)
        if "desired_state" in fields:
            check_desired(to, fields["desired_state"])
        if "state" in fields:
            raise ValueError("give the new state as to=")
        with self.session() as s, s.begin():
            res = s.execute(
                update(SandboxRecord)
                .where(SandboxRecord.id == sandbox_id, SandboxRecord.state.in_(exp))
                .values(state=to, updated_at=time.time(), **fields)
                .execution_options(synchronize_session=False))
            rec = s.get(SandboxRecord, sandbox_id, populate_existing=True)
            if rec is None:
                raise NotFound(f"no sandbox {sandbox_id}", sandbox_id=sandbox_id)
            if res.rowcount != 1:  # type: ignore[attr-defined]
                raise Conflict(f"sandbox {sandbox_id} is {rec.state.value}, not "
                               f"{' or '.join(sorted(e.value for e in exp))}",
                               sandbox_id=sandbox_id, state=rec.state.value)
        for listener in self._listeners:
            try:
                listener(rec, exp, to)
            except Exception:  # a listener never undoes or blocks a move
                log.exception("transition listener failed")
        self._changed(sandbox_id)
        return rec

    def discard(self, sandbox_id: str, expect: State | Collection[State]) -> bool:
        """Remove the record if it is in ``expect`` (a failed create, a retired pool VM).

        Returns False when it is in another state (e.g. a delete took it over).
        """
        exp = frozenset({expect} if isinstance(expect, State) else expect)
        with self.session() as s, s.begin():
            res = s.execute(delete(SandboxRecord).where(
                SandboxRecord.id == sandbox_id, SandboxRecord.state.in_(exp)))
            gone = bool(res.rowcount)  # type: ignore[attr-defined]
        if gone:
            self._changed(sandbox_id)
        return gone

    def extend(self, sandbox_id: str, until: float,
               expect: Collection[State] = LIVE) -> SandboxRecord:
        """Make the sandbox live at least until ``until`` (Unix seconds) if it is in
        ``expect``, as a compare-and-set: a later ``expires_at`` is never shortened and
        none (no limit) is never set. Returns the record. Raises NotFound, Conflict (with
        the current ``state``) when it is in another state."""
        exp = frozenset(expect)
        with self.session() as s, s.begin():
            s.execute(
                update(SandboxRecord)
                .where(SandboxRecord.id == sandbox_id, SandboxRecord.state.in_(exp),
                       SandboxRecord.expires_at.is_not(None),
                       SandboxRecord.expires_at < until)
                .values(expires_at=until, updated_at=time.time())
                .execution_options(synchronize_session=False))
            rec = s.get(SandboxRecord, sandbox_id, populate_existing=True)
            if rec is None:
                raise NotFound(f"no sandbox {sandbox_id}", sandbox_id=sandbox_id)
            if rec.state not in exp:
                raise Conflict(f"sandbox {sandbox_id} is {rec.state.value}",
                               sandbox_id=sandbox_id, state=rec.state.value)
        return rec

    # -- sandboxes: other fields -------------------------------------------------

    def add(self, *records: Base) -> None:
        """Insert records in one transaction."""
        with self.session() as s, s.begin():
            s.add_all(records)

    def get(self, sandbox_id: str) -> SandboxRecord | None:
        """The sandbox's record, or None: no such row, or one that cannot be read or holds
        a damaged field (logged once and marked, as in ``in_states``)."""
        try:
            rec = self.find(SandboxRecord, sandbox_id)
        except Exception as exc:
            self._unreadable(sandbox_id, exc)
            return None
        return rec if rec is None or self._sound(rec) else None

    def state_of(self, sandbox_id: str) -> State | None:
        """The sandbox's state as stored, or None: no such row, one marked unreadable,
        or a state no ``State`` names.

        The check every guest call makes (``GuestCalls.using``), so it skips
        SQLAlchemy: one ``SELECT`` on a connection of its own in autocommit mode
        (each read sees what was committed; WAL readers never wait for a writer).
        3.5 us a read here against 60 for the same through SQLAlchemy's Core and 350
        for ``get`` (2,000 reads each, in-process)."""
        if sandbox_id in self.unreadable:
            return None
        try:
            with self._reading:
                if self._reader is None:
                    self._reader = sqlite3.connect(self._path, timeout=30, isolation_level=None,
                                                   check_same_thread=False)
                row = self._reader.execute("SELECT state FROM sandboxes WHERE id = ?",
                                           (sandbox_id,)).fetchone()
        except sqlite3.Error:  # the usual way, which raises as every other read does
            with self.engine.connect() as conn:
                return conn.execute(_STATE_OF, {"id": sandbox_id}).scalar()
        if row is None:
            return None
        try:
            return State(row[0])
        except ValueError:
            return None

    def find(self, cls: type[R], key: str) -> R | None:
        with self.session() as s:
            return s.get(cls, key)

    def update(self, sandbox_id: str, **fields: Any) -> SandboxRecord | None:
        """Set fields other than ``state`` (use ``transition``); None if no such sandbox.

        A new ``desired_state`` must suit the current state (``lifecycle.DESIRED``),
        checked in the same transaction; else ``Conflict`` with the current ``state``
        (the sandbox moved meanwhile, e.g. a delete began)."""
        if "state" in fields:
            raise ValueError("state changes go through Store.transition")
        return self.change(SandboxRecord, sandbox_id, **fields)

    def change(self, cls: type[R], key: str, **fields: Any) -> R | None:
        if cls is SandboxRecord and "state" in fields:
            raise ValueError("state changes go through Store.transition")
        with self.session() as s, s.begin():
            rec = s.get(cls, key)
            if rec is None:
                return None
            if isinstance(rec, SandboxRecord) and "desired_state" in fields \
                    and fields["desired_state"] not in DESIRED[rec.state]:
                raise Conflict(f"sandbox {key} is {rec.state.value}: it cannot want "
                               f"{State(fields['desired_state']).value}", sandbox_id=key,
                               state=rec.state.value)
            for name, value in fields.items():
                setattr(rec, name, value)
            if isinstance(rec, SandboxRecord):
                rec.updated_at = time.time()
            return rec

    def add_snapshot(self, snap: SnapshotRecord, sleep_of: str | None = None) -> None:
        """Insert a snapshot record; with ``sleep_of``, also make it that sandbox's
        ``sleep_snapshot``, in the same transaction."""
        with self.session() as s, s.begin():
            s.add(snap)
            if sleep_of is not None:
                s.execute(update(SandboxRecord).where(SandboxRecord.id == sleep_of)
                          .values(sleep_snapshot=snap.id, updated_at=time.time())
                          .execution_options(synchronize_session=False))

    def next_value(self, name: str) -> int:
        """The counter ``name`` plus one, stored in one transaction; 1 the first time.

        Never repeats a value, restarts included (SQLite refuses a write whose
        read was overtaken rather than losing it).
        """
        with self.session() as s, s.begin():
            rec = s.get(CounterRecord, name)
            if rec is None:
                rec = CounterRecord(name=name, value=0)
                s.add(rec)
            rec.value += 1
            return rec.value

    def remove(self, cls: type[Base], key: str) -> None:
        with self.session() as s, s.begin():
            rec = s.get(cls, key)
            if rec is not None:
                s.delete(rec)

    # -- queries -------------------------------------------------------------------

    def live(self) -> list[SandboxRecord]:
        """Sandboxes that still exist (see ``lifecycle.LIVE``), oldest first."""
        return self.in_states(LIVE)

    def with_vmm(self) -> list[SandboxRecord]:
        """Sandboxes that may have a VMM process (they count against the cap)."""
        return self.in_states(VMM_STATES)

    def in_states(self, states: Iterable[State]) -> list[SandboxRecord]:
        """Sandboxes in any of ``states``, oldest first.

        A row that cannot be read (a damaged value in one of its columns) does not
        fail the query: it is left out, logged once and marked (``unreadable``,
        and its ``error`` column where that can be written), and every other row
        is returned."""
        return self._records(SandboxRecord.state.in_(list(states)))

    def unowned_user_sandboxes(self, states: Iterable[State]) -> list[SandboxRecord]:
        """Sandboxes in any of ``states`` that have a ``user_id`` but no machine record
        names, oldest first (normally none: ``hangar.core.machines``' reconcile pass looks
        for them every second, so the others are not read). Damaged rows as ``in_states``."""
        return self._records(SandboxRecord.state.in_(list(states))
                             & SandboxRecord.user_id.is_not(None)
                             & SandboxRecord.id.not_in(select(MachineRecord.sandbox_id)))

    def machine_sandboxes(self) -> dict[str, tuple[str, State | None]]:
        """Every machine record's sandbox id and that sandbox's state (None: no such row),
        by the record's user id: one query, however many machines (``hangar.core.machines``'
        reconcile pass reads it every second). A sandbox row whose state cannot be read
        leaves its machine out (logged once and marked, as in ``in_states``)."""
        q = select(MachineRecord.user_id, MachineRecord.sandbox_id, SandboxRecord.state) \
            .outerjoin(SandboxRecord, SandboxRecord.id == MachineRecord.sandbox_id)
        try:
            with self.session() as s:
                return {user: (sid, state) for user, sid, state in s.execute(q)}
        except Exception:  # one damaged row: read them one by one
            pass
        out: dict[str, tuple[str, State | None]] = {}
        for m in self.list(MachineRecord):
            try:
                with self.session() as s:
                    state = s.scalar(select(SandboxRecord.state)
                                     .where(SandboxRecord.id == m.sandbox_id))
            except Exception as exc:
                self._unreadable(m.sandbox_id, exc)
                continue
            out[m.user_id] = (m.sandbox_id, state)
        return out

    def _records(self, where: Any) -> list[SandboxRecord]:
        """The sandboxes ``where`` selects, oldest first, damaged rows left out (``in_states``)."""
        try:
            with self.session() as s:
                recs = list(s.scalars(select(SandboxRecord).where(where)
                                      .order_by(SandboxRecord.created_at)))
            return [r for r in recs if self._sound(r)]
        except Exception:  # one damaged row: read them one by one
            pass
        with self.session() as s:
            ids = list(s.scalars(select(SandboxRecord.id).where(where)
                                 .order_by(SandboxRecord.created_at)))
        out: list[SandboxRecord] = []
        for sid in ids:
            try:
                with self.session() as s:
                    rec = s.get(SandboxRecord, sid)
                if rec is not None and self._sound(rec):
                    out.append(rec)
            except Exception as exc:
                self._unreadable(sid, exc)
        return out

    def _sound(self, rec: SandboxRecord) -> bool:
        wrong = unsound(rec)
        if wrong is None:
            return True
        self._unreadable(rec.id, ValueError(wrong))
        return False

    def _unreadable(self, sandbox_id: str, exc: Exception) -> None:
        """Log once and mark a sandbox row that cannot be read or holds a damaged field."""
        if sandbox_id in self.unreadable:
            return
        self.unreadable.add(sandbox_id)
        log.error("sandbox record unreadable: left out until repaired",
                  extra={"sandbox_id": sandbox_id, "error": repr(exc)[:300]})
        try:
            with self.engine.begin() as conn:
                conn.execute(text("UPDATE sandboxes SET error = :e WHERE id = :id"),
                             {"e": f"unreadable record: {exc!r}"[:1000], "id": sandbox_id})
        except Exception:  # the mark is best effort; the log line is the record
            pass

    def visible(self) -> list[SandboxRecord]:
        """Sandboxes the API lists: all but tombstones and warm-pool VMs, oldest first."""
        return self.in_states(set(State) - GONE - {State.POOLED})

    def visible_ids(self) -> list[str]:
        """Ids of the sandboxes ``visible`` returns, oldest first: one query of one column,
        no record read (a hot path may afford it for thousands)."""
        with self.session() as s:
            return list(s.scalars(select(SandboxRecord.id).where(SandboxRecord.state.in_(
                list(set(State) - GONE - {State.POOLED}))).order_by(SandboxRecord.created_at)))

    def state_counts(self) -> dict[State, int]:
        """How many sandboxes are in each state but the tombstones (one indexed query)."""
        with self.session() as s:
            q = (select(SandboxRecord.state, func.count()).where(
                SandboxRecord.state.in_(list(set(State) - GONE))).group_by(SandboxRecord.state))
            return {State(st): int(n) for st, n in s.execute(q)}

    def all(self) -> list[SandboxRecord]:
        """Every record, tombstones included (tools and tests; not for hot paths)."""
        with self.session() as s:
            return list(s.scalars(select(SandboxRecord).order_by(SandboxRecord.created_at)))

    def purge(self, older_than: float) -> int:
        """Remove tombstones (``deleted``, ``expired``) last changed before ``older_than``
        (Unix seconds), with their exposed ports and volume attachments; returns how many went."""
        with self.session() as s, s.begin():
            gone = select(SandboxRecord.id).where(SandboxRecord.state.in_(list(GONE)),
                                                  SandboxRecord.updated_at < older_than)
            ids = list(s.scalars(gone))
            for i in range(0, len(ids), 500):
                chunk = ids[i:i + 500]
                s.execute(delete(PortRecord).where(PortRecord.sandbox_id.in_(chunk)))
                s.execute(delete(VolumeAttachmentRecord).where(
                    VolumeAttachmentRecord.sandbox_id.in_(chunk)))
                s.execute(delete(SandboxRecord).where(SandboxRecord.id.in_(chunk),
                                                      SandboxRecord.state.in_(list(GONE))))
            return len(ids)

    def list(self, cls: type[R]) -> list[R]:
        with self.session() as s:
            return list(s.scalars(select(cls)))

    # -- volumes ------------------------------------------------------------------------

    HOLDING = frozenset(set(State) - GONE - {State.FAILED})
    """States in which a sandbox holds the volumes attached to it."""

    def volume_holders(self, volume_id: str) -> "builtins.list[VolumeAttachmentRecord]":
        """The attachments of ``volume_id`` whose sandbox still holds it (exists, not failed)."""
        with self.session() as s:
            q = (select(VolumeAttachmentRecord).join(
                SandboxRecord, SandboxRecord.id == VolumeAttachmentRecord.sandbox_id)
                .where(VolumeAttachmentRecord.volume_id == volume_id,
                       SandboxRecord.state.in_(list(self.HOLDING))))
            return list(s.scalars(q))

    def attachments(self, sandbox_id: str) -> "builtins.list[VolumeAttachmentRecord]":
        """The sandbox's volumes, by drive index."""
        with self.session() as s:
            q = select(VolumeAttachmentRecord).where(
                VolumeAttachmentRecord.sandbox_id == sandbox_id)
            return list(s.scalars(q.order_by(VolumeAttachmentRecord.index)))

    def detach_volumes(self, sandbox_id: str) -> int:
        """Forget the sandbox's attachments; returns how many went."""
        q = delete(VolumeAttachmentRecord).where(VolumeAttachmentRecord.sandbox_id == sandbox_id)
        with self.session() as s, s.begin():
            return int(s.execute(q).rowcount)  # type: ignore[attr-defined]

    def volume_by_name(self, name: str) -> VolumeRecord | None:
        with self.session() as s:
            return s.scalars(select(VolumeRecord).where(VolumeRecord.name == name)).first()

    # -- exposed ports --------------------------------------------------------------

    def ports(self, sandbox_id: str) -> "builtins.list[PortRecord]":
        """The sandbox's exposed ports, by port number."""
        with self.session() as s:
            q = select(PortRecord).where(PortRecord.sandbox_id == sandbox_id)
            return list(s.scalars(q.order_by(PortRecord.port)))

    def port(self, sandbox_id: str, port: int) -> PortRecord | None:
        with self.session() as s:
            return s.get(PortRecord, (sandbox_id, port))

    def put_port(self, rec: PortRecord) -> PortRecord:
        """Insert or replace the record of ``(rec.sandbox_id, rec.port)``."""
        with self.session() as s, s.begin():
            return s.merge(rec)

    def remove_ports(self, sandbox_id: str, port: int | None = None) -> int:
        """Forget one exposed port (or all of a sandbox's); returns how many went."""
        q = delete(PortRecord).where(PortRecord.sandbox_id == sandbox_id)
        if port is not None:
            q = q.where(PortRecord.port == port)
        with self.session() as s, s.begin():
            return int(s.execute(q).rowcount)  # type: ignore[attr-defined]
