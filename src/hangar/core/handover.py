"""What a cluster layer hands the core, and takes away: placed creates, adopted sandboxes,
sandboxes given up. A single host uses none of it.

==========================  ================================================================
``Placement``               a create whose id a cluster chose and claimed before the request
                            reached this node; an argument of ``SandboxManager.create``,
                            ``fork`` and ``MachineManager.get_or_create`` (the gateway hands
                            it to the API under the ASGI scope key ``PLACEMENT_SCOPE``)
``Template``                what a sandbox is made of (``describe``): enough for another
                            node to recreate its record
``SharedSnapshot``          a snapshot made on another node, its files fetched into this
                            host's layout; ``Handover.receive`` records it (forks)
``Adoptee``                 a sleeping sandbox another node gave up: its template, its last
                            snapshot (a ``SharedSnapshot``) and, for a user's machine, the
                            machine's settings
``Handover.adopt``          write an adoptee's records: the sandbox in ``sleeping`` (a start
                            state of ``lifecycle.INITIAL``), its sleep snapshot, its machine
``Handover.forget``         a sandbox this host no longer owns: end its VMM if any, drop its
                            records and sleep snapshots (never a user snapshot)
``Handover.fence``          a node cut off from its cluster: SIGKILL every VMM of this host at
                            once (the core notices them dead and records it)
==========================  ================================================================

Both writers hold the sandbox's lock; neither touches anything outside this host.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from hangar.core.context import Context
from hangar.core.launch import Launcher
from hangar.core.lifecycle import INITIAL, OnExpiry, State, check_desired
from hangar.core.recovery import vmm_processes
from hangar.core.removal import Removal
from hangar.core.store import MachineRecord, SandboxRecord, SnapshotRecord
from hangar.core.views import SandboxView, SnapshotView, user_metadata
from hangar.engines.process import kill_process

log = logging.getLogger("hangar.handover")

PLACEMENT_SCOPE = "hangar.placement"
"""The ASGI scope key under which a cluster's gateway hands the API a ``Placement``."""


@dataclass(frozen=True)
class Placement:
    """Where a cluster placed a create: the sandbox id it claimed (with a VM slot) for it."""

    sandbox_id: str


@dataclass(frozen=True)
class Template:
    """What a sandbox is made of. Times are Unix seconds, sizes MiB."""

    image: str
    image_digest: str
    engine: str
    accel: str
    vcpus: int
    memory_mib: int
    disk_mib: int
    desktop: str | None = None
    network: dict[str, Any] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    """The client's metadata (opaque; only string keys and values are kept)."""
    source: str | None = None
    expires_at: float | None = None
    last_active_at: float | None = None
    e2b: dict[str, Any] | None = None
    """E2B's options (``hangar.core.e2b.Options.as_dict``), or None."""
    on_expiry: str | None = None
    """``lifecycle.OnExpiry``'s value, or None (``delete``)."""
    auto_resume: bool = False
    ttl_s: float | None = None
    wake_ttl_s: float | None = None
    """The record's clock (``hangar.core.sleep``): a paused sandbox keeps it stopped."""
    sleep_memory: bool | None = None
    """False: a sleep at expiry keeps its disk alone (the record's ``sleep_memory``)."""


def describe(rec: SandboxRecord | SandboxView) -> Template:
    """The template of ``rec`` (what another node needs to recreate it)."""
    return Template(image=rec.image, image_digest=rec.image_digest, engine=rec.engine,
                    accel=rec.accel, vcpus=rec.vcpus, memory_mib=rec.memory_mib,
                    disk_mib=rec.disk_mib, desktop=rec.desktop, network=rec.network,
                    metadata=user_metadata(rec), source=rec.source,
                    expires_at=rec.expires_at, last_active_at=rec.last_active_at,
                    e2b=dict(rec.e2b) if isinstance(rec.e2b, dict) else None,
                    on_expiry=rec.on_expiry.value if rec.on_expiry else None,
                    auto_resume=bool(rec.auto_resume), ttl_s=rec.ttl_s,
                    wake_ttl_s=rec.wake_ttl_s,
                    sleep_memory=False if rec.sleep_memory is False else None)


@dataclass(frozen=True)
class SharedSnapshot(SnapshotView):
    """A snapshot made on another node (``kind`` ``user`` or ``sleep``); its files are in
    this host's layout. The fields are ``SnapshotView``'s, a desktop and a network policy
    absent unless given."""

    desktop: str | None = None
    network: dict[str, Any] | None = None

    def record(self) -> SnapshotRecord:
        return SnapshotRecord(team=self.team,
            id=self.id, sandbox_id=self.sandbox_id, kind=self.kind, size_bytes=self.size_bytes,
            created_at=self.created_at, image=self.image, image_digest=self.image_digest,
            vcpus=self.vcpus, memory_mib=self.memory_mib, disk_mib=self.disk_mib,
            desktop=self.desktop, network=self.network,
            memory=False if self.memory is False else None)


@dataclass(frozen=True)
class Adoptee:
    """A sleeping sandbox to take over; its snapshot's files are in this host's layout."""

    sandbox_id: str
    template: Template
    snapshot: SharedSnapshot
    """Its last snapshot (``kind`` sleep), which it wakes from."""
    created_at: float
    user: str | None = None
    """The user whose machine it is, or None."""
    idle_timeout_s: float | None = None
    """The machine's idle timeout (None: the sandbox's own, else the server's default)."""
    machine_created_at: float | None = None
    team: str | None = None
    """The team whose sandbox it is (``hangar.core.teams``), or None: the operator's."""


class Handover:
    """Adopts sandboxes from other nodes and forgets the ones they took."""

    def __init__(self, ctx: Context, launcher: Launcher, removal: Removal) -> None:
        self.ctx = ctx
        self.launcher = launcher
        self.removal = removal

    async def adopt(self, a: Adoptee) -> SandboxRecord:
        """Write ``a``'s records: the sandbox asleep in its snapshot, wanting to run (a call
        or the reconcile loop wakes it), and its machine record. A local record of the same
        id is forgotten first (its sleep snapshots too, but the adoptee's). Returns the new
        record."""
        state = State.SLEEPING
        assert state in INITIAL
        check_desired(state, State.RUNNING)
        ctx = self.ctx
        t = a.template
        await self.forget(a.sandbox_id, "replaced by an adoption", keep=a.snapshot.id)
        now = time.time()
        async with ctx.registry.lock(a.sandbox_id):
            rec = SandboxRecord(
                id=a.sandbox_id, state=state, desired_state=State.RUNNING, image=t.image,
                image_digest=t.image_digest, engine=t.engine or ctx.engine.name,
                accel=t.accel or ctx.engine.accel, vcpus=t.vcpus, memory_mib=t.memory_mib,
                disk_mib=t.disk_mib, pid=None, created_at=a.created_at, updated_at=now,
                last_active_at=t.last_active_at or now, expires_at=t.expires_at,
                desktop=t.desktop, network=t.network,
                metadata_={k: v for k, v in t.metadata.items()
                           if isinstance(k, str) and isinstance(v, str)},
                source=t.source, sleep_snapshot=a.snapshot.id, user_id=a.user,
                idle_timeout_s=a.idle_timeout_s,
                e2b=dict(t.e2b) if isinstance(t.e2b, dict) else None,
                on_expiry=OnExpiry(t.on_expiry) if t.on_expiry else None,
                auto_resume=t.auto_resume, ttl_s=t.ttl_s, wake_ttl_s=t.wake_ttl_s,
                sleep_memory=t.sleep_memory, team=a.team)
            records: list[Any] = [rec, a.snapshot.record()]
            if a.user:
                ctx.store.remove(MachineRecord, a.user)
                records.append(MachineRecord(
                    user_id=a.user, sandbox_id=a.sandbox_id,
                    idle_timeout_s=float(a.idle_timeout_s or rec.idle_timeout_s
                                         or ctx.settings.machine_idle_s),
                    created_at=a.machine_created_at or a.created_at))
            ctx.store.add(*records)
        return rec

    async def forget(self, sandbox_id: str, why: str = "owned by another node",
                     keep: str | None = None) -> bool:
        """End the sandbox's VMM if any and drop its records, machine and sleep snapshots
        (never a user snapshot: forks may still need it; nor ``keep``'s files). Returns
        False when there was no record."""
        ctx = self.ctx
        async with ctx.registry.lock(sandbox_id):
            rec = ctx.store.get(sandbox_id)
            if rec is None:
                return False
            if rec.state not in (State.SLEEPING, State.FAILED):
                log.warning("VMM ended: its sandbox belongs elsewhere",
                            extra={"sandbox_id": sandbox_id, "state": rec.state.value})
            await self.launcher.stop(sandbox_id, rec.pid)
            for snap in ctx.store.list(SnapshotRecord):
                if snap.sandbox_id == sandbox_id and snap.kind == "sleep":
                    if snap.id == keep:
                        ctx.store.remove(SnapshotRecord, snap.id)
                    else:
                        self.removal.drop_snapshot(snap.id)
            ctx.store.discard(sandbox_id, set(State))
            for mach in ctx.store.list(MachineRecord):
                if mach.sandbox_id == sandbox_id:
                    ctx.store.remove(MachineRecord, mach.user_id)
        log.info("local sandbox dropped", extra={"sandbox_id": sandbox_id, "reason": why})
        return True

    def receive(self, snap: SharedSnapshot) -> bool:
        """Record a snapshot fetched from shared storage (a fork of one made elsewhere).
        Returns False when this host has it already."""
        if self.ctx.store.find(SnapshotRecord, snap.id) is not None:
            return False
        self.ctx.store.add(snap.record())
        return True

    def has_snapshot(self, snapshot_id: str) -> bool:
        return self.ctx.store.find(SnapshotRecord, snapshot_id) is not None

    def fence(self) -> int:
        """SIGKILL every VMM of this host at once (those the registry knows and any other
        VMM process of this data directory); returns how many. The core then finds them
        dead and records it, as after any crash."""
        ctx = self.ctx
        pids = {rt.vm.pid for sid in ctx.registry.ids() if (rt := ctx.registry.get(sid))}
        pids |= {pid for pid, _ in vmm_processes(ctx.layout.sandboxes)}
        for pid in pids:
            kill_process(pid, ctx.engine.helper)  # the root helper's, under a split
        return len(pids)
