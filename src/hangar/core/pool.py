"""The warm pool: sandboxes booted ahead of time, paused, each handed out once.

A create whose options fit the pool (the default image and shape, no
desktop) takes the oldest pooled VM: it is resumed, its clock and entropy
refreshed, and it becomes the caller's sandbox under its own id. A pool VM
is used once and never handed to a second owner; one older than
``pool_max_age_s`` is replaced. The pool refills in the background, one
boot at a time, and only while the cap on concurrent VMs leaves room, so
pooled VMs never crowd out sandboxes that users asked for.

Security: pooled VMs are fresh boots of the image; nothing of one owner
can reach another, since a VM leaves the pool only by being taken or ended.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from hangar.core.states import State
from hangar.core.store import SandboxRecord
from hangar.engines.snapshot_io import refresh_guest
from hangar.images import GuestImage, resolve_image

if TYPE_CHECKING:
    from hangar.core.sandboxes import CreateOptions, SandboxManager

log = logging.getLogger("hangar.pool")


class WarmPool:
    """Keeps ``size`` paused VMs of the default template ready."""

    def __init__(self, manager: "SandboxManager", size: int, max_age_s: float) -> None:
        self.manager = manager
        self.size = size
        self.max_age_s = max_age_s
        self._refill: asyncio.Task[None] | None = None

    def _pooled(self) -> list[SandboxRecord]:
        return [r for r in self.manager.store.with_vmm() if r.state == State.POOLED.value]

    def fits(self, opts: "CreateOptions", image: GuestImage) -> bool:
        """True when a create with ``opts`` may be served from the pool."""
        s = self.manager.settings
        return (image.name == s.default_image and not opts.desktop and opts.network is None
                and opts.vcpus in (None, s.default_vcpus)
                and opts.memory_mib in (None, s.default_memory_mib)
                and opts.disk_mib in (None, s.default_disk_mib))

    async def take(self, opts: "CreateOptions", image: GuestImage) -> SandboxRecord | None:
        """Hand one pooled VM to a new owner, or None when none fits or is ready."""
        if self.size <= 0 or not self.fits(opts, image):
            return None
        m = self.manager
        while True:
            async with m._admit:
                ready = [r for r in self._pooled()
                         if r.image_digest == image.digest and r.id in m._runtimes]
                if not ready:
                    return None
                rec = ready[0]
                m.store.update(rec.id, state=State.CREATING)
            rt = m._runtimes[rec.id]
            try:
                await m.engine.resume(rt.vm)
                assert rt.agent is not None
                await refresh_guest(rt.agent)
            except Exception as exc:  # a broken pool VM: end it, try the next
                log.warning("pool VM unusable", extra={"sandbox_id": rec.id, "error": str(exc)})
                await m._finish(rec.id, State.DELETED, None)
                continue
            fresh = m._new_record(rec.id, State.RUNNING, image, opts)
            updated = m.store.update(
                rec.id, state=State.RUNNING, created_at=fresh.created_at,
                last_active_at=fresh.last_active_at, expires_at=fresh.expires_at,
                metadata_=fresh.metadata_)
            self.kick()
            return updated

    def status(self) -> dict[str, float | int | str | None]:
        """Size wanted, VMs ready (booted and paused) and starting, ages in seconds."""
        pooled = self._pooled()
        ready = [r for r in pooled if r.id in self.manager._runtimes]
        now = time.time()
        return {"size": self.size, "ready": len(ready), "starting": len(pooled) - len(ready),
                "max_age_s": self.max_age_s,
                "oldest_age_s": round(now - min(r.created_at for r in ready), 3) if ready else None,
                "image": self.manager.settings.default_image}

    def kick(self) -> None:
        """Start a background refill if one is not running."""
        if self.size > 0 and (self._refill is None or self._refill.done()):
            self._refill = asyncio.create_task(self._fill())

    async def _fill(self) -> None:
        m = self.manager
        while len(self._pooled()) < self.size:
            image = resolve_image(m.layout, m.settings.default_image)
            from hangar.core.sandboxes import CreateOptions, new_id

            async with m._admit:
                if len(m.store.with_vmm()) >= m.settings.max_sandboxes:
                    return
                rec = m._new_record(new_id(), State.POOLED, image, CreateOptions(timeout_s=0))
                m.store.add(rec)
            started = time.monotonic()
            try:
                rt = await m.boot(rec, image)
                await m.engine.pause(rt.vm)
            except Exception as exc:
                log.warning("pool boot failed", extra={"sandbox_id": rec.id, "error": str(exc)})
                await m._finish(rec.id, State.DELETED, None)
                return
            log.info("pool VM ready", extra={"sandbox_id": rec.id,
                                             "duration_s": round(time.monotonic() - started, 3)})

    async def maintain(self) -> None:
        """Replace pool VMs past their maximum age, then refill (called by the reconcile loop)."""
        now = time.time()
        for rec in self._pooled():
            if now - rec.created_at > self.max_age_s and rec.id in self.manager._runtimes:
                log.info("pool VM retired", extra={"sandbox_id": rec.id})
                await self.manager._finish(rec.id, State.DELETED, None)
        self.kick()

    async def close(self) -> None:
        """Stop refilling and end the pooled VMs: unlike users' sandboxes they
        do not outlive the server."""
        if self._refill is not None:
            self._refill.cancel()
            try:
                await self._refill
            except (asyncio.CancelledError, Exception):
                pass
        for rec in self._pooled():
            await self.manager._finish(rec.id, State.DELETED, None)
