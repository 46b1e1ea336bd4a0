"""Creating sandboxes: from the warm pool when one fits, else restored from the image's
template snapshot (``hangar.core.templates``), else a cold boot; and forks.

Every create takes its turn at the start gate (``hangar.core.starts``: at most
``max_concurrent_starts`` at once, the rest queued), writes its record
(``creating``) under admission, brings the
VM up, and moves the record to ``running`` by compare-and-set. A create
that fails at any step removes the VM, its files and its record: nothing
half-made is ever listed. A delete that arrives meanwhile moves the record
to ``stopping`` and ends the VM (``hangar.core.removal``); the create
notices, cleans up and answers ``Conflict`` (409, "deleted while being
created"), which is a client's race, not a server error.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from hangar.core.admission import Admission, CreateOptions, check_desktop, new_id
from hangar.core.context import Context
from hangar.core.handover import Placement
from hangar.core.launch import Launcher
from hangar.core.lifecycle import State
from hangar.core.pool import WarmPool
from hangar.core.store import SandboxRecord
from hangar.errors import Conflict, HangarError, InvalidRequest
from hangar.images import GuestImage, resolve_image

log = logging.getLogger("hangar.sandboxes")


class Creation:
    """Creates sandboxes (cold or from the pool) and brings forks up."""

    def __init__(self, ctx: Context, admission: Admission, launcher: Launcher,
                 pool: WarmPool | None) -> None:
        self.ctx = ctx
        self.admission = admission
        self.launcher = launcher
        self.pool = pool

    async def create(self, opts: CreateOptions,
                     placement: Placement | None = None) -> SandboxRecord:
        """A running sandbox, from the warm pool when one fits, else restored from its
        image's template snapshot (made first if missing), else booted cold.

        ``placement``: the id a cluster claimed for it (a pool VM, which has its own
        id, is then not used).

        Raises LimitExceeded (cap on concurrent VMs reached, or the start queue full or
        waited out: ``hangar.core.starts``), NotFound (no
        such image, volume or secret: another team's is missing), InvalidRequest (bad desktop or network), EngineError or
        Timeout (the VM did not come up), Conflict (deleted while being
        created); on any failure nothing of the sandbox is left.
        """
        started = time.monotonic()
        image = resolve_image(self.ctx.layout, opts.image or self.ctx.settings.default_image)
        if opts.desktop:
            check_desktop(opts.desktop, image)
        network = self.launcher.policy(opts.network)
        volumes = self.launcher.volumes
        # a bad request is a 4xx before anything else; a team names its own volumes and
        # secrets only (another's is missing: hangar.core.teams)
        volumes.plan("-", opts.volumes)
        wanted = self.launcher.vault.check_request(opts.secrets)  # hangar.core.secrets
        if wanted and not network:
            raise InvalidRequest("a sandbox with secrets needs a network (its egress proxy "
                                 "puts them in its requests); give it network 'internet' or "
                                 "'open'")
        sid = placement.sandbox_id if placement is not None else None
        if sid is None and not wanted and self.pool is not None and opts.team is None \
                and self.pool.fits(opts, image):
            rec = await self._from_pool(opts, image, started)
            if rec is not None:
                return rec
        rec = self.admission.new_record(sid or new_id(), State.CREATING, image, opts, network)
        async with self.admission.turn("create", rec.memory_mib, rec):  # hangar.core.starts
            async with self.admission.slot(memory_mib=rec.memory_mib, rec=rec):
                # checked and written in one step of the event loop: two creates cannot
                # both take a volume's one writer's place (hangar.core.volumes)
                self.ctx.store.add(rec, *volumes.plan(rec.id, opts.volumes))
            try:
                self.launcher.bind_secrets(rec.id, wanted)
            except BaseException:
                self.ctx.store.discard(rec.id, State.CREATING)
                await volumes.release(rec.id)
                raise
            chosen = ["template" if self.launcher.templates.enabled else "cold"]

            async def start() -> str:
                _rt, source = await self.launcher.start_new(rec, image, {State.CREATING},
                                                            crash_step="create.booting",
                                                            chosen=chosen)
                return source

            return await self.bring_up(rec, start, chosen, started)

    async def _from_pool(self, opts: CreateOptions, image: GuestImage,
                         started: float) -> SandboxRecord | None:
        assert self.pool is not None
        claimed = self.pool.claim(image)
        if claimed is None:
            self.ctx.metrics.pool_misses.inc()
            return None
        self.ctx.metrics.pool_hits.inc()
        fresh = self.admission.new_record(claimed.id, State.RUNNING, image, opts,
                                          claimed.network)
        try:
            return await self.bring_up(
                claimed, lambda: self.pool.prepare(claimed.id),  # type: ignore[union-attr]
                "pool", started, created_at=fresh.created_at,
                last_active_at=fresh.last_active_at, expires_at=fresh.expires_at,
                metadata_=fresh.metadata_, user_id=fresh.user_id,
                idle_timeout_s=fresh.idle_timeout_s, e2b=fresh.e2b, on_expiry=fresh.on_expiry,
                auto_resume=fresh.auto_resume, ttl_s=fresh.ttl_s,
                sleep_memory=fresh.sleep_memory)
        except Conflict:
            raise
        except HangarError as exc:  # a broken pool VM: it is gone; boot one cold
            log.warning("pool VM unusable", extra={"sandbox_id": claimed.id,
                                                   "error": exc.message})
            return None

    async def bring_up(self, rec: SandboxRecord, start: Callable[[], Awaitable[Any]],
                       source: str | list[str], started: float, **fields: Any) -> SandboxRecord:
        """Run ``start`` for a record in ``creating``, then move it to ``running`` with ``fields``.

        ``source``: the path it took (``cold``, ``pool``, ``fork``), or a one-item list
        that ``start`` fills in as soon as it knows (``Launcher.start_new``), unless
        ``start`` returns one (``template`` or ``cold``).

        On failure the VM and the record are removed and the error raised;
        if a delete took the record meanwhile, raises Conflict ("deleted
        while being created") instead.
        """
        ctx = self.ctx
        path = source

        def label() -> str:
            return path[0] if isinstance(path, list) else path

        with ctx.registry.creating(rec.id):
            try:
                took_path = await start()
                if isinstance(took_path, str):
                    path = took_path
                taken = label()
                rec = ctx.store.transition(rec.id, State.CREATING, State.RUNNING, source=taken,
                                           **fields)
            except BaseException as exc:
                await self.launcher.stop(rec.id)
                discarded = ctx.store.discard(rec.id, State.CREATING)
                if discarded:
                    await self.launcher.volumes.release(rec.id)
                    self.launcher.vault.forget(rec.id)
                if not discarded:
                    cur = ctx.store.get(rec.id)
                    if cur is not None and cur.state in (State.STOPPING, State.DELETED):
                        ctx.metrics.creates.labels("deleted").inc()
                        log.info("create abandoned: deleted while being created",
                                 extra={"sandbox_id": rec.id})
                        raise Conflict(f"sandbox {rec.id} was deleted while being created",
                                       sandbox_id=rec.id) from None
                ctx.metrics.creates.labels("failed").inc()
                ctx.metrics.create_seconds.labels(label(), "failed").observe(
                    time.monotonic() - started)
                if isinstance(exc, Exception):
                    log.error("sandbox create failed", extra={
                        "sandbox_id": rec.id, "source": label(),
                        "error": exc.message if isinstance(exc, HangarError) else repr(exc)})
                raise
        took = time.monotonic() - started
        ctx.metrics.creates.labels("ok").inc()
        ctx.metrics.create_seconds.labels(taken, "ok").observe(took)
        log.info("sandbox created", extra={"sandbox_id": rec.id, "duration_s": round(took, 3),
                                           "image": rec.image, "source": taken})
        ctx.publish("sandbox.created", rec.id, image=rec.image, source=taken,
                    duration_s=round(took, 3))
        return rec
