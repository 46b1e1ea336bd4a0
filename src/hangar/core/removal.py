"""Ending sandboxes: delete, expiry, a dead VMM, and removing snapshots' files.

Every ending is two moves: to ``stopping`` with the end written as the
desired state (``deleted``, ``expired`` or ``failed``), then, once the VMM,
its folder, its NIC and any sleep snapshot are gone, to that end. A server
killed in between finishes the job at start (``complete``).

Callers hold the sandbox's lock, except for a delete that meets a sandbox
still ``creating``: the create holds no lock (nothing else can touch a
sandbox before it runs), so the delete moves it to ``stopping``, ends its
VM, and waits for the create to notice and give up (it answers 409); then
it completes the removal.
"""

from __future__ import annotations

import logging
import shutil

from hangar.core.context import Context
from hangar.core.launch import Launcher
from hangar.core.lifecycle import ENDINGS, State
from hangar.core.store import SnapshotRecord
from hangar.core.testhooks import crash_point
from hangar.errors import Conflict, Deleting

log = logging.getLogger("hangar.removal")

STOPPABLE = frozenset({State.CREATING, State.POOLED, State.RUNNING, State.UNRESPONSIVE,
                       State.SNAPSHOTTING, State.SLEEPING, State.RESTORING, State.FAILED})
"""States that may move to ``stopping``."""

CREATE_GIVE_UP_S = 30.0
"""How long a delete waits for a create it interrupted to clean up, seconds."""


class Removal:
    """Ends sandboxes and removes snapshot files."""

    def __init__(self, ctx: Context, launcher: Launcher) -> None:
        self.ctx = ctx
        self.launcher = launcher

    async def finish(self, sandbox_id: str, end: State, error: str | None = None) -> None:
        """Move the sandbox to ``stopping`` and then to ``end`` (deleted, expired, failed).

        The caller holds the sandbox's lock. Raises Conflict when it is
        already stopping or gone.
        """
        if end not in ENDINGS:
            raise ValueError(f"{end} is not an ending")
        self.ctx.store.transition(sandbox_id, STOPPABLE, State.STOPPING, desired_state=end,
                                  error=error)
        if end == State.DELETED:
            crash_point("delete.stopping")
        await self.complete(sandbox_id)

    async def complete(self, sandbox_id: str) -> None:
        """Finish a sandbox in ``stopping``: end its VMM, remove its files, move to its end."""
        rec = self.ctx.store.get(sandbox_id)
        if rec is None or rec.state != State.STOPPING:
            return
        rt = self.ctx.registry.get(sandbox_id)
        if rt is not None and rt.vm.alive():  # what its guest wrote reaches its volumes
            await self.launcher.volumes.unmount(rt, sandbox_id, self.launcher.reconnect)
        await self.launcher.stop(sandbox_id, rec.pid)
        await self.launcher.volumes.release(sandbox_id)
        if rec.sleep_snapshot:
            self.drop_snapshot(rec.sleep_snapshot)
        end = rec.desired_state if rec.desired_state in ENDINGS else State.DELETED
        if end != State.FAILED:  # a failed sandbox may be restored: it keeps its secrets
            self.launcher.vault.forget(sandbox_id)
        self.ctx.store.transition(sandbox_id, State.STOPPING, end, pid=None,
                                  sleep_snapshot=None, restore_from=None)
        log.info(f"sandbox {end.value}", extra={"sandbox_id": sandbox_id})

    async def delete(self, sandbox_id: str) -> None:
        """End the sandbox's VM, remove its files and sleep snapshot; keep a tombstone.

        Raises NotFound (unknown or deleted), Gone (expired), Deleting
        (already being deleted).
        """
        ctx = self.ctx
        while True:
            rec = ctx.record(sandbox_id)
            if rec.state == State.STOPPING:
                raise Deleting(f"sandbox {sandbox_id} is already being deleted",
                               sandbox_id=sandbox_id)
            if rec.state == State.CREATING:
                try:
                    ctx.store.transition(sandbox_id, State.CREATING, State.STOPPING,
                                         desired_state=State.DELETED)
                except Conflict:
                    continue  # it has just started running (or someone else stopped it)
                await self._interrupt_create(sandbox_id)
                return
            async with ctx.registry.lock(sandbox_id):
                rec = ctx.record(sandbox_id)
                if rec.state == State.CREATING:
                    continue
                if rec.state == State.STOPPING:
                    raise Deleting(f"sandbox {sandbox_id} is already being deleted",
                                   sandbox_id=sandbox_id)
                await self.finish(sandbox_id, State.DELETED)
                return

    async def _interrupt_create(self, sandbox_id: str) -> None:
        ctx = self.ctx
        rt = ctx.registry.get(sandbox_id)
        if rt is not None:  # the create is waiting for the agent: end that wait now
            await ctx.engine.stop(rt.vm)
        if not await ctx.registry.create_ended(sandbox_id, CREATE_GIVE_UP_S):
            log.warning("an interrupted create did not give up in time",
                        extra={"sandbox_id": sandbox_id})
        async with ctx.registry.lock(sandbox_id):
            await self.complete(sandbox_id)

    def drop_snapshot(self, snapshot_id: str) -> None:
        """Remove a snapshot's record and files."""
        self.ctx.store.remove(SnapshotRecord, snapshot_id)
        self.launcher.vault.forget(snapshot_id)
        shutil.rmtree(self.ctx.layout.snapshot(snapshot_id), ignore_errors=True)
