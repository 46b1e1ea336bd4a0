"""Background tasks of one owner: started by name, crashes logged once, stopped together.

Every long-lived part of the server that runs work in the background (the
reconcile loop and its per-sandbox steps, the warm pool's refill, terminal
sessions and their sweeper, a cluster node's loops) keeps its tasks in one
``Tasks``::

    tasks = Tasks("pool")
    tasks.start("refill", self._fill())      # no-op while a "refill" runs
    tasks.running("refill")                  # True until it returns
    await tasks.stop()                       # on shutdown: cancel, then await each
    tasks.start("loop", every(5.0, self.step, log, "step failed"))  # a periodic loop

Rules:

* One task per name at a time: ``start`` of a name whose task still runs
  closes the new coroutine unstarted and returns the running task.
* A task that ends by an exception (not a cancellation) is logged once, at
  error level with its traceback, naming the owner and the task; nobody
  needs to await it for that. Its name is free again as soon as it ends.
* A task is the server's own work: it runs with no team acting
  (``hangar.core.teams``), whoever's request started it, so a long-lived loop
  first started by a team's request never sees the server through that team.
* ``stop`` cancels every task and awaits them all (also those started by a
  task while it was being stopped), each given ``timeout_s`` seconds in total
  to clean up; one that does not end in time is logged and left behind.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any

from hangar.core.acting import ACTING

log = logging.getLogger("hangar.tasks")

STOP_TIMEOUT_S = 30.0
"""How long ``Tasks.stop`` waits for cancelled tasks to clean up, seconds."""


class Tasks:
    """Named asyncio tasks of one owner (``owner`` names it in logs)."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._tasks: dict[str, asyncio.Task[Any]] = {}

    def start(self, name: str, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``coro`` as the task ``name``; the running one if ``name`` is taken (``coro``
        is then closed without running). Needs a running event loop."""
        task = self._tasks.get(name)
        if task is not None and not task.done():
            coro.close()
            return task
        context = contextvars.copy_context()
        context.run(ACTING.set, None)  # the server's own work (see the module docstring)
        task = asyncio.create_task(coro, name=f"{self.owner}: {name}", context=context)
        self._tasks[name] = task
        task.add_done_callback(lambda t: self._done(name, t))
        return task

    def _done(self, name: str, task: asyncio.Task[Any]) -> None:
        if self._tasks.get(name) is task:
            del self._tasks[name]
        if task.cancelled():
            return
        exc = task.exception()  # retrieved here, so asyncio never warns about it again
        if exc is not None:
            log.error("background task failed", exc_info=exc,
                      extra={"owner": self.owner, "task": name, "error": repr(exc)[:300]})

    def running(self, name: str) -> bool:
        """Whether the task ``name`` runs."""
        task = self._tasks.get(name)
        return task is not None and not task.done()

    def names(self) -> set[str]:
        """Names of the tasks that run."""
        return {n for n, t in self._tasks.items() if not t.done()}

    def __len__(self) -> int:
        return len(self.names())

    def cancel(self, name: str) -> None:
        """Cancel the task ``name`` if it runs (without waiting for it)."""
        task = self._tasks.get(name)
        if task is not None:
            task.cancel()

    async def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Cancel every task and wait until all have ended (at most ``timeout_s`` seconds)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        current = asyncio.current_task()
        while True:
            tasks = [t for t in self._tasks.values() if not t.done() and t is not current]
            if not tasks:
                return
            for t in tasks:
                t.cancel()
            left = deadline - loop.time()
            if left <= 0:
                break
            _, pending = await asyncio.wait(tasks, timeout=left)
            if pending:
                break
        log.warning("background tasks did not stop in time", extra={
            "owner": self.owner, "tasks": sorted(self.names()), "timeout_s": timeout_s})


async def every(interval_s: float, step: Callable[[], Awaitable[object] | object],
                logger: logging.Logger, failed: str) -> None:
    """Call ``step`` every ``interval_s`` seconds (the first after one interval), awaiting
    what it returns if that is awaitable, until cancelled. A step that raises is logged
    with ``logger.exception(failed)`` and the loop goes on: one failure never ends it."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            got = step()
            if inspect.isawaitable(got):
                await got
        except Exception:
            logger.exception(failed)


async def race(tasks: Iterable[asyncio.Task[Any]]) -> set[asyncio.Task[Any]]:
    """Wait until the first of ``tasks`` ends (returns or raises), then cancel the others
    and wait until every one has ended; returns the tasks that ended first (read their
    ``result()`` or ``exception()``). If ``race`` itself is cancelled, so are they all.
    For the halves of a relay: whichever side stops first ends both."""
    tasks = list(tasks)
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        return done
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
