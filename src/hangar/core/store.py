"""Persistent sandbox records in SQLite (SQLAlchemy 2 ORM).

The store is the source of truth across server restarts: on start the
orchestrator reads every live record and adopts or cleans up its VM.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from sqlalchemy import JSON, Float, Integer, String, create_engine, event, select
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from hangar.core.states import LIVE, State


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
    expires_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    error: Mapped[str | None] = mapped_column(String(1024), nullable=True)
    desktop: Mapped[str | None] = mapped_column(String(32), nullable=True)
    metadata_: Mapped[dict[str, Any]] = mapped_column("metadata", JSON, default=dict)


class Store:
    """Thread-safe access to sandbox records (one short session per call)."""

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

    def add(self, record: SandboxRecord) -> None:
        with self.session() as s, s.begin():
            s.add(record)

    def get(self, sandbox_id: str) -> SandboxRecord | None:
        with self.session() as s:
            return s.get(SandboxRecord, sandbox_id)

    def update(self, sandbox_id: str, **fields: Any) -> SandboxRecord | None:
        with self.session() as s, s.begin():
            rec = s.get(SandboxRecord, sandbox_id)
            if rec is None:
                return None
            for key, value in fields.items():
                setattr(rec, key, value.value if isinstance(value, State) else value)
            rec.updated_at = time.time()
            return rec

    def delete(self, sandbox_id: str) -> None:
        with self.session() as s, s.begin():
            rec = s.get(SandboxRecord, sandbox_id)
            if rec is not None:
                s.delete(rec)

    def live(self) -> list[SandboxRecord]:
        with self.session() as s:
            q = select(SandboxRecord).where(SandboxRecord.state.in_([x.value for x in LIVE]))
            return list(s.scalars(q.order_by(SandboxRecord.created_at)))

    def all(self) -> list[SandboxRecord]:
        with self.session() as s:
            return list(s.scalars(select(SandboxRecord).order_by(SandboxRecord.created_at)))
