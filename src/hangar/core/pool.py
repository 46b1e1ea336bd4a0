"""The warm pool: sandboxes made ahead of time, paused, each handed out once.

With booted templates (``hangar.core.templates``) a pool VM is one already
restored from its image's template snapshot and re-identified (its own
hostname, machine-id, fork generation, entropy; its id is the sandbox id
it is handed out under), so the pool saves the last step only: the
restore (about 0.35 s under TCG) against a resume and a clock refresh
(about 0.1 s). A pool VM costs only the pages it has written itself
(docs/performance.md, "Booted templates"): hence the default size.

The pool keeps, for each template it serves, a number of paused VMs of
that image in the default shape (vCPUs, memory, disk; no desktop; the
default network policy): ``HANGAR_POOL_TEMPLATES="base=2,dev=1"``, or by
default ``HANGAR_POOL_SIZE`` VMs of the default template. A create whose
options fit takes one (``claim``): it is resumed, its clock and entropy
refreshed, and it becomes the caller's sandbox under its own id. The pool
refills in the background, one boot at a time, and only while the cap on
concurrent VMs leaves room and a start slot is free with no client's start
queued (``hangar.core.starts``), so pooled VMs never crowd out or delay
sandboxes that users asked for. A pool VM older than ``pool_max_age_s`` is retired and
replaced.

Claim and retirement race safely: each is a compare-and-set of the record
(``pooled -> creating`` or ``pooled -> stopping``), so exactly one wins;
retirement holds the sandbox's lock and ends a VM only after its move
succeeded, so it never kills a VM that has just been handed out.

Security: pooled VMs are fresh boots or template restores of the image; nothing of one owner
can reach another, since a VM leaves the pool only by being taken (once)
or ended. Pool VMs do not outlive the server: a restarted server ends them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from hangar.config import Settings
from hangar.core.admission import Admission, CreateOptions, default_size, new_id
from hangar.core.context import Context
from hangar.core.launch import Launcher
from hangar.core.lifecycle import State
from hangar.core.store import SandboxRecord
from hangar.core.tasks import Tasks
from hangar.engines.snapshot_io import refresh_guest
from hangar.errors import Conflict, EngineError, HangarError, NotFound
from hangar.images import GuestImage, resolve_image

log = logging.getLogger("hangar.pool")

FAILED_BOOT_BACKOFF_S = (2.0, 300.0)
"""First and largest pause after failed pool boots, seconds (doubling)."""


def templates(settings: Settings) -> dict[str, int]:
    """The pool's targets by template name, from the settings.

    Raises ValueError for a malformed ``pool_templates`` (``name=count,...``).
    """
    if not settings.pool_templates:
        return {settings.default_image: settings.pool_size} if settings.pool_size > 0 else {}
    out: dict[str, int] = {}
    for part in settings.pool_templates.split(","):
        name, sep, count = part.strip().partition("=")
        if not sep or not name.strip() or not count.strip().isdigit():
            raise ValueError(f"bad HANGAR_POOL_TEMPLATES entry {part!r}; want name=count")
        if int(count) > 0:
            out[name.strip()] = int(count)
    return out


class WarmPool:
    """Keeps paused VMs of some templates ready. One per server."""

    def __init__(self, ctx: Context, admission: Admission, launcher: Launcher,
                 targets: Mapping[str, int], max_age_s: float) -> None:
        self.ctx = ctx
        self.admission = admission
        self.launcher = launcher
        self.targets = dict(targets)
        self.max_age_s = max_age_s
        self._ready: dict[str, float] = {}  # sandbox id -> when it was ready (Unix s)
        self._tasks = Tasks("pool")
        self._failures = 0
        self._paused_until = 0.0

    @property
    def size(self) -> int:
        """VMs the pool aims to hold, all templates together."""
        return sum(self.targets.values())

    def pooled(self) -> list[SandboxRecord]:
        """Records of pool VMs (ready or booting)."""
        return self.ctx.store.in_states({State.POOLED})

    def ready_count(self) -> int:
        return len(self._ready)

    def ready_by_template(self) -> dict[str, int]:
        """Ready (booted and paused) VMs per template name."""
        out: dict[str, int] = {}
        for rec in self.pooled():
            if rec.id in self._ready:
                out[rec.image] = out.get(rec.image, 0) + 1
        return out

    def fits(self, opts: CreateOptions, image: GuestImage) -> bool:
        """True when a create with ``opts`` may be served from the pool."""
        s = self.ctx.settings
        vcpus, memory = default_size(image, s)
        return (self.targets.get(image.name, 0) > 0 and not opts.desktop
                and opts.network is None and not opts.volumes
                and opts.vcpus in (None, vcpus)
                and opts.memory_mib in (None, memory)
                and opts.disk_mib in (None, s.default_disk_mib))

    def claim(self, image: GuestImage) -> SandboxRecord | None:
        """Move one ready pool VM of ``image`` to ``creating`` for its new owner, or None.

        The caller then calls ``prepare`` and finishes the create. Never
        awaits, so a claim is one atomic step for the event loop.
        """
        for rec in self.pooled():
            if rec.id not in self._ready or rec.image_digest != image.digest:
                continue
            self._ready.pop(rec.id, None)
            try:
                claimed = self.ctx.store.transition(rec.id, State.POOLED, State.CREATING,
                                                    pooled=False)
            except (Conflict, NotFound):
                continue  # retired meanwhile
            self.ctx.publish("pool.take", rec.id, image=image.name)
            self.kick()
            return claimed
        return None

    async def prepare(self, sandbox_id: str) -> None:
        """Resume a claimed VM and refresh its clock and entropy. Raises the engine's errors."""
        rt = self.ctx.registry.get(sandbox_id)
        if rt is None or rt.agent is None:
            raise EngineError(f"pool VM {sandbox_id} has no runtime", sandbox_id=sandbox_id)
        await self.ctx.engine.resume(rt.vm)
        await refresh_guest(rt.agent)

    def status(self) -> dict[str, Any]:
        """Size wanted, VMs ready (booted and paused) and starting, ages in seconds,
        and the size wanted per template."""
        pooled = len(self.pooled())
        ready = list(self._ready.values())
        return {"size": self.size, "ready": len(ready), "starting": max(0, pooled - len(ready)),
                "max_age_s": self.max_age_s,
                "oldest_age_s": round(time.time() - min(ready), 3) if ready else None,
                "image": self.ctx.settings.default_image, "templates": dict(self.targets)}

    def kick(self) -> None:
        """Start a background refill if one is not running."""
        if self.size > 0:
            self._tasks.start("refill", self._fill())

    def _wanted(self) -> str | None:
        have: dict[str, int] = {}
        for rec in self.pooled():
            have[rec.image] = have.get(rec.image, 0) + 1
        for name, target in self.targets.items():
            if have.get(name, 0) < target:
                return name
        return None

    async def _fill(self) -> None:
        ctx = self.ctx
        while time.time() >= self._paused_until:
            name = self._wanted()
            if name is None:
                return
            try:
                image = resolve_image(ctx.layout, name)
            except HangarError as exc:
                log.warning("pool template unavailable", extra={"image": name,
                                                                "error": exc.message})
                self._failed()
                return
            rec = self.admission.new_record(new_id(), State.POOLED, image,
                                            CreateOptions(timeout_s=0),
                                            self.launcher.policy(None))
            starts = self.admission.starts
            if not starts.try_take():  # clients' starts first (hangar.core.starts)
                return
            try:
                async with self.admission.if_room(rec.memory_mib) as room:
                    if not room:
                        return
                    rec.pooled = True
                    ctx.store.add(rec)
                started = time.monotonic()
                try:
                    rt, source = await self.launcher.start_new(rec, image, {State.POOLED})
                    await ctx.engine.pause(rt.vm)
                except BaseException as exc:
                    if not isinstance(exc, Exception):
                        await self._end(rec.id)
                        raise
                    log.warning("pool boot failed", extra={"sandbox_id": rec.id,
                                                           "error": str(exc)})
                    await self._end(rec.id)
                    self._failed()
                    return
            finally:
                starts.release(refill=True)
            self._failures = 0
            self._ready[rec.id] = time.time()
            ctx.metrics.pool_refills.inc()
            ctx.publish("pool.refill", rec.id, image=image.name, source=source,
                        duration_s=round(time.monotonic() - started, 3))
            log.info("pool VM ready", extra={"sandbox_id": rec.id, "image": image.name,
                                             "duration_s": round(time.monotonic() - started, 3)})

    def _failed(self) -> None:
        first, most = FAILED_BOOT_BACKOFF_S
        self._failures += 1
        self._paused_until = time.time() + min(most, first * 2 ** (self._failures - 1))

    async def _end(self, sandbox_id: str) -> None:
        """End a pool VM that no one has claimed, under its lock; no-op if claimed."""
        ctx = self.ctx
        self._ready.pop(sandbox_id, None)
        async with ctx.registry.lock(sandbox_id):
            try:
                ctx.store.transition(sandbox_id, State.POOLED, State.STOPPING,
                                     desired_state=State.DELETED)
            except (Conflict, NotFound):
                return  # handed out (or gone) meanwhile: not ours to end
            await self.launcher.stop(sandbox_id)
            ctx.store.discard(sandbox_id, State.STOPPING)

    async def maintain(self) -> None:
        """Retire pool VMs past their maximum age, then refill (the reconcile loop calls it)."""
        now = time.time()
        for sid, ready_at in list(self._ready.items()):
            if now - ready_at > self.max_age_s:
                log.info("pool VM retired", extra={"sandbox_id": sid})
                await self._end(sid)
        self.kick()

    async def close(self) -> None:
        """Stop refilling and end the pooled VMs: unlike users' sandboxes they
        do not outlive the server."""
        await self._tasks.stop()
        for rec in self.pooled():
            await self._end(rec.id)
