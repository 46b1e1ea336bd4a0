"""The initramfs: busybox, the virtio modules and the guest's Python files.

The initramfs is small (about 1.5 MB gzip'd) and built in about a second, so
it carries everything that changes often: the guest agent and init. The slow
rootfs (debootstrap, a minute or more) is rebuilt only when its recipe changes.
Its name, ``initrd-<tag>.img``, hashes every input (the guest Python files,
the /init script, the module list, the kernel version, the busybox binary),
so a changed agent gets a new initrd next to the same rootfs.

Contents (a gzip'd newc cpio, written here without the cpio tool)::

    /init                         busybox sh script, below (``INIT_SCRIPT``)
    /bin/busybox                  the host's static busybox (busybox-static)
    /bin/<applet> -> busybox      every applet the binary lists
    /dev/console                  char 5:1, for the kernel's first open
    /lib/modules/<kver>/...       ``MODULES`` and their dependencies, plus
                                  modules.dep/alias/order/builtin for them
    /hangar/python/hangar/...     the guest's Python files (``guest_sources``)
                                  and, when the host's Python matches the
                                  guest's, unchecked-hash .pyc files for them;
                                  ``hangar/guest/_spawn.abi3.so``, the agent's
                                  native spawn, compiled from ``_spawn.c`` by the
                                  host's C compiler (``native_build``) where it
                                  has one and Python's headers (x86-64 only)

/init mounts proc, sysfs and devtmpfs and loads the modules (those of
``ON_DEMAND`` only when their option is on the kernel command line). With
``hangar.probe=1`` on the kernel command line it prints ``HANGAR-PROBE-OK``
and powers off (the engine's accelerator probe). Otherwise it waits (at most
10 s) for the root device (``root=``, default /dev/vda), mounts it read-write
on /newroot (``noinit_itable``: a sandbox's disk reads as zeros where it was
never written, so the kernel need not zero the inode tables the boot's
``grow_root`` adds), mounts a tmpfs on /newroot/usr/lib/hangar/python and
copies its own Python files there (nothing written to the disk), moves /dev,
/proc and /sys into the new root (so devtmpfs stays mounted), mounts
/dev/pts, /dev/shm, /run, /tmp and /sys/fs/cgroup there, brings ``lo`` up,
writes the uptime at which it began to /run/hangar/boot (the boot's phases:
``hangar.guest.paths.BOOT_MARKS``), and ``switch_root``s to ``python3 -S``
importing ``hangar.guest.init`` and calling its ``main()``:
``/usr/lib/hangar/runtime/bin/python3`` when the image carries Hangar's
runtime (``hangar.images.runtime``), else ``/usr/bin/python3``.
On any failure it prints ``hangar-initramfs: FATAL: ...`` and powers off.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import io
import logging
import marshal
import os
import platform
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import hangar
from hangar.errors import ImageError
from hangar.guest import paths
from hangar.privileged import beneath

log = logging.getLogger(__name__)

INITRAMFS_VERSION = 1
"""Bump when the initramfs layout changes in a way the inputs do not show."""

BUSYBOX = Path("/bin/busybox")

MODULES: tuple[str, ...] = (
    "virtio_mmio",                  # the transport of QEMU microvm and Firecracker
    "virtio_blk",
    "virtio_console",               # virtio-serial: the agent channel under QEMU
    "virtio_rng",                   # file virtio-rng.ko
    "virtio_balloon",               # free page reporting: freed guest memory returns to the host
    "virtio_net",                   # only with hangar.net=
    "vmw_vsock_virtio_transport",   # only with hangar.channel=vsock (Firecracker's channel)
    "overlay",                      # only with hangar.overlay=: read-only root + writable drive
)
"""Modules in the initramfs; dependencies (virtio, virtio_ring, vsock...) are added."""
ON_DEMAND: dict[str, str] = {
    "hangar.net": "virtio_net",
    "hangar.channel": "vmw_vsock_virtio_transport",
    "hangar.overlay": "overlay",
}
"""Modules loaded only when the kernel command line holds that option: each module
loaded costs its signature check and its init, some tens of ms under TCG."""

GUEST_PYTHON_DIR = paths.PYTHON_DIR
"""Where the guest's Python files live in the running guest (its PYTHONPATH)."""
RUNTIME_DIR = paths.RUNTIME_DIR
"""Hangar's own Python runtime in images that bring it (``hangar.images.runtime``)."""

INIT_SCRIPT = r"""#!/bin/sh
# hangar initramfs /init (busybox sh); see hangar.images.initramfs.
export PATH=/bin
set -f
KVER='@KVER@'
MODULES='@MODULES@'
PYDIR='@PYDIR@'
RUNTIME='@RUNTIME@'

die() {
    echo "hangar-initramfs: FATAL: $*"
    echo "hangar-initramfs: powering off"
    sync
    poweroff -f
    sleep 2
    exit 1
}

mount -t proc proc /proc || die "cannot mount /proc"
read -r BEGAN _ < /proc/uptime
mount -t sysfs sysfs /sys || die "cannot mount /sys"
mount -t devtmpfs devtmpfs /dev || die "cannot mount devtmpfs on /dev"

ROOT=/dev/vda
FSTYPE=ext4
PROBE=0
OVERLAY=
for arg in $(cat /proc/cmdline); do
    case "$arg" in
        hangar.probe=1) PROBE=1 ;;
        root=/dev/*) ROOT="${arg#root=}" ;;
        rootfstype=*) FSTYPE="${arg#rootfstype=}" ;;
        hangar.overlay=/dev/*) OVERLAY="${arg#hangar.overlay=}" ;;
    esac
    case "${arg%%=*}" in
@ON_DEMAND@
    esac
done

if [ "$PROBE" = 1 ]; then
    echo HANGAR-PROBE-OK
    poweroff -f
    die "poweroff failed"
fi

modprobe -a $MODULES || echo "hangar-initramfs: warning: could not load all of: $MODULES"

i=0
while [ ! -b "$ROOT" ]; do
    i=$((i + 1))
    [ $i -gt 200 ] && die "root device $ROOT did not appear within 10 s"
    sleep 0.05
done

if [ -n "$OVERLAY" ]; then
    # Read-only image below, the sandbox's own writable drive above (Firecracker).
    i=0
    while [ ! -b "$OVERLAY" ]; do
        i=$((i + 1))
        [ $i -gt 200 ] && die "overlay device $OVERLAY did not appear within 10 s"
        sleep 0.05
    done
    mkdir -p /lower /rw
    mount -t "$FSTYPE" -o ro "$ROOT" /lower || die "cannot mount $ROOT read-only"
    mount -t ext4 -o rw "$OVERLAY" /rw || die "cannot mount $OVERLAY"
    mkdir -p /rw/upper /rw/work
    mount -t overlay overlay -o lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work /newroot \
        || die "cannot mount the overlay root"
else
    OPTS=rw
    [ "$FSTYPE" = ext4 ] && OPTS=rw,noinit_itable
    mount -t "$FSTYPE" -o "$OPTS" "$ROOT" /newroot || die "cannot mount $ROOT ($FSTYPE) on /newroot"
fi
# Hangar's own runtime when the image carries it (images imported from OCI), else the image's.
PY=/usr/bin/python3
[ -x "/newroot$RUNTIME/bin/python3" ] && PY="$RUNTIME/bin/python3"
[ -x "/newroot$PY" ] || die "$ROOT has no $PY"
mkdir -p "/newroot$PYDIR" && mount -t tmpfs -o mode=0755 hangar-python "/newroot$PYDIR" \
    && cp -a /hangar/python/. "/newroot$PYDIR/" \
    || die "cannot install the guest's Python files into $PYDIR"
for d in dev proc sys; do
    mkdir -p "/newroot/$d"
    mount -o move "/$d" "/newroot/$d" || die "cannot move /$d into the new root"
done
# The rest of the guest init's mounts, here because busybox is quicker than
# importing ctypes in Python under TCG; the guest init mounts whatever is missing.
R=/newroot
mkdir -p $R/dev/pts $R/dev/shm $R/run $R/tmp
mount -t devpts -o nosuid,noexec,gid=5,mode=0620,ptmxmode=0666 devpts $R/dev/pts
mount -t tmpfs -o nosuid,nodev,mode=1777 tmpfs $R/dev/shm
mount -t tmpfs -o nosuid,nodev,mode=0755 tmpfs $R/run
mount -t tmpfs -o nosuid,nodev,mode=1777 tmpfs $R/tmp
# favordynmods (Linux 6.0+): the agent moves itself into each command's cgroup and back
# around its spawn, and without it each move may wait for an RCU grace period (13 ms
# under TCG against 2, hangar.guest.limits); an older kernel mounts without it
mount -t cgroup2 -o nosuid,nodev,noexec,relatime,favordynmods cgroup2 $R/sys/fs/cgroup \
    2>/dev/null || mount -t cgroup2 -o nosuid,nodev,noexec,relatime cgroup2 $R/sys/fs/cgroup
ip link set lo up
mkdir -p $R@RUNDIR@ && echo "initramfs $BEGAN" > $R@BOOTMARKS@
# Import the guest init from its .pyc (running init.py as a script would
# compile it first: about 0.1 s under TCG).
exec switch_root /newroot "$PY" -S -c \
    "import sys; sys.path[0] = '$PYDIR'; import hangar.guest.init as m; m.main()"
die "switch_root failed"
"""


def package_dir() -> Path:
    """The ``hangar`` package directory these sources come from."""
    return Path(hangar.__file__).resolve().parent


def guest_sources(pkg: Path | None = None) -> dict[str, bytes]:
    """The guest's Python files: path inside the initramfs' python dir → content.

    ``hangar/__init__.py`` and every ``*.py`` under ``hangar/guest/``, which
    holds exactly what runs in the guest (so an agent split over several
    modules travels whole), and its ``*.c`` files: ``build_initrd`` puts what
    they compile to in their place (``native_build``).
    ``hangar/guest/init.py`` and ``protocol.py`` must exist; ``agent.py`` may not yet.
    """
    pkg = pkg or package_dir()
    files: dict[str, bytes] = {"hangar/__init__.py": (pkg / "__init__.py").read_bytes()}
    for p in sorted([*(pkg / "guest").rglob("*.py"), *(pkg / "guest").glob("*.c")]):
        rel = p.relative_to(pkg / "guest")
        if "__pycache__" in rel.parts:
            continue
        files[f"hangar/guest/{rel.as_posix()}"] = p.read_bytes()
    for need in ("hangar/guest/__init__.py", "hangar/guest/init.py", "hangar/guest/protocol.py"):
        if need not in files:
            raise ImageError(f"guest file {need} is missing from {pkg}", step="initramfs")
    return files


def native_toolchain() -> str:
    """What ``native_build`` compiles with: the C compiler's path and Python's include
    folder, or "" where either is missing or the host is not x86-64 (then the guest
    starts commands with ``posix_spawn``; ``hangar.guest.spawn``). Part of the initrd's
    tag, so installing a compiler later rebuilds the initramfs."""
    cc = shutil.which("cc") or shutil.which("gcc")
    include = sysconfig.get_paths().get("include") or ""
    if platform.machine() != "x86_64" or cc is None or not os.path.isfile(
            os.path.join(include, "Python.h")):
        return ""
    return f"{cc}\0{include}"


def native_build(source: bytes, name: str) -> bytes | None:
    """``source`` (C, Python's limited API for 3.11) compiled into an extension module
    (``<name>.abi3.so``), or None where there is no toolchain (``native_toolchain``) or
    the compiler fails (its output goes to the log). About half a second, once per
    initramfs."""
    toolchain = native_toolchain()
    if not toolchain:
        return None
    cc, include = toolchain.split("\0")
    with tempfile.TemporaryDirectory(prefix="hangar-native-") as d:
        src, out = os.path.join(d, f"{name}.c"), os.path.join(d, f"{name}.abi3.so")
        with open(src, "wb") as f:
            f.write(source)
        try:
            done = subprocess.run(
                [cc, "-O2", "-shared", "-fPIC", "-Wall", f"-I{include}",
                 "-Wl,--build-id=none", "-o", out, src],
                capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.SubprocessError) as e:
            log.warning("initramfs: cannot compile %s: %s", name, e)
            return None
        if done.returncode != 0:
            log.warning("initramfs: %s did not compile (%s): %s", name, cc,
                        done.stderr.strip()[-2000:])
            return None
        with open(out, "rb") as f:
            return f.read()


def render_init(kernel_version: str) -> str:
    always = [m for m in MODULES if m not in ON_DEMAND.values()]
    on_demand = "\n".join(f'        {opt}) MODULES="$MODULES {mod}" ;;'
                          for opt, mod in ON_DEMAND.items())
    return (INIT_SCRIPT.replace("@KVER@", kernel_version)
            .replace("@MODULES@", " ".join(always))
            .replace("@ON_DEMAND@", on_demand)
            .replace("@PYDIR@", GUEST_PYTHON_DIR).replace("@RUNTIME@", RUNTIME_DIR)
            .replace("@RUNDIR@", paths.RUN_DIR).replace("@BOOTMARKS@", paths.BOOT_MARKS))


def initrd_tag(sources: Mapping[str, bytes], kernel_version: str, *,
               python_version: str | None = None, busybox: Path = BUSYBOX) -> str:
    """12 hex digits naming the initramfs built from these inputs."""
    h = hashlib.sha256()
    h.update(f"v{INITRAMFS_VERSION}\0{kernel_version}\0{' '.join(MODULES)}\0".encode())
    h.update(f"{python_version if _can_precompile(python_version) else ''}\0".encode())
    if any(p.endswith(".c") for p in sources):
        h.update(f"{native_toolchain()}\0".encode())
    h.update(render_init(kernel_version).encode() + b"\0")
    for path in sorted(sources):
        h.update(path.encode() + b"\0" + hashlib.sha256(sources[path]).digest())
    try:
        h.update(hashlib.sha256(busybox.read_bytes()).digest())
    except OSError as e:
        raise ImageError(f"cannot read {busybox} (install busybox-static): {e}",
                         step="initramfs") from e
    return h.hexdigest()[:12]


def _can_precompile(python_version: str | None) -> bool:
    return python_version == f"{sys.version_info.major}.{sys.version_info.minor}"


def _pyc(source: bytes, guest_path: str) -> bytes | None:
    """An unchecked-hash .pyc of ``source`` (the guest never edits these files), or None."""
    try:
        code = compile(source, guest_path, "exec", dont_inherit=True)
    except (SyntaxError, ValueError):
        return None  # the guest will report it when it imports the module
    flags = (0b01).to_bytes(4, "little")  # hash-based, check_source off
    return importlib.util.MAGIC_NUMBER + flags + importlib.util.source_hash(source) + marshal.dumps(code)


# ---------------------------------------------------------------------------------------------
# modules


def _mod_name(path: str) -> str:
    base = path.rsplit("/", 1)[-1]
    for ext in (".ko", ".ko.xz", ".ko.zst", ".ko.gz"):
        if base.endswith(ext):
            base = base[: -len(ext)]
            break
    return base.replace("-", "_")


def module_closure(modules_dir: Path, wanted: Iterable[str] = MODULES) -> tuple[list[str], list[str]]:
    """Resolve ``wanted`` through ``modules.dep``.

    Returns (relative .ko paths in load order, wanted names that are built in).
    Raises ``ImageError`` for a module that is neither a file nor built in.
    """
    dep_text = _read_text(modules_dir, "modules.dep")
    deps: dict[str, list[str]] = {}
    by_name: dict[str, str] = {}
    for line in dep_text.splitlines():
        if ":" not in line:
            continue
        mod, rest = line.split(":", 1)
        deps[mod] = rest.split()
        by_name[_mod_name(mod)] = mod
    builtin = {_mod_name(x) for x in (_read(modules_dir, "modules.builtin") or b"").decode(
        errors="replace").split()}
    order: list[str] = []
    seen: set[str] = set()

    def visit(path: str) -> None:
        if path in seen:
            return
        seen.add(path)
        for d in deps.get(path, []):
            visit(d)
        order.append(path)

    built_in: list[str] = []
    for name in wanted:
        key = name.replace("-", "_")
        if key in by_name:
            visit(by_name[key])
        elif key in builtin:
            built_in.append(name)
        else:
            raise ImageError(f"kernel module {name} is neither in modules.dep nor built in",
                             step="initramfs", module=name)
    return order, built_in


def _read(modules_dir: Path, rel: str) -> bytes | None:
    """The regular file ``rel`` below the folder ``modules_dir``, None when missing. Opened
    without following a link below that folder: root may build an initramfs from a build
    folder that a split server owns (``staging.image_at``). Raises OSError (ELOOP)."""
    top = os.open(modules_dir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = beneath.walk(top, rel)
    except FileNotFoundError:
        return None
    finally:
        os.close(top)
    with os.fdopen(fd, "rb") as f:
        return f.read()


def _read_text(modules_dir: Path, rel: str) -> str:
    """``_read`` of a file that must be there, as text. Raises OSError."""
    data = _read(modules_dir, rel)
    if data is None:
        raise FileNotFoundError(2, "no such file", str(modules_dir / rel))
    return data.decode(errors="replace")


def _filtered(text: str, keep: set[str], key: Callable[[str], str]) -> bytes:
    return "".join(line + "\n" for line in text.splitlines() if key(line) in keep).encode()


# ---------------------------------------------------------------------------------------------
# cpio


class _Cpio:
    """A minimal newc ("070701") cpio writer: dirs, files, symlinks, char devices."""

    def __init__(self, out: io.BufferedIOBase, mtime: int) -> None:
        self.out = out
        self.mtime = mtime
        self.ino = 1
        self.dirs: set[str] = {""}

    def _entry(self, name: str, mode: int, data: bytes = b"", nlink: int = 1,
               rdev: tuple[int, int] = (0, 0)) -> None:
        nb = name.encode() + b"\0"
        fields = (self.ino, mode, 0, 0, nlink, self.mtime, len(data), 0, 0, rdev[0], rdev[1],
                  len(nb), 0)
        self.ino += 1
        hdr = b"070701" + b"".join(b"%08X" % f for f in fields) + nb
        self.out.write(hdr + b"\0" * (-len(hdr) % 4))
        self.out.write(data + b"\0" * (-len(data) % 4))

    def dir(self, name: str, mode: int = 0o755) -> None:
        name = name.strip("/")
        if name in self.dirs:
            return
        parent = name.rpartition("/")[0]
        self.dir(parent)
        self.dirs.add(name)
        self._entry(name, stat.S_IFDIR | mode, nlink=2)

    def file(self, name: str, data: bytes, mode: int = 0o644) -> None:
        name = name.strip("/")
        self.dir(name.rpartition("/")[0])
        self._entry(name, stat.S_IFREG | mode, data)

    def symlink(self, name: str, target: str) -> None:
        name = name.strip("/")
        self.dir(name.rpartition("/")[0])
        self._entry(name, stat.S_IFLNK | 0o777, target.encode())

    def chardev(self, name: str, major: int, minor: int, mode: int = 0o600) -> None:
        name = name.strip("/")
        self.dir(name.rpartition("/")[0])
        self._entry(name, stat.S_IFCHR | mode, rdev=(major, minor))

    def close(self) -> None:
        self._entry("TRAILER!!!", 0)


def _applets(busybox: Path) -> list[str]:
    try:
        out = subprocess.run([str(busybox), "--list"], capture_output=True, text=True, check=True,
                             timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise ImageError(f"cannot run {busybox} --list (install busybox-static): {e}",
                         step="initramfs") from e
    return [a for a in out.split() if a and "/" not in a and a != "busybox"]


def build_initrd(dest: Path, *, modules_dir: Path, kernel_version: str,
                 sources: Mapping[str, bytes], python_version: str | None = None,
                 busybox: Path = BUSYBOX) -> int:
    """Write the initramfs to ``dest`` (atomically) and return its size in bytes.

    ``modules_dir`` is the kernel's ``lib/modules/<kernel_version>`` tree;
    ``python_version`` (``"3.11"``) is the guest's, to decide on .pyc files.
    """
    modpaths, _ = module_closure(modules_dir)
    keep = set(modpaths)
    buf = io.BytesIO()
    c = _Cpio(buf, int(time.time()))
    for d in ("bin", "dev", "proc", "sys", "newroot", "run", "tmp", "etc"):
        c.dir(d)
    c.symlink("sbin", "bin")
    c.chardev("dev/console", 5, 1)
    c.chardev("dev/null", 1, 3, 0o666)
    c.file("init", render_init(kernel_version).encode(), 0o755)
    try:
        c.file("bin/busybox", busybox.read_bytes(), 0o755)
    except OSError as e:
        raise ImageError(f"cannot read {busybox} (install busybox-static): {e}",
                         step="initramfs") from e
    for a in _applets(busybox):
        c.symlink(f"bin/{a}", "busybox")
    c.file("etc/hostname", b"hangar\n")

    mroot = f"lib/modules/{kernel_version}"
    for rel in modpaths:
        data = _read(modules_dir, rel)
        if data is None:
            raise FileNotFoundError(2, "no such file", str(modules_dir / rel))
        c.file(f"{mroot}/{rel}", data)
    dep_text = _read_text(modules_dir, "modules.dep")
    c.file(f"{mroot}/modules.dep", _filtered(dep_text, keep, lambda ln: ln.split(":", 1)[0]))
    names = {_mod_name(p) for p in modpaths}
    # "alias <pattern> <module>" and "softdep <module> pre: ... post: ..." lines
    for idx, field in (("modules.alias", -1), ("modules.symbols", -1), ("modules.softdep", 1)):
        got = _read(modules_dir, idx)
        if got is not None:
            c.file(f"{mroot}/{idx}", _filtered(
                got.decode(errors="replace"), names,
                lambda ln, i=field: ln.split()[i] if len(ln.split()) > 2 else ""))
    order = _read(modules_dir, "modules.order")
    if order is not None:
        c.file(f"{mroot}/modules.order",
               _filtered(order.decode(errors="replace"), keep, lambda ln: ln))
    builtin = _read(modules_dir, "modules.builtin")
    if builtin is not None:
        c.file(f"{mroot}/modules.builtin", builtin)

    precompile = _can_precompile(python_version)
    tag = sys.implementation.cache_tag
    for rel in sorted(sources):
        if rel.endswith(".c"):  # the guest gets what it compiles to, when it does
            d, _, fname = rel.rpartition("/")
            built = native_build(sources[rel], fname[:-2])
            if built is not None:
                c.file(f"hangar/python/{d}/{fname[:-2]}.abi3.so", built, 0o755)
            continue
        c.file(f"hangar/python/{rel}", sources[rel])
        if precompile and rel.endswith(".py"):
            pyc = _pyc(sources[rel], f"{GUEST_PYTHON_DIR}/{rel}")
            if pyc is not None:
                d, _, fname = rel.rpartition("/")
                c.file(f"hangar/python/{d}/__pycache__/{fname[:-3]}.{tag}.pyc", pyc)
    c.close()

    data = gzip.compress(buf.getvalue(), compresslevel=6, mtime=0)
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    try:
        # a new file of this process's own, never a link or file someone put there first
        # (root may add an initramfs to a build folder that a split server owns)
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                          | os.O_CLOEXEC, 0o644), "wb") as out:
            out.write(data)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return len(data)
