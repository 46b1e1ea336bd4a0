"""Template memory: clones of one template snapshot share its RAM copy-on-write.

A template is made from a VM booted with ``VMSpec.template_source``: its
RAM is the file ``SOURCE_RAM`` in its sandbox folder, mapped shared
(``argv.RamFile``, ``share=on``), so the file always holds the guest's
memory. ``QemuEngine.snapshot(vm, dest, template=True)`` pauses it, saves
the device state with ``x-ignore-shared`` (``migration``: the stream leaves
that RAM out and takes a few hundred KiB) and copies the file with
``save_memory`` into the snapshot's ``memory.ram`` (zero pages left as
holes, made read-only, its SHA-256 in the manifest).

A clone's QEMU maps that memory privately (``share=off``: ``MAP_PRIVATE``,
copy-on-write) and loads only the device state, so every page no clone has
written is held once on the host, and ``/proc/PID/smaps`` counts it to each
clone's Pss divided by the number of clones mapping it.

Why a sealed memfd and not the file itself: QEMU 7.2 opens a
``memory-backend-file`` read-write even for a private mapping (only 8.2's
``rom=off`` separates the two), and when the balloon reports free pages it
punches holes into the file (``fallocate``), private mapping or not. A
clone given the template file would thus be able to change it, and would
change it. So ``TemplateMemories`` copies each template's memory once per
server process into a memfd (tmpfs pages, zero pages skipped, the SHA-256
checked on the way), seals it against writes, growth and shrinking
(``F_SEAL_WRITE``: ``write``, ``fallocate`` and shared writable mappings
fail; private mappings stay copy-on-write) and hands it to each clone as
an open file, which QEMU opens as ``/proc/self/fd/N`` or, in a private
view without ``/proc``, as ``VIEW_FDS/N`` (its own ``/proc/PID/fd`` bound
there read-only; a memfd itself cannot be bound: it lives in no mount of
the VMM's namespace). The VMM's uid never
gets the template file, and nothing, not even root through that memfd, can
change what clones map. Those hole punches also mean that templates and
their clones have a balloon without free page reporting
(``QemuCommand.balloon_args``): a clone keeps the private pages its guest
frees until it exits (the pages it never wrote cost nothing), and the
balloon's statistics work as for any guest.

The memfd holds the template's non-zero pages and grows where clones fault
on its holes (shmem gives a hole a zero page of its own, even when the
clone then writes a private copy): at most the guest's memory size once
per template, in no clone's Pss (``resident_bytes`` tells). Its pages are
charged to the cgroup of whoever first touched them (the server, or a
clone at a hole), so a clone's memory limit allows twice its guest
(``Confinement.limits``, ``template_clone``). ``release`` (``QemuEngine.release_snapshot``) drops a
template's memfd when its snapshot is deleted (running clones keep their
mapping), and a template whose file changed or vanished is dropped at the
next ``open``.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from hangar.engines.snapshot_io import template_memory
from hangar.errors import EngineError

SOURCE_RAM = "memory.ram"
"""A template source's RAM file, in its sandbox folder."""
VIEW_FDS = "/vmm-fd"
"""Where a confined clone's QEMU finds its own open files (its ``/proc/PID/fd``) in its
private view, to open the template's memfd by number."""
CHUNK = 64 << 10
"""Bytes copied (or skipped when all zero) at a time."""
SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL
_ZERO = bytes(CHUNK)


def make_source_ram(folder: Path, memory_mib: int) -> Path:
    """Create a template source's empty (sparse) RAM file of ``memory_mib`` MiB in
    ``folder``; returns its path. Raises OSError."""
    path = folder / SOURCE_RAM
    with open(path, "xb") as f:
        f.truncate(memory_mib << 20)
    return path


def _copy_sparse(src_fd: int, dst_fd: int, size: int) -> str:
    """Copy ``size`` bytes leaving all-zero chunks as holes; returns the SHA-256 (hex)
    of all ``size`` bytes."""
    digest = hashlib.sha256()
    offset = 0
    while offset < size:
        chunk = os.pread(src_fd, min(CHUNK, size - offset), offset)
        if not chunk:
            raise EngineError(f"memory file ends at {offset} of {size} bytes")
        digest.update(chunk)
        if chunk != _ZERO[:len(chunk)]:
            view = memoryview(chunk)
            done = 0
            while done < len(chunk):
                done += os.pwrite(dst_fd, view[done:], offset + done)
        offset += len(chunk)
    return digest.hexdigest()


def _save(src: Path, dst: Path) -> tuple[int, str]:
    src_fd = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(src_fd).st_size
        dst_fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o444)
        try:
            os.ftruncate(dst_fd, size)
            sha = _copy_sparse(src_fd, dst_fd, size)
            os.fsync(dst_fd)
        finally:
            os.close(dst_fd)
    finally:
        os.close(src_fd)
    return os.stat(dst).st_blocks * 512, sha


async def save_memory(src: Path, dst: Path) -> tuple[int, str]:
    """Copy a paused template source's RAM file ``src`` to the new file ``dst`` (mode
    0444, all-zero 64 KiB chunks left as holes, fsynced).

    Returns ``(allocated bytes, SHA-256 hex of the whole contents)``.
    Raises ``EngineError``.
    """
    try:
        return await asyncio.to_thread(_save, src, dst)
    except OSError as exc:
        raise EngineError(f"cannot save the template's memory into {dst}: {exc}") from None


@dataclass
class _Entry:
    fd: int
    ident: tuple[int, int, int, int]
    """(st_dev, st_ino, st_size, st_mtime_ns) of the file the memfd was filled from."""


def _ident(path: Path) -> tuple[int, int, int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _fill(path: Path, size: int, sha256: str) -> int:
    """A sealed memfd holding the contents of ``path`` (``size`` bytes), checked
    against ``sha256``. Raises EngineError."""
    try:
        src_fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise EngineError(f"cannot open the template's memory {path}: {exc.strerror}") from None
    fd = os.memfd_create("hangar-template", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        if os.fstat(src_fd).st_size != size:
            raise EngineError(f"template memory {path} is {os.fstat(src_fd).st_size} bytes, "
                              f"its manifest says {size}")
        os.ftruncate(fd, size)
        got = _copy_sparse(src_fd, fd, size)
        if got != sha256:
            raise EngineError(f"template memory {path} has changed since it was saved "
                              f"(SHA-256 {got[:12]}, manifest {sha256[:12]}): rebuild the template")
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    finally:
        os.close(src_fd)
    return fd


class TemplateMemories:
    """One sealed memfd per template snapshot folder, filled at first use; see the
    module docstring. Not thread-safe: use it from the server's event loop."""

    def __init__(self) -> None:
        self._entries: dict[Path, _Entry] = {}
        self._locks: dict[Path, asyncio.Lock] = {}

    async def open(self, snapshot_dir: Path, size: int, sha256: str) -> int:
        """The sealed memfd of the template in ``snapshot_dir`` (its ``memory.ram`` of
        ``size`` bytes whose SHA-256 is ``sha256``), filled now if needed.

        Returns a new descriptor of it (close-on-exec) that the caller passes
        to its VMM and closes, so a ``release`` meanwhile cannot close it
        under the caller. Raises ``EngineError`` when the file is missing, of
        another size, or its contents differ from ``sha256``.
        """
        key = snapshot_dir.resolve()
        self._sweep()
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            path = template_memory(key)
            entry = self._entries.get(key)
            try:
                ident = _ident(path)
            except OSError as exc:
                self.release(key)
                raise EngineError(f"template {snapshot_dir} has no memory file: "
                                  f"{exc.strerror}") from None
            if entry is None or entry.ident != ident:
                self.release(key)
                fd = await asyncio.to_thread(_fill, path, size, sha256)
                entry = self._entries[key] = _Entry(fd, ident)
            return os.dup(entry.fd)

    def release(self, snapshot_dir: Path) -> None:
        """Close the memfd of the template in ``snapshot_dir``, if one is open (clones
        that map it keep their mapping). Never raises."""
        entry = self._entries.pop(snapshot_dir.resolve(), None)
        if entry is not None:
            os.close(entry.fd)

    def _sweep(self) -> None:
        """Drop the memfds of templates whose file is gone or was replaced."""
        for key, entry in list(self._entries.items()):
            try:
                same = _ident(template_memory(key)) == entry.ident
            except OSError:
                same = False
            if not same:
                self.release(key)

    def resident_bytes(self) -> int:
        """Host memory the open memfds hold (their allocated pages), bytes."""
        return sum(os.fstat(e.fd).st_blocks * 512 for e in self._entries.values())

    def close(self) -> None:
        """Close every memfd."""
        for key in list(self._entries):
            self.release(key)

    def __len__(self) -> int:
        return len(self._entries)
