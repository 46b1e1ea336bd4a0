"""QEMU ``microvm`` engine, driven over QMP (``qemu.qmp``).

Machine: ``-M microvm`` with virtio-mmio devices only: a virtio-blk disk
(the sandbox's qcow2 overlay over the image's read-only ext4 rootfs), a
virtio-serial port named ``hangar.agent`` on a Unix socket (the agent
channel; this host kernel has no vhost-vsock, so QEMU's vsock is not used),
a virtio-rng, a virtio-balloon (``MemoryTuning``), and the serial console
written to ``serial.log``. When the spec has a ``net`` (``hangar.net``), a
virtio-net NIC on its TAP (or on QEMU's user-mode stack) is added last,
with ``hangar.net=`` on the kernel command line for the guest's
``hangar.guest.net``; without one, no NIC.

The kernel is the image's ELF ``vmlinux`` when it has one, booted through
its PVH entry point: QEMU maps the file and copies its segments into guest
RAM, so the host holds the kernel once in its page cache for every VM, and
the guest skips decompressing itself. Without one (an image built before
``vmlinux`` existed), the bzImage ``vmlinuz``, whose bytes QEMU keeps in
its own heap for the VM's life (about 14 MiB per VM).

Memory (``MemoryTuning``, figures in docs/performance.md): under TCG, a
translation buffer of ``tb_mib`` (QEMU's default is 1 GiB, of which an
idle guest keeps about 200 MiB resident); a virtio-balloon with free page
reporting, so the pages the guest frees go back to the host, and guest
memory statistics every ``stats_interval_s`` (``memory``); guest RAM marked
mergeable for KSM only when ``ksm`` is set (QEMU's default marks it always).

Accelerator: KVM where a probe boot of the guest kernel reaches its
initramfs (``hangar.probe=1`` prints ``HANGAR-PROBE-OK``) within
``PROBE_TIMEOUT_S``; TCG otherwise. Opening ``/dev/kvm`` is not enough: a
nested paravirtual KVM accepts ``KVM_CREATE_VM`` yet hangs ordinary guest
kernels. The probe result is cached in ``engine-probe.json`` keyed by the
QEMU version and host kernel release.

Each VMM runs in its own session (``start_new_session``), so a restarted
Hangar server can find and adopt it by the pid file and the ``-name`` tag,
and confined (``hangar.engines.confine``): its own user, cgroup and mount
namespace, seccomp (``-sandbox``), and a capped console log.

Snapshots use QEMU's migration stream (files: ``hangar.engines.snapshot_io``).
``snapshot`` pauses the VM and migrates it into ``state.mig``, which the
server opens and passes to QEMU as a file descriptor (QMP ``getfd``, then
``migrate fd:migration``): a confined QEMU may neither open the snapshot
folder nor spawn ``cat`` (QEMU 7.2 has no ``file:`` transport). All-zero
pages cost a few bytes, so the file is about the guest memory in use. It
then copies the qcow2 overlay, which the finished migration has flushed
and released. ``restore`` starts QEMU with the same argv plus ``-incoming
defer``, passes ``state.mig`` the same way, runs ``migrate-incoming
fd:migration`` and ``cont``. Only the
arguments in ``machine_args`` (plus the fixed device list) must match; the
kernel command line and file paths may differ, since RAM comes from the
stream. The guest TSC and clocks are part of the saved CPU state and simply
continue, so the guest's wall clock lags by the time the snapshot sat
on disk until ``snapshot_io.refresh_guest`` sets it. The agent's
virtio-serial port needs care on restore; see ``agent_channel``.

Files: ``hangar.layout.SandboxPaths`` (disk.qcow2, qmp.sock, agent.sock,
serial.log, vmm.log, vmm.pid) and ``SnapshotPaths`` (state.mig, disk.qcow2,
snapshot.json). The process is started, reaped and killed by
``hangar.engines.process``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import os
import platform
import shutil
import subprocess
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qemu.qmp import QMPClient, QMPError

from hangar.engines import process, snapshot_io
from hangar.engines.confine import Confinement
from hangar.engines.agent_client import AgentChannel, Streams, unix_channel
from hangar.engines.base import VM, Engine, SnapshotFiles, VMSpec
from hangar.engines.memory import MemoryUsage, host_usage
from hangar.engines.process import VMMProcesses
from hangar.errors import EngineError, Timeout
from hangar.guest import protocol as P
from hangar.layout import ImagePaths, Layout, SandboxPaths, SnapshotPaths

log = logging.getLogger("hangar.engine.qemu")

QEMU = "qemu-system-x86_64"
QEMU_IMG = "qemu-img"
PROBE_TIMEOUT_S = 15.0
PROBE_MARKER = b"HANGAR-PROBE-OK"
STOP_GRACE_S = 3.0
MACHINE = "microvm,pit=on,rtc=on"
MACHINE_FLAGS = ("-M", "-accel", "-cpu", "-smp", "-m")
MIGRATE_BANDWIDTH = 1 << 40  # bytes/s: no limit in practice (QEMU's default is 128 MiB/s)
MIGRATE_TIMEOUT_S = 60.0
MIGRATE_S_PER_GIB = 60.0  # extra seconds of migration timeout per GiB of guest memory
SECCOMP = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"
"""QEMU's ``-sandbox`` (seccomp) setting for every VMM."""
MIGRATION_FD = "migration"
"""The name under which a snapshot's stream is passed to QEMU (QMP ``getfd``)."""
FILE_LIMIT_SLACK_MIB = 512
"""``RLIMIT_FSIZE`` of QEMU is its disk plus its memory plus this, MiB: no file it
writes (its disk, a snapshot's stream) may grow past that."""
HELLO_PROBE_S = 0.5  # seconds between ``hello`` requests to a restored guest without a HELLO
BALLOON_ID = "balloon0"
TUNING_KEYS = ("tb-size", "mem-merge")
"""Suboptions of ``-accel`` and ``-M`` that tune the host's memory, not the machine's shape:
snapshots neither record nor compare them."""
KERNEL_ARGS = ("console=ttyS0", "root=/dev/vda", "rw", "quiet", "panic=-1")
GUEST_KERNEL_ARGS = ("cryptomgr.notests",)
"""Kernel options for what a guest's boot does not need (docs/performance.md, "Boot"):
the crypto self-tests, about 0.25 s of an emulated boot. Others were measured
(``mitigations=off``, ``audit=0``, ``nowatchdog``, no PS/2 or extra UART probing,
skipping initcalls) and made no difference worth a line here."""


@dataclass(frozen=True)
class MemoryTuning:
    """How a QEMU guest holds host memory; see the module docstring.

    ``tb_mib``: the TCG translation buffer per VM, MiB (ignored under KVM).
    A boot translates far more code than any size up to 64 MiB holds, so the
    buffer fills and stays resident; 48 is the knee measured here (boot and a
    mixed workload as fast as with 128 or QEMU's 1024, within noise; 32 boots
    0.25 s slower and runs that workload 15-25 % slower; 16 retranslates so
    often that an exec takes 6 times longer). ``balloon``: a virtio-balloon with free page reporting and
    memory statistics every ``stats_interval_s`` seconds. ``ksm``: guest RAM
    may be merged with identical pages of other guests by the host's ksmd
    (which the operator starts; see docs/security.md for the side channel).
    """

    tb_mib: int = 48
    balloon: bool = True
    ksm: bool = False
    stats_interval_s: int = 5


KSM_RUN = Path("/sys/kernel/mm/ksm/run")


def ksm_running(path: Path = KSM_RUN) -> bool:
    """Whether the host's ksmd merges pages (``/sys/kernel/mm/ksm/run`` reads 1)."""
    try:
        return path.read_text().strip() == "1"
    except OSError:
        return False


def without_tuning(machine: list[str]) -> list[str]:
    """``machine`` arguments without ``TUNING_KEYS`` suboptions (what snapshots compare)."""
    out = []
    for arg in machine:
        out.append(",".join(p for p in arg.split(",")
                            if p.split("=", 1)[0] not in TUNING_KEYS) if "," in arg else arg)
    return out


def host_tsc_khz() -> int | None:
    """The host CPU's clock in kHz from /proc/cpuinfo, or None.

    Under TCG the guest's TSC runs at the host's rate, but the guest's PIT
    calibration of it fails when the host is busy ("Unable to calibrate
    against PIT") and the kernel then hangs; ``tsc_early_khz`` skips it.
    """
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("cpu MHz"):
                    return int(float(line.split(":")[1]) * 1000)
    except (OSError, ValueError, IndexError):
        pass
    return None


def qemu_version() -> str:
    """First line of ``qemu-system-x86_64 --version``; EngineError if absent."""
    exe = shutil.which(QEMU)
    if exe is None:
        raise EngineError(f"{QEMU} not found; install the qemu-system-x86 package")
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, check=False)
    return out.stdout.splitlines()[0] if out.stdout else "unknown"


def probe_kvm(kernel: Path, initrd: Path, timeout: float = PROBE_TIMEOUT_S) -> tuple[bool, str]:
    """Boot ``kernel`` under KVM and report whether its initramfs ran.

    Returns (usable, reason). Takes up to ``timeout`` seconds when KVM hangs.
    """
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return False, "/dev/kvm is missing or not accessible"
    cmd = [
        QEMU, "-M", "microvm,pit=on", "-accel", "kvm", "-cpu", "host", "-m", "256", "-smp", "1",
        "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot", "-serial", "stdio",
        "-kernel", str(kernel), "-initrd", str(initrd),
        "-append", "console=ttyS0 panic=-1 hangar.probe=1",
    ]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return False, f"a KVM probe boot did not reach the initramfs in {timeout:.0f} s"
    took = time.monotonic() - started
    if PROBE_MARKER in out:
        return True, f"a KVM probe boot reached the initramfs in {took:.1f} s"
    tail = out.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
    return False, f"the KVM probe boot failed: {tail[0]}"


def choose_accel(layout: Layout, kernel: Path, initrd: Path, wanted: str = "auto") -> tuple[str, str]:
    """Pick ``kvm`` or ``tcg``; returns (accel, reason). Cached per QEMU and host kernel."""
    if wanted in ("kvm", "tcg"):
        return wanted, "set by configuration"
    key = f"{qemu_version()} / {platform.release()}"
    try:
        cached = json.loads(layout.qemu_probe_file.read_text())
        if cached.get("key") == key:
            return cached["accel"], cached["reason"] + " (cached)"
    except (OSError, ValueError, KeyError):
        pass
    ok, reason = probe_kvm(kernel, initrd)
    accel = "kvm" if ok else "tcg"
    layout.qemu_probe_file.write_text(json.dumps({"key": key, "accel": accel, "reason": reason}))
    return accel, reason


class QemuEngine(Engine):
    """Boots sandboxes as QEMU microvm guests. See the module docstring."""

    name = "qemu"

    def __init__(self, accel: str = "tcg", accel_reason: str = "",
                 confine: Confinement | None = None,
                 tuning: MemoryTuning | None = None) -> None:
        self.accel = accel
        self.accel_reason = accel_reason
        self.tuning = tuning or MemoryTuning()
        self.version = qemu_version()
        self.binary = shutil.which(QEMU) or QEMU
        self.confine = confine if confine is not None else Confinement()
        self.network_namespace: Path | None = None
        """Start VMMs in this network namespace (e.g. ``/run/netns/NAME``; where their
        TAPs are) instead of the server's."""
        self._procs = VMMProcesses()
        # Agent connections that ``restore`` opened before ``cont``, by QEMU pid.
        self._held: dict[int, Streams] = {}
        self._tsc_khz = host_tsc_khz()

    def describe(self) -> dict[str, str]:
        t = self.tuning
        d = {"engine": self.name, "accel": self.accel, "version": self.version,
             "accel_reason": self.accel_reason,
             "tb_mib": str(t.tb_mib) if self.accel != "kvm" else "",
             "balloon": str(t.balloon).lower(), "ksm": str(t.ksm).lower()}
        for m in self.confine.measures():
            d[m.name.replace(" ", "_")] = "on" if m.on else "off"
        return d

    def machine_args(self, spec: VMSpec) -> list[str]:
        """The QEMU arguments that fix the machine's shape.

        A snapshot can only be restored into a QEMU started with exactly
        these (plus the same devices, which ``command`` always adds in the
        same order), so snapshots record them and ``restore`` compares.
        """
        cpu = "host" if self.accel == "kvm" else "max"
        accel = "kvm" if self.accel == "kvm" else "tcg,thread=multi"
        return ["-M", MACHINE, "-accel", accel, "-cpu", cpu,
                "-smp", str(spec.vcpus), "-m", f"{spec.memory_mib}M"]

    def tuned_machine_args(self, spec: VMSpec) -> list[str]:
        """``machine_args`` with the memory tuning: ``tb-size`` and ``mem-merge``."""
        machine = self.machine_args(spec)
        i = machine.index("-M") + 1
        machine[i] += f",mem-merge={'on' if self.tuning.ksm else 'off'}"
        if self.accel != "kvm":
            i = machine.index("-accel") + 1
            machine[i] += f",tb-size={self.tuning.tb_mib}"
        return machine

    def command(self, spec: VMSpec, tap_fd: int | None = None, *,
                balloon: bool | None = None) -> list[str]:
        """The full QEMU argv for ``spec``; ``tap_fd``: an open TAP for its NIC;
        ``balloon`` overrides the tuning's (restores keep the devices their snapshot has).

        The serial console is QEMU's stdout (``VMMProcesses.spawn`` sends it
        to the capped console log); with confinement's seccomp on, QEMU may
        not spawn, raise privileges, use obsolete calls or change its own
        scheduling (``SECCOMP``).
        """
        p = spec.paths
        args = [*KERNEL_ARGS, *GUEST_KERNEL_ARGS, f"hangar.hostname={spec.hostname}"]
        if self.accel != "kvm" and self._tsc_khz:
            args += [f"tsc_early_khz={self._tsc_khz}", "tsc=reliable"]
        if spec.net is not None:
            args.append(spec.net.kernel_arg())
        append = " ".join([*args, *spec.kernel_args])
        kernel = spec.image.vmlinux if spec.image.vmlinux is not None else spec.image.kernel
        if balloon is None:
            balloon = self.tuning.balloon
        return [
            self.binary, "-name", f"hangar-{spec.sandbox_id}",
            *self.tuned_machine_args(spec),
            "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
            *(["-sandbox", SECCOMP] if self.confine.seccomp else []),
            "-kernel", str(kernel), "-initrd", str(spec.image.initrd),
            "-append", append,
            "-drive", f"id=root,file={p.disk},format=qcow2,if=none,discard=unmap",
            "-device", "virtio-blk-device,drive=root",
            "-device", "virtio-serial-device",
            "-chardev", f"socket,id=agent,path={p.agent},server=on,wait=off",
            "-device", "virtserialport,chardev=agent,name=hangar.agent",
            "-object", "rng-random,id=rng,filename=/dev/urandom",
            "-device", "virtio-rng-device,rng=rng",
            *self.balloon_args(balloon),
            "-chardev", "stdio,id=console,signal=off",
            "-serial", "chardev:console",
            "-qmp", f"unix:{p.qmp},server=on,wait=off",
            *self.nic_args(spec, tap_fd),
        ]

    def balloon_args(self, balloon: bool) -> list[str]:
        """The virtio-balloon: free page reporting, and statistics polled every few seconds."""
        if not balloon:
            return []
        return ["-device", f"virtio-balloon-device,id={BALLOON_ID},free-page-reporting=on,"
                           f"guest-stats-polling-interval={self.tuning.stats_interval_s}"]

    @staticmethod
    def nic_args(spec: VMSpec, tap_fd: int | None = None) -> list[str]:
        """The NIC's QEMU arguments: [] without ``spec.net``.

        TAP: the NetworkManager made the TAP, so QEMU runs no scripts; a
        confined QEMU may not open ``/dev/net/tun``, so it gets the TAP as
        the open file ``tap_fd`` (``hangar.engines.vmm_exec`` opens it). User mode: QEMU's own
        stack on the attachment's subnet, IPv4 only.
        """
        net = spec.net
        if net is None:
            return []
        if net.kind == "tap" and tap_fd is not None:
            netdev = f"tap,id=net0,fd={tap_fd}"
        elif net.kind == "tap":
            netdev = f"tap,id=net0,ifname={net.tap},script=no,downscript=no"
        else:
            subnet = ipaddress.ip_interface(f"{net.ip}/{net.prefix}").network
            netdev = (f"user,id=net0,net={subnet},host={net.gateway},ipv6=off"
                      + (f",dns={net.dns}" if net.dns else ""))
        return ["-netdev", netdev, "-device", f"virtio-net-device,netdev=net0,mac={net.mac}"]

    async def _make_disk(self, spec: VMSpec) -> None:
        base = spec.image.rootfs
        size = max(spec.disk_mib * 1024 * 1024, base.stat().st_size)
        proc = await asyncio.create_subprocess_exec(
            QEMU_IMG, "create", "-q", "-f", "qcow2", "-b", str(base), "-F", "raw",
            str(spec.paths.disk), str(size),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        _, err = await proc.communicate()
        if proc.returncode != 0:
            raise EngineError(f"qemu-img create failed: {err.decode(errors='replace').strip()}")

    async def boot(self, spec: VMSpec) -> VM:
        p = spec.paths
        p.dir.mkdir(parents=True, exist_ok=False)
        try:
            await self._make_disk(spec)
            return await self._start(spec)
        except BaseException:
            await self._cleanup(p, None)
            raise

    async def _start(self, spec: VMSpec, extra: tuple[str, ...] = (), *,
                     balloon: bool | None = None) -> VM:
        """Start QEMU for ``spec`` (its argv, with ``balloon`` as ``command`` takes it,
        plus ``extra``) in the sandbox directory.

        Confined as ``self.confine`` says (``hangar.engines.confine``): its
        cgroup, user, view and console logger are set up here. Returns once
        QEMU has created its QMP and agent sockets (so that a bad argument
        fails here with QEMU's own message); raises ``EngineError``. The
        caller cleans up on failure.
        """
        p = spec.paths
        tap = spec.net.tap if spec.net is not None and spec.net.kind == "tap" else None
        try:
            image_dirs = sorted({f.parent for f in (spec.image.kernel, spec.image.vmlinux,
                                                    spec.image.initrd, spec.image.rootfs)
                                 if f is not None})
            plan = self.confine.prepare(
                spec.sandbox_id, p, vcpus=spec.vcpus, memory_mib=spec.memory_mib,
                accel=self.accel, tcg_cache_mib=self.tuning.tb_mib, reads=image_dirs,
                owned=[p.disk],
                file_limit=(spec.disk_mib + spec.memory_mib + FILE_LIMIT_SLACK_MIB) << 20,
                host_network=spec.net is not None and spec.net.kind == "user", tap=tap,
                netns=self.network_namespace)
            console = self.confine.console_argv(p)
            argv = [*self.command(spec, self.confine.tap_fd() if tap else None, balloon=balloon),
                    *extra]
            proc = self._procs.spawn(argv, cwd=p.dir, pid_file=p.pid_file, stdout=p.serial_log,
                                     stderr=p.vmm_log, plan=plan, console=console)
        except OSError as exc:
            raise EngineError(f"cannot start {QEMU}: {exc}", sandbox_id=spec.sandbox_id) from None
        vm = VM(spec.sandbox_id, self.name, proc.pid, p, self.accel)
        try:
            deadline = time.monotonic() + 10
            while not (p.qmp.exists() and p.agent.exists()):
                if proc.poll() is not None:
                    raise EngineError(f"QEMU exited at start: {self._log_tail(p)}",
                                      sandbox_id=spec.sandbox_id)
                if time.monotonic() > deadline:
                    raise EngineError("QEMU did not create its sockets in 10 s",
                                      sandbox_id=spec.sandbox_id)
                await asyncio.sleep(0.02)
        except BaseException:
            await self._procs.kill(proc.pid)
            raise
        return vm

    @staticmethod
    def _log_tail(p: SandboxPaths) -> str:
        return process.tail(p.vmm_log, 1) or "no output"

    def agent_channel(self, vm: VM) -> AgentChannel:
        """The agent's virtio-serial port on ``agent.sock``; for a restored VM, with probing.

        The snapshot recorded whether a host was connected to the agent
        port. ``restore`` connects to the new QEMU's agent socket before
        ``cont``, so the port's state does not change under the guest: if a
        host was connected, the agent keeps the session it had and sends no
        HELLO (it answers requests, so the handshake asks it ``hello``); if
        not, the HELLO it had queued flows now. That held connection is the
        channel's first stream.

        Later connections (the first was closed) go through QEMU telling
        the guest that the host left and came back; if both notices reach
        the guest before the agent reads the port, the agent never sees the
        EOF and again sends no HELLO. So a restored VM's channel always asks
        ``hello`` every ``HELLO_PROBE_S`` seconds until one greeting comes
        (bytes written while the agent reopens its port are dropped).
        """
        if not vm.extra.get("restored_from"):
            return unix_channel(vm.paths.agent)
        plain = unix_channel(vm.paths.agent)

        async def open_() -> Streams:
            held = self._held.pop(vm.pid, None)
            return held if held is not None else await plain.open()

        return AgentChannel(open_, probe_interval=HELLO_PROBE_S)

    def vmm_error(self, vm: VM) -> str:
        return self._log_tail(vm.paths)

    def _drop_held(self, pid: int | None) -> None:
        held = self._held.pop(pid, None) if pid else None
        if held is not None:
            held[1].close()

    async def _qmp(self, vm: VM, command: str, **args: object) -> object:
        client = QMPClient(f"hangar-{vm.sandbox_id}")
        try:
            await asyncio.wait_for(client.connect(str(vm.paths.qmp)), 5)
            return await asyncio.wait_for(client.execute(command, args or None), 30)
        except (QMPError, OSError, asyncio.TimeoutError) as exc:
            raise EngineError(f"QMP {command} failed: {exc}", sandbox_id=vm.sandbox_id) from None
        finally:
            try:
                await client.disconnect()
            except Exception:
                pass

    async def memory(self, vm: VM) -> MemoryUsage | None:
        """What ``vm`` costs the host and what its guest uses (``MemoryUsage``).

        Host figures from /proc; guest figures from the balloon's statistics
        (QMP ``qom-get guest-stats``), None without a balloon or before the
        guest's first report. Returns None when the VMM is gone.
        """
        usage = host_usage(vm.pid)
        if usage is None:
            return None
        argv = process.argv_of(vm.pid) or []
        if not any(a.startswith("virtio-balloon-device") for a in argv):
            return usage
        try:
            got = await self._qmp(vm, "qom-get", path=f"/machine/peripheral/{BALLOON_ID}",
                                  property="guest-stats")
        except EngineError:
            return usage
        stats = got.get("stats", {}) if isinstance(got, dict) else {}
        total, free = stats.get("stat-total-memory", -1), stats.get("stat-free-memory", -1)
        updated = got.get("last-update", 0) if isinstance(got, dict) else 0
        if total <= 0 or free < 0 or not updated:
            return usage
        mib = 1 << 20
        cache = stats.get("stat-disk-caches", -1)
        return MemoryUsage(
            host_mib=usage.host_mib, host_rss_mib=usage.host_rss_mib,
            guest_total_mib=round(total / mib, 1), guest_used_mib=round((total - free) / mib, 1),
            guest_cache_mib=round(cache / mib, 1) if cache >= 0 else None,
            guest_stats_age_s=round(max(0.0, time.time() - updated), 1))

    async def pause(self, vm: VM) -> None:
        await self._qmp(vm, "stop")

    async def resume(self, vm: VM) -> None:
        await self._qmp(vm, "cont")

    async def stop(self, vm: VM) -> None:
        if vm.alive():
            try:
                await asyncio.wait_for(self._qmp(vm, "quit"), STOP_GRACE_S)
            except (EngineError, asyncio.TimeoutError):
                pass
            await self._procs.wait_gone(vm.pid, STOP_GRACE_S)
        await self._cleanup(vm.paths, vm.pid)

    async def _cleanup(self, p: SandboxPaths, pid: int | None) -> None:
        """Kill the VMM if it still runs, reap it, and remove the sandbox's files.

        Without a ``pid`` (or with -1) the pid file names it, trusted only if
        that process is this server's child or this sandbox's QEMU (``adopt``).
        """
        if pid is None or pid <= 1:
            pid = process.read_pid(p.pid_file)
            if pid is not None and self._procs.child(pid) is None \
                    and self.adopt(p.dir.name, p, pid) is None:
                pid = None
        self._drop_held(pid)
        await self._procs.kill(pid)
        await self.confine.release(p)
        shutil.rmtree(p.dir, ignore_errors=True)

    # -- snapshots ---------------------------------------------------------

    @asynccontextmanager
    async def _qmp_session(self, vm: VM) -> AsyncIterator[QMPClient]:
        """One QMP connection for a sequence of commands; EngineError if it cannot connect.

        QEMU's socket file exists from its ``bind()``; until its ``listen()`` a
        connect is refused, a gap a busy host can stretch. A refused connect is
        tried again (every 50 ms, within the same 5 s) while QEMU runs.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5
        while True:
            client = QMPClient(f"hangar-{vm.sandbox_id}")
            try:
                await asyncio.wait_for(client.connect(str(vm.paths.qmp)),
                                       max(0.1, deadline - loop.time()))
                break
            except (QMPError, OSError, asyncio.TimeoutError) as exc:
                refused = isinstance(getattr(exc, "exc", exc), ConnectionRefusedError)
                if refused and loop.time() < deadline and vm.alive():
                    await asyncio.sleep(0.05)
                    continue
                raise EngineError(f"QMP connect failed: {exc}",
                                  sandbox_id=vm.sandbox_id) from None
        try:
            yield client
        finally:
            try:
                await client.disconnect()
            except Exception:
                pass

    @staticmethod
    async def _run(client: QMPClient, vm: VM, command: str, **args: object) -> Any:
        try:
            return await asyncio.wait_for(client.execute(command, args or None), 30)
        except (QMPError, OSError, asyncio.TimeoutError) as exc:
            raise EngineError(f"QMP {command} failed: {exc}", sandbox_id=vm.sandbox_id) from None

    async def _wait_migration(self, client: QMPClient, vm: VM, timeout: float) -> dict[str, Any]:
        """Poll ``query-migrate`` until it completes; returns its last answer.

        Raises ``EngineError`` when the migration fails or QEMU dies, and
        ``Timeout`` after ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        delay = 0.01
        while True:
            if not vm.alive():
                raise EngineError(f"QEMU exited during the migration: {self._log_tail(vm.paths)}",
                                  sandbox_id=vm.sandbox_id)
            info = await self._run(client, vm, "query-migrate")
            status = info.get("status", "none")
            if status == "completed":
                return info
            if status in ("failed", "cancelled", "cancelling"):
                reason = info.get("error-desc", "no reason given")
                raise EngineError(f"migration {status}: {reason}", sandbox_id=vm.sandbox_id)
            if time.monotonic() > deadline:
                raise Timeout(f"migration did not complete in {timeout:.0f} s (status {status})",
                              sandbox_id=vm.sandbox_id)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.2)

    async def _pass_fd(self, client: QMPClient, vm: VM, path: Path, flags: int) -> None:
        """Open ``path`` here and hand it to QEMU as ``MIGRATION_FD`` (QMP ``getfd``).

        A confined QEMU can neither open the snapshot folder nor spawn a
        helper, so the migration stream reaches it as an open file.
        """
        try:
            fd = os.open(path, flags | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise EngineError(f"cannot open {path.name}: {exc.strerror}",
                              sandbox_id=vm.sandbox_id) from None
        try:
            client.send_fd_scm(fd)
            await self._run(client, vm, "getfd", fdname=MIGRATION_FD)
        except (QMPError, OSError) as exc:
            raise EngineError(f"cannot pass the migration file to QEMU: {exc}",
                              sandbox_id=vm.sandbox_id) from None
        finally:
            os.close(fd)

    def _argv_of(self, vm: VM) -> list[str]:
        argv = process.argv_of(vm.pid)
        if argv is None:
            raise EngineError("the VM's QEMU process is gone", sandbox_id=vm.sandbox_id)
        return argv

    @staticmethod
    def _arg(argv: list[str], flag: str) -> str:
        try:
            return argv[argv.index(flag) + 1]
        except (ValueError, IndexError):
            raise EngineError(f"QEMU's command line has no {flag}") from None

    def _shape_of(self, vm: VM) -> tuple[list[str], dict[str, Any]]:
        """The running VM's machine arguments and its image's manifest, from its argv.

        Read from ``/proc/<pid>/cmdline`` so that VMs adopted from an
        earlier server process (whose ``VMSpec`` is gone) work too.
        """
        argv = self._argv_of(vm)
        machine: list[str] = []
        for flag in MACHINE_FLAGS:
            machine += [flag, self._arg(argv, flag)]
        machine = without_tuning(machine)
        image_paths = ImagePaths(Path(self._arg(argv, "-kernel")).parent)
        try:
            image = json.loads(image_paths.manifest.read_text())
        except (OSError, ValueError) as exc:
            raise EngineError(f"cannot read the VM's image manifest: {exc}",
                              sandbox_id=vm.sandbox_id) from None
        return machine, image

    async def _img_virtual_size(self, disk: Path) -> int:
        proc = await asyncio.create_subprocess_exec(
            QEMU_IMG, "info", "--output=json", "-U", str(disk),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await proc.communicate()
        if proc.returncode != 0:
            raise EngineError(f"qemu-img info failed: {err.decode(errors='replace').strip()}")
        return int(json.loads(out)["virtual-size"])

    async def snapshot(self, vm: VM, dest: Path) -> SnapshotFiles:
        """Save the VM's device state, RAM and disk into the new directory ``dest``.

        Pauses the VM (QMP ``stop``), streams its state with QMP ``migrate``
        into ``dest/state.mig`` (opened here, passed as a file descriptor),
        waits for ``query-migrate`` to report completion,
        copies the qcow2 overlay (the migration has flushed and released
        it) and writes the manifest; see ``hangar.engines.snapshot_io``.
        The VM ends paused (QEMU's ``postmigrate`` state); ``resume`` runs
        it on, with its disk taken back. ``dest`` must not exist or be
        empty; on failure it is removed again and the VM is left paused.
        Returns the files and their allocated size in bytes (state file plus
        disk copy). Raises ``EngineError`` or ``Timeout``.
        """
        if not vm.alive():
            raise EngineError("cannot snapshot a VM that is not running", sandbox_id=vm.sandbox_id)
        machine, image = self._shape_of(vm)
        try:
            dest.mkdir(parents=True, exist_ok=True)
            if any(dest.iterdir()):
                raise EngineError(f"snapshot directory {dest} is not empty",
                                  sandbox_id=vm.sandbox_id)
        except OSError as exc:
            raise EngineError(f"cannot make snapshot directory {dest}: {exc}") from None
        memory_mib = int(self._arg(machine, "-m").rstrip("M"))
        files = SnapshotPaths(dest)
        state, partial = files.state, files.state_partial
        started = time.monotonic()
        created_at = time.time()
        try:
            async with self._qmp_session(vm) as qmp:
                await self._run(qmp, vm, "stop")
                await self._run(qmp, vm, "migrate-set-parameters",
                                **{"max-bandwidth": MIGRATE_BANDWIDTH})
                await self._pass_fd(qmp, vm, partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                await self._run(qmp, vm, "migrate", uri=f"fd:{MIGRATION_FD}")
                try:
                    info = await self._wait_migration(
                        qmp, vm, MIGRATE_TIMEOUT_S + memory_mib / 1024 * MIGRATE_S_PER_GIB)
                except BaseException:
                    try:  # leave the VM paused and usable, not mid-migration
                        await asyncio.shield(self._run(qmp, vm, "migrate_cancel"))
                    except (EngineError, asyncio.CancelledError):
                        pass
                    raise
            await asyncio.to_thread(snapshot_io.fsync_file, partial)
            os.replace(partial, state)
            disk = files.disk
            await snapshot_io.copy_file(vm.paths.disk, disk)
            await asyncio.to_thread(snapshot_io.fsync_file, disk)
            manifest = snapshot_io.SnapshotManifest(
                engine=self.name, vmm_version=self.version, accel=self.accel,
                image_name=str(image.get("name", "")), image_digest=str(image.get("digest", "")),
                kernel_version=str(image.get("kernel", {}).get("version", "")),
                vcpus=int(self._arg(machine, "-smp")), memory_mib=memory_mib,
                disk_virtual_bytes=await self._img_virtual_size(disk), machine=machine,
                created_at=created_at, state_bytes=snapshot_io.allocated_bytes(state),
                disk_bytes=snapshot_io.allocated_bytes(disk),
                save_seconds=round(time.monotonic() - started, 3),
                source_sandbox=vm.sandbox_id,
                extra={"migration_ms": info.get("total-time"),
                       "ram_transferred": info.get("ram", {}).get("transferred"),
                       "balloon": any(a.startswith("virtio-balloon-device")
                                      for a in self._argv_of(vm))},
            )
            snapshot_io.write_manifest(dest, manifest)
        except BaseException:
            shutil.rmtree(dest, ignore_errors=True)
            raise
        log.info("snapshot of %s: %d bytes in %.2f s", vm.sandbox_id, manifest.total_bytes,
                 manifest.save_seconds)
        return SnapshotFiles(dest, manifest.total_bytes)

    async def restore(self, spec: VMSpec, source: Path) -> VM:
        """Start a new VM for ``spec`` from the snapshot in ``source``; it ends running.

        The snapshot's disk is copied into the new sandbox (and its backing
        file repointed at ``spec.image.rootfs``), QEMU starts with the same
        argv as ``boot`` plus ``-incoming defer``, loads the state with QMP
        ``migrate-incoming`` from ``state.mig`` passed as a file descriptor,
        and is resumed with ``cont``.
        ``spec`` must have the snapshot's image digest, vCPUs and memory
        (``snapshot_io.read_manifest`` tells them). The guest's clock and
        entropy are the snapshot's until ``snapshot_io.refresh_guest`` runs.
        Raises ``NotFound`` (no snapshot there), ``EngineError`` (mismatch,
        QEMU failure) or ``Timeout``; on failure the sandbox directory is removed.
        """
        manifest = snapshot_io.read_manifest(source, self.name)
        if manifest.image_digest != spec.image.digest:
            raise EngineError(
                f"snapshot needs image {manifest.image_name}-{manifest.image_digest}, "
                f"the sandbox has {spec.image.name}-{spec.image.digest}",
                sandbox_id=spec.sandbox_id)
        machine = self.machine_args(spec)
        if machine != manifest.machine:
            raise EngineError(
                f"snapshot was made on machine {' '.join(manifest.machine)}; restoring on "
                f"{' '.join(machine)} is not possible (vCPUs, memory and accelerator must match)",
                sandbox_id=spec.sandbox_id)
        if manifest.vmm_version != self.version:
            log.warning("restoring a snapshot made by %s with %s",
                        manifest.vmm_version, self.version)
        p = spec.paths
        p.dir.mkdir(parents=True, exist_ok=False)
        vm: VM | None = None
        try:
            snap = SnapshotPaths(source)
            await snapshot_io.copy_file(snap.disk, p.disk)
            await self._rebase(p.disk, spec.image.rootfs)
            # The snapshot's devices, whatever the tuning says now.
            balloon = bool(manifest.extra.get("balloon", False))
            vm = await self._start(spec, ("-incoming", "defer"), balloon=balloon)
            async with self._qmp_session(vm) as qmp:
                await self._pass_fd(qmp, vm, snap.state, os.O_RDONLY)
                await self._run(qmp, vm, "migrate-incoming", uri=f"fd:{MIGRATION_FD}")
                await self._wait_migration(
                    qmp, vm, MIGRATE_TIMEOUT_S + manifest.memory_mib / 1024 * MIGRATE_S_PER_GIB)
                # Connect before the guest runs: see agent_channel.
                self._held[vm.pid] = await asyncio.open_unix_connection(
                    str(p.agent), limit=P.MAX_DATA * 2)
                await self._run(qmp, vm, "cont")
                status = await self._run(qmp, vm, "query-status")
                if status.get("status") != "running":
                    raise EngineError(f"restored VM is {status.get('status')}, not running",
                                      sandbox_id=spec.sandbox_id)
            vm.extra["restored_from"] = str(source)
            return vm
        except BaseException:
            await self._cleanup(p, vm.pid if vm is not None else None)
            raise

    async def _rebase(self, disk: Path, backing: Path) -> None:
        """Point ``disk``'s backing file at ``backing`` without touching data (``rebase -u``)."""
        proc = await asyncio.create_subprocess_exec(
            QEMU_IMG, "rebase", "-u", "-f", "qcow2", "-F", "raw", "-b", str(backing), str(disk),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        _, err = await proc.communicate()
        if proc.returncode != 0:
            raise EngineError(f"qemu-img rebase failed: {err.decode(errors='replace').strip()}")

    def adopt(self, sandbox_id: str, paths: SandboxPaths, pid: int) -> VM | None:
        """Return the VM if ``pid`` is still this sandbox's QEMU (checked by its argv)."""
        argv = process.argv_of(pid)
        if argv is None or f"hangar-{sandbox_id}" not in argv:
            return None
        vm = VM(sandbox_id, self.name, pid, paths, self.accel, extra={"restored_from": "adopted"})
        return vm if vm.alive() else None
