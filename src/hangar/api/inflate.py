"""Bounded gzip inflation of client bodies: ``Inflater`` and ``inflate_whole``.

Every gzip body a client sends (envd's Connect messages and its REST uploads) is
inflated here, never with ``gzip.decompress``: a few KiB of gzip can inflate to
gigabytes (deflate reaches about 1030:1). ``Inflater`` inflates incrementally with
``zlib.decompressobj``, never more than ``CHUNK`` bytes at a time
(``max_length``), so a caller that hands each piece on before asking for the next
holds at most one piece, and it refuses past its caps with ``TooLarge`` (413) naming
them:

* ``limit``: the most bytes the whole body may inflate to (None: no total cap);
* ``ratio``: past ``ratio_floor`` inflated bytes, the output may be at most ``ratio``
  times the compressed bytes it came from so far (None: no ratio cap).

``inflate_whole`` inflates a body held whole (a Connect message) in a worker thread
once it is larger than ``OFFLOOP_BYTES``, so a large message never holds the event
loop. A body that is not gzip, or ends before its gzip stream does, is
``InvalidRequest`` (400).
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Iterator

from hangar.errors import InvalidRequest, TooLarge

CHUNK = 256 << 10
"""Most bytes one ``Inflater.feed`` step gives at a time."""
OFFLOOP_BYTES = 4 << 10
"""Compressed bodies larger than this (they may inflate to a thousand times as much) are
inflated in a worker thread (``inflate_whole``)."""
ONLOOP_OUT = 64 << 10
"""Most inflated bytes a small body may make on the event loop: past that (4 KiB of gzip
may inflate to 4 MiB: about 17 ms of loop time, review 29d D-M2) it is inflated again in a
worker thread."""

__all__ = ["CHUNK", "OFFLOOP_BYTES", "Inflater", "inflate_whole"]


class Inflater:
    """One gzip stream, inflated piece by piece under caps (see the module docstring).

    ``what`` names the body in errors ("the gzip body", "a gzip message").
    """

    def __init__(self, *, limit: int | None, ratio: int | None = None,
                 ratio_floor: int = 0, what: str = "the gzip body") -> None:
        self._z = zlib.decompressobj(wbits=31)
        self.limit, self.ratio, self.ratio_floor, self.what = limit, ratio, ratio_floor, what
        self.read = 0
        """Compressed bytes given so far."""
        self.used = 0
        """Compressed bytes inflated so far (the ratio's base)."""
        self.out = 0
        """Inflated bytes given so far."""

    def _check(self) -> None:
        if self.limit is not None and self.out > self.limit:
            raise TooLarge(f"{self.what} inflates to more than {self.limit} bytes, the limit",
                           limit_bytes=self.limit)
        if self.ratio is not None and self.out > max(self.ratio_floor, self.ratio * self.used):
            raise TooLarge(f"{self.what} inflates more than {self.ratio} times its "
                           f"compressed size past {self.ratio_floor} bytes, the limit "
                           f"(a compression bomb?); send it uncompressed",
                           limit_ratio=self.ratio, limit_bytes=self.ratio_floor)

    def feed(self, data: bytes) -> Iterator[bytes]:
        """The inflated bytes of ``data``, in pieces of at most ``CHUNK`` bytes.

        Raises TooLarge past a cap, InvalidRequest for bytes that are not gzip (or that
        follow the end of the gzip stream)."""
        self.read += len(data)
        pending = data
        while pending or not self._z.eof:
            if self._z.eof:
                raise InvalidRequest(f"{self.what} has bytes after its gzip stream")
            try:
                piece = self._z.decompress(pending, CHUNK)
            except zlib.error as exc:
                raise InvalidRequest(f"{self.what} is broken: {exc}") from None
            pending = self._z.unconsumed_tail
            self.used = self.read - len(pending)
            if self._z.eof and self._z.unused_data:
                raise InvalidRequest(f"{self.what} has bytes after its gzip stream")
            self.out += len(piece)
            self._check()
            if piece:
                yield piece
            if not pending and len(piece) < CHUNK:
                break  # all input taken and no output held back: wait for more input

    def close(self) -> None:
        """Raises InvalidRequest when the body ended before its gzip stream did."""
        if not self._z.eof:
            raise InvalidRequest(f"{self.what} ends before its gzip stream does")


def _whole(data: bytes | bytearray, limit: int, what: str) -> bytearray:
    inflater = Inflater(limit=limit, what=what)
    out = bytearray()
    for piece in inflater.feed(data):
        out += piece
    inflater.close()
    return out  # held once: a copy to bytes would hold it twice


async def inflate_whole(data: bytes | bytearray, limit: int,
                        what: str = "the gzip body") -> bytearray:
    """``data`` (one whole gzip stream) inflated, at most ``limit`` bytes (held once, as a
    bytearray); off the event loop when ``data`` is over ``OFFLOOP_BYTES`` or inflates
    past ``ONLOOP_OUT``. Raises TooLarge, InvalidRequest."""
    if len(data) <= OFFLOOP_BYTES:
        small = min(limit, ONLOOP_OUT)
        try:
            return _whole(data, small, what)
        except TooLarge:
            if small == limit:
                raise
    return await asyncio.to_thread(_whole, data, limit, what)
