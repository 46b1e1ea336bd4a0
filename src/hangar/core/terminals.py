"""Terminal sessions: programs on a pseudo-terminal in a guest, outliving their viewers.

A session (``Terminal``) is one ``pty`` operation of the guest agent
(``hangar.guest.terminal``), owned by the server rather than by a
connection: a viewer (the WebSocket of ``hangar.api.pty``) *attaches* to it,
and may drop and attach again. Rules:

* **Output is kept, bounded.** Every byte the program writes goes into a
  ring of the last ``RING_BYTES`` bytes, numbered from 0 (the *offset*).
  The session's task takes output off the agent channel as it comes, so the
  guest's flow-control window stays open unless the server itself lags
  (then the program blocks on its writes, as on a slow terminal); a slow
  viewer loses the oldest bytes of the ring, never the server's memory.
  An attachment starts at a given offset (default: the first byte no
  viewer was sent), so a viewer that comes back sees what was produced
  while it was away; bytes older than the ring are reported as dropped.
* **One viewer at a time.** A new attachment takes over and the previous
  one is told to close (a dropped connection the server has not noticed
  yet must not block the user who reconnects).
* **Grace period.** A session without a viewer for ``grace_s`` seconds
  (from its start, or from its last viewer leaving) is hung up (SIGHUP,
  then SIGKILL 2 s later) and forgotten. A hang-up never waits for the
  guest; a session task that ends first (the server stops) CANCELs its
  channel, which the guest takes as a hang-up too.
* **Deadlines** (``PtyChannel``): 30 s to start; none while the program
  runs (as a tunnel); a hung-up session whose guest makes no progress for
  30 s ends without an exit code and marks the sandbox ``unresponsive``. A session whose program has ended is kept
  until a viewer has received its exit code, or for the grace period.
* **Busy.** While the program runs the sandbox counts as busy (as with a
  tunnel or a live desktop), so it is neither snapshotted nor put to sleep
  under a running shell; deleting the sandbox ends every session.
* At most ``MAX_PER_SANDBOX`` sessions per sandbox (``LimitExceeded``).

Events: ``pty.opened`` (session, ``program``: ``shell`` or ``command``,
never the command's text) and ``pty.closed`` (session, exit_code).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any

from hangar.core.commands import Command
from hangar.core.secrets import with_env
from hangar.core.tasks import Tasks
from hangar.engines.agent_client import AgentClient, PtyChannel, PtyExit
from hangar.errors import HangarError, LimitExceeded, NotFound

log = logging.getLogger("hangar.terminals")

RING_BYTES = 1 << 20
"""Bytes of output kept per session for viewers that attach later."""
MAX_PER_SANDBOX = 16
"""Sessions one sandbox may hold at once (running or awaiting their viewer)."""
DEFAULT_GRACE_S = 60.0
"""Seconds a session lives without a viewer, unless its creator chose otherwise."""
SWEEP_S = 1.0
"""Seconds between sweeps for sessions whose grace period ran out."""

Using = Callable[[str], AbstractAsyncContextManager[AgentClient]]


@dataclass
class Attachment:
    """One viewer's hold on a session; ``taken_over`` is set when another viewer takes it."""

    offset: int
    """The next output byte this viewer is to receive."""
    dropped: int = 0
    """Bytes the viewer asked for that were no longer in the ring."""
    taken_over: bool = False


@dataclass
class Terminal:
    """One session; see the module docstring."""

    id: str
    sandbox_id: str
    cols: int
    rows: int
    grace_s: float
    kind: str
    """``shell`` (a login shell) or ``command``."""
    created_at: float = field(default_factory=time.time)
    pid: int = 0
    exit: PtyExit | None = None
    ended: bool = False
    """The program has ended (``exit`` set) or was never reached."""
    viewer: Attachment | None = None
    detached_at: float = field(default_factory=time.monotonic)
    delivered: int = 0
    """Offset up to which output was sent to some viewer."""
    exit_delivered: bool = False
    hung_up: bool = False
    """Asked to end (closed, expired, server stopping), maybe before its program started."""
    _ring: bytearray = field(default_factory=bytearray)
    _base: int = 0
    _changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    _channel: PtyChannel | None = None
    _task: asyncio.Task[None] | None = None

    @property
    def end(self) -> int:
        """Offset one past the last output byte."""
        return self._base + len(self._ring)

    @property
    def state(self) -> str:
        return "exited" if self.ended else "running"

    async def _append(self, data: bytes) -> None:
        self._ring += data
        over = len(self._ring) - RING_BYTES
        if over > 0:
            del self._ring[:over]
            self._base += over
        async with self._changed:
            self._changed.notify_all()

    async def _finish(self, exit: PtyExit | None) -> None:
        self.exit = exit or PtyExit(None)
        self.ended = True
        async with self._changed:
            self._changed.notify_all()

    def attach(self, offset: int | None) -> Attachment:
        """Attach a viewer from ``offset`` (None: the first byte no viewer was sent);
        a viewer attached before is taken over."""
        if self.viewer is not None:
            self.viewer.taken_over = True
        start = self.delivered if offset is None else max(0, min(offset, self.end))
        dropped = max(0, self._base - start)
        a = Attachment(offset=max(start, self._base), dropped=dropped)
        self.viewer = a
        asyncio.get_running_loop().create_task(self._poke())
        return a

    def detach(self, a: Attachment) -> None:
        if self.viewer is a:
            self.viewer = None
            self.detached_at = time.monotonic()

    async def _poke(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def next(self, a: Attachment, limit: int = 1 << 16) -> bytes | None:
        """The next output for viewer ``a``: bytes, or None once the program has ended and
        everything was sent (or when ``a`` was taken over: check ``a.taken_over``)."""
        async with self._changed:
            await self._changed.wait_for(
                lambda: a.taken_over or a.offset < self.end or self.ended)
        if a.taken_over:
            return None
        if a.offset < self._base:  # the ring moved on while the viewer was slow
            a.dropped += self._base - a.offset
            a.offset = self._base
        if a.offset < self.end:
            start = a.offset - self._base
            chunk = bytes(self._ring[start:start + limit])
            a.offset += len(chunk)
            self.delivered = max(self.delivered, a.offset)
            return chunk
        return None

    async def write(self, data: bytes) -> None:
        if self._channel is not None and not self.ended:
            await self._channel.write(data)

    async def resize(self, cols: int, rows: int) -> None:
        self.cols, self.rows = cols, rows
        if self._channel is not None and not self.ended:
            await self._channel.resize(cols, rows)

    async def hang_up(self) -> None:
        self.hung_up = True
        if self._channel is not None and not self.ended:
            await self._channel.hang_up()


class Terminals:
    """Every terminal session of a server, by sandbox."""

    def __init__(self, using: Using, publish: Callable[..., None],
                 base_env: Callable[[str], dict[str, str]] | None = None) -> None:
        self._using = using
        self._base_env = base_env
        """A sandbox's own variables (its secrets' placeholders: ``hangar.core.secrets``)."""
        self._publish = publish
        self._sessions: dict[str, Terminal] = {}
        self._tasks = Tasks("terminals")
        """Each session's task (named by the session id) and the sweeper."""

    # -- queries ------------------------------------------------------------------------------

    def list(self, sandbox_id: str) -> list[Terminal]:
        return sorted((t for t in self._sessions.values() if t.sandbox_id == sandbox_id),
                      key=lambda t: t.created_at)

    def get(self, sandbox_id: str, session_id: str) -> Terminal:
        """Raises NotFound for an unknown session, or one of another sandbox."""
        t = self._sessions.get(session_id)
        if t is None or t.sandbox_id != sandbox_id:
            raise NotFound(f"no terminal session {session_id[:80]} in sandbox {sandbox_id[:80]}",
                           sandbox_id=sandbox_id)
        return t

    # -- lifecycle ----------------------------------------------------------------------------

    async def open(self, sandbox_id: str, command: Command | None = None, *, cols: int = 80,
                   rows: int = 24, grace_s: float = DEFAULT_GRACE_S) -> Terminal:
        """Start a program on a ``cols`` x ``rows`` pty in ``sandbox_id``'s guest: the
        ``command`` (its env and cwd too), or the guest's login shell when it is None or
        names no program; returns once it runs.

        Raises LimitExceeded (``MAX_PER_SANDBOX``), the errors of a guest call
        (NotFound, Conflict, Busy...) and InvalidRequest (bad input, a program
        that cannot start).
        """
        command = command or Command()
        if self._base_env is not None:
            command = with_env(command, self._base_env(sandbox_id))
        meta = command.pty_meta(cols, rows)
        if len(self.list(sandbox_id)) >= MAX_PER_SANDBOX:
            raise LimitExceeded(f"sandbox {sandbox_id} has {MAX_PER_SANDBOX} terminal sessions, "
                                "the most allowed; close one (DELETE .../pty/{session})",
                                retry_after=grace_s, sandbox_id=sandbox_id)
        t = Terminal(id="pty-" + secrets.token_hex(8), sandbox_id=sandbox_id,
                     cols=int(meta.get("cols", 80)), rows=int(meta.get("rows", 24)),
                     grace_s=grace_s,
                     kind="command" if command.command is not None else "shell")
        self._sessions[t.id] = t
        started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        t._task = self._tasks.start(t.id, self._run(t, meta, started))
        try:
            await asyncio.shield(started)
        except asyncio.CancelledError:
            # The caller went away; the program may start anyway. With no viewer, the
            # sweep hangs it up after its grace period.
            self._ensure_sweeper()
            raise
        except BaseException:
            self._sessions.pop(t.id, None)
            raise
        self._ensure_sweeper()
        return t

    async def _run(self, t: Terminal, meta: dict[str, Any], started: asyncio.Future[None]) -> None:
        exit: PtyExit | None = None
        try:
            async with self._using(t.sandbox_id) as agent:
                ch = await agent.open_pty(meta)
                t._channel, t.pid = ch, ch.pid
                started.set_result(None)
                if t.hung_up:  # closed while it was starting
                    await ch.hang_up()
                try:
                    self._publish("pty.opened", t.sandbox_id, session=t.id, program=t.kind)
                    while True:
                        data = await ch.read()
                        if not data:
                            break
                        await t._append(data)
                    exit = ch.exit
                    if ch.error is not None:
                        log.warning("terminal session lost its program's exit code",
                                    extra={"sandbox_id": t.sandbox_id, "session": t.id,
                                           "error": str(ch.error)[:200]})
                finally:
                    # This task ending first (the server stops) CANCELs the channel: the
                    # guest hangs the program up.
                    await ch.close()
        except asyncio.CancelledError:
            if not started.done():
                started.cancel()
            raise
        except BaseException as exc:
            if not started.done():
                started.set_exception(exc)
                started.exception()  # retrieved: nobody may be awaiting it any more
                t.ended = True
                return
            if not isinstance(exc, HangarError):
                log.error("terminal session failed", extra={"sandbox_id": t.sandbox_id,
                                                            "session": t.id,
                                                            "error": repr(exc)})
        finally:
            if started.done() and not started.cancelled() and started.exception() is None:
                await t._finish(exit)
                self._publish("pty.closed", t.sandbox_id, session=t.id,
                              exit_code=t.exit.exit_code if t.exit else None)

    def delivered_exit(self, t: Terminal) -> None:
        """A viewer received ``t``'s exit code: the session is done."""
        t.exit_delivered = True
        self._sessions.pop(t.id, None)

    async def close(self, sandbox_id: str, session_id: str) -> None:
        """Hang up a session and forget it. Raises NotFound."""
        t = self.get(sandbox_id, session_id)
        self._sessions.pop(t.id, None)
        await t.hang_up()

    def _ensure_sweeper(self) -> None:
        self._tasks.start("sweeper", self._sweep())

    async def _sweep(self) -> None:
        while self._sessions:
            await asyncio.sleep(SWEEP_S)
            now = time.monotonic()
            for t in list(self._sessions.values()):
                if t.viewer is None and now - t.detached_at >= t.grace_s:
                    self._sessions.pop(t.id, None)
                    log.info("terminal session expired without a viewer",
                             extra={"sandbox_id": t.sandbox_id, "session": t.id})
                    try:
                        await t.hang_up()
                    except HangarError:
                        pass

    async def shutdown(self) -> None:
        """Hang up every session (the server stops)."""
        sessions, self._sessions = list(self._sessions.values()), {}
        for t in sessions:
            try:
                await asyncio.wait_for(t.hang_up(), 2)
            except (HangarError, asyncio.TimeoutError):
                pass
        await self._tasks.stop()
