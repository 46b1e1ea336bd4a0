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
``file``, ``socket``, ``pty``, ``watch``); the guest ends it with one RESPONSE
or ERROR frame. The host may send SIGNAL on an open channel (a signal for an
exec or a terminal; a terminal's resize or hang-up), and CANCEL when it
abandons one: the guest then stops the operation (an exec's process group
is killed, a file or socket closed, a terminal hung up, a watch stopped)
and the host ignores whatever still comes on that channel. Channel 0 carries the agent's
unsolicited HELLO, sent when it opens the port, so the host never writes
before the guest is listening (virtio-serial drops bytes sent to a port
nobody opened).

**Flow control** (version 2). Each channel has a window in each
direction, like HTTP/2's (RFC 9113 §5.2) or SSH's (RFC 4254 §5.2): a side
may have at most ``WINDOW`` bytes of DATA and EOF frames on a channel that
the other side has not yet acknowledged, counted as whole encoded frames
(header, meta and data: ``Frame.size``). The receiver acknowledges with a
WINDOW frame (``meta["bytes"]``: bytes it grants back) once its consumer
has taken at least ``GRANT_AT`` bytes off the channel. REQUEST, RESPONSE,
ERROR, SIGNAL, CANCEL, WINDOW and HELLO frames are not counted: each
channel has one REQUEST and one RESPONSE or ERROR, and the others are
small. So what one side must hold for a channel is bounded by ``WINDOW``
plus one final frame, a slow reader of one channel slows only that
channel's writer, and other channels on the same stream go on (no
head-of-line blocking). A receiver that gets more than it granted on a
channel treats it as a broken peer and drops the channel (``Inflow``).

**Bounds.** A meta is at most ``MAX_META`` bytes (1 MiB) and ``MAX_DEPTH``
(32) levels of nesting; a frame whose meta is larger, deeper, not JSON or not
an object is dropped whole (``Decoder.dropped``), and the stream goes on. A
frame on a channel the reader did not open (``Decoder``'s ``wanted``) is
skipped as its bytes arrive: never buffered whole, its meta never parsed.

A reader that meets bytes that are not a frame header skips forward to the
next magic; a frame with another version is answered with an ERROR of code
``unsupported_version``, so an old guest is detected, not misread.

Versions: 1, the first; 2 adds WINDOW and CANCEL and flow control (a
version-1 peer would not grant windows, so the two never talk).
"""

from __future__ import annotations

import asyncio
import enum
import json
import struct
from collections.abc import Callable, Iterator
from typing import Any

MAGIC = b"HG"
VERSION = 2
HEADER = struct.Struct("!2sBBIII")
MAX_META = 1 << 20
MAX_DEPTH = 32
"""Most levels of nesting in a meta (the protocol's own use at most 4)."""
MAX_DATA = 1 << 22
CHUNK = 1 << 16  # bytes of stream data per DATA frame
WINDOW = 1 << 20
"""Bytes of DATA and EOF frames (whole frames) a side may have unacknowledged per channel."""
GRANT_AT = WINDOW // 4
"""A receiver grants window back once its consumer has taken this many bytes."""
MAX_STREAM_FRAME = HEADER.size + 1024 + CHUNK
"""Largest DATA frame a sender makes (``CHUNK`` of data, a small meta); ``WINDOW -
GRANT_AT`` is larger, so a sender always gets room for its next frame."""


class Kind(enum.IntEnum):
    HELLO = 1
    REQUEST = 2
    DATA = 3
    EOF = 4
    RESPONSE = 5
    ERROR = 6
    SIGNAL = 7
    WINDOW = 8
    CANCEL = 9


FLOW_KINDS = frozenset({Kind.DATA, Kind.EOF})
"""Kinds whose frames count against a channel's window."""
FINAL_KINDS = frozenset({Kind.RESPONSE, Kind.ERROR})
"""Kinds that end a channel (guest to host)."""


class ProtocolError(Exception):
    """A frame could not be parsed."""


def encode(kind: Kind, channel: int, meta: dict[str, Any] | None = None, data: bytes = b"") -> bytes:
    """Serialise one frame; ``meta`` must be JSON-serialisable."""
    m = json.dumps(meta or {}, separators=(",", ":")).encode()
    if len(m) > MAX_META or len(data) > MAX_DATA:
        raise ProtocolError("frame too large")
    return HEADER.pack(MAGIC, VERSION, int(kind), channel, len(m), len(data)) + m + data


class Frame:
    """One decoded frame; ``size`` is its encoded length in bytes (what flow control counts)."""

    __slots__ = ("kind", "channel", "meta", "data", "version", "size", "unparsed")

    def __init__(self, kind: int, channel: int, meta: dict[str, Any], data: bytes, version: int,
                 size: int = 0, unparsed: bytes | None = None):
        self.kind = kind
        self.channel = channel
        self.meta = meta
        self.data = data
        self.version = version
        self.size = size
        self.unparsed = unparsed
        """The meta's bytes, not yet parsed (``meta`` is then empty): a meta over the
        ``Decoder``'s ``parse_max``, for its caller to parse (``parse_meta``) elsewhere."""

    def __repr__(self) -> str:
        return f"Frame(kind={self.kind}, channel={self.channel}, meta={self.meta}, data={len(self.data)}B)"


def depth_ok(value: Any, limit: int = MAX_DEPTH) -> bool:
    """True when ``value`` (parsed JSON) nests at most ``limit`` containers deep."""
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            v = v.values()
        elif not isinstance(v, list):
            continue
        if d > limit:
            return False
        stack.extend((x, d + 1) for x in v if isinstance(x, (dict, list)))
    return True


def parse_meta(raw: bytes) -> dict[str, Any] | None:
    """A frame's meta, or None when it is not a JSON object within ``MAX_META`` bytes and
    ``MAX_DEPTH`` levels. Never raises (a meta nested deeper than the interpreter's
    recursion limit is refused by the JSON parser itself: RecursionError, caught)."""
    if not raw:
        return {}
    if len(raw) > MAX_META:
        return None
    try:  # UTF-8 only: json.loads would take UTF-16 and UTF-32 bytes too
        meta = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):
        return None
    if not isinstance(meta, dict):
        return None
    # n bytes of JSON nest at most n/2 deep: small metas need no walk
    if len(raw) > 2 * MAX_DEPTH and not depth_ok(meta):
        return None
    return meta


class Decoder:
    """Incremental decoder: ``feed`` bytes, iterate complete frames.

    ``wanted(kind, channel)``, when given, says which frames to decode: any other is
    skipped as its bytes arrive (``dropped`` counts it), never held whole nor parsed.
    ``dropped`` also counts frames refused by ``parse_meta``; ``skipped`` counts bytes
    dropped while resynchronising and in skipped frames. ``parse_max``, when given: a meta
    longer than that many bytes is left to the caller (``Frame.unparsed``), who may parse
    it off its event loop (about 0.6 s a MiB).
    """

    def __init__(self, wanted: Callable[[int, int], bool] | None = None,
                 parse_max: int | None = None) -> None:
        self.parse_max = parse_max
        self._buf = bytearray()
        self._skip = 0  # bytes of a skipped frame still to come
        self.wanted = wanted
        self.skipped = 0  # bytes dropped while resynchronising or skipping
        self.dropped = 0  # frames dropped: unwanted, or a meta out of bounds

    def feed(self, data: bytes) -> Iterator[Frame]:
        """Take ``data`` (now) and return an iterator of the complete frames it holds.

        Frames are cut one at a time as the caller iterates, so ``wanted`` sees the
        channels that the frames before it opened (a REQUEST and its CANCEL often come
        in one read). Frames left unread stay buffered for the next ``feed``.
        """
        if self._skip:
            n = min(self._skip, len(data))
            self._skip -= n
            self.skipped += n
            data = data[n:]
        self._buf += data
        return self._frames()

    def _frames(self) -> Iterator[Frame]:
        while True:
            if self._skip or len(self._buf) < HEADER.size:
                return
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
            if self.wanted is not None and not self.wanted(kind, channel):
                self.dropped += 1
                n = min(end, len(self._buf))
                del self._buf[:n]
                self.skipped += n
                self._skip = end - n
                continue
            if len(self._buf) < end:
                return
            raw_meta = bytes(self._buf[HEADER.size:HEADER.size + mlen])
            data = bytes(self._buf[HEADER.size + mlen:end])
            del self._buf[:end]
            if self.parse_max is not None and mlen > self.parse_max:
                yield Frame(kind, channel, {}, data, version, end, unparsed=raw_meta)
                continue
            meta = parse_meta(raw_meta)
            if meta is None:
                self.dropped += 1
                self.skipped += end
                continue
            yield Frame(kind, channel, meta, data, version, end)


def granted(frame: Frame) -> int:
    """The bytes a WINDOW frame grants; 0 for a malformed one."""
    n = frame.meta.get("bytes")
    return n if isinstance(n, int) and not isinstance(n, bool) and 0 < n <= WINDOW else 0


class Outflow:
    """The sender's side of one channel's window: bytes it may still send.

    ``take(n)`` waits until ``n`` bytes of window are free, then uses them;
    ``grant(n)`` (a WINDOW frame came) frees more. ``fail(exc)`` makes every
    waiting and later ``take`` raise ``exc``; ``fail(None)`` lets them
    through at once instead (the frames go nowhere: the peer is gone).
    """

    def __init__(self, size: int = WINDOW) -> None:
        self.size = size
        self.available = size
        self._changed = asyncio.Event()
        self._failed: BaseException | None = None
        self._open = False
        self._waiters = 0

    @property
    def waiting(self) -> bool:
        """True while a ``take`` waits for window."""
        return self._waiters > 0

    def grant(self, n: int) -> None:
        # A receiver grants back only what it took, so more than the whole window
        # is a broken peer's lie: never believed.
        self.available = min(self.available + n, self.size)
        self._changed.set()

    def fail(self, exc: BaseException | None) -> None:
        if exc is None:
            self._open = True
        elif self._failed is None:
            self._failed = exc
        self._changed.set()

    def take_now(self, n: int) -> bool:
        """Use ``n`` bytes of window at once when they are free and no ``take`` waits;
        False (nothing used) otherwise, and then the frame goes through ``take``."""
        if self._failed is not None or self._waiters or n > WINDOW:
            return False
        if self._open or self.available >= n:
            self.available -= n
            return True
        return False

    async def take(self, n: int) -> None:
        if n > WINDOW:
            raise ValueError(f"a {n}-byte frame cannot fit a {WINDOW}-byte window")
        self._waiters += 1
        try:
            while True:
                if self._failed is not None:
                    raise self._failed
                if self._open or self.available >= n:
                    self.available -= n
                    return
                self._changed.clear()
                await self._changed.wait()
        finally:
            self._waiters -= 1


class Inflow:
    """The receiver's side of one channel's window.

    ``arrive(n)`` accounts a DATA or EOF frame of ``n`` bytes: False when the
    sender had no such window (a broken or hostile peer). ``consume(n)``
    accounts what the consumer took and returns the bytes to grant back
    now (0 until ``GRANT_AT`` have gathered).
    """

    def __init__(self, size: int = WINDOW) -> None:
        self.window = size
        """Bytes the sender may still send."""
        self._consumed = 0

    def arrive(self, n: int) -> bool:
        if n > self.window:
            return False
        self.window -= n
        return True

    def consume(self, n: int) -> int:
        self._consumed += n
        if self._consumed < GRANT_AT:
            return 0
        grant, self._consumed = self._consumed, 0
        self.window += grant
        return grant
