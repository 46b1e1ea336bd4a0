"""``AgentClient``: the guest agent's calls on one connection, those that carry streams too.

``Connection`` (``connection``) gives the handshake and ``call``, on which
the typed plain calls stand: on files (``FileCalls``, ``files``: stat,
list_dir, mkdir, remove) and on the machine (``MachineCalls``, ``machine``:
ping, set_time, reseed, set_identity); ``AgentClient`` adds the
calls that move bytes or live on: an exec (its output as ``ExecEvent`` events,
or its ``ExecResult``), a file read or write, and the long-lived channels
opened through ``_open_long``, whose handles live in ``streams``: a tunnel
(``Tunnel``), a terminal (``PtyChannel``), a file watch (``WatchChannel``);
and the calls on processes that outlive their connection (start, list,
attach, input, signal, resize, remove; their answers in ``processes``).

Each call keeps to its ``Deadlines``; a consumer that gives up (an iterator
closed early, an HTTP client gone) CANCELs the call in the guest: an exec's
process group is killed, a file or socket closed, a terminal hung up, a
watch stopped.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from typing import Any

from hangar.engines.agent_client.channel import Channel
from hangar.engines.agent_client.files import FileCalls
from hangar.engines.agent_client.machine import MachineCalls
from hangar.engines.agent_client.processes import (
    PROCS_EVERY, ProcessStream, ProcInfo, ProcSignalled, checked_info, proc_signalled,
)
from hangar.engines.agent_client.results import (
    OWN_HEAD, OWN_TAIL, CaptureTooLong, ExecEvent, ExecResult, exec_result,
)
from hangar.engines.agent_client.streams import PtyChannel, Tunnel, WatchChannel
from hangar.errors import GuestError, HangarError
from hangar.guest import protocol as P
from hangar.turns import mapped


class _SourceFailed(Exception):
    """A HangarError raised by the chunks of a write (not by its channel), carried past the
    channel's own error handling to the caller as it is."""

    def __init__(self, error: HangarError) -> None:
        super().__init__(error.message)
        self.error = error


async def _source(chunks: Iterable[bytes] | AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    try:
        if hasattr(chunks, "__aiter__"):
            async for chunk in chunks:
                yield chunk
        else:
            for chunk in chunks:
                yield chunk
    except HangarError as exc:
        raise _SourceFailed(exc) from None


class AgentClient(FileCalls, MachineCalls):
    """A connection to one guest agent with all its calls, one typed method per guest
    operation; safe for concurrent use within one event loop. Made by
    ``AgentClient.handshake`` (see ``Connection``)."""

    async def _send_stream(self, ch: Channel, stream: str,
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
            async for chunk in chunks:
                for i in range(0, len(chunk), P.CHUNK):
                    await piece(P.Kind.DATA, chunk[i:i + P.CHUNK])
                sent += len(chunk)
        else:
            for chunk in chunks:
                for i in range(0, len(chunk), P.CHUNK):
                    await piece(P.Kind.DATA, chunk[i:i + P.CHUNK])
                sent += len(chunk)
        await piece(P.Kind.EOF)
        return sent


    def _check_user(self, meta: dict[str, Any]) -> None:
        """GuestError for a request naming a ``user`` (``exec_meta``, ``proc_meta``) to an
        agent whose HELLO does not say ``users``: one older than this host, which would run
        the command as root (a sandbox saved before an upgrade)."""
        if meta.get("user") is not None and not self.hello.get("users"):
            raise GuestError("this sandbox's guest agent is older than the server and runs "
                             f"no command as {str(meta['user'])[:40]!r} (a sandbox started "
                             "by this version does)")

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

        A command without ``head`` or ``tail`` keeps ``OWN_HEAD`` and ``OWN_TAIL``
        bytes of each stream; an answer with more than the request asked for
        (``head + tail`` per stream; nothing in a streamed exec's result) raises
        GuestError, unread.
        """
        self._check_user(meta)
        timeout = meta.get("timeout")
        if timeout is None:
            timeout = self.deadlines.exec_max_s
        head = int(meta["head"] if meta.get("head") is not None else OWN_HEAD)
        tail = int(meta["tail"] if meta.get("tail") is not None else OWN_TAIL)
        meta = {**meta, "timeout": timeout, "stdin": stdin is not None, "head": head,
                "tail": tail}
        if meta.get("stream"):
            head = tail = 0  # the output comes as DATA; the result carries counts only
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
                        result = exec_result(frame, head, tail)
                    except CaptureTooLong as exc:
                        raise GuestError("the guest agent answered an exec with more output "
                                         f"than was asked for: {exc}") from None
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
                    size = await self._send_stream(ch, "file", _source(chunks),
                                                   self.deadlines.stall_s)
                except _SourceFailed as exc:  # e.g. TooLarge from an upload's decoder
                    ch.fail(exc.error, cancel=True)
                    return
                except HangarError:
                    return  # the channel failed: the reader below raises why
                except Exception as exc:  # the source failed: cancel, then tell the caller
                    ch.fail(exc, cancel=True)
                    return
                ch.expect(self.deadlines.control_s + size / self.deadlines.write_rate)

            sender = _background(send())
            try:
                return await self._response(ch)
            finally:
                sender.cancel()
        finally:
            ch.close()

    async def open_tunnel(self, port: int, host: str = "127.0.0.1") -> Tunnel:
        """Open a byte tunnel to ``host:port`` inside the guest.

        The guest must connect (or refuse) within ``deadlines.control_s``;
        an open tunnel has no deadline (its two ends decide when it ends).
        Raises NotFound when nothing listens there.
        """
        ch, _ = await self._open_long(
            {"op": "connect", "port": port, "host": host}, "connected",
            "the guest ended the tunnel before it was open")
        return Tunnel(self, ch)

    async def open_pty(self, meta: dict[str, Any]) -> PtyChannel:
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

    async def open_watch(self, path: str, recursive: bool) -> WatchChannel:
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

    # -- processes that outlive their connection (``processes``) --------------

    async def start_process(self, meta: dict[str, Any]) -> ProcInfo:
        """Start a process that outlives this connection (``meta`` from ``proc_meta``);
        its entry. Raises InvalidRequest (bad input, a program that cannot start),
        Conflict (a running process has its tag), LimitExceeded (the guest's table is
        full of running processes), Timeout, GuestError."""
        self._check_user(meta)
        return checked_info(await self._plain({**meta, "op": "proc_start", "attach": False}))

    async def start_process_attached(self, meta: dict[str, Any]) -> ProcessStream:
        """``start_process``, its output streamed from its first byte (``ProcessStream``);
        closing the stream detaches, the process runs on."""
        self._check_user(meta)
        ch, frame = await self._open_long({**meta, "op": "proc_start", "attach": True},
                                          "started", "the guest ended the process stream "
                                          "before it started")
        return ProcessStream(self, ch, _frame_info(ch, frame))

    async def list_processes(self) -> list[ProcInfo]:
        """The guest's table, oldest first (at most 64 entries; a hostile guest's, up to
        1,024 of up to 256 arguments each, read ``PROCS_EVERY`` at a time with turns of
        the loop between)."""
        meta = await self._plain({"op": "proc_list"})
        entries = meta.get("processes")
        if not isinstance(entries, list):
            raise GuestError("the guest agent sent a malformed process list")
        return await mapped(lambda e: checked_info(e if isinstance(e, dict) else {}),
                            entries[:1024], PROCS_EVERY)

    async def attach_process(self, pid: int | None = None, tag: str | None = None, *,
                             replay: bool = False, follow: bool = False) -> ProcessStream:
        """Attach to a process by ``pid`` (else ``tag``): its output from now on
        (``replay``: what its 1 MiB ring holds first) until it ends (``follow``: until its
        output ends, which a program it left behind may hold open). Raises NotFound."""
        ch, frame = await self._open_long(
            {"op": "proc_attach", **_selector(pid, tag), "replay": replay, "follow": follow},
            "attached", "the guest ended the process stream before it attached")
        return ProcessStream(self, ch, _frame_info(ch, frame))

    async def send_process_input(self, data: bytes, pid: int | None = None,
                                 tag: str | None = None) -> int:
        """Write ``data`` to a process's stdin or terminal, in order; bytes written.
        Raises NotFound, Conflict (its input is closed), Busy (it read none of it for
        5 s), Timeout, GuestError."""
        ch = self._open("proc_input")
        try:
            self._write(P.Kind.REQUEST, ch.cid, {"op": "proc_input", **_selector(pid, tag)})

            async def send() -> None:
                try:
                    await self._send_stream(ch, "stdin", [data] if data else [],
                                            self.deadlines.stall_s)
                except HangarError:
                    return  # the channel failed or ended: the reader below says why
                ch.expect(self.deadlines.control_s)

            sender = _background(send())
            try:
                while True:
                    frame = await ch.get()
                    if frame.kind == P.Kind.RESPONSE:
                        written = frame.meta.get("written")
                        return written if isinstance(written, int) else 0
                    if frame.kind == P.Kind.ERROR:
                        self._raise(frame)
            finally:
                sender.cancel()
        finally:
            ch.close()

    async def close_process_stdin(self, pid: int | None = None,
                                  tag: str | None = None) -> ProcInfo:
        """Close a process's stdin (it reads EOF). Raises NotFound, InvalidRequest (a
        terminal: send Ctrl-D, byte 4)."""
        return checked_info(await self._plain({"op": "proc_close_stdin",
                                               **_selector(pid, tag)}))

    async def signal_process(self, sig: int, pid: int | None = None,
                             tag: str | None = None) -> ProcSignalled:
        """Send signal ``sig`` (1..64) to a process's group; whether any of it was left to
        get it, and the process's status. Raises NotFound, InvalidRequest."""
        meta = await self._plain({"op": "proc_signal", **_selector(pid, tag), "signal": sig})
        try:
            return proc_signalled(meta)
        except (TypeError, ValueError):
            raise GuestError("the guest agent sent a malformed signal answer") from None

    async def resize_process(self, cols: int, rows: int, pid: int | None = None,
                             tag: str | None = None) -> ProcInfo:
        """Set a terminal process's size in characters. Raises NotFound, InvalidRequest
        (not a terminal, a size outside 1..1000)."""
        return checked_info(await self._plain({"op": "proc_resize", **_selector(pid, tag),
                                               "cols": cols, "rows": rows}))

    async def remove_process(self, pid: int | None = None,
                             tag: str | None = None) -> ProcInfo:
        """Kill a process's group (SIGKILL) if it runs, wait for its exit (at most 5 s)
        and forget it; its last entry. Raises NotFound."""
        return checked_info(await self._plain({"op": "proc_remove", **_selector(pid, tag)},
                                              self.deadlines.control_s + 5.0))

    async def _plain(self, meta: dict[str, Any],
                     deadline_s: float | None = None) -> dict[str, Any]:
        """``call`` with a request whose meta names its ``op``."""
        rest = dict(meta)
        op = rest.pop("op")
        return await self.call(op, deadline_s=deadline_s, **rest)

    async def _open_long(self, meta: dict[str, Any], flag: str,
                         ended: str) -> tuple[Channel, P.Frame]:
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


def _selector(pid: int | None, tag: str | None) -> dict[str, Any]:
    """A process named by ``pid``, else ``tag``; ValueError for neither."""
    if pid is not None:
        return {"pid": pid}
    if tag is not None:
        return {"tag": tag}
    raise ValueError("name the process by pid or tag")


def _frame_info(ch: Channel, frame: P.Frame) -> ProcInfo:
    """The entry a stream's first frame carries; the channel closed when it is malformed."""
    try:
        return checked_info(frame.meta)
    except GuestError:
        ch.close()
        raise


def _background(coro: Any) -> asyncio.Task[Any]:
    """A task whose failure nobody awaits is not reported as never retrieved."""
    task: asyncio.Task[Any] = asyncio.ensure_future(coro)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return task
