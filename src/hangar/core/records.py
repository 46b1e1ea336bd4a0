"""The rows Hangar keeps in SQLite (SQLAlchemy 2 ORM declarative classes): sandboxes,
snapshots, machines, ports, volumes and their attachments, and counters. ``Store``
(``hangar.core.store``) reads and writes them; this module only declares them, with
``unsound``, the check a row read back must pass (SQLite stores any value in any column,
so a damaged or forged database may hold a field of the wrong type).

Times are seconds since the epoch (float); sizes are MiB where a column says ``_mib``.
"""

from __future__ import annotations

from typing import Any, TypeVar

from sqlalchemy import JSON, Boolean, Enum, Float, Integer, String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from hangar.core.lifecycle import OnExpiry, State


def _state_column() -> Enum:
    # Stored as the value ("running"), as a VARCHAR: databases made before the
    # column was an Enum hold exactly these strings.
    return Enum(State, native_enum=False, length=16, create_constraint=False,
                validate_strings=True, values_callable=lambda e: [m.value for m in e])


def _expiry_column() -> Enum:
    return Enum(OnExpiry, native_enum=False, length=8, create_constraint=False,
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
    """The client's metadata (string keys and values), opaque to Hangar: never read as state."""
    user_id: Mapped[str | None] = mapped_column(String(128), nullable=True, default=None)
    """The user whose machine this is (``hangar.core.machines``), or None."""
    idle_timeout_s: Mapped[float | None] = mapped_column(Float, nullable=True, default=None)
    """Idle seconds before it sleeps (machines), or None: never for idleness."""
    pooled: Mapped[bool | None] = mapped_column(Boolean, nullable=True, default=False)
    """True while it is a warm-pool VM nobody has claimed (``hangar.core.pool``)."""
    team: Mapped[str | None] = mapped_column(String(64), nullable=True, default=None)
    """The team whose key made it (``hangar.core.teams``), or None: the operator's."""
    e2b: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True, default=None)
    """E2B's options of a sandbox made through ``/e2b`` (``hangar.core.e2b.Options``), or None."""
    on_expiry: Mapped[OnExpiry | None] = mapped_column(_expiry_column(), nullable=True,
                                                       default=None)
    """What the end of its time to live does (``lifecycle.OnExpiry``); None: ``delete``."""
    auto_resume: Mapped[bool | None] = mapped_column(Boolean, nullable=True, default=False)
    """Whether its create asked a call to wake it once it sleeps (E2B's ``autoResume``);
    kept as asked: Hangar wakes a sleeping sandbox on any call to it."""
    ttl_s: Mapped[float | None] = mapped_column(Float, nullable=True, default=None)
    """The time to live it was created with, seconds (None: none); what a sleep that
    stopped its clock gives back when it wakes."""
    wake_ttl_s: Mapped[float | None] = mapped_column(Float, nullable=True, default=None)
    """Set (armed) by ``pause`` and a sleep at expiry: its clock stops when it falls asleep
    (``expires_at`` None), and when it wakes it lives this many seconds more (0: no limit),
    unless a connect gives its own. None: its clock runs on while it sleeps."""
    sleep_memory: Mapped[bool | None] = mapped_column(Boolean, nullable=True, default=None)
    """What a sleep at expiry (``on_expiry`` sleep) keeps: its memory (None, True: the wake
    restores its processes) or its disk alone (False: the wake boots it cold from its
    disk; E2B's ``autoPauseMemory: false``)."""


class SnapshotRecord(Base):
    """One snapshot: memory, device state and disk of a sandbox at one moment.

    ``kind`` is ``user`` (made through the API) or ``sleep`` (made when a
    machine went to sleep; removed once it has woken). ``memory`` False: a sleep
    snapshot of the disk alone (no memory or device state), which the sandbox wakes from
    by booting cold (``hangar.core.sleep``); None or True: memory, devices and disk.
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
    name: Mapped[str | None] = mapped_column(String(128), nullable=True, index=True)
    """A name the client gave it (several may share one; the newest answers to it)."""
    memory: Mapped[bool | None] = mapped_column(Boolean, nullable=True, default=None)
    """False: the disk alone (booted from, never restored); None or True: a full one."""
    team: Mapped[str | None] = mapped_column(String(64), nullable=True, default=None)
    """The team of the sandbox it was taken of (``hangar.core.teams``), or None."""


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
class VolumeRecord(Base):
    """A named volume (``hangar.core.volumes``): an ext4 image that outlives sandboxes.

    ``size_mib`` in MiB; times are Unix seconds."""

    __tablename__ = "volumes"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    size_mib: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)


class VolumeAttachmentRecord(Base):
    """A volume attached to a sandbox at ``path`` in its guest; ``index`` is its drive's
    place among the sandbox's volumes (``SandboxPaths.volume``). It holds the volume while
    the sandbox lives (``Store.volume_holders``)."""

    __tablename__ = "volume_attachments"

    sandbox_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    volume_id: Mapped[str] = mapped_column(String(32), primary_key=True, index=True)
    index: Mapped[int] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(String(256))
    read_only: Mapped[bool] = mapped_column(Boolean, default=False)


class CounterRecord(Base):
    """A named number that only grows (``Store.next_value``)."""

    __tablename__ = "counters"

    name: Mapped[str] = mapped_column(String(32), primary_key=True)
    value: Mapped[int] = mapped_column(Integer, default=0)


R = TypeVar("R", bound=Base)

_NUMBER = (int, float)
_SOUND: tuple[tuple[str, tuple[type, ...], bool], ...] = (
    ("state", (State,), False), ("desired_state", (State,), False),
    ("image", (str,), False), ("vcpus", (int,), False), ("memory_mib", (int,), False),
    ("disk_mib", (int,), False), ("created_at", _NUMBER, False),
    ("updated_at", _NUMBER, False), ("last_active_at", _NUMBER, True),
    ("expires_at", _NUMBER, True), ("pid", (int,), True), ("error", (str,), True),
    ("metadata_", (dict,), True), ("network", (dict,), True), ("user_id", (str,), True),
    ("idle_timeout_s", _NUMBER, True), ("e2b", (dict,), True), ("sleep_snapshot", (str,), True),
    ("restore_from", (str,), True), ("desktop", (str,), True), ("source", (str,), True),
    ("on_expiry", (OnExpiry,), True), ("ttl_s", _NUMBER, True), ("wake_ttl_s", _NUMBER, True),
)
"""A sandbox row's fields, the types each must have, and whether it may be NULL."""


def unsound(rec: "SandboxRecord") -> str | None:
    """What is wrong with a sandbox row a damaged or forged database holds (a field of the
    wrong type: SQLite stores any value in any column), or None when it is sound."""
    for name, types, nullable in _SOUND:
        value = getattr(rec, name, None)
        if value is None and nullable:
            continue
        if not isinstance(value, types) or isinstance(value, bool):
            return f"{name} is {type(value).__name__}"
    return None
