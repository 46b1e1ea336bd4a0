"""The port proxy's byte budget for guest WebSocket messages (``hangar.api.proxy.budget``),
on its own: counted per sandbox and in all, a take that does not fit waits for a give or
its time, nothing counted when it fails. The real relay is in test_ports
(``test_guest_websocket_messages_are_bounded_per_sandbox``)."""

from __future__ import annotations

import asyncio

from hangar.api.proxy.budget import MessageBudget


def test_per_sandbox_and_total_caps() -> None:
    async def run() -> None:
        b = MessageBudget(per_sandbox=10, total=15, wait_s=0.05)
        assert await b.take("a", 10)
        assert not await b.take("a", 1)  # a's own cap
        assert await b.take("b", 5)
        assert not await b.take("c", 1)  # the server's
        assert (b.held, b.held_total) == ({"a": 10, "b": 5}, 15)
        b.give("a", 10)
        assert await b.take("c", 1)
        assert not await b.take("d", 16)  # more than any room there can be: at once
        assert (b.held, b.held_total) == ({"b": 5, "c": 1}, 6)
    asyncio.run(run())


def test_a_take_waits_for_a_give() -> None:
    async def run() -> None:
        b = MessageBudget(per_sandbox=4, total=100, wait_s=5)
        assert await b.take("a", 4)
        waiter = asyncio.create_task(b.take("a", 3))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        b.give("a", 2)  # not enough yet
        await asyncio.sleep(0.05)
        assert not waiter.done()
        b.give("a", 2)
        assert await asyncio.wait_for(waiter, 1)
        assert b.held == {"a": 3}
    asyncio.run(run())
