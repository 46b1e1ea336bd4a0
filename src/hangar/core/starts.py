"""The start gate: how many VMMs may be starting at once, and the queue before it.

A start is a VMM boot, a restore of a snapshot into a new VMM (a create from a
template snapshot, a fork, a restore in place) or a wake. Under emulation
each one takes a core for seconds; a hundred at once share two cores and all
finish together, at the end. So at most ``max_concurrent_starts`` run at once
(``HANGAR_MAX_CONCURRENT_STARTS``, default ``max(2, cores)``) and the rest
wait their turn in FIFO order in a bounded queue:

* a start that finds a free slot and no one queued runs at once;
* else it queues, if fewer than ``start_queue`` (``HANGAR_START_QUEUE``) wait;
  a freed slot goes to the oldest waiter (handed over, so no late comer
  overtakes it);
* past the queue's length it is refused at once: ``LimitExceeded`` (429,
  ``Retry-After``) with ``limit: start_queue_full``; past
  ``start_queue_wait_s`` (``HANGAR_START_QUEUE_WAIT_S``) in the queue it is
  refused the same way with ``limit: start_queue_wait``. Nothing was started
  for a refused request;
* a client that disconnects while its request waits leaves the queue
  (``leave_when``: the API sets an event its request's disconnect sets).

The warm pool takes a slot only when one is free and no one waits
(``try_take``): a refill never overtakes a waiting client. A client that
arrives while a refill holds a slot waits for it (one restore), and the queue
holds one more client per refill under way, so a refill never makes a client's
start refused.

A start holds its slot from its admission (``hangar.core.admission``, whose
checks it passes after its wait, so the VMM cap, memory budget and team
quotas stay exact) until its guest answers or the start fails.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass

from hangar.errors import LimitExceeded
from hangar.metrics import Metrics

log = logging.getLogger("hangar.starts")

QUEUE_RETRY_AFTER_S = 5.0
"""What a start refused by a full queue is told to wait, seconds."""

_LEAVE: contextvars.ContextVar[asyncio.Event | None] = contextvars.ContextVar(
    "hangar_start_leave", default=None)


def default_concurrent_starts() -> int:
    """``max(2, cores)``: the default of ``HANGAR_MAX_CONCURRENT_STARTS``."""
    return max(2, os.cpu_count() or 1)


@contextmanager
def leave_when(gone: asyncio.Event) -> Iterator[None]:
    """While the block runs, a start queued in this task leaves the queue as soon as
    ``gone`` is set (the API sets it when its client disconnects); it is then refused
    with ``LimitExceeded`` (``limit: client_gone``), which no one reads."""
    token = _LEAVE.set(gone)
    try:
        yield
    finally:
        _LEAVE.reset(token)


@dataclass(frozen=True)
class StartsView:
    """The gate's figures: starts ``running`` of ``limit``, ``queued`` of ``queue``
    (its length), ``max_wait_s`` in the queue at most; counts since start-up of starts
    that waited (``waited``) and were refused (``refused``, by a full queue or its
    maximum wait)."""

    running: int
    limit: int
    queued: int
    queue: int
    max_wait_s: float
    waited: int
    refused: int


class StartGate:
    """At most ``limit`` starts at once; up to ``queue`` more wait in FIFO order, each
    at most ``max_wait_s`` seconds."""

    def __init__(self, limit: int, queue: int, max_wait_s: float,
                 metrics: Metrics | None = None) -> None:
        self.limit = limit
        self.queue = queue
        self.max_wait_s = max_wait_s
        self.running = 0
        self.refilling = 0
        """Slots held by the warm pool's refills (``try_take``)."""
        self.waited = 0
        self.refused = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._metrics = metrics

    def view(self) -> StartsView:
        """The figures now (``StartsView``)."""
        return StartsView(running=self.running, limit=self.limit, queued=len(self._waiters),
                          queue=self.queue, max_wait_s=self.max_wait_s, waited=self.waited,
                          refused=self.refused)

    def try_take(self) -> bool:
        """Take a slot if one is free and no one waits (the warm pool); True if taken,
        then ``release`` it."""
        if self.running < self.limit and not self._waiters:
            self.running += 1
            self.refilling += 1
            return True
        return False

    def release(self, refill: bool = False) -> None:
        """Give a slot back: to the oldest waiter, else to the free ones. ``refill``:
        the slot was taken by ``try_take``."""
        if refill:
            self.refilling -= 1
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the slot passes to it; running stays the same
                return
        self.running -= 1

    @asynccontextmanager
    async def turn(self, kind: str = "create") -> AsyncIterator[None]:
        """Hold one start slot while the block runs, waiting in the queue for it first.

        ``kind`` (``create``, ``fork``, ``wake``, ``restore``) names the start in logs.
        Raises LimitExceeded (429, ``Retry-After``) when the queue is full
        (``limit: start_queue_full``), when the wait passes ``max_wait_s``
        (``limit: start_queue_wait``), or when the client left (``limit:
        client_gone``); in each case nothing was taken.
        """
        await self._take(kind)
        try:
            yield
        finally:
            self.release()

    async def _take(self, kind: str) -> None:
        if self.running < self.limit and not self._waiters:
            self.running += 1
            return
        if len(self._waiters) >= self.queue + self.refilling:
            raise self._refuse(
                f"every start slot is busy (HANGAR_MAX_CONCURRENT_STARTS={self.limit}) and "
                f"the start queue is full (HANGAR_START_QUEUE={self.queue} waiting); retry "
                "later", "start_queue_full", kind)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        self.waited += 1
        started = time.monotonic()
        gone = _LEAVE.get()
        watcher = asyncio.ensure_future(gone.wait()) if gone is not None else None
        try:
            waits: set[asyncio.Future[object]] = {fut}  # type: ignore[arg-type]
            if watcher is not None:
                waits.add(watcher)  # type: ignore[arg-type]
            await asyncio.wait(waits, timeout=self.max_wait_s,
                               return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            self._leave(fut)
            raise
        finally:
            if watcher is not None:
                watcher.cancel()
        waited = time.monotonic() - started
        if self._metrics is not None:
            self._metrics.start_wait_seconds.observe(waited)
        if fut.done():
            return  # our turn: the slot was handed over
        self._leave(fut)
        if gone is not None and gone.is_set():
            log.info("client left the start queue", extra={"kind": kind,
                                                           "duration_s": round(waited, 3)})
            raise LimitExceeded("the client disconnected while its start waited in the "
                                "queue", retry_after=QUEUE_RETRY_AFTER_S, limit="client_gone")
        raise self._refuse(
            f"this start waited its maximum in the start queue (HANGAR_START_QUEUE_WAIT_S="
            f"{self.max_wait_s:g} s) for a start slot (HANGAR_MAX_CONCURRENT_STARTS="
            f"{self.limit}); retry later",
            "start_queue_wait", kind)

    def _leave(self, fut: asyncio.Future[None]) -> None:
        """Take ``fut`` out of the queue; a slot handed to it meanwhile passes on."""
        if fut.done() and not fut.cancelled():
            self.release()
            return
        fut.cancel()
        try:
            self._waiters.remove(fut)
        except ValueError:
            pass

    def _refuse(self, message: str, limit: str, kind: str) -> LimitExceeded:
        self.refused += 1
        if self._metrics is not None:
            self._metrics.start_refusals.labels(limit).inc()
            if kind in ("create", "fork"):
                self._metrics.creates.labels("limited").inc()
        return LimitExceeded(message, retry_after=QUEUE_RETRY_AFTER_S, limit=limit,
                             max_concurrent_starts=self.limit, start_queue=self.queue,
                             queued=len(self._waiters))
