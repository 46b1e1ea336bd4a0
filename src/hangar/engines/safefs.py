"""File operations as root inside folders a confined VMM can write.

A confined VMM may rename, remove and create names in its sandbox folder
(its sockets, its disk, its console folder) and, when jailed, in its whole
chroot. So the server (root) never follows a name there: each operation
opens the trusted folder (one the VMM cannot rename: its parent is root's)
as a directory descriptor, walks each name below it with ``openat`` and
``O_NOFOLLOW`` (a symlink anywhere fails with ``ELOOP``), opens files with
``O_NONBLOCK`` (a FIFO put in a file's place cannot hang the server) and
checks with ``fstat`` that it got a regular file (or a directory) before
it reads, copies, changes the owner or the mode, all through the
descriptor. Removal is ``shutil.rmtree``, which on Linux works the same way
(``os.fwalk``-style descriptors, links unlinked, never followed).

Errors are ``OSError``: ``ELOOP`` for a symlink, ``EINVAL`` for a file
that is not of the expected type.
"""

from __future__ import annotations

import errno
import os
import stat
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from hangar.privileged import beneath

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
FILE_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _parts(rel: str | Path) -> list[str]:
    parts = [p for p in Path(rel).parts if p not in ("", ".")]
    if not parts or any(p in ("..", "/") for p in parts):
        raise OSError(errno.EINVAL, f"not a plain relative path: {rel}")
    return parts


def open_dir(folder: Path) -> int:
    """A descriptor of the trusted ``folder`` itself, opened one name at a time from ``/``
    (``hangar.privileged.beneath.open_trusted``: a symlink on the way is followed only
    where no one but root, or this process's user, may have put it; ``folder`` itself is
    never a symlink). A ``/proc/<pid>/fd/<n>`` path (``beneath.fd_path``) is that open
    folder itself."""
    text = str(folder)
    if text.startswith("/proc/"):
        return beneath.open_trusted(text)
    parent, name = os.path.split(os.path.abspath(text))
    if not name:
        return os.open("/", DIR_FLAGS)
    up = beneath.open_trusted(parent, path_only=True)
    try:
        return os.open(name, DIR_FLAGS, dir_fd=up)
    finally:
        os.close(up)


def open_in(folder: Path, rel: str | Path, flags: int = os.O_RDONLY, *,
            directory: bool = False) -> int:
    """Open ``folder/rel`` without following any symlink below ``folder``.

    ``flags``: the access mode (``os.O_RDONLY``, ``os.O_WRONLY``...); the
    result is a regular file's descriptor (``directory``: a directory's).
    Raises OSError: ``ELOOP`` on a symlink, ``EINVAL`` on the wrong type,
    ``ENOENT`` when a name is missing. The caller closes it.
    """
    parts = _parts(rel)
    fd = open_dir(folder)
    try:
        for name in parts[:-1]:
            nxt = os.open(name, DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nxt
        last = os.open(parts[-1], (DIR_FLAGS if directory else flags | FILE_FLAGS), dir_fd=fd)
    finally:
        os.close(fd)
    st = os.fstat(last)
    if (stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode)):
        return last
    os.close(last)
    raise OSError(errno.EINVAL, f"{folder / rel} is not a regular "
                                f"{'directory' if directory else 'file'}")


@contextmanager
def opened(folder: Path, rel: str | Path, flags: int = os.O_RDONLY, *,
           directory: bool = False) -> Iterator[int]:
    """``open_in`` as a context manager that closes the descriptor."""
    fd = open_in(folder, rel, flags, directory=directory)
    try:
        yield fd
    finally:
        os.close(fd)


def read_tail(folder: Path, rel: str | Path, max_bytes: int = 64 << 10) -> bytes:
    """The last ``max_bytes`` bytes of the regular file ``folder/rel`` (see ``open_in``)."""
    with opened(folder, rel) as fd:
        size = os.fstat(fd).st_size
        os.lseek(fd, max(0, size - max_bytes), os.SEEK_SET)
        out = b""
        while len(out) < max_bytes:
            chunk = os.read(fd, max_bytes - len(out))
            if not chunk:
                break
            out += chunk
        return out


def own(folder: Path, rel: str | Path, uid: int, gid: int, mode: int, *,
        directory: bool = False) -> None:
    """Give ``folder/rel`` to ``uid:gid`` with ``mode``, through its descriptor."""
    with opened(folder, rel, directory=directory) as fd:
        os.fchown(fd, uid, gid)
        os.fchmod(fd, mode)


def own_folder(folder: Path, uid: int, gid: int, mode: int) -> None:
    """Set ``folder``'s own owner and mode (``folder`` must not be a symlink)."""
    fd = open_dir(folder)
    try:
        os.fchown(fd, uid, gid)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def copy_argv(dst: Path) -> list[str]:
    """``cp``'s argv that copies its standard input (an open file) to ``dst``, keeping
    holes and sharing blocks where the filesystem can (``/dev/stdin`` reopens the same
    file through the descriptor, never a name)."""
    return ["cp", "--reflink=auto", "--sparse=always", "--", "/dev/stdin", str(dst)]


def copy_out(folder: Path, rel: str | Path, dst: Path) -> None:
    """Copy the regular file ``folder/rel`` (opened as ``open_in`` does) to ``dst``, a
    path the VMM cannot reach. Blocking; raises OSError."""
    with opened(folder, rel) as fd:
        os.set_blocking(fd, True)
        out = subprocess.run(copy_argv(dst), stdin=fd, capture_output=True, text=True)
    if out.returncode != 0:
        raise OSError(errno.EIO, f"copying {folder / rel} failed: {out.stderr.strip()}")


def console_file(sandbox_dir: Path) -> str:
    """Which file of ``sandbox_dir`` holds the guest's console: ``console/current``
    when ``serial.log`` is the server's link to it, else ``serial.log`` itself (a link
    anywhere else is never followed: reading it fails with ``ELOOP``)."""
    try:
        target = os.readlink(sandbox_dir / "serial.log")
    except OSError:
        return "serial.log"
    return "console/current" if target == "console/current" else "serial.log"


def open_append(folder: Path, name: str) -> int:
    """``folder/name`` opened to append (made 0600 if missing), never through a link."""
    (leaf,) = _parts(name)
    fd = open_dir(folder)
    try:
        out = os.open(leaf, os.O_WRONLY | os.O_APPEND | os.O_CREAT | FILE_FLAGS, 0o600,
                      dir_fd=fd)
    finally:
        os.close(fd)
    if not stat.S_ISREG(os.fstat(out).st_mode):
        os.close(out)
        raise OSError(errno.EINVAL, f"{folder / name} is not a regular file")
    os.set_blocking(out, True)
    return out


def replace_file(folder: Path, name: str, data: bytes, mode: int = 0o644) -> None:
    """Write ``folder/name`` as a new file of this process's own, renamed over whatever
    had the name (a file or a link the VMM made there is replaced, never written
    through)."""
    (name,) = _parts(name)
    fd = open_dir(folder)
    try:
        beneath.write_at(fd, name, data, mode)
    finally:
        os.close(fd)


def read_own(folder: Path, name: str, max_bytes: int = 4096) -> bytes:
    """The start of ``folder/name`` if it is a regular file of root's or this process's
    own user (one the VMM made is not believed). Raises OSError (``EPERM``: another
    owner)."""
    with opened(folder, name) as fd:
        if os.fstat(fd).st_uid not in (0, os.geteuid()):
            raise OSError(errno.EPERM, f"{folder / name} is not ours")
        return os.read(fd, max_bytes)
