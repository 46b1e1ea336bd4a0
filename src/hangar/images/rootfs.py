"""Shaping a guest's tree for a VM without an init system, before it is packed.

``guest_setup`` gives every Hangar guest (Debian or not) its host name and hosts,
an empty resolv.conf and fstab, ``poweroff``-style commands that signal PID 1,
/root, and the folder the initramfs puts the guest's Python in; ``trim`` leaves
out of a Debian tree what a sandbox never needs (docs, man pages, locales, apt
caches, logs) and keeps dpkg from adding them back; ``write_files`` writes a
recipe's ``files``. Every write goes through ``hangar.images.safetree``, so nothing
the tree holds (a link to the host's folders) makes it write outside the tree.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from hangar.errors import ImageError
from hangar.images import safetree
from hangar.images.initramfs import GUEST_PYTHON_DIR
from hangar.images.recipes import Recipe

RESOLV_PLACEHOLDER = "# Hangar: written at sandbox start when the sandbox has a network.\n"

POWEROFF_SHIM = """#!/bin/sh
# Hangar guests have no init system: PID 1 (hangar.guest.init) powers off on SIGTERM.
exec kill -TERM 1
"""

NODOC = """# Hangar: keep docs, man pages and translations out of the sandbox image.
path-exclude=/usr/share/doc/*
path-include=/usr/share/doc/*/copyright
path-exclude=/usr/share/man/*
path-exclude=/usr/share/info/*
path-exclude=/usr/share/locale/*
path-include=/usr/share/locale/locale.alias
path-exclude=/usr/share/lintian/*
"""


def configure_rootfs(root: Path) -> None:
    """Shape a recipe's tree after debootstrap: ``guest_setup``, then ``trim``."""
    guest_setup(root)
    trim(root)


def put_file(root: Path, path: str, data: bytes | str, mode: int | None = None,
             owner: tuple[int, int] | None = None) -> None:
    """Write a file at the guest path ``path`` of the tree ``root`` (parents made, a link
    or file there replaced), never outside the tree (``hangar.images.safetree``);
    ``owner`` is its (uid, gid) when given."""
    safetree.write_file(root, path, data, 0o644 if mode is None else mode, owner)


def guest_setup(root: Path) -> None:
    """What every Hangar guest's tree needs (Debian or not): host name and hosts, an
    empty resolv.conf and fstab, ``poweroff``-style commands that signal PID 1 (when the
    tree has /bin/sh), /root, and the folder the initramfs puts the guest's Python in."""
    put_file(root, "/etc/hostname", "hangar\n")
    put_file(root, "/etc/hosts",
             "127.0.0.1\tlocalhost\n127.0.1.1\thangar\n"
             "::1\t\tlocalhost ip6-localhost ip6-loopback\n"
             "ff02::1\t\tip6-allnodes\nff02::2\t\tip6-allrouters\n")
    put_file(root, "/etc/resolv.conf", RESOLV_PLACEHOLDER)
    put_file(root, "/etc/fstab",
             "# Hangar: the initramfs mounts / and the guest init mounts the rest; "
             "nothing here.\n")
    safetree.make_dirs(root, "/root", 0o700)
    if safetree.lstat(root, "/bin/sh", follow_last=True) is not None:
        for cmd in ("poweroff", "halt", "reboot", "shutdown"):
            put_file(root, f"/usr/local/sbin/{cmd}", POWEROFF_SHIM, 0o755)
    safetree.make_dirs(root, GUEST_PYTHON_DIR)


TRIM = (("/var/cache/apt", "*.bin"), ("/var/cache/apt/archives", "*.deb"),
        ("/var/lib/apt/lists", "*_*"), ("/var/cache/debconf", "*-old"),
        ("/var/lib/dpkg", "*-old"), ("/usr/share/man", "*"), ("/usr/share/info", "*"),
        ("/usr/share/lintian", "*"), ("/var/log", "bootstrap.log"), ("/tmp", "*"),
        ("/var/tmp", "*"))
"""(folder, glob) of what ``trim`` removes."""


def trim(root: Path) -> None:
    """Leave out of a Debian tree what a sandbox never needs: docs (but copyrights), man
    pages, locales, apt caches and lists, logs; and keep dpkg from adding them back.

    Works through ``safetree``: a tree whose ``usr/share/doc`` or ``var/log`` is a link
    to the host's trims inside the tree only.
    """
    put_file(root, "/etc/dpkg/dpkg.cfg.d/01-hangar-nodoc", NODOC)
    for folder, pattern in TRIM:
        safetree.remove_matching(root, folder, pattern)
    safetree.remove_matching(root, "/usr/share/locale", "*", keep=frozenset({"locale.alias"}))
    for dfd, name, st in safetree.files_under(root, "/usr/share/doc"):
        if stat.S_ISREG(st.st_mode) and name != "copyright":
            os.unlink(name, dir_fd=dfd)
    for dfd, name, st in safetree.files_under(root, "/var/log"):
        if stat.S_ISREG(st.st_mode):
            fd = os.open(name, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                         dir_fd=dfd)
            try:
                os.ftruncate(fd, 0)
            finally:
                os.close(fd)


def write_files(root: Path, recipe: Recipe) -> None:
    """Write the recipe's ``files`` into the tree (parents made as needed)."""
    for f in recipe.files:
        if not f.path.startswith("/") or ".." in f.path.split("/"):
            raise ImageError(f"recipe {recipe.name}: file path {f.path!r} must be absolute",
                             image=recipe.name)
        put_file(root, f.path, f.content, f.mode)


def python_version(root: Path) -> str | None:
    """The tree's ``/usr/bin/python3`` version (``"3.11"``), or None."""
    target = safetree.readlink(root, "/usr/bin/python3")
    if target is None:
        return None
    m = re.fullmatch(r"(?:.*/)?python(\d+\.\d+)", target)
    return m.group(1) if m else None
