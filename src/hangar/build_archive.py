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
"""Most bytes an archive may unpack to when its hash is checked."""

__all__ = ["UNPACKED_MAX", "archive_hash", "make_archive", "matched_files"]


def matched_files(context: Path, src: str) -> list[Path]:
    """The files ``src`` (a path or glob relative to ``context``) names: each match, and
    everything under a matched folder, sorted, without leaving ``context``. Raises
    ValueError when nothing matches or ``src`` climbs out."""
    root = context.resolve()
    found: set[Path] = set()
    for m in glob.glob(str(root / src), recursive=True):
        p = Path(os.path.normpath(m))
        if not p.is_relative_to(root):
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
    reading at most ``limit`` bytes of files. Raises ValueError (past the bound, a member
    that is neither a file, a folder nor a symlink), tarfile.TarError, EOFError."""
    h = hashlib.sha256(f"COPY {src} {dest}".encode())
    read = 0
    with tarfile.open(path, "r|*") as tar:
        for m in tar:
            h.update(m.name.rstrip("/").encode())
            kind = (0o040000 if m.isdir() else 0o120000 if m.issym() else
                    0o100000 if m.isreg() else None)
            if kind is None:
                raise ValueError(f"{m.name[:100]!r} is neither a file, a folder nor a symlink")
            h.update(str(kind | (m.mode & 0o7777)).encode())
            if m.issym():
                h.update(str(len(m.linkname.encode())).encode())
                h.update(m.linkname.encode())
                continue
            if not m.isdir():
                h.update(str(m.size).encode())
            if m.isreg():
                read += m.size
                if read > limit:
                    raise ValueError(f"the archive unpacks to more than {limit} bytes")
                f = tar.extractfile(m)
                assert f is not None
                while chunk := f.read(1 << 20):
                    h.update(chunk)
    return h.hexdigest()
