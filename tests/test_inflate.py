"""``hangar.api.inflate.inflate_whole``: a small gzip body that inflates far (4 KiB to
3 MiB) is inflated again off the event loop past ``ONLOOP_OUT`` (review 29d D-M2) and
still gives every byte; the caps hold on both paths."""

from __future__ import annotations

import asyncio
import gzip
import threading

import pytest

from hangar.api import inflate
from hangar.errors import TooLarge


def _run(data: bytes, limit: int) -> tuple[bytes, set[str]]:
    """The inflated bytes and the names of the threads that inflated."""
    threads: set[str] = set()
    whole = inflate._whole

    def spy(*args: object) -> bytes:
        threads.add(threading.current_thread().name)
        return whole(*args)  # type: ignore[arg-type]

    inflate._whole = spy  # type: ignore[assignment]
    try:
        return asyncio.run(inflate.inflate_whole(data, limit)), threads
    finally:
        inflate._whole = whole  # type: ignore[assignment]


def test_small_output_stays_on_the_loop_large_goes_off() -> None:
    small = gzip.compress(b"a" * 1000)
    out, threads = _run(small, 1 << 20)
    assert out == b"a" * 1000 and threads == {"MainThread"}
    bomb = gzip.compress(b"\0" * (3 << 20))
    assert len(bomb) <= inflate.OFFLOOP_BYTES
    out, threads = _run(bomb, 16 << 20)
    assert out == b"\0" * (3 << 20)
    assert len(threads) == 2 and "MainThread" in threads  # tried on the loop, then a worker


def test_the_limit_holds_on_both_paths() -> None:
    with pytest.raises(TooLarge):
        _run(gzip.compress(b"b" * 5000), 4000)  # under ONLOOP_OUT: refused on the loop
    with pytest.raises(TooLarge):
        _run(gzip.compress(b"\0" * (3 << 20)), 1 << 20)  # refused by the worker
