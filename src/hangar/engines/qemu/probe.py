"""What this host offers QEMU: its version, KVM (a probe boot, cached), KSM and the TSC clock.

Accelerator: KVM where a probe boot of the guest kernel reaches its
initramfs (``hangar.probe=1`` prints ``HANGAR-PROBE-OK``) within
``PROBE_TIMEOUT_S``; TCG otherwise. Opening ``/dev/kvm`` is not enough: a
nested paravirtual KVM accepts ``KVM_CREATE_VM`` yet hangs ordinary guest
kernels. The probe result is cached in ``engine-probe.json``
(``Layout.qemu_probe_file``) keyed by the QEMU version and host kernel
release.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import time
from pathlib import Path

from hangar.engines import safefs
from hangar.errors import EngineError
from hangar.layout import Layout

QEMU = "qemu-system-x86_64"
"""The QEMU binary, looked up on ``PATH``."""
QEMU_IMG = "qemu-img"
PROBE_TIMEOUT_S = 15.0
"""Seconds a KVM probe boot may take to reach the initramfs."""
PROBE_MARKER = b"HANGAR-PROBE-OK"
KSM_RUN = Path("/sys/kernel/mm/ksm/run")


def qemu_version() -> str:
    """First line of ``qemu-system-x86_64 --version``; EngineError if absent."""
    exe = shutil.which(QEMU)
    if exe is None:
        raise EngineError(f"{QEMU} not found; install the qemu-system-x86 package")
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, check=False)
    return out.stdout.splitlines()[0] if out.stdout else "unknown"


NO_ACCESS = "/dev/kvm is missing or not accessible"
"""The start of the probe's reason when this process may not open ``/dev/kvm``."""


def probe_kvm(kernel: Path, initrd: Path, timeout: float = PROBE_TIMEOUT_S) -> tuple[bool, str]:
    """Boot ``kernel`` under KVM and report whether its initramfs ran.

    Returns (usable, reason). Takes up to ``timeout`` seconds when KVM hangs.
    """
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return False, f"{NO_ACCESS} to uid {os.getuid()}"
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


def choose_accel(layout: Layout, kernel: Path, initrd: Path,
                 wanted: str = "auto") -> tuple[str, str]:
    """Pick ``kvm`` or ``tcg``; returns (accel, reason). Cached per QEMU and host kernel."""
    if wanted in ("kvm", "tcg"):
        return wanted, "set by configuration"
    key = f"{qemu_version()} / {platform.release()}"
    cache = layout.qemu_probe_file
    try:  # never through a link, a FIFO or a large file the server put there
        cached = json.loads(safefs.read_tail(cache.parent, cache.name))
        if cached.get("key") == key:
            return cached["accel"], cached["reason"] + " (cached)"
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        pass
    ok, reason = probe_kvm(kernel, initrd)
    accel = "kvm" if ok else "tcg"
    if reason.startswith(NO_ACCESS):
        # Not cached: it says who asked (a split server's unprivileged user, say), not
        # what the host can do; a later probe with access must not read "tcg" here.
        return accel, reason
    # a new file of this process's own, renamed over the name (``hangar doctor`` as root)
    safefs.replace_file(cache.parent, cache.name,
                        json.dumps({"key": key, "accel": accel, "reason": reason}).encode())
    return accel, reason


def ksm_running(path: Path = KSM_RUN) -> bool:
    """Whether the host's ksmd merges pages (``/sys/kernel/mm/ksm/run`` reads 1)."""
    try:
        return path.read_text().strip() == "1"
    except OSError:
        return False


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
