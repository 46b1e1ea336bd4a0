"""``hangar status``: the server's health, its engine, its warm pool, its limits (live
sandboxes, starts in progress, the start queue), its memory and its teams' use, in a few
lines (a team's key sees the health line alone: the rest is the operator's)."""

from __future__ import annotations

from hangar.cli.common import out, sdk
from hangar.errors import Forbidden
from hangar.schemas import Capacity, MemoryStatus, PoolStatus, TeamInfo


def status() -> None:
    """The server's health, its warm pool, and what each team holds against its limits."""
    pool: PoolStatus | None = None
    cap: Capacity | None = None
    teams: list[TeamInfo] = []
    with sdk() as h:
        health = h.health()
        try:
            pool = h.pool()
            cap = h.capacity()
            teams = h.list_teams()
        except Forbidden:  # a team's key
            pass
    engine, details = describe_engine(health.engine)
    noun = "sandbox" if health.sandboxes == 1 else "sandboxes"
    out.print(f"Hangar {health.version} at {h.base_url}: {health.status}; {health.sandboxes} "
              f"{noun}; engine {engine}", highlight=False, soft_wrap=True)
    if details:
        out.print(f"  {details}", highlight=False, soft_wrap=True)
    if pool is not None:
        out.print(f"warm pool ({pool.image}): {pool.ready} ready, {pool.starting} starting, "
                  f"{pool.size} wanted, replaced after {pool.max_age_s:.0f} s")
    if cap is not None:
        out.print(limits_line(cap), highlight=False, soft_wrap=True)
        out.print(memory_line(cap.memory), highlight=False, soft_wrap=True)
    for t in teams:
        out.print(f"team {t.name}: {team_use(t)}", highlight=False, soft_wrap=True)


def limits_line(c: Capacity) -> str:
    """``"limits: 12 of 30 VMs live (sandboxes and the warm pool), 2 of 2 starts in
    progress, 5 of 256 queued (wait at most 90 s; 3 refused since start-up)"``: the
    operator's caps and their use (the cap on VMs counts the warm pool's too)."""
    st = c.starts
    refused = f"; {st.refused} refused since start-up" if st.refused else ""
    return (f"limits: {c.vmms} of {c.vmm_limit} VMs live (sandboxes and the warm pool), "
            f"{st.running} of {st.limit} "
            f"starts in progress, {st.queued} of {st.queue} queued (wait at most "
            f"{st.max_wait_s:g} s{refused})")


def memory_line(m: MemoryStatus) -> str:
    """``"memory: sandboxes declare 2048 of 38568 MiB (budget 19284 × 2), their VMMs hold
    310 MiB; the host has 20100 MiB available, keeps 1228"``."""
    over = f" × {m.overcommit:g}" if m.overcommit != 1 else ""
    slept = f"; {m.slept} idle sandboxes put to sleep for memory" if m.slept else ""
    return (f"memory: sandboxes declare {m.declared_mib} of {m.allowed_mib} MiB (budget "
            f"{m.budget_mib}{over}), their VMMs hold {m.used_mib} MiB; the host has "
            f"{m.available_mib} MiB available, keeps {m.headroom_mib}{slept}")


def team_use(t: TeamInfo) -> str:
    """``"2 sandboxes (of 4), 2 vCPUs, 1024 MiB of memory, 2048 MiB of disk, 0 MiB of
    volumes"``: a team's use, each figure with its limit when it has one."""
    u = t.usage

    def of(limit: int | None) -> str:
        return f" (of {limit})" if limit is not None else ""
    noun = "sandbox" if u.sandboxes == 1 else "sandboxes"
    return (f"{u.sandboxes} {noun}{of(t.max_sandboxes)}, {u.vcpus} vCPUs{of(t.max_vcpus)}, "
            f"{u.memory_mib} MiB of memory{of(t.max_memory_mib)}, {u.disk_mib} MiB of "
            f"disk{of(t.max_disk_mib)}, {u.volumes_mib} MiB of volumes{of(t.max_volumes_mib)}")


def describe_engine(engine: dict[str, str]) -> tuple[str, str]:
    """``("qemu 7.2.22 (tcg)", "tb_mib=256, balloon=true, ...")`` from /health's ``engine``
    map: the engine named once with its version and accelerator, then its other facts."""
    name, accel = engine.get("engine", "?"), engine.get("accel", "")
    # "QEMU emulator version 7.2.22 (Debian ...)" says the name again: keep the number.
    version = next((w for w in engine.get("version", "").split() if w[:1].isdigit()),
                   engine.get("version", ""))
    head = " ".join(x for x in (name, version) if x) + (f" ({accel})" if accel else "")
    rest = ", ".join(f"{k}={v}" for k, v in engine.items()
                     if k not in ("engine", "version", "accel") and v)
    return head, rest
