"""A host connection of the guest agent and the requests it opened (standard library only).

``Session`` is one host connection: its writer and its open channels.
``Channel`` is one request on it: its inbound frames and its flow-control
window in each direction (``hangar.guest.protocol``: ``Outflow``,
``Inflow``). The agent (``hangar.guest.agent``) makes them; its
operations, ``hangar.guest.terminal`` and ``hangar.guest.watch`` among
them, talk to the host through a ``Channel`` only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from hangar.guest import protocol as P


class Session:
    """One host connection: its writer and the channels (requests) it opened.

    Frames go out whole (``write`` serialises them); ``write_now`` writes a
    small control frame without waiting. Once the connection ends
    (``close``) nothing more is written: a later host connection never sees
    frames of this one's channels.
    """

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.channels: dict[int, Channel] = {}
        end = writer.get_extra_info("socket") or writer.get_extra_info("pipe")
        self.input_fd: int | None = end.fileno() if end is not None else None
        """An fd of the connection that polls readable when the host has sent more (the
        socket, or the virtio-serial port, whose write end is the same open file)."""
        self.lock = asyncio.Lock()
        self.open = True

    async def write(self, frame: bytes) -> None:
        if not self.open:
            return
        async with self.lock:
            try:
                self.writer.write(frame)
                await self.writer.drain()
            except (ConnectionError, OSError, RuntimeError):
                pass

    async def send(self, kind: P.Kind, channel: int, meta: dict[str, Any] | None = None,
                   data: bytes = b"") -> None:
        await self.write(P.encode(kind, channel, meta, data))

    def write_now(self, kind: P.Kind, channel: int, meta: dict[str, Any]) -> None:
        self.put(P.encode(kind, channel, meta))

    def put(self, frame: bytes) -> None:
        """Write a whole small frame now, without waiting for the lock or a drain (frames
        stay whole: ``write`` puts each of its own in one call too)."""
        if not self.open:
            return
        try:
            self.writer.write(frame)
        except (ConnectionError, OSError, RuntimeError):
            pass

    def close(self) -> None:
        """The host went away: cancel every request of this connection."""
        self.open = False
        for ch in list(self.channels.values()):
            ch.outflow.fail(None)  # nothing waits on a window that will never grow
            if ch.task is not None:
                ch.task.cancel()


class Channel:
    """One open request: its inbound frames and its window in each direction.

    ``get`` takes the next inbound frame and grants the host more window as
    frames are taken (or, with ``ack=False``, once the consumer says it is
    done with them: ``ack``); ``stream`` sends a DATA or EOF frame once the
    host's window has room for it (see ``hangar.guest.protocol``); ``send``
    sends any other frame. ``afterwards``: what the operation leaves for after its
    RESPONSE or ERROR is out (the agent runs it then, whatever the end: work the host
    need not wait for).
    """

    def __init__(self, session: Session, cid: int) -> None:
        self.session = session
        self.cid = cid
        self.inbox: asyncio.Queue[P.Frame] = asyncio.Queue()
        self.outflow = P.Outflow()
        self.inflow = P.Inflow()
        self.task: asyncio.Task[None] | None = None
        self.afterwards: list[Callable[[], object]] = []
        self.listener: Callable[[P.Frame], None] | None = None

    def listen(self, listener: Callable[[P.Frame], None]) -> None:
        """Hand every inbound frame from now on to ``listener`` as it arrives, instead of
        queueing it for ``get`` (an operation that needs no task to read its frames)."""
        self.listener = listener
        while not self.inbox.empty():
            listener(self.inbox.get_nowait())

    async def get(self, ack: bool = True) -> P.Frame:
        frame = await self.inbox.get()
        if ack and frame.kind in P.FLOW_KINDS:
            self.ack(frame.size)
        return frame

    def ack(self, size: int) -> None:
        """The consumer is done with ``size`` bytes of DATA and EOF frames (``Frame.size``)
        taken with ``get(ack=False)``: grant them back to the host."""
        grant = self.inflow.consume(size)
        if grant:
            self.session.write_now(P.Kind.WINDOW, self.cid, {"bytes": grant})

    async def stream(self, meta: dict[str, Any], data: bytes = b"",
                     kind: P.Kind = P.Kind.DATA) -> None:
        frame = P.encode(kind, self.cid, meta, data)
        await self.outflow.take(len(frame))
        await self.session.write(frame)

    def stream_now(self, meta: dict[str, Any]) -> bool:
        """Send a DATA frame of ``meta`` alone at once, without a turn of the event loop:
        True when it went out, False (nothing sent) when the window has no room for it
        now or a ``stream`` waits for room; then send it with ``stream``."""
        frame = P.encode(P.Kind.DATA, self.cid, meta)
        if not self.session.open or not self.outflow.take_now(len(frame)):
            return False
        self.session.put(frame)
        return True

    async def send(self, kind: P.Kind, meta: dict[str, Any] | None = None,
                   data: bytes = b"") -> None:
        await self.session.send(kind, self.cid, meta, data)
