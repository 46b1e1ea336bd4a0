"""Snapshots: take one, restore a sandbox to one, start new sandboxes (forks) from one.

Taking a snapshot moves the sandbox ``running -> snapshotting``, pauses it,
has the engine save memory, device state and disk into
``snapshots/<id>/``, records the snapshot once its files are complete, then
resumes the VM and moves back to ``running``. A snapshot is refused with
``Busy`` (409, retryable) while a command or file transfer runs; calls
that arrive during one wait for it.

Restoring in place moves ``running`` (or ``failed``) ``-> restoring`` with
the snapshot's id on the record, ends the current VM, and starts a new one
from the snapshot; a server killed midway redoes the restore at start
(``redo_restore``). A fork is a create whose VM is restored from the
snapshot (``hangar.core.creation``).
"""

from __future__ import annotations

import logging
import re
import shutil
import time

from hangar.core.admission import Admission, CreateOptions, new_id
from hangar.core.context import Context
from hangar.core.handover import Placement
from hangar.core.creation import Creation
from hangar.core.launch import Launcher
from hangar.core.lifecycle import State
from hangar.core.registry import Runtime
from hangar.core.removal import Removal
from hangar.core.store import SandboxRecord, SnapshotRecord
from hangar.core.acting import acting
from hangar.core.teams import Teams
from hangar.core.testhooks import crash_point
from hangar.core.views import SandboxView, SnapshotView
from hangar.errors import Busy, Conflict, InvalidRequest, NotFound
from hangar.images import resolve_pinned

log = logging.getLogger("hangar.snapshots")


NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
"""A snapshot's name: 1 to 128 letters, digits, ``.``, ``_`` and ``-``, not first."""
_ID = re.compile(r"snap-[0-9a-f]{12}")


def check_name(name: str) -> None:
    """Refuse a snapshot name that is malformed or has a snapshot id's form (InvalidRequest)."""
    if not NAME.fullmatch(name) or _ID.fullmatch(name):
        raise InvalidRequest(f"name: {name[:140]!r} is not a snapshot name (1 to 128 letters, "
                             "digits, '.', '_' and '-', a letter or digit first, not of a "
                             "snapshot id's form)", field="name")


def running_and_idle(ctx: Context, sandbox_id: str) -> tuple[SandboxRecord, Runtime]:
    """The record and runtime of a running sandbox with no guest call in flight.

    Raises NotFound, Gone, Conflict (not running) or Busy (a call runs: retry).
    """
    rec = ctx.record(sandbox_id)
    rt = ctx.registry.get(sandbox_id)
    if rec.state != State.RUNNING or rt is None:
        raise Conflict(f"sandbox {sandbox_id} is {rec.state.value}, not running",
                       sandbox_id=sandbox_id, state=rec.state.value)
    if rt.busy:
        raise Busy(f"sandbox {sandbox_id} is running a command or file transfer; "
                   "retry when it has finished", sandbox_id=sandbox_id)
    return rec, rt


class Snapshots:
    """Takes, lists, removes and restores snapshots; forks."""

    def __init__(self, ctx: Context, admission: Admission, launcher: Launcher,
                 removal: Removal, creation: Creation) -> None:
        self.ctx = ctx
        self.admission = admission
        self.launcher = launcher
        self.removal = removal
        self.creation = creation

    # -- taking ------------------------------------------------------------------------

    async def save(self, rec: SandboxRecord, rt: Runtime, kind: str,
                   name: str | None = None, *, memory: bool = True) -> SnapshotRecord:
        """Pause the VM and save it as a snapshot of ``kind`` (``user`` or ``sleep``),
        named ``name`` when given; with ``memory`` False its disk alone
        (``Engine.snapshot``; the record's ``memory`` False).

        The VM ends paused. The record is written once the files are complete
        (a ``sleep`` snapshot becomes the sandbox's ``sleep_snapshot`` in the
        same transaction); on failure the files are removed. Raises the
        engine's errors.
        """
        ctx = self.ctx
        snap_id = new_id("snap-")
        dest = ctx.layout.snapshot(snap_id)
        started = time.monotonic()
        outcome = "failed"
        try:
            await ctx.engine.pause(rt.vm)
            crash_point(f"{'sleep' if kind == 'sleep' else 'snapshot'}.paused")
            files = await ctx.engine.snapshot(rt.vm, dest, memory=memory)
            if kind == "user":
                crash_point("snapshot.saved")
            snap = SnapshotRecord(
                id=snap_id, sandbox_id=rec.id, kind=kind, size_bytes=files.size_bytes,
                created_at=time.time(), image=rec.image, image_digest=rec.image_digest,
                vcpus=rec.vcpus, memory_mib=rec.memory_mib, disk_mib=rec.disk_mib,
                desktop=rec.desktop, network=rec.network, name=name,
                memory=None if memory else False, team=rec.team)
            self.launcher.vault.copy(rec.id, snap_id)  # its placeholders and CA, if any
            ctx.store.add_snapshot(snap, sleep_of=rec.id if kind == "sleep" else None)
            outcome = "ok"
        except BaseException:
            shutil.rmtree(dest, ignore_errors=True)
            self.launcher.vault.forget(snap_id)
            raise
        finally:
            ctx.metrics.snapshot_seconds.labels(kind, outcome).observe(time.monotonic() - started)
        return snap

    async def snapshot(self, sandbox_id: str, name: str | None = None) -> SnapshotRecord:
        """Save the sandbox's memory, device state and disk; it keeps running. ``name``:
        a name for it (``check_name``; the newest of a name answers to it: ``named``).

        Raises NotFound, Conflict (not running) or Busy (a command runs: retry).
        """
        ctx = self.ctx
        started = time.monotonic()
        if name is not None:
            check_name(name)
        self.launcher.volumes.refuse_snapshot(sandbox_id, "be snapshotted")
        async with ctx.registry.lock(sandbox_id):
            rec, rt = running_and_idle(ctx, sandbox_id)
            self.admission.check_snapshot_room(rec)
            ctx.store.transition(sandbox_id, State.RUNNING, State.SNAPSHOTTING)
            try:
                snap = await self.save(rec, rt, "user", name)
            finally:
                if rt.vm.alive():
                    await ctx.engine.resume(rt.vm)
                ctx.store.transition(sandbox_id, State.SNAPSHOTTING, State.RUNNING)
        await ctx.hooks.saved(SandboxView.of(rec), SnapshotView.of(snap))  # VM runs on meanwhile
        log.info("snapshot taken", extra={"sandbox_id": sandbox_id, "snapshot_id": snap.id,
                                          "size_bytes": snap.size_bytes,
                                          "duration_s": round(time.monotonic() - started, 3)})
        ctx.publish("snapshot.created", sandbox_id, snapshot_id=snap.id,
                    size_bytes=snap.size_bytes)
        return snap

    # -- reading and removing -----------------------------------------------------------

    def get(self, snapshot_id: str, shared: bool = False) -> SnapshotRecord:
        """A user snapshot the acting team may see (``hangar.core.teams``: another
        team's is missing), or with ``shared`` one of the operator's too (a built
        template's, which every team starts from: ``hangar.core.builds``). Raises
        NotFound."""
        snap = self.ctx.store.find(SnapshotRecord, snapshot_id)
        if snap is None or snap.kind != "user" or not (
                Teams.visible(snap) or shared and snap.team is None):
            raise NotFound(f"no snapshot {snapshot_id}", snapshot_id=snapshot_id)
        return snap

    def named(self, name: str) -> SnapshotRecord:
        """The newest user snapshot named ``name`` in the acting team's names (the
        operator's: those of no team; names are given per team). Raises NotFound."""
        who = acting()
        snaps = [s for s in self.list() if s.name == name and s.team == who]
        if not snaps:
            raise NotFound(f"no snapshot named {name!r}", snapshot=name)
        return snaps[-1]

    def list(self, sandbox_id: str | None = None) -> list[SnapshotRecord]:
        """User snapshots the acting team may see, oldest first; only ``sandbox_id``'s
        when given."""
        snaps = [s for s in self.ctx.store.list(SnapshotRecord)
                 if s.kind == "user" and Teams.visible(s)]
        if sandbox_id is not None:
            snaps = [s for s in snaps if s.sandbox_id == sandbox_id]
        return sorted(snaps, key=lambda s: s.created_at)

    def delete(self, snapshot_id: str) -> None:
        """Remove a user snapshot. Raises NotFound, Conflict (a restore from it is under way)."""
        self.get(snapshot_id)
        busy = [r.id for r in self.ctx.store.in_states({State.RESTORING})
                if r.restore_from == snapshot_id]
        if busy:
            raise Conflict(f"snapshot {snapshot_id} is being restored into {busy[0]}",
                           snapshot_id=snapshot_id, sandbox_id=busy[0])
        self.removal.drop_snapshot(snapshot_id)

    # -- restore and fork -----------------------------------------------------------------

    async def restore(self, sandbox_id: str, snapshot_id: str) -> SandboxRecord:
        """Bring a sandbox back to a snapshot of its own: processes, memory and files.

        The current VM is replaced. Raises NotFound (no such snapshot),
        InvalidRequest (the snapshot belongs to another sandbox), ImageMissing
        (its image build is gone; the VM is left as it was), Busy, Conflict
        (wrong state), LimitExceeded (a failed sandbox and no room, or the start queue
        full or waited out: ``hangar.core.starts``); if the
        restore itself fails the sandbox is ``failed``.
        """
        ctx = self.ctx
        snap = self.get(snapshot_id)
        if snap.sandbox_id != sandbox_id:
            raise InvalidRequest(f"snapshot {snapshot_id} was taken of {snap.sandbox_id}; "
                                 f"start a new sandbox from it with POST /snapshots/"
                                 f"{snapshot_id}/sandboxes", snapshot_id=snapshot_id)
        resolve_pinned(ctx.layout, snap.image, snap.image_digest)  # ImageMissing: VM untouched
        async with ctx.registry.lock(sandbox_id), self.admission.starts.turn("restore"):
            rec = ctx.record(sandbox_id)
            if rec.state == State.RUNNING:
                running_and_idle(ctx, sandbox_id)
                ctx.store.transition(sandbox_id, State.RUNNING, State.RESTORING,
                                     restore_from=snapshot_id)
                await self.launcher.stop(sandbox_id)
            elif rec.state == State.FAILED:
                async with self.admission.slot(create=False, memory_mib=rec.memory_mib,
                                               rec=rec):
                    ctx.store.transition(sandbox_id, State.FAILED, State.RESTORING,
                                         restore_from=snapshot_id, error=None,
                                         desired_state=State.RUNNING)
            else:
                raise Conflict(f"sandbox {sandbox_id} is {rec.state.value}",
                               sandbox_id=sandbox_id, state=rec.state.value)
            crash_point("restore.stopped")
            rec = await self._restore_locked(sandbox_id, snap)
        log.info("sandbox restored", extra={"sandbox_id": sandbox_id, "snapshot_id": snapshot_id})
        return rec

    async def redo_restore(self, sandbox_id: str) -> None:
        """Finish a restore that a server killed midway left in ``restoring`` with no VM."""
        ctx = self.ctx
        async with ctx.registry.lock(sandbox_id):
            rec = ctx.store.get(sandbox_id)
            if rec is None or rec.state != State.RESTORING or ctx.registry.get(sandbox_id):
                return
            snap = ctx.store.find(SnapshotRecord, rec.restore_from or "")
            if snap is None:
                ctx.store.transition(sandbox_id, State.RESTORING, State.FAILED, pid=None,
                                     restore_from=None,
                                     error=f"snapshot {rec.restore_from} is gone; the "
                                           "interrupted restore cannot be finished")
                return
            await self.launcher.stop(sandbox_id, rec.pid)  # a half-restored VM, if any
            await self._restore_locked(sandbox_id, snap)
        log.info("interrupted restore finished", extra={"sandbox_id": sandbox_id,
                                                        "snapshot_id": snap.id})

    async def _restore_locked(self, sandbox_id: str, snap: SnapshotRecord) -> SandboxRecord:
        ctx = self.ctx
        started = time.monotonic()
        rec = ctx.record(sandbox_id)
        try:
            self.launcher.vault.copy(snap.id, sandbox_id)  # the secrets its guest holds
            await self.launcher.restore(rec, snap, {State.RESTORING})
            crash_point("restore.restored")
        except BaseException as exc:
            ctx.metrics.restore_seconds.labels("failed").observe(time.monotonic() - started)
            ctx.store.transition(sandbox_id, State.RESTORING, State.FAILED, pid=None,
                                 restore_from=None, error=str(exc)[:1000] or repr(exc))
            raise
        ctx.metrics.restore_seconds.labels("ok").observe(time.monotonic() - started)
        rec = ctx.store.transition(sandbox_id, State.RESTORING, State.RUNNING, error=None,
                                   restore_from=None, last_active_at=time.time())
        rt = ctx.registry.get(sandbox_id)
        ctx.publish("snapshot.restored", sandbox_id, snapshot_id=snap.id,
                    generation=rt.generation if rt else None)
        return rec

    async def fork(self, snapshot_id: str, opts: CreateOptions,
                   placement: Placement | None = None, shared: bool = False) -> SandboxRecord:
        """A new sandbox started from a snapshot (its shape: vCPUs, memory, disk, desktop),
        under the id a cluster claimed for it when ``placement`` is given; ``shared``: the
        snapshot may be the operator's (``get``).

        Raises NotFound, LimitExceeded, Conflict (deleted while being
        created), or the engine's errors (nothing is left).
        """
        ctx = self.ctx
        started = time.monotonic()
        await ctx.hooks.fetch_snapshot(snapshot_id)
        snap = self.get(snapshot_id, shared)
        image = resolve_pinned(ctx.layout, snap.image, snap.image_digest)
        rec = self.admission.new_record(
            placement.sandbox_id if placement is not None else new_id(), State.CREATING, image,
            CreateOptions(timeout_s=opts.timeout_s, metadata=opts.metadata,
                          desktop=snap.desktop, e2b=opts.e2b, on_expiry=opts.on_expiry,
                          auto_resume=opts.auto_resume, sleep_memory=opts.sleep_memory,
                          team=opts.team),
            self.launcher.policy(snap.network or "none"), snap.vcpus, snap.memory_mib, snap.disk_mib)
        async with self.admission.turn("fork", rec.memory_mib, rec):  # hangar.core.starts
            async with self.admission.slot(memory_mib=rec.memory_mib, rec=rec):
                ctx.store.add(rec)
            try:
                self.launcher.vault.copy(snapshot_id, rec.id)  # the placeholders its guest holds
            except BaseException:
                ctx.store.discard(rec.id, State.CREATING)
                raise

            async def start() -> None:
                await self.launcher.restore(rec, snap, {State.CREATING})
                crash_point("fork.restored")

            rec = await self.creation.bring_up(rec, start, "fork", started)
        rt = ctx.registry.get(rec.id)
        ctx.publish("snapshot.forked", rec.id, snapshot_id=snapshot_id,
                    generation=rt.generation if rt else None)
        return rec
