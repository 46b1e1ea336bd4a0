"""The runtime registry: what the server holds in memory about each sandbox.

* ``Runtime``: a sandbox's VM handle, its agent connection (opened on first
  use), and how many guest calls are in flight (``busy``).
* Per-sandbox locks (``Registry.lock``) order lifecycle changes: snapshot,
  sleep, wake, restore, delete, expiry, crash handling and pool retirement
  all hold the sandbox's lock. An entry exists only while someone holds or
  waits for the lock, so entries go away with the sandbox.
* Creates in flight (``Registry.creating``): a delete that meets a sandbox
  still ``creating`` ends its VM and waits here for the create to give up.

A runtime is registered as soon as its VMM process exists (before the
agent answers), so a delete never misses a VM that is starting. The store
remains the truth: a runtime means "this process holds this VM", nothing more.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from hangar.engines.base import VM
from hangar.engines.agent_client import AgentClient


@dataclass
class Runtime:
    """In-memory state of one sandbox that has a VMM."""

    vm: VM
    agent: AgentClient | None = None
    connect_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    busy: int = 0
    """Guest calls in flight; a busy sandbox is neither snapshotted nor put to sleep."""
    generation: int | None = None
    """The guest's fork generation when this process restored it from a user snapshot."""
    touched_at: float = 0.0
    """When a guest call last recorded ``last_active_at`` (Unix seconds)."""
    template: Path | None = None
    """The template snapshot folder its VM was restored from at create
    (``hangar.core.templates``); None: booted, forked, woken or adopted."""


@dataclass
class _LockEntry:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0


class Registry:
    """Runtimes, per-sandbox locks and creates in flight, by sandbox id. One per server."""

    def __init__(self) -> None:
        self._runtimes: dict[str, Runtime] = {}
        self._locks: dict[str, _LockEntry] = {}
        self._creating: dict[str, asyncio.Event] = {}

    # -- runtimes --------------------------------------------------------------

    def get(self, sandbox_id: str) -> Runtime | None:
        return self._runtimes.get(sandbox_id)

    def put(self, sandbox_id: str, runtime: Runtime) -> None:
        self._runtimes[sandbox_id] = runtime

    async def drop(self, sandbox_id: str) -> Runtime | None:
        """Forget the sandbox's runtime and close its agent connection; returns it."""
        rt = self._runtimes.pop(sandbox_id, None)
        if rt is not None and rt.agent is not None:
            await rt.agent.close()
        return rt

    def ids(self) -> set[str]:
        """Ids of the sandboxes whose VM this process holds."""
        return set(self._runtimes)

    async def close(self) -> None:
        """Close every agent connection (the VMs keep running)."""
        for rt in list(self._runtimes.values()):
            if rt.agent is not None:
                await rt.agent.close()

    # -- per-sandbox locks -------------------------------------------------------

    @asynccontextmanager
    async def lock(self, sandbox_id: str) -> AsyncIterator[None]:
        """Hold the sandbox's lock (not reentrant)."""
        entry = self._locks.get(sandbox_id)
        if entry is None:
            entry = self._locks[sandbox_id] = _LockEntry()
        entry.users += 1
        try:
            async with entry.lock:
                yield
        finally:
            entry.users -= 1
            if entry.users == 0:
                del self._locks[sandbox_id]

    def locked(self, sandbox_id: str) -> bool:
        """True while someone holds or waits for the sandbox's lock."""
        return sandbox_id in self._locks

    def lock_count(self) -> int:
        """Lock entries in existence (one per sandbox with a lifecycle change under way)."""
        return len(self._locks)

    # -- creates in flight -----------------------------------------------------------

    @contextmanager
    def creating(self, sandbox_id: str) -> Iterator[None]:
        """Mark a create (or fork, or pool take) of ``sandbox_id`` as in flight."""
        done = self._creating[sandbox_id] = asyncio.Event()
        try:
            yield
        finally:
            done.set()
            self._creating.pop(sandbox_id, None)

    def create_in_flight(self, sandbox_id: str) -> bool:
        return sandbox_id in self._creating

    async def create_ended(self, sandbox_id: str, timeout: float) -> bool:
        """Wait until no create of ``sandbox_id`` is in flight; False on timeout."""
        done = self._creating.get(sandbox_id)
        if done is None:
            return True
        try:
            await asyncio.wait_for(done.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False
