"""Root acts only on what it opened itself: descriptor-relative file operations.

Under the privilege split the data directory (``<data>``, its ``sandboxes/``,
``images/``, ``backups/`` ...) belongs to the unprivileged server, which may
rename any name in it and put a symlink in its place at any moment. So a
root process (the helper, ``hangar image build``, ``hangar template build``,
``hangar backup``, the jailer's preparation) never hands such a path to
``open``/``chmod``/``chown``/``link``/``mount``. It opens a directory it can
trust (``open_trusted``: every symlink on the way lies in a folder only root
may write), walks each name below it with ``openat`` and ``O_NOFOLLOW``
(``walk``), checks what it got with ``fstat`` (``expect``) after opening,
never before, and acts on the descriptor (``fchown``, ``fchmod``,
``linkat``, ``renameat`` with directory descriptors). A child process that
must name such a folder (a bind mount's source, a working directory) is
given ``fd_path``: ``/proc/<pid>/fd/<n>`` of a descriptor this process
holds, which the kernel resolves to that very folder, whatever its names
became, and which the server's user cannot resolve at all.

Standard library only: ``hangar.engines``, ``hangar.images``, ``hangar.ops``
and the root helper all import it from here, the bottom of the layers.

Errors are ``OSError``: ``ELOOP`` for a symlink where none may be,
``EINVAL`` for a plain relative path that is not one or a file of the wrong
type, ``EPERM`` for a file of the wrong owner or with other links.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
"""Flags that open one folder, never a symlink to one."""
FILE_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
"""Added to a file's flags: never a symlink, and a FIFO put there cannot hang root."""
PATH_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
"""Flags that hold one folder on the way (search permission is enough, as for a path)."""
MAX_LINKS = 40
"""Symlinks ``open_trusted`` follows on one path (the kernel's own bound)."""


def parts(rel: str | Path) -> list[str]:
    """The names of the plain relative path ``rel`` (no ``..``, not absolute, not empty).
    Raises OSError (EINVAL)."""
    text = str(rel)
    names = [p for p in text.split("/") if p not in ("", ".")]
    if not names or text.startswith("/") or ".." in names:
        raise OSError(errno.EINVAL, f"not a plain relative path: {rel}")
    return names


def _trusted_folder(fd: int) -> bool:
    """Whether a symlink in the folder ``fd`` was put there by root (or by this process's
    own user): the folder is theirs and no one else may write it, or it is sticky."""
    st = os.fstat(fd)
    own = st.st_uid in (0, os.geteuid())
    return own and (not st.st_mode & 0o022 or bool(st.st_mode & stat.S_ISVTX))


def open_trusted(path: str | Path, *, path_only: bool = False) -> int:
    """A descriptor of the folder ``path``, opened from ``/`` one name at a time.

    A symlink on the way is followed only when the folder holding it is one
    that only root (or this process's user) may write, and, in a sticky
    folder such as ``/tmp``, only a symlink of root's (or that user's); any
    other symlink fails with ELOOP. So a root process opens
    ``/var/lib/hangar`` (its parents are root's) but never follows a link
    the server put in ``<data>`` or below. ``/proc/...`` paths are opened by
    the kernel (``fd_path`` of a descriptor: the exact folder). ``path_only``:
    an ``O_PATH`` descriptor (to walk below, as a path would: search permission
    is enough), else one to read the folder. Raises OSError. The caller
    closes the descriptor.
    """
    text = os.path.abspath(str(path))
    if text.startswith("/proc/"):
        return os.open(text, (os.O_PATH if path_only else os.O_RDONLY) | os.O_DIRECTORY
                       | os.O_CLOEXEC)
    todo = [p for p in text.split("/") if p]
    fd = os.open("/", PATH_FLAGS)
    links = 0
    try:
        while todo:
            name = todo.pop(0)
            if name == ".":
                continue
            try:
                nxt = os.open(name, PATH_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if not stat.S_ISLNK(st.st_mode):
                    raise
                dst = os.fstat(fd)
                sticky_ok = bool(dst.st_mode & stat.S_ISVTX) and st.st_uid in (0, os.geteuid())
                if not _trusted_folder(fd) or (dst.st_mode & stat.S_ISVTX and not sticky_ok):
                    raise OSError(errno.ELOOP, f"{text}: the symlink {name} is in a folder "
                                               f"others may write") from None
                links += 1
                if links > MAX_LINKS:
                    raise OSError(errno.ELOOP, f"{text}: too many symlinks") from None
                target = os.readlink(name, dir_fd=fd)
                todo = [p for p in target.split("/") if p] + todo
                if target.startswith("/"):
                    nxt = os.open("/", PATH_FLAGS)
                else:
                    nxt = os.dup(fd)
            os.close(fd)
            fd = nxt
        if path_only:
            fd, out = -1, fd
            return out
        return os.open(".", DIR_FLAGS, dir_fd=fd)  # the folder itself, to read and act on
    finally:
        if fd >= 0:
            os.close(fd)


def walk(dir_fd: int, rel: str | Path, flags: int = os.O_RDONLY, *, directory: bool = False,
         mode: int = 0o600) -> int:
    """Open ``rel`` below the folder ``dir_fd`` without following any symlink.

    Each folder on the way is opened with ``O_NOFOLLOW`` relative to the one
    before; the last name with ``flags`` (``O_CREAT`` makes it with ``mode``)
    plus ``FILE_FLAGS``, or as a folder (``directory``). Checked after
    opening: a regular file (or a folder). Raises OSError: ELOOP on a
    symlink, EINVAL on another type, ENOENT. The caller closes the result.
    """
    names = parts(rel)
    fd = os.dup(dir_fd)
    try:
        for name in names[:-1]:
            nxt = _open(name, DIR_FLAGS, 0, fd)
            os.close(fd)
            fd = nxt
        last = _open(names[-1], DIR_FLAGS if directory else flags | FILE_FLAGS, mode, fd)
    finally:
        os.close(fd)
    try:
        expect(last, directory=directory)
    except BaseException:
        os.close(last)
        raise
    return last


def _open(name: str, flags: int, mode: int, dir_fd: int | None) -> int:
    """``openat``; a symlink met where a folder was asked (ENOTDIR) fails as ELOOP."""
    try:
        return os.open(name, flags, mode, dir_fd=dir_fd)
    except NotADirectoryError:
        if stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
            raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), name) from None
        raise


@contextmanager
def walked(dir_fd: int, rel: str | Path, flags: int = os.O_RDONLY, *,
           directory: bool = False) -> Iterator[int]:
    """``walk`` as a context manager that closes the descriptor."""
    fd = walk(dir_fd, rel, flags, directory=directory)
    try:
        yield fd
    finally:
        os.close(fd)


def expect(fd: int, *, directory: bool = False, uids: tuple[int, ...] | None = None,
           single: bool = False) -> os.stat_result:
    """``fstat`` of ``fd``, checked: a folder (``directory``) or a regular file; owned by
    one of ``uids`` (None: anyone); with no other hard link (``single``, files only).
    Raises OSError (EINVAL, EPERM)."""
    st = os.fstat(fd)
    if not (stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode)):
        raise OSError(errno.EINVAL, f"not a regular {'folder' if directory else 'file'}")
    if uids is not None and st.st_uid not in uids:
        raise OSError(errno.EPERM, f"owned by uid {st.st_uid}")
    if single and not directory and st.st_nlink != 1:
        raise OSError(errno.EPERM, "the file has other links")
    return st


def fd_path(fd: int) -> str:
    """``/proc/<this pid>/fd/<fd>``: a name for the file ``fd`` that a root child process
    (mount, chdir, exec) resolves to that very file while this process holds ``fd``; the
    server's user cannot resolve it."""
    return f"/proc/{os.getpid()}/fd/{fd}"


def mkdir_at(dir_fd: int, name: str, mode: int = 0o755) -> int:
    """The folder ``name`` of ``dir_fd`` (made with ``mode`` if missing), opened without
    following a symlink. Raises OSError."""
    (leaf,) = parts(name)
    try:
        os.mkdir(leaf, mode, dir_fd=dir_fd)
    except FileExistsError:
        pass
    return walk(dir_fd, leaf, directory=True)


def write_at(dir_fd: int, name: str, data: bytes, mode: int = 0o644) -> None:
    """``name`` in ``dir_fd`` becomes a new file of this process's own holding ``data``,
    of mode ``mode`` (set through its descriptor, whatever the umask), renamed over
    whatever had the name (a link there is replaced, never written through).
    Raises OSError."""
    (leaf,) = parts(name)
    tmp = f".{leaf}.{os.getpid()}.tmp"
    try:
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | FILE_FLAGS, mode,
                      dir_fd=dir_fd)
        try:
            os.fchmod(out, mode)
            view = memoryview(data)
            while view:
                view = view[os.write(out, view):]
        finally:
            os.close(out)
        os.replace(tmp, leaf, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise


def read_own_at(dir_fd: int, name: str, max_bytes: int = 4096) -> bytes:
    """The start of the regular file ``name`` of ``dir_fd`` if root (or this process's
    user) owns it: a file the server put in its place is not believed. Raises OSError."""
    with walked(dir_fd, name) as fd:
        expect(fd, uids=(0, os.geteuid()))
        return os.read(fd, max_bytes)


def chmod_entries(dir_fd: int, add: int, *, uids: tuple[int, ...] = (0,)) -> None:
    """Add the bits ``add`` (e.g. 0o444; folders get the matching execute bits too) to
    the folder ``dir_fd`` and each regular file or folder directly in it that one of
    ``uids`` owns, each opened without following a symlink and changed through its
    descriptor (a FIFO, device or link there is left alone). Never raises."""
    def one(fd: int) -> None:
        st = os.fstat(fd)
        if st.st_uid not in uids or not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
            return
        want = st.st_mode | add | ((add & 0o444) >> 2 if stat.S_ISDIR(st.st_mode) else 0)
        if stat.S_IMODE(want) != stat.S_IMODE(st.st_mode):
            os.fchmod(fd, stat.S_IMODE(want))

    try:
        one(dir_fd)
        names = os.listdir(dir_fd)
    except OSError:
        return
    for name in names:
        try:
            fd = os.open(name, os.O_RDONLY | FILE_FLAGS, dir_fd=dir_fd)
        except OSError:
            continue  # a link, or gone meanwhile
        try:
            one(fd)
        except OSError:
            pass
        finally:
            os.close(fd)


WALK_FLAGS = DIR_FLAGS | os.O_NONBLOCK | os.O_NOCTTY
"""Flags that open a folder of a walk: never a symlink, and a FIFO or device swapped in
fails (``ENOTDIR``) without being opened."""


def fwalk(dir_fd: int | None, name: str = ".") -> Iterator[tuple[tuple[str, ...], list[str],
                                                                   list[str], int]]:
    """``os.fwalk(name, dir_fd=dir_fd, follow_symlinks=False)`` that never opens what it
    did not mean to: top-down, it yields ``(the folder's names below name, its
    subfolders, its other entries, its descriptor)``, each folder opened with
    ``WALK_FLAGS`` relative to its parent's descriptor (Python 3.11's ``os.fwalk`` opens
    a subfolder with plain ``O_RDONLY`` and compares after, so a name swapped for a link
    to a FIFO or a device meanwhile was opened as root: review 29b, G12). A subfolder
    swapped for anything else meanwhile is skipped; a symlink is listed with the other
    entries, never followed. The descriptor is valid until the next step; subfolders
    removed from the list by the caller are not walked. Raises OSError for ``name``
    itself (ELOOP or ENOTDIR when it is not a folder). ``dir_fd`` None: ``name`` is a
    path (its last name never a link)."""
    top = _open(name, WALK_FLAGS, 0, dir_fd)
    try:
        yield from _fwalk(top, ())
    finally:
        os.close(top)


def _fwalk(fd: int, rel: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], list[str],
                                                             list[str], int]]:
    dirs: list[str] = []
    files: list[str] = []
    with os.scandir(fd) as entries:
        for entry in entries:
            try:
                is_dir = entry.is_dir(follow_symlinks=False)
            except OSError:
                continue
            (dirs if is_dir else files).append(entry.name)
    yield rel, dirs, files, fd
    for name in dirs:
        try:
            sub = os.open(name, WALK_FLAGS, dir_fd=fd)
        except OSError:
            continue  # swapped for a link, FIFO or device, or gone meanwhile: not walked
        try:
            yield from _fwalk(sub, (*rel, name))
        finally:
            os.close(sub)


def remove_tree(dir_fd: int, name: str) -> None:
    """Remove ``name`` of the folder ``dir_fd`` and everything in it. Each folder is opened
    with ``O_DIRECTORY | O_NOFOLLOW | O_NONBLOCK`` relative to its parent's descriptor, so a
    symlink, FIFO or device put in a folder's place is never opened (it is unlinked), and
    each name is removed relative to its folder's descriptor. (Python 3.11's
    ``shutil.rmtree(dir_fd=...)`` opens each subfolder with plain ``O_RDONLY`` and checks
    only afterwards.) A ``name`` that is not a folder is unlinked; a missing one is left.
    Raises OSError (e.g. ``EBUSY`` for a mount point)."""
    try:
        fd = os.open(name, DIR_FLAGS | os.O_NONBLOCK, dir_fd=dir_fd)
    except FileNotFoundError:
        return
    except OSError as exc:
        if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
            raise
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dir_fd)
        return
    try:
        for entry in os.listdir(fd):
            remove_tree(fd, entry)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dir_fd)

