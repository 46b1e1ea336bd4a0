"""A build's own folders: root builds where the server cannot swap a name under it.

``hangar image build`` and ``hangar template build`` may run as root beside a
split server, whose user owns ``<data>``, ``<data>/images`` and
``<data>/cache`` (see ``hangar.privileged.split``) and so may rename any name
there and put a symlink in its place at any moment. A build therefore never
works by a path through those folders (``hangar.privileged.beneath``):

- ``BuildRoom`` opens ``images`` and ``cache/build`` without following a
  symlink the server put on the way (``open_trusted``, ``mkdir_at``), makes
  the build's staging folder (``images/.staging-<name>-*``) and its work tree
  (``cache/build/<name>-*``) in them, 0700, opens each without following a
  link and checks after opening that it is root's (this process's user's),
  empty and a folder. Every tool of the build (debootstrap, apt, mkfs.ext4,
  dpkg-deb, cp, the build namespace) is given ``fd_path`` of those
  descriptors: ``/proc/<pid>/fd/<n>``, which the kernel resolves to the very
  folder root made whatever its name became, and below which every name is
  root's own (0700: the server cannot even look in).
- As root, the work tree is also bind-mounted (private) on a new folder of
  ``/run/hangar-builds`` (root's, 0700), and that path is what the tools get:
  mount(8) and umount(8) (debootstrap's, apt's chroot mounts, the template
  build's loop mount) canonicalize the paths they are given into a string,
  which must not pass through a folder of the server's.
- ``<data>/cache`` (the .debs, lists and work trees of root's builds, which
  the server never uses) stays root's under the split (``split.take_back``
  gives back what an earlier Hangar handed over, also when a build finds it
  the server's) and the caches are named through its descriptor
  (``BuildRoom.cached``).
- ``BuildRoom.publish`` renames the finished staging folder to its id
  relative to the descriptor of ``images`` (``renameat``), then opens the
  id without following a link and checks that it is the folder root staged
  (same device and inode); a swapped one is refused and nothing more is done
  with it.
- ``BuildRoom.close`` removes what is left of the two folders through their
  descriptors (``remove_at``: anything mounted below is unmounted by a path
  through the descriptor first, then ``beneath.remove_tree``, which opens
  each folder with ``O_DIRECTORY | O_NOFOLLOW | O_NONBLOCK``), and
  their names only while they still name those folders.
- ``image_at`` describes a published build (its initramfs made or
  repointed if this Hangar's guest files changed) through a descriptor of
  its folder, so what root writes there cannot be sent elsewhere.

``remove_at`` is also how ``hangar image gc`` removes builds and leftovers.
Raises ``OSError`` (ELOOP for a symlink where a folder was expected, EPERM
for a folder that is not root's) or ``ImageError``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import fcntl
import os
import secrets
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hangar.errors import ImageError
from hangar.images.commands import mounts_under
from hangar.images.guest_image import GuestImage
from hangar.layout import Layout
from hangar.privileged import beneath

MNT_DETACH = 2
UMOUNT_NOFOLLOW = 8
MS_BIND = 4096
MS_PRIVATE = 1 << 18
PRIVATE_ROOT = Path("/run/hangar-builds")
"""Root's own folder (0700, in root's /run) on which a build's work tree is bind-mounted
while it runs as root, so that the paths its tools see (and canonicalize: mount(8),
umount(8)) lie under folders only root may write."""


LOOP_CTL_GET_FREE = 0x4C82
LOOP_SET_FD = 0x4C00
LOOP_CLR_FD = 0x4C01


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def open_images(layout: Layout) -> int:
    """A descriptor of ``<data>/images``, opened from ``/`` without following a symlink
    that anyone but root (or this process's user) put on the way. Raises OSError."""
    return beneath.open_trusted(layout.images)


def new_dir(parent_fd: int, prefix: str) -> tuple[int, str]:
    """A new empty folder ``<prefix><random>`` (0700) of ``parent_fd`` and its name, opened
    without following a link and checked after opening: a folder of this process's user,
    empty, with no access for others. Raises OSError (EPERM when the name was swapped)."""
    for _ in range(100):
        name = prefix + secrets.token_hex(4)
        try:
            os.mkdir(name, 0o700, dir_fd=parent_fd)
        except FileExistsError:
            continue
        fd = beneath.walk(parent_fd, name, directory=True)
        try:
            st = beneath.expect(fd, directory=True, uids=(os.geteuid(),))
            if stat.S_IMODE(st.st_mode) & 0o077 or os.listdir(fd):
                raise OSError(errno.EPERM, f"{name}: not the folder just made")
        except BaseException:
            os.close(fd)
            raise
        return fd, name
    raise OSError(errno.EEXIST, f"no free name for {prefix}*")


def _same(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _umount_below(fd: int) -> None:
    """Unmount (lazily) whatever is mounted at or below the folder ``fd``, naming each
    mount point by a path through ``fd`` (never by a path through the server's folders).
    Raises ImageError when a mount stays."""
    top = beneath.fd_path(fd)
    real = os.path.realpath(top)
    libc = _libc()
    for _ in range(2):
        found = mounts_under(Path(top))
        if not found:
            return
        for mp in found:
            rel = os.path.relpath(mp, real)
            at = top if rel == "." else f"{top}/{rel}"
            libc.umount2(at.encode(), MNT_DETACH | UMOUNT_NOFOLLOW)
    left = mounts_under(Path(top))
    if left:
        raise ImageError(f"cannot remove {real}: still mounted: {', '.join(map(str, left))}")


def clear(fd: int) -> None:
    """Remove everything in the folder ``fd`` (after unmounting what is mounted below it),
    through ``fd``: each name is opened without following a link. Raises ImageError when
    a mount stays; other failures are left (as ``remove_tree`` does)."""
    _umount_below(fd)
    for name in os.listdir(fd):
        try:
            remove_at(fd, name)
        except OSError:
            pass


def remove_at(dir_fd: int, name: str) -> None:
    """Remove ``name`` of the folder ``dir_fd``: a folder with everything in it (through
    descriptors, ``beneath.remove_tree``, after unmounting what is mounted below
    it), anything else (a symlink too, never followed) unlinked. Raises OSError."""
    (leaf,) = beneath.parts(name)
    try:
        st = os.stat(leaf, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(leaf, dir_fd=dir_fd)
        return
    fd = beneath.walk(dir_fd, leaf, directory=True)
    try:
        if not _same(os.fstat(fd), st):
            raise OSError(errno.ELOOP, f"{leaf} changed while it was removed")
        _umount_below(fd)
    except ImageError as exc:
        raise OSError(errno.EBUSY, exc.message) from exc
    finally:
        os.close(fd)
    beneath.remove_tree(dir_fd, leaf)


def _drop(parent_fd: int, name: str, fd: int) -> None:
    """Empty the folder ``fd`` and remove its name ``name`` of ``parent_fd`` if that name
    still is that folder (else the name is left: it is not root's own any more)."""
    try:
        clear(fd)
    finally:
        try:
            if _same(os.stat(name, dir_fd=parent_fd, follow_symlinks=False), os.fstat(fd)):
                os.rmdir(name, dir_fd=parent_fd)
        except OSError:
            pass


class _Bind:
    """The folder ``fd`` bind-mounted (private) on a new folder of ``PRIVATE_ROOT``, whose
    whole chain is root's: the path tools get. Root only. Raises OSError."""

    def __init__(self, fd: int) -> None:
        run = beneath.open_trusted("/run")
        try:
            self.parent_fd = beneath.mkdir_at(run, PRIVATE_ROOT.name, 0o700)
        finally:
            os.close(run)
        try:
            beneath.expect(self.parent_fd, directory=True, uids=(0,))
            os.fchmod(self.parent_fd, 0o700)
            point, self.name = new_dir(self.parent_fd, "work-")
            os.close(point)
            self.path = PRIVATE_ROOT / self.name
            _check(_libc().mount(beneath.fd_path(fd).encode(), str(self.path).encode(), None,
                                 MS_BIND, None), f"bind the work tree on {self.path}")
            _check(_libc().mount(None, str(self.path).encode(), None, MS_PRIVATE, None),
                   f"make {self.path} private")
            got = beneath.walk(self.parent_fd, self.name, directory=True)
            try:
                if not _same(os.fstat(got), os.fstat(fd)):
                    raise OSError(errno.EPERM, f"{self.path} is not the work tree")
            finally:
                os.close(got)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Unmount what is mounted at or below the path (its chain is root's), then remove
        the mount point."""
        if getattr(self, "path", None) is not None:
            for mp in mounts_under(self.path):
                _libc().umount2(str(mp).encode(), MNT_DETACH | UMOUNT_NOFOLLOW)
            try:
                os.rmdir(self.name, dir_fd=self.parent_fd)
            except OSError:
                pass
        os.close(self.parent_fd)


class BuildRoom:
    """The staging folder and work tree of one build, held by descriptor (see the module).

    ``stage`` and ``work`` are ``fd_path`` names of the two folders for every tool
    of the build; ``publish`` gives the staging folder its id in ``images``;
    ``close`` (or leaving the ``with`` block) removes what is left.
    """

    def __init__(self, layout: Layout, name: str, work_prefix: str) -> None:
        self.layout = layout
        self.published = False
        self._fds: list[int] = []
        self._bind: _Bind | None = None
        try:
            self.images_fd = self._hold(open_images(layout))
            self.cache_fd = self._hold(beneath.open_trusted(layout.cache))
            if os.geteuid() == 0:
                from hangar.privileged.split import take_back

                take_back(self.cache_fd)  # handed to the server by an earlier Hangar
            self.build_fd = self._hold(beneath.mkdir_at(self.cache_fd, layout.build_cache.name,
                                                        0o700))
            self.work_fd, self.work_name = new_dir(self.build_fd, work_prefix)
            self._hold(self.work_fd)
            self.stage_fd, self.stage_name = new_dir(self.images_fd,
                                                     layout.image_staging_prefix(name))
            self._hold(self.stage_fd)
            self._bind = _Bind(self.work_fd) if os.geteuid() == 0 else None
        except BaseException:
            self._close_fds()
            raise

    def _hold(self, fd: int) -> int:
        self._fds.append(fd)
        return fd

    def _close_fds(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    @property
    def stage(self) -> Path:
        """The staging folder, as a path through this process's descriptor."""
        return Path(beneath.fd_path(self.stage_fd))

    def cached(self, path: Path) -> Path:
        """``path`` (a cache of the layout's: ``debs_cache``, ``apt_lock`` ...) as a path
        through this process's descriptor of ``<data>/cache``, which is root's own."""
        return Path(beneath.fd_path(self.cache_fd)) / path.relative_to(self.layout.cache)

    @property
    def work(self) -> Path:
        """The work tree's folder: as root, its bind mount under ``PRIVATE_ROOT`` (a path
        whose every folder is root's), else a path through this process's descriptor."""
        if self._bind is not None:
            return self._bind.path
        return Path(beneath.fd_path(self.work_fd))

    def publish(self, image_id: str) -> bool:
        """Rename the staging folder (made readable: 0755) to ``images/<image_id>``;
        False (nothing renamed) when a build of that id is there already. Checked after
        the rename: ``images/<image_id>`` is the very folder staged. Raises ImageError
        when the server swapped it."""
        (leaf,) = beneath.parts(image_id)
        os.fchmod(self.stage_fd, 0o755)
        try:
            os.stat(leaf, dir_fd=self.images_fd, follow_symlinks=False)
            return False
        except FileNotFoundError:
            pass
        os.rename(self.stage_name, leaf, src_dir_fd=self.images_fd,
                  dst_dir_fd=self.images_fd)
        try:
            fd = beneath.walk(self.images_fd, leaf, directory=True)
        except OSError as exc:
            raise ImageError(f"build {image_id}: its staging folder was swapped before it "
                             f"was published ({exc.strerror}); not used", image=image_id)
        try:
            if not _same(os.fstat(fd), os.fstat(self.stage_fd)):
                raise ImageError(f"build {image_id}: its staging folder was swapped before "
                                 "it was published; not used", image=image_id)
        finally:
            os.close(fd)
        self.published = True  # else ``close`` empties the folder staged, wherever it is
        return True

    def close(self) -> None:
        """Remove the work tree and, unless published, the staging folder (see ``_drop``)."""
        if not self._fds:
            return
        try:
            if self._bind is not None:
                self._bind.close()
            _drop(self.build_fd, self.work_name, self.work_fd)
        finally:
            try:
                if not self.published:
                    _drop(self.images_fd, self.stage_name, self.stage_fd)
            finally:
                self._close_fds()

    def __enter__(self) -> "BuildRoom":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def image_at(layout: Layout, image_id: str, manifest: dict[str, Any] | None = None
             ) -> GuestImage:
    """The published build ``images/<image_id>`` as ``catalogue.ensure_initrd`` gives it
    (its initramfs made or repointed when needed), with every write done below a
    descriptor of that folder opened without following a link; the paths returned are
    the build's real ones. Raises OSError, ImageError."""
    from hangar.images.catalogue import ensure_initrd, read_manifest

    with opened_build(layout, image_id) as fd:
        at = Path(beneath.fd_path(fd))
        img = ensure_initrd(at, manifest if manifest is not None else read_manifest(at))
    real = layout.images / image_id

    def moved(p: Path) -> Path:
        return real / p.relative_to(at)

    return dataclasses.replace(img, dir=real, kernel=moved(img.kernel),
                               initrd=moved(img.initrd), rootfs=moved(img.rootfs),
                               vmlinux=None if img.vmlinux is None else moved(img.vmlinux))


@contextmanager
def opened_build(layout: Layout, image_id: str) -> Iterator[int]:
    """A descriptor of the build folder ``images/<image_id>``, opened without following a
    link (the server owns ``images`` and its folders). Raises OSError."""
    (leaf,) = beneath.parts(image_id)
    images = open_images(layout)
    try:
        fd = beneath.walk(images, leaf, directory=True)
    finally:
        os.close(images)
    try:
        yield fd
    finally:
        os.close(fd)


@contextmanager
def loop_device(fd: int) -> Iterator[str]:
    """A loop device (``/dev/loopN``) over the file ``fd``, read-only when ``fd`` is,
    attached by descriptor (``LOOP_SET_FD``; losetup(8) and ``mount -o loop`` would open
    the file again by its canonical path), detached after. Raises OSError."""
    ctl = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
    try:
        for _ in range(32):
            dev = f"/dev/loop{fcntl.ioctl(ctl, LOOP_CTL_GET_FREE)}"
            lfd = os.open(dev, os.O_RDONLY | os.O_CLOEXEC)
            try:
                fcntl.ioctl(lfd, LOOP_SET_FD, fd)
                break
            except OSError as exc:
                os.close(lfd)
                if exc.errno != errno.EBUSY:  # taken meanwhile by another process: again
                    raise
        else:
            raise OSError(errno.EBUSY, "no free loop device")
    finally:
        os.close(ctl)
    try:
        yield dev
    finally:
        try:
            fcntl.ioctl(lfd, LOOP_CLR_FD, 0)
        except OSError:
            pass
        os.close(lfd)


def copy_tree_at(src_fd: int, dest: Path) -> None:
    """Copy the folder ``src_fd`` into the new folder ``dest`` (of root's own): folders,
    regular files (opened without following a link) and symlinks (copied as links), with
    their modes; anything else is left out. Walks by descriptor (``beneath.fwalk``), so a
    name swapped for a link, FIFO or device on the way is never followed or opened.
    Raises OSError."""
    dest.mkdir(mode=stat.S_IMODE(os.fstat(src_fd).st_mode))
    for rel, dirs, files, dfd in beneath.fwalk(src_fd):
        here = dest.joinpath(*rel)
        for name in dirs:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                (here / name).symlink_to(os.readlink(name, dir_fd=dfd))
            else:
                (here / name).mkdir(mode=stat.S_IMODE(st.st_mode))
        for name in files:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                (here / name).symlink_to(os.readlink(name, dir_fd=dfd))
            elif stat.S_ISREG(st.st_mode):
                with beneath.walked(dfd, name) as ffd:
                    _copy_fd(ffd, here / name)


def _copy_fd(src: int, dest: Path) -> None:
    """The file ``src`` into the new file ``dest``, with its mode."""
    mode = stat.S_IMODE(os.fstat(src).st_mode)
    out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                  mode)
    try:
        os.fchmod(out, mode)
        while os.sendfile(out, src, None, 1 << 30):
            pass
    finally:
        os.close(out)


def copy_file_at(dir_fd: int, name: str, dest: Path, uids: tuple[int, ...]) -> None:
    """The regular file ``name`` of ``dir_fd`` (opened without following a link, owned by
    one of ``uids``) into the new file ``dest``. Raises OSError."""
    with beneath.walked(dir_fd, name) as fd:
        beneath.expect(fd, uids=uids)
        _copy_fd(fd, dest)
