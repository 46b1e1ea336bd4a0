"""Persistent records in SQLite (SQLAlchemy 2 ORM): sandboxes, snapshots, machines, ports.

The store is the source of truth across server restarts: on start the
orchestrator reads every live record and adopts or cleans up its VM
(``hangar.core.recovery``). Each call is one short session and one
transaction.

A sandbox's state changes only through ``Store.transition``: a
compare-and-set (``UPDATE ... WHERE id = ? AND state IN (...)``) of a move
that ``hangar.core.lifecycle.MOVES`` allows. ``update`` changes any other
field and refuses ``state``. Listeners registered with ``on_transition``
hear every move once it is committed (the event bus uses this).

Columns added since a data directory was made are added to its tables at
start (``ALTER TABLE ... ADD COLUMN``, nullable), so old databases keep working.
"""

from __future__ import annotations

import builtins
import logging
import time
from collections.abc import Callable, Collection, Iterable
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import (
    JSON, Boolean, Enum, Float, Integer, String, create_engine, delete, event, inspect, select,
    text, update,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from hangar.core.lifecycle import DESIRED, LIVE, VMM_STATES, State, check, check_desired
from hangar.errors import Conflict, NotFound
from hangar.images import image_id  # noqa: F401  (re-exported: a record's build id)

log = logging.getLogger("hangar.store")


def _state_column() -> Enum:
    # Stored as the value ("running"), as a VARCHAR: databases made before the
    # column was an Enum hold exactly these strings.
    return Enum(State, native_enum=False, length=16, create_constraint=False,
                validate_strings=True, values_callable=lambda e: [m.value for m in e])


class Base(DeclarativeBase):
    pass


class SandboxRecord(Base):
    """One sandbox. Times are Unix seconds; sizes in MiB."""

    __tablename__ = "sandboxes"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    state: Mapped[State] = mapped_column(_state_column(), index=True)
    desired_state: Mapped[State] = mapped_column(_state_column())
    """``running`` or ``sleeping``; while ``stopping``: deleted, expired or failed."""
    image: Mapped[str] = mapped_column(String(64))
    image_digest: Mapped[str] = mapped_column(String(64), default="")
    engine: Mapped[str] = mapped_column(String(16))
    accel: Mapped[str] = mapped_column(String(8), default="")
    vcpus: Mapped[int] = mapped_column(Integer)
    memory_mib: Mapped[int] = mapped_column(Integer)
    disk_mib: Mapped[int] = mapped_column(Integer)
    pid: Mapped[int | None] = mapped_column(Integer, nullable=True)
    created_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)
    last_active_at: Mapped[float] = mapped_column(Float, default=0.0)
    expires_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    error: Mapped[str | None] = mapped_column(String(1024), nullable=True)
    """Why it failed, or the last error of a reconcile step (cleared when one succeeds)."""
    desktop: Mapped[str | None] = mapped_column(String(32), nullable=True)
    sleep_snapshot: Mapped[str | None] = mapped_column(String(32), nullable=True)
    """Id of the snapshot it sleeps in; set once that snapshot is complete."""
    restore_from: Mapped[str | None] = mapped_column(String(32), nullable=True)
    source: Mapped[str | None] = mapped_column(String(8), nullable=True)
    """Where its VM came from: ``cold`` (booted), ``pool`` (the warm pool) or ``fork``."""
    """While ``restoring``: the snapshot being restored (a restarted server redoes it)."""
    network: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    """Egress policy (``hangar.net.Policy`` as a dict); None: no NIC."""
    metadata_: Mapped[dict[str, Any]] = mapped_column("metadata", JSON, default=dict)

    @property
    def user_id(self) -> str | None:
        """The user whose machine this is, or None."""
        v = (self.metadata_ or {}).get("user_id")
        return v if isinstance(v, str) else None

    @property
    def idle_timeout_s(self) -> float | None:
        """Idle seconds before it sleeps (machines), or None."""
        v = (self.metadata_ or {}).get("idle_timeout_s")
        return float(v) if v else None


class SnapshotRecord(Base):
    """One snapshot: memory, device state and disk of a sandbox at one moment.

    ``kind`` is ``user`` (made through the API) or ``sleep`` (made when a
    machine went to sleep; removed once it has woken).
    """

    __tablename__ = "snapshots"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    sandbox_id: Mapped[str] = mapped_column(String(32), index=True)
    kind: Mapped[str] = mapped_column(String(8))
    size_bytes: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[float] = mapped_column(Float)
    image: Mapped[str] = mapped_column(String(64))
    image_digest: Mapped[str] = mapped_column(String(64))
    vcpus: Mapped[int] = mapped_column(Integer)
    memory_mib: Mapped[int] = mapped_column(Integer)
    disk_mib: Mapped[int] = mapped_column(Integer)
    desktop: Mapped[str | None] = mapped_column(String(32), nullable=True)
    network: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)


class MachineRecord(Base):
    """A user's persistent machine: one sandbox that sleeps when idle."""

    __tablename__ = "machines"

    user_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    sandbox_id: Mapped[str] = mapped_column(String(32))
    idle_timeout_s: Mapped[float] = mapped_column(Float)
    created_at: Mapped[float] = mapped_column(Float)


class PortRecord(Base):
    """A guest TCP port exposed through Hangar's HTTP server (``hangar.core.ports``).

    ``nonce`` (random hex) is part of what its URL tokens sign, so tokens issued
    before a port was closed never open it again once it is exposed anew.
    """

    __tablename__ = "ports"

    sandbox_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    port: Mapped[int] = mapped_column(Integer, primary_key=True)
    public: Mapped[bool] = mapped_column(Boolean, default=False)
    nonce: Mapped[str] = mapped_column(String(32))
    created_at: Mapped[float] = mapped_column(Float)
class CounterRecord(Base):
    """A named number that only grows (``Store.next_value``)."""

    __tablename__ = "counters"

    name: Mapped[str] = mapped_column(String(32), primary_key=True)
    value: Mapped[int] = mapped_column(Integer, default=0)


R = TypeVar("R", bound=Base)

TransitionListener = Callable[[SandboxRecord, frozenset[State], State], None]
"""Called with (the record after the move, the states it was expected in, the new state)."""


class Store:
    """Access to the records; one short session and transaction per call."""

    def __init__(self, path: Path) -> None:
        self.engine = create_engine(f"sqlite:///{path}", connect_args={"check_same_thread": False})

        @event.listens_for(self.engine, "connect")
        def _pragmas(conn: Any, _: Any) -> None:
            cur = conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.close()

        Base.metadata.create_all(self.engine)
        self._add_missing_columns()
        self._session = sessionmaker(self.engine, expire_on_commit=False)
        self._listeners: list[TransitionListener] = []

    def _add_missing_columns(self) -> None:
        insp = inspect(self.engine)
        with self.engine.begin() as conn:
            for table in Base.metadata.sorted_tables:
                have = {c["name"] for c in insp.get_columns(table.name)}
                for col in table.columns:
                    if col.name not in have:
                        kind = col.type.compile(self.engine.dialect)
                        conn.execute(text(f'ALTER TABLE {table.name} ADD COLUMN "{col.name}" {kind}'))
                        log.info("column added", extra={"table": table.name, "column": col.name})

    def session(self) -> Session:
        return self._session()

    def on_transition(self, listener: TransitionListener) -> None:
        """Call ``listener`` after every committed move (it must not raise or block)."""
        self._listeners.append(listener)

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
        return rec

    def discard(self, sandbox_id: str, expect: State | Collection[State]) -> bool:
        """Remove the record if it is in ``expect`` (a failed create, a retired pool VM).

        Returns False when it is in another state (e.g. a delete took it over).
        """
        exp = frozenset({expect} if isinstance(expect, State) else expect)
        with self.session() as s, s.begin():
            res = s.execute(delete(SandboxRecord).where(
                SandboxRecord.id == sandbox_id, SandboxRecord.state.in_(exp)))
            return bool(res.rowcount)  # type: ignore[attr-defined]

    # -- sandboxes: other fields -------------------------------------------------

    def add(self, *records: Base) -> None:
        """Insert records in one transaction."""
        with self.session() as s, s.begin():
            s.add_all(records)

    def get(self, sandbox_id: str) -> SandboxRecord | None:
        return self.find(SandboxRecord, sandbox_id)

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
        """Sandboxes in any of ``states``, oldest first."""
        with self.session() as s:
            q = select(SandboxRecord).where(SandboxRecord.state.in_(list(states)))
            return list(s.scalars(q.order_by(SandboxRecord.created_at)))

    def all(self) -> list[SandboxRecord]:
        with self.session() as s:
            return list(s.scalars(select(SandboxRecord).order_by(SandboxRecord.created_at)))

    def list(self, cls: type[R]) -> list[R]:
        with self.session() as s:
            return list(s.scalars(select(cls)))

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
