"""Host memory: what guests declare, what their VMMs use, what the host has left.

Admission (``hangar.core.admission``) counts each sandbox's declared guest memory
against ``memory_budget_mib × memory_overcommit``: with the default ratio of 1 a host
never promises more than its budget, and an operator who knows that idle guests use
a fraction of what they declare (issue 33 measured 60-100 MiB of host memory for an
idle 512 MiB guest under emulation) raises the ratio to fit more. What keeps an
overcommitted host safe is the **headroom**: the host's ``MemAvailable`` must stay
above ``memory_headroom_mib``.

* A create, wake, restore or fork that would leave less than the headroom, counting
  ``START_COST_MIB`` for the new VMM, first puts idle sandboxes to sleep (``relieve``)
  and is refused (429, ``host_memory_low``) only when none is left to sleep.
* A reconcile pass (``pressure_pass``) does the same whenever the host falls below the
  headroom on its own (guests touching their memory): one sandbox per pass, until
  the host is above it again.

A sandbox put to sleep loses nothing (its memory, devices and disk are snapshotted:
``hangar.core.sleep``) and wakes on its next call. Only sandboxes whose wake is
transparent are chosen (``sleepable``): running, idle for ``memory_pressure_idle_s``,
no call in flight, no volume mounted, and not an E2B sandbox made without
``autoResume`` (whose envd calls would fail while it sleeps), oldest idle first. The
warm pool does not refill under pressure (``Admission.if_room``).

``HANGAR_TEST_MEMINFO`` (tests only) names a file read instead of ``/proc/meminfo``.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hangar.core.context import Context
from hangar.core.lifecycle import State
from hangar.errors import Busy, Conflict, HangarError, LimitExceeded

if TYPE_CHECKING:
    from hangar.core.admission import Admission
    from hangar.core.sleep import Sleeper
    from hangar.core.store import SandboxRecord
    from hangar.core.volumes import Volumes

log = logging.getLogger("hangar.memory")

MEMINFO = Path("/proc/meminfo")
TEST_MEMINFO_ENV = "HANGAR_TEST_MEMINFO"
"""Tests only: a file in ``/proc/meminfo``'s format read instead (the module docstring)."""
START_COST_MIB = 100
"""Host memory a new VMM takes at once, MiB: an idle sandbox's cost under emulation as
issue 33 measured it (60-100 MiB); its guest's later use shows in ``MemAvailable``."""
HEADROOM_SHARE = 0.05
"""Share of the host's RAM kept available when ``memory_headroom_mib`` is unset."""
RELIEF_TRIES = 3
"""Sandboxes a refused start may put to sleep before it is refused."""
RETRY_AFTER_S = 5.0
"""What a start refused for low host memory is told to wait, seconds."""


def _field_mib(path: str | Path, field: str) -> int:
    """The kB figure of line ``field:`` of a ``/proc`` file, in MiB; 0 when unreadable."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def meminfo(field: str) -> int:
    """``field`` of ``/proc/meminfo`` (``MemTotal``, ``MemAvailable``...) in MiB; 0 when
    it cannot be read."""
    return _field_mib(os.environ.get(TEST_MEMINFO_ENV) or MEMINFO, field)


def rss_mib(pid: int | None) -> int:
    """Resident memory of process ``pid`` (``VmRSS``), MiB; 0 when it is gone."""
    return _field_mib(f"/proc/{pid}/status", "VmRSS") if pid else 0


@dataclass(frozen=True)
class MemoryView:
    """The host's memory as admission sees it, all in MiB: guests' ``declared`` memory
    against ``allowed`` (``budget × overcommit``), what their VMMs ``used`` (resident),
    what the host has ``available`` against the ``headroom`` it keeps, and how many
    sandboxes were put to sleep for it (``slept``)."""

    declared: int
    budget: int
    overcommit: float
    allowed: int
    used: int
    available: int
    headroom: int
    slept: int = 0
    """Idle sandboxes put to sleep for memory since the server started."""


class Memory:
    """``m.host_memory``: the figures above, the host's pressure, and its relief."""

    def __init__(self, ctx: Context, admission: Admission, sleeper: Sleeper,
                 volumes: Volumes) -> None:
        self.ctx = ctx
        self.admission = admission
        self.sleeper = sleeper
        self.volumes = volumes
        self.slept = 0
        """Sandboxes put to sleep to relieve the host since start-up."""

    # -- figures -----------------------------------------------------------------------

    def allowed_mib(self) -> int:
        """Guest memory all VMMs may declare together: the budget × ``memory_overcommit``."""
        return int(self.admission.memory_budget_mib() * self.ctx.settings.memory_overcommit)

    def headroom_mib(self) -> int:
        """Host memory kept available (``memory_headroom_mib``, else ``HEADROOM_SHARE``
        of the host's RAM)."""
        s = self.ctx.settings
        if s.memory_headroom_mib is not None:
            return s.memory_headroom_mib
        return int(meminfo("MemTotal") * HEADROOM_SHARE)

    def view(self) -> MemoryView:
        """The figures now (reads each VMM's ``/proc/PID/status``: not for hot paths)."""
        held = self.ctx.store.with_vmm()
        return MemoryView(
            declared=sum(r.memory_mib for r in held), budget=self.admission.memory_budget_mib(),
            overcommit=self.ctx.settings.memory_overcommit, allowed=self.allowed_mib(),
            used=sum(rss_mib(r.pid) for r in held), available=meminfo("MemAvailable"),
            headroom=self.headroom_mib(), slept=self.slept)

    # -- pressure ----------------------------------------------------------------------

    def low(self, need_mib: int = 0) -> LimitExceeded | None:
        """The refusal of a start that would take ``need_mib`` more from the host (or of
        nothing, with 0) below the headroom; None when there is room. A host whose
        ``MemAvailable`` cannot be read is never refused."""
        available = meminfo("MemAvailable")
        headroom = self.headroom_mib()
        if not available or available - need_mib >= headroom:
            return None
        return LimitExceeded(
            f"host memory is low: {available} MiB available and {headroom} MiB are kept "
            f"(HANGAR_MEMORY_HEADROOM_MIB); no idle sandbox is left to put to sleep",
            retry_after=RETRY_AFTER_S, limit="host_memory_low", available_mib=available,
            headroom_mib=headroom, needed_mib=need_mib)

    def sleepable(self) -> list[SandboxRecord]:
        """Sandboxes a relief may put to sleep, oldest idle first (the module docstring)."""
        ctx = self.ctx
        idle_before = time.time() - ctx.settings.memory_pressure_idle_s
        out = []
        for rec in ctx.store.in_states({State.RUNNING}):
            rt = ctx.registry.get(rec.id)
            if rt is None or rt.busy or (rec.last_active_at or 0.0) > idle_before \
                    or ctx.registry.locked(rec.id):  # a lifecycle change holds it
                continue
            if rec.e2b is not None and not rec.auto_resume:
                continue
            if rec.desired_state != State.RUNNING or self.volumes.has(rec.id):
                continue
            out.append(rec)
        return sorted(out, key=lambda r: r.last_active_at or 0.0)

    async def relieve(self) -> bool:
        """Put the oldest idle sandbox to sleep; False when none could be."""
        for rec in self.sleepable():
            try:
                await self.sleeper.sleep(rec.id)
            except (Busy, Conflict):  # a call came in, or it changed state: the next one
                continue
            except HangarError as exc:
                log.warning("a sandbox could not be put to sleep for memory",
                            extra={"sandbox_id": rec.id, "error": str(exc)})
                continue
            self.slept += 1
            self.ctx.metrics.memory_sleeps.inc()
            self.ctx.publish("sandbox.memory_sleep", rec.id,
                             available_mib=meminfo("MemAvailable"))
            log.info("sandbox put to sleep: host memory is low",
                     extra={"sandbox_id": rec.id, "available_mib": meminfo("MemAvailable"),
                            "headroom_mib": self.headroom_mib()})
            return True
        return False

    async def pressure_pass(self) -> None:
        """A reconcile pass: below the headroom, put one idle sandbox to sleep."""
        if self.low() is not None:
            await self.relieve()
