"""Firecracker's jailer and the cgroup limits it applies.

Under the jailer (``JailerConfig``) each VMM gets its own uid/gid, claimed
for its sandbox folder in ``[uid_base, uid_base + uid_count)`` from the
host-wide registry (``hangar.engines.uids``: never two live VMMs on one uid), a chroot
(``hangar.layout.FirecrackerPaths.root``) and cgroup limits: memory (the
guest's plus ``vmm_overhead_mib``) and CPU (``vcpus`` CPUs of quota), in
``<controller>/<parent_cgroup>/<vm id>``, and a pids limit (``pids_max``).
It is on by default when Hangar runs as root (``HANGAR_FIRECRACKER_JAILER``,
``hangar.engines.doctor.jailer_choice``). cgroup v2 is used when its cpu and
memory controllers are enabled, else v1, else none (``cgroup_version``;
``cgroups="off"`` skips limits). The jailer needs root.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from hangar.engines.uids import DEFAULT_REGISTRY, UidAllocator

log = logging.getLogger("hangar.engine.firecracker")

CPU_PERIOD_US = 100_000
"""CFS period of the CPU quota, in microseconds (the kernel's default)."""


@dataclass(frozen=True)
class JailerConfig:
    """Run each VMM under Firecracker's ``jailer`` (needs root).

    ``uid_base``/``uid_count``: the range each VMM's uid (= gid) is claimed
    from (``hangar.engines.uids.UidAllocator``, claims in ``uid_registry``). ``cgroups``: ``auto``, ``v1``, ``v2`` or ``off``.
    ``vmm_overhead_mib``: memory allowed beyond the guest's, in MiB.
    ``chroot_base``: the jailer's ``--chroot-base-dir``; None (as root) is the sandbox's
    own folder. A server split from root (``hangar.roothelper``) owns its sandbox folders,
    so its jails live in a root-owned folder instead (``SPLIT_CHROOT_BASE``): the jailer
    is root and follows the path it is given.
    """

    binary: Path
    uid_base: int = 500_000
    """Above QEMU's VMMs (``hangar.engines.confine``, 400,000 up) and image builds
    (``hangar.images.confined``, 300,000 up): no two kinds share a uid (the root helper
    refuses ranges that overlap)."""
    uid_count: int = 65_536
    cgroups: Literal["auto", "v1", "v2", "off"] = "auto"
    parent_cgroup: str = "hangar"
    vmm_overhead_mib: int = 128
    pids_max: int = 256
    uid_registry: Path = DEFAULT_REGISTRY
    chroot_base: Path | None = None

    def allocator(self) -> UidAllocator:
        """The allocator of this range (claims are host-wide, so any instance will do)."""
        return UidAllocator(self.uid_base, self.uid_count, self.uid_registry)

    def uid_for(self, vm_id: str, folder: Path) -> int:
        """The uid (= gid) of the VMM ``vm_id`` whose sandbox folder is ``folder``: the
        one the folder holds, or a new claim. Raises OSError (``UidsExhausted``)."""
        return self.allocator().allocate(vm_id, folder)


SPLIT_CHROOT_BASE = Path("/srv/jailer")
"""Where a split server's jails live (the jailer's own default ``--chroot-base-dir``):
``<base>/firecracker/<vm id>/root``, every folder above ``root`` root's."""


def jailed_argv(config: JailerConfig, firecracker: Path, vm_id: str, uid: int, gid: int,
                jail_base: Path, version: str | None, vcpus: int, memory_mib: int,
                fc_args: list[str]) -> list[str]:
    """The jailer's argv that starts ``firecracker`` as ``uid:gid`` in
    ``<jail_base>/firecracker/<vm_id>/root``, in a pid namespace of its own, with the
    cgroup limits of a guest of ``vcpus`` and ``memory_mib`` MiB; ``fc_args`` go to
    Firecracker."""
    return [str(config.binary), "--id", vm_id, "--exec-file", str(firecracker),
            "--uid", str(uid), "--gid", str(gid),
            "--chroot-base-dir", str(jail_base.absolute()), "--new-pid-ns",
            *cgroup_args(config, version, vcpus, memory_mib), "--", *fc_args]


def cgroup_mounts() -> dict[str, list[Path]]:
    """Mounted cgroup hierarchies: ``{"v1": [...], "v2": [...]}`` from /proc/mounts."""
    found: dict[str, list[Path]] = {"v1": [], "v2": []}
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and parts[2] in ("cgroup", "cgroup2"):
                    found["v2" if parts[2] == "cgroup2" else "v1"].append(Path(parts[1]))
    except OSError:
        pass
    return found


def cgroup_version(wanted: str = "auto") -> str | None:
    """``"2"`` or ``"1"`` for the jailer's ``--cgroup-version``, or None (no limits).

    v2 needs a cgroup2 mount whose root offers the cpu, memory and pids
    controllers; v1 needs mounted ``cpu``, ``memory`` and ``pids`` hierarchies.
    """
    if wanted == "off":
        return None
    mounts = cgroup_mounts()
    if wanted in ("auto", "v2"):
        for m in mounts["v2"]:
            try:
                ctrl = (m / "cgroup.controllers").read_text().split()
            except OSError:
                continue
            if {"cpu", "memory", "pids"} <= set(ctrl):
                return "2"
    if wanted in ("auto", "v1"):
        names = {n for m in mounts["v1"] for n in m.name.split(",")}
        if {"cpu", "memory", "pids"} <= names:
            return "1"
    return None


def cgroup_args(config: JailerConfig, version: str | None, vcpus: int,
                memory_mib: int) -> list[str]:
    """The jailer's ``--cgroup`` arguments for a guest of ``vcpus`` and ``memory_mib`` MiB."""
    if version is None:
        return []
    mem = (memory_mib + config.vmm_overhead_mib) << 20
    quota = vcpus * CPU_PERIOD_US
    if version == "2":
        limits = [f"memory.max={mem}", f"cpu.max={quota} {CPU_PERIOD_US}"]
    else:
        limits = [f"memory.limit_in_bytes={mem}", f"cpu.cfs_period_us={CPU_PERIOD_US}",
                  f"cpu.cfs_quota_us={quota}"]
    if config.pids_max:
        limits.append(f"pids.max={config.pids_max}")
    args = ["--cgroup-version", version, "--parent-cgroup", config.parent_cgroup]
    for limit in limits:
        args += ["--cgroup", limit]
    return args


async def remove_cgroups(parent: str, vm_id: str) -> None:
    """Remove ``<controller>/<parent>/<vm_id>`` from every hierarchy once its tasks left.

    Retries for about a second while the killed VMM's tasks leave (EBUSY).
    """
    await asyncio.to_thread(remove_cgroups_now, parent, vm_id)


def remove_cgroups_now(parent: str, vm_id: str) -> None:
    """``remove_cgroups``, blocking (the privileged helper's)."""
    import time

    mounts = cgroup_mounts()
    for base in [*mounts["v1"], *mounts["v2"]]:
        d = base / parent / vm_id
        for _ in range(50):
            try:
                d.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:  # EBUSY while the killed tasks leave
                time.sleep(0.02)
        else:
            log.warning("could not remove cgroup %s", d)
