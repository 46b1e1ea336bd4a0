"""Snapshot files on disk, and refreshing a guest after a restore.

A snapshot is one directory that an engine writes with ``Engine.snapshot``
and any number of new sandboxes start from with ``Engine.restore``. Its
files are named in ``hangar.layout.SnapshotPaths``; for QEMU::

    <snapshot>/
      state.mig       the VMM's saved device state and RAM: QEMU's migration
                      stream, written by ``migrate fd:`` (pages that are all
                      zero take a few bytes each, so the stream is about the
                      size of the guest memory in use), stored compressed
                      with zstd (level 1; ``state_compression`` ``zstd``,
                      about 3.5 x smaller: 104 MiB of an idle 512 MiB guest
                      became 29 MiB) through a pipe whose other end QEMU
                      writes (``hangar.engines.qemu.streampipe``); a
                      template's holds the device state only and is stored as
                      QEMU wrote it (``none``, as in every format-1 snapshot)
      disk.qcow2      copy of the sandbox's qcow2 overlay at the moment of
                      the snapshot; its backing file is the image's
                      read-only rootfs, repointed on every restore at the
                      build the manifest names (``image_name``-``image_digest``),
                      never at another one
      snapshot.json   the manifest (``SnapshotManifest``); written last, so a
                      directory without it is an unfinished snapshot
      memory.ram      a template's only (``SnapshotManifest.template``): the
                      guest's RAM, byte for byte, zero pages as holes, mode
                      0444; ``state.mig`` then holds the device state only,
                      and clones map this file's contents copy-on-write
                      (``hangar.engines.qemu.template``)

(Firecracker's: ``vmstate``, ``memory``, ``disk.ext4`` and ``snapshot.json``;
see ``hangar.engines.firecracker.snapshots``.)

A disk-only snapshot (``Engine.snapshot(..., memory=False)``,
``SnapshotManifest.memory`` false) holds the disk and the manifest alone: no
device state, no RAM. It is never restored; a VM boots cold from a copy of
its disk (``VMSpec.disk_from``).

Every snapshot with RAM in its stream is compressed alike: a user snapshot
(``POST /sandboxes/{id}/snapshots``, and so the source of forks and of
builds' layers), a sleep, a snapshot shared with another cluster node (its
files are copied as they are). A template's is not: its stream is small
and every create restores it, so it is read as QEMU wrote it. The
manifest's ``state_compression`` says which, and a snapshot written before
(manifest format 1, no such field) is read as it is. A Hangar older than
format 2 refuses a format-2 snapshot by its format.

The files are never changed after the manifest is written: a restore copies
the disk, so one snapshot can be restored any number of times, also at once
(forks). Deleting a snapshot is removing its directory.

A restored guest resumes with the wall clock and the entropy pool it had
when it was saved: ``refresh_guest`` sets the clock from the host's and
mixes fresh host entropy into the guest kernel's pool. The orchestrator
calls it after every restore, before the sandbox is handed out.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hangar.durable import atomic_write
from hangar.errors import EngineError, NotFound
from hangar.layout import SnapshotPaths

if TYPE_CHECKING:
    from hangar.engines.agent_client import AgentClient

FORMAT = 2
"""The manifest format written: 2 added ``state_compression``."""
READS = (1, 2)
"""The manifest formats read: a format-1 snapshot's ``state.mig`` is uncompressed."""
RESEED_BYTES = 32
NONE = "none"
ZSTD = "zstd"
COMPRESSIONS = (NONE, ZSTD)
"""How a QEMU snapshot's ``state.mig`` may be stored (``SnapshotManifest.state_compression``)."""


@dataclass(frozen=True)
class SnapshotManifest:
    """What a snapshot holds and the machine it needs. Sizes in bytes, times in seconds.

    ``machine`` is the VMM arguments that must be identical on restore (for
    QEMU: ``-M``, ``-accel``, ``-cpu``, ``-smp``, ``-m``); ``vcpus`` and
    ``memory_mib`` repeat two of them for the orchestrator, which must
    restore with a ``VMSpec`` of the same shape.

    A ``template`` (QEMU: ``Engine.snapshot(..., template=True)``) is
    restored only where all of these match: ``vmm_version`` (the exact
    QEMU build: a stream without RAM is read against the device layout of
    the QEMU that wrote it), ``machine`` (hence vCPUs and memory size),
    ``image_digest`` (which fixes the kernel, ``kernel_version``) and the
    memory file's size and ``memory_sha256``; any other snapshot is only
    warned about when the VMM's version differs.
    """

    engine: str
    vmm_version: str
    accel: str
    image_name: str
    image_digest: str
    kernel_version: str
    vcpus: int
    memory_mib: int
    disk_virtual_bytes: int
    """Size of the guest's disk as the guest sees it."""
    machine: list[str]
    created_at: float
    """Unix time at which the VM was paused for the snapshot."""
    state_bytes: int
    """Allocated size of ``state.mig`` (as stored: compressed when ``state_compression``
    says so)."""
    disk_bytes: int
    """Allocated size of ``disk.qcow2`` (the sandbox's own changes only)."""
    save_seconds: float
    """Wall time the snapshot took, from pause to manifest."""
    source_sandbox: str = ""
    format: int = FORMAT
    extra: dict[str, Any] = field(default_factory=dict)
    template: bool = False
    """Clones share this snapshot's memory (``memory.ram``) copy-on-write."""
    memory_bytes: int = 0
    """Allocated size of a template's ``memory.ram`` (0 for other snapshots)."""
    memory_sha256: str = ""
    """SHA-256 (hex) of a template's ``memory.ram``, all ``memory_mib`` MiB of it."""
    memory: bool = True
    """False: a disk-only snapshot (no device state or RAM; ``state_bytes`` 0), which a VM
    boots from (``VMSpec.disk_from``) and no ``Engine.restore`` takes."""
    state_compression: str = NONE
    """How ``state.mig`` is stored: ``zstd`` (a zstd stream of the migration stream; a QEMU
    snapshot with RAM in its stream) or ``none`` (as QEMU wrote it: a template's, a
    Firecracker snapshot's, and every snapshot of manifest format 1)."""

    @property
    def total_bytes(self) -> int:
        return self.state_bytes + self.disk_bytes + self.memory_bytes

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "total_bytes": self.total_bytes}, indent=2)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "SnapshotManifest":
        raw = dict(raw)
        raw.pop("total_bytes", None)
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in raw.items() if k in known})


def read_manifest(snapshot_dir: Path, engine: str = "qemu") -> SnapshotManifest:
    """The manifest of ``engine``'s snapshot in ``snapshot_dir``, checked for its files.

    Raises ``NotFound`` when there is no finished snapshot there, and
    ``EngineError`` when its manifest is unreadable, of another format or
    engine, or a file it needs is missing.
    """
    files = SnapshotPaths(snapshot_dir)
    path = files.manifest
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise NotFound(f"no snapshot in {snapshot_dir}", snapshot=str(snapshot_dir)) from None
    except (OSError, ValueError) as exc:
        raise EngineError(f"unreadable snapshot manifest {path}: {exc}") from None
    if raw.get("format") not in READS:
        raise EngineError(f"snapshot {snapshot_dir} has format {raw.get('format')!r}; "
                          f"this Hangar reads formats {', '.join(map(str, READS))}")
    if raw.get("engine") != engine:
        raise EngineError(f"snapshot {snapshot_dir} was made by the {raw.get('engine')} "
                          f"engine, not {engine}")
    try:
        m = SnapshotManifest.from_dict(raw)
    except TypeError as exc:
        raise EngineError(f"snapshot manifest {path} lacks fields: {exc}") from None
    needed: tuple[Path, ...] = ((files.state, files.disk) if engine == "qemu"
                                else (files.fc_state, files.fc_memory, files.fc_disk))
    if not m.memory:
        needed = (files.disk if engine == "qemu" else files.fc_disk,)
    if engine == "qemu" and m.template:
        needed = (*needed, template_memory(snapshot_dir))
    for f in needed:
        if not f.is_file():
            raise EngineError(f"snapshot {snapshot_dir} lacks {f.name}")
    if m.state_compression not in COMPRESSIONS:
        raise EngineError(f"snapshot {snapshot_dir} stores its state with "
                          f"{m.state_compression!r}, which this Hangar cannot read "
                          f"({', '.join(COMPRESSIONS)})")
    return m


def check_restorable(m: SnapshotManifest, source: Path, sandbox_id: str) -> None:
    """Raise EngineError when ``m`` is a disk-only snapshot's: a VM boots from its disk
    (``VMSpec.disk_from``), it is never restored."""
    if not m.memory:
        raise EngineError(f"snapshot {source} holds a disk only: boot from it, it cannot be "
                          "restored", sandbox_id=sandbox_id)


def disk_source(source: Path, engine: str, image_digest: str, sandbox_id: str) -> Path:
    """The disk file of the snapshot in ``source`` that a VM of the image build
    ``image_digest`` boots from (``VMSpec.disk_from``). Raises NotFound (no finished
    snapshot there), EngineError (another engine's or image build's, or a file missing)."""
    m = read_manifest(source, engine)
    if m.image_digest != image_digest:
        raise EngineError(f"snapshot {source} is of image {m.image_name}-{m.image_digest}, "
                          f"not of build {image_digest}", sandbox_id=sandbox_id)
    files = SnapshotPaths(source)
    return files.disk if engine == "qemu" else files.fc_disk


def template_memory(snapshot_dir: Path) -> Path:
    """A QEMU template snapshot's memory file, ``memory.ram``."""
    return snapshot_dir / "memory.ram"


def write_manifest(snapshot_dir: Path, manifest: SnapshotManifest) -> None:
    """Write ``snapshot.json`` atomically and durably (``hangar.durable.atomic_write``)."""
    atomic_write(SnapshotPaths(snapshot_dir).manifest, manifest.to_json().encode(), 0o644)


def allocated_bytes(path: Path) -> int:
    """Bytes ``path`` occupies on disk (its blocks, not its apparent size); 0 if absent."""
    try:
        return path.stat().st_blocks * 512
    except OSError:
        return 0


def fsync_file(path: Path) -> None:
    """Flush one file's data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


async def copy_file(src: Path, dst: Path) -> None:
    """Copy ``src`` to ``dst`` keeping holes, sharing extents where the filesystem can.

    Uses ``cp --reflink=auto --sparse=always``. Raises ``EngineError``.
    """
    proc = await asyncio.create_subprocess_exec(
        "cp", "--reflink=auto", "--sparse=always", "--", str(src), str(dst),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    _, err = await proc.communicate()
    if proc.returncode != 0:
        raise EngineError(f"copying {src} failed: {err.decode(errors='replace').strip()}")


async def refresh_guest(agent: "AgentClient") -> dict[str, float | int]:
    """Set a restored guest's wall clock to the host's and reseed its entropy pool.

    Returns ``skew_s`` (seconds the guest clock was behind the host's before
    it was set; negative when it was ahead), ``rtt_s`` (round trip of the
    ``set_time`` request, an upper bound of the error left in the clock) and
    ``reseed_bytes`` (bytes of host entropy given to the guest, 32).
    Raises ``GuestError`` (or another agent error) when the agent refuses.
    """
    sent = time.monotonic()
    clock = await agent.set_time(time.time_ns())
    rtt = time.monotonic() - sent
    seeded = await agent.reseed(os.urandom(RESEED_BYTES))
    return {"skew_s": clock.skew_s, "rtt_s": rtt, "reseed_bytes": seeded.bytes}
