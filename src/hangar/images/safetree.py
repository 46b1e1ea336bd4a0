"""Files inside an image tree that the image itself shaped, without ever leaving it.

A tree unpacked from an OCI archive, or changed by a template's build steps,
holds whatever links its author chose: ``etc -> /etc``, ``var/log -> /var/log``,
``usr -> ../../..``. The host works on such a tree as root, so every operation
here goes through directory file descriptors, one component at a time, with
``O_NOFOLLOW``: a symlink met on the way is resolved as the guest would resolve
it (an absolute target starts again at the tree's root, ``..`` stops at the
root; what ``openat2``'s ``RESOLVE_IN_ROOT`` does), never by the host's path
lookup. The last component of a path that is written, removed or changed is
not followed: a link there is replaced, not written through. Nothing in the
tree can run while the host works on it (build steps end with their PID
namespace, ``hangar.images.buildns``), so a link cannot be swapped midway.

Paths are guest paths (``/etc/hosts``); ``root`` is the tree's host folder.
Every function raises ``ImageError`` when the tree is in the way (a file where
a folder must be, a link loop) and lets ``OSError`` of the host through.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from hangar.errors import ImageError
from hangar.privileged import beneath

MAX_SYMLINK_HOPS = 40
"""Links followed while resolving one path (the kernel's own limit)."""
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _parts(path: str) -> list[str]:
    return [p for p in path.split("/") if p not in ("", ".")]


class _Walk:
    """A resolution in progress: a stack of folder descriptors from the root down."""

    def __init__(self, root: Path, path: str) -> None:
        self.path = path
        self.stack = [os.open(root, _DIR)]
        self.hops = 0

    def close(self) -> None:
        for fd in self.stack:
            os.close(fd)
        self.stack = []

    @property
    def fd(self) -> int:
        return self.stack[-1]

    def up(self) -> None:
        if len(self.stack) > 1:
            os.close(self.stack.pop())

    def follow(self, target: str, rest: list[str]) -> list[str]:
        self.hops += 1
        if self.hops > MAX_SYMLINK_HOPS:
            raise ImageError(f"too many symbolic links resolving {self.path} in the image")
        if target.startswith("/"):
            while len(self.stack) > 1:
                os.close(self.stack.pop())
        return _parts(target) + rest

    def walk(self, parts: list[str], *, create: bool, mode: int = 0o755) -> None:
        """Descend through ``parts`` (all folders), following links inside the tree."""
        while parts:
            name = parts.pop(0)
            if name == "..":
                self.up()
                continue
            try:
                st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
            except FileNotFoundError:
                if not create:
                    raise
                os.mkdir(name, mode, dir_fd=self.fd)
                st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                parts[:0] = self.follow(os.readlink(name, dir_fd=self.fd), [])
                continue
            if not stat.S_ISDIR(st.st_mode):
                raise ImageError(f"{self.path}: {name} is not a folder in the image")
            self.stack.append(os.open(name, _DIR, dir_fd=self.fd))


@contextmanager
def parent(root: Path, path: str, *, create: bool = False,
           follow_last: bool = False) -> Iterator[tuple[int, str]]:
    """(descriptor of the folder holding ``path``'s last component, that component).

    With ``create`` missing folders are made (0755). With ``follow_last`` a link
    at the last component is resolved too (inside the tree). The name is ``""``
    for the root itself. Raises FileNotFoundError for a missing folder.
    """
    w = _Walk(root, path)
    try:
        parts = _parts(path)
        while True:
            last = parts.pop() if parts else ""
            w.walk(parts, create=create)
            if last == "..":
                w.up()
                last = ""
            if last and follow_last:
                try:
                    st = os.stat(last, dir_fd=w.fd, follow_symlinks=False)
                except FileNotFoundError:
                    st = None
                if st is not None and stat.S_ISLNK(st.st_mode):
                    parts = w.follow(os.readlink(last, dir_fd=w.fd), [])
                    continue
            break
        yield w.fd, last
    finally:
        w.close()


def open_dir(root: Path, path: str, *, create: bool = False, mode: int = 0o755) -> int:
    """A descriptor (``os.listdir``, ``os.fwalk`` and ``dir_fd`` take it) of the folder
    ``path``, links inside the tree followed. With ``create`` the missing folders are
    made with ``mode``. The caller closes it. Raises FileNotFoundError."""
    w = _Walk(root, path)
    try:
        w.walk(_parts(path), create=create, mode=mode)
        return os.dup(w.fd)
    finally:
        w.close()


def lstat(root: Path, path: str, *, follow_last: bool = False) -> os.stat_result | None:
    """The entry at ``path`` (None when missing)."""
    try:
        with parent(root, path, follow_last=follow_last) as (fd, name):
            return os.stat(name or ".", dir_fd=fd, follow_symlinks=False)
    except (FileNotFoundError, NotADirectoryError):
        return None


def exists(root: Path, path: str) -> bool:
    """Whether ``path`` resolves (inside the tree) to something other than a dangling link."""
    st = lstat(root, path, follow_last=True)
    return st is not None and not stat.S_ISLNK(st.st_mode)


def readlink(root: Path, path: str) -> str | None:
    """The target of the link at ``path``, or None when it is no link."""
    try:
        with parent(root, path) as (fd, name):
            return os.readlink(name, dir_fd=fd) if name else None
    except (FileNotFoundError, NotADirectoryError, OSError):
        return None


def read_file(root: Path, path: str, limit: int = 1 << 20) -> bytes | None:
    """Up to ``limit`` bytes of the regular file at ``path`` (links inside the tree
    followed), or None when there is none. Raises ImageError when it is larger."""
    try:
        with parent(root, path, follow_last=True) as (fd, name):
            f = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                        dir_fd=fd)
    except (FileNotFoundError, NotADirectoryError, ImageError, OSError):
        return None
    try:
        if not stat.S_ISREG(os.fstat(f).st_mode):
            return None
        data = os.read(f, limit + 1)
        if len(data) > limit:
            raise ImageError(f"{path} in the image is larger than {limit} bytes")
        return data
    finally:
        os.close(f)


def _clear(fd: int, name: str) -> None:
    """Remove a file or link at ``name`` (a folder is an error)."""
    try:
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        raise ImageError(f"a folder is in the way at {name} in the image")
    os.unlink(name, dir_fd=fd)


def write_file(root: Path, path: str, data: bytes | str, mode: int = 0o644,
               owner: tuple[int, int] | None = None) -> None:
    """Write ``data`` at ``path`` (folders made, a link or file there replaced), owned by
    ``owner`` (uid, gid) when given."""
    raw = data.encode() if isinstance(data, str) else data
    with parent(root, path, create=True) as (fd, name):
        if not name:
            raise ImageError(f"cannot write a file at {path!r}")
        _clear(fd, name)
        f = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                    mode & 0o7777, dir_fd=fd)
        try:
            view = memoryview(raw)
            while view:
                view = view[os.write(f, view):]
            if owner is not None:
                os.fchown(f, *owner)
            os.fchmod(f, mode & 0o7777)
        finally:
            os.close(f)


def make_dirs(root: Path, path: str, mode: int | None = None) -> None:
    """Make the folder ``path`` and its parents (links inside the tree followed); with
    ``mode``, set the last one's permission bits."""
    fd = open_dir(root, path, create=True)
    try:
        if mode is not None:
            os.chmod(f"/proc/self/fd/{fd}", mode)
    finally:
        os.close(fd)


def symlink(root: Path, path: str, target: str) -> None:
    """Make a link at ``path`` pointing at ``target`` (a file or link there replaced)."""
    with parent(root, path, create=True) as (fd, name):
        _clear(fd, name)
        os.symlink(target, name, dir_fd=fd)


def remove(root: Path, path: str) -> None:
    """Remove whatever is at ``path`` (a folder with all it holds); the last component is
    never followed. Missing is fine."""
    try:
        with parent(root, path) as (fd, name):
            _remove_at(fd, name)
    except (FileNotFoundError, NotADirectoryError):
        pass


def _remove_at(fd: int, name: str) -> None:
    try:
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        beneath.remove_tree(fd, name)  # never opens a link, FIFO or device
    else:
        os.unlink(name, dir_fd=fd)


def remove_matching(root: Path, folder: str, pattern: str, *,
                    keep: frozenset[str] = frozenset()) -> int:
    """Remove the entries of ``folder`` whose names match the glob ``pattern`` (but the
    names in ``keep``); returns how many. A missing folder removes nothing."""
    try:
        fd = open_dir(root, folder)
    except (FileNotFoundError, NotADirectoryError, ImageError):
        return 0
    n = 0
    try:
        for name in os.listdir(fd):
            if name not in keep and fnmatch.fnmatchcase(name, pattern):
                _remove_at(fd, name)
                n += 1
    finally:
        os.close(fd)
    return n


def files_under(root: Path, folder: str) -> Iterator[tuple[int, str, os.stat_result]]:
    """(folder descriptor, name, lstat) of every non-folder below ``folder``, links
    never followed. Descriptors are valid while the item is being handled."""
    try:
        top = open_dir(root, folder)
    except (FileNotFoundError, NotADirectoryError, ImageError):
        return
    try:
        # beneath.fwalk: os.fwalk would open a subfolder swapped for a FIFO's link meanwhile
        for _rel, _dirs, files, dfd in beneath.fwalk(top):
            for name in files:
                try:
                    yield dfd, name, os.stat(name, dir_fd=dfd, follow_symlinks=False)
                except FileNotFoundError:
                    continue
    finally:
        os.close(top)


def copy_in(src: Path, root: Path, path: str, mode: int | None = None) -> None:
    """Copy the host file, link or folder ``src`` to ``path`` in the tree.

    A file or link there is replaced by a file; a folder (or a link to one in
    the tree) is merged into by a folder. ``mode`` sets
    the top file's permission bits (else the source's are kept). Links in
    ``src`` are copied as links, never followed.
    """
    st = os.lstat(src)
    if stat.S_ISLNK(st.st_mode):
        symlink(root, path, os.readlink(src))
    elif stat.S_ISDIR(st.st_mode):  # into a folder a link there names (inside the tree)
        with parent(root, path, create=True, follow_last=True) as (fd, name):
            _copy_dir(src, fd, name, st.st_mode & 0o7777 if mode is None else mode)
    elif stat.S_ISREG(st.st_mode):
        with parent(root, path, create=True) as (fd, name):
            _copy_file(src, fd, name, st.st_mode & 0o7777 if mode is None else mode)
    else:
        raise ImageError(f"cannot copy {src}: only files, folders and links are copied")


def _copy_file(src: Path | str, fd: int, name: str, mode: int) -> None:
    _clear(fd, name)
    with open(src, "rb") as s:
        f = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                    0o600, dir_fd=fd)
        try:
            with os.fdopen(os.dup(f), "wb") as d:
                shutil.copyfileobj(s, d, 1 << 20)
            os.fchmod(f, mode)
        finally:
            os.close(f)


def _copy_dir(src: Path, fd: int, name: str, mode: int) -> None:
    """Merge the host folder ``src`` into ``name`` of the folder ``fd`` (``""``: into the
    folder ``fd`` itself, whose mode is left alone)."""
    if name:
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        if st is not None and not stat.S_ISDIR(st.st_mode):
            os.unlink(name, dir_fd=fd)
            st = None
        if st is None:
            os.mkdir(name, 0o700, dir_fd=fd)
    sub = os.open(name, _DIR, dir_fd=fd) if name else os.dup(fd)
    try:
        if name:
            os.chmod(f"/proc/self/fd/{sub}", mode)
        with os.scandir(src) as it:
            for entry in sorted(it, key=lambda e: e.name):
                est = entry.stat(follow_symlinks=False)
                if stat.S_ISLNK(est.st_mode):
                    _clear(sub, entry.name)
                    os.symlink(os.readlink(entry.path), entry.name, dir_fd=sub)
                elif stat.S_ISDIR(est.st_mode):
                    _copy_dir(Path(entry.path), sub, entry.name, est.st_mode & 0o7777)
                elif stat.S_ISREG(est.st_mode):
                    _copy_file(entry.path, sub, entry.name, est.st_mode & 0o7777)
    finally:
        os.close(sub)
