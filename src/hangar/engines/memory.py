"""What a VM's memory costs the host, and what its guest uses of it.

Host figures come from the VMM process's /proc/PID/smaps_rollup (Linux 4.14+);
guest figures from the engine (QEMU's balloon statistics). The figures are
those of ``GET /sandboxes/{id}`` (``memory``) and of docs/performance.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hangar.errors import HangarError

if TYPE_CHECKING:
    from hangar.privileged import Client


@dataclass(frozen=True)
class MemoryUsage:
    """A VM's memory, MiB: what it costs the host and what its guest uses.

    ``host_mib`` is the VMM process's proportional set size (``Pss`` of
    /proc/PID/smaps_rollup: its private pages plus its share of pages it
    shares, such as QEMU's code and the kernel file); ``host_rss_mib`` its
    resident set. ``guest_*`` come from the guest's balloon driver (None
    without one): ``guest_total_mib`` the memory its kernel manages,
    ``guest_used_mib`` all of it but the free part (used plus buffers and
    cache, as ``free`` counts them), ``guest_cache_mib`` the disk cache,
    ``guest_stats_age_s`` how old those figures are.
    """

    host_mib: float
    host_rss_mib: float
    guest_total_mib: float | None = None
    guest_used_mib: float | None = None
    guest_cache_mib: float | None = None
    guest_stats_age_s: float | None = None


def smaps_rollup(pid: int) -> dict[str, int]:
    """The kB figures of /proc/PID/smaps_rollup (``Rss``, ``Pss``, ``Anonymous``...); {} if gone."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                parts = line.split()
                if len(parts) == 3 and parts[2] == "kB":
                    out[parts[0].rstrip(":")] = int(parts[1])
    except (OSError, ValueError):
        return {}
    return out


def host_usage(pid: int, helper: "Client | None" = None) -> MemoryUsage | None:
    """The host figures of the process ``pid``; None once it is gone. An unprivileged
    server may not read a VMM's ``smaps_rollup`` (another uid's, which needs ptrace
    rights): a server split from root asks its root helper (``helper``, its client)."""
    if helper is not None and os.geteuid() != 0:
        try:
            got = helper.vmm_memory(pid)
        except HangarError:
            return None
        return None if got is None else MemoryUsage(**got)
    roll = smaps_rollup(pid)
    if not roll:
        return None
    return MemoryUsage(host_mib=round(roll.get("Pss", 0) / 1024, 1),
                       host_rss_mib=round(roll.get("Rss", 0) / 1024, 1))
