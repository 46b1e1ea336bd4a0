"""Firecracker snapshot files: sparse memory, Diff merging, the manifest.

A snapshot directory (``hangar.layout.SnapshotPaths``) holds ``vmstate``
(device state), ``memory`` (guest RAM, sparse), ``disk.ext4`` (a sparse
copy of the writable drive) and ``snapshot.json`` (the manifest of
``hangar.engines.snapshot_io``, written last). ``FirecrackerEngine.snapshot``
pauses the VM, runs ``PUT /snapshot/create`` into the VMM's root, moves the
files out, punches holes into the memory file's zero blocks (a 256 MiB
guest's file then takes about 30 MB) and copies the drive. A Diff snapshot
(only pages dirtied since the VM's previous snapshot or restore, tracked
with ``track_dirty_pages``) is merged onto a copy of that snapshot's memory,
so every snapshot directory stands alone. A restore hard-links ``vmstate``
and ``memory`` into the new VMM's root (Firecracker maps the memory file
privately: the snapshot never changes) and copies ``disk.ext4``.

Templates (``Engine.snapshot(..., template=True)``) need nothing more here:
Firecracker's File memory backend maps ``memory`` ``MAP_PRIVATE``, so every
clone of one snapshot reads the pages it has not written from the host's
page cache of that one file, held once, and copies a page only when it
writes it. The file is root's and mode 0644, hard-linked into each jail:
the jailed VMM's uid can read it, never write it. Loading on demand through
a userfaultfd page-fault handler (``"backend_type": "Uffd"``) would serve
the same pages from one process instead of the page cache; it is not used.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hangar.engines import snapshot_io
from hangar.engines.base import VM
from hangar.engines.snapshot_io import SnapshotManifest

if TYPE_CHECKING:
    from hangar.engines.firecracker.engine import FirecrackerEngine

log = logging.getLogger("hangar.engine.firecracker")


async def dig_holes(path: Path) -> None:
    """Deallocate the all-zero blocks of ``path`` in place (``fallocate --dig-holes``).

    Firecracker writes every page of a full snapshot's memory file; most of
    a young guest's memory is zeros, so this shrinks the file on disk
    (256 MiB guest: 256 MiB to about 30 MB, in 0.2 s). Contents are unchanged;
    skipped when ``fallocate`` is missing or the filesystem cannot punch holes.
    """
    if shutil.which("fallocate") is None:
        return
    proc = await asyncio.create_subprocess_exec(
        "fallocate", "--dig-holes", str(path),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    _, err = await proc.communicate()
    if proc.returncode != 0:
        log.info("fallocate --dig-holes %s: %s", path, err.decode(errors="replace").strip())


def reports_holes(sparse_file: Path) -> bool:
    """Whether the filesystem of ``sparse_file`` (a file known to have holes) reports them.

    ``merge_diff`` relies on ``SEEK_HOLE``; a filesystem that does not
    implement it reports the whole file as data, and a merge would then
    overwrite the base memory with the diff's zeros.
    """
    try:
        fd = os.open(sparse_file, os.O_RDONLY)
    except OSError:
        return False
    try:
        return os.lseek(fd, 0, os.SEEK_HOLE) < os.fstat(fd).st_size
    except OSError:
        return False
    finally:
        os.close(fd)


def merge_diff(diff: Path, target: Path) -> int:
    """Copy the data extents of sparse ``diff`` over ``target`` at the same offsets.

    A Diff snapshot's memory file holds only dirtied pages (the rest are
    holes), so this turns a copy of the previous full memory file into the
    current one. Returns the bytes copied. Raises OSError.
    """
    copied = 0
    src = os.open(diff, os.O_RDONLY)
    try:
        dst = os.open(target, os.O_WRONLY)
        try:
            size = os.fstat(src).st_size
            pos = 0
            while pos < size:
                try:
                    start = os.lseek(src, pos, os.SEEK_DATA)
                except OSError:  # ENXIO: no data after pos
                    break
                end = os.lseek(src, start, os.SEEK_HOLE)
                off = start
                while off < end:
                    n = os.copy_file_range(src, dst, end - off, off, off)
                    if n <= 0:
                        raise OSError(f"copy_file_range stopped at {off} of {diff}")
                    off += n
                copied += end - start
                pos = end
        finally:
            os.close(dst)
    finally:
        os.close(src)
    return copied


def read_snapshot(source: Path) -> SnapshotManifest:
    """The manifest of a Firecracker snapshot directory, checked for its files.

    Raises NotFound when ``source`` holds no finished snapshot, EngineError
    when it is another engine's, of another format, or lacks a file.
    """
    return snapshot_io.read_manifest(source, "firecracker")


def manifest_of(engine: "FirecrackerEngine", vm: VM, disk: Path, created_at: float, started: float,
                state_bytes: int, disk_bytes: int, **fields: Any) -> SnapshotManifest:
    """The manifest of a snapshot ``engine`` just took of ``vm``: its image, kernel and
    machine from ``vm.extra``, ``disk`` (the copied drive) for the virtual size,
    ``created_at`` (epoch seconds), ``started`` (``time.monotonic()`` when the save began)
    for ``save_seconds``, sizes in bytes, and ``fields`` (``template``, ``memory``,
    ``extra``) as given."""
    x = vm.extra
    return SnapshotManifest(
        engine=engine.name, vmm_version=engine.version, accel=engine.accel,
        image_name=x.get("image", ""), image_digest=x.get("image_digest", ""),
        kernel_version=x.get("kernel_version", ""), vcpus=int(x.get("vcpus", 0)),
        memory_mib=int(x.get("memory_mib", 0)), disk_virtual_bytes=disk.stat().st_size,
        machine=[f"vcpus={x.get('vcpus')}", f"memory_mib={x.get('memory_mib')}"],
        created_at=created_at, state_bytes=state_bytes, disk_bytes=disk_bytes,
        save_seconds=round(time.monotonic() - started, 6), source_sandbox=vm.sandbox_id,
        **fields)
