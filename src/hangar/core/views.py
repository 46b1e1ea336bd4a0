"""What core shows outside itself: frozen views of its records, and a sandbox's wire schema.

The face (``hangar.core.service``) answers with these views, never with the
store's rows: a view is a copy taken when it was read, so holding one keeps
no database session and no caller can change a record through it.

=================  ===========================================================
``SandboxView``    a sandbox (``store.SandboxRecord``): same field names
``SnapshotView``   a snapshot (``store.SnapshotRecord``)
``VolumeView``     a named volume with the sandboxes holding it
``SecretView``     a vault entry's name and hosts (never its value)
``MachineView``    a user's machine (``machines.Machine``; named by ``service``)
=================  ===========================================================

``sandbox_view`` turns a ``SandboxView`` into what ``GET /sandboxes/{id}``
shows; a cluster node stores the same in its directory record
(``status.view``), so a sandbox whose node is lost is still shown exactly as
its node last showed it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from hangar.core.lifecycle import Face, OnExpiry, State, public_name
from hangar.images import image_id
from hangar.schemas import SandboxInfo

if TYPE_CHECKING:
    from hangar.core.store import SandboxRecord

__all__ = ["AttachmentView", "SandboxView", "SecretView", "SnapshotView",
           "VolumeView", "sandbox_view", "user_metadata"]

_V = TypeVar("_V")


def _copy(cls: type[_V], row: Any, **extra: Any) -> _V:
    """A ``cls`` of the fields of ``row`` (a record, or a view already) that ``cls`` names."""
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    names = [f.name for f in fields if f.name not in extra]
    return cls(**{n: getattr(row, n) for n in names}, **extra)


@dataclass(frozen=True)
class SandboxView:
    """A sandbox as read from the store. Times are Unix seconds, sizes MiB; ``network`` is
    the stored egress policy, ``metadata_`` the client's metadata as stored (see
    ``user_metadata``), ``e2b`` what E2B's API keeps on it; ``on_expiry`` what its time
    limit ends in (None: delete), ``auto_resume`` whether a call wakes it then, ``ttl_s``
    its time to live as last set, ``wake_ttl_s`` the one a pause gives back on waking,
    ``sleep_memory`` False when a sleep at expiry keeps its disk alone (None: memory too)."""

    id: str
    state: State
    desired_state: State
    image: str
    image_digest: str
    engine: str
    accel: str
    vcpus: int
    memory_mib: int
    disk_mib: int
    pid: int | None
    created_at: float
    updated_at: float
    last_active_at: float
    expires_at: float | None
    error: str | None
    desktop: str | None
    sleep_snapshot: str | None
    restore_from: str | None
    source: str | None
    network: dict[str, Any] | None
    metadata_: dict[str, Any]
    user_id: str | None
    idle_timeout_s: float | None
    pooled: bool | None
    e2b: dict[str, Any] | None
    on_expiry: OnExpiry | None
    auto_resume: bool | None
    ttl_s: float | None
    wake_ttl_s: float | None
    sleep_memory: bool | None = None
    team: str | None = None
    """The team whose key made it (``hangar.core.teams``), or None: the operator's."""

    @classmethod
    def of(cls, rec: Any) -> SandboxView:
        """The view of ``rec`` (a ``SandboxRecord``; a view is returned as is)."""
        return rec if isinstance(rec, SandboxView) else _copy(cls, rec)

    @property
    def image_id(self) -> str:
        """The image's public id: its name and build digest (``hangar.images.image_id``)."""
        return image_id(self.image, self.image_digest)


@dataclass(frozen=True)
class SnapshotView:
    """A snapshot: ``kind`` ``full``/``sleep``..., ``size_bytes`` on disk, times Unix seconds."""

    id: str
    sandbox_id: str
    kind: str
    size_bytes: int
    created_at: float
    image: str
    image_digest: str
    vcpus: int
    memory_mib: int
    disk_mib: int
    desktop: str | None
    network: dict[str, Any] | None
    name: str | None = None
    """The name its client gave it, or None (``Snapshots.named``)."""
    memory: bool | None = None
    """False: a sleep snapshot of the disk alone (booted from); None or True: a full one."""
    team: str | None = None
    """The team whose sandbox it was taken of (``hangar.core.teams``), or None."""

    @classmethod
    def of(cls, rec: Any) -> SnapshotView:
        return rec if isinstance(rec, SnapshotView) else _copy(cls, rec)

    @property
    def image_id(self) -> str:
        """The image's public id: its name and build digest (``hangar.images.image_id``)."""
        return image_id(self.image, self.image_digest)


@dataclass(frozen=True)
class AttachmentView:
    """A volume mounted in a sandbox at ``path``."""

    sandbox_id: str
    path: str
    read_only: bool


@dataclass(frozen=True)
class VolumeView:
    """A named volume: size MiB, times Unix seconds, the sandboxes that hold it."""

    id: str
    name: str
    size_mib: int
    created_at: float
    updated_at: float
    attached: tuple[AttachmentView, ...] = ()

    @classmethod
    def of(cls, rec: Any, holders: Any = ()) -> VolumeView:
        """The view of volume record ``rec`` held by ``holders`` (attachment records)."""
        return _copy(cls, rec, attached=tuple(
            AttachmentView(a.sandbox_id, a.path, bool(a.read_only)) for a in holders))


@dataclass(frozen=True)
class FsckView:
    """What ``e2fsck -f -y`` did to a volume: its exit code (0: sound, 1 to 3: repaired),
    whether it repaired anything, and the last 4 KiB of its output."""

    id: str
    name: str
    exit_code: int
    repaired: bool
    output: str


@dataclass(frozen=True)
class SecretView:
    """A vault entry without its value: the hosts it may be sent to, times Unix seconds."""

    name: str
    hosts: tuple[str, ...]
    created_at: float
    updated_at: float

    @classmethod
    def of(cls, rec: Any) -> SecretView:
        return _copy(cls, rec, hosts=tuple(rec.hosts))


def user_metadata(rec: SandboxView | SandboxRecord) -> dict[str, str]:
    """The client's metadata of ``rec`` (string keys and values; anything else a damaged
    or old record holds is left out)."""
    raw = rec.metadata_
    if not isinstance(raw, dict):
        return {}
    return {k: v for k, v in raw.items() if isinstance(k, str) and isinstance(v, str)}


def sandbox_view(rec: SandboxView | SandboxRecord) -> SandboxInfo:
    """What ``GET /sandboxes/{id}`` shows of ``rec`` (without the live memory figures)."""
    return SandboxInfo(
        id=rec.id, state=public_name(rec.state, Face.NATIVE) or rec.state.value, image=rec.image,
        image_id=image_id(rec.image, rec.image_digest), engine=rec.engine, accel=rec.accel,
        vcpus=rec.vcpus, memory_mib=rec.memory_mib, disk_mib=rec.disk_mib,
        created_at=rec.created_at, expires_at=rec.expires_at, error=rec.error,
        metadata=user_metadata(rec),
        desktop=rec.desktop, network=rec.network, source=rec.source, team=rec.team,
    )
