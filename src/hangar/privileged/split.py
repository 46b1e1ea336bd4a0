"""The steps of the privilege split that need no helper: hand the data directory over,
drop root, and check first that the dropped server could still run.

``hangar.roothelper.split`` forks the root helper, then (in the server) calls
``hand_over`` (the data directory to the server's user: every file and
folder but the images' files and ``bin/``, which stay root's and readable,
since the server writes its store, keys, sandbox folders and template
snapshots) and ``drop`` (``setgroups([])``, ``setresgid``, ``setresuid``,
which clears every capability, ``PR_SET_NO_NEW_PRIVS``); before forking it
refuses (``check_code``) a user who could not read the code the server still
has to import. ``hand_new`` hands over what a root CLI builds into a split
server's data directory; ``take_back`` gives root back the build caches an
earlier Hangar handed over. Standard library only: ``hangar.images`` and
``hangar.core`` call ``hand_new`` from below the helper.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import sysconfig
from pathlib import Path

from hangar.errors import ConfigError
from hangar.layout import BUILD_CACHE, STAGING_PREFIX, TRASH_PREFIX, Layout
from hangar.privileged import beneath

PR_SET_NO_NEW_PRIVS = 38
KEEP_ROOTS = ("images", "bin", "cache")
"""Top-level entries of the data directory that stay root's (``cache``: the build caches
and work trees of root's image builds, which the server never uses; see ``take_back``)."""


def _take(path: str | Path, uid: int, gid: int, dir_fd: int | None = None) -> None:
    """What root owns of ``path`` (its user, its group) to ``uid`` and ``gid``; a VMM's
    own files and the VMM's group of its folder, disk and console stay as they are."""
    st = os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
    new_uid = uid if st.st_uid == 0 else -1
    new_gid = gid if st.st_gid == 0 else -1
    if new_uid != -1 or new_gid != -1:
        os.chown(path, new_uid, new_gid, dir_fd=dir_fd, follow_symlinks=False)


def _give(root: Path, uid: int, gid: int) -> None:
    """``root`` and everything below it (never through a link): ``_take``."""
    _take(root, uid, gid)
    for _rel, dirnames, filenames, dirfd in beneath.fwalk(None, str(root)):
        for name in (*dirnames, *filenames):
            _take(name, uid, gid, dir_fd=dirfd)


def _share(name: str, dirfd: int, uid: int, gid: int) -> None:
    """A file of a template snapshot, for the server: a lock file is given to
    ``uid:gid``; a snapshot's file of root's stays root's, read-only to the server (group
    ``gid``, group-readable, writable by nobody but root), so that one image cache can
    serve split and unsplit servers alike and a server can restore it but never alter it
    in place. Opened without following a link; what is not a regular file is left."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=dirfd)
    except OSError:
        return  # a link, or gone meanwhile
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != 0:
            return
        if name.endswith(".lock"):
            os.fchown(fd, uid, gid)
            return
        os.fchown(fd, 0, gid)
        os.fchmod(fd, (stat.S_IMODE(st.st_mode) | stat.S_IRGRP) & ~0o7022)
    finally:
        os.close(fd)


ROOTS_BUILDS = (STAGING_PREFIX, TRASH_PREFIX)
"""Folders of the image cache that stay root's (``hangar.layout``): a build in progress
(``.staging-<name>-*``, root's, 0700, where the build's tools write the rootfs, the kernel
and the initramfs) and one ``hangar image gc`` is removing. A split server starting
beside a build handed the build's staging folder to its user, who could then put a
link where root was about to write."""


def give_images(images: Path | str, uid: int, gid: int, dir_fd: int | None = None,
                under: tuple[str, ...] = ()) -> None:
    """The folders of ``images`` to ``uid:gid`` (the server adds template snapshots and
    their folders, and removes unusable ones); the files of template snapshots shared
    read-only (``_share``); an image's own files stay root's (read-only to the server).
    ``dir_fd``: ``images`` is a name relative to that folder (``hand_new``), and
    ``under`` the names it lies under in the image cache. A build in progress or being
    removed (``ROOTS_BUILDS``) is not handed over: root writes and removes there by names
    below it. Walked by ``beneath.fwalk`` (never opening a link, FIFO or device put in a
    folder's place); raises OSError when ``images`` itself is not a folder."""
    for rel, dirnames, filenames, dirfd in beneath.fwalk(dir_fd, str(images)):
        dirnames[:] = [d for d in dirnames if not d.startswith(ROOTS_BUILDS)]
        os.chown(dirfd, uid, gid)
        where = under + rel
        if "template-snapshots" in where:
            for name in filenames:
                _share(name, dirfd, uid, gid)


def hand_new(data_dir: Path, build: Path) -> None:
    """A build (or a template snapshot of it) that root just made in a split server's data
    directory (``hangar image build``, ``hangar template build`` run as root while the
    server runs): handed over as the split hands its images at start (``give_images``), so
    the running server restores its template snapshots and makes new ones. Nothing when
    the data directory is root's (no split), or when not root."""
    if os.geteuid() != 0:
        return
    top = beneath.open_trusted(data_dir)  # root acts only on what it opened itself
    try:
        st = os.fstat(top)
        if st.st_uid == 0:
            return
        rel = os.path.relpath(os.path.abspath(build), os.path.abspath(data_dir))
        names = beneath.parts(rel)
        if names[0] != "images" or len(names) < 2:
            raise OSError(errno.EINVAL, f"{build} is not in the image cache")
        up = beneath.walk(top, "/".join(names[:-1]), directory=True)  # no symlink on the way
        try:
            give_images(names[-1], st.st_uid, st.st_gid, dir_fd=up,
                        under=tuple(names[1:-1]))
        finally:
            os.close(up)
    finally:
        os.close(top)


def take_back(dir_fd: int) -> None:
    """The folder ``dir_fd`` and everything in it root's again, writable by root only:
    what an earlier Hangar handed to the server (``<data>/cache``, whose .debs, lists and
    trees root's builds use). Each name is opened without following a link and changed
    through its descriptor; a symlink, FIFO, socket or device there (which root's tools
    could be sent through) is removed, never followed. Walked top-down, so a folder is
    root's before what is in it is looked at.

    The work trees in ``BUILD_CACHE`` are made root's, but what is in them is not walked:
    a build in progress works there, in a Debian tree full of symlinks and device nodes,
    and this runs at every build's start and every split server's start, beside builds of
    other images (removing them broke those builds: an image with no symlink in
    ``/usr/bin``). Root's tools use a work tree only while its build runs, through the
    descriptor of the folder that build made itself (0700, root's); an older one is only
    ever removed, through descriptors (``staging.remove_at``). Raises OSError."""
    def own(fd: int) -> None:
        st = os.fstat(fd)
        if (st.st_uid, st.st_gid) != (0, 0):
            os.fchown(fd, 0, 0)
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o7022:
            os.fchmod(fd, mode & ~0o7022)

    own(dir_fd)
    for rel, dirs, files, dfd in beneath.fwalk(dir_fd):
        for name in dirs + files:
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                    os.unlink(name, dir_fd=dfd)
                    continue
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                             dir_fd=dfd)
            except FileNotFoundError:
                continue
            except OSError as exc:
                if exc.errno != errno.ELOOP:  # swapped for a link meanwhile: removed
                    raise
                os.unlink(name, dir_fd=dfd)
                continue
            try:
                st = os.fstat(fd)
                if stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode):
                    own(fd)
            finally:
                os.close(fd)
        if rel == (BUILD_CACHE,):
            dirs.clear()  # each work tree root's (above), its contents not walked


def hand_over(layout: Layout, uid: int, gid: int) -> None:
    """Give the data directory to ``uid:gid`` but for ``KEEP_ROOTS`` (of ``images``, only
    what the server writes: ``give_images``; ``cache`` is taken back: ``take_back``)."""
    root = layout.root
    os.chown(root, uid, gid, follow_symlinks=False)
    os.chmod(root, 0o700)
    for entry in os.scandir(root):
        if entry.name == "images" and entry.is_dir(follow_symlinks=False):
            give_images(Path(entry.path), uid, gid)
        if entry.name == "cache":
            if entry.is_dir(follow_symlinks=False):
                fd = os.open(entry.path, beneath.DIR_FLAGS)
                try:
                    take_back(fd)
                finally:
                    os.close(fd)
            else:  # a link an earlier server put there: root makes its own folder
                os.unlink(entry.path)
        if entry.name in KEEP_ROOTS:
            continue
        if entry.is_dir(follow_symlinks=False):
            _give(Path(entry.path), uid, gid)
        else:
            _take(entry.path, uid, gid)


def unreadable(paths: list[Path], uid: int, gid: int) -> Path | None:
    """The first of ``paths`` that ``uid:gid`` (no other group) could not enter and read,
    or None. Asked of the kernel by a child that becomes that user (so access control
    lists and every folder on the way count), before anything is handed over."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        code = 1
        try:
            os.close(r)
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
            bad = next((str(p) for p in paths if not os.access(p, os.R_OK | os.X_OK)), "")
            os.write(w, bad.encode() or b"-")
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        got = f.read(8192).decode(errors="replace")
    _, status = os.waitpid(pid, 0)
    if status != 0 or not got:
        raise OSError("could not check what the server's user can read")
    return None if got == "-" else Path(got)


def check_code(uid: int, gid: int) -> None:
    """Refuse (ConfigError) when ``uid`` could not import the rest of Hangar once
    dropped: the standard library, the installed packages and Hangar itself."""
    import hangar

    paths = sysconfig.get_paths()
    wanted = [Path(p) for p in (paths["stdlib"], paths["platstdlib"], paths["purelib"],
                                Path(hangar.__file__).parent) if Path(p).exists()]
    where = unreadable(wanted, uid, gid)
    if where is not None:
        raise ConfigError(f"the server's user cannot read {where} (Python or Hangar "
                          f"installed where only root can read it): run scripts/install.sh "
                          f"(it grants that user read access), install Hangar in a virtual "
                          f"environment of a Python that user can read, or keep the server "
                          f"root with HANGAR_PRIVSEP=0")


def drop(uid: int, gid: int) -> None:
    """Become ``uid:gid`` for good, with no groups, capabilities or way back."""
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS")
    if os.getuid() != uid or os.geteuid() != uid or os.getegid() != gid:
        raise OSError("the server is still privileged")
