"""Sleep and wake: a sandbox with no VMM that lives in a snapshot, and back.

Sleep: ``running -> snapshotting`` (desired ``sleeping``), pause, save a
``sleep`` snapshot (recorded, and named on the sandbox, in one
transaction), end the VMM, ``-> sleeping``. A sleeping sandbox holds no
VMM and does not count against the cap.

Wake: under admission ``sleeping -> waking`` (desired ``running``), restore
from the sleep snapshot (clock and entropy refreshed), ``-> running``, then
remove the sleep snapshot. A failed wake goes back to ``sleeping`` with
its snapshot intact and the error on the record.

A server killed midway is resolved at start (``hangar.core.recovery``):
a VM paused before its sleep snapshot was complete is resumed (and the
reconcile loop puts it to sleep again); one whose snapshot is complete is
ended and the sandbox is ``sleeping``; an interrupted wake goes back to
``sleeping`` and is woken again.
"""

from __future__ import annotations

import logging
import time

from hangar.core.admission import Admission
from hangar.core.context import Context
from hangar.core.launch import Launcher
from hangar.core.lifecycle import State
from hangar.core.removal import Removal
from hangar.core.snapshots import Snapshots, running_and_idle
from hangar.core.store import SandboxRecord, SnapshotRecord
from hangar.core.testhooks import crash_point, wake_delay
from hangar.core.views import SandboxView, SnapshotView
from hangar.errors import Conflict

log = logging.getLogger("hangar.sleep")


class Sleeper:
    """Puts sandboxes to sleep and wakes them."""

    def __init__(self, ctx: Context, admission: Admission, launcher: Launcher,
                 removal: Removal, snapshots: Snapshots) -> None:
        self.ctx = ctx
        self.admission = admission
        self.launcher = launcher
        self.removal = removal
        self.snapshots = snapshots

    async def sleep(self, sandbox_id: str) -> SandboxRecord:
        """Snapshot the sandbox and end its VMM; calls to it will wake it.

        A sleeping one is returned as is. Raises NotFound, Conflict (not
        running) or Busy (a command runs: retry); on failure the VM is
        resumed and the sandbox keeps running (the desired state stays
        ``sleeping``, so the reconcile loop tries again later).
        """
        ctx = self.ctx
        started = time.monotonic()
        async with ctx.registry.lock(sandbox_id):
            rec = ctx.record(sandbox_id)
            if rec.state == State.SLEEPING:
                return rec
            self.launcher.volumes.refuse_snapshot(sandbox_id, "sleep")
            rec, rt = running_and_idle(ctx, sandbox_id)
            ctx.store.transition(sandbox_id, State.RUNNING, State.SNAPSHOTTING,
                                 desired_state=State.SLEEPING)
            try:
                snap = await self.snapshots.save(rec, rt, "sleep")
                await ctx.hooks.saved(SandboxView.of(rec), SnapshotView.of(snap))  # uploaded first
            except BaseException:
                if rt.vm.alive():
                    await ctx.engine.resume(rt.vm)
                ctx.store.transition(sandbox_id, State.SNAPSHOTTING, State.RUNNING)
                raise
            crash_point("sleep.saved")
            await self.launcher.stop(sandbox_id)
            crash_point("sleep.stopped")
            rec = ctx.store.transition(sandbox_id, State.SNAPSHOTTING, State.SLEEPING, pid=None,
                                       error=None)
        log.info("sandbox asleep", extra={"sandbox_id": sandbox_id, "size_bytes": snap.size_bytes,
                                          "duration_s": round(time.monotonic() - started, 3)})
        return rec

    def want(self, sandbox_id: str, state: State) -> SandboxRecord:
        """Set the desired state (``running`` or ``sleeping``) and let the reconcile loop act.

        Raises NotFound, Gone, Conflict (a sandbox that cannot sleep or wake).
        """
        if state not in (State.RUNNING, State.SLEEPING):
            raise ValueError(f"cannot want {state}")
        rec = self.ctx.record(sandbox_id)
        if state == State.SLEEPING:
            self.launcher.volumes.refuse_snapshot(sandbox_id, "sleep")
        if rec.state not in (State.RUNNING, State.SLEEPING, State.SNAPSHOTTING, State.WAKING):
            raise Conflict(f"sandbox {sandbox_id} is {rec.state.value}", sandbox_id=sandbox_id,
                           state=rec.state.value)
        return self.ctx.store.update(sandbox_id, desired_state=state)  # type: ignore[return-value]

    async def wake(self, sandbox_id: str) -> SandboxRecord:
        """Restore a sleeping sandbox from its sleep snapshot; a running one is returned as is.

        Raises LimitExceeded (no room for another VMM), Conflict, or the
        engine's errors; on failure the sandbox stays asleep with its
        snapshot intact and the error on its record.
        """
        ctx = self.ctx
        started = time.monotonic()
        async with ctx.registry.lock(sandbox_id):
            rec = ctx.record(sandbox_id)
            if rec.state == State.RUNNING:
                return rec
            if rec.state != State.SLEEPING or not rec.sleep_snapshot:
                raise Conflict(f"sandbox {sandbox_id} is {rec.state.value}",
                               sandbox_id=sandbox_id, state=rec.state.value)
            snap = ctx.store.find(SnapshotRecord, rec.sleep_snapshot)
            if snap is None:
                raise Conflict(f"sandbox {sandbox_id} lost its sleep snapshot",
                               sandbox_id=sandbox_id)
            async with self.admission.slot(create=False, memory_mib=rec.memory_mib):
                await ctx.hooks.claim(SandboxView.of(rec))  # a cluster: owner and slot, or refused
                try:
                    rec = ctx.store.transition(sandbox_id, State.SLEEPING, State.WAKING,
                                               desired_state=State.RUNNING)
                except BaseException:
                    await ctx.hooks.release(sandbox_id)
                    raise
            try:
                await wake_delay()
                await self.launcher.restore(rec, snap, {State.WAKING})
                crash_point("wake.restored")
            except BaseException as exc:
                ctx.metrics.wake_seconds.labels("failed").observe(time.monotonic() - started)
                ctx.store.transition(sandbox_id, State.WAKING, State.SLEEPING, pid=None,
                                     error=f"wake failed: {exc}"[:1000])
                await ctx.hooks.release(sandbox_id)
                raise
            rec = ctx.store.transition(sandbox_id, State.WAKING, State.RUNNING,
                                       sleep_snapshot=None, last_active_at=time.time(),
                                       error=None)
            self.removal.drop_snapshot(snap.id)
        took = time.monotonic() - started
        ctx.metrics.wake_seconds.labels("ok").observe(took)
        log.info("sandbox awake", extra={"sandbox_id": sandbox_id, "duration_s": round(took, 3)})
        return rec
