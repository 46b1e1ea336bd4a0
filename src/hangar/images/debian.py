"""The Debian pipeline of a recipe's build: ``debootstrap`` from the host's mirror, then
``apt-get install`` inside the tree (chroot), and the mounts and shared apt caches
that takes.

The mirror is the one the host's apt uses for the recipe's suite (the ``URIs:`` of
the matching stanza of /etc/apt/sources.list.d/debian.sources, ``host_mirror``),
else debootstrap's default. Downloaded .debs are kept in
``<data>/cache/debootstrap/``. Every step runs a host tool through
``hangar.images.commands.run`` and raises ``ImageError`` with the tail of its output.

``static_bash`` then makes ``/bin/bash`` Debian's statically linked build of the same
bash where the tree has one (the ``bash-static`` package every recipe includes): under
QEMU's emulation a dynamically linked program starts slowly, because this QEMU (7.2)
translates the guest's code anew for every address it runs at, and address-space
randomization maps ld.so, libc and the position-independent program at new addresses in
every process; a static non-PIE bash runs at the same addresses every time, so its
translated code is reused. Measured in a ``base`` guest (p50 of 30, ms): ``bash -l -c
true`` 89 dynamic, 27-32 static; ``/bin/true`` 22-25 and ``sh -c true`` 28-31 (both
dynamic). E2B's SDK runs every command as ``/bin/bash -l -c``. ``locale_archive`` puts
the ``C.UTF-8`` locale the guest's commands run with into glibc's locale archive, one file
to map instead of a dozen.
"""

from __future__ import annotations

import fcntl
import os
import re
import stat
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from hangar.errors import ImageError
from hangar.images import safetree
from hangar.images.commands import Progress, inside, remove_tree, run
from hangar.images.recipes import Recipe
from hangar.images.rootfs import RESOLV_PLACEHOLDER, put_file
from hangar.layout import Layout

DEBIAN_SOURCES = Path("/etc/apt/sources.list.d/debian.sources")


def host_mirror(suite: str, sources: Path = DEBIAN_SOURCES) -> str | None:
    """The first ``URIs:`` entry of the deb822 stanza of ``sources`` listing ``suite``."""
    try:
        text = sources.read_text()
    except OSError:
        return None
    for stanza in re.split(r"\n[ \t]*\n", text):
        fields: dict[str, str] = {}
        key = None
        for line in stanza.splitlines():
            if line.startswith("#"):
                continue
            if line[:1] in (" ", "\t") and key:
                fields[key] += " " + line.strip()
                continue
            k, sep, v = line.partition(":")
            if sep:
                key = k.strip().lower()
                fields[key] = v.strip()
        if fields.get("enabled", "yes").lower() == "no":
            continue
        if "deb" not in fields.get("types", "").split():
            continue
        if suite not in fields.get("suites", "").split():
            continue
        for uri in fields.get("uris", "").split():
            if uri.split(":", 1)[0] in ("http", "https", "file"):
                return uri
    return None


def debootstrap(recipe: Recipe, rootdir: Path, mirror: str | None, cache: Path,
                say: Progress, lock: Path | None = None) -> None:
    """``debootstrap`` of ``recipe`` into ``rootdir``, its .debs kept in ``cache``.

    With ``lock`` (a flock file), builds may run side by side: what ``cache`` lacks is
    first fetched under the lock (``--download-only`` into a scratch tree beside
    ``rootdir``, removed after), since debootstrap writes a download straight to its
    final name there and another build reading it half-written would take it for a bad
    copy and delete it; the debootstrap proper then finds every .deb in ``cache`` and
    only reads it.
    """
    cache.mkdir(parents=True, exist_ok=True)
    argv: list[str | Path] = ["debootstrap", f"--variant={recipe.variant}",
                              f"--cache-dir={os.path.abspath(cache)}"]
    if recipe.packages:
        argv.append(f"--include={','.join(recipe.packages)}")
    tail: list[str | Path] = [mirror] if mirror else []
    echo = lambda ln: ln.startswith(("I: ", "W: ", "E: "))  # noqa: E731
    if lock is not None:
        scratch = rootdir.with_name(rootdir.name + ".download")
        try:
            with flock(lock):
                run("debootstrap", [*argv, "--download-only", recipe.suite, scratch, *tail],
                    progress=say, echo=echo, timeout=3600)
        finally:
            remove_tree(scratch)
    run("debootstrap", [*argv, recipe.suite, rootdir, *tail], progress=say, echo=echo,
        timeout=3600)


UNSAFE_IO_CONF = "etc/dpkg/dpkg.cfg.d/hangar-build-unsafe-io"
"""dpkg's configuration file, in a tree being built, that ``unsafe_io`` writes and removes."""


@contextmanager
def unsafe_io(rootdir: Path) -> Iterator[None]:
    """dpkg inside ``rootdir`` (debootstrap's, then apt-get's) skips its fsync of every file
    it unpacks (``force-unsafe-io``) for the duration; the option is gone from the tree
    after. A build tree is thrown away whole if anything fails before it is packed, so
    what the syncs protect (a half-unpacked package after a crash) cannot reach an image,
    and they cost a few ms each: about a minute for an image of a few ten thousand files
    on a virtual disk. Debian's throwaway-chroot builders (mmdebstrap, sbuild) do the same.
    """
    conf = rootdir / UNSAFE_IO_CONF
    conf.parent.mkdir(parents=True, exist_ok=True)
    conf.write_text("force-unsafe-io\n")
    try:
        yield
    finally:
        conf.unlink(missing_ok=True)


@contextmanager
def chroot_mounts(rootdir: Path, binds: Mapping[str, Path] | None = None) -> Iterator[None]:
    """/proc, /sys and /dev in the tree (and ``binds``: path in the tree -> host folder),
    plus the host's resolver, for commands run in it with ``chroot``.

    Everything is unmounted and /etc/resolv.conf emptied whatever happens
    (the guest writes its own at boot when it has a network).
    """
    try:
        host_resolv = Path("/etc/resolv.conf").read_bytes()
    except OSError:
        host_resolv = b""
    put_file(rootdir, "/etc/resolv.conf", host_resolv)
    mounts: list[Path] = []
    try:
        for fstype, src, target in (("proc", "proc", "/proc"), ("sysfs", "sysfs", "/sys"),
                                    (None, "/dev", "/dev"), *((None, str(h), t) for t, h in
                                                              (binds or {}).items())):
            # Mount only on real folders of the tree: a link could point at the host's.
            dest = inside(rootdir, target)
            if dest.is_symlink() or (dest.exists() and not dest.is_dir()):
                dest.unlink()
            dest.mkdir(parents=True, exist_ok=True)
            argv: list[str | Path] = (["mount", "--bind", src, dest] if fstype is None
                                      else ["mount", "-t", fstype, src, dest])
            run("mount", argv, timeout=60)
            mounts.append(dest)
        yield
    finally:
        for dest in reversed(mounts):
            try:
                run("umount", ["umount", "-l", dest], timeout=60)
            except ImageError:
                pass
        put_file(rootdir, "/etc/resolv.conf", RESOLV_PLACEHOLDER)


@dataclass(frozen=True)
class AptCaches:
    """Host folders apt may share between builds: .debs and package lists, under a lock."""

    archives: Path
    lists: Path
    lock: Path

    @classmethod
    def of(cls, layout: Layout) -> "AptCaches":
        return cls(layout.debootstrap_cache, layout.apt_lists_cache, layout.apt_lock)


def apt_install(rootdir: Path, packages: tuple[str, ...], say: Progress,
                 caches: AptCaches | None = None) -> None:
    """``apt-get install`` ``packages`` inside the tree (chroot with /proc, /sys, /dev).

    The tree's apt sources are those debootstrap wrote (the same mirror);
    the host's resolver is lent for the duration. With ``caches``, apt's
    archives and lists are the host's shared folders (bind-mounted, under
    their flock), so .debs fetched once (by debootstrap or an earlier build)
    are reused and nothing is left in the tree; else the tree's own, cleaned
    after.
    """
    say(f"apt-get install {' '.join(packages)}")
    env = {"DEBIAN_FRONTEND": "noninteractive", "LC_ALL": "C"}
    opts = ["-o", "APT::Sandbox::User=root"]
    binds: dict[str, Path] = {}
    if caches is not None:
        for d in (caches.archives / "partial", caches.lists / "partial"):
            d.mkdir(parents=True, exist_ok=True)
        binds = {"/var/cache/apt/archives": caches.archives, "/var/lib/apt/lists": caches.lists}
    with flock(caches.lock if caches else None), chroot_mounts(rootdir, binds):
        run("apt-get update", ["chroot", rootdir, "apt-get", *opts, "update", "-q"], env=env,
            timeout=1800)
        run("apt-get install", ["chroot", rootdir, "apt-get", *opts, "install", "-y", "-q",
                                "--no-install-recommends", *packages],
            progress=say, echo=lambda ln: ln.startswith(("E: ", "W: ", "Get:", "Setting up ")),
            env=env, timeout=3600)
        if caches is None:
            run("apt-get clean", ["chroot", rootdir, "apt-get", "clean"], env=env, timeout=300)


STATIC_BASH = "/bin/bash-static"
"""Where Debian's ``bash-static`` package puts its program."""
DYNAMIC_BASH = "/bin/bash.dynamic"
"""Where ``static_bash`` diverts the ``bash`` package's own ``/bin/bash``."""


def static_bash(rootdir: Path, say: Progress) -> bool:
    """Make ``/bin/bash`` a link to ``STATIC_BASH`` when the tree has it; return whether.

    The ``bash`` package's program is diverted with ``dpkg-divert --local --rename`` to
    ``DYNAMIC_BASH``, so apt in the guest still upgrades both packages, and an upgrade of
    ``bash`` lands there instead of replacing the link. Both programs are built from the
    same source and version (``bash-static`` is a binary of the ``bash`` source package):
    same builtins, options, variables, login and startup files. Raises ImageError when
    ``dpkg-divert`` fails."""
    static = safetree.lstat(rootdir, STATIC_BASH, follow_last=True)
    bash = safetree.lstat(rootdir, "/bin/bash")
    if static is None or bash is None or not stat.S_ISREG(bash.st_mode):
        return False
    say(f"/bin/bash -> {STATIC_BASH} (the bash package's as {DYNAMIC_BASH})")
    run("dpkg-divert", ["chroot", rootdir, "dpkg-divert", "--local", "--rename", "--divert",
                        DYNAMIC_BASH, "--add", "/bin/bash"],
        env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}, timeout=300)
    safetree.symlink(rootdir, "/bin/bash", STATIC_BASH.rsplit("/", 1)[1])
    return True


C_UTF8 = "/usr/lib/locale/C.utf8"
"""The ``C.UTF-8`` locale as ``libc-bin`` ships it: a folder of one file per category."""
LOCALE_ARCHIVE = "/usr/lib/locale/locale-archive"
"""Where glibc looks for a locale first, before a locale's own folder."""


def locale_archive(rootdir: Path, say: Progress) -> bool:
    """Add ``C_UTF8`` to a ``LOCALE_ARCHIVE`` (the tree's own ``localedef --add-to-archive``)
    when the tree has both and no archive yet; return whether.

    Guests run commands with ``LANG=C.UTF-8``. Without an archive, every program that
    calls ``setlocale`` (bash, ls, grep, Python) opens and maps the folder's dozen files
    one by one; from the archive it maps one file. Under emulation that is about 1.3 ms
    of a 7 ms ``bash -c true`` (docs/performance.md). glibc reads a locale it does not
    find in the archive, or one whose format it does not know, from the folder as
    before. Raises ImageError when ``localedef`` fails."""
    tool = safetree.lstat(rootdir, "/usr/bin/localedef", follow_last=True)
    folder = safetree.lstat(rootdir, C_UTF8, follow_last=True)
    if tool is None or folder is None or not stat.S_ISDIR(folder.st_mode) \
            or safetree.lstat(rootdir, LOCALE_ARCHIVE) is not None:
        return False
    say(f"{LOCALE_ARCHIVE} with {C_UTF8}")
    run("localedef", ["chroot", rootdir, "localedef", "--add-to-archive", C_UTF8],
        env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}, timeout=300)
    return True


@contextmanager
def flock(path: Path | None) -> Iterator[None]:
    """Hold the flock of the file ``path`` (made if missing; a link there is refused,
    never followed, and the file is never truncated)."""
    if path is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                 | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
