"""The root helper: the one process of ``hangar serve`` that keeps root.

``split(layout, confine, user, net, jail)``, called by ``hangar serve``
(``hangar.cli.serve``) as root before any thread starts and before uvicorn
parses a byte from the network:

1. a ``SOCK_SEQPACKET`` socketpair, then ``fork``: the child keeps root and
   runs ``run`` on its end (it closes the other);
2. the parent gives the data directory to ``user``
   (``hangar.privileged.split.hand_over``) and drops to it for good
   (``hangar.privileged.split.drop``);
3. it returns the helper's pid and the server's ``hangar.privileged.Client``,
   which the caller hands to the engine and the network manager it builds.

The helper (``Helper``) talks only over the inherited socketpair (no path on
the filesystem), one request at a time (``hangar.privileged.protocol``), and
ends when the server's end closes. It does only what the request table
names, each request checked twice: by its strict model, and here against
the host (a sandbox id names ``<data>/sandboxes/<id>``, a real folder; a
read-only folder lies under the images; a pid runs as a VMM uid; the VMM's
binary is QEMU's, and what confines it is the plan this helper made, never
one the server sent). VMMs it starts are its children (it is their
subreaper), reaped here.

Root acts only on what it opened itself (``hangar.privileged.beneath``): the
server owns the data directory and may swap any name in it for a symlink at
any moment, so the helper opens the data directory once, when it starts
(``data_fd``), and reaches a sandbox's folder or an image's folder from it
one name at a time with ``O_NOFOLLOW``, checking what it got after opening.
Every file operation then goes through that descriptor, and the processes
it starts (``vmm_exec``'s bind mounts, the VMM's working directory) name the
folder as ``/proc/<helper pid>/fd/<n>``: that very folder, whatever its name
became. The descriptors of a sandbox are held (``held``) until its release.

It sits beside ``hangar.server``, above the engines and the network whose
root halves it runs; ``hangar.privileged`` below them holds only the
protocol and the client, so no package imports its way back up here.
"""

from __future__ import annotations

import array
import errno
import fcntl
import json
import logging
import os
import select
import pwd
import shutil
import socket
import re
import resource
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from hangar.engines import memory, process
from hangar.engines.confine import Confinement, Plan, release_folder, remove_cgroup
from hangar.engines.process import VMMProcesses
from hangar.engines.qemu.argv import SECCOMP
from hangar.engines.qemu.template import VIEW_FDS
from hangar.images.confined import UID_BASE as BUILD_UID_BASE
from hangar.images.confined import UID_COUNT as BUILD_UID_COUNT
from hangar.errors import ConfigError, HangarError
from hangar.layout import Layout, SandboxPaths
from hangar.privileged import beneath
from hangar.privileged import protocol as P
from hangar.privileged.client import Client
from hangar.privileged.split import check_code, drop, hand_over

if TYPE_CHECKING:
    from collections.abc import Callable

    from hangar.engines.firecracker.hostjail import HostJail
    from hangar.images.pull import Pulls
    from hangar.net import NetworkManager

log = logging.getLogger("hangar.privileged")


class Refused(Exception):
    """A request that checks against the host refused; the message says why."""


def recv(sock: socket.socket) -> tuple[bytes, list[int]]:
    """One message and the descriptors that came with it (b"" at the end)."""
    fds = array.array("i")
    data, ancdata, flags, _ = sock.recvmsg(P.MAX_MESSAGE, socket.CMSG_LEN(P.MAX_FDS * fds.itemsize))
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        for fd in fds:
            os.close(fd)
        return b"\0", []  # never parses: answered as a bad request
    return data, list(fds)


class Helper:
    """The request handlers; ``confine`` is the server's confinement (as root) and
    ``owner_uid`` the unprivileged server's uid, which owns the sandbox folders."""

    def __init__(self, layout: Layout, confine: Confinement, owner_uid: int,
                 qemu: str | None, net: "NetworkManager | None" = None,
                 jail: "HostJail | None" = None) -> None:
        self.layout = layout
        self.jail = jail
        self.confine = confine
        self.confine.owner_uid = owner_uid
        self.owner_uid = owner_uid
        self.qemu = qemu
        self.net = net
        self.procs = VMMProcesses()
        self.plans: dict[str, tuple[Plan, list[str] | None]] = {}
        named = uid_ranges(confine, jail)
        check_disjoint(named)
        self.ranges = [(base, base + count) for what, (base, count) in named.items()
                       if what != "image builds"]
        _room_above(HELD_FLOOR)
        self.data_fd = _above(beneath.open_trusted(layout.root))
        """The data directory, opened by root itself when the helper starts."""
        self.held: dict[str, list[int]] = {}
        """Descriptors each sandbox's VMM (and its start) still names, closed at release."""
        self.pulls: "Pulls | None" = None  # images being pulled, made at the first

    # -- checks against the host ----------------------------------------------------

    def _hold(self, sandbox_id: str, fd: int) -> str:
        fds = self.held.setdefault(sandbox_id, [])
        if len(fds) >= MAX_HELD:
            os.close(fd)
            raise Refused(f"sandbox {sandbox_id} holds too many open folders; release it")
        fd = _above(fd)
        fds.append(fd)
        return beneath.fd_path(fd)

    def _drop(self, sandbox_id: str) -> None:
        for fd in self.held.pop(sandbox_id, []):
            os.close(fd)

    def folder(self, sandbox_id: str) -> tuple[SandboxPaths, SandboxPaths]:
        """``sandbox_id``'s folder: its names (what the VMM and the server see) and the
        same folder as this helper opened it (``<data>/sandboxes/<id>`` walked from
        ``data_fd`` without following a symlink, a folder of the server's or root's;
        every file operation goes there). Raises Refused."""
        if not _ID.fullmatch(sandbox_id):  # validated again: it names a folder here
            raise Refused(f"{sandbox_id!r} is not a sandbox id")
        try:
            fd = beneath.walk(self.data_fd, f"sandboxes/{sandbox_id}", directory=True)
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                raise Refused(f"no sandbox folder {sandbox_id}") from None
            raise Refused(f"{self.layout.sandbox(sandbox_id).dir} is not a sandbox folder "
                          f"({exc.strerror or exc})") from None
        if os.fstat(fd).st_uid not in (0, self.owner_uid):
            os.close(fd)
            raise Refused(f"{self.layout.sandbox(sandbox_id).dir} is not a sandbox folder")
        return self.layout.sandbox(sandbox_id), SandboxPaths(Path(self._hold(sandbox_id, fd)))

    def image_dir(self, sandbox_id: str, path: str) -> tuple[str, str]:
        """The image folder ``path`` (under ``<data>/images``, through the images' own
        links) as this helper opened it: its real path walked from ``data_fd`` without
        following a symlink. Returns (that real path, its ``/proc`` name, held for
        ``sandbox_id``). Raises Refused."""
        if not P.normal_path(path):  # a ``..`` would climb out of the VMM's view
            raise Refused(f"{path} is not an image folder (a path with no empty, '.' or "
                          f"'..' name)")
        images = os.path.normpath(self.layout.images.absolute())
        asked = os.path.normpath(path)
        real, real_images = os.path.realpath(asked), os.path.realpath(images)
        if not asked.startswith(images + "/") or not real.startswith(real_images + "/"):
            raise Refused(f"{path} is not an image folder")
        try:
            fd = beneath.walk(self.data_fd, "images/" + os.path.relpath(real, real_images),
                              directory=True)
        except OSError:
            raise Refused(f"{path} is not an image folder") from None
        return real, self._hold(sandbox_id, fd)

    def vmm_uid(self, pid: int) -> None:
        try:
            with open(f"/proc/{pid}/status") as f:
                uid = next(int(line.split()[1]) for line in f if line.startswith("Uid:"))
        except (OSError, StopIteration, ValueError, IndexError):
            raise Refused(f"no process {pid}") from None
        if not any(lo <= uid < hi for lo, hi in self.ranges):
            raise Refused(f"process {pid} is not a VMM")

    # -- handlers -----------------------------------------------------------------------

    def ping(self, req: P.Ping, fds: list[int]) -> Any:
        return "pong"

    def prepare_vmm(self, req: P.PrepareVmm, fds: list[int]) -> Any:
        self._drop(req.sandbox_id)  # a new start: what an earlier one held goes
        if req.view_fds is not None and req.view_fds != VIEW_FDS:
            raise Refused(f"a VMM's own descriptors are bound at {VIEW_FDS} only")
        paths, at = self.folder(req.sandbox_id)
        if req.tap is not None and (self.net is None or self.net.tap_of(req.sandbox_id)
                                    != req.tap):
            raise Refused(f"{req.tap} is not the TAP of {req.sandbox_id}")
        sources = [self.image_dir(req.sandbox_id, r) for r in req.reads]
        plan = self.confine.prepare(
            req.sandbox_id, paths, vcpus=req.vcpus, memory_mib=req.memory_mib, accel=req.accel,
            tcg_cache_mib=req.tcg_cache_mib, reads=[Path(r) for r in req.reads],
            owned=[paths.dir / n for n in req.owned], file_limit=req.file_limit,
            host_network=req.host_network, tap=req.tap, view_fds=req.view_fds, at=at,
            read_sources=sources)
        plan.umask = 0  # its sockets: reachable by the server, in a folder only it and the VMM enter
        console = self.confine.console_argv(paths, at)
        if console is not None and plan.root is not None:
            try:
                cfd = beneath.walk(self.data_fd, f"sandboxes/{req.sandbox_id}/console",
                                   directory=True)
            except OSError as exc:
                raise Refused(f"the console folder of {req.sandbox_id}: {exc}") from None
            plan.console_source = self._hold(req.sandbox_id, cfd)
        self.plans[req.sandbox_id] = (plan, console)
        return {"uid": plan.uid, "root": plan.root}

    def spawn_vmm(self, req: P.SpawnVmm, fds: list[int]) -> Any:
        if self.qemu is None or req.argv[0] != self.qemu:
            raise Refused(f"only {self.qemu} is started")
        if self.confine.seccomp and not _seccomp_on(req.argv):
            raise Refused(f"a VMM runs with -sandbox {SECCOMP} only")
        if len(fds) != len(req.fds):
            raise Refused("the descriptors sent and named differ")
        paths, at = self.folder(req.sandbox_id)
        got = self.plans.pop(req.sandbox_id, None)
        if got is None:
            raise Refused(f"sandbox {req.sandbox_id} was not prepared")
        plan, console = got
        placed: list[int] = []
        try:
            for fd, number in zip(fds, req.fds):
                if not 3 <= number < 1024 or _is_open(number):
                    raise Refused(f"descriptor number {number} is not free")
                os.dup2(fd, number, inheritable=False)
                placed.append(number)
            handle = self.procs.spawn(req.argv, cwd=at.dir, pid_file=at.pid_file,
                                      stdout=at.serial_log, stderr=at.vmm_log, plan=plan,
                                      console=console, pass_fds=placed)
        finally:
            for number in placed:
                os.close(number)
        return {"pid": handle.pid, "exit": handle.poll()}

    def kill_vmm(self, req: P.KillVmm, fds: list[int]) -> Any:
        if not process.alive(req.pid):
            return None  # already gone (a zombie is reaped here within a second)
        self.vmm_uid(req.pid)
        process.kill_process(req.pid)
        return None

    def release_vmm(self, req: P.ReleaseVmm, fds: list[int]) -> Any:
        self.plans.pop(req.sandbox_id, None)
        self._drop(req.sandbox_id)
        self.release_cgroups(req.sandbox_id)
        release_folder(self.layout.sandbox(req.sandbox_id), wait=1.0, cgroups=False)
        if self.jail is not None:  # a jailed Firecracker's too (the start-up sweep's orphans)
            try:
                self.jail.release(self.layout.sandbox(req.sandbox_id), req.sandbox_id)
            except HangarError:
                pass  # no Firecracker id: never jailed
        return None

    def vmm_memory(self, req: P.VmmMemory, fds: list[int]) -> Any:
        self.vmm_uid(req.pid)
        usage = memory.host_usage(req.pid)
        return None if usage is None else {"host_mib": usage.host_mib,
                                           "host_rss_mib": usage.host_rss_mib}

    def _net(self) -> "NetworkManager":
        if self.net is None:
            raise Refused("guest networking is off (HANGAR_NETWORK)")
        return self.net

    def net_info(self, req: P.NetInfo, fds: list[int]) -> Any:
        ok, reason = self._net().available()
        return {"ok": ok, "reason": reason}

    def net_start(self, req: P.NetStart, fds: list[int]) -> Any:
        self._net().start()

    def net_attach(self, req: P.NetAttach, fds: list[int]) -> Any:
        from dataclasses import asdict

        got = self._net().attach(req.sandbox_id, dict(req.policy))
        return None if got is None else asdict(got)

    def net_release(self, req: P.NetRelease, fds: list[int]) -> Any:
        self._net().release(req.sandbox_id)

    def net_sweep(self, req: P.NetSweep, fds: list[int]) -> Any:
        return self._net().sweep(req.live_ids)

    def net_teardown(self, req: P.NetTeardown, fds: list[int]) -> Any:
        self._net().teardown()

    def net_leases(self, req: P.NetLeases, fds: list[int]) -> Any:
        return self._net().leases()

    def net_guard(self, req: P.NetGuard, fds: list[int]) -> Any:
        self._net().guard_control(list(req.endpoints))

    def net_intercept(self, req: P.NetIntercept, fds: list[int]) -> Any:
        if req.kind == "dns":
            self._net().redirect_dns(req.sandbox_id, req.port)
        else:
            self._net().intercept(req.sandbox_id, req.port, tuple(req.dports))

    def net_admit(self, req: P.NetAdmit, fds: list[int]) -> Any:
        self._net().admit(req.sandbox_id, [tuple(e) for e in req.entries])

    def net_rules(self, req: P.NetRules, fds: list[int]) -> Any:
        self._net().set_rules(req.sandbox_id, dict(req.policy))

    def _jail(self) -> "HostJail":
        if self.jail is None:
            raise Refused("Firecracker's jailer is not run by this helper")
        return self.jail

    def jail_prepare(self, req: P.JailPrepare, fds: list[int]) -> Any:
        self._drop(req.sandbox_id)
        paths, _ = self.folder(req.sandbox_id)
        return {"uid": self._jail().prepare(paths, req.sandbox_id),
                "gid": self._jail().group}

    def jail_link(self, req: P.JailLink, fds: list[int]) -> Any:
        paths, _ = self.folder(req.sandbox_id)
        self._jail().link(self.layout, paths, req.sandbox_id,
                          [(src, name) for src, name in req.links], data_fd=self.data_fd)
        return None

    def jail_spawn(self, req: P.JailSpawn, fds: list[int]) -> Any:
        paths, at = self.folder(req.sandbox_id)
        handle = self._jail().spawn(self.procs, paths, req.sandbox_id, req.vcpus,
                                    req.memory_mib, at=at)
        return {"pid": handle.pid, "exit": handle.poll()}

    def jail_release(self, req: P.JailRelease, fds: list[int]) -> Any:
        self._drop(req.sandbox_id)
        self._jail().release(self.layout.sandbox(req.sandbox_id), req.sandbox_id)
        return None

    def _pulls(self) -> "Pulls":
        if self.pulls is None:
            from hangar.images.pull import Pulls
            self.pulls = Pulls(self.layout.root)
        return self.pulls

    def image_pull(self, req: P.ImagePull, fds: list[int]) -> Any:
        return self._pulls().start(req.name, req.ref, req.username, req.password)

    def image_pull_wait(self, req: P.ImagePullWait, fds: list[int]) -> Any:
        return self._pulls().poll(req.name, req.offset)

    def release_cgroups(self, sandbox_id: str) -> None:
        """Remove the cgroup folders this helper's hierarchy makes for ``sandbox_id``
        (``<parent>/<id>`` of each controller), waiting up to a second for its VMM to
        leave them. Computed here, never read from ``vmm.cgroup``: that file lies in the
        server's folder (and a restart's hand-over makes it the server's). Never raises."""
        if not _ID.fullmatch(sandbox_id) or self.confine.hierarchy is None:
            return
        for base in self.confine.hierarchy.bases:
            remove_cgroup(Path(base) / sandbox_id, time.monotonic() + 1.0)

    # -- the loop -----------------------------------------------------------------------

    def answer(self, data: bytes, fds: list[int]) -> dict[str, Any]:
        try:
            try:
                req = P.REQUEST.validate_json(data)
            except ValidationError as exc:
                first = exc.errors()[0] if exc.errors() else {}
                where = ".".join(str(x) for x in first.get("loc", ()))
                return {"ok": False, "error": f"bad request: {where}: {first.get('msg', exc)}"}
            try:
                return {"ok": True, "result": getattr(self, req.op)(req, fds)}
            except Refused as exc:
                return {"ok": False, "error": f"refused: {exc}"}
            except OSError as exc:
                return {"ok": False, "error": f"{req.op}: {exc}"}
            except HangarError as exc:  # e.g. a policy the network cannot enforce
                return {"ok": False, "error": exc.message, "status": exc.status}
            except Exception as exc:  # noqa: BLE001 - a bug answers, the helper lives on
                log.exception("privileged request %s failed", req.op)
                return {"ok": False, "error": f"{req.op}: {type(exc).__name__}"}
        finally:
            for fd in fds:
                try:
                    os.close(fd)
                except OSError:
                    pass

    def reap(self) -> None:
        for pid in list(self.procs._children):
            self.procs.exited(pid)

    def serve(self, sock: socket.socket) -> None:
        """Answer requests until the server's end closes (then end every pull)."""
        try:
            self._serve(sock)
        finally:
            self.pulls and self.pulls.stop_all()

    def _serve(self, sock: socket.socket) -> None:
        while True:
            ready, _, _ = select.select([sock], [], [], 1.0)
            self.reap()
            if not ready:
                continue
            try:
                data, fds = recv(sock)
            except OSError:
                return
            if not data and not fds:
                return
            out = json.dumps(self.answer(data, fds), separators=(",", ":")).encode()
            if len(out) > P.MAX_MESSAGE:
                out = b'{"ok":false,"error":"answer too large"}'
            try:
                sock.send(out)
            except OSError:
                return


MAX_HELD = 16
"""Folders one sandbox's requests may hold open in the helper until its release."""
_ID = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")
"""A sandbox id as the request table spells it (``protocol.SandboxId``)."""


def uid_ranges(confine: Confinement, jail: "HostJail | None") -> dict[str, tuple[int, int]]:
    """``{what: (base, count)}`` of the uids QEMU's VMMs, image builds and (with ``jail``)
    jailed Firecracker VMMs run as."""
    named = {"QEMU's VMMs": (confine.config.uid_base, confine.config.uid_count),
             "image builds": (BUILD_UID_BASE, BUILD_UID_COUNT)}
    if jail is not None:
        named["jailed Firecracker VMMs"] = (jail.config.uid_base, jail.config.uid_count)
    return named


def check_disjoint(ranges: dict[str, tuple[int, int]]) -> None:
    """Refuse (ConfigError) uid ranges ``{what: (base, count)}`` that overlap: a jailed
    VMM, a QEMU VMM and an image build must never share a uid (one could then signal,
    trace or write the other's files)."""
    items = sorted((base, base + count, what) for what, (base, count) in ranges.items())
    for (lo1, hi1, a), (lo2, hi2, b) in zip(items, items[1:]):
        if lo2 < hi1:
            raise ConfigError(f"the uids of {a} ({lo1}-{hi1 - 1}) and of {b} "
                              f"({lo2}-{hi2 - 1}) overlap: give them disjoint ranges")


def _seccomp_on(argv: list[str]) -> bool:
    """Whether QEMU's ``argv`` turns seccomp on as ``QemuCommand`` does, once, and never
    off (a later ``-sandbox`` would win)."""
    values = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("-sandbox", "--sandbox")]
    return values == [SECCOMP]


HELD_FLOOR = 1024
"""The least number of a descriptor the helper keeps open (``data_fd``, a sandbox's held
folders): above every number a VMM may be handed (``spawn_vmm``: 3..1023), so that the
numbers the server asks for stay free however many sandboxes hold folders."""


def _room_above(floor: int) -> None:
    """Raise this process's soft limit of open files to its hard limit, so that descriptors
    fit above ``floor`` (``_above``). Never raises."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or hard > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (OSError, ValueError):
        pass


def _above(fd: int) -> int:
    """``fd`` moved to the lowest free number at or above ``HELD_FLOOR`` (close-on-exec; the
    old number closed), or ``fd`` itself when the limit of open files leaves no room."""
    try:
        high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, HELD_FLOOR)
    except OSError:
        return fd
    os.close(fd)
    return high


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def run(sock: socket.socket, layout: Layout, confine: Confinement, owner_uid: int,
        net: "NetworkManager | None" = None, jail: "HostJail | None" = None) -> None:
    """The helper's whole life (in the forked child); never returns."""
    from hangar.engines.qemu.probe import QEMU

    code = 0
    try:
        process.become_subreaper()
        Helper(layout, confine, owner_uid, shutil.which(QEMU), net, jail).serve(sock)
    except BaseException:  # noqa: BLE001 - the helper must end, whatever happened
        log.exception("privileged helper failed")
        code = 1
    finally:
        os._exit(code)


def check_links(path: str = "/proc/sys/fs/protected_hardlinks") -> None:
    """Raise ConfigError unless the kernel refuses hard links to files one cannot write
    (``fs.protected_hardlinks``, 1 by default): root gives the server's folders and the
    files of template snapshots in them their owners and modes, so a server that could
    link a file of root's there would have root re-own it."""
    try:
        value = Path(path).read_text().strip()
    except OSError:
        return  # no such sysctl (not Linux's /proc): nothing to rely on or refuse
    if value != "1":
        raise ConfigError("fs.protected_hardlinks is 0: a split server could hard-link a "
                          "file of root's into its folders, where root changes owners and "
                          "modes. Run sysctl -w fs.protected_hardlinks=1 (and set it in "
                          "/etc/sysctl.d), or keep the server root with HANGAR_PRIVSEP=0")


def split(layout: Layout, confine: Confinement, user: str,
          net: "NetworkManager | None" = None, jail: "Callable[[int], HostJail] | None" = None
          ) -> tuple[int, Client]:
    """Fork the helper and drop to ``user`` (see the module docstring); returns the
    helper's pid and the server's client of it. ``confine`` and ``net`` (the guest
    network, or None) are the helper's, made from the server's settings as root;
    ``jail`` makes its Firecracker jailer (``HostJail``) from the server's group id, or
    is None (no Firecracker). Raises ConfigError."""
    if os.geteuid() != 0:
        raise ConfigError("HANGAR_PRIVSEP needs hangar serve to start as root")
    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        raise ConfigError(f"no user {user!r} to run the HTTP server as: create it "
                          f"(scripts/install.sh does), set HANGAR_USER, or keep the server "
                          f"root with HANGAR_PRIVSEP=0") from None
    if pw.pw_uid == 0:
        raise ConfigError(f"HANGAR_USER {user!r} is root")
    check_links()
    check_code(pw.pw_uid, pw.pw_gid)
    try:
        host_jail = jail(pw.pw_gid) if jail is not None else None
    except OSError as exc:
        raise ConfigError(f"Firecracker's jailer cannot run for a split server: {exc}") \
            from None
    check_disjoint(uid_ranges(confine, host_jail))  # refused here, in the server's words
    pid, client = _fork(layout, confine, pw.pw_uid, net, host_jail)
    hand_over(layout, pw.pw_uid, pw.pw_gid)
    drop(pw.pw_uid, pw.pw_gid)
    return pid, client


def beside(layout: Layout, confine: Confinement, uid: int, gid: int,
           net: "NetworkManager | None" = None, jail: "Callable[[int], HostJail] | None" = None
           ) -> tuple[int, Client]:
    """What ``split`` does, for a root command beside a split server's data directory
    (``hangar.cli.snapshot_step``: the template snapshot of ``hangar image build`` and
    ``hangar template build``): fork a helper whose server is ``uid:gid`` (the user that
    owns the data directory), and drop this process to that user, so that the step runs
    as the server itself would, every root act through the helper's request table. Hands
    nothing over: the data directory is that user's already. Raises ConfigError."""
    if os.geteuid() != 0:
        raise ConfigError("acting as a split server's user needs root")
    if uid == 0:
        raise ConfigError("the data directory is root's: no server's user to act as")
    check_code(uid, gid)
    try:
        host_jail = jail(gid) if jail is not None else None
    except OSError as exc:
        raise ConfigError(f"Firecracker's jailer cannot run for a split server: {exc}") \
            from None
    check_disjoint(uid_ranges(confine, host_jail))
    pid, client = _fork(layout, confine, uid, net, host_jail)
    drop(uid, gid)
    return pid, client


def _fork(layout: Layout, confine: Confinement, uid: int, net: "NetworkManager | None",
          jail: "HostJail | None") -> tuple[int, Client]:
    """Fork the helper (it runs ``run`` on its end of a new socketpair and never returns);
    returns its pid and this process's client of it."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        ours.close()
        run(theirs, layout, confine, uid, net, jail)  # never returns
    theirs.close()
    return pid, Client(ours)
