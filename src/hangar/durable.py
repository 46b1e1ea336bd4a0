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

import os
from pathlib import Path

__all__ = ["atomic_write", "fsync_dir", "replace"]


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
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
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
