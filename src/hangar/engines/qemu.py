"""QEMU ``microvm`` engine, driven over QMP (``qemu.qmp``).

Machine: ``-M microvm`` with virtio-mmio devices only: a virtio-blk disk
(the sandbox's qcow2 overlay over the image's read-only ext4 rootfs), a
virtio-serial port named ``hangar.agent`` on a Unix socket (the agent
channel; this host kernel has no vhost-vsock, so QEMU's vsock is not used),
a virtio-rng, and the serial console written to ``serial.log``.

Accelerator: KVM where a probe boot of the guest kernel reaches its
initramfs (``hangar.probe=1`` prints ``HANGAR-PROBE-OK``) within
``PROBE_TIMEOUT_S``; TCG otherwise. Opening ``/dev/kvm`` is not enough: a
nested paravirtual KVM accepts ``KVM_CREATE_VM`` yet hangs ordinary guest
kernels. The probe result is cached in ``engine-probe.json`` keyed by the
QEMU version and host kernel release.

Each VMM runs in its own session (``start_new_session``), so a restarted
Hangar server can find and adopt it by the pid file and the ``-name`` tag.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import platform
import shutil
import subprocess
import time
from pathlib import Path

from qemu.qmp import QMPClient, QMPError

from hangar.engines.base import VM, Engine, SnapshotFiles, VMSpec, kill_process
from hangar.errors import EngineError, Timeout
from hangar.guest.client import AgentClient
from hangar.layout import Layout, SandboxPaths

log = logging.getLogger("hangar.engine.qemu")

QEMU = "qemu-system-x86_64"
QEMU_IMG = "qemu-img"
PROBE_TIMEOUT_S = 15.0
PROBE_MARKER = b"HANGAR-PROBE-OK"
STOP_GRACE_S = 3.0


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
        cached = json.loads(layout.probe_file.read_text())
        if cached.get("key") == key:
            return cached["accel"], cached["reason"] + " (cached)"
    except (OSError, ValueError, KeyError):
        pass
    ok, reason = probe_kvm(kernel, initrd)
    accel = "kvm" if ok else "tcg"
    layout.probe_file.write_text(json.dumps({"key": key, "accel": accel, "reason": reason}))
    return accel, reason


class QemuEngine(Engine):
    """Boots sandboxes as QEMU microvm guests. See the module docstring."""

    name = "qemu"

    def __init__(self, accel: str = "tcg", accel_reason: str = "") -> None:
        self.accel = accel
        self.accel_reason = accel_reason
        self.version = qemu_version()
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        self._tsc_khz = host_tsc_khz()

    def describe(self) -> dict[str, str]:
        return {"engine": self.name, "accel": self.accel, "version": self.version,
                "accel_reason": self.accel_reason}

    def command(self, spec: VMSpec) -> list[str]:
        """The full QEMU argv for ``spec``."""
        p = spec.paths
        cpu = "host" if self.accel == "kvm" else "max"
        accel = "kvm" if self.accel == "kvm" else "tcg,thread=multi"
        args = ["console=ttyS0", "root=/dev/vda", "rw", "quiet", "panic=-1",
                f"hangar.hostname={spec.hostname}"]
        if self.accel != "kvm" and self._tsc_khz:
            args += [f"tsc_early_khz={self._tsc_khz}", "tsc=reliable"]
        append = " ".join([*args, *spec.kernel_args])
        return [
            QEMU, "-name", f"hangar-{spec.sandbox_id}",
            "-M", "microvm,pit=on,rtc=on", "-accel", accel, "-cpu", cpu,
            "-smp", str(spec.vcpus), "-m", f"{spec.memory_mib}M",
            "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
            "-kernel", str(spec.image.kernel), "-initrd", str(spec.image.initrd),
            "-append", append,
            "-drive", f"id=root,file={p.disk},format=qcow2,if=none,discard=unmap",
            "-device", "virtio-blk-device,drive=root",
            "-device", "virtio-serial-device",
            "-chardev", f"socket,id=agent,path={p.agent},server=on,wait=off",
            "-device", "virtserialport,chardev=agent,name=hangar.agent",
            "-object", "rng-random,id=rng,filename=/dev/urandom",
            "-device", "virtio-rng-device,rng=rng",
            "-chardev", f"file,id=console,path={p.serial_log}",
            "-serial", "chardev:console",
            "-qmp", f"unix:{p.qmp},server=on,wait=off",
            "-pidfile", str(p.pid_file),
        ]

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
            log_file = open(p.dir / "qemu.log", "wb")
            try:
                proc = subprocess.Popen(self.command(spec), stdin=subprocess.DEVNULL,
                                        stdout=log_file, stderr=subprocess.STDOUT,
                                        start_new_session=True, cwd=p.dir)
            finally:
                log_file.close()
            self._procs[proc.pid] = proc
            vm = VM(spec.sandbox_id, self.name, proc.pid, p, self.accel)
            # QEMU creates its sockets before it runs the guest; wait for them
            # so that a bad argument fails here with QEMU's own message.
            deadline = time.monotonic() + 10
            while not (p.qmp.exists() and p.agent.exists()):
                if proc.poll() is not None:
                    raise EngineError(f"QEMU exited at start: {self._log_tail(p)}",
                                      sandbox_id=spec.sandbox_id)
                if time.monotonic() > deadline:
                    raise EngineError("QEMU did not create its sockets in 10 s",
                                      sandbox_id=spec.sandbox_id)
                await asyncio.sleep(0.02)
            return vm
        except BaseException:
            await self._cleanup(p, self._procs.get(self._pid_of(p) or -1))
            raise

    @staticmethod
    def _pid_of(p: SandboxPaths) -> int | None:
        try:
            return int(p.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None

    @staticmethod
    def _log_tail(p: SandboxPaths) -> str:
        try:
            text = (p.dir / "qemu.log").read_text(errors="replace").strip()
        except OSError:
            return "no output"
        return text.splitlines()[-1] if text else "no output"

    async def connect_agent(self, vm: VM, timeout: float) -> AgentClient:
        try:
            return await AgentClient.connect(vm.paths.agent, timeout, proc_alive=vm.alive)
        except Timeout:
            raise Timeout(f"guest agent did not answer within {timeout:.0f} s; "
                          f"console: {self._console_tail(vm.paths)}", sandbox_id=vm.sandbox_id)

    @staticmethod
    def _console_tail(p: SandboxPaths, lines: int = 3) -> str:
        try:
            text = p.serial_log.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "no console output"
        return " | ".join(text[-lines:]) or "no console output"

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
            deadline = time.monotonic() + STOP_GRACE_S
            while vm.alive() and time.monotonic() < deadline:
                self._reap(vm.pid)
                await asyncio.sleep(0.05)
        await self._cleanup(vm.paths, self._procs.get(vm.pid), vm.pid)

    def _reap(self, pid: int) -> None:
        proc = self._procs.get(pid)
        if proc is not None and proc.poll() is not None:
            self._procs.pop(pid, None)

    async def _cleanup(self, p: SandboxPaths, proc: subprocess.Popen[bytes] | None,
                       pid: int | None = None) -> None:
        """Kill the VMM if it still runs, reap it, and remove the sandbox's files."""
        pid = pid or (proc.pid if proc else None) or self._pid_of(p)
        if pid:
            kill_process(pid)
        if proc is not None:
            try:
                await asyncio.to_thread(proc.wait, 5)
            except subprocess.TimeoutExpired:
                pass
            self._procs.pop(proc.pid, None)
        elif pid:
            deadline = time.monotonic() + 5
            while VM("", "", pid, p, "").alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
        shutil.rmtree(p.dir, ignore_errors=True)

    async def snapshot(self, vm: VM, dest: Path) -> SnapshotFiles:
        raise EngineError("snapshots are not implemented for QEMU yet")

    async def restore(self, spec: VMSpec, source: Path) -> VM:
        raise EngineError("snapshots are not implemented for QEMU yet")

    def adopt(self, sandbox_id: str, paths: SandboxPaths, pid: int) -> VM | None:
        """Return the VM if ``pid`` is still this sandbox's QEMU (checked by its argv)."""
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return None
        if f"hangar-{sandbox_id}".encode() not in argv:
            return None
        vm = VM(sandbox_id, self.name, pid, paths, self.accel)
        return vm if vm.alive() else None
