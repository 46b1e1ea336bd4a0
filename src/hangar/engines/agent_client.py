"""Host side of the guest agent protocol (see ``hangar.guest.protocol``).

One ``AgentClient`` holds one connection to one guest's agent channel (a
Unix socket that the VMM exposes) and multiplexes any number of requests
over it. Every connection starts with ``AgentClient.handshake``: an engine
says only how to open its channel (an ``AgentChannel``: QEMU's virtio-serial
socket, Firecracker's vsock socket after ``CONNECT <port>``), and the
handshake retries, waits for the agent's greeting and checks its protocol
version. This module runs on the host; ``hangar.guest`` holds only what runs
in the guest.

Bounds. A guest is hostile, so nothing it sends is buffered without bound:

* Flow control (protocol version 2): per channel, the guest may have at
  most ``WINDOW`` bytes of DATA and EOF frames that the host's consumer
  has not taken; the host grants more as it takes them (``_Channel.get``).
  A guest that sends more loses the call (``GuestError``), and the frames
  are not kept. Frames for channels the host does not hold are dropped.
  So per call the host holds at most ``WINDOW`` plus one final frame,
  whatever the guest does and however slowly the HTTP client reads, and
  a slow consumer never holds up another channel. The host's own DATA to
  the guest keeps to the guest's window too and waits for the stream to
  drain (a terminal's SIGNALs wait for the drain); REQUEST, WINDOW,
  CANCEL and a terminal's hang-up are queued without waiting (a frozen
  guest cannot block a call's clean-up).
* Deadlines (``Deadlines``): every call has one, and a call whose guest
  does not answer in time fails with ``Timeout`` (504), the guest is told
  to CANCEL it, and ``on_unanswered`` is called (the orchestrator marks
  the sandbox ``unresponsive``).
* A consumer that gives up (an iterator closed early, an HTTP client gone)
  CANCELs the call in the guest: an exec's process group is killed, a file
  or socket closed, a terminal hung up, a watch stopped.
* A HELLO with another ``boot_id`` on an open connection means the agent
  restarted: every open call fails at once instead of waiting for its
  deadline.

Agent error codes become ``hangar.errors`` classes:

==================  ======================
agent code          raised
==================  ======================
not_found           NotFound
is_directory,       InvalidRequest
not_directory,
invalid,
permission_denied
exists, not_empty   Conflict
anything else       GuestError
==================  ======================

A lost connection fails every open request with ``GuestError``.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hangar.errors import Conflict, GuestError, HangarError, InvalidRequest, NotFound, Timeout
from hangar.guest import protocol as P

ERRORS: dict[str, type[HangarError]] = {
    "not_found": NotFound,
    "is_directory": InvalidRequest,
    "not_directory": InvalidRequest,
    "invalid": InvalidRequest,
    "permission_denied": InvalidRequest,
    "exists": Conflict,
    "not_empty": Conflict,
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
    exec_max_s: float = 86400.0
    stall_s: float = 30.0
    write_rate: float = float(4 << 20)


PROBE_CHANNEL_BASE = 0xFFFF0000
"""First channel id of the handshake's ``hello`` probes; ``AgentClient`` requests count
from 1 and never reach it."""

Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]


@dataclass(frozen=True)
class AgentChannel:
    """How to reach one guest's agent: what an engine provides for ``AgentClient.handshake``.

    ``open()`` returns a new byte stream to the agent or raises ``OSError``
    while it cannot yet (the handshake retries). ``probe_interval`` (seconds)
    asks the agent ``hello`` instead of waiting for its HELLO alone, for a
    restored guest that may have kept its session and owe none.
    """

    open: Callable[[], Awaitable[Streams]]
    probe_interval: float | None = None


def unix_channel(path: Path | str) -> AgentChannel:
    """A channel that connects to the Unix socket ``path`` (QEMU's virtio-serial port)."""

    async def open_() -> Streams:
        return await asyncio.open_unix_connection(str(path), limit=P.MAX_DATA * 2)

    return AgentChannel(open_)


@dataclass
class StreamCapture:
    """One output stream as captured by the agent.

    ``head`` is the whole output when ``truncated`` is false; otherwise the
    first bytes, with ``tail`` the last ones and ``total`` the byte count.
    """

    head: bytes = b""
    tail: bytes = b""
    total: int = 0
    truncated: bool = False

    @classmethod
    def from_frame(cls, m: dict[str, Any], data: memoryview) -> tuple["StreamCapture", memoryview]:
        """Decode one capture whose bytes start ``data``; returns it and the rest."""
        h, t = int(m.get("head", 0)), int(m.get("tail", 0))
        cap = cls(head=bytes(data[:h]), tail=bytes(data[h:h + t]),
                  total=int(m.get("total", 0)), truncated=bool(m.get("truncated", False)))
        return cap, data[h + t:]


@dataclass
class ExecResult:
    """Outcome of one command in the guest.

    ``exit_code`` is 128+N when the process died of signal N (``signal``);
    ``timed_out`` is set when Hangar killed the process group at its timeout.
    """

    exit_code: int | None
    signal: int | None
    timed_out: bool
    duration_s: float
    stdout: StreamCapture = field(default_factory=StreamCapture)
    stderr: StreamCapture = field(default_factory=StreamCapture)


@dataclass
class ExecEvent:
    """One streamed event: ``kind`` is ``stdout``, ``stderr`` (``data`` set) or ``exit``."""

    kind: str
    data: bytes = b""
    result: ExecResult | None = None


def exec_meta(
    command: str | None = None,
    argv: list[str] | None = None,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    timeout: float | None = None,
    stdin: bool = False,
    stream: bool = False,
    head: int | None = None,
    tail: int | None = None,
) -> dict[str, Any]:
    meta: dict[str, Any] = {"op": "exec", "stream": stream, "stdin": stdin}
    if argv is not None:
        meta["argv"] = argv
    else:
        meta["shell"] = command
    for key, value in (("env", env), ("cwd", cwd), ("timeout", timeout), ("head", head),
                       ("tail", tail)):
        if value is not None:
            meta[key] = value
    return meta


def _int_or_none(value: Any) -> int | None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise ValueError(f"not an integer: {value!r}")


def _result(frame: P.Frame) -> ExecResult:
    """The exec result in a RESPONSE; ValueError, TypeError or AttributeError when
    the guest sent something else."""
    meta = frame.meta
    stdout, rest = StreamCapture.from_frame(meta.get("stdout", {}), memoryview(frame.data))
    stderr, _ = StreamCapture.from_frame(meta.get("stderr", {}), rest)
    return ExecResult(
        exit_code=_int_or_none(meta.get("exit_code")),
        signal=_int_or_none(meta.get("signal")),
        timed_out=bool(meta.get("timed_out")),
        duration_s=float(meta.get("duration_s", 0.0)),
        stdout=stdout,
        stderr=stderr,
    )


class AgentClient:
    """A connection to one guest agent; safe for concurrent use within one event loop."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 hello: dict[str, Any], deadlines: Deadlines | None = None) -> None:
        self._reader = reader
        self._writer = writer
        self.hello = hello
        self.deadlines = deadlines or Deadlines()
        self.on_unanswered: Callable[[str, float], None] | None = None
        """Called with (operation, seconds) when a call's deadline passes unanswered."""
        self._ids = itertools.count(1)
        self._channels: dict[int, _Channel] = {}
        self._closed = False
        self._pump = asyncio.create_task(self._read_loop())

    @classmethod
    async def handshake(cls, channel: "AgentChannel", timeout: float, *,
                        alive: Callable[[], bool] | None = None) -> "AgentClient":
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
        decoder = P.Decoder()
        probes: set[int] = set()
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
            for frame in decoder.feed(data):
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
                      proc_alive: Callable[[], bool] | None = None) -> "AgentClient":
        """``handshake`` over the Unix socket at ``path`` (``unix_channel``)."""
        return await cls.handshake(unix_channel(path), timeout, alive=proc_alive)

    @classmethod
    def greeted(cls, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                hello: dict[str, Any]) -> "AgentClient":
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
                           timeout: float = 30.0) -> "AgentClient":
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

    # -- plumbing ----------------------------------------------------------

    async def _read_loop(self) -> None:
        decoder = P.Decoder()
        try:
            while True:
                data = await self._reader.read(1 << 16)
                if not data:
                    break
                for frame in decoder.feed(data):
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
        return self._closed

    def _write(self, kind: P.Kind, channel: int, meta: dict[str, Any] | None = None,
               data: bytes = b"") -> None:
        """Queue one control frame (REQUEST, WINDOW, CANCEL) on the stream now, without
        waiting. Raises GuestError when the connection is lost.

        A frozen guest thus never blocks a call's clean-up. These frames are
        small and one per call or per window the host's consumer took; DATA
        and EOF go through ``_Channel.send_frame``, which waits.
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

    def _open(self, op: str) -> "_Channel":
        cid = next(self._ids) & 0xFFFFFFFF or next(self._ids)
        ch = _Channel(self, cid, op)
        self._channels[cid] = ch
        return ch

    def _forget(self, ch: "_Channel", cancel: bool) -> None:
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
    def _raise(frame: P.Frame) -> None:
        code = frame.meta.get("code", "internal")
        message = frame.meta.get("message", "guest agent error")
        if not isinstance(code, str) or not isinstance(message, str):
            code, message = "internal", "guest agent error"
        raise ERRORS.get(code, GuestError)(message[:2000], guest_code=code[:64])

    async def _send_stream(self, ch: "_Channel", stream: str,
                           chunks: Iterable[bytes] | AsyncIterator[bytes],
                           stall_s: float | None = None) -> int:
        """Send ``chunks`` as DATA frames within the guest's window, then EOF; returns bytes.

        With ``stall_s``, the guest must open its window within that many
        seconds whenever the host waits for it (else ``Timeout``).
        """
        sent = 0

        async def piece(kind: P.Kind, data: bytes = b"") -> None:
            await ch.send_frame(P.encode(kind, ch.cid, {"stream": stream}, data), stall_s)

        if hasattr(chunks, "__aiter__"):
            async for chunk in chunks:  # type: ignore[union-attr]
                for i in range(0, len(chunk), P.CHUNK):
                    await piece(P.Kind.DATA, chunk[i:i + P.CHUNK])
                sent += len(chunk)
        else:
            for chunk in chunks:  # type: ignore[union-attr]
                for i in range(0, len(chunk), P.CHUNK):
                    await piece(P.Kind.DATA, chunk[i:i + P.CHUNK])
                sent += len(chunk)
        await piece(P.Kind.EOF)
        return sent

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
            while True:
                frame = await ch.get()
                if frame.kind == P.Kind.RESPONSE:
                    return frame.meta
                if frame.kind == P.Kind.ERROR:
                    self._raise(frame)
        finally:
            ch.close()

    # -- operations --------------------------------------------------------

    async def exec_stream(self, meta: dict[str, Any], stdin: bytes | None = None,
                          ) -> AsyncIterator[ExecEvent]:
        """Run a command (``meta`` from ``exec_meta``) and yield its events.

        Yields ``stdout``/``stderr`` events as output arrives when
        ``meta["stream"]`` is true, then one ``exit`` event. A command
        without a timeout gets ``deadlines.exec_max_s``; the guest must end
        the call within its timeout plus ``deadlines.exec_grace_s``, else
        ``Timeout``. Output waits in the guest while the caller has not
        taken it (at most ``WINDOW`` bytes wait here). Closing the iterator
        early cancels the call: the guest kills the command's process group.
        """
        timeout = meta.get("timeout")
        if timeout is None:
            timeout = self.deadlines.exec_max_s
        meta = {**meta, "timeout": timeout, "stdin": stdin is not None}
        ch = self._open("exec")
        sender: asyncio.Task[int] | None = None
        try:
            self._write(P.Kind.REQUEST, ch.cid, meta)
            ch.expect(float(timeout) + self.deadlines.exec_grace_s)
            if stdin is not None:
                sender = _background(self._send_stream(ch, "stdin", [stdin] if stdin else []))
            while True:
                frame = await ch.get()
                if frame.kind == P.Kind.DATA:
                    kind = "stderr" if frame.meta.get("stream") == "stderr" else "stdout"
                    yield ExecEvent(kind, frame.data)
                elif frame.kind == P.Kind.RESPONSE:
                    try:
                        result = _result(frame)
                    except (TypeError, ValueError, AttributeError):
                        raise GuestError("the guest agent sent a malformed exec result") from None
                    yield ExecEvent("exit", result=result)
                    return
                elif frame.kind == P.Kind.ERROR:
                    self._raise(frame)
        finally:
            if sender is not None:
                sender.cancel()
            ch.close()

    async def exec(self, meta: dict[str, Any], stdin: bytes | None = None) -> ExecResult:
        """Run a command to completion; returns its captured result (see ``exec_stream``)."""
        result: ExecResult | None = None
        async for ev in self.exec_stream({**meta, "stream": False}, stdin):
            if ev.kind == "exit":
                result = ev.result
        assert result is not None
        return result

    async def read_file(self, path: str) -> AsyncIterator[bytes]:
        """Yield a guest file's bytes in chunks. Raises NotFound, InvalidRequest.

        Whenever the guest has window to send, it must send its next bytes
        within ``deadlines.stall_s`` seconds (time spent waiting for the
        caller does not count), else ``Timeout``. Closing the iterator early
        cancels the read.
        """
        ch = self._open("read_file")
        try:
            self._write(P.Kind.REQUEST, ch.cid, {"op": "read_file", "path": path})
            ch.watch_stalls(self.deadlines.stall_s)
            while True:
                frame = await ch.get()
                if frame.kind == P.Kind.DATA:
                    yield frame.data
                elif frame.kind == P.Kind.RESPONSE:
                    return
                elif frame.kind == P.Kind.ERROR:
                    self._raise(frame)
        finally:
            ch.close()

    async def write_file(self, path: str, chunks: Iterable[bytes] | AsyncIterator[bytes],
                         mode: int = 0o644) -> dict[str, Any]:
        """Write a guest file atomically from byte chunks; returns ``{path, size}``.

        Chunks go out as the guest's window allows. While the host waits for
        window the guest must open it within ``deadlines.stall_s``; after the
        last byte it must answer within ``deadlines.control_s`` plus one
        second per ``deadlines.write_rate`` bytes; else ``Timeout``. An error
        of ``chunks`` (the client's upload broke) cancels the write and is
        raised as it is.
        """
        ch = self._open("write_file")
        try:
            self._write(P.Kind.REQUEST, ch.cid, {"op": "write_file", "path": path, "mode": mode})
            ch.expect(self.deadlines.control_s)  # to open the file; disarmed when data flows

            async def send() -> None:
                try:
                    ch.expect(None)
                    size = await self._send_stream(ch, "file", chunks, self.deadlines.stall_s)
                except HangarError:
                    return  # the channel failed: the reader below raises why
                except Exception as exc:  # the source failed: cancel, then tell the caller
                    ch.fail(exc, cancel=True)
                    return
                ch.expect(self.deadlines.control_s + size / self.deadlines.write_rate)

            sender = _background(send())
            try:
                while True:
                    frame = await ch.get()
                    if frame.kind == P.Kind.RESPONSE:
                        return frame.meta
                    if frame.kind == P.Kind.ERROR:
                        self._raise(frame)
            finally:
                sender.cancel()
        finally:
            ch.close()

    async def open_tunnel(self, port: int, host: str = "127.0.0.1") -> "Tunnel":
        """Open a byte tunnel to ``host:port`` inside the guest.

        The guest must connect (or refuse) within ``deadlines.control_s``;
        an open tunnel has no deadline (its two ends decide when it ends).
        Raises NotFound when nothing listens there.
        """
        ch, _ = await self._open_long(
            {"op": "connect", "port": port, "host": host}, "connected",
            "the guest ended the tunnel before it was open")
        return Tunnel(self, ch)

    async def open_pty(self, meta: dict[str, Any]) -> "PtyChannel":
        """Start a program on a pseudo-terminal in the guest (``hangar.guest.terminal``).

        ``meta`` holds ``argv`` or ``shell`` (neither: a login shell), ``env``,
        ``cwd``, ``cols``, ``rows``. Returns once the program runs. The guest
        must start it (or refuse) within ``deadlines.control_s``; a running
        terminal has no deadline (it lives until its program ends or it is
        hung up). Raises InvalidRequest (bad input, a program that cannot
        start), Timeout, GuestError.
        """
        ch, frame = await self._open_long({**meta, "op": "pty"}, "started",
                                          "the guest ended the terminal before it started")
        pid = frame.meta.get("pid")
        return PtyChannel(self, ch, pid if isinstance(pid, int) else 0)

    async def open_watch(self, path: str, recursive: bool) -> "WatchChannel":
        """Watch ``path`` in the guest for file changes (``hangar.guest.watch``).

        Returns once the watch is in place. The guest must set it up (or
        refuse) within ``deadlines.control_s``; a watch in place has no
        deadline. Raises NotFound (no such path), InvalidRequest (too many
        folders, a bad path), Timeout, GuestError.
        """
        ch, frame = await self._open_long(
            {"op": "watch", "path": path, "recursive": recursive}, "ready",
            "the guest ended the watch before it was in place")
        return WatchChannel(ch, frame.meta)

    async def _open_long(self, meta: dict[str, Any], flag: str,
                         ended: str) -> tuple["_Channel", P.Frame]:
        """Open a long-lived channel (a tunnel, a terminal, a watch) with the request
        ``meta`` and wait, within ``deadlines.control_s``, for the guest's first DATA frame
        carrying ``flag``; from then on the channel has no deadline. Returns the channel
        and that frame. Raises the guest's ERROR as its class, or GuestError(``ended``)
        when the guest ends the channel first; the channel is closed on any failure.
        """
        ch = self._open(meta["op"])
        try:
            self._write(P.Kind.REQUEST, ch.cid, meta)
            ch.expect(self.deadlines.control_s)
            while True:
                frame = await ch.get()
                if frame.kind == P.Kind.DATA and frame.meta.get(flag):
                    ch.expect(None)
                    return ch, frame
                if frame.kind in P.FINAL_KINDS:
                    if frame.kind == P.Kind.ERROR:
                        self._raise(frame)
                    raise GuestError(ended)
        except BaseException:
            ch.close()
            raise

    async def close(self) -> None:
        self._closed = True
        self._pump.cancel()
        for ch in list(self._channels.values()):
            ch.fail(GuestError("agent connection closed"), cancel=False)
        try:
            self._writer.close()
        except Exception:
            pass


def _background(coro: Any) -> "asyncio.Task[Any]":
    """A task whose failure nobody awaits is not reported as never retrieved."""
    task = asyncio.ensure_future(coro)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return task


class _Channel:
    """One open request: frames the guest sent, both windows, the deadline.

    The read loop ``deliver``s frames: a DATA or EOF frame beyond what the
    host granted fails the channel (a guest that breaks flow control is not
    buffered for); WINDOW frames open the host's own window; anything after
    the final frame is ignored. The consumer ``get``s them in order and the
    host grants the guest more window as it does. ``expect`` arms the
    deadline, ``watch_stalls`` re-arms it whenever the guest may send;
    at the deadline the call fails with ``Timeout``, the guest is told to
    CANCEL, and ``AgentClient.on_unanswered`` hears of it.
    """

    def __init__(self, client: AgentClient, cid: int, op: str) -> None:
        self.client = client
        self.cid = cid
        self.op = op
        self.frames: deque[P.Frame] = deque()
        self.ready = asyncio.Event()
        self.inflow = P.Inflow()
        self.outflow = P.Outflow()
        self.ended = False
        self.error: BaseException | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.stall_s: float | None = None
        self.closed = False

    # the read loop's side

    def deliver(self, frame: P.Frame) -> None:
        if self.ended:
            return
        if frame.kind == P.Kind.WINDOW:
            self.outflow.grant(P.granted(frame))
            return
        if frame.kind in P.FLOW_KINDS:
            if not self.inflow.arrive(frame.size):
                self.frames.clear()
                self.fail(GuestError(f"the guest agent sent more than its flow-control window "
                                     f"during {self.op}"), cancel=True)
                return
            self.frames.append(frame)
            self._stall_check()
        elif frame.kind in P.FINAL_KINDS:
            self.ended = True
            self._disarm()
            self.outflow.fail(GuestError(f"the guest ended {self.op}"))
            self.frames.append(frame)
        else:
            return  # the guest sends no other kinds on a channel
        self.ready.set()

    def fail(self, exc: BaseException, cancel: bool) -> None:
        """End the channel with ``exc`` (raised after the frames already queued)."""
        if self.ended:
            return
        self.ended = True
        self.error = exc
        self._disarm()
        self.outflow.fail(exc)
        self.ready.set()
        self.client._forget(self, cancel)

    # the consumer's side

    @property
    def buffered(self) -> int:
        """Bytes of DATA and EOF frames received and not yet taken."""
        return sum(f.size for f in self.frames if f.kind in P.FLOW_KINDS)

    async def get(self) -> P.Frame:
        while not self.frames:
            if self.error is not None:
                raise self.error
            self.ready.clear()
            await self.ready.wait()
        frame = self.frames.popleft()
        if frame.kind in P.FLOW_KINDS:
            grant = self.inflow.consume(frame.size)
            if grant and not self.ended:
                try:
                    self.client._write(P.Kind.WINDOW, self.cid, {"bytes": grant})
                except GuestError:
                    pass  # the read loop fails the channel
            self._stall_check()
        return frame

    async def send_frame(self, frame: bytes, stall_s: float | None = None) -> None:
        """Send a DATA or EOF frame once the guest's window has room for it, and wait
        until the stream's buffer is below its high-water mark (so a guest that grants
        window it does not read cannot make the host buffer without bound). With
        ``stall_s``, the guest must make room within that many seconds. Raises the
        channel's error once it has failed.
        """
        armed = stall_s is not None
        if armed:
            self.expect(stall_s)
        try:
            await self.outflow.take(len(frame))
            self.client._write_frame(frame)
            await self.client._drain()
        finally:
            if armed and not self.ended:
                self.expect(None)

    async def send_control(self, kind: P.Kind, meta: dict[str, Any]) -> None:
        """Send a control frame (SIGNAL), which flow control does not count, and wait
        until the stream's buffer is below its high-water mark, so repeated frames to a
        guest that does not read cannot make the host buffer. Raises the channel's
        error once it has failed.
        """
        if self.error is not None:
            raise self.error
        self.client._write(kind, self.cid, meta)
        await self.client._drain()

    def close(self) -> None:
        """The consumer is done: forget the channel; CANCEL it unless it ended."""
        if self.closed:
            return
        self.closed = True
        self._disarm()
        if not self.ended:
            self.ended = True
            self.outflow.fail(GuestError(f"{self.op} was cancelled"))
            self.client._forget(self, cancel=True)
        else:
            self.client._forget(self, cancel=False)

    # deadlines

    def expect(self, seconds: float | None) -> None:
        """The guest must end the call (or, with ``watch_stalls``, move) within ``seconds``."""
        self._disarm()
        if seconds is not None and not self.ended:
            self.timer = asyncio.get_running_loop().call_later(seconds, self._expire, seconds)

    def watch_stalls(self, seconds: float) -> None:
        """Whenever the guest has window to send, it must send within ``seconds``."""
        self.stall_s = seconds
        self.expect(seconds)

    def _stall_check(self) -> None:
        if self.stall_s is None or self.ended:
            return
        if self.inflow.window >= P.MAX_STREAM_FRAME:
            self.expect(self.stall_s)  # the guest can send: progress is due
        else:
            self._disarm()  # it waits for the host's consumer, not the other way round

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _expire(self, seconds: float) -> None:
        self.timer = None
        if self.ended:
            return
        self.fail(Timeout(f"the guest agent did not answer {self.op} within {seconds:g} s",
                          op=self.op, deadline_s=seconds), cancel=True)
        self.client._unanswered(self.op, seconds)


class Tunnel:
    """A TCP connection inside the guest, carried over the agent channel.

    Both directions are flow-controlled: ``write`` waits while the guest's
    window is full (its TCP peer reads slowly), and bytes the host has not
    ``read`` hold the guest back.
    """

    def __init__(self, client: AgentClient, ch: _Channel) -> None:
        self._client = client
        self._ch = ch
        self._eof = False
        self._closed = False

    async def read(self) -> bytes:
        """Next bytes from the guest; ``b""`` once the guest side has closed."""
        while not self._eof:
            try:
                frame = await self._ch.get()
            except HangarError:
                self._eof = True
                break
            if frame.kind == P.Kind.DATA and frame.data:
                return frame.data
            if frame.kind in (P.Kind.EOF, P.Kind.RESPONSE, P.Kind.ERROR):
                self._eof = True
        return b""

    async def write(self, data: bytes) -> None:
        """Send ``data`` to the guest's socket. Raises GuestError once the tunnel ended."""
        for i in range(0, len(data), P.CHUNK):
            await self._ch.send_frame(P.encode(P.Kind.DATA, self._ch.cid, {"stream": "socket"},
                                               data[i:i + P.CHUNK]))

    async def close(self) -> None:
        """Half-close towards the guest, then forget (and cancel) the channel."""
        if self._closed:
            return
        self._closed = True
        ch = self._ch
        if not ch.ended and not self._client.closed:
            eof = P.encode(P.Kind.EOF, ch.cid, {"stream": "socket"})
            if ch.outflow.available >= len(eof):
                ch.outflow.available -= len(eof)
                try:
                    self._client._write_frame(eof)
                except GuestError:
                    pass
        ch.close()


@dataclass
class PtyExit:
    """How a pty's program ended: ``exit_code`` is 128+N when signal N killed it."""

    exit_code: int | None
    signal: int | None = None
    duration_s: float = 0.0
    input_dropped: int = 0
    """Input bytes dropped because the program did not read them (see ``hangar.guest.terminal``)."""


class PtyChannel:
    """A program on a pseudo-terminal in the guest, carried over the agent channel.

    Flow control both ways: output that the host has not ``read`` holds the
    guest back (once the window is full the program blocks on its writes, as
    on a slow terminal), and ``write`` waits while the guest's window is
    full, i.e. while the program has not read the input before (the guest
    drops input that its program leaves unread for 5 s, so that wait is
    bounded). Like a tunnel, a terminal has no deadline while its program
    runs (30 s to start, in ``open_pty``); after ``hang_up`` the guest owes
    the end: it must make progress within ``deadlines.control_s`` whenever
    it can send, else the terminal ends with ``Timeout`` and the sandbox is
    reported (``on_unanswered``).
    """

    def __init__(self, client: AgentClient, ch: _Channel, pid: int) -> None:
        self._client = client
        self._ch = ch
        self._hung_up = False
        self.pid = pid
        """The program's process id in the guest."""
        self.exit: PtyExit | None = None
        """Set once the program has ended (``read`` returned ``b""``)."""
        self.error: HangarError | None = None
        """Why the terminal ended without an exit code (lost connection, Timeout...)."""

    async def read(self) -> bytes:
        """Next output bytes; ``b""`` once the terminal has ended (``exit`` is then set).

        A terminal that ends without its program's exit code (the agent
        connection was lost, the guest failed or missed a deadline) ends with
        ``exit_code`` None and ``error`` set; ``read`` itself does not raise.
        """
        while self.exit is None:
            try:
                frame = await self._ch.get()
            except HangarError as exc:
                self.error, self.exit = exc, PtyExit(None)
                break
            if frame.kind == P.Kind.DATA and frame.data:
                return frame.data
            if frame.kind == P.Kind.RESPONSE:
                m = frame.meta
                try:
                    self.exit = PtyExit(_int_or_none(m.get("exit_code")),
                                        _int_or_none(m.get("signal")),
                                        float(m.get("duration_s") or 0.0),
                                        int(m.get("input_dropped") or 0))
                except (TypeError, ValueError):
                    self.error = GuestError("the guest agent sent a malformed pty result")
                    self.exit = PtyExit(None)
            elif frame.kind == P.Kind.ERROR:
                try:
                    self._client._raise(frame)
                except HangarError as exc:
                    self.error, self.exit = exc, PtyExit(None)
        self._ch.close()
        return b""

    async def write(self, data: bytes) -> None:
        """Send input bytes to the program's terminal, as the guest's window allows.

        Input to a terminal that has ended or was hung up goes nowhere; a
        failure (a lost connection) ends the terminal, which ``read`` reports.
        """
        for i in range(0, len(data), P.CHUNK):
            if self._ch.ended or self._hung_up:
                return
            frame = P.encode(P.Kind.DATA, self._ch.cid, {"stream": "stdin"}, data[i:i + P.CHUNK])
            try:
                await self._ch.send_frame(frame)
            except HangarError:
                return

    async def _signal(self, meta: dict[str, Any]) -> None:
        if self._ch.ended or self._hung_up:
            return
        try:
            await self._ch.send_control(P.Kind.SIGNAL, meta)
        except HangarError:
            pass  # the terminal ended: ``read`` reports why

    async def resize(self, cols: int, rows: int) -> None:
        """Set the terminal's size in characters (the program gets SIGWINCH)."""
        await self._signal({"cols": cols, "rows": rows})

    async def kill(self, sig: int = 9) -> None:
        """Send signal ``sig`` to the program's process group."""
        await self._signal({"signal": sig})

    async def hang_up(self) -> None:
        """Hang up, as closing a terminal does: SIGHUP, then SIGKILL 2 s later.

        Never waits (a stuck guest cannot hold up the caller). The rest of the
        output and the exit code still come through ``read``; from now on the
        guest must make progress within ``deadlines.control_s`` whenever it
        can send, else the terminal ends with ``Timeout``.
        """
        if self._hung_up or self._ch.ended:
            return
        self._hung_up = True
        try:
            self._client._write(P.Kind.SIGNAL, self._ch.cid, {"hangup": True})
        except GuestError:
            return
        self._ch.watch_stalls(self._client.deadlines.control_s)

    async def close(self) -> None:
        """Forget the terminal; one still running is CANCELled, which the guest takes as a
        hang-up. Never waits."""
        self._ch.close()


class WatchChannel:
    """A file watch in the guest; ``next`` yields batches of events (dicts, see
    ``hangar.guest.watch``).

    Batches that the host has not taken hold the guest back (it stops
    reading inotify, whose kernel queue overflows instead). No deadline
    while the watch runs: a quiet path is no stuck guest.
    """

    def __init__(self, ch: _Channel, ready: dict[str, Any]) -> None:
        self._ch = ch
        self.path: str = str(ready.get("path", ""))
        dirs = ready.get("dirs")
        self.dirs: int = dirs if isinstance(dirs, int) else 0
        self.ended: str | None = None
        """Why the watch ended: ``deleted`` (the path went away), ``stopped`` (``close``),
        ``failed`` (the guest reported an error) or ``disconnected`` (the channel was lost:
        the connection, the agent, or the guest broke the protocol); None while it runs."""
        self.error: HangarError | None = None
        """The error behind ``failed`` and ``disconnected``."""

    async def next(self) -> list[dict[str, Any]] | None:
        """The next batch of events; None once the watch has ended (see ``ended``)."""
        while self.ended is None:
            try:
                frame = await self._ch.get()
            except HangarError as exc:
                self.error, self.ended = exc, "disconnected"
                break
            if frame.kind == P.Kind.DATA and isinstance(frame.meta.get("events"), list):
                return [e for e in frame.meta["events"] if isinstance(e, dict)]
            if frame.kind == P.Kind.RESPONSE:
                reason = frame.meta.get("reason")
                self.ended = reason if reason in ("deleted", "stopped") else "stopped"
            elif frame.kind == P.Kind.ERROR:
                try:
                    self._ch.client._raise(frame)
                except HangarError as exc:
                    self.error, self.ended = exc, "failed"
        self._ch.close()
        return None

    async def close(self) -> None:
        """Stop the watch (CANCEL in the guest) and forget the channel. Never waits."""
        self.ended = self.ended or "stopped"
        self._ch.close()
