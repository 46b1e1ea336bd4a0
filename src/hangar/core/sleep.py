"""Sleep and wake: a sandbox with no VMM that lives in a snapshot, and back; the verbs
protocols build on them (pause, connect, settled), and a sandbox's clock across a sleep.

Sleep: ``running -> snapshotting`` (desired ``sleeping``), pause, save a
``sleep`` snapshot (recorded, and named on the sandbox, in one
transaction), end the VMM, ``-> sleeping``. A sleeping sandbox holds no
VMM and does not count against the cap.

Wake: under admission ``sleeping -> waking`` (desired ``running``), restore
from the sleep snapshot (clock and entropy refreshed), ``-> running``, then
remove the sleep snapshot. A failed wake goes back to ``sleeping`` with
its snapshot intact and the error on the record.

A sleep that keeps the disk alone (``memory`` False: E2B's filesystem-only
pause) makes the guest flush its file systems (``Launcher.flush``), then saves
a disk-only sleep snapshot (``SnapshotRecord.memory`` False: no memory or
device state); its wake boots the guest cold from a copy of that disk
(``Launcher.boot_from``): files kept, processes and memory gone, a new
kernel boot. The moves and the clock are the same.

A server killed midway is resolved at start (``hangar.core.recovery``):
a VM paused before its sleep snapshot was complete is resumed (and the
reconcile loop puts it to sleep again); one whose snapshot is complete is
ended and the sandbox is ``sleeping``; an interrupted wake goes back to
``sleeping`` and is woken again.

The verbs, each one move (or compare-and-set) of the store at a time, so the
reconcile loop never sees half of one:

``pause``     a sleep that stops the clock (keeping memory, or the disk alone): its
              ``running -> snapshotting``
              move arms ``wake_ttl_s`` (the record's ``ttl_s``), and its
              ``snapshotting -> sleeping`` move (or recovery's) clears
              ``expires_at`` in the same transaction. A plain ``sleep`` (a
              machine's idleness, Hangar's own API) leaves the clock running.
``wake``      its ``waking -> running`` move restarts a stopped clock
              (``expires_at`` = now + ``wake_ttl_s``; 0: no limit) and disarms
              it; given a ``ttl_s`` (a connect) it sets that one instead.
``connect``   wakes a sleeping sandbox with a time to live (``WOKE``), or
              extends a running one's (``EXTENDED``: never shortens, never
              limits one without a limit); waits out a move in progress first.
``settled``   the record once no operation holds it between two states
              (``lifecycle.MOVING``), woken by the store's change notification
              (``Store.on_change``), never by polling.
``extend``    ``Store.extend``: a time to live made longer, never shorter.

The reconcile loop puts a sandbox whose record says ``on_expiry`` ``sleep``
to sleep with ``pause`` when its time runs out (``hangar.core.reconcile``).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import threading
import time
from collections.abc import Collection
from dataclasses import dataclass

from hangar.core.admission import Admission
from hangar.core.context import Context
from hangar.core.launch import Launcher
from hangar.core.lifecycle import LIVE, MOVING, State, restarted_clock, stopped_clock
from hangar.core.removal import Removal
from hangar.core.snapshots import Snapshots, running_and_idle
from hangar.core.store import SandboxRecord, SnapshotRecord
from hangar.core.testhooks import crash_point, wake_delay
from hangar.core.views import SandboxView, SnapshotView
from hangar.errors import Busy, Conflict

log = logging.getLogger("hangar.sleep")

SETTLE_S = 120.0
"""Longest ``connect`` waits for a sandbox between states (pausing, waking), seconds."""
CONNECT_TRIES = 3
"""Times ``connect`` acts again on a sandbox that moved between its look and its act."""


class Connect(str, enum.Enum):
    """What ``connect`` did."""

    WOKE = "woke"
    """It slept: it was woken and lives the connect's time to live from now."""
    EXTENDED = "extended"
    """It ran: its time to live was extended to at least the connect's (``extend``)."""

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Connected:
    """The answer of ``connect``: the sandbox after it (a frozen view), and what it did."""

    record: SandboxView
    did: Connect


class Sleeper:
    """Puts sandboxes to sleep and wakes them."""

    def __init__(self, ctx: Context, admission: Admission, launcher: Launcher,
                 removal: Removal, snapshots: Snapshots) -> None:
        self.ctx = ctx
        self.admission = admission
        self.launcher = launcher
        self.removal = removal
        self.snapshots = snapshots
        self._waiters: dict[str, set[tuple[asyncio.AbstractEventLoop, asyncio.Event]]] = {}
        """Sandbox id -> the ``settled`` calls waiting for it to move."""
        self._waiters_lock = threading.Lock()
        """Guards ``_waiters``: a change notice may come from another thread."""
        ctx.store.on_change(self._changed)

    def _changed(self, sandbox_id: str) -> None:
        """The store's change notification: wake every ``settled`` waiting on it (any
        thread may call it)."""
        with self._waiters_lock:
            waiting = list(self._waiters.get(sandbox_id, ()))
        for loop, event in waiting:
            loop.call_soon_threadsafe(event.set)

    async def settled(self, sandbox_id: str, timeout_s: float = SETTLE_S) -> SandboxRecord:
        """The record once no operation holds the sandbox between two states (not in
        ``lifecycle.MOVING``: ``running``, ``unresponsive``, ``sleeping``, ``failed``,
        ``stopping``). Waits for the store's notice of its next move, up to ``timeout_s``
        in all. Raises NotFound, Gone (also when it ends meanwhile), Busy (still moving
        after ``timeout_s``: retry)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            waiter = (loop, asyncio.Event())
            with self._waiters_lock:
                self._waiters.setdefault(sandbox_id, set()).add(waiter)
            try:
                rec = self.ctx.record(sandbox_id)  # read after the waiter is in place
                if rec.state not in MOVING:
                    return rec
                left = deadline - loop.time()
                if left <= 0:
                    raise Busy(f"sandbox {sandbox_id} is still {rec.state.value}",
                               retry_after=5.0, sandbox_id=sandbox_id, state=rec.state.value)
                try:
                    await asyncio.wait_for(waiter[1].wait(), left)
                except TimeoutError:
                    pass  # read once more: the answer says what it is now
            finally:
                with self._waiters_lock:
                    waiting = self._waiters.get(sandbox_id)
                    if waiting is not None:
                        waiting.discard(waiter)
                        if not waiting:
                            del self._waiters[sandbox_id]

    def extend(self, sandbox_id: str, ttl_s: float,
               expect: Collection[State] = LIVE) -> SandboxRecord:
        """Make the sandbox live at least ``ttl_s`` seconds from now; never shortens, never
        limits one without a limit (``Store.extend``). Raises NotFound, Conflict (not in
        ``expect``)."""
        return self.ctx.store.extend(sandbox_id, time.time() + ttl_s, expect)

    async def pause(self, sandbox_id: str, memory: bool | None = None) -> SandboxRecord:
        """Sleep with the clock stopped: asleep it has no time limit, woken it gets its
        ``ttl_s`` back (or a connect's). ``memory``: whether the sleep keeps its memory
        (False: its disk alone, and the wake boots it cold); None: as its record's
        ``sleep_memory`` says (a sleep at expiry). A sleeping one is returned as is.
        Raises as ``sleep``."""
        if memory is None:
            memory = self.ctx.record(sandbox_id).sleep_memory is not False
        return await self.sleep(sandbox_id, pause=True, memory=memory)

    async def connect(self, sandbox_id: str, ttl_s: float,
                      settle_s: float = SETTLE_S) -> Connected:
        """Wake the sandbox if it sleeps, with ``ttl_s`` seconds to live from now (0: no
        limit), or extend a running (or unresponsive) one's to at least ``ttl_s``; a move in
        progress is waited out first (``settled``, up to ``settle_s``).

        Raises NotFound, Gone, Conflict (failed or stopping: nothing to connect to), Busy
        (still moving, or it kept moving under the connect: retry), and ``wake``'s errors.
        """
        for _ in range(CONNECT_TRIES):
            rec = await self.settled(sandbox_id, settle_s)
            try:
                if rec.state == State.SLEEPING:
                    rec, woke = await self._wake(sandbox_id, ttl_s)
                    if woke:
                        return Connected(SandboxView.of(rec), Connect.WOKE)
                if rec.state in (State.RUNNING, State.UNRESPONSIVE):
                    rec = self.extend(sandbox_id, ttl_s, {State.RUNNING, State.UNRESPONSIVE})
                    return Connected(SandboxView.of(rec), Connect.EXTENDED)
            except Conflict as exc:
                if isinstance(exc, Busy) or self.ctx.record(sandbox_id).state == rec.state:
                    raise  # not a move under it: the connect's own answer
                continue
            raise Conflict(f"sandbox {sandbox_id} is {rec.state.value}",
                           sandbox_id=sandbox_id, state=rec.state.value)
        raise Busy(f"sandbox {sandbox_id} keeps changing state; retry", retry_after=2.0,
                   sandbox_id=sandbox_id)

    async def sleep(self, sandbox_id: str, pause: bool = False,
                    memory: bool = True) -> SandboxRecord:
        """Snapshot the sandbox and end its VMM; calls to it will wake it. With ``pause``
        its clock stops as it falls asleep (``stopped_clock``). With ``memory`` False only
        its disk is kept, once its guest has flushed its file systems; the wake boots it
        cold (the module docstring).

        A sleeping one is returned as is. Raises NotFound, Conflict (not
        running) or Busy (a command runs: retry); on failure the VM is
        resumed and the sandbox keeps running with its clock (the desired state
        stays ``sleeping``, so the reconcile loop tries again later).
        """
        ctx = self.ctx
        started = time.monotonic()
        async with ctx.registry.lock(sandbox_id):
            rec = ctx.record(sandbox_id)
            if rec.state == State.SLEEPING:
                return rec
            self.launcher.volumes.refuse_snapshot(sandbox_id, "sleep")
            rec, rt = running_and_idle(ctx, sandbox_id)
            armed = {"wake_ttl_s": rec.ttl_s or 0.0} if pause else {}
            rec = ctx.store.transition(sandbox_id, State.RUNNING, State.SNAPSHOTTING,
                                       desired_state=State.SLEEPING, **armed)
            try:
                if not memory:
                    await self.launcher.flush(rt, sandbox_id)
                snap = await self.snapshots.save(rec, rt, "sleep", memory=memory)
                await ctx.hooks.saved(SandboxView.of(rec), SnapshotView.of(snap))  # uploaded first
            except BaseException:
                if rt.vm.alive():
                    await ctx.engine.resume(rt.vm)
                ctx.store.transition(sandbox_id, State.SNAPSHOTTING, State.RUNNING,
                                     **({"wake_ttl_s": None} if pause else {}))
                raise
            crash_point("sleep.saved")
            await self.launcher.stop(sandbox_id)
            crash_point("sleep.stopped")
            rec = ctx.store.transition(sandbox_id, State.SNAPSHOTTING, State.SLEEPING, pid=None,
                                       error=None, **stopped_clock(rec))
        log.info("sandbox asleep", extra={"sandbox_id": sandbox_id, "size_bytes": snap.size_bytes,
                                          "memory": memory,
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

    async def wake(self, sandbox_id: str, ttl_s: float | None = None) -> SandboxRecord:
        """Restore a sleeping sandbox from its sleep snapshot (or boot it cold from the disk
        of a disk-only one); a running one is returned as is.
        A clock a pause stopped runs again (``restarted_clock``); ``ttl_s``: the time to
        live it gets instead (seconds, 0: none).

        Raises LimitExceeded (no room for another VMM), Conflict, or the
        engine's errors; on failure the sandbox stays asleep with its
        snapshot intact and the error on its record.
        """
        rec, _ = await self._wake(sandbox_id, ttl_s)
        return rec

    async def _wake_locked(self, rec: SandboxRecord, snap: SnapshotRecord,
                           started: float) -> None:
        """Admit a sleeping sandbox's VMM and bring it up from ``snap`` (under its lock and
        a start slot); on failure it is ``sleeping`` again and the error is raised."""
        ctx = self.ctx
        sandbox_id = rec.id
        async with self.admission.slot(create=False, memory_mib=rec.memory_mib, rec=rec):
            await ctx.hooks.claim(SandboxView.of(rec))  # a cluster: owner and slot, or refused
            try:
                rec = ctx.store.transition(sandbox_id, State.SLEEPING, State.WAKING,
                                           desired_state=State.RUNNING)
            except BaseException:
                await ctx.hooks.release(sandbox_id)
                raise
        try:
            await wake_delay()
            if snap.memory is False:
                await self.launcher.boot_from(rec, snap, {State.WAKING})
            else:
                await self.launcher.restore(rec, snap, {State.WAKING})
            crash_point("wake.restored")
        except BaseException as exc:
            ctx.metrics.wake_seconds.labels("failed").observe(time.monotonic() - started)
            ctx.store.transition(sandbox_id, State.WAKING, State.SLEEPING, pid=None,
                                 error=f"wake failed: {exc}"[:1000])
            await ctx.hooks.release(sandbox_id)
            raise

    async def _wake(self, sandbox_id: str,
                    ttl_s: float | None) -> tuple[SandboxRecord, bool]:
        """``wake``; also says whether this call woke it (False: it ran already)."""
        ctx = self.ctx
        started = time.monotonic()
        async with ctx.registry.lock(sandbox_id):
            rec = ctx.record(sandbox_id)
            if rec.state == State.RUNNING:
                return rec, False
            if rec.state != State.SLEEPING or not rec.sleep_snapshot:
                raise Conflict(f"sandbox {sandbox_id} is {rec.state.value}",
                               sandbox_id=sandbox_id, state=rec.state.value)
            snap = ctx.store.find(SnapshotRecord, rec.sleep_snapshot)
            if snap is None:
                raise Conflict(f"sandbox {sandbox_id} lost its sleep snapshot",
                               sandbox_id=sandbox_id)
            async with self.admission.turn("wake", rec.memory_mib, rec, create=False):
                await self._wake_locked(rec, snap, started)
            rec = ctx.record(sandbox_id)
            now = time.time()
            rec = ctx.store.transition(sandbox_id, State.WAKING, State.RUNNING,
                                       sleep_snapshot=None, last_active_at=now, error=None,
                                       **restarted_clock(rec, ttl_s, now))
            self.removal.drop_snapshot(snap.id)
        took = time.monotonic() - started
        ctx.metrics.wake_seconds.labels("ok").observe(took)
        log.info("sandbox awake", extra={"sandbox_id": sandbox_id, "duration_s": round(took, 3),
                                         "cold": snap.memory is False})
        return rec, True
