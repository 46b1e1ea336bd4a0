"""What every part of the orchestrator shares: settings, store, engine, registry, bus.

One ``Context`` per server, made by ``SandboxManager``; the parts
(admission, launch, removal, creation, snapshots, sleep, guest calls,
reconcile, recovery, pool) each take it and talk to one another only
through their public methods.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from hangar.config import Settings
from hangar.core.events import EventBus
from hangar.core.hooks import Hooks
from hangar.core.lifecycle import State
from hangar.core.registry import Registry
from hangar.core.store import SandboxRecord, Store
from hangar.engines.base import Engine
from hangar.errors import Gone, NotFound
from hangar.layout import Layout
from hangar.metrics import Metrics


@dataclass
class Context:
    """The services one server's orchestrator shares."""

    settings: Settings
    layout: Layout
    store: Store
    engine: Engine
    metrics: Metrics
    events: EventBus
    registry: Registry
    hooks: Hooks = field(default_factory=Hooks)
    """A cluster node's hooks (``hangar.core.hooks``); no-ops on a single host."""

    def state(self, sandbox_id: str) -> State:
        """The state of a sandbox a user may see, read without its whole record
        (``Store.state_of``). Raises as ``record``."""
        state = self.store.state_of(sandbox_id)
        if state is None or state in (State.POOLED, State.DELETED, State.EXPIRED):
            return self.record(sandbox_id).state  # raises, with the record's own message
        return state

    def record(self, sandbox_id: str) -> SandboxRecord:
        """The record of a sandbox a user may see.

        Raises NotFound (unknown, deleted, or a warm-pool VM) or Gone (expired).
        """
        rec = self.store.get(sandbox_id)
        if rec is None or rec.state == State.POOLED:
            raise NotFound(f"no sandbox {sandbox_id}", sandbox_id=sandbox_id)
        if rec.state == State.DELETED:
            raise NotFound(f"sandbox {sandbox_id} was deleted", sandbox_id=sandbox_id)
        if rec.state == State.EXPIRED:
            raise Gone(f"sandbox {sandbox_id} expired at "
                       f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(rec.expires_at or 0))}",
                       sandbox_id=sandbox_id)
        return rec

    def publish(self, kind: str, sandbox_id: str | None = None, **data: Any) -> None:
        """Publish a live event (``hangar.core.events``); never raises."""
        try:
            self.events.publish(kind, sandbox_id, **data)
        except Exception:  # events are best effort
            pass
