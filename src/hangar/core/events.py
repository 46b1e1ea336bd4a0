"""Live events: what happens on the server, as it happens.

``EventBus.publish`` records one event in a bounded ring buffer and hands
it to every subscriber; ``GET /events`` (Server-Sent Events) serves them.
Each event has an ``id`` (increasing within one server process), a
``time`` (Unix seconds), a ``kind`` and a flat ``data`` dict.

Kinds (``data`` fields in brackets)::

    sandbox.created   [image, source: template|pool|cold|fork, duration_s]
    sandbox.deleted   sandbox.expired   sandbox.crashed [error]
    sandbox.unresponsive [error]    sandbox.responsive
    exec.started      [exec_id, command only when the caller opted in]
    exec.finished     [exec_id, exit_code, duration_s, timed_out]
    machine.sleeping  machine.asleep  machine.waking  machine.awake   [user_id]
    pool.take         pool.refill [source]
    template.snapshot [image, key, duration_s]   (an image's template snapshot was made)
    snapshot.created  [snapshot_id, size_bytes]
    snapshot.restored [snapshot_id, generation]
    snapshot.forked   [snapshot_id, generation]   (the guest's new fork generation)
    port.exposed      [port, public]   port.closed [port]
    volume.created    [volume_id, size_mib]   volume.deleted [volume_id]
    egress.denied     [port, reason, via: dns|proxy, domain and/or address, repeats]
                      (coalesced: hangar.net.egress)
    agent.task.started  agent.tool.started  agent.tool.finished  agent.task.ended

Rules: an event never carries command output, environment variables, file
contents or secrets. ``publish`` never blocks and never raises: a slow
subscriber loses its oldest undelivered events (and is told how many), it
never holds the publisher up.

On the wire an event's id is ``<stream>:<n>`` (``wire_id``): a client
that reconnects with the id of another stream (the server restarted) gets
the whole ring, one with an id of this stream what came after it.
``close()`` ends every subscription (the server is shutting down, so its
open event streams must not hold the shutdown up).
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from hangar.core.acting import acting

RING_SIZE = 4096
"""Events kept for clients that reconnect with ``Last-Event-ID``."""
SUBSCRIBER_QUEUE = 1024
"""Undelivered events a subscriber may hold before its oldest are dropped."""


@dataclass(frozen=True)
class Event:
    """One event. ``time`` is Unix seconds."""

    id: int
    time: float
    kind: str
    sandbox_id: str | None = None
    data: dict[str, Any] = field(default_factory=dict)
    team: str | None = None
    """The team it concerns (``EventBus.publish``), or None: the operator's alone."""

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "time": self.time, "kind": self.kind,
                "sandbox_id": self.sandbox_id, **self.data}


@dataclass
class _Subscriber:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Event | None]
    kinds: tuple[str, ...]
    sandbox_id: str | None
    team: str | None = None
    dropped: int = 0

    def wants(self, ev: Event) -> bool:
        if self.team is not None and ev.team != self.team:
            return False
        if self.sandbox_id is not None and ev.sandbox_id != self.sandbox_id:
            return False
        return not self.kinds or any(ev.kind == k or ev.kind.startswith(k + ".")
                                     for k in self.kinds)

    def offer(self, ev: Event) -> None:
        """Called in the subscriber's loop."""
        if self.queue.full():
            self.queue.get_nowait()
            self.dropped += 1
        self.queue.put_nowait(ev)

    def end(self) -> None:
        """Called in the subscriber's loop: wake it to finish."""
        if self.queue.full():
            self.queue.get_nowait()
        self.queue.put_nowait(None)


class EventBus:
    """A bounded, in-memory fan-out of events. Safe to publish from any thread."""

    def __init__(self, ring_size: int = RING_SIZE) -> None:
        self.closed = False
        self.stream = secrets.token_hex(4)
        """Names this process's sequence of ids; a client holding an id of
        another stream (the server restarted) gets the whole ring."""
        self._ring: deque[Event] = deque(maxlen=ring_size)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._subs: list[_Subscriber] = []
        self.owner: Callable[[str], str | None] = lambda sandbox_id: None
        """The team of a sandbox (set by the manager: ``hangar.core.teams``)."""

    def publish(self, kind: str, sandbox_id: str | None = None, *, team: str | None = None,
                **data: Any) -> Event:
        """Record an event and hand it to the subscribers that want it.

        It concerns ``team``, else the acting team (``hangar.core.teams``), else the team
        of ``sandbox_id``'s sandbox; a team's subscribers see only the events of their
        team, the operator's see every one."""
        if team is None:
            team = acting()
        if team is None and sandbox_id is not None:
            try:
                team = self.owner(sandbox_id)
            except Exception:  # events are best effort; the operator still sees it
                team = None
        with self._lock:
            ev = Event(next(self._ids), round(time.time(), 3), kind, sandbox_id, data, team)
            self._ring.append(ev)
            subs = [] if self.closed else list(self._subs)
        for sub in subs:
            if sub.wants(ev):
                try:
                    sub.loop.call_soon_threadsafe(sub.offer, ev)
                except RuntimeError:  # that loop has closed
                    pass
        return ev

    def since(self, last_id: int | None) -> list[Event]:
        """Events in the ring with an id above ``last_id`` (all when None)."""
        with self._lock:
            return [e for e in self._ring if last_id is None or e.id > last_id]

    def wire_id(self, ev: Event) -> str:
        """The id a client sees and sends back as ``Last-Event-ID``: ``<stream>:<n>``."""
        return f"{self.stream}:{ev.id}"

    def resume_after(self, wire_id: str | None) -> int | None:
        """The ``last_id`` to subscribe with for a client's ``Last-Event-ID``.

        None (no id: live events only); the id's number when it is of this
        stream; 0 (the whole ring) when it is of another stream or garbled.
        """
        if not wire_id:
            return None
        stream, _, n = wire_id.strip().rpartition(":")
        if stream == self.stream and n.isascii() and n.isdigit():
            return int(n)
        return 0

    def close(self) -> None:
        """End every subscription; later events are still recorded. Safe from any thread."""
        with self._lock:
            self.closed = True
            subs = list(self._subs)
        for sub in subs:
            try:
                sub.loop.call_soon_threadsafe(sub.end)
            except RuntimeError:
                pass

    @property
    def last_id(self) -> int:
        with self._lock:
            return self._ring[-1].id if self._ring else 0

    async def subscribe(self, last_id: int | None = None, kinds: Iterable[str] = (),
                        sandbox_id: str | None = None, idle: float | None = None,
                        team: str | None = None) -> AsyncIterator[Event | None]:
        """Yield missed events after ``last_id`` from the ring, then live ones.

        ``kinds`` filters by kind or prefix (``exec`` matches ``exec.finished``);
        ``sandbox_id`` by sandbox; ``team`` (a team's subscriber) to that team's events
        (None: every event, the operator's view). With ``idle`` (seconds), yields None
        whenever that long passed without an event (time for a keep-alive).
        Runs until the caller stops iterating or the bus is closed.
        """
        sub = _Subscriber(asyncio.get_running_loop(), asyncio.Queue(SUBSCRIBER_QUEUE),
                          tuple(kinds), sandbox_id, team)
        with self._lock:
            if self.closed:
                return
            backlog = [e for e in self._ring
                       if (last_id is not None and e.id > last_id) and sub.wants(e)]
            self._subs.append(sub)
        try:
            seen = last_id or 0
            for ev in backlog:
                seen = ev.id
                yield ev
            while True:
                try:
                    got = await asyncio.wait_for(sub.queue.get(), idle)
                except TimeoutError:
                    yield None
                    continue
                if got is None:  # the bus was closed
                    return
                ev = got
                if ev.id <= seen:
                    continue
                seen = ev.id
                yield ev
        finally:
            with self._lock:
                self._subs.remove(sub)
