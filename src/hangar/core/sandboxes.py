"""The orchestrator's front: one ``SandboxManager`` per server, wiring the parts.

``SandboxManager`` is the only writer of sandbox and snapshot records. It
owns no logic of its own beyond reading records; each responsibility is a
module of ``hangar.core`` with a public surface the others use:

=================  ==============================================================
``context``        what the parts share: settings, store, engine, metrics, event bus
``admission``      ``CreateOptions``, the cap on concurrent VMMs, new records
``registry``       runtimes (VM, agent, busy count), per-sandbox locks, creates
                   in flight
``launch``         NIC, VMM start (boot or restore), agent handshake, stop
``creation``       create (warm pool or cold boot), the create protocol forks share
``removal``        delete, expiry, a dead VMM; snapshot files
``snapshots``      take, restore in place, fork, list, remove
``sleep``          sleep and wake; pause, connect, settled: the verbs protocols use
``guestcalls``     exec, files, tunnels, file watches (wake a sleeping sandbox first)
``commands``       the typed surface of guest calls: Command, ExecResult, FileEntry, HOME
``desktop``        computer use and the VNC connection (``SandboxManager.desktop``)
``terminals``      terminal sessions (pty) that outlive their viewers
``processes``      background processes that outlive their connection (the guest's
                   process table): start, list, attach, stdin, signal, kill
``ports``          exposed guest ports and their signed URL tokens
``reconcile``      the loop that moves current states toward desired ones
``recovery``       start-up: adopt, resume, finish or undo what a dead server left
``pool``           the warm pool
``lifecycle``      the states and the table of allowed moves
``store``          records; every state change is a compare-and-set
``publish``        the events that follow state changes
``testhooks``      test-only: crash at a named step, hold a wake up
``hooks``          a cluster node's part in wakes, saved snapshots and forks (no-ops alone)
``handover``       a cluster's placed creates, adopted sandboxes, sandboxes given up
``views``          frozen views of records (what the face answers with)
``surfaces``       the face's sub-surfaces that wrap a part (volumes, secrets, network)
``service``        the face: the one module api and cluster import
``tasks``          background tasks: started by name, crashes logged, stopped on close
=================  ==============================================================

Rules:

* A create that fails at any step removes the VM, its files and its record;
  a delete during a create makes the create answer 409.
* A delete ends the VM, removes its files and leaves a ``deleted`` tombstone.
* Every VMM counts against ``max_sandboxes`` (pooled ones too).
* Snapshot, sleep, wake, restore, delete, expiry, crash handling and pool
  retirement hold the sandbox's lock; guest calls mark it busy, and a
  snapshot or sleep of a busy sandbox is refused with ``Busy`` (409, retryable).
* A server killed at any step comes back consistent (``recovery``).
* Outside core (api, cluster) the manager is used only through its face:
  the names in ``SandboxManager.PUBLIC`` and the verbs of the sub-surfaces
  in ``SandboxManager.SURFACES``; records leave it only as views
  (``hangar.core.views``). ``tests/test_layers.py`` checks both.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import replace
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING, Any

from hangar.config import Settings
from hangar.core.admission import Admission, CreateOptions, new_id
from hangar.core.secret_proxy import SecretProxies
from hangar.core.secrets import Vault
from hangar.core.commands import Command
from hangar.core.context import Context
from hangar.core.creation import Creation
from hangar.core.events import EventBus
from hangar.core.guestcalls import GuestCalls
from hangar.core.builds import Builds
from hangar.core.pulls import ImagePulls
from hangar.core.acting import acting
from hangar.core.teams import Teams
from hangar.core.processes import Processes
from hangar.core.handover import Adoptee, Handover, Placement, SharedSnapshot
from hangar.core.hooks import Hooks
from hangar.core.launch import Launcher, renet_meta
from hangar.core.lifecycle import GONE, State
from hangar.core.pool import WarmPool, templates
from hangar.core.ports import Ports
from hangar.core.publish import announce
from hangar.core.reconcile import Reconciler
from hangar.core.recovery import Recovery
from hangar.core.registry import Registry
from hangar.engines.memory import MemoryUsage
from hangar.core.removal import Removal
from hangar.core.sleep import SETTLE_S, Connected, Sleeper
from hangar.core.memory import Memory
from hangar.core.snapshots import Snapshots
from hangar.core.starts import StartsView
from hangar.core.store import SnapshotRecord, Store
from hangar.core.surfaces import CodeFace, FilesFace, NetworkFace, SecretsFace, VolumesFace
from hangar.core.terminals import Terminals
from hangar.core.views import SandboxView, SnapshotView
from hangar.engines.base import Engine
from hangar.errors import Conflict, HangarError
from hangar.engines.agent_client import AgentClient, ExecEvent, ExecResult, Tunnel
from hangar.layout import Layout
from hangar.metrics import Capacity, Metrics

if TYPE_CHECKING:
    from hangar.core.desktop import Desktop

log = logging.getLogger("hangar.sandboxes")

PURGE_EVERY_S = 60.0
"""Longest gap between two purges of old tombstones (``SandboxManager.purge``), seconds."""

__all__ = ["CreateOptions", "SandboxManager", "new_id", "renet_meta"]


def _for_team(opts: CreateOptions) -> CreateOptions:
    """``opts`` made for the acting team when it names none (``core.teams``)."""
    team = acting()
    return replace(opts, team=team) if team is not None and opts.team is None else opts


class SandboxManager:
    """Creates, tracks, snapshots and removes sandboxes. One per server process.

    Its face (``hangar.core.service``): the methods and attributes in ``PUBLIC``, and the
    sub-surfaces in ``SURFACES`` (``m.ports.expose(...)``); everything else on it
    (``launcher``, ``calls``, ``store``, ``registry``...) is core's own."""

    SURFACES = ("files", "ports", "processes", "terminals", "desktop", "volumes", "secrets",
                "network", "code", "builds", "pulls", "teams", "host_memory", "settings",
                "events")
    """Attributes that are sub-surfaces: outside core, ``m.<surface>.<verb>`` is allowed
    for their public verbs (``settings`` and ``events`` are the server's settings and
    event bus, shared as they are)."""

    PUBLIC = frozenset(SURFACES) | {
        "start", "close", "net", "policy", "get", "find", "list", "ids", "in_states", "vmm_count",
        "on_transition", "create_in_flight", "memory", "set_timeout", "capacity",
        "starts",
        "state_counts", "engine_name", "engine_accel", "describe_engine", "pool_status",
        "create", "provision", "delete", "snapshot", "restore", "fork", "adopt", "forget", "fence",
        "get_snapshot", "named_snapshot", "list_snapshots", "delete_snapshot", "has_snapshot",
        "receive_snapshot", "sleep", "wake", "want", "pause", "connect", "settled", "extend",
        "sleeps_cold",
        "exec", "exec_stream", "tunnel", "agent", "port_key"}
    """The face's names that api and cluster may use on the manager."""

    def __init__(self, settings: Settings, layout: Layout, store: Store, engine: Engine,
                 metrics: Metrics, events: EventBus | None = None,
                 hooks: Hooks | None = None, secret_key: bytes | None = None) -> None:
        self.settings = settings
        self.layout = layout
        self.store = store
        self.engine = engine
        self.metrics = metrics
        self.events = events or EventBus()
        self.registry = Registry()
        ctx = self.ctx = Context(settings, layout, store, engine, metrics, self.events,
                                 self.registry, hooks or Hooks())
        store.on_transition(lambda rec, frm, to: announce(ctx, rec, frm, to))
        self.admission = Admission(ctx)
        self.teams = Teams(ctx)
        """Teams, their quotas and who sees what (``core.teams``)."""
        self.admission.teams = self.teams
        self.launcher = Launcher(ctx, secret_key)
        self.launcher.volumes.teams = self.teams
        self.removal = Removal(ctx, self.launcher)
        targets = templates(settings)
        self.pool: WarmPool | None = (
            WarmPool(ctx, self.admission, self.launcher, targets, settings.pool_max_age_s)
            if targets else None)
        self.creation = Creation(ctx, self.admission, self.launcher, self.pool)
        self.snapshots = Snapshots(ctx, self.admission, self.launcher, self.removal,
                                   self.creation)
        self.sleeper = Sleeper(ctx, self.admission, self.launcher, self.removal, self.snapshots)
        self.host_memory = Memory(ctx, self.admission, self.sleeper, self.launcher.volumes)
        """The host's memory: figures, pressure and its relief (``core.memory``)."""
        self.admission.memory = self.host_memory
        self.calls = GuestCalls(ctx, self.launcher, self.sleeper)
        self.terminals = Terminals(self.calls.using, ctx.publish, self.launcher.vault.env)
        self.files = FilesFace(self.calls)
        """A sandbox's files (``core.surfaces.FilesFace``)."""
        self.processes = Processes(self.calls)
        """Background processes that outlive their connection (``core.processes``)."""
        self.ports = Ports(ctx)
        self.secrets = SecretsFace(self.launcher.vault, self.launcher.secret_proxies)
        self.teams.count("secrets", self.launcher.vault.held_by)
        """The vault, as views (``core.surfaces.SecretsFace``)."""
        self.network = NetworkFace(self.launcher.rules, self.launcher.secret_proxies)
        """Running sandboxes' egress rules (``core.surfaces.NetworkFace``)."""
        self._volumes = VolumesFace(self.launcher.volumes)
        self.code = CodeFace(self)
        """The code interpreter (``core.surfaces.CodeFace``)."""
        self.builds = Builds(self)
        self.teams.count("templates", self.builds.held_by)
        """Template builds in build sandboxes (``core.builds``)."""
        self.pulls = ImagePulls(settings, layout.root, engine.helper)
        """A registry's images pulled as Hangar images, for builds (``core.pulls``)."""
        self.reconciler = Reconciler(ctx, self.removal, self.sleeper, self.snapshots, self.pool,
                                     concurrency=settings.reconcile_concurrency)
        self.reconciler.add_pass("unresponsive", self.calls.probe_unresponsive)
        self.reconciler.add_pass("memory", self.host_memory.pressure_pass)
        self.reconciler.add_pass("purge", self.purge)
        self._purged_at = 0.0
        self.recovery = Recovery(ctx, self.launcher, self.removal)
        self.handover = Handover(ctx, self.launcher, self.removal)
        self._desktop: Desktop | None = None
        metrics.watch_states(self.state_counts)
        metrics.watch_capacity(self.capacity)
        metrics.watch_teams(self.teams.figures)

    @property
    def volumes(self) -> VolumesFace:
        """Named volumes, as views (``core.surfaces.VolumesFace``)."""
        return self._volumes

    @property
    def net(self) -> Any:
        """The network manager (``hangar.net.NetworkManager``), or None when networking is off."""
        return self.launcher.net

    def policy(self, requested: Any) -> dict[str, Any] | None:
        """The egress policy a sandbox gets; see ``Launcher.policy``."""
        return self.launcher.policy(requested)

    # -- start and stop ----------------------------------------------------------------

    async def start(self) -> None:
        """Recover what a previous server left, start the reconcile loop, fill the pool."""
        await self.recovery.run()
        self.launcher.volumes.sweep()
        await self.launcher.recover_secrets()
        self.reconciler.start()
        if self.pool is not None:
            self.pool.kick()

    async def close(self) -> None:
        """Stop background work, end pool VMs and drop agent connections; sandboxes keep running."""
        await self.reconciler.close()
        await self.builds.close()
        await self.pulls.close()
        await self.launcher.secret_proxies.stop_all(keep_rules=True)
        await self.terminals.shutdown()
        if self.pool is not None:
            await self.pool.close()
        await self.registry.close()
        await self.launcher.rules.close()

    @property
    def vault(self) -> "Vault":
        """The vault of secrets (``hangar.core.secrets``)."""
        return self.launcher.vault

    @property
    def secret_proxies(self) -> "SecretProxies":
        """Sandboxes' secret-injecting proxies (``hangar.core.secret_proxy``); the network
        rules' changes go to ``update_rules``."""
        return self.launcher.secret_proxies

    # -- records -----------------------------------------------------------------------

    def get(self, sandbox_id: str) -> SandboxView:
        """A sandbox. Raises NotFound (unknown, deleted) or Gone (expired)."""
        return SandboxView.of(self.ctx.record(sandbox_id))

    def find(self, sandbox_id: str) -> SandboxView | None:
        """A sandbox in any state (pooled, ended ones too), or None when there is no record."""
        rec = self.store.get(sandbox_id)
        return None if rec is None else SandboxView.of(rec)

    def in_states(self, states: Iterable[State]) -> list[SandboxView]:
        """Sandboxes in ``states`` (pooled ones too when asked)."""
        return [SandboxView.of(r) for r in self.store.in_states(states)]

    def vmm_count(self) -> int:
        """Sandboxes that hold a VMM (the ones counted against ``max_sandboxes``)."""
        return len(self.store.with_vmm())

    def on_transition(self, listener: Callable[[SandboxView, frozenset[State], State], None]
                      ) -> None:
        """Call ``listener(sandbox, the states it was expected in, the new state)`` after
        every state change (in the writer's thread; it must be quick and not raise)."""
        self.store.on_transition(lambda rec, frm, to: listener(SandboxView.of(rec), frm, to))

    def create_in_flight(self, sandbox_id: str) -> bool:
        """Whether this server is creating ``sandbox_id`` right now."""
        return self.registry.create_in_flight(sandbox_id)

    @property
    def engine_name(self) -> str:
        """The engine's name (``firecracker``, ``qemu``)."""
        return self.engine.name

    @property
    def engine_accel(self) -> str:
        """The engine's acceleration (``kvm``, ``tcg``...)."""
        return self.engine.accel

    def describe_engine(self) -> dict[str, str]:
        """The engine as ``/health`` shows it."""
        return self.engine.describe()

    def pool_status(self) -> dict[str, Any] | None:
        """The warm pool's sizes (``WarmPool.status``), or None when there is no pool."""
        return self.pool.status() if self.pool is not None else None

    @property
    def port_key(self) -> bytes:
        """The secret that signs this server's port tokens (E2B's access tokens derive
        from it)."""
        return self.ports.key.key()

    async def memory(self, sandbox_id: str) -> MemoryUsage | None:
        """What the sandbox's running VM costs the host and its guest uses (MiB); None when
        this server holds no running VM for it (sleeping, stopped, being created)."""
        rt = self.registry.get(sandbox_id)
        if rt is None or not rt.vm.alive():
            return None
        return await self.engine.memory(rt.vm)

    def list(self) -> list[SandboxView]:
        """Sandboxes that exist or failed (not deleted, expired or pooled), oldest first:
        the acting team's only, when a team acts (``core.teams``)."""
        return [SandboxView.of(r) for r in self.store.visible() if Teams.visible(r)]

    def ids(self) -> list[str]:
        """Ids of the sandboxes ``list`` returns, oldest first, without reading their
        records (one query of one column)."""
        return self.store.visible_ids()

    async def purge(self) -> int:
        """Remove the records of sandboxes deleted or expired more than
        ``purge_retention_s`` ago (a reconcile pass; it works at most every
        ``PURGE_EVERY_S`` seconds, or half the retention when that is shorter).
        Returns how many went."""
        keep = self.settings.purge_retention_s
        now = time.time()
        if now - self._purged_at < min(PURGE_EVERY_S, keep / 2):
            return 0
        self._purged_at = now
        n = await asyncio.to_thread(self.store.purge, now - keep)
        if n:
            log.info("old sandbox records purged", extra={"records": n, "retention_s": keep})
        return n

    def set_timeout(self, sandbox_id: str, timeout_s: float) -> SandboxView:
        """Make the sandbox expire ``timeout_s`` seconds from now (0: never)."""
        rec = self.get(sandbox_id)
        if rec.state in (State.STOPPING, State.FAILED):
            raise Conflict(f"sandbox {sandbox_id} is {rec.state.value}", sandbox_id=sandbox_id)
        expires = time.time() + timeout_s if timeout_s else None
        return SandboxView.of(self.store.update(sandbox_id, expires_at=expires))

    def capacity(self) -> Capacity:
        """VMMs against their cap, guest memory against the budget, the pool and free disk
        (the gauges of ``hangar.metrics``)."""
        disk = os.statvfs(self.layout.root)
        pool = self.pool
        mem = self.host_memory.view()
        starts = self.admission.starts.view()
        return Capacity(
            vmms=len(self.store.with_vmm()), vmm_limit=self.settings.max_sandboxes,
            memory_committed_mib=mem.declared, memory_budget_mib=mem.budget,
            pool_ready=pool.ready_by_template() if pool is not None else {},
            pool_target=dict(pool.targets) if pool is not None else {},
            data_free_bytes=disk.f_bavail * disk.f_frsize, memory_allowed_mib=mem.allowed,
            memory_used_mib=mem.used, host_available_mib=mem.available,
            headroom_mib=mem.headroom, starts_running=starts.running,
            starts_limit=starts.limit, start_queued=starts.queued,
            start_queue_limit=starts.queue)

    def starts(self) -> StartsView:
        """Starts in progress and queued against their limits (``core.starts``)."""
        return self.admission.starts.view()

    def state_counts(self) -> dict[str, int]:
        """Sandboxes by state (tombstones not counted), for ``hangar_sandboxes{state}``."""
        counts = {s.value: 0 for s in State if s not in GONE}
        for state, n in self.store.state_counts().items():
            counts[state.value] = n
        return counts

    # -- lifecycle ---------------------------------------------------------------------

    async def create(self, opts: CreateOptions,
                     placement: Placement | None = None) -> SandboxView:
        """See ``Creation.create``; ``placement``: the id a cluster claimed for it. Made
        for the acting team (``core.teams``) unless ``opts`` names one."""
        return SandboxView.of(await self.creation.create(_for_team(opts), placement))

    async def provision(self, opts: CreateOptions, *, snapshot_id: str | None = None,
                        prepare: Callable[[str], Awaitable[object]] | None = None,
                        shared: bool = False) -> SandboxView:
        """A sandbox made ready in one verb: created from ``opts`` (or forked from the
        snapshot ``snapshot_id``; ``shared``: it may be the operator's, a built template's
        that a team starts from: ``Snapshots.get``), then ``prepare(sandbox_id)`` run in it
        (a guest setup a protocol needs, such as E2B's default user) while it has no
        expiry, and only then
        its time to live started (``opts.timeout_s`` seconds, else the server's default; 0:
        none). All or nothing: on any failure, the create's or ``prepare``'s, the sandbox
        is deleted and the error raised. Raises what ``create``/``fork`` and ``prepare``
        raise, and Conflict when it was deleted meanwhile."""
        ttl = opts.timeout_s if opts.timeout_s is not None else self.settings.default_timeout_s
        clockless = replace(opts, timeout_s=0)  # no expiry until it is ready
        rec = (await self.fork(snapshot_id, clockless, shared=shared)
               if snapshot_id is not None else await self.create(clockless))
        try:
            if prepare is not None:
                await prepare(rec.id)
            cur = self.get(rec.id)
            if cur.state in (State.STOPPING, State.FAILED, *GONE):
                raise Conflict(f"sandbox {rec.id} was deleted while being created",
                               sandbox_id=rec.id)
            now = time.time()
            done = self.store.update(rec.id, ttl_s=ttl or None,
                                     expires_at=now + ttl if ttl else None)
            if done is None:
                raise Conflict(f"sandbox {rec.id} was deleted while being created",
                               sandbox_id=rec.id)
        except BaseException:
            with contextlib.suppress(HangarError):  # deleted meanwhile: nothing left to do
                await self.delete(rec.id)
            raise
        return SandboxView.of(done)

    async def delete(self, sandbox_id: str) -> None:
        """See ``Removal.delete``."""
        await self.removal.delete(sandbox_id)

    async def snapshot(self, sandbox_id: str, name: str | None = None) -> SnapshotView:
        """See ``Snapshots.snapshot``."""
        return SnapshotView.of(await self.snapshots.snapshot(sandbox_id, name))

    async def restore(self, sandbox_id: str, snapshot_id: str) -> SandboxView:
        """See ``Snapshots.restore``."""
        return SandboxView.of(await self.snapshots.restore(sandbox_id, snapshot_id))

    async def fork(self, snapshot_id: str, opts: CreateOptions,
                   placement: Placement | None = None, shared: bool = False) -> SandboxView:
        """See ``Snapshots.fork``; ``placement``: the id a cluster claimed for it. Made
        for the acting team (``core.teams``) unless ``opts`` names one."""
        return SandboxView.of(await self.snapshots.fork(snapshot_id, _for_team(opts),
                                                        placement, shared))

    async def adopt(self, adoptee: Adoptee) -> SandboxView:
        """Take over a sleeping sandbox from another node. See ``Handover.adopt``."""
        return SandboxView.of(await self.handover.adopt(adoptee))

    async def forget(self, sandbox_id: str, why: str = "owned by another node") -> bool:
        """Drop a sandbox another node owns now. See ``Handover.forget``."""
        return await self.handover.forget(sandbox_id, why)

    def fence(self) -> int:
        """SIGKILL every VMM of this host (a cut-off cluster node). See ``Handover.fence``."""
        return self.handover.fence()

    def get_snapshot(self, snapshot_id: str) -> SnapshotView:
        """One snapshot. Raises NotFound."""
        return SnapshotView.of(self.snapshots.get(snapshot_id))

    def named_snapshot(self, name: str) -> SnapshotView:
        """See ``Snapshots.named``."""
        return SnapshotView.of(self.snapshots.named(name))

    def list_snapshots(self, sandbox_id: str | None = None) -> list[SnapshotView]:
        """Snapshots (of ``sandbox_id`` when given), oldest first."""
        return [SnapshotView.of(s) for s in self.snapshots.list(sandbox_id)]

    def delete_snapshot(self, snapshot_id: str) -> None:
        """Remove a snapshot and its files. Raises NotFound, Conflict (in use)."""
        self.snapshots.delete(snapshot_id)

    def has_snapshot(self, snapshot_id: str) -> bool:
        """Whether this host has a record of ``snapshot_id``."""
        return self.handover.has_snapshot(snapshot_id)

    def receive_snapshot(self, snap: SharedSnapshot) -> bool:
        """Record a snapshot fetched from shared storage; False when this host has it.
        See ``Handover.receive``."""
        return self.handover.receive(snap)

    async def sleep(self, sandbox_id: str) -> SandboxView:
        """See ``Sleeper.sleep``."""
        return SandboxView.of(await self.sleeper.sleep(sandbox_id))

    async def wake(self, sandbox_id: str) -> SandboxView:
        """See ``Sleeper.wake``."""
        return SandboxView.of(await self.sleeper.wake(sandbox_id))

    def want(self, sandbox_id: str, state: State) -> SandboxView:
        """See ``Sleeper.want``."""
        return SandboxView.of(self.sleeper.want(sandbox_id, state))

    async def pause(self, sandbox_id: str, memory: bool | None = None) -> SandboxView:
        """Sleep with the clock stopped, keeping its memory or (``memory`` False) its disk
        alone, the wake then a cold boot (``Sleeper.pause``)."""
        return SandboxView.of(await self.sleeper.pause(sandbox_id, memory))

    def sleeps_cold(self, sandbox_id: str) -> bool:
        """True when the sandbox sleeps in a snapshot of its disk alone: its wake boots it
        cold (``Sleeper.pause`` with ``memory`` False). Raises NotFound, Gone."""
        rec = self.ctx.record(sandbox_id)
        snap = (self.store.find(SnapshotRecord, rec.sleep_snapshot)
                if rec.state == State.SLEEPING and rec.sleep_snapshot else None)
        return snap is not None and snap.memory is False

    async def connect(self, sandbox_id: str, ttl_s: float,
                      settle_s: float = SETTLE_S) -> Connected:
        """Wake or extend, saying which (``Sleeper.connect``)."""
        return await self.sleeper.connect(sandbox_id, ttl_s, settle_s)

    async def settled(self, sandbox_id: str, timeout_s: float = SETTLE_S) -> SandboxView:
        """The sandbox once it is between no two states (``Sleeper.settled``)."""
        return SandboxView.of(await self.sleeper.settled(sandbox_id, timeout_s))

    def extend(self, sandbox_id: str, ttl_s: float) -> SandboxView:
        """Live at least ``ttl_s`` seconds more, never less (``Sleeper.extend``)."""
        return SandboxView.of(self.sleeper.extend(sandbox_id, ttl_s))

    # -- guest calls ------------------------------------------------------------------
    # Typed operations in a sandbox's guest (``hangar.core.commands``: Command, FileEntry,
    # HOME...); each wakes a sleeping sandbox first and holds it busy while it runs. See
    # ``GuestCalls`` for the errors each raises. Files are ``self.files``.

    @asynccontextmanager
    async def using(self, sandbox_id: str) -> AsyncIterator[AgentClient]:
        """The core's own access to a sandbox's agent; see ``GuestCalls.using``."""
        async with self.calls.using(sandbox_id) as agent:
            yield agent

    async def exec(self, sandbox_id: str, cmd: Command | dict[str, Any],
                   stdin: bytes | None = None, shown: str | None = None) -> ExecResult:
        """See ``GuestCalls.exec``."""
        return await self.calls.exec(sandbox_id, cmd, stdin, shown)

    def exec_stream(self, sandbox_id: str, cmd: Command | dict[str, Any],
                    stdin: bytes | None = None, shown: str | None = None,
                    ) -> AsyncIterator[ExecEvent]:
        """See ``GuestCalls.exec_stream``."""
        return self.calls.exec_stream(sandbox_id, cmd, stdin, shown)

    def tunnel(self, sandbox_id: str, port: int,
               busy: bool = True) -> AbstractAsyncContextManager[Tunnel]:
        """See ``GuestCalls.tunnel``: ``async with m.tunnel(id, port) as conn: ...``;
        ``busy=False``: the tunnel does not hold the sandbox busy (proxied traffic)."""
        return self.calls.tunnel(sandbox_id, port, busy=busy)

    async def agent(self, sandbox_id: str) -> AgentClient:
        """See ``GuestCalls.agent``."""
        return await self.calls.agent(sandbox_id)

    @property
    def desktop(self) -> Desktop:
        """Computer use on this manager's desktop sandboxes (``hangar.core.desktop``)."""
        if self._desktop is None:
            from hangar.core.desktop import Desktop

            self._desktop = Desktop(self)
        return self._desktop
