"""Persistent records in SQLite (SQLAlchemy 2 ORM): sandboxes, snapshots, machines.

The store is the source of truth across server restarts: on start the
orchestrator reads every live record and adopts or cleans up its VM. Each
call is one short session, safe from any thread.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import JSON, Float, Integer, String, create_engine, event, select
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from hangar.core.states import LIVE, VMM_STATES, State


class Base(DeclarativeBase):
    pass


class SandboxRecord(Base):
    """One sandbox. Times are Unix seconds; sizes in MiB."""

    __tablename__ = "sandboxes"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    state: Mapped[str] = mapped_column(String(16), index=True)
    desired_state: Mapped[str] = mapped_column(String(16))
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
    desktop: Mapped[str | None] = mapped_column(String(32), nullable=True)
    sleep_snapshot: Mapped[str | None] = mapped_column(String(32), nullable=True)
    network: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    """Egress policy (``hangar.net.Policy`` as a dict); None: no NIC."""
    metadata_: Mapped[dict[str, Any]] = mapped_column("metadata", JSON, default=dict)


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


R = TypeVar("R", bound=Base)


class Store:
    """Thread-safe access to the records (one short session per call)."""

    def __init__(self, path: Path) -> None:
        self.engine = create_engine(f"sqlite:///{path}", connect_args={"check_same_thread": False})

        @event.listens_for(self.engine, "connect")
        def _pragmas(conn: Any, _: Any) -> None:
            cur = conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.close()

        Base.metadata.create_all(self.engine)
        self._session = sessionmaker(self.engine, expire_on_commit=False)

    def session(self) -> Session:
        return self._session()

    def add(self, record: Base) -> None:
        with self.session() as s, s.begin():
            s.add(record)

    def get(self, sandbox_id: str) -> SandboxRecord | None:
        return self.find(SandboxRecord, sandbox_id)

    def find(self, cls: type[R], key: str) -> R | None:
        with self.session() as s:
            return s.get(cls, key)

    def update(self, sandbox_id: str, **fields: Any) -> SandboxRecord | None:
        return self.change(SandboxRecord, sandbox_id, **fields)

    def change(self, cls: type[R], key: str, **fields: Any) -> R | None:
        with self.session() as s, s.begin():
            rec = s.get(cls, key)
            if rec is None:
                return None
            for name, value in fields.items():
                setattr(rec, name, value.value if isinstance(value, State) else value)
            if isinstance(rec, SandboxRecord):
                rec.updated_at = time.time()
            return rec

    def delete(self, sandbox_id: str) -> None:
        self.remove(SandboxRecord, sandbox_id)

    def remove(self, cls: type[Base], key: str) -> None:
        with self.session() as s, s.begin():
            rec = s.get(cls, key)
            if rec is not None:
                s.delete(rec)

    def live(self) -> list[SandboxRecord]:
        """Sandboxes that still exist (see ``states.LIVE``), oldest first."""
        return self._in_states(LIVE)

    def with_vmm(self) -> list[SandboxRecord]:
        """Sandboxes that may have a VMM process (they count against the cap)."""
        return self._in_states(VMM_STATES)

    def _in_states(self, states: set[State]) -> list[SandboxRecord]:
        with self.session() as s:
            q = select(SandboxRecord).where(SandboxRecord.state.in_([x.value for x in states]))
            return list(s.scalars(q.order_by(SandboxRecord.created_at)))

    def all(self) -> list[SandboxRecord]:
        with self.session() as s:
            return list(s.scalars(select(SandboxRecord).order_by(SandboxRecord.created_at)))

    def list(self, cls: type[R]) -> list[R]:
        with self.session() as s:
            return list(s.scalars(select(cls)))
