"""Durable replacement of files: write a temporary file, sync it, rename it into place,
sync the folder.

A rename is atomic, but it is durable only once the folder that holds the
name is synced: after a power loss without that sync the old file (or no
file) can come back, even though the new one had been written and synced
(``rename(2)``; ext4 and XFS document it; SQLite does the same dance for its
journal). Every record Hangar renames into place (key files, snapshot
records, backups, manifests) goes through ``atomic_write`` or, when the
data was written by another tool, ``replace``.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

__all__ = ["atomic_write", "fsync_dir", "read_small", "replace"]


def fsync_dir(folder: str | os.PathLike[str]) -> None:
    """``fsync`` a folder, so the names in it (a rename, a new file) survive a crash."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    """Rename ``src`` (already written and synced) over ``dst``, then sync ``dst``'s folder."""
    os.replace(src, dst)
    fsync_dir(Path(dst).parent)


def read_small(path: str | os.PathLike[str], limit: int) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them.

    For files root reads from a folder a less privileged server may write (key files in
    the data directory): the last name is opened with ``O_NOFOLLOW | O_NONBLOCK`` (a link
    is refused, a FIFO cannot hang the reader), the descriptor checked to be a regular
    file and read to ``limit`` bytes at most (a link to ``/dev/zero`` cannot fill memory).
    Raises ``FileNotFoundError`` when it is absent, ``OSError`` (``ELOOP`` for a link,
    ``EINVAL`` for another kind of file, ``EFBIG`` past ``limit``) otherwise.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        chunks: list[bytes] = []
        size = 0
        while size <= limit:
            chunk = os.read(fd, min(1 << 16, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise OSError(errno.EFBIG, f"larger than {limit} bytes", str(path))
        return b"".join(chunks)
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike[str], data: bytes, mode: int = 0o600, *,
                 exclusive: bool = False) -> None:
    """Make ``path`` hold ``data`` (permissions ``mode``), all or nothing, durably.

    The bytes go to a temporary file beside ``path`` (``.NAME.PID.tmp``), which is
    synced, then renamed over ``path`` (or, with ``exclusive``, linked to ``path`` only if
    nothing is there: ``FileExistsError`` otherwise), then the folder is synced. A crash
    at any point leaves either the old file (or none) or the new one, never a part.
    Written by root into a folder another user owns (a split server's data directory,
    docs/security.md class 9: e.g. ``hangar key add`` run as root), the file is that
    user's, as if the server had written it.
    Raises ``OSError`` as the system gives it; the temporary file is removed on failure.
    """
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    # a new file of its own: a leftover (a crash's, or a FIFO or link someone planted) is
    # removed first, and O_EXCL fails rather than open whatever takes its place meanwhile
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        try:
            os.fchmod(fd, mode)
            if os.geteuid() == 0:
                folder = os.stat(target.parent)
                if folder.st_uid != 0:
                    os.fchown(fd, folder.st_uid, folder.st_gid)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        if exclusive:
            os.link(tmp, target)  # FileExistsError when someone was first
            os.unlink(tmp)
        else:
            os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(target.parent)
