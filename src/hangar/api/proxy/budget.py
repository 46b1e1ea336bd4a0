"""How many bytes of guest WebSocket messages the server holds on clients' behalf.

The port proxy (``hangar.api.proxy.websocket``) takes a guest's message frame by frame
and gives it to the client whole (ASGI has no fragments); the ASGI server then keeps a
message its client has not read in the connection's write buffer while the proxy
assembles the next. Without a bound in bytes, one guest that sends 16 MiB messages to
256 clients that never read (a tenant's own, on its own public port) makes the server
hold about 8 GiB. So every byte of a message, from its first frame until the message
after it has been handed on (by then the server's write buffer has drained below its
mark), is counted against its sandbox (``per_sandbox``) and the server
(``total``). A frame that does not fit waits up to ``wait_s`` for bytes to be given
back (the guest's leg is not read meanwhile: the guest is slowed, not its data lost);
then its connection is closed with 1013 (try again later).

The figures are the settings ``port_websocket_buffer_mib`` (per sandbox, 64) and
``port_websocket_buffer_total_mib`` (server, 512). The largest message is 16 MiB
(``WS_MAX_MESSAGE``), so one connection holds at most 32 MiB.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

WAIT_S = 10.0
"""Longest a frame waits for room, seconds, before its connection is closed with 1013."""


class MessageBudget:
    """Bytes held per sandbox and in all (``take``/``give``). Lives on the event loop's
    thread: every call is from the loop."""

    def __init__(self, per_sandbox: int, total: int, wait_s: float = WAIT_S) -> None:
        self.per_sandbox = per_sandbox
        self.total = total
        self.wait_s = wait_s
        self.held: dict[str, int] = {}
        self.held_total = 0
        self._freed = asyncio.Event()

    def _fits(self, sandbox_id: str, n: int) -> bool:
        return self.held.get(sandbox_id, 0) + n <= self.per_sandbox \
            and self.held_total + n <= self.total

    async def take(self, sandbox_id: str, n: int) -> bool:
        """Count ``n`` bytes against ``sandbox_id``, waiting up to ``wait_s`` for room;
        False when there was none (nothing counted)."""
        deadline = time.monotonic() + self.wait_s
        while not self._fits(sandbox_id, n):
            left = deadline - time.monotonic()
            if left <= 0 or n > min(self.per_sandbox, self.total):
                return False
            self._freed.clear()
            try:
                await asyncio.wait_for(self._freed.wait(), left)
            except asyncio.TimeoutError:
                return False
        self.held[sandbox_id] = self.held.get(sandbox_id, 0) + n
        self.held_total += n
        return True

    def give(self, sandbox_id: str, n: int) -> None:
        """Give back ``n`` bytes ``take`` counted for ``sandbox_id``."""
        if n <= 0:
            return
        left = self.held.get(sandbox_id, 0) - n
        if left > 0:
            self.held[sandbox_id] = left
        else:
            self.held.pop(sandbox_id, None)
        self.held_total = max(0, self.held_total - n)
        self._freed.set()


def budget_of(state: Any, settings: Any) -> MessageBudget:
    """The server's budget (one per app, on ``app.state``), made from ``settings`` on first
    use."""
    budget: MessageBudget | None = getattr(state, "ws_budget", None)
    if budget is None:
        budget = MessageBudget(
            getattr(settings, "port_websocket_buffer_mib", 64) << 20,
            getattr(settings, "port_websocket_buffer_total_mib", 512) << 20)
        state.ws_budget = budget
    return budget
