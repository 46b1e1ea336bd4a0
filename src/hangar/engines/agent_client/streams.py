"""Handles of the long-lived channels: a tunnel, a terminal, a file watch.

``AgentClient`` (``client``) opens them (``open_tunnel``, ``open_pty``,
``open_watch``) and hands each its ``Channel``; from then on the handle
alone reads and writes it. None has a deadline while it runs (its two ends
decide when it ends); each keeps to the channel's windows both ways, and
``close`` never waits: it forgets the channel and CANCELs it in the guest
(a tunnel's socket is closed, a terminal hung up, a watch stopped).
"""

from __future__ import annotations

from typing import Any

from hangar.engines.agent_client.channel import Channel
from hangar.engines.agent_client.connection import Connection
from hangar.engines.agent_client.results import PtyExit, pty_exit
from hangar.errors import GuestError, HangarError
from hangar.guest import protocol as P


class Tunnel:
    """A TCP connection inside the guest, carried over the agent channel.

    Both directions are flow-controlled: ``write`` waits while the guest's
    window is full (its TCP peer reads slowly), and bytes the host has not
    ``read`` hold the guest back.
    """

    def __init__(self, client: Connection, ch: Channel) -> None:
        self._client = client
        self._ch = ch
        self._eof = False
        self._closed = False
        self.lost: HangarError | None = None
        """Why the tunnel ended without the guest closing its socket (the agent connection
        was lost: the sandbox was deleted or its VM ended), once ``read`` returned ``b""``
        for that reason; None while it runs or after the guest's own close. An answer
        delimited by its connection's close is whole only when this is None."""

    async def read(self) -> bytes:
        """Next bytes from the guest, those of every DATA frame already come joined (up to
        ``P.CHUNK`` or so: a guest's frames of one byte each cost one read each otherwise);
        ``b""`` once the guest side has closed, or the tunnel was lost (``lost``)."""
        while not self._eof:
            try:
                frame = await self._ch.get()
            except HangarError as exc:
                self._eof, self.lost = True, exc
                break
            if frame.kind == P.Kind.DATA and frame.data:
                return await self._more(frame.data)
            if frame.kind in (P.Kind.EOF, P.Kind.RESPONSE, P.Kind.ERROR):
                self._eof = True
        return b""

    async def _more(self, first: bytes) -> bytes:
        """``first`` and the data of the DATA frames queued right after it."""
        queued = self._ch.frames
        if not queued or queued[0].kind != P.Kind.DATA:
            return first
        out = bytearray(first)
        while len(out) < P.CHUNK and queued and queued[0].kind == P.Kind.DATA:
            out += (await self._ch.get()).data
        return bytes(out)

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

    def __init__(self, client: Connection, ch: Channel, pid: int) -> None:
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
                try:
                    self.exit = pty_exit(frame.meta)
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

    def __init__(self, ch: Channel, ready: dict[str, Any]) -> None:
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
