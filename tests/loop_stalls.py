"""How long the event loop stands still while some work runs: a 5 ms ticker's longest
gap, and the same ticker's longest gap just before the work, on this machine as loaded as
it is now (a shared 2-core machine delays single turns by itself). A test asserts the work's
worst gap against ``allowed``: ``floor`` seconds, or ``LOAD_FACTOR`` times the machine's own
worst, whichever is larger. Where the work held the loop only a tenth of a second or so at
once before its fix, a wall-clock gap cannot tell the two apart on a loaded machine (a turn
of 10 ms CPU may wait 100 ms for a core): such a test checks ``cpu`` instead, the loop
thread's own CPU time between two turns less its garbage collections (``check_cpu``): a
full collection walks the whole test process, 0.1 s or so whenever one falls due, which is
no part of the work measured. Against a real server, ``HealthWatch`` times its ``/health``
from a thread while the work runs."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar

import httpx

T = TypeVar("T")

TICK_S = 0.005
BASELINE_S = 0.5
"""Seconds the ticker runs alone before the work, to measure the machine."""
LOAD_FACTOR = 4.0


@dataclass
class Stalls:
    worst: float
    """The ticker's longest gap while the work ran, seconds (inf: it never had a turn)."""
    baseline: float
    """Its longest gap just before, alone."""
    cpu: float = 0.0
    """The most CPU time the loop's thread spent between two of the ticker's turns while the
    work ran, less its garbage collections, seconds: what one turn of the work cost,
    whatever the machine's load."""

    def allowed(self, floor: float) -> float:
        return max(floor, LOAD_FACTOR * self.baseline)

    def check(self, floor: float) -> None:
        assert self.worst < self.allowed(floor), (
            f"the event loop stood still {self.worst:.3f} s (allowed {self.allowed(floor):.3f}"
            f" s; this machine alone: {self.baseline:.3f} s)")

    def check_cpu(self, limit: float) -> None:
        assert self.cpu < limit, (
            f"the event loop ran {self.cpu:.3f} s of CPU in one turn (allowed {limit:.3f} s;"
            f" its longest gap {self.worst:.3f} s)")


class _Collections:
    """CPU time the current thread spent in garbage collections while in use."""

    def __init__(self) -> None:
        self.spent = 0.0
        self._thread = threading.get_ident()
        self._started = 0.0

    def _seen(self, phase: str, info: dict[str, int]) -> None:
        if threading.get_ident() != self._thread:
            return
        if phase == "start":
            self._started = time.thread_time()
        else:
            self.spent += time.thread_time() - self._started

    def __enter__(self) -> _Collections:
        gc.callbacks.append(self._seen)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._seen)


async def _gaps(stop: asyncio.Event, cpu: list[float] | None = None) -> list[float]:
    """The ticker's gaps until ``stop``; the loop thread's CPU time in each, less its
    garbage collections, added to ``cpu``."""
    loop = asyncio.get_running_loop()
    gaps: list[float] = []
    with _Collections() as collections:
        last, last_cpu = loop.time(), time.thread_time() - collections.spent
        while not stop.is_set():
            await asyncio.sleep(TICK_S)
            gaps.append(loop.time() - last)
            if cpu is not None:
                cpu.append(time.thread_time() - collections.spent - last_cpu)
            last, last_cpu = loop.time(), time.thread_time() - collections.spent
    return gaps


async def measured(work: Awaitable[T]) -> tuple[T, Stalls]:
    """Run ``work`` with the ticker beside it; returns its result and the ``Stalls``."""
    alone = asyncio.Event()
    ticker = asyncio.create_task(_gaps(alone))
    await asyncio.sleep(BASELINE_S)
    alone.set()
    baseline = max(await ticker, default=TICK_S)
    stop = asyncio.Event()
    cpu: list[float] = []
    ticker = asyncio.create_task(_gaps(stop, cpu))
    try:
        result = await work
    finally:
        stop.set()
        gaps = await ticker
    return result, Stalls(max(gaps, default=float("inf")), baseline,
                          max(cpu, default=float("inf")))


class HealthWatch:
    """``/health``'s answer times, sampled every 20 ms in a thread while in use; ``idle``:
    the slowest of 20 taken just before, this machine's own figure under its load now."""

    def __init__(self, url: str) -> None:
        self.url, self.idle = url, 0.0
        self.times: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as h:
            while not self._stop.is_set():
                t = time.monotonic()
                h.get("/health")
                self.times.append(time.monotonic() - t)
                self._stop.wait(0.02)

    def __enter__(self) -> HealthWatch:
        with httpx.Client(base_url=self.url, timeout=30) as h:
            idle = []
            for _ in range(20):
                t = time.monotonic()
                h.get("/health")
                idle.append(time.monotonic() - t)
        self.idle = max(idle)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def worst(self) -> float:
        return max(self.times, default=0.0)
