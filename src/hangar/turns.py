"""Work on the event loop in bounded pieces: ``Turns``, ``mapped`` and ``extend``.

The event loop serves every tenant's calls at once, so work whose size a guest or a tenant
sets (a folder's listing of 10,000 entries, a watcher's events, a process table) must not
hold it in one turn: review 29k K-H3 found a ListDir answer built and encoded in 1-2 s of a
single turn. Such work is done here in slices, with a turn of the loop
(``await asyncio.sleep(0)``) between two of them:

* ``Turns`` counts units of work done (items converted, bytes encoded) and gives the loop a
  turn each time ``every`` of them were counted;
* ``mapped`` converts a sequence of items ``every`` at a time, ``extend`` appends items to a
  list or a protobuf repeated field ``every`` at a time.

A slice is one call per item, so its time is ``every`` items' worth: choose ``every`` so
that a slice of the heaviest item takes a few milliseconds. A worker thread
(``asyncio.to_thread``) is no substitute for Python code that holds the GIL: a single C call
(``json.dumps``, ``bytes.split``) runs to its end before the loop's thread gets the GIL back.

Errors: whatever the conversion raises, raised as is (the items converted so far are lost).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")

__all__ = ["EVERY", "Turns", "extend", "mapped"]

EVERY = 256
"""Items converted between two turns by default: 256 of those converted this way (a ListDir
``EntryInfo`` with two metadata pairs, about 15 us each on this 2-core machine; a listing's
``FileEntry``, 8-20 us) take 2-6 ms of one turn."""


class Turns:
    """A count of work done on the loop since its last turn; ``tick`` gives it a turn once
    ``every`` units (items, bytes: the caller's choice) have been counted."""

    def __init__(self, every: int = EVERY) -> None:
        if every < 1:
            raise ValueError("every must be at least 1")
        self.every = every
        self.done = 0
        """Units counted since the last turn."""

    async def tick(self, units: int = 1) -> bool:
        """Count ``units`` of work just done; at ``every`` or more since the last turn, gives
        the loop one and returns True (else returns False at once)."""
        self.done += units
        if self.done < self.every:
            return False
        self.done = 0
        await asyncio.sleep(0)
        return True


async def mapped(fn: Callable[[T], R], items: Sequence[T], every: int = EVERY) -> list[R]:
    """``[fn(x) for x in items]``, ``every`` items between two turns of the loop."""
    out: list[R] = []
    for at in range(0, len(items), every):
        if at:
            await asyncio.sleep(0)
        out.extend(map(fn, items[at:at + every]))
    return out


async def extend(target: Any, items: Sequence[Any], every: int = EVERY) -> None:
    """``target.extend(items)`` (a list, a protobuf repeated field: each message is copied),
    ``every`` items between two turns of the loop."""
    for at in range(0, len(items), every):
        if at:
            await asyncio.sleep(0)
        target.extend(items[at:at + every])
