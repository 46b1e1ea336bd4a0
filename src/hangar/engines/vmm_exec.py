"""Start one VMM confined: cgroup, private view of the filesystem, own user, then exec.

Run as a script by ``hangar.engines.process.VMMProcesses.spawn`` (as root),
never imported by the server at run time: it uses the standard library
only and starts in a few milliseconds (``python3 -S -E``)::

    python3 -S -E vmm_exec.py '<plan as JSON>' -- /usr/bin/qemu-system-x86_64 ...

Steps, in this order (each failure prints ``vmm_exec: <step>: <reason>`` on
stderr, which is the sandbox's ``vmm.log``, and exits 126):

1. ``cgroups``: write its own pid to ``cgroup.procs`` of each directory, so
   the VMM's every page and thread counts from its first instruction.
2. ``rlimits``: ``RLIMIT_CORE`` 0 (a VMM's core would hold guest memory) and
   ``RLIMIT_FSIZE`` (no file it writes grows past it). ``netns``: enter
   that network namespace (a path such as ``/run/netns/NAME``). ``tap``: open the
   existing TAP device (of the network namespace it was started in) as
   the given file descriptor, since the VMM may not open ``/dev/net/tun``.
3. ``pidns`` (with ``pid_ns``): a new pid namespace, then ``fork``: the
   child is its pid 1 and goes on; this process writes the child's pid (as
   the host sees it) and a newline to ``report_fd`` and exits 0. The VMM
   then sees no process of the host, and cannot signal any.
4. ``view``: new mount and IPC namespaces (and, with ``own_network``, a
   network namespace holding only a loopback that is down: a VMM whose NIC
   is a TAP it was handed, or that has none, needs no network of the
   host's), the mount namespace's root an empty tmpfs mounted on
   ``root``: the ``binds`` (read-only unless marked), the host's
   ``/usr``-merged symlinks, and ``/dev`` with only the listed character
   devices, made for the VMM's user (as Firecracker's jailer makes
   ``/dev/kvm``); then ``pivot_root`` into it and the old root detached, and
   the tmpfs made read-only. Paths keep their host names, so the VMM's argv
   is the same with or without a view.
5. ``user``: no supplementary groups but ``groups``, then ``gid`` and
   ``uid`` (real, effective and saved), and ``PR_SET_NO_NEW_PRIVS``.
6. ``exec``: ``cwd``, then ``execv`` of the argv after ``--`` (it keeps the
   pid: without ``pid_ns`` the VMM's pid is the one the server started,
   with it the one written to ``report_fd``).

The plan (``hangar.engines.confine.Plan.to_json``) has the keys ``cgroups``
(list of directories), ``rlimits`` (``{"FSIZE": bytes}``), ``root`` (a
directory, or null for no view), ``binds`` (``[src, dst, writable]``),
``symlinks`` (``[path, target]``), ``devices`` (``[name, major, minor]``),
``own_network`` (bool), ``netns`` (a path or null), ``tap`` (``[device, fd]`` or null),
``uid``, ``gid``, ``groups`` (null: keep the caller's identity), ``cwd``,
``pid_ns`` (bool), ``report_fd`` (a file descriptor number, with ``pid_ns``),
``umask`` (the VMM's, or null: keep it) and ``same`` (``{bind target: path}``: the
bound folder must be the very one ``path`` names, same device and inode: the root
helper's ``/proc/<pid>/fd/<n>`` of a folder it opened itself).

The view's root and the bind sources may be names in a folder the server's user
can write; they are resolved once each, and checked after: the working directory
becomes the tmpfs just mounted (``enter_view_root``, everything after relative to
it) and each bind of ``same`` is compared with the folder the helper opened. A path
of the view (a bind target, a symlink, a device) must be plain (no empty, ``.`` or
``..`` name: a ``..`` from the tmpfs's root would climb into the host's tree) and is
made one name at a time with ``O_NOFOLLOW`` relative to the tmpfs's descriptors.
"""

import ctypes
import fcntl
import json
import os
import resource
import socket
import stat
import struct
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWNET = 0x40000000
CLONE_NEWPID = 0x20000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MNT_DETACH = 2
PR_SET_NO_NEW_PRIVS = 38
TUNSETIFF = 0x400454CA
IFF_TAP, IFF_NO_PI, IFF_VNET_HDR = 0x0002, 0x1000, 0x4000
SYS_PIVOT_ROOT = 155  # x86_64

_libc = ctypes.CDLL(None, use_errno=True)


class Failed(Exception):
    """A step failed; the message names the step and the reason."""


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise Failed(f"{what}: {os.strerror(err)}")


def _mount(src: str | None, dst: str, fstype: str | None, flags: int, data: str | None = None,
           what: str = "mount") -> None:
    _check(_libc.mount(src.encode() if src else None, dst.encode(),
                       fstype.encode() if fstype else None, ctypes.c_ulong(flags),
                       data.encode() if data else None), f"{what} {dst}")


def join_cgroups(dirs: list[str]) -> None:
    for d in dirs:
        try:
            with open(os.path.join(d, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
        except OSError as exc:
            raise Failed(f"cgroups: cannot join {d}: {exc.strerror}") from None


def set_rlimits(limits: dict[str, int]) -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if "FSIZE" in limits:
        n = int(limits["FSIZE"])
        resource.setrlimit(resource.RLIMIT_FSIZE, (n, n))


def enter_netns(path: str) -> None:
    """Move into the network namespace bound at ``path`` (``ip netns`` names them)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise Failed(f"netns: {path}: {exc.strerror}") from None
    try:
        _check(_libc.setns(fd, CLONE_NEWNET), f"netns: enter {path}")
    finally:
        os.close(fd)


def open_tap(name: str, fd_number: int) -> None:
    """Open the existing TAP ``name`` of this network namespace as ``fd_number``."""
    try:
        socket.if_nametoindex(name)  # never create one: TUNSETIFF would
    except OSError:
        raise Failed(f"tap: no device {name} here") from None
    try:
        os.fstat(fd_number)
    except OSError:
        pass
    else:
        raise Failed(f"tap: file descriptor {fd_number} is taken")
    try:
        fd = os.open("/dev/net/tun", os.O_RDWR)
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(),
                                               IFF_TAP | IFF_NO_PI | IFF_VNET_HDR))
    except OSError as exc:
        raise Failed(f"tap: cannot open {name}: {exc.strerror}") from None
    if fd != fd_number:
        os.dup2(fd, fd_number)
        os.close(fd)
    os.set_inheritable(fd_number, True)


VIEW_TMPFS = "mode=0755,size=1m,nr_inodes=4096"
VIEW_BYTES, VIEW_INODES = 1 << 20, 4096


def _names(path: str) -> list[str]:
    """The names of the view's path ``path``: absolute, with no empty, ``.`` or ``..``
    name (a ``..`` from the tmpfs's root climbs into the host's tree, where the server's
    symlinks are). Raises Failed."""
    names = path.split("/")[1:]
    if not path.startswith("/") or any(n in ("", ".", "..") for n in names):
        raise Failed(f"view: {path!r} is not a plain absolute path")
    return names


def _inside(path: str) -> str:
    """``path`` of the view, relative to the working directory (the view's tmpfs)."""
    return "./" + "/".join(_names(path))


DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _folder(names: list[str]) -> int:
    """The folder ``names`` of the view (below the working directory, its tmpfs), each
    name made if missing and opened with ``O_NOFOLLOW`` relative to the one before: never
    a symlink, never outside the view. The caller closes it. Raises Failed."""
    fd = os.open(".", DIR_FLAGS)
    try:
        for name in names:
            try:
                os.mkdir(name, 0o755, dir_fd=fd)
            except FileExistsError:
                pass
            nxt = os.open(name, DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nxt
    except OSError as exc:
        os.close(fd)
        raise Failed(f"view: cannot make /{'/'.join(names)}: {exc.strerror}") from None
    return fd


def make_target(path: str, is_dir: bool) -> str:
    """Make the bind target ``path`` of the view (a folder, or an empty regular file),
    through descriptors of the tmpfs; returns its name relative to the working directory.
    Raises Failed."""
    names = _names(path)
    fd = _folder(names if is_dir else names[:-1])
    try:
        if not is_dir:
            try:
                f = os.open(names[-1], os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                            | os.O_NOCTTY | os.O_CLOEXEC, 0o644, dir_fd=fd)
            except OSError as exc:
                raise Failed(f"view: cannot make {path}: {exc.strerror}") from None
            try:
                if not stat.S_ISREG(os.fstat(f).st_mode):
                    raise Failed(f"view: {path} is not a regular file")
            finally:
                os.close(f)
    finally:
        os.close(fd)
    return _inside(path)


def enter_view_root(root: str) -> None:
    """Make the working directory the tmpfs just mounted on ``root``, checked after
    opening: the folder ``root`` names may lie in a folder the server's user can write
    (its sandbox folder), so the name is resolved once and what it gave must be that
    tmpfs (its size and inode count, empty); everything after is relative to it, never
    through ``root`` again."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        st = os.fstatvfs(fd)
        if (st.f_blocks * st.f_frsize != VIEW_BYTES or st.f_files != VIEW_INODES
                or os.listdir(fd)):
            raise Failed(f"view: {root} is not the view's own tmpfs")
        os.fchdir(fd)
    finally:
        os.close(fd)


def make_view(plan: dict) -> None:
    root = plan["root"]
    uid, gid = plan.get("uid"), plan.get("gid")
    flags = CLONE_NEWNS | CLONE_NEWIPC | (CLONE_NEWNET if plan.get("own_network") else 0)
    _check(_libc.unshare(flags), "view: unshare")
    umask = os.umask(0o022)  # the view's folders must be traversable by the VMM's user
    _mount(None, "/", None, MS_REC | MS_PRIVATE, what="view: make private")
    _mount("tmpfs", root, "tmpfs", MS_NOSUID, VIEW_TMPFS, what="view: tmpfs on")
    enter_view_root(root)
    same = plan.get("same") or {}
    for src, dst, writable in plan.get("binds", []):
        _names(dst)  # refused before anything is made
        try:
            is_dir = stat.S_ISDIR(os.stat(src).st_mode)
        except OSError as exc:
            raise Failed(f"view: {src}: {exc.strerror}") from None
        target = make_target(dst, is_dir)
        _mount(src, target, None, MS_BIND | MS_REC, what="view: bind")
        if dst in same:  # checked after binding: the very folder the helper opened
            got, want = os.stat(target), os.stat(same[dst])
            if (got.st_dev, got.st_ino) != (want.st_dev, want.st_ino):
                raise Failed(f"view: {src} is not the folder that was opened (a symlink "
                             f"was put in its place)")
        flags = MS_BIND | MS_REMOUNT | MS_NOSUID | MS_NODEV | (0 if writable else MS_RDONLY)
        _mount(None, target, None, flags, what="view: remount")
    for path, target in plan.get("symlinks", []):
        names = _names(path)
        fd = _folder(names[:-1])
        try:
            os.symlink(target, names[-1], dir_fd=fd)
        except FileExistsError:
            pass
        finally:
            os.close(fd)
    for name, major, minor in plan.get("devices", []):
        names = _names("/dev/" + name)
        fd = _folder(names[:-1])
        try:
            os.mknod(names[-1], 0o600 | stat.S_IFCHR, os.makedev(major, minor), dir_fd=fd)
            if uid is not None:
                os.chown(names[-1], uid, gid, dir_fd=fd, follow_symlinks=False)
        except OSError as exc:
            raise Failed(f"view: mknod /dev/{name}: {exc.strerror}") from None
        finally:
            os.close(fd)
    _check(_libc.syscall(SYS_PIVOT_ROOT, b".", b"."), "view: pivot_root")
    _check(_libc.umount2(b".", MNT_DETACH), "view: detach the old root")
    os.chdir("/")
    _mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID, what="view: read-only root")
    os.umask(umask)


def new_pid_namespace(report_fd: int) -> None:
    """Fork into a new pid namespace; only the child (its pid 1) returns. The parent
    reports the child's host pid on ``report_fd`` and exits."""
    _check(_libc.unshare(CLONE_NEWPID), "pidns: unshare")
    pid = os.fork()
    if pid == 0:
        os.close(report_fd)
        return
    try:
        os.write(report_fd, f"{pid}\n".encode())
    finally:
        os._exit(0)


def drop_user(plan: dict) -> None:
    uid, gid = plan.get("uid"), plan.get("gid")
    if uid is not None:
        try:
            os.setgroups(list(plan.get("groups") or []))
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
        except OSError as exc:
            raise Failed(f"user: cannot become {uid}:{gid}: {exc.strerror}") from None
        if os.getuid() != uid or os.geteuid() != uid:
            raise Failed(f"user: still uid {os.geteuid()}")
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "user: no_new_privs")


def run(plan: dict, argv: list[str]) -> None:
    join_cgroups(plan.get("cgroups", []))
    set_rlimits(plan.get("rlimits", {}))
    if plan.get("netns"):
        enter_netns(plan["netns"])
    if plan.get("tap"):
        open_tap(plan["tap"][0], int(plan["tap"][1]))
    if plan.get("pid_ns"):  # before the view, whose /proc/self binds must be the VMM's
        new_pid_namespace(int(plan["report_fd"]))
    if plan.get("root"):
        make_view(plan)
    drop_user(plan)
    if plan.get("umask") is not None:
        os.umask(int(plan["umask"]))
    try:
        os.chdir(plan.get("cwd") or "/")
    except OSError as exc:
        raise Failed(f"exec: cwd {plan.get('cwd')}: {exc.strerror}") from None
    try:
        os.execv(argv[0], argv)
    except OSError as exc:
        raise Failed(f"exec: {argv[0]}: {exc.strerror}") from None


def main() -> None:
    if len(sys.argv) < 4 or sys.argv[2] != "--":
        print("usage: vmm_exec.py PLAN_JSON -- ARGV...", file=sys.stderr)
        sys.exit(2)
    try:
        run(json.loads(sys.argv[1]), sys.argv[3:])
    except Failed as exc:
        print(f"vmm_exec: {exc}", file=sys.stderr, flush=True)
        sys.exit(126)


if __name__ == "__main__":
    main()
