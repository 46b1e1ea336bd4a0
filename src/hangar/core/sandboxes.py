"""The orchestrator: sandbox lifecycle, limits, and calls into the guest.

``SandboxManager`` is the only writer of sandbox records. It asks the
engine for VMs, keeps one agent connection per running sandbox, enforces
the cap on concurrent VMs, and on start reconciles the store with the VMM
processes that are still running (adopt what answers, clean up the rest).

Lifecycle rules (see ``hangar.core.states``):

* a create that fails at any step removes the VM, its files and its record;
* a delete ends the VM, removes its files and leaves a ``deleted`` tombstone;
* a VMM that dies on its own is noticed by the watcher within
  ``WATCH_INTERVAL_S`` and its sandbox marked ``failed``, files released.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any

from hangar.config import Settings
from hangar.core.states import LIVE, State, check
from hangar.core.store import SandboxRecord, Store
from hangar.engines.base import VM, Engine, VMSpec
from hangar.errors import Conflict, GuestError, Gone, HangarError, LimitExceeded, NotFound
from hangar.guest.client import AgentClient, ExecEvent, ExecResult
from hangar.images import resolve_image
from hangar.layout import Layout
from hangar.metrics import Metrics

log = logging.getLogger("hangar.sandboxes")

WATCH_INTERVAL_S = 1.0


@dataclass(frozen=True)
class CreateOptions:
    """What a create asks for; ``None`` takes the server's default.

    Sizes in MiB; ``timeout_s`` is the sandbox's time to live in seconds.
    """

    image: str | None = None
    vcpus: int | None = None
    memory_mib: int | None = None
    disk_mib: int | None = None
    timeout_s: float | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    desktop: str | None = None
    """Screen as ``WIDTHxHEIGHTxDEPTH`` (pixels, bits); starts the guest's desktop."""


@dataclass
class Runtime:
    """In-memory state of one live sandbox."""

    vm: VM
    agent: AgentClient | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def new_id() -> str:
    return "sb-" + secrets.token_hex(6)


class SandboxManager:
    """Creates, tracks and removes sandboxes. One per server process."""

    def __init__(self, settings: Settings, layout: Layout, store: Store, engine: Engine,
                 metrics: Metrics) -> None:
        self.settings = settings
        self.layout = layout
        self.store = store
        self.engine = engine
        self.metrics = metrics
        self._runtimes: dict[str, Runtime] = {}
        self._admit = asyncio.Lock()
        self._reserved = 0
        self._watcher: asyncio.Task[None] | None = None
        metrics.watch_states(self.state_counts)

    # -- start-up and background ------------------------------------------

    async def start(self) -> None:
        """Reconcile the store with running VMMs, then start the watcher."""
        for rec in self.store.live():
            vm = self.engine.adopt(rec.id, self.layout.sandbox(rec.id), rec.pid or -1)
            if vm is not None and rec.state in (State.RUNNING.value, State.PAUSED.value):
                self._runtimes[rec.id] = Runtime(vm)
                log.info("sandbox adopted", extra={"sandbox_id": rec.id, "pid": vm.pid})
                continue
            await self._release(rec.id, vm, State.FAILED, "the VMM was gone when the server started")
        self._sweep_orphan_dirs()
        self._watcher = asyncio.create_task(self._watch())

    def _sweep_orphan_dirs(self) -> None:
        known = {r.id for r in self.store.live()}
        for d in self.layout.sandboxes.iterdir():
            if d.name not in known:
                pid = None
                try:
                    pid = int((d / "vmm.pid").read_text())
                except (OSError, ValueError):
                    pass
                vm = self.engine.adopt(d.name, self.layout.sandbox(d.name), pid or -1)
                if vm is not None:
                    from hangar.engines.base import kill_process

                    kill_process(vm.pid)
                import shutil

                shutil.rmtree(d, ignore_errors=True)
                log.info("orphan sandbox directory removed", extra={"sandbox_id": d.name})

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            try:
                await self._watch_once()
            except Exception:  # the watcher must outlive any one failure
                log.exception("watcher pass failed")

    async def _watch_once(self) -> None:
        """Expire sandboxes past their TTL; mark those whose VMM died ``failed``."""
        now = time.time()
        for rec in self.store.live():
            if rec.expires_at is not None and rec.expires_at <= now and rec.state in (
                    State.RUNNING.value, State.PAUSED.value):
                rt = self._runtimes.get(rec.id)
                await self._release(rec.id, rt.vm if rt else None, State.EXPIRED, None)
                log.info("sandbox expired", extra={"sandbox_id": rec.id})
        for sid, rt in list(self._runtimes.items()):
            if not rt.vm.alive():
                rec = self.store.get(sid)
                if rec is not None and rec.state in (State.RUNNING.value, State.PAUSED.value):
                    log.warning("VMM died", extra={"sandbox_id": sid, "pid": rt.vm.pid})
                    await self._release(sid, rt.vm, State.FAILED, "the VMM process exited")

    async def close(self) -> None:
        """Stop background work and drop agent connections; VMs keep running."""
        if self._watcher is not None:
            self._watcher.cancel()
        for rt in self._runtimes.values():
            if rt.agent is not None:
                await rt.agent.close()

    def state_counts(self) -> dict[str, int]:
        counts = {s.value: 0 for s in State if s in LIVE or s == State.FAILED}
        for rec in self.store.live():
            counts[rec.state] = counts.get(rec.state, 0) + 1
        return counts

    # -- lifecycle ---------------------------------------------------------

    async def create(self, opts: CreateOptions) -> SandboxRecord:
        """Boot a sandbox and wait until its agent answers.

        Raises LimitExceeded (cap on concurrent VMs reached), NotFound (no
        such image), EngineError or Timeout (the VM did not come up); on any
        failure nothing of the sandbox is left.
        """
        s = self.settings
        started = time.monotonic()
        image = resolve_image(self.layout, opts.image or s.default_image)
        async with self._admit:
            live = len([r for r in self.store.live()])
            if live >= s.max_sandboxes:
                self.metrics.creates.labels("limited").inc()
                raise LimitExceeded(f"at most {s.max_sandboxes} sandboxes may run at once",
                                    retry_after=5, limit=s.max_sandboxes)
            sid = new_id()
            now = time.time()
            ttl = opts.timeout_s if opts.timeout_s is not None else s.default_timeout_s
            rec = SandboxRecord(
                id=sid, state=State.CREATING.value, desired_state=State.RUNNING.value,
                image=image.name, image_digest=image.digest, engine=self.engine.name,
                accel=self.engine.accel, vcpus=opts.vcpus or s.default_vcpus,
                memory_mib=opts.memory_mib or s.default_memory_mib,
                disk_mib=opts.disk_mib or s.default_disk_mib, pid=None, created_at=now,
                updated_at=now, expires_at=now + ttl if ttl else None,
                metadata_=dict(opts.metadata), desktop=opts.desktop,
            )
            self.store.add(rec)
        kernel_args = (f"hangar.desktop={opts.desktop}",) if opts.desktop else ()
        spec = VMSpec(sid, image, self.layout.sandbox(sid), rec.vcpus, rec.memory_mib,
                      rec.disk_mib, hostname=sid, kernel_args=kernel_args)
        vm: VM | None = None
        try:
            vm = await self.engine.boot(spec)
            self.store.update(sid, pid=vm.pid)
            agent = await self.engine.connect_agent(vm, s.boot_timeout_s)
        except BaseException as exc:
            if vm is not None:
                await self.engine.stop(vm)
            self.store.delete(sid)
            self.metrics.creates.labels("failed").inc()
            log.error("sandbox create failed", extra={"sandbox_id": sid, "error": str(exc)})
            raise
        self._runtimes[sid] = Runtime(vm, agent)
        rec = self.store.update(sid, state=State.RUNNING)  # type: ignore[assignment]
        took = time.monotonic() - started
        self.metrics.creates.labels("ok").inc()
        self.metrics.create_seconds.observe(took)
        log.info("sandbox created", extra={"sandbox_id": sid, "duration_s": round(took, 3),
                                           "image": image.name, "accel": vm.accel})
        return rec

    def get(self, sandbox_id: str) -> SandboxRecord:
        """The record of a sandbox; NotFound if unknown or deleted."""
        rec = self.store.get(sandbox_id)
        if rec is None:
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
        if rec.state not in (State.RUNNING.value, State.PAUSED.value, State.CREATING.value):
            raise Conflict(f"sandbox {sandbox_id} is {rec.state}", sandbox_id=sandbox_id)
        expires = time.time() + timeout_s if timeout_s else None
        return self.store.update(sandbox_id, expires_at=expires)  # type: ignore[return-value]

    def list(self) -> list[SandboxRecord]:
        """Sandboxes that are live or failed (not deleted or expired), oldest first."""
        gone = (State.DELETED.value, State.EXPIRED.value)
        return [r for r in self.store.all() if r.state not in gone]

    async def delete(self, sandbox_id: str) -> None:
        """End the sandbox's VM and remove everything it held. NotFound if unknown."""
        rec = self.get(sandbox_id)
        if rec.state == State.STOPPING.value:
            raise Conflict(f"sandbox {sandbox_id} is already being deleted", sandbox_id=sandbox_id)
        rt = self._runtimes.get(sandbox_id)
        await self._release(sandbox_id, rt.vm if rt else None, State.DELETED, None)
        log.info("sandbox deleted", extra={"sandbox_id": sandbox_id})

    async def _release(self, sandbox_id: str, vm: VM | None, final: State,
                       error: str | None) -> None:
        self.store.update(sandbox_id, state=State.STOPPING)
        rt = self._runtimes.pop(sandbox_id, None)
        if rt is not None and rt.agent is not None:
            await rt.agent.close()
        if vm is None:
            vm = VM(sandbox_id, self.engine.name, -1, self.layout.sandbox(sandbox_id), "")
        await self.engine.stop(vm)
        self.store.update(sandbox_id, state=final, pid=None, error=error)

    # -- guest calls -------------------------------------------------------

    async def agent(self, sandbox_id: str) -> AgentClient:
        """The agent connection of a running sandbox, reconnecting if it dropped.

        Raises NotFound (unknown or deleted) or Conflict (not running).
        """
        rec = self.get(sandbox_id)
        rt = self._runtimes.get(sandbox_id)
        if rec.state != State.RUNNING.value or rt is None:
            raise Conflict(f"sandbox {sandbox_id} is {rec.state}, not running",
                           sandbox_id=sandbox_id, state=rec.state)
        async with rt.lock:
            if rt.agent is None or rt.agent.closed:
                if not rt.vm.alive():
                    raise Conflict(f"sandbox {sandbox_id} has stopped", sandbox_id=sandbox_id)
                rt.agent = await self.engine.connect_agent(rt.vm, 10.0)
            return rt.agent

    async def exec(self, sandbox_id: str, meta: dict[str, Any],
                   stdin: bytes | None = None) -> ExecResult:
        """Run a command to completion (``meta`` from ``guest.client.exec_meta``)."""
        agent = await self.agent(sandbox_id)
        started = time.monotonic()
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
        agent = await self.agent(sandbox_id)
        started = time.monotonic()
        ok = False
        try:
            async for ev in agent.exec_stream({**meta, "stream": True}, stdin):
                if ev.kind == "exit":
                    ok = True
                yield ev
        finally:
            self.metrics.execs.labels("ok" if ok else "error").inc()
            self.metrics.exec_seconds.observe(time.monotonic() - started)

    async def read_file(self, sandbox_id: str, path: str) -> AsyncIterator[bytes]:
        agent = await self.agent(sandbox_id)
        async for chunk in agent.read_file(path):
            yield chunk

    async def write_file(self, sandbox_id: str, path: str,
                         chunks: Iterable[bytes] | AsyncIterator[bytes],
                         mode: int = 0o644) -> dict[str, Any]:
        agent = await self.agent(sandbox_id)
        return await agent.write_file(path, chunks, mode)

    async def file_op(self, sandbox_id: str, op: str, **meta: Any) -> dict[str, Any]:
        """``list_dir``, ``stat``, ``mkdir`` or ``remove`` in the guest."""
        if op not in ("list_dir", "stat", "mkdir", "remove"):
            raise GuestError(f"unknown file operation {op}")
        agent = await self.agent(sandbox_id)
        return await agent.call(op, **meta)
