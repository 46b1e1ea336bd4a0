"""What this host can run, and which engine ``auto`` picks.

``diagnose(layout, image)`` reports:

- whether ``/dev/kvm`` is there and usable;
- the VMMs found, with versions: ``qemu-system-x86_64``, ``firecracker``,
  ``jailer`` (looked up as ``hangar.engines.firecracker.binaries`` describes);
- QEMU's accelerator, from its KVM probe boot (``qemu.choose_accel``);
- whether a Firecracker probe boot works: the image's ``vmlinux`` and
  initramfs with ``hangar.probe=1``, which must print ``HANGAR-PROBE-OK`` on
  the console within ``PROBE_TIMEOUT_S`` (``firecracker.probe_boot``);
- the cgroup version the jailer would use for limits;
- each confinement measure for VMMs (``hangar.engines.confine``: user,
  seccomp, cgroup, view, console cap) and Firecracker's jailer, on or off
  with the reason;
- the engine ``auto`` picks, and why.

``auto`` is Firecracker when its binary is found and its probe boot
succeeds, otherwise QEMU (which then picks KVM or TCG by its own probe).
Opening ``/dev/kvm`` proves nothing: a nested paravirtual KVM accepts
``KVM_CREATE_VM`` and still cannot run an ordinary guest kernel.

Both probe results are cached, keyed by VMM version, host kernel release
and (for Firecracker) the image's kernel: QEMU's in ``engine-probe.json``,
Firecracker's in ``firecracker-probe.json`` in the data directory
(``Layout.qemu_probe_file``, ``Layout.firecracker_probe_file``). A
probe that fails takes its full timeout (10 to 15 s) the first time.

``choose_engine(kind, layout, image)`` builds the engine for ``kind``
(``auto``, ``firecracker`` or ``qemu``); ``Report.lines()`` is for printing.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hangar.engines.base import Engine
from hangar.engines import safefs
from hangar.engines.confine import ConfineConfig, Confinement, Measure
from hangar.engines.firecracker import (
    PROBE_TIMEOUT_S,
    UNJAILED_REFUSED,
    FirecrackerEngine,
    JailerConfig,
    binary_version,
    cgroup_version,
    find_firecracker,
    find_jailer,
    probe_boot,
)
from hangar.errors import EngineError, InvalidRequest
from hangar.layout import Layout

if TYPE_CHECKING:
    from hangar.engines.qemu import MemoryTuning
    from hangar.privileged import Client
    from hangar.images import GuestImage

log = logging.getLogger("hangar.engine.doctor")

ENGINE_KINDS = ("auto", "firecracker", "qemu")


@dataclass(frozen=True)
class VMMInfo:
    """One VMM binary: ``path`` and ``version`` are None when it was not found."""

    name: str
    path: str | None
    version: str | None
    note: str = ""


@dataclass(frozen=True)
class Report:
    """What ``diagnose`` found. ``None`` for a probe means it was not run."""

    kvm: bool
    kvm_note: str
    vmms: tuple[VMMInfo, ...]
    qemu_accel: str | None
    qemu_reason: str
    firecracker_boots: bool | None
    firecracker_reason: str
    jailer_cgroups: str
    auto_engine: str
    auto_reason: str
    notes: tuple[str, ...] = field(default_factory=tuple)
    confinement: tuple[Measure, ...] = field(default_factory=tuple)

    def vmm(self, name: str) -> VMMInfo | None:
        return next((v for v in self.vmms if v.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def lines(self) -> list[str]:
        """Human-readable lines, one fact each."""
        out = [f"/dev/kvm: {'usable' if self.kvm else 'not usable'} ({self.kvm_note})"]
        for v in self.vmms:
            if v.path:
                out.append(f"{v.name}: {v.version or 'unknown version'} at {v.path}"
                           + (f" ({v.note})" if v.note else ""))
            else:
                out.append(f"{v.name}: not found" + (f" ({v.note})" if v.note else ""))
        if self.qemu_accel:
            out.append(f"qemu accelerator: {self.qemu_accel} ({self.qemu_reason})")
        else:
            out.append(f"qemu accelerator: none ({self.qemu_reason})")
        fc = {True: "works", False: "fails", None: "not run"}[self.firecracker_boots]
        out.append(f"firecracker probe boot: {fc} ({self.firecracker_reason})")
        out.append(f"jailer cgroup limits: {self.jailer_cgroups}")
        out.append(f"engine 'auto' picks: {self.auto_engine} ({self.auto_reason})")
        out.extend(m.line() for m in self.confinement)
        out.extend(self.notes)
        return out


def _probe_key(binary: Path, image: "GuestImage") -> str:
    return (f"{binary_version(binary)} / {platform.release()} / "
            f"{image.kernel_version} / {image.digest}")


def firecracker_usable(layout: Layout, image: "GuestImage", binary: Path | None = None,
                       *, use_cache: bool = True,
                       timeout: float = PROBE_TIMEOUT_S) -> tuple[bool, str]:
    """Whether Firecracker boots ``image`` here: (ok, reason), cached in the data dir.

    Takes up to ``timeout`` seconds when not cached. Never raises for a
    failed boot; a missing binary gives (False, "firecracker not found").
    """
    binary = binary or find_firecracker()
    if binary is None:
        return False, "firecracker not found"
    cache = layout.firecracker_probe_file
    try:
        key = _probe_key(binary, image)
    except EngineError as exc:
        return False, exc.message
    if use_cache:
        try:  # never through a link, a FIFO or a large file the server put there
            cached = json.loads(safefs.read_tail(cache.parent, cache.name))
            if cached.get("key") == key:
                return bool(cached["ok"]), str(cached["reason"]) + " (cached)"
        except (OSError, ValueError, KeyError, AttributeError):
            pass
    ok, reason = probe_boot(image, binary, timeout)
    try:  # a new file of this process's own, renamed over the name (root's probe)
        safefs.replace_file(cache.parent, cache.name,
                            json.dumps({"key": key, "ok": ok, "reason": reason}).encode())
    except OSError as exc:
        log.warning("cannot cache the Firecracker probe result in %s: %s", cache, exc)
    return ok, reason


def _kvm() -> tuple[bool, str]:
    if not os.path.exists("/dev/kvm"):
        return False, "no /dev/kvm: the kvm module is not loaded or this is not a VM host"
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return False, "/dev/kvm exists but this user cannot open it (join group kvm)"
    return True, "present and accessible; only a probe boot shows whether guests run"


def jailer_choice(wanted: bool | str, helper: "Client | None" = None
                  ) -> tuple[Path | None, str]:
    """Firecracker's jailer for ``wanted`` (``auto``, ``on``/True, ``off``/False):
    (its path, why) when it is used, (None, why not) otherwise. ``helper``: the root
    helper's client of a server split from root, which runs the jailer. ``on``
    without root (or such a helper) or a jailer raises EngineError."""
    if wanted in (False, "off"):
        return None, "turned off (HANGAR_FIRECRACKER_JAILER=off)"
    jb = find_jailer()
    split = os.geteuid() != 0 and helper is not None  # its helper jails
    problem = ("Hangar is not root" if os.geteuid() != 0 and not split else
               "no jailer found; run scripts/fetch-firecracker.sh" if jb is None else None)
    if problem is None:
        return jb, (f"{jb}: own uid, own pid namespace, chroot, cgroup limits per VMM"
                    + (", run by the privileged helper" if split else ""))
    if wanted in (True, "on"):
        raise EngineError(f"the jailer is required (HANGAR_FIRECRACKER_JAILER=on) but {problem}")
    if os.geteuid() == 0 or split:  # auto without a jailer: never a VMM as root (or as
        # the split server's own user) unasked
        raise EngineError(f"{problem}: {UNJAILED_REFUSED}")
    return None, problem


def diagnose(layout: Layout, image: "GuestImage | None", *, use_cache: bool = True,
             probe_timeout: float = PROBE_TIMEOUT_S,
             confine: ConfineConfig | None = None, jailer_mode: bool | str = "auto") -> Report:
    """Inspect this host; see the module docstring. Runs (or reads cached) probe boots.

    ``image`` None skips both probe boots. Never raises for a missing VMM.
    ``confine`` and ``jailer_mode`` are the server's settings (default: the defaults).
    """
    from hangar.engines.qemu import QEMU, choose_accel, qemu_version

    kvm, kvm_note = _kvm()
    vmms: list[VMMInfo] = []
    qemu_path = shutil.which(QEMU)
    qemu_ver = None
    if qemu_path:
        try:
            qemu_ver = qemu_version()
        except EngineError as exc:
            qemu_ver = None
            log.warning("%s", exc.message)
    vmms.append(VMMInfo(QEMU, qemu_path, qemu_ver,
                        "" if qemu_path else "install the qemu-system-x86 package"))
    fc = find_firecracker()
    fc_ver = None
    if fc:
        try:
            fc_ver = binary_version(fc)
        except EngineError as exc:
            fc_ver, fc = None, None
            log.warning("%s", exc.message)
    vmms.append(VMMInfo("firecracker", str(fc) if fc else None, fc_ver,
                        "" if fc else "run scripts/fetch-firecracker.sh"))
    jailer = find_jailer()
    jailer_ver = None
    if jailer:
        try:
            jailer_ver = binary_version(jailer)
        except EngineError:
            jailer = None
    vmms.append(VMMInfo("jailer", str(jailer) if jailer else None, jailer_ver,
                        ("" if os.geteuid() == 0 else "needs root") if jailer else
                        "comes with firecracker"))

    notes: list[str] = []
    if image is None:
        qemu_accel, qemu_reason = None, "no guest image to probe with"
        fc_ok: bool | None = None
        fc_reason = "no guest image to probe with"
    else:
        if qemu_path:
            qemu_accel, qemu_reason = choose_accel(layout, image.kernel, image.initrd)
        else:
            qemu_accel, qemu_reason = None, "QEMU not found"
        if fc:
            fc_ok, fc_reason = firecracker_usable(layout, image, fc, use_cache=use_cache,
                                                  timeout=probe_timeout)
        else:
            fc_ok, fc_reason = None, "firecracker not found"

    cg = cgroup_version("auto")
    cgroups = {"2": "cgroup v2", "1": "cgroup v1 (v2 has no cpu and memory controllers here)",
               None: "none (no cgroup v1 or v2 hierarchy with cpu and memory controllers)"}[cg]

    if fc and fc_ok:
        auto, why = "firecracker", "its probe boot reached the guest's initramfs"
    elif qemu_path:
        if not fc:
            why = "firecracker is not installed"
        elif fc_ok is None:
            why = "Firecracker was not probed"
        else:
            why = "Firecracker's probe boot failed"
        auto = "qemu"
        why += f"; QEMU with {qemu_accel or 'an accelerator chosen at start'}"
    else:
        auto, why = "none", "neither a working Firecracker nor QEMU was found"
    if fc and not fc_ok and kvm:
        notes.append("note: /dev/kvm opens but guests do not run under Firecracker; a nested "
                     "or paravirtual KVM may run only guest kernels built for it")
    measures = [Measure(m.name if m.name.startswith("console") else f"qemu {m.name}", m.on,
                        m.reason) for m in Confinement(confine).measures()]
    try:
        jb, jailer_why = jailer_choice(jailer_mode)
    except EngineError as exc:
        jb, jailer_why = None, exc.message
    measures.append(Measure("firecracker jailer", jb is not None, jailer_why))
    return Report(kvm=kvm, kvm_note=kvm_note, vmms=tuple(vmms), qemu_accel=qemu_accel,
                  qemu_reason=qemu_reason, firecracker_boots=fc_ok, firecracker_reason=fc_reason,
                  jailer_cgroups=cgroups, auto_engine=auto, auto_reason=why, notes=tuple(notes),
                  confinement=tuple(measures))


def choose_engine(kind: str, layout: Layout, image: "GuestImage", *, accel: str = "auto",
                  jailer: bool | str | JailerConfig = "auto",
                  confine: ConfineConfig | None = None,
                  tuning: "MemoryTuning | None" = None,
                  helper: "Client | None" = None) -> Engine:
    """Build the engine named ``kind``: ``auto``, ``firecracker`` or ``qemu``.

    ``auto`` runs (or reads the cached result of) the Firecracker probe boot
    and falls back to QEMU. ``accel`` is QEMU's (``auto``, ``kvm``, ``tcg``).
    ``jailer``: ``auto`` (default) runs Firecracker VMMs under the jailer
    found by ``find_jailer`` when Hangar is root, ``on`` (True) requires it,
    ``off`` (False) does without; or give a ``JailerConfig``. ``confine``:
    QEMU's confinement (default: ``ConfineConfig()``, everything on).
    ``tuning`` is QEMU's memory tuning (``hangar.engines.qemu.MemoryTuning``).
    ``helper``: the root helper's client of a server split from root
    (``hangar.roothelper``), given to the engine (None: this process is root or
    unsplit).
    Raises InvalidRequest for an unknown kind, EngineError when the VMM (or a
    required jailer) is missing.
    """
    if kind not in ENGINE_KINDS:
        raise InvalidRequest(f"unknown engine {kind!r}; choose one of {', '.join(ENGINE_KINDS)}")
    if kind in ("auto", "firecracker"):
        fc = find_firecracker()
        if kind == "auto":
            ok, reason = firecracker_usable(layout, image, fc) if fc else (False, "not found")
            if not ok:
                log.info("engine auto: QEMU, since Firecracker is not usable: %s", reason)
                kind = "qemu"
            else:
                log.info("engine auto: Firecracker: %s", reason)
        if kind != "qemu":
            config: JailerConfig | None = None
            if isinstance(jailer, JailerConfig):
                config = jailer
            else:
                try:
                    jb, why = jailer_choice(jailer, helper)
                except EngineError as exc:
                    if kind == "firecracker":
                        raise
                    log.warning("engine auto: QEMU, since Firecracker cannot run confined: "
                                "%s", exc.message)
                    return _qemu(layout, image, accel, confine, tuning, helper)
                if jb is not None:
                    c = confine or ConfineConfig()
                    config = JailerConfig(jb, cgroups=c.cgroups if c.enabled else "off")  # type: ignore[arg-type]
                else:
                    log.warning("Firecracker runs without its jailer: %s", why)
            return FirecrackerEngine(fc, jailer=config, console_log_bytes=(
                confine or ConfineConfig()).console_log_bytes, unjailed=config is None,
                helper=helper)
    return _qemu(layout, image, accel, confine, tuning, helper)


def _qemu(layout: Layout, image: "GuestImage", accel: str, confine: ConfineConfig | None,
          tuning: "MemoryTuning | None", helper: "Client | None" = None) -> Engine:
    from hangar.engines.qemu import QemuEngine, choose_accel

    chosen, reason = choose_accel(layout, image.kernel, image.initrd, accel)
    return QemuEngine(chosen, reason, Confinement(confine, helper), tuning)
