"""Host side of the guest agent protocol (see ``hangar.guest.protocol``).

One ``AgentClient`` holds one connection to one guest's agent channel (a
Unix socket that the VMM exposes) and multiplexes any number of requests
over it. Every connection starts with ``AgentClient.handshake``: an engine
says only how to open its channel (an ``AgentChannel``: QEMU's virtio-serial
socket, Firecracker's vsock socket after ``CONNECT <port>``), and the
handshake retries, waits for the agent's greeting and checks its protocol
version. This module runs on the host; ``hangar.guest`` holds only what runs
in the guest. Agent error codes become ``hangar.errors`` classes:

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


_LOST = P.Frame(P.Kind.ERROR, 0, {"code": "disconnected", "message": "agent connection lost"},
                b"", P.VERSION)


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


def _result(frame: P.Frame) -> ExecResult:
    meta = frame.meta
    stdout, rest = StreamCapture.from_frame(meta.get("stdout", {}), memoryview(frame.data))
    stderr, _ = StreamCapture.from_frame(meta.get("stderr", {}), rest)
    return ExecResult(
        exit_code=meta.get("exit_code"),
        signal=meta.get("signal"),
        timed_out=bool(meta.get("timed_out")),
        duration_s=float(meta.get("duration_s", 0.0)),
        stdout=stdout,
        stderr=stderr,
    )


class AgentClient:
    """A connection to one guest agent; safe for concurrent use within one event loop."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 hello: dict[str, Any]) -> None:
        self._reader = reader
        self._writer = writer
        self.hello = hello
        self._ids = itertools.count(1)
        self._channels: dict[int, asyncio.Queue[P.Frame]] = {}
        self._write_lock = asyncio.Lock()
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
                    q = self._channels.get(frame.channel)
                    if q is not None:
                        q.put_nowait(frame)
        except (ConnectionError, OSError):
            pass
        finally:
            self._closed = True
            for q in self._channels.values():
                q.put_nowait(_LOST)

    @property
    def closed(self) -> bool:
        return self._closed

    async def _send(self, kind: P.Kind, channel: int, meta: dict[str, Any] | None = None,
                    data: bytes = b"") -> None:
        if self._closed:
            raise GuestError("agent connection lost")
        async with self._write_lock:
            try:
                self._writer.write(P.encode(kind, channel, meta, data))
                await self._writer.drain()
            except (ConnectionError, OSError) as exc:
                raise GuestError(f"agent connection lost: {exc}") from None

    def _open(self) -> tuple[int, asyncio.Queue[P.Frame]]:
        cid = next(self._ids) & 0xFFFFFFFF or next(self._ids)
        q: asyncio.Queue[P.Frame] = asyncio.Queue()
        self._channels[cid] = q
        return cid, q

    @staticmethod
    def _raise(frame: P.Frame) -> None:
        code = frame.meta.get("code", "internal")
        message = frame.meta.get("message", "guest agent error")
        raise ERRORS.get(code, GuestError)(message, guest_code=code)

    async def _send_stream(self, cid: int, stream: str, chunks: Iterable[bytes] | AsyncIterator[bytes]) -> None:
        if hasattr(chunks, "__aiter__"):
            async for chunk in chunks:  # type: ignore[union-attr]
                for i in range(0, len(chunk), P.CHUNK):
                    await self._send(P.Kind.DATA, cid, {"stream": stream}, chunk[i:i + P.CHUNK])
        else:
            for chunk in chunks:  # type: ignore[union-attr]
                for i in range(0, len(chunk), P.CHUNK):
                    await self._send(P.Kind.DATA, cid, {"stream": stream}, chunk[i:i + P.CHUNK])
        await self._send(P.Kind.EOF, cid, {"stream": stream})

    async def call(self, op: str, **meta: Any) -> dict[str, Any]:
        """One request without data streams; returns the RESPONSE meta."""
        cid, q = self._open()
        try:
            await self._send(P.Kind.REQUEST, cid, {"op": op, **meta})
            while True:
                frame = await q.get()
                if frame.kind == P.Kind.RESPONSE:
                    return frame.meta
                if frame.kind == P.Kind.ERROR:
                    self._raise(frame)
        finally:
            self._channels.pop(cid, None)

    # -- operations --------------------------------------------------------

    async def exec_stream(self, meta: dict[str, Any], stdin: bytes | None = None,
                          ) -> AsyncIterator[ExecEvent]:
        """Run a command (``meta`` from ``exec_meta``) and yield its events.

        Yields ``stdout``/``stderr`` events as output arrives when
        ``meta["stream"]`` is true, then one ``exit`` event. Closing the
        iterator early kills the command's process group.
        """
        cid, q = self._open()
        finished = False
        try:
            meta = {**meta, "stdin": stdin is not None}
            await self._send(P.Kind.REQUEST, cid, meta)
            if stdin is not None:
                await self._send_stream(cid, "stdin", [stdin] if stdin else [])
            while True:
                frame = await q.get()
                if frame.kind == P.Kind.DATA:
                    yield ExecEvent(frame.meta.get("stream", "stdout"), frame.data)
                elif frame.kind == P.Kind.RESPONSE:
                    finished = True
                    yield ExecEvent("exit", result=_result(frame))
                    return
                elif frame.kind == P.Kind.ERROR:
                    finished = True
                    self._raise(frame)
        finally:
            if not finished and not self._closed:
                try:
                    await self._send(P.Kind.SIGNAL, cid, {"signal": 9})
                except GuestError:
                    pass
            self._channels.pop(cid, None)

    async def exec(self, meta: dict[str, Any], stdin: bytes | None = None) -> ExecResult:
        """Run a command to completion; returns its captured result."""
        result: ExecResult | None = None
        async for ev in self.exec_stream({**meta, "stream": False}, stdin):
            if ev.kind == "exit":
                result = ev.result
        assert result is not None
        return result

    async def read_file(self, path: str) -> AsyncIterator[bytes]:
        """Yield a guest file's bytes in chunks. Raises NotFound, InvalidRequest."""
        cid, q = self._open()
        try:
            await self._send(P.Kind.REQUEST, cid, {"op": "read_file", "path": path})
            while True:
                frame = await q.get()
                if frame.kind == P.Kind.DATA:
                    yield frame.data
                elif frame.kind == P.Kind.RESPONSE:
                    return
                elif frame.kind == P.Kind.ERROR:
                    self._raise(frame)
        finally:
            self._channels.pop(cid, None)

    async def write_file(self, path: str, chunks: Iterable[bytes] | AsyncIterator[bytes],
                         mode: int = 0o644) -> dict[str, Any]:
        """Write a guest file atomically from byte chunks; returns ``{path, size}``."""
        cid, q = self._open()
        try:
            await self._send(P.Kind.REQUEST, cid, {"op": "write_file", "path": path, "mode": mode})
            failure: list[BaseException] = []

            async def send() -> None:
                try:
                    await self._send_stream(cid, "file", chunks)
                except Exception as exc:  # the source failed: tell the guest, then the caller
                    failure.append(exc)
                    if not self._closed:
                        await self._send(P.Kind.SIGNAL, cid, {"abort": True})

            sender = asyncio.create_task(send())
            try:
                while True:
                    frame = await q.get()
                    if frame.kind == P.Kind.RESPONSE:
                        return frame.meta
                    if frame.kind == P.Kind.ERROR:
                        if failure:
                            raise failure[0]
                        self._raise(frame)
            finally:
                if not sender.done():
                    sender.cancel()
                    if not self._closed:
                        try:
                            await self._send(P.Kind.SIGNAL, cid, {"abort": True})
                        except GuestError:
                            pass
        finally:
            self._channels.pop(cid, None)

    async def open_tunnel(self, port: int, host: str = "127.0.0.1") -> "Tunnel":
        """Open a byte tunnel to ``host:port`` inside the guest.

        Raises NotFound when nothing listens there.
        """
        cid, q = self._open()
        await self._send(P.Kind.REQUEST, cid, {"op": "connect", "port": port, "host": host})
        while True:
            frame = await q.get()
            if frame.kind == P.Kind.DATA and frame.meta.get("connected"):
                return Tunnel(self, cid, q)
            if frame.kind == P.Kind.ERROR:
                self._channels.pop(cid, None)
                self._raise(frame)

    async def open_pty(self, meta: dict[str, Any]) -> "PtyChannel":
        """Start a program on a pseudo-terminal in the guest (``hangar.guest.terminal``).

        ``meta`` holds ``argv`` or ``shell`` (neither: a login shell), ``env``,
        ``cwd``, ``cols``, ``rows``. Returns once the program runs. Raises
        InvalidRequest (bad input, a program that cannot start), GuestError.
        """
        cid, q = self._open()
        try:
            await self._send(P.Kind.REQUEST, cid, {**meta, "op": "pty"})
            while True:
                frame = await q.get()
                if frame.kind == P.Kind.DATA and frame.meta.get("started"):
                    return PtyChannel(self, cid, q, int(frame.meta.get("pid") or 0))
                if frame.kind == P.Kind.ERROR:
                    self._raise(frame)
        except BaseException:
            self._channels.pop(cid, None)
            raise

    async def open_watch(self, path: str, recursive: bool) -> "WatchChannel":
        """Watch ``path`` in the guest for file changes (``hangar.guest.watch``).

        Returns once the watch is in place. Raises NotFound (no such path),
        InvalidRequest (too many folders, a bad path), GuestError.
        """
        cid, q = self._open()
        try:
            await self._send(P.Kind.REQUEST, cid, {"op": "watch", "path": path,
                                                   "recursive": recursive})
            while True:
                frame = await q.get()
                if frame.kind == P.Kind.DATA and frame.meta.get("ready"):
                    return WatchChannel(self, cid, q, frame.meta)
                if frame.kind == P.Kind.ERROR:
                    self._raise(frame)
        except BaseException:
            self._channels.pop(cid, None)
            raise

    async def close(self) -> None:
        self._closed = True
        self._pump.cancel()
        try:
            self._writer.close()
        except Exception:
            pass


class Tunnel:
    """A TCP connection inside the guest, carried over the agent channel."""

    def __init__(self, client: AgentClient, cid: int, q: asyncio.Queue[P.Frame]) -> None:
        self._client = client
        self._cid = cid
        self._q = q
        self._eof = False
        self._closed = False

    async def read(self) -> bytes:
        """Next bytes from the guest; ``b""`` once the guest side has closed."""
        while not self._eof:
            frame = await self._q.get()
            if frame.kind == P.Kind.DATA and frame.data:
                return frame.data
            if frame.kind in (P.Kind.EOF, P.Kind.RESPONSE, P.Kind.ERROR):
                self._eof = True
        return b""

    async def write(self, data: bytes) -> None:
        for i in range(0, len(data), P.CHUNK):
            await self._client._send(P.Kind.DATA, self._cid, {"stream": "socket"},
                                     data[i:i + P.CHUNK])

    async def close(self) -> None:
        """Half-close towards the guest and forget the channel."""
        if self._closed:
            return
        self._closed = True
        if not self._client.closed:
            try:
                await self._client._send(P.Kind.EOF, self._cid, {"stream": "socket"})
            except GuestError:
                pass
        self._client._channels.pop(self._cid, None)


@dataclass
class PtyExit:
    """How a pty's program ended: ``exit_code`` is 128+N when signal N killed it."""

    exit_code: int | None
    signal: int | None = None
    duration_s: float = 0.0
    input_dropped: int = 0
    """Input bytes dropped because the program did not read them (see ``hangar.guest.terminal``)."""


class PtyChannel:
    """A program on a pseudo-terminal in the guest, carried over the agent channel."""

    def __init__(self, client: AgentClient, cid: int, q: asyncio.Queue[P.Frame],
                 pid: int) -> None:
        self._client = client
        self._cid = cid
        self._q = q
        self.pid = pid
        """The program's process id in the guest."""
        self.exit: PtyExit | None = None
        """Set once the program has ended (``read`` returned ``b""``)."""

    async def read(self) -> bytes:
        """Next output bytes; ``b""`` once the program has ended (``exit`` is then set).

        A lost agent connection ends it with ``exit_code`` None.
        """
        while self.exit is None:
            frame = await self._q.get()
            if frame.kind == P.Kind.DATA and frame.data:
                return frame.data
            if frame.kind == P.Kind.RESPONSE:
                m = frame.meta
                self.exit = PtyExit(m.get("exit_code"), m.get("signal"),
                                    float(m.get("duration_s") or 0.0),
                                    int(m.get("input_dropped") or 0))
            elif frame.kind == P.Kind.ERROR:
                self.exit = PtyExit(None)
        self._client._channels.pop(self._cid, None)
        return b""

    async def _signal(self, meta: dict[str, Any]) -> None:
        if self.exit is None and not self._client.closed:
            try:
                await self._client._send(P.Kind.SIGNAL, self._cid, meta)
            except GuestError:
                pass

    async def write(self, data: bytes) -> None:
        """Send input bytes to the program's terminal."""
        for i in range(0, len(data), P.CHUNK):
            if self.exit is not None:
                return
            await self._client._send(P.Kind.DATA, self._cid, {"stream": "stdin"},
                                     data[i:i + P.CHUNK])

    async def resize(self, cols: int, rows: int) -> None:
        """Set the terminal's size in characters (the program gets SIGWINCH)."""
        await self._signal({"cols": cols, "rows": rows})

    async def kill(self, sig: int = 9) -> None:
        """Send signal ``sig`` to the program's process group."""
        await self._signal({"signal": sig})

    async def hang_up(self) -> None:
        """Hang up, as closing a terminal does: SIGHUP, then SIGKILL after 2 s."""
        if self.exit is None and not self._client.closed:
            try:
                await self._client._send(P.Kind.EOF, self._cid, {"stream": "stdin"})
            except GuestError:
                pass


class WatchChannel:
    """A file watch in the guest; ``next`` yields batches of events (dicts, see
    ``hangar.guest.watch``)."""

    def __init__(self, client: AgentClient, cid: int, q: asyncio.Queue[P.Frame],
                 ready: dict[str, Any]) -> None:
        self._client = client
        self._cid = cid
        self._q = q
        self.path: str = str(ready.get("path", ""))
        self.dirs: int = int(ready.get("dirs") or 0)
        self.ended: str | None = None
        """Why the watch ended: ``deleted`` (the path went away), ``stopped`` or
        ``disconnected``; None while it runs."""

    async def next(self) -> list[dict[str, Any]] | None:
        """The next batch of events; None once the watch has ended."""
        while self.ended is None:
            frame = await self._q.get()
            if frame.kind == P.Kind.DATA and isinstance(frame.meta.get("events"), list):
                return [e for e in frame.meta["events"] if isinstance(e, dict)]
            if frame.kind == P.Kind.RESPONSE:
                self.ended = str(frame.meta.get("reason", "stopped"))
            elif frame.kind == P.Kind.ERROR:
                self.ended = "disconnected"
        self._client._channels.pop(self._cid, None)
        return None

    async def close(self) -> None:
        """Stop the watch in the guest and forget the channel."""
        if self.ended is None and not self._client.closed:
            try:
                await self._client._send(P.Kind.SIGNAL, self._cid, {"stop": True})
            except GuestError:
                pass
        self.ended = self.ended or "stopped"
        self._client._channels.pop(self._cid, None)
