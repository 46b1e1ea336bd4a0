"""The orchestrator: sandbox lifecycle, snapshots, sleep and wake, limits.

``SandboxManager`` is the only writer of sandbox and snapshot records. It
asks the engine for VMs, keeps one agent connection per running sandbox,
enforces the cap on concurrent VMs, and runs one reconcile loop that moves
each sandbox's current state toward its desired one (``hangar.core.states``).

Rules:

* A create that fails at any step removes the VM, its files and its record.
* A delete ends the VM, removes its files and leaves a ``deleted`` tombstone.
* Every VMM counts against ``max_sandboxes`` (pooled ones too); the check
  and the new record happen under one lock, so a storm cannot overshoot.
* A snapshot is refused with ``Busy`` (409, retryable) while a command or
  file transfer runs in the sandbox; while one is taken, new calls wait.
* A sandbox with an idle timeout (a user's machine) sleeps when idle: it is
  snapshotted and its VMM ended. Any call to a sleeping sandbox wakes it
  (restore from the sleep snapshot, clock and entropy refreshed) and then
  runs; the caller does nothing.
* On start, VMMs that still run are adopted; everything else a crashed
  server left (VMM processes, disks, sockets, partial snapshots) is removed.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from hangar.config import Settings
from hangar.core.states import GONE, State
from hangar.core.store import SandboxRecord, SnapshotRecord, Store
from hangar.engines.base import VM, Engine, VMSpec, kill_process
from hangar.engines.snapshot_io import refresh_guest
from hangar.errors import (
    Busy, Conflict, GuestError, Gone, HangarError, InvalidRequest, LimitExceeded, NotFound,
)
from hangar.guest.client import AgentClient, ExecEvent, ExecResult
from hangar.images import RECIPES, GuestImage, resolve_image
from hangar.layout import Layout
from hangar.metrics import Metrics
from hangar.net import NetAttachment, NetworkManager, Policy

log = logging.getLogger("hangar.sandboxes")

WATCH_INTERVAL_S = 1.0


@dataclass(frozen=True)
class CreateOptions:
    """What a create asks for; ``None`` takes the server's default.

    Sizes in MiB; ``timeout_s`` is the time to live in seconds (0: none);
    ``idle_timeout_s`` makes the sandbox sleep after that many idle seconds.
    """

    image: str | None = None
    vcpus: int | None = None
    memory_mib: int | None = None
    disk_mib: int | None = None
    timeout_s: float | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    desktop: str | None = None
    """Screen as ``WIDTHxHEIGHTxDEPTH`` (pixels, bits); starts the guest's desktop."""
    idle_timeout_s: float | None = None
    network: Any = None
    """Egress policy: ``none``, ``internet``, ``open`` or a dict with ``egress``,
    ``allow`` and ``deny`` CIDR lists; None takes the server's default."""


@dataclass
class Runtime:
    """In-memory state of one sandbox that has a VMM."""

    vm: VM
    agent: AgentClient | None = None
    connect_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    busy: int = 0


def check_desktop(screen: str, image: GuestImage) -> None:
    """Refuse at create a desktop that could never start: a bad size, or an image without X.

    Raises InvalidRequest naming the problem.
    """
    from hangar.guest.desktop import parse_geometry
    from hangar.images import RECIPES

    try:
        parse_geometry(screen)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    recipe = RECIPES.get(image.name)
    if recipe is not None and "xvfb" not in recipe.packages:
        raise InvalidRequest(f"image {image.name!r} has no desktop; use an image with one, "
                             "such as 'desktop'", image=image.name)


def renet_meta(net: NetAttachment) -> dict[str, Any]:
    """An exec that gives a restored guest's NIC ``net``'s MAC and address."""
    script = (
        'dev=$(ls /sys/class/net | grep -v "^lo$" | head -n1); '
        'ip link set dev "$dev" down; ip link set dev "$dev" address "$1"; '
        'ip addr flush dev "$dev"; '
        'exec python3 -c "import sys; from hangar.guest import net; net.configure(sys.argv[1])" "$2"'
    )
    return {"op": "exec", "argv": ["/bin/sh", "-c", script, "renet", net.mac, net.kernel_arg()],
            "env": {"PYTHONPATH": "/usr/lib/hangar/python"}, "timeout": 20}


def new_id(prefix: str = "sb-") -> str:
    return prefix + secrets.token_hex(6)


class SandboxManager:
    """Creates, tracks, snapshots and removes sandboxes. One per server process."""

    def __init__(self, settings: Settings, layout: Layout, store: Store, engine: Engine,
                 metrics: Metrics) -> None:
        self.settings = settings
        self.layout = layout
        self.store = store
        self.engine = engine
        self.metrics = metrics
        self.pool: Any = None  # hangar.core.pool.WarmPool, set by the app
        self._runtimes: dict[str, Runtime] = {}
        self._gates: dict[str, asyncio.Lock] = {}
        self._admit = asyncio.Lock()
        self._watcher: asyncio.Task[None] | None = None
        self.net = self._network(settings)
        metrics.watch_states(self.state_counts)

    @staticmethod
    def _network(settings: Settings) -> NetworkManager | None:
        if settings.network == "off":
            return None
        mode = "auto" if settings.network == "auto" else settings.network
        return NetworkManager(bridge=settings.net_bridge, pool=settings.net_pool,
                              dns=settings.net_dns, mode=mode)  # type: ignore[arg-type]

    def policy(self, requested: Any) -> dict[str, Any] | None:
        """The egress policy a sandbox gets, as stored; None means no NIC.

        Raises InvalidRequest for a bad policy, or one networking cannot
        honour here (e.g. ``internet`` filtering without TAP devices).
        """
        if self.net is None:
            if requested not in (None, "none") and Policy.parse(requested).egress != "none":
                raise InvalidRequest("guest networking is off on this server (HANGAR_NETWORK)")
            return None
        if requested is None:
            requested = "internet" if self.net.mode == "tap" else "none"
        policy = Policy.parse(requested)
        if policy.egress == "none":
            return None
        if self.net.mode == "user" and (policy.egress != "open" or policy.allow or policy.deny):
            raise InvalidRequest("without TAP networking (not root) guests can only get "
                                 "egress 'open' or 'none'")
        return policy.model_dump(mode="json")

    async def _attach(self, rec: SandboxRecord) -> NetAttachment | None:
        if self.net is None or not rec.network:
            return None
        return await self.net.attach_async(rec.id, rec.network)

    async def _detach(self, sandbox_id: str) -> None:
        if self.net is None:
            return
        try:
            await self.net.release_async(sandbox_id)
        except Exception as exc:  # never block a state change on the network
            log.warning("network release failed", extra={"sandbox_id": sandbox_id,
                                                           "error": str(exc)})

    # -- start-up and the reconcile loop -----------------------------------

    async def start(self) -> None:
        """Reconcile the store with what runs on the host, then start the loop."""
        for rec in self.store.live():
            await self._recover(rec)
        self._sweep_orphans()
        if self.net is not None:
            ok, reason = self.net.available()
            if self.net.mode != "user" and not ok:
                log.warning("TAP networking unavailable", extra={"reason": reason})
            if self.net.mode == "tap":
                await asyncio.to_thread(self.net.start)
                removed = await self.net.sweep_async(
                    [r.id for r in self.store.live() if r.state != State.SLEEPING.value])
                if removed:
                    log.info("stale network devices removed", extra={"count": len(removed)})
        self._watcher = asyncio.create_task(self._watch())

    async def _recover(self, rec: SandboxRecord) -> None:
        vm = self.engine.adopt(rec.id, self.layout.sandbox(rec.id), rec.pid or -1)
        state = State(rec.state)
        if state == State.SLEEPING:
            return
        if vm is not None and state in (State.RUNNING, State.SNAPSHOTTING, State.WAKING):
            self._runtimes[rec.id] = Runtime(vm)
            self.store.update(rec.id, state=State.RUNNING)
            log.info("sandbox adopted", extra={"sandbox_id": rec.id, "pid": vm.pid})
            return
        if state == State.WAKING and rec.sleep_snapshot:
            await self._stop_vm(rec.id, vm)
            self.store.update(rec.id, state=State.SLEEPING, pid=None)
            return
        if state in (State.CREATING, State.POOLED):
            await self._stop_vm(rec.id, vm)
            self.store.delete(rec.id) if state == State.CREATING else self.store.update(
                rec.id, state=State.DELETED, pid=None)
            return
        final = State.DELETED if state == State.STOPPING else State.FAILED
        await self._stop_vm(rec.id, vm)
        self.store.update(rec.id, state=final, pid=None,
                          error=None if final == State.DELETED else
                          "the VMM was gone when the server started")

    def _sweep_orphans(self) -> None:
        """Remove sandbox folders and snapshot folders that no record owns."""
        live = {r.id for r in self.store.live()}
        for d in self.layout.sandboxes.iterdir():
            if d.name in live:
                continue
            try:
                pid = int((d / "vmm.pid").read_text())
            except (OSError, ValueError):
                pid = -1
            vm = self.engine.adopt(d.name, self.layout.sandbox(d.name), pid)
            if vm is not None:
                kill_process(vm.pid)
            shutil.rmtree(d, ignore_errors=True)
            log.info("orphan sandbox folder removed", extra={"sandbox_id": d.name})
        snaps = {s.id for s in self.store.list(SnapshotRecord)}
        for d in self.layout.snapshots.iterdir():
            if d.name not in snaps:
                shutil.rmtree(d, ignore_errors=True)
                log.info("orphan snapshot folder removed", extra={"snapshot_id": d.name})

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            try:
                await self.reconcile()
            except Exception:  # the loop must outlive any one failure
                log.exception("reconcile pass failed")

    async def reconcile(self) -> None:
        """One pass: expire, notice dead VMMs, sleep idle machines, honour desired states."""
        now = time.time()
        for rec in self.store.live():
            state = State(rec.state)
            sid = rec.id
            if rec.expires_at is not None and rec.expires_at <= now and state in (
                    State.RUNNING, State.SLEEPING):
                await self._finish(sid, State.EXPIRED, None)
                log.info("sandbox expired", extra={"sandbox_id": sid})
                continue
            rt = self._runtimes.get(sid)
            if state == State.RUNNING and rt is not None and not rt.vm.alive():
                log.warning("VMM died", extra={"sandbox_id": sid, "pid": rt.vm.pid})
                await self._finish(sid, State.FAILED, "the VMM process exited")
                continue
            idle = rec.metadata_.get("idle_timeout_s") if rec.metadata_ else None
            if (state == State.RUNNING and idle and rt is not None and rt.busy == 0
                    and now - max(rec.last_active_at, rec.created_at) >= float(idle)):
                self.store.update(sid, desired_state=State.SLEEPING)
                rec.desired_state = State.SLEEPING.value
                log.info("sandbox idle", extra={"sandbox_id": sid, "idle_s": float(idle)})
            try:
                if rec.desired_state == State.SLEEPING.value and state == State.RUNNING:
                    await self.sleep(sid)
                elif rec.desired_state == State.RUNNING.value and state == State.SLEEPING:
                    await self.wake(sid)
            except HangarError as exc:
                log.warning("reconcile step failed", extra={"sandbox_id": sid,
                                                            "error": exc.message})
        if self.pool is not None:
            await self.pool.maintain()

    async def close(self) -> None:
        """Stop background work and drop agent connections; VMs keep running."""
        if self._watcher is not None:
            self._watcher.cancel()
        if self.pool is not None:
            await self.pool.close()
        for rt in self._runtimes.values():
            if rt.agent is not None:
                await rt.agent.close()

    def state_counts(self) -> dict[str, int]:
        counts = {s.value: 0 for s in State if s not in GONE}
        for rec in self.store.all():
            if rec.state in counts:
                counts[rec.state] += 1
        return counts

    def _gate(self, sandbox_id: str) -> asyncio.Lock:
        """The per-sandbox lock that orders lifecycle changes (snapshot, sleep, wake, delete)."""
        return self._gates.setdefault(sandbox_id, asyncio.Lock())

    # -- create, get, list, delete -----------------------------------------

    def _admit_one(self) -> None:
        """Raise LimitExceeded when no VMM may start now (call under ``_admit``)."""
        cap = self.settings.max_sandboxes
        if len(self.store.with_vmm()) >= cap:
            self.metrics.creates.labels("limited").inc()
            raise LimitExceeded(f"at most {cap} sandboxes may run at once", retry_after=5,
                                limit=cap)

    def _new_record(self, sid: str, state: State, image: GuestImage, opts: CreateOptions,
                    vcpus: int | None = None, memory_mib: int | None = None,
                    disk_mib: int | None = None) -> SandboxRecord:
        s = self.settings
        now = time.time()
        ttl = opts.timeout_s if opts.timeout_s is not None else s.default_timeout_s
        recipe = RECIPES.get(image.name)  # a recipe's default size beats the server's
        default_vcpus = (recipe and recipe.default_vcpus) or s.default_vcpus
        default_memory = (recipe and recipe.default_memory_mib) or s.default_memory_mib
        metadata: dict[str, Any] = dict(opts.metadata)
        if opts.idle_timeout_s:
            metadata["idle_timeout_s"] = opts.idle_timeout_s
        return SandboxRecord(
            id=sid, state=state.value, desired_state=State.RUNNING.value,
            image=image.name, image_digest=image.digest, engine=self.engine.name,
            accel=self.engine.accel, vcpus=vcpus or opts.vcpus or default_vcpus,
            memory_mib=memory_mib or opts.memory_mib or default_memory,
            disk_mib=disk_mib or opts.disk_mib or s.default_disk_mib, pid=None, created_at=now,
            updated_at=now, last_active_at=now, expires_at=now + ttl if ttl else None,
            metadata_=metadata, desktop=opts.desktop, network=self.policy(opts.network),
        )

    def spec(self, rec: SandboxRecord, image: GuestImage,
             net: NetAttachment | None = None) -> VMSpec:
        kernel_args = (f"hangar.desktop={rec.desktop}",) if rec.desktop else ()
        return VMSpec(rec.id, image, self.layout.sandbox(rec.id), rec.vcpus, rec.memory_mib,
                      rec.disk_mib, hostname=rec.id, kernel_args=kernel_args, net=net)

    async def _launch(self, rec: SandboxRecord,
                      start: Callable[[NetAttachment | None], Awaitable[VM]],
                      with_nic: bool = True,
                      ready: Callable[[AgentClient, NetAttachment | None], Awaitable[None]]
                      | None = None) -> Runtime:
        """Attach ``rec``'s NIC, start its VM with ``start(nic)``, connect the agent, run
        ``ready``; on any failure the VM is stopped and the NIC released, so nothing is
        left but the record."""
        vm: VM | None = None
        try:
            net = await self._attach(rec) if with_nic else None
            vm = await start(net)
            self.store.update(rec.id, pid=vm.pid)
            agent = await self.engine.connect_agent(vm, self.settings.boot_timeout_s)
            if ready is not None:
                await ready(agent, net)
        except BaseException:
            if vm is not None:
                await self.engine.stop(vm)
            await self._detach(rec.id)
            raise
        rt = Runtime(vm, agent)
        self._runtimes[rec.id] = rt
        return rt

    async def boot(self, rec: SandboxRecord, image: GuestImage) -> Runtime:
        """Boot ``rec``'s VM and wait for its agent; on failure nothing is left but the record."""
        return await self._launch(rec, lambda net: self.engine.boot(self.spec(rec, image, net)))

    async def create(self, opts: CreateOptions) -> SandboxRecord:
        """A running sandbox, from the warm pool when one fits, else booted cold.

        The returned record's ``source`` attribute (not stored) says which:
        ``pool`` or ``cold``. A size the create leaves out comes from the
        image's recipe (``Recipe.default_vcpus``/``default_memory_mib``), else
        the server's settings.

        Raises LimitExceeded (cap on concurrent VMs reached), NotFound (no
        such image), EngineError or Timeout (the VM did not come up); on any
        failure nothing of the sandbox is left.
        """
        started = time.monotonic()
        image = resolve_image(self.layout, opts.image or self.settings.default_image)
        if opts.desktop:
            check_desktop(opts.desktop, image)
        if self.pool is not None:
            rec = await self.pool.take(opts, image)
            if rec is not None:
                self._created(rec, started, "pool")
                rec.source = "pool"  # type: ignore[attr-defined]  # told to the caller only
                return rec
        async with self._admit:
            self._admit_one()
            rec = self._new_record(new_id(), State.CREATING, image, opts)
            self.store.add(rec)
        try:
            await self.boot(rec, image)
        except BaseException as exc:
            self.store.delete(rec.id)
            self.metrics.creates.labels("failed").inc()
            log.error("sandbox create failed", extra={"sandbox_id": rec.id, "error": str(exc)})
            raise
        rec = self.store.update(rec.id, state=State.RUNNING)  # type: ignore[assignment]
        self._created(rec, started, "cold")
        rec.source = "cold"  # type: ignore[attr-defined]
        return rec

    def _created(self, rec: SandboxRecord, started: float, source: str) -> None:
        took = time.monotonic() - started
        self.metrics.creates.labels("ok").inc()
        self.metrics.create_seconds.observe(took)
        log.info("sandbox created", extra={"sandbox_id": rec.id, "duration_s": round(took, 3),
                                           "image": rec.image, "source": source})

    def get(self, sandbox_id: str) -> SandboxRecord:
        """The record of a sandbox. Raises NotFound (unknown, deleted) or Gone (expired)."""
        rec = self.store.get(sandbox_id)
        if rec is None or rec.state == State.POOLED.value:
            raise NotFound(f"no sandbox {sandbox_id}", sandbox_id=sandbox_id)
        if rec.state == State.DELETED.value:
            raise NotFound(f"sandbox {sandbox_id} was deleted", sandbox_id=sandbox_id)
        if rec.state == State.EXPIRED.value:
            raise Gone(f"sandbox {sandbox_id} expired at "
                       f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(rec.expires_at or 0))}",
                       sandbox_id=sandbox_id)
        return rec

    def set_timeout(self, sandbox_id: str, timeout_s: float) -> SandboxRecord:
        """Make the sandbox expire ``timeout_s`` seconds from now (0: never)."""
        rec = self.get(sandbox_id)
        if rec.state in (State.STOPPING.value, State.FAILED.value):
            raise Conflict(f"sandbox {sandbox_id} is {rec.state}", sandbox_id=sandbox_id)
        expires = time.time() + timeout_s if timeout_s else None
        return self.store.update(sandbox_id, expires_at=expires)  # type: ignore[return-value]

    def list(self) -> list[SandboxRecord]:
        """Sandboxes that exist or failed (not deleted, expired or pooled), oldest first."""
        hidden = {s.value for s in GONE} | {State.POOLED.value}
        return [r for r in self.store.all() if r.state not in hidden]

    async def delete(self, sandbox_id: str) -> None:
        """End the sandbox's VM, remove its files and sleep snapshot. NotFound if unknown."""
        rec = self.get(sandbox_id)
        if rec.state == State.STOPPING.value:
            raise Conflict(f"sandbox {sandbox_id} is already being deleted", sandbox_id=sandbox_id)
        async with self._gate(sandbox_id):
            await self._finish(sandbox_id, State.DELETED, None)
        log.info("sandbox deleted", extra={"sandbox_id": sandbox_id})

    async def _finish(self, sandbox_id: str, final: State, error: str | None) -> None:
        """Move to ``final``: end the VMM, remove files and any sleep snapshot."""
        self.store.update(sandbox_id, state=State.STOPPING)
        rt = self._runtimes.get(sandbox_id)
        await self._stop_vm(sandbox_id, rt.vm if rt else None)
        rec = self.store.get(sandbox_id)
        if rec is not None and rec.sleep_snapshot:
            self._drop_snapshot(rec.sleep_snapshot)
        self.store.update(sandbox_id, state=final, pid=None, error=error, sleep_snapshot=None)
        gate = self._gates.get(sandbox_id)
        if gate is not None and not gate.locked():
            del self._gates[sandbox_id]

    async def _stop_vm(self, sandbox_id: str, vm: VM | None) -> None:
        rt = self._runtimes.pop(sandbox_id, None)
        if rt is not None and rt.agent is not None:
            await rt.agent.close()
        if vm is None:
            vm = VM(sandbox_id, self.engine.name, -1, self.layout.sandbox(sandbox_id), "")
        await self.engine.stop(vm)
        await self._detach(sandbox_id)

    # -- snapshots, sleep and wake -------------------------------------------

    def _running(self, sandbox_id: str) -> tuple[SandboxRecord, Runtime]:
        rec = self.get(sandbox_id)
        rt = self._runtimes.get(sandbox_id)
        if rec.state != State.RUNNING.value or rt is None:
            raise Conflict(f"sandbox {sandbox_id} is {rec.state}, not running",
                           sandbox_id=sandbox_id, state=rec.state)
        if rt.busy:
            raise Busy(f"sandbox {sandbox_id} is running a command or file transfer; "
                       "retry when it has finished", sandbox_id=sandbox_id)
        return rec, rt

    async def _snapshot_vm(self, rec: SandboxRecord, rt: Runtime, kind: str) -> SnapshotRecord:
        snap_id = new_id("snap-")
        dest = self.layout.snapshot(snap_id)
        try:
            files = await self.engine.snapshot(rt.vm, dest)
        except BaseException:
            shutil.rmtree(dest, ignore_errors=True)
            raise
        snap = SnapshotRecord(
            id=snap_id, sandbox_id=rec.id, kind=kind, size_bytes=files.size_bytes,
            created_at=time.time(), image=rec.image, image_digest=rec.image_digest,
            vcpus=rec.vcpus, memory_mib=rec.memory_mib, disk_mib=rec.disk_mib,
            desktop=rec.desktop, network=rec.network)
        self.store.add(snap)
        return snap

    async def snapshot(self, sandbox_id: str) -> SnapshotRecord:
        """Save the sandbox's memory, device state and disk; it keeps running.

        Raises Conflict (not running) or Busy (a command runs: retry).
        """
        started = time.monotonic()
        async with self._gate(sandbox_id):
            rec, rt = self._running(sandbox_id)
            try:
                snap = await self._snapshot_vm(rec, rt, "user")
            finally:
                if rt.vm.alive():
                    await self.engine.resume(rt.vm)
        log.info("snapshot taken", extra={"sandbox_id": sandbox_id, "snapshot_id": snap.id,
                                          "size_bytes": snap.size_bytes,
                                          "duration_s": round(time.monotonic() - started, 3)})
        return snap

    async def sleep(self, sandbox_id: str) -> SandboxRecord:
        """Snapshot the sandbox and end its VMM; calls to it will wake it.

        Raises Conflict (not running) or Busy (a command runs: retry).
        """
        started = time.monotonic()
        async with self._gate(sandbox_id):
            rec = self.get(sandbox_id)
            if rec.state == State.SLEEPING.value:
                return rec
            rec, rt = self._running(sandbox_id)
            self.store.update(sandbox_id, state=State.SNAPSHOTTING, desired_state=State.SLEEPING)
            try:
                snap = await self._snapshot_vm(rec, rt, "sleep")
            except BaseException:
                if rt.vm.alive():
                    await self.engine.resume(rt.vm)
                self.store.update(sandbox_id, state=State.RUNNING, desired_state=State.RUNNING)
                raise
            await self._stop_vm(sandbox_id, rt.vm)
            rec = self.store.update(sandbox_id, state=State.SLEEPING, pid=None,  # type: ignore[assignment]
                                    sleep_snapshot=snap.id)
        log.info("sandbox asleep", extra={"sandbox_id": sandbox_id, "size_bytes": snap.size_bytes,
                                          "duration_s": round(time.monotonic() - started, 3)})
        return rec

    async def wake(self, sandbox_id: str) -> SandboxRecord:
        """Restore a sleeping sandbox from its sleep snapshot; a running one is returned as is.

        Raises LimitExceeded (no room for another VMM) or the engine's errors;
        on failure the sandbox stays asleep with its snapshot intact.
        """
        started = time.monotonic()
        async with self._gate(sandbox_id):
            rec = self.get(sandbox_id)
            if rec.state == State.RUNNING.value:
                return rec
            if rec.state != State.SLEEPING.value or not rec.sleep_snapshot:
                raise Conflict(f"sandbox {sandbox_id} is {rec.state}", sandbox_id=sandbox_id)
            snap = self.store.find(SnapshotRecord, rec.sleep_snapshot)
            if snap is None:
                raise Conflict(f"sandbox {sandbox_id} lost its sleep snapshot",
                               sandbox_id=sandbox_id)
            async with self._admit:
                self._admit_one()
                self.store.update(sandbox_id, state=State.WAKING, desired_state=State.RUNNING)
            try:
                await self._restore_into(rec, snap)
            except BaseException as exc:
                self.store.update(sandbox_id, state=State.SLEEPING, error=str(exc)[:1000])
                raise
            rec = self.store.update(sandbox_id, state=State.RUNNING, sleep_snapshot=None,  # type: ignore[assignment]
                                    last_active_at=time.time(), error=None)
            self._drop_snapshot(snap.id)
        log.info("sandbox awake", extra={"sandbox_id": sandbox_id,
                                         "duration_s": round(time.monotonic() - started, 3)})
        return rec

    async def _restore_into(self, rec: SandboxRecord, snap: SnapshotRecord) -> Runtime:
        """Start ``rec``'s VM from ``snap``; agent connected, clock and entropy refreshed."""
        image = resolve_image(self.layout, f"{snap.image}-{snap.image_digest}")

        async def ready(agent: AgentClient, net: NetAttachment | None) -> None:
            await refresh_guest(agent)
            if net is not None:  # a fork (or a new lease) has another MAC and address
                await agent.exec(renet_meta(net))

        # The NIC must match the snapshot's devices: a snapshot with one gets one.
        return await self._launch(
            rec, lambda net: self.engine.restore(self.spec(rec, image, net),
                                                 self.layout.snapshot(snap.id)),
            with_nic=bool(snap.network), ready=ready)

    async def restore(self, sandbox_id: str, snapshot_id: str) -> SandboxRecord:
        """Bring a sandbox back to a snapshot of its own: processes, memory and files.

        The current VM is replaced. Raises NotFound (no such snapshot),
        InvalidRequest (the snapshot belongs to another sandbox), Busy; if the
        restore itself fails the sandbox is ``failed``.
        """
        snap = self.get_snapshot(snapshot_id)
        if snap.sandbox_id != sandbox_id:
            raise InvalidRequest(f"snapshot {snapshot_id} was taken of {snap.sandbox_id}; "
                                 f"start a new sandbox from it with POST /snapshots/"
                                 f"{snapshot_id}/sandboxes", snapshot_id=snapshot_id)
        async with self._gate(sandbox_id):
            rec = self.get(sandbox_id)
            if rec.state == State.RUNNING.value:
                _, rt = self._running(sandbox_id)
                await self._stop_vm(sandbox_id, rt.vm)
            elif rec.state != State.FAILED.value:
                raise Conflict(f"sandbox {sandbox_id} is {rec.state}", sandbox_id=sandbox_id)
            try:
                await self._restore_into(rec, snap)
            except BaseException as exc:
                self.store.update(sandbox_id, state=State.FAILED, pid=None, error=str(exc)[:1000])
                raise
            rec = self.store.update(sandbox_id, state=State.RUNNING, error=None,  # type: ignore[assignment]
                                    last_active_at=time.time())
        log.info("sandbox restored", extra={"sandbox_id": sandbox_id, "snapshot_id": snapshot_id})
        return rec

    async def fork(self, snapshot_id: str, opts: CreateOptions) -> SandboxRecord:
        """A new sandbox started from a snapshot (its shape: vCPUs, memory, disk, desktop).

        Raises NotFound, LimitExceeded, or the engine's errors (nothing is left).
        """
        started = time.monotonic()
        snap = self.get_snapshot(snapshot_id)
        image = resolve_image(self.layout, f"{snap.image}-{snap.image_digest}")
        async with self._admit:
            self._admit_one()
            rec = self._new_record(new_id(), State.CREATING, image,
                                   CreateOptions(timeout_s=opts.timeout_s, metadata=opts.metadata,
                                                 desktop=snap.desktop,
                                                 network=snap.network or "none"),
                                   snap.vcpus, snap.memory_mib, snap.disk_mib)
            self.store.add(rec)
        try:
            await self._restore_into(rec, snap)
        except BaseException:
            self.store.delete(rec.id)
            self.metrics.creates.labels("failed").inc()
            raise
        rec = self.store.update(rec.id, state=State.RUNNING)  # type: ignore[assignment]
        self._created(rec, started, f"snapshot {snapshot_id}")
        return rec

    def get_snapshot(self, snapshot_id: str) -> SnapshotRecord:
        snap = self.store.find(SnapshotRecord, snapshot_id)
        if snap is None or snap.kind != "user":
            raise NotFound(f"no snapshot {snapshot_id}", snapshot_id=snapshot_id)
        return snap

    def list_snapshots(self, sandbox_id: str | None = None) -> list[SnapshotRecord]:
        snaps = [s for s in self.store.list(SnapshotRecord) if s.kind == "user"]
        if sandbox_id is not None:
            snaps = [s for s in snaps if s.sandbox_id == sandbox_id]
        return sorted(snaps, key=lambda s: s.created_at)

    def delete_snapshot(self, snapshot_id: str) -> None:
        self.get_snapshot(snapshot_id)
        self._drop_snapshot(snapshot_id)

    def _drop_snapshot(self, snapshot_id: str) -> None:
        self.store.remove(SnapshotRecord, snapshot_id)
        shutil.rmtree(self.layout.snapshot(snapshot_id), ignore_errors=True)

    # -- guest calls -------------------------------------------------------

    @asynccontextmanager
    async def using(self, sandbox_id: str) -> AsyncIterator[AgentClient]:
        """The agent of a running sandbox for one call; wakes a sleeping one first.

        While the call runs the sandbox is ``busy``: it will not be
        snapshotted or put to sleep. Raises NotFound, Gone or Conflict.
        """
        for _ in range(3):
            rec = self.get(sandbox_id)
            if rec.state in (State.SLEEPING.value, State.SNAPSHOTTING.value, State.WAKING.value):
                await self.wake(sandbox_id)
            async with self._gate(sandbox_id):
                rec = self.get(sandbox_id)
                rt = self._runtimes.get(sandbox_id)
                if rec.state == State.SLEEPING.value:
                    continue  # it fell asleep between the wake and the gate
                if rec.state != State.RUNNING.value or rt is None:
                    raise Conflict(f"sandbox {sandbox_id} is {rec.state}, not running",
                                   sandbox_id=sandbox_id, state=rec.state)
                rt.busy += 1
            break
        else:
            raise Busy(f"sandbox {sandbox_id} keeps falling asleep; retry", sandbox_id=sandbox_id)
        try:
            async with rt.connect_lock:
                if rt.agent is None or rt.agent.closed:
                    if not rt.vm.alive():
                        raise Conflict(f"sandbox {sandbox_id} has stopped", sandbox_id=sandbox_id)
                    rt.agent = await self.engine.connect_agent(rt.vm, 10.0)
            yield rt.agent
        finally:
            rt.busy -= 1
            self.store.update(sandbox_id, last_active_at=time.time())

    async def exec(self, sandbox_id: str, meta: dict[str, Any],
                   stdin: bytes | None = None) -> ExecResult:
        """Run a command to completion (``meta`` from ``guest.client.exec_meta``)."""
        started = time.monotonic()
        async with self.using(sandbox_id) as agent:
            try:
                result = await agent.exec(meta, stdin)
            except HangarError:
                self.metrics.execs.labels("error").inc()
                raise
        self.metrics.execs.labels("ok").inc()
        took = time.monotonic() - started
        self.metrics.exec_seconds.observe(took)
        log.info("exec", extra={"sandbox_id": sandbox_id, "duration_s": round(took, 3),
                                "exit_code": result.exit_code, "timed_out": result.timed_out})
        return result

    async def exec_stream(self, sandbox_id: str, meta: dict[str, Any],
                          stdin: bytes | None = None) -> AsyncIterator[ExecEvent]:
        """Run a command, yielding output events then an ``exit`` event."""
        started = time.monotonic()
        ok = False
        try:
            async with self.using(sandbox_id) as agent:
                async for ev in agent.exec_stream({**meta, "stream": True}, stdin):
                    if ev.kind == "exit":
                        ok = True
                    yield ev
        finally:
            self.metrics.execs.labels("ok" if ok else "error").inc()
            self.metrics.exec_seconds.observe(time.monotonic() - started)

    async def read_file(self, sandbox_id: str, path: str) -> AsyncIterator[bytes]:
        async with self.using(sandbox_id) as agent:
            async for chunk in agent.read_file(path):
                yield chunk

    async def write_file(self, sandbox_id: str, path: str,
                         chunks: Iterable[bytes] | AsyncIterator[bytes],
                         mode: int = 0o644) -> dict[str, Any]:
        async with self.using(sandbox_id) as agent:
            return await agent.write_file(path, chunks, mode)

    async def file_op(self, sandbox_id: str, op: str, **meta: Any) -> dict[str, Any]:
        """``list_dir``, ``stat``, ``mkdir`` or ``remove`` in the guest."""
        if op not in ("list_dir", "stat", "mkdir", "remove"):
            raise GuestError(f"unknown file operation {op}")
        async with self.using(sandbox_id) as agent:
            return await agent.call(op, **meta)

    async def agent(self, sandbox_id: str) -> AgentClient:
        """The agent of a running sandbox (for long-lived uses such as tunnels)."""
        async with self.using(sandbox_id) as agent:
            return agent
