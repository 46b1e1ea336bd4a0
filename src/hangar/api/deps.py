"""Shared FastAPI dependencies.

Dependencies are ``async def`` when they do not block: FastAPI runs a plain
``def`` in a worker thread, a hand-off each way on every request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Request

from hangar.core.service import PLACEMENT_SCOPE, Placement, SandboxManager, leave_when

IDLE_RECEIVE_S = 0.1
"""Pause after a message other than a disconnect while watching for one, seconds (a
server that answers ``receive`` at once must not make the watch spin)."""


async def manager(request: Request) -> SandboxManager:
    return request.app.state.manager


async def placement(request: Request) -> Placement | None:
    """The id a cluster's gateway claimed for this request's create, or None (one host)."""
    return request.scope.get(PLACEMENT_SCOPE)


@asynccontextmanager
async def queued_until_gone(request: Request) -> AsyncIterator[None]:
    """While the block runs (a create or fork: its body already read), watch for the
    client's disconnect; a start of the block waiting in the start queue then leaves it
    (``hangar.core.starts``), so a client that gave up starts no VM."""
    gone = asyncio.Event()

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                gone.set()
                return
            await asyncio.sleep(IDLE_RECEIVE_S)

    watcher = asyncio.create_task(watch())
    try:
        with leave_when(gone):
            yield
    finally:
        watcher.cancel()
