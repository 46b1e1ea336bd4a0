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

It sits beside ``hangar.server``, above the engines and the network whose
root halves it runs; ``hangar.privileged`` below them holds only the
protocol and the client, so no package imports its way back up here.
"""

from __future__ import annotations

import array
import json
import logging
import os
import select
import pwd
import shutil
import socket
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from hangar.engines import memory, process
from hangar.engines.confine import Confinement, Plan, release_folder
from hangar.engines.process import VMMProcesses
from hangar.engines.qemu.argv import SECCOMP
from hangar.errors import ConfigError, HangarError
from hangar.layout import Layout, SandboxPaths
from hangar.privileged import protocol as P
from hangar.privileged.client import Client
from hangar.privileged.split import check_code, drop, hand_over

if TYPE_CHECKING:
    from collections.abc import Callable

    from hangar.engines.firecracker.hostjail import HostJail
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
        self.ranges = [(confine.config.uid_base, confine.config.uid_base
                        + confine.config.uid_count), (300_000, 300_000 + 65_536)]

    # -- checks against the host ----------------------------------------------------

    def folder(self, sandbox_id: str) -> Path:
        d = self.layout.sandbox(sandbox_id).dir
        try:
            st = os.lstat(d)
        except OSError:
            raise Refused(f"no sandbox folder {sandbox_id}") from None
        if not stat.S_ISDIR(st.st_mode) or d.parent.resolve() != self.layout.sandboxes.resolve():
            raise Refused(f"{d} is not a sandbox folder")
        return d

    def image_dir(self, path: str) -> Path:
        real = Path(path).resolve()
        images = self.layout.images.resolve()
        if not real.is_dir() or not real.is_relative_to(images):
            raise Refused(f"{path} is not an image folder")
        return Path(path)

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
        d = self.folder(req.sandbox_id)
        paths = SandboxPaths(d)
        if req.tap is not None and (self.net is None or self.net.tap_of(req.sandbox_id)
                                    != req.tap):
            raise Refused(f"{req.tap} is not the TAP of {req.sandbox_id}")
        plan = self.confine.prepare(
            req.sandbox_id, paths, vcpus=req.vcpus, memory_mib=req.memory_mib, accel=req.accel,
            tcg_cache_mib=req.tcg_cache_mib, reads=[self.image_dir(r) for r in req.reads],
            owned=[d / n for n in req.owned], file_limit=req.file_limit,
            host_network=req.host_network, tap=req.tap, view_fds=req.view_fds)
        plan.umask = 0  # its sockets: reachable by the server, in a folder only it and the VMM enter
        console = self.confine.console_argv(paths)
        self.plans[req.sandbox_id] = (plan, console)
        return {"uid": plan.uid, "root": plan.root}

    def spawn_vmm(self, req: P.SpawnVmm, fds: list[int]) -> Any:
        if self.qemu is None or req.argv[0] != self.qemu:
            raise Refused(f"only {self.qemu} is started")
        if self.confine.seccomp and not _seccomp_on(req.argv):
            raise Refused(f"a VMM runs with -sandbox {SECCOMP} only")
        if len(fds) != len(req.fds):
            raise Refused("the descriptors sent and named differ")
        d = self.folder(req.sandbox_id)
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
            paths = SandboxPaths(d)
            handle = self.procs.spawn(req.argv, cwd=d, pid_file=paths.pid_file,
                                      stdout=paths.serial_log, stderr=paths.vmm_log, plan=plan,
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
        release_folder(self.layout.sandbox(req.sandbox_id), wait=1.0)
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
        d = self.folder(req.sandbox_id)
        return {"uid": self._jail().prepare(SandboxPaths(d), req.sandbox_id),
                "gid": self._jail().group}

    def jail_link(self, req: P.JailLink, fds: list[int]) -> Any:
        d = self.folder(req.sandbox_id)
        self._jail().link(self.layout, SandboxPaths(d), req.sandbox_id,
                          [(src, name) for src, name in req.links])
        return None

    def jail_spawn(self, req: P.JailSpawn, fds: list[int]) -> Any:
        d = self.folder(req.sandbox_id)
        handle = self._jail().spawn(self.procs, SandboxPaths(d), req.sandbox_id, req.vcpus,
                                    req.memory_mib)
        return {"pid": handle.pid, "exit": handle.poll()}

    def jail_release(self, req: P.JailRelease, fds: list[int]) -> Any:
        self._jail().release(self.layout.sandbox(req.sandbox_id), req.sandbox_id)
        return None

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
        """Answer requests until the server's end closes."""
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


def _seccomp_on(argv: list[str]) -> bool:
    """Whether QEMU's ``argv`` turns seccomp on as ``QemuCommand`` does, once, and never
    off (a later ``-sandbox`` would win)."""
    values = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("-sandbox", "--sandbox")]
    return values == [SECCOMP]


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
    check_code(pw.pw_uid, pw.pw_gid)
    try:
        host_jail = jail(pw.pw_gid) if jail is not None else None
    except OSError as exc:
        raise ConfigError(f"Firecracker's jailer cannot run for a split server: {exc}") \
            from None
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        ours.close()
        run(theirs, layout, confine, pw.pw_uid, net, host_jail)  # never returns
    theirs.close()
    hand_over(layout, pw.pw_uid, pw.pw_gid)
    drop(pw.pw_uid, pw.pw_gid)
    return pid, Client(ours)
