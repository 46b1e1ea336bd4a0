"""How long the event loop stands still while some work runs: a 5 ms ticker's longest
gap, and the same ticker's longest gap just before the work, on this machine as loaded as
it is now (a shared 2-core machine delays single turns by itself). A test asserts the work's
worst gap against ``allowed``: ``floor`` seconds, or ``LOAD_FACTOR`` times the machine's own
worst, whichever is larger."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar

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

    def allowed(self, floor: float) -> float:
        return max(floor, LOAD_FACTOR * self.baseline)

    def check(self, floor: float) -> None:
        assert self.worst < self.allowed(floor), (
            f"the event loop stood still {self.worst:.3f} s (allowed {self.allowed(floor):.3f}"
            f" s; this machine alone: {self.baseline:.3f} s)")


async def _gaps(stop: asyncio.Event) -> list[float]:
    loop = asyncio.get_running_loop()
    gaps: list[float] = []
    last = loop.time()
    while not stop.is_set():
        await asyncio.sleep(TICK_S)
        gaps.append(loop.time() - last)
        last = loop.time()
    return gaps


async def measured(work: Awaitable[T]) -> tuple[T, Stalls]:
    """Run ``work`` with the ticker beside it; returns its result and the ``Stalls``."""
    alone = asyncio.Event()
    ticker = asyncio.create_task(_gaps(alone))
    await asyncio.sleep(BASELINE_S)
    alone.set()
    baseline = max(await ticker, default=TICK_S)
    stop = asyncio.Event()
    ticker = asyncio.create_task(_gaps(stop))
    try:
        result = await work
    finally:
        stop.set()
        gaps = await ticker
    return result, Stalls(max(gaps, default=float("inf")), baseline)
