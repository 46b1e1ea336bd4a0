"""What differs between the asyncio and blocking clients besides async/await.

``_sync/_compat.py`` has the same names for threads; both are written by
hand (the generator skips them).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

sleep = asyncio.sleep


class Stop:
    """A flag that a background loop waits on between its rounds."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def set(self) -> None:
        self._event.set()

    def clear(self) -> None:
        self._event.clear()

    def is_set(self) -> bool:
        return self._event.is_set()

    async def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds; True when the flag was set."""
        try:
            await asyncio.wait_for(self._event.wait(), timeout)
        except TimeoutError:
            return False
        return True


class Background:
    """Runs ``target`` as a task of the running event loop."""

    def __init__(self, target: Callable[[], Coroutine[Any, Any, None]], name: str) -> None:
        self._task = asyncio.get_running_loop().create_task(target(), name=name)

    def alive(self) -> bool:
        return not self._task.done()

    async def join(self) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


async def ws_connect(url: str, open_timeout: float) -> Any:
    """Open a WebSocket (``websockets``' asyncio client); its errors pass through."""
    from websockets.asyncio.client import connect

    return await connect(url, open_timeout=open_timeout, max_size=1 << 22,
                         user_agent_header=None)


async def ws_recv(ws: Any, timeout: float | None) -> str | bytes:
    """The next message; TimeoutError after ``timeout`` seconds (None: wait for ever)."""
    if timeout is None:
        msg: str | bytes = await ws.recv()
        return msg
    msg = await asyncio.wait_for(ws.recv(), timeout)
    return msg


async def run_blocking(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a worker thread, so the loop is not held (a build's archive)."""
    return await asyncio.to_thread(fn, *args)


async def file_chunks(path: Path, size: int = 1 << 20) -> AsyncIterator[bytes]:
    """The bytes of the file at ``path``, ``size`` at a time, each read in a thread."""
    with open(path, "rb") as f:
        while chunk := await asyncio.to_thread(f.read, size):
            yield chunk
