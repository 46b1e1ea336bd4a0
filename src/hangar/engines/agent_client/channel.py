"""One flow-controlled channel of an agent connection: one call's frames, windows and deadline.

Flow control (protocol version 2, ``hangar.guest.protocol``): per channel,
the guest may have at most ``WINDOW`` bytes of DATA and EOF frames that the
host's consumer has not taken; the host grants more as it takes them
(``Channel.get``). A guest that sends more loses the call (``GuestError``),
and the frames are not kept. So per call the host holds at most ``WINDOW``
plus one final frame, whatever the guest does and however slowly the HTTP
client reads, and a slow consumer never holds up another channel. The
host's own DATA to the guest keeps to the guest's window too and waits for
the stream to drain (``send_frame``; a terminal's SIGNALs wait for the
drain too, ``send_control``).

Deadlines: ``expect`` arms one, ``watch_stalls`` re-arms it whenever the
guest may send. At the deadline the call fails with ``Timeout`` (504), the
guest is told to CANCEL it, and ``Connection.on_unanswered`` hears of it.
A consumer that gives up ``close``s the channel, which CANCELs the call in
the guest unless it had ended.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING, Any

from hangar.errors import GuestError, Timeout
from hangar.guest import protocol as P

if TYPE_CHECKING:
    from hangar.engines.agent_client.connection import Connection

EAGER_TURN = 64
"""Frames a consumer takes back to back, none awaited, before ``Channel.get`` gives the loop
a turn: a guest's window (1 MiB) holds 28,000 frames of one byte, whose handling without a
turn held the loop 1.2 s (review 29i I-H2)."""


class Channel:
    """One open request: frames the guest sent, both windows, the deadline.

    The read loop ``deliver``s frames: a DATA or EOF frame beyond what the
    host granted fails the channel (a guest that breaks flow control is not
    buffered for); WINDOW frames open the host's own window; anything after
    the final frame is ignored. The consumer ``get``s them in order and the
    host grants the guest more window as it does. ``expect`` arms the
    deadline, ``watch_stalls`` re-arms it whenever the guest may send;
    at the deadline the call fails with ``Timeout``, the guest is told to
    CANCEL, and ``Connection.on_unanswered`` hears of it.
    """

    def __init__(self, client: Connection, cid: int, op: str) -> None:
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
        self._eager = 0  # frames taken without waiting since the last wait or turn

    # the read loop's side

    def deliver(self, frame: P.Frame) -> None:
        """Take one frame the guest sent on this channel (called by the read loop)."""
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
        """The next frame, in order, once one came; grants the guest the window it frees.
        Raises the channel's error (``GuestError``, ``Timeout``) once the frames that came
        before it are taken."""
        if not self.frames:
            self._eager = 0
        while not self.frames:
            if self.error is not None:
                raise self.error
            self.ready.clear()
            await self.ready.wait()
        self._eager += 1
        if self._eager >= EAGER_TURN:  # frames taken back to back: a turn for the others
            self._eager = 0
            await asyncio.sleep(0)
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
