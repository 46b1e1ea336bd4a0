"""The framed session with one guest agent: its one handshake, the read loop and plain calls.

One ``Connection`` holds one byte stream to one guest's agent channel (a
Unix socket that the VMM exposes) and multiplexes any number of requests
over it, each on a ``Channel`` of its own (``channel``). Every connection
starts with ``Connection.handshake``: an engine says only how to open its
channel (an ``AgentChannel``: QEMU's virtio-serial socket, Firecracker's
vsock socket after ``CONNECT <port>``), and the handshake retries, waits for
the agent's greeting and checks its protocol version.

Frames the host sends: DATA and EOF keep to the guest's window and wait for
the stream to drain (``Channel.send_frame``); REQUEST, WINDOW, CANCEL and a
terminal's hang-up are queued without waiting (``_write``), so a frozen
guest cannot block a call's clean-up. Frames for channels the host does not
hold are dropped.

Every call has a deadline (``Deadlines``): a call whose guest does not
answer in time fails with ``Timeout`` (504), the guest is told to CANCEL
it, and ``on_unanswered`` is called (the orchestrator marks the sandbox
``unresponsive``). Agent error codes become ``hangar.errors`` classes
(``ERRORS``; anything else is ``GuestError``), as does a lost connection.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, Self

from hangar import json_items
from hangar.engines.agent_client.channel import Channel
from hangar.errors import (
    Busy, Conflict, GuestError, HangarError, InvalidRequest, LimitExceeded, NotFound, Timeout,
)
from hangar.guest import protocol as P
from hangar.schemas.bounds import EXEC_TIMEOUT_MAX_S

ERRORS: dict[str, type[HangarError]] = {
    "not_found": NotFound,
    "is_directory": InvalidRequest,
    "not_directory": InvalidRequest,
    "invalid": InvalidRequest,
    "permission_denied": InvalidRequest,
    "exists": Conflict,
    "not_empty": Conflict,
    "closed": Conflict,
    "busy": Busy,
    "too_many": LimitExceeded,
}

log = logging.getLogger("hangar.agent")



class SessionRestarted(GuestError):
    """The agent began a new session on this connection before it answered (502).

    The guest agent serves its virtio-serial port one session at a time and
    reopens the port whenever it reads the host's absence; each session
    starts with a HELLO and ends by cancelling its requests. A request sent
    to a session that was ending (or while the port was closed, when the
    bytes are dropped) is never answered: it fails with this error as soon
    as the next session's HELLO arrives. Nothing of it ran to completion in
    the guest, so a request that is safe to repeat may be sent again at once
    on the same connection.
    """


@dataclass(frozen=True)
class Deadlines:
    """How long a guest may take before a call fails with ``Timeout`` (504), seconds.

    ``control_s`` for a request without streams (stat, list, mkdir, hello,
    set_time...), to open a tunnel, a terminal or a watch, and for a
    hung-up terminal to make progress; an exec gets its own timeout plus
    ``exec_grace_s`` (one without a timeout gets ``exec_max_s``); a file
    read or write must move the next window within ``stall_s`` whenever
    it can (time spent waiting for the HTTP client does not count), and a
    write must be answered ``control_s`` plus one second per
    ``write_rate`` bytes after its last byte (the guest's fsync).
    """

    control_s: float = 30.0
    exec_grace_s: float = 10.0
    exec_max_s: float = EXEC_TIMEOUT_MAX_S
    stall_s: float = 30.0
    write_rate: float = float(4 << 20)


CHANNEL_START_SPAN = 1 << 30
"""A connection's first request channel id is drawn below this (``Connection``)."""
META_ONLOOP = 8 << 10
"""A guest's frame meta longer than this, bytes (at most ``protocol.MAX_META``, 1 MiB), is
not parsed on the event loop as it arrives: only an answer (RESPONSE, ERROR) or a DATA
frame on an open channel (a watch's batch of events, up to 64 KiB) may be that large, and
its values are counted first (``META_ITEMS``), then it is parsed in a worker thread; any
other frame's (a HELLO's, always read) is dropped unparsed (review 29f H3, 29g G-H1)."""
META_ITEMS = 1 << 18
"""Most values (``hangar.json_items``) of a large answer's meta: a folder's listing of
10,000 entries holds about 90,000; a parse of this many small values holds the GIL, and so
the loop, about 40 ms even in a worker thread."""
META_TURN = 16 << 10
"""Bytes of metas parsed on the loop between two of its turns: a guest that writes frames
back to back shares the loop with every other tenant's calls (review 29g G-H1)."""
DATA_META_MAX = P.CHUNK + (1 << 10)
"""Largest meta of a DATA frame taken, bytes: a watch's batch of events
(``hangar.guest.watch.BATCH_BYTES``, ``P.CHUNK``) and its wrapper. Each event is then
converted on the loop; a MiB of them held it about 0.4 s (review 29j J-H1)."""
LARGE_META_KINDS = frozenset({P.Kind.RESPONSE, P.Kind.ERROR, P.Kind.DATA})
"""The only kinds whose meta may exceed ``META_ONLOOP`` (a listing, an error's text, a
watch's events)."""
PROBE_CHANNEL_BASE = 0xFFFF0000
"""First channel id of the handshake's ``hello`` probes; requests count from below
``CHANNEL_START_SPAN`` and never reach it."""

Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]


@dataclass(frozen=True)
class AgentChannel:
    """How to reach one guest's agent: what an engine provides for ``Connection.handshake``.

    ``open()`` returns a new byte stream to the agent or raises ``OSError``
    while it cannot yet (the handshake retries). ``probe_interval`` (seconds)
    asks the agent ``hello`` instead of waiting for its HELLO alone, for a
    restored guest that may have kept its session and owe none.
    """

    open: Callable[[], Awaitable[Streams]]
    probe_interval: float | None = None


FEED_SLICE = 8 << 10
"""Bytes of a guest's stream given to the decoder between two turns of the loop: what it
does with bytes that make no frame (resynchronising, frames skipped or refused) costs
time too, and a read may hold 64 KiB of it (review 29i I-H1: 256 KiB of it held the loop
up to a second)."""


async def _fed(decoder: P.Decoder, data: bytes) -> list[P.Frame]:
    """The frames ``data`` completes, fed to ``decoder`` ``FEED_SLICE`` bytes at a time
    with a turn of the loop between two slices."""
    out: list[P.Frame] = []
    for at in range(0, len(data), FEED_SLICE):
        if at:
            await asyncio.sleep(0)
        out.extend(decoder.feed(data[at:at + FEED_SLICE]))
    return out


async def _large_meta(frame: P.Frame) -> dict[str, Any] | None:
    """The meta of a frame the decoder left unparsed (over ``META_ONLOOP``), or None to drop
    the frame: not an answer, more than ``META_ITEMS`` values, or not a meta
    (``protocol.parse_meta``). Counted and parsed in a worker thread."""
    raw = frame.unparsed
    if frame.kind not in LARGE_META_KINDS or raw is None:
        return None
    if frame.kind == P.Kind.DATA and len(raw) > DATA_META_MAX:
        return None  # a watch's batch is smaller: its events are converted on the loop

    def parse() -> dict[str, Any] | None:
        return None if json_items.too_many(raw, META_ITEMS) else P.parse_meta(raw)

    return await asyncio.to_thread(parse)


def unix_channel(path: Path | str) -> AgentChannel:
    """A channel that connects to the Unix socket ``path`` (QEMU's virtio-serial port)."""

    async def open_() -> Streams:
        return await asyncio.open_unix_connection(str(path), limit=P.MAX_DATA * 2)

    return AgentChannel(open_)


class Connection:
    """A framed session with one guest agent: the handshake, the read loop, the channel
    table and plain calls; safe for concurrent use within one event loop.

    ``AgentClient`` (``hangar.engines.agent_client.client``) adds the calls that
    carry streams. A HELLO with another ``boot_id`` on an open connection means
    the agent restarted: every open call fails at once with ``GuestError``
    instead of waiting for its deadline; so does every call when the
    connection is lost.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 hello: dict[str, Any], deadlines: Deadlines | None = None) -> None:
        self._reader = reader
        self._writer = writer
        self.hello = hello
        self.deadlines = deadlines or Deadlines()
        self.on_unanswered: Callable[[str, float], None] | None = None
        """Called with (operation, seconds) when a call's deadline passes unanswered."""
        # Channel ids start at a random point: a restored guest may keep its session, whose
        # channels still open (a process's stream from before a pause) would otherwise be
        # named again by this connection's first requests ("channel already open").
        self._ids = itertools.count(1 + secrets.randbelow(CHANNEL_START_SPAN))
        self._channels: dict[int, Channel] = {}
        self._closed = False
        self._pump = asyncio.create_task(self._read_loop())

    @classmethod
    async def handshake(cls, channel: AgentChannel, timeout: float, *,
                        alive: Callable[[], bool] | None = None) -> Self:
        """Open the agent's channel and wait for the agent to greet; the one handshake.

        ``channel.open()`` gives a byte stream to the agent; while it raises
        ``OSError`` (the VMM has not made its socket yet, the guest does not
        listen yet) or the stream closes before the greeting, it is opened
        again every 50 ms. The greeting is the agent's HELLO frame, or, with
        ``channel.probe_interval`` set, the answer to a ``hello`` request sent
        at once and then every ``probe_interval`` seconds (for a restored guest
        that may owe no HELLO; the requests use channel ids from
        ``PROBE_CHANNEL_BASE``, which requests never use). Without a probe the
        host writes nothing before the HELLO (virtio-serial drops bytes sent
        to a port the guest has not opened).

        Waits at most ``timeout`` seconds; ``alive`` (the VMM's liveness) ends
        the wait early. Raises ``Timeout``, or ``GuestError`` when the VMM
        exits or the agent speaks another protocol version; other errors of
        ``channel.open()`` pass through.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        last: BaseException | None = None
        while loop.time() < deadline:
            if alive is not None and not alive():
                raise GuestError("the VMM exited before the guest agent answered")
            try:
                reader, writer = await asyncio.wait_for(
                    channel.open(), max(0.01, deadline - loop.time()))
            except OSError as exc:  # also TimeoutError and ConnectionError
                last = exc
                await asyncio.sleep(0.05)
                continue
            try:
                hello = await cls._greeting(reader, writer, deadline, alive,
                                            channel.probe_interval)
            except OSError as exc:  # the stream closed or broke: open it again
                last = exc
                writer.close()
                await asyncio.sleep(0.05)
                continue
            except BaseException:
                writer.close()
                raise
            if hello is None:
                writer.close()
                break
            try:
                return cls.greeted(reader, writer, hello)
            except BaseException:
                writer.close()
                raise
        raise Timeout(f"guest agent did not answer within {timeout:.0f} s",
                      last_error=repr(last) if last else "no answer")

    @staticmethod
    async def _greeting(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                        deadline: float, alive: Callable[[], bool] | None,
                        probe_interval: float | None) -> dict[str, Any] | None:
        """The greeting's meta, or None at ``deadline``; OSError when the stream ends."""
        loop = asyncio.get_running_loop()
        probes: set[int] = set()
        decoder = P.Decoder(lambda kind, cid: (cid == 0 and kind == P.Kind.HELLO)
                            or cid in probes, parse_max=META_ONLOOP)
        probe_ids = itertools.count(PROBE_CHANNEL_BASE)
        next_probe = loop.time() if probe_interval else math.inf
        while loop.time() < deadline:
            if alive is not None and not alive():
                raise GuestError("the VMM exited before the guest agent answered")
            if loop.time() >= next_probe:
                cid = next(probe_ids)
                probes.add(cid)
                writer.write(P.encode(P.Kind.REQUEST, cid, {"op": "hello"}))
                await writer.drain()
                next_probe = loop.time() + (probe_interval or math.inf)
            wait = max(0.01, min(next_probe, deadline, loop.time() + 0.5) - loop.time())
            try:
                data = await asyncio.wait_for(reader.read(1 << 16), wait)
            except TimeoutError:
                continue  # the HELLO comes when the guest opens its port
            if not data:
                raise ConnectionResetError("the agent's stream closed before it greeted")
            for frame in await _fed(decoder, data):
                if frame.unparsed is not None:
                    continue  # a greeting is small: a meta over META_ONLOOP is none
                if frame.kind == P.Kind.HELLO or (
                        frame.kind == P.Kind.RESPONSE and frame.channel in probes):
                    return frame.meta
                if (frame.kind == P.Kind.ERROR and frame.channel in probes
                        and frame.meta.get("code") == "unsupported_version"):
                    raise GuestError("the guest agent speaks another protocol version "
                                     f"(it answered: {str(frame.meta.get('message'))[:200]}); "
                                     f"the host speaks {P.VERSION}")
        return None

    @classmethod
    async def connect(cls, path: Path | str, timeout: float = 30.0,
                      proc_alive: Callable[[], bool] | None = None) -> Self:
        """``handshake`` over the Unix socket at ``path`` (``unix_channel``)."""
        return await cls.handshake(unix_channel(path), timeout, alive=proc_alive)

    @classmethod
    def greeted(cls, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                hello: dict[str, Any]) -> Self:
        """A client on a stream whose agent has said ``hello`` (its HELLO meta).

        Raises ``GuestError`` when the agent speaks another protocol version,
        so an old guest is detected, not misread.
        """
        if hello.get("protocol") != P.VERSION:
            raise GuestError(f"guest agent speaks protocol {hello.get('protocol')}, "
                             f"host speaks {P.VERSION}")
        return cls(reader, writer, hello)

    @classmethod
    async def from_streams(cls, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                           timeout: float = 30.0) -> Self:
        """``handshake`` on one byte stream that is already open, never reopened.

        Raises ``Timeout``, or ``GuestError`` when the stream closes before
        the HELLO or the agent speaks another protocol version; the writer is
        closed on failure.
        """
        given: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = [(reader, writer)]

        async def once() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            if not given:
                raise GuestError("agent stream closed before its HELLO")
            return given.pop()

        try:
            return await cls.handshake(AgentChannel(once), timeout)
        except BaseException:
            writer.close()
            raise

    # -- plumbing: for the channels and stream handles of this package, not for callers --

    async def _read_loop(self) -> None:
        # Frames on channels this side never opened (or closed) are skipped unparsed, and a
        # meta out of the protocol's bounds drops its frame (``P.Decoder``). A meta over
        # ``META_ONLOOP`` bytes is parsed in a worker thread (review 29f H3).
        channels = self._channels
        decoder = P.Decoder(lambda kind, cid: (cid == 0 and kind == P.Kind.HELLO)
                            or cid in channels, parse_max=META_ONLOOP)
        try:
            while True:
                data = await self._reader.read(1 << 16)
                if not data:
                    break
                parsed = 0  # bytes of metas parsed on the loop since its last turn
                for frame in await _fed(decoder, data):
                    if frame.unparsed is not None:
                        meta = await _large_meta(frame)
                        if meta is None:
                            decoder.dropped += 1
                            continue
                        frame.meta, frame.unparsed = meta, None
                    else:
                        parsed += frame.size - len(frame.data)
                        if parsed > META_TURN:
                            await asyncio.sleep(0)
                            parsed = 0
                    if frame.kind == P.Kind.HELLO and frame.channel == 0:
                        self._greeted_again(frame.meta)
                        continue
                    ch = self._channels.get(frame.channel)
                    if ch is not None:
                        ch.deliver(frame)
        except (ConnectionError, OSError):
            pass
        finally:
            self._closed = True
            for ch in list(self._channels.values()):
                ch.fail(GuestError("agent connection lost"), cancel=False)

    def _greeted_again(self, hello: dict[str, Any]) -> None:
        """A HELLO on an open connection: a new agent session, which has none of our requests.

        A session writes its HELLO before it reads any request, so a HELLO
        after the greeting is never the greeting session's own: the session
        that had our requests has ended (see ``SessionRestarted``), or the
        agent itself restarted (another ``boot_id`` or pid).
        """
        lost = sorted(ch.op for ch in self._channels.values())
        if hello.get("boot_id") == self.hello.get("boot_id"):
            if lost:  # a guest's HELLOs alone write no lines (the guest may send many)
                log.info("guest agent began a new session", extra={"in_flight": lost})
            error: GuestError = SessionRestarted(
                "the guest agent began a new session before it answered; the call was lost")
        else:
            error = GuestError("the guest agent restarted; the call was lost")
        self.hello = hello
        for ch in list(self._channels.values()):
            ch.fail(error, cancel=False)

    @property
    def closed(self) -> bool:
        """True once the connection is lost or closed."""
        return self._closed

    def _write(self, kind: P.Kind, channel: int, meta: dict[str, Any] | None = None,
               data: bytes = b"") -> None:
        """Queue one control frame (REQUEST, WINDOW, CANCEL) on the stream now, without
        waiting. Raises GuestError when the connection is lost.

        A frozen guest thus never blocks a call's clean-up. These frames are
        small and one per call or per window the host's consumer took; DATA
        and EOF go through ``Channel.send_frame``, which waits.
        """
        self._write_frame(P.encode(kind, channel, meta, data))

    def _write_frame(self, frame: bytes) -> None:
        if self._closed:
            raise GuestError("agent connection lost")
        try:
            self._writer.write(frame)
        except (ConnectionError, OSError, RuntimeError) as exc:
            raise GuestError(f"agent connection lost: {exc}") from None

    async def _drain(self) -> None:
        try:
            await self._writer.drain()
        except (ConnectionError, OSError, RuntimeError) as exc:
            raise GuestError(f"agent connection lost: {exc}") from None

    def _open(self, op: str) -> Channel:
        cid = next(self._ids) & 0xFFFFFFFF or next(self._ids)
        ch = Channel(self, cid, op)
        self._channels[cid] = ch
        return ch

    def _forget(self, ch: Channel, cancel: bool) -> None:
        """Drop ``ch`` from the table (later frames on it are ignored); CANCEL it in the guest."""
        if self._channels.get(ch.cid) is ch:
            del self._channels[ch.cid]
        if cancel and not self._closed:
            try:
                self._write(P.Kind.CANCEL, ch.cid)
            except GuestError:
                pass

    def _unanswered(self, op: str, seconds: float) -> None:
        if self.on_unanswered is not None:
            try:
                self.on_unanswered(op, seconds)
            except Exception:  # a hook never breaks the call that failed
                log.exception("on_unanswered hook failed")

    @staticmethod
    def _raise(frame: P.Frame) -> NoReturn:
        """Raise the guest's ERROR frame as its ``hangar.errors`` class (``ERRORS``)."""
        code = frame.meta.get("code", "internal")
        message = frame.meta.get("message", "guest agent error")
        if not isinstance(code, str) or not isinstance(message, str):
            code, message = "internal", "guest agent error"
        raise ERRORS.get(code, GuestError)(message[:2000], guest_code=code[:64])

    async def _response(self, ch: Channel) -> dict[str, Any]:
        """The meta of the call's RESPONSE on ``ch``; its ERROR raised (``_raise``); frames
        before either are skipped."""
        while True:
            frame = await ch.get()
            if frame.kind == P.Kind.RESPONSE:
                return frame.meta
            if frame.kind == P.Kind.ERROR:
                self._raise(frame)

    # -- calls ---------------------------------------------------------------

    async def call(self, op: str, *, deadline_s: float | None = None,
                   **meta: Any) -> dict[str, Any]:
        """One request without data streams; returns the RESPONSE meta.

        The guest must answer within ``deadline_s`` seconds (default
        ``deadlines.control_s``), else ``Timeout``.
        """
        ch = self._open(op)
        try:
            self._write(P.Kind.REQUEST, ch.cid, {"op": op, **meta})
            ch.expect(deadline_s if deadline_s is not None else self.deadlines.control_s)
            return await self._response(ch)
        finally:
            ch.close()

    async def close(self) -> None:
        """Close the connection: every open call fails with ``GuestError``. Never waits."""
        self._closed = True
        self._pump.cancel()
        for ch in list(self._channels.values()):
            ch.fail(GuestError("agent connection closed"), cancel=False)
        try:
            self._writer.close()
        except Exception:
            pass
