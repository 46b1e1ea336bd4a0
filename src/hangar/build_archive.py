"""A template build's ``COPY`` archives: made and hashed the way E2B's SDK makes them.

A ``COPY src dest`` step names its files by a **files hash**: SHA-256 over
``COPY <src> <dest>``, then, for each file the source names (in the order
of the archive), its path relative to the build context, its ``st_mode``,
its size unless it is a folder, and its link's target (a symlink, not
followed) or its bytes. The files travel as a tar archive (gzip'd) of
those files with those relative paths. E2B's SDK computes the same hash on
the client (its ``calculate_files_hash``), so the server can check that an
upload holds what its step names (``archive_hash``, ``hangar.core.builds``),
and Hangar's own CLI makes archives the same way (``make_archive``). The
format is E2B's; nothing of its code is used here.
"""

from __future__ import annotations

import glob
import hashlib
import os
import tarfile
import tempfile
from pathlib import Path

UNPACKED_MAX = 4 << 30
"""Most bytes of files an archive may hold when its hash is checked."""
MEMBERS_MAX = 1_000_000
"""Most members (files, folders, links) an archive may hold: a deep ``node_modules`` has
some 10^5; each costs ~60 us of the check's thread."""
HEADER_MAX = 64 << 10
"""Longest extended header (a pax header, a GNU long name or link), bytes: a path is at
most 4096 bytes on Linux; Python's tarfile reads such a header into memory whole."""
META_MAX = 2 << 30
"""Most bytes of the unpacked stream that are not file contents (headers, padding): bounds
the work a compressed stream of headers alone can ask for."""

__all__ = ["HEADER_MAX", "MEMBERS_MAX", "META_MAX", "UNPACKED_MAX", "archive_hash",
           "archive_hashes",
           "make_archive", "matched_files"]


class _BoundedInfo(tarfile.TarInfo):
    """A member header read with bounds: tarfile reads a pax header or a GNU long name
    into memory whole, and a sparse member's map as long as the stream declares (a 2 MB
    gzip'd upload asked the server for 4 GiB), so those are refused before they are read.
    Overrides CPython's private ``TarInfo._proc_*`` (3.11's)."""

    def _proc_member(self, tar: tarfile.TarFile) -> tarfile.TarInfo:
        if self.type == tarfile.GNUTYPE_SPARSE:
            raise ValueError(f"{self.name[:100]!r} is a sparse file")
        if self.type in (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE,
                         tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE) and self.size > HEADER_MAX:
            raise ValueError(f"an extended header of {self.size} bytes (at most {HEADER_MAX})")
        return super()._proc_member(tar)  # type: ignore[misc]

    def _proc_gnusparse_00(self, *args: object) -> None:
        raise ValueError("a sparse file")

    _proc_gnusparse_01 = _proc_gnusparse_10 = _proc_gnusparse_00


def matched_files(context: Path, src: str) -> list[Path]:
    """The files ``src`` (a path or glob relative to ``context``) names: each match, and
    everything under a matched folder, sorted, without leaving ``context``: neither by
    ``..`` nor through a symlinked folder (a match may be a symlink, kept as a link, as
    Docker keeps one). Raises ValueError when nothing matches or ``src`` climbs out."""
    root = context.resolve()
    found: set[Path] = set()
    for m in glob.glob(str(root / src), recursive=True):
        p = Path(os.path.normpath(m))
        folder = Path(os.path.realpath(p.parent if p != root else p))
        if not p.is_relative_to(root) or not folder.is_relative_to(root):
            raise ValueError(f"{src!r} names files outside the build context")
        found.add(p)
        if p.is_dir() and not p.is_symlink():
            for dirpath, dirs, files in os.walk(p):
                found.update(Path(dirpath) / n for n in dirs + files)
    if not found:
        raise ValueError(f"no file in {root} matches {src!r}")
    return sorted(found)


def make_archive(context: Path, src: str) -> Path:
    """A gzip'd tar of the files ``src`` names, by their paths relative to ``context``
    (symlinks kept as links), in a temporary file the caller removes."""
    files = matched_files(context, src)
    fd, name = tempfile.mkstemp(prefix="hangar-copy-", suffix=".tar.gz")
    os.close(fd)
    with tarfile.open(name, "w:gz") as tar:
        for f in files:
            tar.add(f, arcname=os.path.relpath(f, context.resolve()), recursive=False)
    return Path(name)


def archive_hash(path: Path, src: str, dest: str, limit: int = UNPACKED_MAX) -> str:
    """The files hash of ``COPY src dest`` over the tar at ``path`` (gzip'd or not),
    reading at most ``limit`` bytes of files, ``MEMBERS_MAX`` members and ``META_MAX``
    bytes of headers; memory stays bounded (``HEADER_MAX``). Raises ValueError (past a
    bound, a member that is neither a file, a folder nor a symlink, a sparse file),
    tarfile.TarError, EOFError."""
    return archive_hashes(path, src, dest, limit)[0]


OLD_DIR_SIZE = b"4096"
"""A folder's size on disk as SDKs before 2.63 hash it (``st_size``, which no archive
carries): an ext4 or XFS folder of few entries, the common case of a build context."""


def archive_hashes(path: Path, src: str, dest: str, limit: int = UNPACKED_MAX
                   ) -> tuple[str, str]:
    """``archive_hash``, and the hash an SDK before 2.63 gives the same files (each
    folder's size on disk hashed too, taken as ``OLD_DIR_SIZE``); one pass, the same
    bounds and errors."""
    try:
        return _hash(path, [hashlib.sha256(f"COPY {src} {dest}".encode()) for _ in range(2)],
                     limit)
    except RecursionError:  # pax headers chained past the interpreter's depth
        raise ValueError("extended headers nested too deeply") from None


def _hash(path: Path, hs: "list[hashlib._Hash]", limit: int) -> tuple[str, str]:
    h, old = hs
    read = count = 0
    with tarfile.open(path, "r|*", tarinfo=_BoundedInfo) as tar:
        while (m := tar.next()) is not None:
            tar.members.clear()  # type: ignore[attr-defined]  # kept by tarfile, not needed
            count += 1
            if count > MEMBERS_MAX:
                raise ValueError(f"the archive holds more than {MEMBERS_MAX} members")
            if tar.offset > limit + META_MAX:
                raise ValueError(f"the archive unpacks to more than {limit + META_MAX} bytes")
            kind = (0o040000 if m.isdir() else 0o120000 if m.issym() else
                    0o100000 if m.isreg() else None)
            if kind is None:
                raise ValueError(f"{m.name[:100]!r} is neither a file, a folder nor a symlink")
            for x in hs:
                x.update(m.name.rstrip("/").encode())
                x.update(str(kind | (m.mode & 0o7777)).encode())
            if m.issym():
                for x in hs:
                    x.update(str(len(m.linkname.encode())).encode())
                    x.update(m.linkname.encode())
                continue
            if not m.isdir():
                for x in hs:
                    x.update(str(m.size).encode())
            else:
                old.update(OLD_DIR_SIZE)
            if m.isreg():
                read += m.size
                if read > limit:
                    raise ValueError(f"the archive unpacks to more than {limit} bytes")
                f = tar.extractfile(m)
                assert f is not None
                while chunk := f.read(1 << 20):
                    h.update(chunk)
                    old.update(chunk)
    return h.hexdigest(), old.hexdigest()
