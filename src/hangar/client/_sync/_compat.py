"""What differs between the blocking and asyncio clients besides async/await.

The same names as ``_async/_compat.py``, for threads; written by hand.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

sleep = time.sleep


class Stop:
    """A flag that a background loop waits on between its rounds."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def set(self) -> None:
        self._event.set()

    def clear(self) -> None:
        self._event.clear()

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds; True when the flag was set."""
        return self._event.wait(timeout)


class Background:
    """Runs ``target`` in a daemon thread."""

    def __init__(self, target: Callable[[], None], name: str) -> None:
        self._thread = threading.Thread(target=target, name=name, daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def join(self) -> None:
        self._thread.join()


def ws_connect(url: str, open_timeout: float) -> Any:
    """Open a WebSocket (``websockets``' threading client); its errors pass through."""
    from websockets.sync.client import connect

    return connect(url, open_timeout=open_timeout, max_size=1 << 22, user_agent_header=None,
                   legacy=True)  # a connection object, not a context to enter


def ws_recv(ws: Any, timeout: float | None) -> str | bytes:
    """The next message; TimeoutError after ``timeout`` seconds (None: wait for ever)."""
    msg: str | bytes = ws.recv(timeout=timeout)
    return msg


def run_blocking(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, here in the caller's thread (the asyncio twin uses a worker)."""
    return fn(*args)


def file_chunks(path: Path, size: int = 1 << 20) -> Iterator[bytes]:
    """The bytes of the file at ``path``, ``size`` at a time."""
    with open(path, "rb") as f:
        while chunk := f.read(size):
            yield chunk
