"""The Firecracker probe boot: does a guest reach its initramfs under Firecracker here?

Boots the image's ``vmlinux`` and initramfs with ``hangar.probe=1`` (the
initramfs prints ``HANGAR-PROBE-OK`` and powers off) in a temporary
directory laid out like a sandbox's (``hangar.layout.FirecrackerPaths``).
Opening ``/dev/kvm`` proves nothing: a nested paravirtual KVM accepts
``KVM_CREATE_VM`` and still cannot run an ordinary guest kernel.
``hangar.engines.doctor.firecracker_usable`` caches the answer.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from hangar.engines import process
from hangar.engines.firecracker.api import FirecrackerAPI
from hangar.engines.firecracker.binaries import find_firecracker
from hangar.engines.firecracker.files import link_or_copy
from hangar.engines.process import VMMProcesses
from hangar.errors import EngineError, ImageError
from hangar.images.vmlinux import ensure_vmlinux
from hangar.layout import SandboxPaths

if TYPE_CHECKING:
    from hangar.images import GuestImage

PROBE_TIMEOUT_S = 10.0
PROBE_MARKER = b"HANGAR-PROBE-OK"
BOOT_ARGS = ("console=ttyS0", "reboot=k", "panic=-1", "pci=off", "i8042.noaux", "i8042.nomux",
             "i8042.nopnp", "i8042.dumbkbd")
"""Kernel arguments of every Firecracker guest; a reboot or panic ends the VMM."""

T = TypeVar("T")


async def probe_boot_async(image: "GuestImage", binary: Path | None = None,
                           timeout: float = PROBE_TIMEOUT_S) -> tuple[bool, str]:
    """Boot ``image``'s kernel and initramfs with ``hangar.probe=1`` under Firecracker.

    Returns (usable, reason): usable when the console shows the initramfs's
    ``HANGAR-PROBE-OK`` within ``timeout`` seconds. Takes up to ``timeout``
    s; leaves no process or file behind. Never raises for a failed boot.
    """
    binary = binary or find_firecracker()
    if binary is None:
        return False, "firecracker not found"
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return False, "/dev/kvm is missing or not accessible"
    try:
        kernel = await asyncio.to_thread(ensure_vmlinux, image)
    except ImageError as exc:
        return False, f"no vmlinux: {exc.message}"
    work = Path(tempfile.mkdtemp(prefix="hangar-fcprobe-"))
    sandbox = SandboxPaths(work)
    files = sandbox.firecracker("hangar-probe", jailed=False)
    procs = VMMProcesses()
    pid: int | None = None
    try:
        link_or_copy(kernel, files.kernel)
        link_or_copy(image.initrd, files.initrd)
        files.log.touch()
        proc = procs.spawn([str(binary), "--id", files.vm_id, "--api-sock", files.api.name,
                            "--log-path", files.log.name, "--level", "Warning"],
                           cwd=files.root, pid_file=sandbox.pid_file, stdout=sandbox.serial_log)
        pid = proc.pid
        started = time.monotonic()
        async with FirecrackerAPI(files.api) as api:
            await api.wait_ready(5, alive=lambda: proc.poll() is None)
            await api.put_machine_config(1, 128)
            await api.put_boot_source(files.kernel.name,
                                      " ".join([*BOOT_ARGS, "hangar.probe=1"]), files.initrd.name)
            await api.instance_start()
        while time.monotonic() - started < timeout:
            if PROBE_MARKER in sandbox.serial_log.read_bytes():
                return True, (f"a Firecracker probe boot reached the initramfs in "
                              f"{time.monotonic() - started:.1f} s")
            if proc.poll() is not None:
                break
            await asyncio.sleep(0.05)
        if PROBE_MARKER in sandbox.serial_log.read_bytes():
            return True, "a Firecracker probe boot reached the initramfs"
        if proc.poll() is not None:
            why = process.tail(files.log, 1) or process.tail(sandbox.serial_log, 1) or "no output"
            return False, f"the Firecracker probe guest died: {why}"
        console = process.tail(sandbox.serial_log, 1) or "no console output"
        return False, (f"a Firecracker probe boot did not reach the initramfs in "
                       f"{timeout:.0f} s (console: {console})")
    except (EngineError, OSError) as exc:
        return False, f"the Firecracker probe boot failed: {getattr(exc, 'message', exc)}"
    finally:
        await procs.kill(pid)
        shutil.rmtree(work, ignore_errors=True)


def run_sync(factory: Callable[[], Awaitable[T]]) -> T:
    """Run a coroutine from synchronous code, also when an event loop already runs here."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(factory())  # type: ignore[arg-type]
    result: list[Any] = []

    def runner() -> None:
        try:
            result.append(asyncio.run(factory()))  # type: ignore[arg-type]
        except BaseException as exc:
            result.append(exc)

    t = threading.Thread(target=runner, name="hangar-fc-sync")
    t.start()
    t.join()
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


def probe_boot(image: "GuestImage", binary: Path | None = None,
               timeout: float = PROBE_TIMEOUT_S) -> tuple[bool, str]:
    """Synchronous ``probe_boot_async`` (safe to call while an event loop runs)."""
    return run_sync(lambda: probe_boot_async(image, binary, timeout))
