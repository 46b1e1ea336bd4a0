"""The framed, versioned host↔guest protocol (standard library only).

One byte stream (a virtio-serial port under QEMU, a vsock connection under
Firecracker) carries many requests at once. Each frame is::

    offset size  field
    0      2     magic  b"HG"
    2      1     protocol version (``VERSION``)
    3      1     kind   (``Kind``)
    4      4     channel id, big-endian u32: the request this frame belongs to
    8      4     meta length in bytes (u32), at most ``MAX_META``
    12     4     data length in bytes (u32), at most ``MAX_DATA``
    16     ...   meta: a UTF-8 JSON object; then data: raw bytes

The host opens a channel with a REQUEST frame (``meta["op"]`` names the
operation) and picks its id; both sides may then send DATA and EOF frames on
it (``meta["stream"]`` names the stream: ``stdin``, ``stdout``, ``stderr``,
``file``); the guest ends it with one RESPONSE or ERROR frame. The host may
send SIGNAL on an open channel. Channel 0 carries the agent's unsolicited
HELLO, sent when it opens the port, so the host never writes before the
guest is listening (virtio-serial drops bytes sent to a port nobody opened).

A reader that meets bytes that are not a frame header skips forward to the
next magic; a frame with another version is answered with an ERROR of code
``unsupported_version``, so an old guest is detected, not misread.
"""

from __future__ import annotations

import enum
import json
import struct
from typing import Any

MAGIC = b"HG"
VERSION = 1
HEADER = struct.Struct("!2sBBIII")
MAX_META = 1 << 20
MAX_DATA = 1 << 22
CHUNK = 1 << 16  # bytes of stream data per DATA frame


class Kind(enum.IntEnum):
    HELLO = 1
    REQUEST = 2
    DATA = 3
    EOF = 4
    RESPONSE = 5
    ERROR = 6
    SIGNAL = 7


class ProtocolError(Exception):
    """A frame could not be parsed."""


def encode(kind: Kind, channel: int, meta: dict[str, Any] | None = None, data: bytes = b"") -> bytes:
    """Serialise one frame; ``meta`` must be JSON-serialisable."""
    m = json.dumps(meta or {}, separators=(",", ":")).encode()
    if len(m) > MAX_META or len(data) > MAX_DATA:
        raise ProtocolError("frame too large")
    return HEADER.pack(MAGIC, VERSION, int(kind), channel, len(m), len(data)) + m + data


class Frame:
    """One decoded frame."""

    __slots__ = ("kind", "channel", "meta", "data", "version")

    def __init__(self, kind: int, channel: int, meta: dict[str, Any], data: bytes, version: int):
        self.kind = kind
        self.channel = channel
        self.meta = meta
        self.data = data
        self.version = version

    def __repr__(self) -> str:
        return f"Frame(kind={self.kind}, channel={self.channel}, meta={self.meta}, data={len(self.data)}B)"


class Decoder:
    """Incremental decoder: ``feed`` bytes, iterate complete frames."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self.skipped = 0  # bytes dropped while resynchronising

    def feed(self, data: bytes) -> list[Frame]:
        self._buf += data
        frames: list[Frame] = []
        while True:
            if len(self._buf) < HEADER.size:
                return frames
            if self._buf[:2] != MAGIC:
                i = self._buf.find(MAGIC, 1)
                drop = i if i > 0 else len(self._buf) - 1
                del self._buf[:drop]
                self.skipped += drop
                continue
            magic, version, kind, channel, mlen, dlen = HEADER.unpack_from(self._buf)
            if mlen > MAX_META or dlen > MAX_DATA:
                del self._buf[:2]
                self.skipped += 2
                continue
            end = HEADER.size + mlen + dlen
            if len(self._buf) < end:
                return frames
            raw_meta = bytes(self._buf[HEADER.size:HEADER.size + mlen])
            data = bytes(self._buf[HEADER.size + mlen:end])
            del self._buf[:end]
            try:
                meta = json.loads(raw_meta) if raw_meta else {}
            except ValueError:
                self.skipped += end
                continue
            frames.append(Frame(kind, channel, meta, data, version))
