"""Running a template's build commands confined: never as host root over the image's content.

A template's ``steps`` and its ``packages`` (``apt-get install``) run the
image's own programs: an OCI image's shell and package manager, or a base
template's tree that earlier steps shaped. They run in ``hangar.images.buildns``:
a user namespace in which root is host uid ``UID_BASE`` (ids 0..65535 are
host ids ``UID_BASE``..``UID_BASE``+65535, none of them a host user's), a mount
namespace whose root is the tree alone (``pivot_root``), a private ``/proc``, a
minimal ``/dev``, a PID namespace that dies with the command, and no network
unless asked for (``network=True``; ``apt-get`` gets the host's, to reach the
mirror).

For root in the namespace to own the tree, ``shifted`` moves the tree's
owners up by ``UID_BASE`` before and back after (an id above 65535 becomes
65534, nobody); set-user-ID and set-group-ID bits and file capabilities,
which ``chown`` clears, are put back. About a second per 50,000 files each
way (the dev image's tree: 48,087 files, 0.85 s up, 0.92 s back).

Recipes (``hangar.images.builder``) are not built this way: their trees come
from debootstrap of Debian's signed archive, which needs host root to make
device nodes, and are Hangar's own content.

Host tools: none beyond Python (the namespaces are made with ``unshare(2)``
and ``pivot_root(2)`` by ``buildns``); the kernel must allow user namespaces
(``user.max_user_namespaces`` > 0).
"""

from __future__ import annotations

import json
import os
import stat
import sys
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from hangar.errors import ImageError
from hangar.images import buildns, safetree
from hangar.images.commands import Progress, run
from hangar.privileged import beneath

UID_BASE = 300_000
"""Host uid (and gid) of root in a build's user namespace. Below the VMMs' range
(``hangar.engines.confine``, 400,000 up) and above any ordinary account's."""
UID_COUNT = 65_536
NOBODY = 65_534
CAP_XATTR = "security.capability"
MOUNT_POINTS = ("/proc", "/dev")
"""Real folders the namespace mounts on (a link or file there is replaced by one; the
guest mounts there too)."""


def _shift(root: Path, up: bool) -> int:
    """Move every owner in the tree by ``UID_BASE`` (``up``) or back; returns the count.
    Never follows a link; restores set-id bits and file capabilities that ``chown``
    clears."""
    n = 0
    seen: set[tuple[int, int]] = set()  # hard links: each inode moves once
    top = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        os.chown(f"/proc/self/fd/{top}", *_moved(os.fstat(top), up))
        for _p, dirs, files, dfd in beneath.fwalk(top):
            for name in dirs + files:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
                    if (st.st_dev, st.st_ino) in seen:
                        continue
                    seen.add((st.st_dev, st.st_ino))
                uid, gid = _moved(st, up)
                if (uid, gid) == (st.st_uid, st.st_gid):
                    continue
                if not stat.S_ISREG(st.st_mode):
                    os.chown(name, uid, gid, dir_fd=dfd, follow_symlinks=False)
                    n += 1
                    continue
                fd = os.open(name, os.O_PATH | os.O_NOFOLLOW, dir_fd=dfd)
                try:
                    at = f"/proc/self/fd/{fd}"
                    try:
                        caps = os.getxattr(at, CAP_XATTR)
                    except OSError:
                        caps = None
                    os.chown(at, uid, gid)
                    if st.st_mode & (stat.S_ISUID | stat.S_ISGID):
                        os.chmod(at, stat.S_IMODE(st.st_mode))
                    if caps is not None:
                        os.setxattr(at, CAP_XATTR, _caps_v2(caps))
                finally:
                    os.close(fd)
                n += 1
    finally:
        os.close(top)
    return n


def _moved(st: os.stat_result, up: bool) -> tuple[int, int]:
    def one(i: int) -> int:
        if up:
            return UID_BASE + (i if i < UID_COUNT else NOBODY)
        return i - UID_BASE if UID_BASE <= i < UID_BASE + UID_COUNT else NOBODY
    return one(st.st_uid), one(st.st_gid)


def _caps_v2(raw: bytes) -> bytes:
    """A file capability as the host writes it: revision 3 (which names the namespace's
    root) becomes revision 2 (the guest's root), the rest unchanged."""
    if len(raw) == 24 and raw[3] == 0x03:
        return bytes([raw[0], raw[1], raw[2], 0x02]) + raw[4:20]
    return raw


@contextmanager
def shifted(root: Path, say: Progress) -> Iterator[None]:
    """The tree owned by the build namespace's ids for the duration (see the module)."""
    for p in MOUNT_POINTS:
        st = safetree.lstat(root, p)
        if st is not None and not stat.S_ISDIR(st.st_mode):
            safetree.remove(root, p)
        safetree.make_dirs(root, p)
    if safetree.lstat(root, "/tmp") is None:  # programs expect one; a link there is kept
        safetree.make_dirs(root, "/tmp", 0o1777)
    n = _shift(root, True)
    say(f"build namespace: tree of {n} files owned by uid {UID_BASE}+")
    try:
        yield
    finally:
        _shift(root, False)


def run_in_tree(step: str, root: Path, argv: list[str], *, env: Mapping[str, str],
                cwd: str = "/", network: bool = False, progress: Progress | None = None,
                echo: bool = True, timeout: float = 3600.0) -> str:
    """Run ``argv`` (a path in the tree and its arguments) confined in ``root``, which
    ``shifted`` holds; returns its output. ``env`` is its whole environment.

    Raises ImageError naming ``step`` when it fails, times out or cannot be set up.
    """
    spec = {"root": str(root), "uid_base": UID_BASE, "uid_count": UID_COUNT,
            "argv": list(argv), "env": dict(env), "cwd": cwd, "network": network}
    # in a file of the build's own (0600), not in argv: the host's ps shows every argv
    with tempfile.NamedTemporaryFile("w", dir=root.parent, prefix=".buildns-",
                                     suffix=".json") as f:
        json.dump(spec, f)
        f.flush()
        return run(step, [sys.executable, "-I", "-S", buildns.__file__, f.name],
                   progress=progress, echo=(lambda _ln: True) if echo else None,
                   timeout=timeout)


def check_available() -> None:
    """Raise ImageError when this host cannot make the build namespace."""
    try:
        n = int(Path("/proc/sys/user/max_user_namespaces").read_text())
    except (OSError, ValueError):
        n = 1
    if n <= 0:
        raise ImageError("template builds run in a user namespace, which this host "
                         "disables (sysctl user.max_user_namespaces = 0)")
    if os.geteuid() != 0:
        raise ImageError("template builds need root to map the build namespace's ids")
