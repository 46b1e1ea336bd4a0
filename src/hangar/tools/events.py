"""Where a task's events go: pluggable sinks.

A task publishes, in this order (each event's ``sandbox_id`` is the task's VM)::

    agent.task.starting  {task_id, name, tier}         (vm and browser tiers: before the
                                                        VM is asked for; no sandbox_id yet)
    agent.task.started   {task_id, name, tier, vcpus, memory_mib, source}
    agent.tool.started   {task_id, tool, summary}
    agent.tool.finished  {task_id, tool, duration_s, ok}      (one pair per call)
    agent.task.ended     {task_id, reason, usage}

``source`` is ``template``, ``pool``, ``cold`` or ``none`` (in-process: no VM);
``reason`` is ``done``, ``error``, ``cancelled`` or ``limit:<name>``;
``usage`` is ``Usage.as_dict()``. ``summary`` is a one-line description of
the call for a person watching (the command, the path, the pattern, the URL
without its query), at most 200 characters; events never carry output, file
contents or environment variables.

Sinks:

* ``ServerSink`` (the default): ``POST /events`` on the task's Hangar server
  with ``{"kind", "sandbox_id", "data"}``, sent in order by one background
  sender so tool calls never wait for it. A server without that route (404
  or 405) disables the sink with one warning; other failures are logged and
  dropped: events never fail a task.
* ``ListSink``: keeps events in a list (tests, embedding).
* ``CallbackSink``: calls a function for each event.
* ``NullSink``: drops them.
"""

from __future__ import annotations

import asyncio
import logging
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from hangar.errors import HangarError, NotFound
from hangar.tools.backend import Backend

log = logging.getLogger("hangar.tools.events")


@dataclass(frozen=True)
class ToolEvent:
    """One event as a sink receives it. ``time`` is Unix seconds."""

    kind: str
    sandbox_id: str | None
    data: dict[str, Any]
    time: float = field(default_factory=time.time)


class EventSink(Protocol):
    """Receives a task's events. ``emit`` must not block or raise."""

    def emit(self, event: ToolEvent) -> None: ...

    async def aclose(self) -> None:
        """Deliver what is pending (bounded), then stop."""
        ...


class NullSink:
    def emit(self, event: ToolEvent) -> None:
        pass

    async def aclose(self) -> None:
        pass


class ListSink:
    """Keeps every event in ``events``."""

    def __init__(self) -> None:
        self.events: list[ToolEvent] = []

    def emit(self, event: ToolEvent) -> None:
        self.events.append(event)

    async def aclose(self) -> None:
        pass

    def kinds(self) -> list[str]:
        return [e.kind for e in self.events]


class CallbackSink:
    """Calls ``fn(event)`` for each event; exceptions are logged, never raised."""

    def __init__(self, fn: Callable[[ToolEvent], None]) -> None:
        self.fn = fn

    def emit(self, event: ToolEvent) -> None:
        try:
            self.fn(event)
        except Exception:
            log.exception("event callback failed")

    async def aclose(self) -> None:
        pass


class ServerSink:
    """Posts events to the Hangar server (``POST /events``), in order, in the background."""

    FLUSH_TIMEOUT_S = 5.0
    """Seconds ``aclose`` waits for pending events before dropping them."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.enabled = True
        self._queue: asyncio.Queue[ToolEvent | None] | None = None
        self._sender: asyncio.Task[None] | None = None

    def emit(self, event: ToolEvent) -> None:
        if not self.enabled:
            return
        if self._queue is None:
            self._queue = asyncio.Queue()
            self._sender = asyncio.get_running_loop().create_task(self._send_all())
        self._queue.put_nowait(event)

    async def _send_all(self) -> None:
        assert self._queue is not None
        while True:
            ev = await self._queue.get()
            if ev is None:
                return
            if not self.enabled:
                continue
            try:
                await self.backend.post_event(ev.kind, ev.sandbox_id, ev.data)
            except (NotFound, HangarError) as exc:
                if isinstance(exc, NotFound) or getattr(exc, "status", None) == 405:
                    self.enabled = False
                    warnings.warn("this Hangar server has no POST /events: agent events are "
                                  "not published", RuntimeWarning, stacklevel=1)
                else:
                    log.warning("event not delivered", extra={"kind": ev.kind,
                                                              "error": exc.message})
            except Exception as exc:  # events never fail a task
                log.warning("event not delivered", extra={"kind": ev.kind, "error": repr(exc)})

    async def aclose(self) -> None:
        if self._queue is None or self._sender is None:
            return
        self._queue.put_nowait(None)
        try:
            await asyncio.wait_for(asyncio.shield(self._sender), self.FLUSH_TIMEOUT_S)
        except (asyncio.TimeoutError, Exception):
            self._sender.cancel()
        self._queue = None
        self._sender = None
