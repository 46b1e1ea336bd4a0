"""The reconcile loop: move every sandbox's current state toward its desired one.

Every ``interval_s`` (1 s) one pass (``tick``) reads the live records (in a
thread, off the event loop) and decides, without waiting on anything, what
each sandbox needs (``plan``):

``expire``    its time to live ran out (running, unresponsive or sleeping)
``pause``     its time to live ran out while it runs, and its record's ``on_expiry``
              is ``sleep``: it sleeps with its clock stopped once no call is in
              flight (``Sleeper.pause``: asleep it has no time limit, woken it gets
              its ``ttl_s`` back)
``crash``     its VMM died (or this server holds no VM for it)
``sleep``     it wants to sleep (a machine idle past its idle timeout does)
``wake``      it sleeps but wants to run
``restore``   a restore was interrupted by a restart: do it again
``complete``  a removal stopped midway: finish it

Each sandbox with work gets its own task, at most one at a time. Slow work
(sleep, wake, restore, complete) runs at most ``concurrency`` at once;
expiry and crash handling never wait for that bound, only for the
sandbox's own lock, so one slow wake never delays another sandbox's
expiry or crash detection. A failed step is retried with exponential
backoff (2 s, 4 s, ... up to 5 min) and its error is written on the record
(``error``; ``GET /sandboxes/{id}`` shows it) until a step succeeds.

Other passes (the warm pool's maintenance, machines' bookkeeping, the purge
of old tombstones) run as tasks of their own from the same tick.

One record never stops the pass for the others: a record whose planning
fails (a damaged value) is logged once, marked (its ``error``) and skipped,
and a row that cannot even be read is left out by ``Store.in_states``. The
rest of the pass goes on: every other sandbox still expires, sleeps and is
reaped on time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from hangar.core.context import Context
from hangar.core.lifecycle import OnExpiry, State
from hangar.core.pool import WarmPool
from hangar.core.removal import Removal
from hangar.core.sleep import Sleeper
from hangar.core.snapshots import Snapshots
from hangar.core.store import SandboxRecord
from hangar.core.tasks import Tasks, every
from hangar.errors import Conflict, HangarError, ImageMissing

log = logging.getLogger("hangar.reconcile")

INTERVAL_S = 1.0
"""Seconds between passes."""
BACKOFF_S = (2.0, 300.0)
"""First and largest wait before retrying a failed step, seconds (doubling)."""
SLOW = frozenset({"sleep", "pause", "wake", "restore", "complete"})
EXPIRABLE = frozenset({State.RUNNING, State.UNRESPONSIVE, State.SLEEPING})

Pass = Callable[[], Coroutine[Any, Any, None]]


class Reconciler:
    """Runs the reconcile loop of one server."""

    def __init__(self, ctx: Context, removal: Removal, sleeper: Sleeper, snapshots: Snapshots,
                 pool: WarmPool | None, concurrency: int = 4,
                 interval_s: float = INTERVAL_S) -> None:
        self.ctx = ctx
        self.removal = removal
        self.sleeper = sleeper
        self.snapshots = snapshots
        self.pool = pool
        self.interval_s = interval_s
        self._slow = asyncio.Semaphore(max(1, concurrency))
        self._work_tasks = Tasks("reconcile")
        """One task per sandbox with work under way, named by its id."""
        self._background = Tasks("reconcile")
        """The loop and the passes."""
        self._passes: dict[str, Pass] = {}
        self._failures: dict[str, int] = {}
        self._retry_at: dict[str, float] = {}
        self._bad: set[str] = set()
        """Sandboxes whose record failed planning, each logged once until it plans again."""

    def add_pass(self, name: str, fn: Pass) -> None:
        """Run ``fn`` from every tick as its own task (never two at once)."""
        self._passes[name] = fn

    def start(self) -> None:
        self._background.start("loop", every(self.interval_s, self.tick, log,
                                             "reconcile pass failed"))

    def busy_ids(self) -> set[str]:
        """Sandboxes with a reconcile task under way."""
        return self._work_tasks.names()

    async def tick(self) -> None:
        """One pass: plan every live sandbox and start the tasks it needs. Waits only for
        the read of the live records, which runs in a thread: with a hundred sandboxes
        it is the pass's largest cost, and on the event loop it held every request
        (``/health`` too) for tens of milliseconds each second."""
        live = await asyncio.to_thread(self.ctx.store.live)
        now = time.time()
        for rec in live:
            if self._work_tasks.running(rec.id):
                continue
            try:
                action = self.plan(rec, now)
            except Exception as exc:  # one bad record never stops the pass
                self._bad_record(rec.id, exc)
                continue
            self._bad.discard(rec.id)
            if action is None:
                continue
            if action in SLOW and self._retry_at.get(rec.id, 0.0) > now:
                continue
            self._work_tasks.start(rec.id, self._work(rec.id, action))
        ids = {r.id for r in live}
        for table in (self._failures, self._retry_at):
            for sid in [s for s in table if s not in ids]:
                del table[sid]
        self._bad &= ids
        passes = dict(self._passes)
        if self.pool is not None:
            passes["pool"] = self.pool.maintain
        for name, fn in passes.items():
            if not self._background.running(f"pass {name}"):
                self._background.start(f"pass {name}", fn())

    def _bad_record(self, sid: str, exc: Exception) -> None:
        """Log once and mark a record that ``plan`` failed on; the pass goes on."""
        if sid in self._bad:
            return
        self._bad.add(sid)
        log.error("sandbox record skipped by the reconcile pass", exc_info=exc,
                  extra={"sandbox_id": sid, "error": repr(exc)[:300]})
        try:
            self.ctx.store.update(sid, error=f"reconcile: unusable record: {exc!r}"[:1000])
        except Exception:  # the mark is best effort; the log line is the record
            pass

    def plan(self, rec: SandboxRecord, now: float) -> str | None:
        """What ``rec`` needs now, or None (see the module docstring)."""
        ctx = self.ctx
        sid, state = rec.id, rec.state
        rt = ctx.registry.get(sid)
        locked = ctx.registry.locked(sid)
        if rec.expires_at is not None and rec.expires_at <= now and state in EXPIRABLE:
            if state != State.RUNNING or rec.on_expiry != OnExpiry.SLEEP:
                return "expire"
            if rt is not None and rt.vm.alive():  # else it crashed (below)
                if rt.busy:
                    return None  # paused once no call is in flight
                log.info("sandbox timed out: pausing", extra={"sandbox_id": sid})
                return "pause"
        if state in (State.RUNNING, State.UNRESPONSIVE) and not locked and (
                rt is None or not rt.vm.alive()):
            return "crash"
        if state == State.RUNNING and rt is not None and rt.busy == 0:
            idle = rec.idle_timeout_s
            if (idle and rec.desired_state == State.RUNNING
                    and now - max(rec.last_active_at, rec.created_at) >= idle):
                try:
                    ctx.store.update(sid, desired_state=State.SLEEPING)
                except Conflict:  # it moved since the pass read it: the next pass sees it
                    return None
                log.info("sandbox idle", extra={"sandbox_id": sid, "idle_s": idle})
                return "sleep"
            if rec.desired_state == State.SLEEPING:
                return "sleep"
        if state == State.SLEEPING and rec.desired_state == State.RUNNING:
            return "wake"
        if state == State.RESTORING and rt is None and not locked:
            return "restore"
        if (state == State.STOPPING and not locked
                and not ctx.registry.create_in_flight(sid)):
            return "complete"
        return None

    async def _work(self, sid: str, action: str) -> None:
        ctx = self.ctx
        try:
            if action in SLOW:
                async with self._slow:
                    await self._slow_step(sid, action)
            else:
                async with ctx.registry.lock(sid):
                    await self._quick_step(sid, action)
            self._failures.pop(sid, None)
            self._retry_at.pop(sid, None)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            n = self._failures[sid] = self._failures.get(sid, 0) + 1
            first, most = BACKOFF_S
            # A missing image build does not come back by itself: try again rarely.
            wait = most if isinstance(exc, ImageMissing) else min(most, first * 2 ** (n - 1))
            self._retry_at[sid] = time.time() + wait
            msg = exc.message if isinstance(exc, HangarError) else repr(exc)
            try:
                ctx.store.update(sid, error=f"{action} failed: {msg}"[:1000])
            except Exception:  # a record that cannot even be marked: the log says it
                pass
            log.warning("reconcile step failed", extra={
                "sandbox_id": sid, "action": action, "error": msg, "attempt": n,
                "retry_in_s": wait})

    async def _quick_step(self, sid: str, action: str) -> None:
        """Expiry and crash handling, under the sandbox's lock, re-checked there."""
        rec = self.ctx.store.get(sid)
        if rec is None:
            return
        now = time.time()
        if action == "expire":
            if rec.state in EXPIRABLE and rec.expires_at is not None and rec.expires_at <= now:
                await self.removal.finish(sid, State.EXPIRED)
                log.info("sandbox expired", extra={"sandbox_id": sid})
        elif action == "crash":
            rt = self.ctx.registry.get(sid)
            if rec.state in (State.RUNNING, State.UNRESPONSIVE) and (
                    rt is None or not rt.vm.alive()):
                log.warning("VMM died", extra={"sandbox_id": sid,
                                               "pid": rt.vm.pid if rt else rec.pid})
                await self.removal.finish(sid, State.FAILED, "the VMM process exited")

    async def _slow_step(self, sid: str, action: str) -> None:
        if action == "sleep":
            await self.sleeper.sleep(sid)
        elif action == "pause":
            await self.sleeper.pause(sid)
        elif action == "wake":
            await self.sleeper.wake(sid)
        elif action == "restore":
            await self.snapshots.redo_restore(sid)
        elif action == "complete":
            async with self.ctx.registry.lock(sid):
                await self.removal.complete(sid)

    async def close(self) -> None:
        """Stop the loop and its tasks (each cleans up after itself)."""
        await self._background.stop()
        await self._work_tasks.stop()
