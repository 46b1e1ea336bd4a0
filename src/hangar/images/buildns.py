"""Run one command in an image tree inside namespaces of its own (standard library only).

Started by ``hangar.images.confined`` as ``python3 buildns.py SPEC`` (SPEC names a JSON file:
``root``, ``uid_base``, ``uid_count``, ``argv``, ``env``, ``cwd``, ``network``,
``hostname``), as host root. What the command gets:

* a **user namespace** whose ids 0..``uid_count``-1 are host ids ``uid_base``..:
  root in it is an unprivileged host user (no host uid or gid, not even group 0,
  is mapped), so it holds no capability over anything of the host's, and
  ``/proc/sys`` files answer it as they answer any other user;
* a **mount namespace** whose root is the tree (``pivot_root``, the host's tree
  detached: a chroot escape finds nothing), with a **private /proc** of its
  own PID namespace (``/proc/sys`` read-only besides), a **minimal /dev**
  (a tmpfs with the host's null, zero, full, random, urandom and tty bound in,
  ``/dev/fd`` and ``/dev/std*`` links, ``/dev/shm`` and a new ``/dev/pts``), no
  ``/sys``;
* a **PID namespace** whose PID 1 is this script: when the command ends, every
  process it left (a daemon a package's script started) is killed with it;
* new **IPC** and **UTS** namespaces, and a new **network namespace** with only
  a loopback unless ``network`` is true (then the host's network is shared:
  the command can reach what the host reaches, loopback services included);
* ``no_new_privs``.

The tree's files must already be owned by the mapped ids (``confined.shift``).
Exit status: the command's (128+N for a signal), 125 when the set-up failed
(its reason on stderr).
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import socket
import struct
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
SYS_PIVOT_ROOT = 155  # x86-64
PR_SET_NO_NEW_PRIVS = 38
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
SETUP_FAILED = 125

_libc = ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def _mount(src: str | None, target: str, fstype: str | None, flags: int,
           data: str | None = None) -> None:
    _check(_libc.mount(src and src.encode(), target.encode(), fstype and fstype.encode(),
                       ctypes.c_ulong(flags), data and data.encode()),
           f"mount {fstype or src} on {target}")


def _dir_fd(root_fd: int, path: str) -> int:
    """An O_PATH descriptor of the real folder ``path`` in the tree: no component may be a
    symlink (``confined.shifted`` made them real folders before)."""
    fd = os.dup(root_fd)
    for name in [p for p in path.split("/") if p]:
        try:
            nxt = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY, dir_fd=fd)
        finally:
            os.close(fd)
        fd = nxt
    return fd


def _at(fd: int) -> str:
    return f"/proc/self/fd/{fd}"


def _setup(spec: dict) -> None:
    """Mounts, host name, loopback and pivot_root, as PID 1 of the new namespaces (still
    host root: the mounts belong to the host's user namespace, so root in the build's
    cannot undo or add any)."""
    root = spec["root"]
    _check(_libc.unshare(CLONE_NEWNS), "unshare the mount namespace")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount(root, root, None, MS_BIND)
    root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW)
    proc = _dir_fd(root_fd, "proc")
    _mount("proc", _at(proc), "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.close(proc)
    sysctl = _dir_fd(root_fd, "proc/sys")
    _mount(_at(sysctl), _at(sysctl), None, MS_BIND)
    os.close(sysctl)
    sysctl = _dir_fd(root_fd, "proc/sys")  # the bind mount now
    _mount(None, _at(sysctl), None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV
           | MS_NOEXEC)
    os.close(sysctl)
    dev = _dir_fd(root_fd, "dev")
    _mount("tmpfs", _at(dev), "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=755,size=1m")
    os.close(dev)
    dev = _dir_fd(root_fd, "dev")  # the tmpfs now
    for name in DEVICES:
        os.close(os.open(name, os.O_CREAT | os.O_WRONLY | os.O_NOFOLLOW, 0o666, dir_fd=dev))
        node = os.open(name, os.O_PATH | os.O_NOFOLLOW, dir_fd=dev)
        _mount(f"/dev/{name}", _at(node), None, MS_BIND)
        os.close(node)
    for link, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2"),
                         ("ptmx", "pts/ptmx")):
        os.symlink(target, link, dir_fd=dev)
    for sub, fstype, data in (("shm", "tmpfs", "mode=1777,size=64m"),
                              ("pts", "devpts", "newinstance,ptmxmode=0666,mode=620")):
        os.mkdir(sub, 0o755, dir_fd=dev)
        fd = os.open(sub, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dev)
        try:
            _mount(fstype, _at(fd), fstype, MS_NOSUID | MS_NOEXEC, data)
        except OSError:
            pass  # a build runs without ptys if the kernel refuses
        os.close(fd)
    os.close(dev)
    hostname = spec.get("hostname", "hangar-build").encode()
    _check(_libc.sethostname(hostname, len(hostname)), "sethostname")
    if not spec.get("network"):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            fcntl.ioctl(s, 0x8914, struct.pack("16sh", b"lo", 0x1 | 0x8 | 0x40))  # up
    os.fchdir(root_fd)
    os.close(root_fd)
    _check(_libc.syscall(SYS_PIVOT_ROOT, b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", MNT_DETACH), "detach the host's tree")
    os.chdir("/")


def _init(spec: dict, up_w: int, go_r: int) -> int:
    """PID 1: set up (as host root), enter the user namespace, run the command, reap
    orphans until it ends; return its status."""
    _setup(spec)
    _check(_libc.unshare(CLONE_NEWUSER), "unshare the user namespace")
    os.write(up_w, b"u")
    if os.read(go_r, 1) != b"g":
        return SETUP_FAILED
    os.setgroups([])
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    pid = os.fork()
    if pid == 0:
        try:
            os.chdir(spec.get("cwd") or "/")
            os.execve(spec["argv"][0], spec["argv"], spec["env"])
        except OSError as e:
            print(f"hangar build step: cannot run {spec['argv'][0]}: {e}", file=sys.stderr)
        os._exit(127)
    while True:
        done, status = os.wait()
        if done == pid:
            return _code(status)


def _code(status: int) -> int:
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


def main() -> int:
    """As host root: new mount, PID, UTS, IPC (and network) namespaces; their PID 1
    mounts the tree's root, then makes the user namespace, whose id maps this process
    writes."""
    with open(sys.argv[1], "rb") as f:
        spec = json.loads(f.read(1 << 22))
    flags = CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS  # the mount namespace: PID 1's own
    if not spec.get("network"):
        flags |= CLONE_NEWNET
    _check(_libc.unshare(flags), "unshare")
    up_r, up_w = os.pipe()
    go_r, go_w = os.pipe()
    init = os.fork()
    if init == 0:
        os.close(up_r)
        os.close(go_w)
        try:
            code = _init(spec, up_w, go_r)
        except BaseException as e:  # noqa: BLE001 - reported, then the set-up fails
            print(f"hangar build step: set-up failed: {e}", file=sys.stderr)
            code = SETUP_FAILED
        sys.stderr.flush()
        os._exit(code)
    os.close(up_w)
    os.close(go_r)
    if os.read(up_r, 1) == b"u":
        line = f"0 {int(spec['uid_base'])} {int(spec['uid_count'])}\n".encode()
        for name in ("uid_map", "gid_map"):
            with open(f"/proc/{init}/{name}", "wb") as f:
                f.write(line)
        os.write(go_w, b"g")
    os.close(go_w)
    _, status = os.waitpid(init, 0)
    return _code(status)


if __name__ == "__main__":
    sys.exit(main())
