"""Guest calls: exec, files and tunnels through a running sandbox's agent.

``GuestCalls.using`` hands out the agent of a running sandbox for one
call: it wakes a sleeping sandbox first, waits while a lifecycle change
holds the sandbox's lock, and connects the agent on first use (a VM
adopted after a restart is reconnected then, the connection proven by a
``hello`` probe: ``Launcher.reconnect``). While the call runs the
sandbox is ``busy``: it is neither snapshotted nor put to sleep.

Deadlines (``hangar.engines.agent_client.Deadlines``; enforced per call
by the agent client, on what the guest owes, never on how slowly the HTTP
client reads):

=====================  ========================================================
call                   the guest must answer within
=====================  ========================================================
exec                   its ``timeout`` plus 10 s (no timeout: ``EXEC_MAX_S``,
                       24 h, which the guest also enforces)
file read              30 s whenever it has window to send the next bytes
file write             30 s whenever the host waits for window; after the
                       last byte, 30 s plus 1 s per 4 MiB (fsync)
stat, list, mkdir...   30 s
tunnel                 30 s to connect; none while open
terminal (pty)         30 s to start; none while open; after a hang-up,
                       progress within 30 s whenever it can send
file watch             30 s to be in place; none while open
=====================  ========================================================

A call whose deadline passes fails with ``Timeout`` (504) and moves the
sandbox ``running -> unresponsive`` (``unanswered``), and so does a heartbeat
left unanswered: every running sandbox whose agent is connected is asked
``hello`` every ``HEARTBEAT_S`` seconds (from the reconcile loop's
``probe_unresponsive`` pass, each in a task of its own), and one that does not
answer within ``HEARTBEAT_DEADLINE_S`` is marked ``unresponsive`` at once, with a
``sandbox.state`` event, whether or not a call is waiting on it; so a guest
that stopped answering shows in ``GET /sandboxes/{id}`` and the events within
``HEARTBEAT_S + HEARTBEAT_DEADLINE_S`` (15 s). A sandbox whose lock is held (a
snapshot, sleep or wake pauses its VM) is not asked. An unresponsive
sandbox answers guest calls at once with 504 and ``Retry-After``; it is
shown as such, can be deleted, and expires as usual. The reconcile loop
asks its agent ``hello`` about every ``PROBE_S`` seconds
(``probe_unresponsive``), on a fresh connection after one that went unanswered; the
first answer moves it back to ``running``.

A guest call that fails for the caller's own reason is the caller's 4xx, never
a retried 5xx (``client_fault``): a full disk (ENOSPC, EDQUOT) is ``DiskFull``
(409, naming the path and the free space), a read-only file system, a loop of
symbolic links or a rename across file systems ``InvalidRequest`` (400), a file
over the size limit ``TooLarge`` (413), a program file in use ``Conflict``. The
guest agent reports these errnos as ``io_error`` with the C library's message
(``hangar.guest.ops.common.os_error``); a missing path, a folder for a file, a
name too long and a denied permission have agent codes of their own
(``hangar.engines.agent_client.ERRORS``).

Commands running at once in one sandbox are capped
(``max_execs_per_sandbox``; ``admission.ExecSlots``): one more is refused
with 429 and ``Retry-After`` before it reaches the guest.

Exec publishes ``exec.started`` and ``exec.finished`` events with an
``exec_id``, the exit code and duration; never output or environment, and
the command text only when the caller opted in.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import Any

from hangar.core.admission import ExecSlots
from hangar.core.secrets import with_env
from hangar.core.commands import HOME, Command, FileEntry, FileEvent, FileList, WriteResult
from hangar.core.context import Context
from hangar.core.launch import Launcher
from hangar.core.lifecycle import State
from hangar.core.sleep import Sleeper
from hangar.errors import (
    Busy, Conflict, DiskFull, GuestError, HangarError, InvalidRequest, NotFound, Timeout, TooLarge,
)
from hangar.schemas.bounds import PORT_MAX, PORT_MIN
from hangar.engines.agent_client import (
    AgentClient, Deadlines, ExecEvent, ExecResult, GuestFile, Tunnel,
)
from hangar.turns import mapped

log = logging.getLogger("hangar.sandboxes")

AGENT_CONNECT_S = 20.0
"""How long a guest call waits to reconnect a VM's agent (adopted after a restart, or
whose connection dropped), seconds."""
TOUCH_S = 1.0
"""A sandbox's ``last_active_at`` is written at most this often, seconds (it is read
for idle timeouts of minutes)."""
TRANSIENT_WAIT = (State.SNAPSHOTTING, State.WAKING, State.RESTORING, State.CREATING)
DEADLINES = Deadlines()
"""The deadlines of guest calls (see the module docstring)."""
EXEC_MAX_S = DEADLINES.exec_max_s
"""What an exec's ``"timeout": null`` means, seconds (24 h)."""
PROBE_S = 5.0
"""How long a probe of an unresponsive sandbox's agent waits for ``hello``, seconds; also
its ``Retry-After``."""
HEARTBEAT_S = 5.0
"""Seconds between heartbeats (``hello``) to each running sandbox's connected agent."""
HEARTBEAT_DEADLINE_S = 10.0
"""How long a heartbeat waits for the agent's answer before the sandbox is marked
``unresponsive``, seconds (a loaded TCG guest answers ``hello`` well within it: the
agent's CPU weight is a hundred times its commands', ``hangar.guest.limits``)."""
BUSY_RETRY_S = 1.0
"""``Retry-After`` of a 409 ``busy`` while a lifecycle change runs, seconds."""


CLIENT_ERRNOS: dict[int, type[HangarError]] = {
    errno.ENOSPC: DiskFull, errno.EDQUOT: DiskFull, errno.EROFS: InvalidRequest,
    errno.EFBIG: TooLarge, errno.ELOOP: InvalidRequest, errno.EXDEV: InvalidRequest,
    errno.ETXTBSY: Conflict, errno.EMLINK: InvalidRequest,
}
"""Errnos of a guest file call that are the caller's problem, and the class each becomes."""
_BY_MESSAGE = {os.strerror(n) + ": ": (n, cls) for n, cls in CLIENT_ERRNOS.items()}
FREE_SPACE_S = 10.0
"""Longest wait for the guest to say how much room a full file system has, seconds."""
_FREE = ('d="$1"; while [ ! -d "$d" ]; do d=$(dirname "$d"); done; '
         'stat -f -c "%a %S %b" "$d"')


def _entry(f: GuestFile) -> FileEntry:
    """``f`` as a wire-safe ``FileEntry`` (``FileEntry`` replaces undecodable bytes of names;
    see ``schemas.files``). Raises GuestError for an entry past the bounds (a name longer
    than NAME_MAX, a path longer than PATH_MAX + NAME_MAX, an mtime that is not finite)."""
    try:
        return FileEntry.model_validate(f, from_attributes=True)
    except ValueError as exc:
        raise GuestError(f"the guest answered a malformed file entry "
                         f"({exc.__class__.__name__})") from None


def _file_event(raw: dict[str, Any]) -> FileEvent | None:
    try:
        return FileEvent.model_validate(raw)
    except ValueError:
        return None


class NoListener(NotFound):
    """Nothing listens on the guest port a tunnel was asked for (404 unless the route
    says otherwise: the WebSocket tunnel answers 503, the port proxy 502)."""


class GuestCalls:
    """Runs calls in sandboxes' guests."""

    def __init__(self, ctx: Context, launcher: Launcher, sleeper: Sleeper) -> None:
        self.ctx = ctx
        self.launcher = launcher
        self.sleeper = sleeper
        self.execs = ExecSlots(ctx.settings.max_execs_per_sandbox)
        self._beats: dict[str, float] = {}
        """Sandbox id → when its last heartbeat was sent (monotonic s)."""
        self._beating: dict[str, asyncio.Task[None]] = {}

    @asynccontextmanager
    async def using(self, sandbox_id: str, *, busy: bool = True) -> AsyncIterator[AgentClient]:
        """The agent of a running sandbox for one call; wakes a sleeping one first.

        With ``busy`` (the default) the sandbox counts as busy meanwhile (neither
        snapshotted nor put to sleep); connections to exposed ports pass ``busy=False``
        (``hangar.core.ports``: they never hold a snapshot or sleep off).

        Raises NotFound, Gone, Conflict (not running), Busy (it keeps
        changing state: retry), Timeout (it is ``unresponsive``: retry later).
        """
        ctx = self.ctx
        for attempt in range(3):
            # A sandbox this server holds a VM for is not asleep (a wake in progress holds
            # the lock taken below), so the common call reads its state once, not twice.
            if attempt or ctx.registry.get(sandbox_id) is None:
                if ctx.state(sandbox_id) in (State.SLEEPING, State.WAKING):
                    await self.sleeper.wake(sandbox_id)
            async with ctx.registry.lock(sandbox_id):
                state = ctx.state(sandbox_id)  # its state only: this is every call's path
                rt = ctx.registry.get(sandbox_id)
                if state == State.SLEEPING:
                    continue  # it fell asleep between the wake and the lock
                if state in TRANSIENT_WAIT:
                    raise Busy(f"sandbox {sandbox_id} is {state.value}; retry shortly",
                               retry_after=BUSY_RETRY_S, sandbox_id=sandbox_id,
                               state=state.value)
                if state == State.UNRESPONSIVE:
                    raise Timeout(f"sandbox {sandbox_id} is unresponsive: its guest agent "
                                  "stopped answering; calls are served again once it answers "
                                  "(it is asked every few seconds), or delete it",
                                  sandbox_id=sandbox_id, state=state.value,
                                  retry_after=PROBE_S)
                if state != State.RUNNING or rt is None:
                    raise Conflict(f"sandbox {sandbox_id} is {state.value}, not running",
                                   sandbox_id=sandbox_id, state=state.value)
                if busy:
                    rt.busy += 1
            break
        else:
            raise Busy(f"sandbox {sandbox_id} keeps falling asleep; retry",
                       retry_after=BUSY_RETRY_S, sandbox_id=sandbox_id)
        try:
            async with rt.connect_lock:
                if rt.agent is None or rt.agent.closed:
                    if not rt.vm.alive():
                        raise Conflict(f"sandbox {sandbox_id} has stopped", sandbox_id=sandbox_id)
                    rt.agent = await self.launcher.reconnect(rt.vm, AGENT_CONNECT_S)
                agent = rt.agent
                agent.deadlines = DEADLINES
                agent.on_unanswered = lambda op, s: self.unanswered(sandbox_id, op, s)
            try:
                yield agent
            except GuestError as exc:
                mapped = await self.client_fault(sandbox_id, agent, exc)
                if mapped is None:
                    raise
                raise mapped from None
        finally:
            if busy:
                rt.busy -= 1
            # Recorded once the caller's answer is on its way (the next turn of the loop),
            # at most once per TOUCH_S: a database write is the slowest step of a short
            # call on the host.
            now = time.time()
            if now - rt.touched_at >= TOUCH_S:
                rt.touched_at = now
                asyncio.get_running_loop().call_soon(self._touch, sandbox_id, now)

    async def client_fault(self, sandbox_id: str, agent: AgentClient,
                           exc: GuestError) -> HangarError | None:
        """The caller's error that a guest's ``io_error`` stands for (``CLIENT_ERRNOS``), or
        None when it is the guest's own fault. A full disk also names its free space."""
        if exc.context.get("guest_code") != "io_error":
            return None
        found = next(((prefix, hit) for prefix, hit in _BY_MESSAGE.items()
                      if exc.message.startswith(prefix)), None)
        if found is None:
            return None
        prefix, (number, cls) = found
        path = exc.message[len(prefix):][:4096]
        context: dict[str, Any] = {"sandbox_id": sandbox_id, "path": path,
                                   "errno": errno.errorcode.get(number, str(number))}
        message = exc.message[:500]
        if cls is DiskFull:
            room = await self._free_space(agent, path)
            if room is not None:
                context["free_bytes"], context["total_bytes"] = room
                message = (f"{message}: the sandbox's disk has {room[0]} bytes free of "
                           f"{room[1]}; delete files in it, or create the sandbox with a "
                           "larger disk_mib")
            else:
                message += ": the sandbox's disk is full; delete files in it"
        log.info("guest call refused by the guest's file system",
                 extra={"sandbox_id": sandbox_id, "errno": context["errno"]})
        return cls(message, **context)

    async def _free_space(self, agent: AgentClient, path: str) -> tuple[int, int] | None:
        """(free bytes for an unprivileged writer, total bytes) of the guest file system
        that holds ``path`` (its nearest existing folder), or None when it cannot say."""
        folder = path if path.startswith("/") else f"{HOME}/{path}"
        meta = Command("sh", args=["-c", _FREE, "sh", os.path.dirname(folder) or "/"],
                       timeout_s=FREE_SPACE_S).exec_meta()
        try:
            result = await asyncio.wait_for(agent.exec(meta), FREE_SPACE_S + 5)
            avail, size, blocks = (int(x) for x in result.stdout.head.split()[:3])
        except (HangarError, OSError, ValueError, asyncio.TimeoutError):
            return None
        return avail * size, blocks * size

    def _touch(self, sandbox_id: str, when: float) -> None:
        try:
            self.ctx.store.update(sandbox_id, last_active_at=when)
        except Exception as exc:  # a late write must never break the loop
            log.warning("last activity not recorded", extra={"sandbox_id": sandbox_id,
                                                              "error": str(exc)})

    def unanswered(self, sandbox_id: str, op: str, seconds: float) -> None:
        """A call's deadline passed: move the sandbox ``running -> unresponsive``."""
        try:
            self.ctx.store.transition(sandbox_id, State.RUNNING, State.UNRESPONSIVE,
                                      error=f"the guest agent did not answer {op} within "
                                            f"{seconds:g} s")
        except (Conflict, NotFound):
            return  # not running (already unresponsive, or being deleted)
        self.ctx.metrics.unresponsive.inc()
        log.warning("guest agent unresponsive", extra={"sandbox_id": sandbox_id, "call": op,
                                                       "deadline_s": seconds})

    async def probe_unresponsive(self) -> None:
        """Ask each ``unresponsive`` sandbox's agent ``hello``; one that answers runs again.
        Also starts the heartbeats that are due (``heartbeats``).

        A reconcile pass (each tick, never two at once). A sandbox whose VMM
        died is left to crash handling.
        """
        self.heartbeats()
        recs = self.ctx.store.in_states({State.UNRESPONSIVE})
        if recs:
            await asyncio.gather(*(self._probe(r.id) for r in recs))

    async def _probe(self, sandbox_id: str) -> None:
        rt = self.ctx.registry.get(sandbox_id)
        if rt is None or not rt.vm.alive():
            return
        agent = None
        try:
            async with rt.connect_lock:
                if rt.agent is None or rt.agent.closed:
                    rt.agent = await self.launcher.reconnect(rt.vm, PROBE_S)
                agent = rt.agent
            await agent.ping(PROBE_S)
        except Timeout:
            # No answer on this connection: the next probe opens a fresh one. A guest can
            # leave the stream mid-frame (a writer killed on the agent's port), and the old
            # connection's decoder would wait for the rest of that frame for ever. (A
            # reconnect that timed out made no connection: nothing to close.)
            if agent is not None:
                await agent.close()
            return
        except (HangarError, OSError):
            return
        try:
            self.ctx.store.transition(sandbox_id, State.UNRESPONSIVE, State.RUNNING, error=None)
        except (Conflict, NotFound):
            return
        log.info("guest agent answers again", extra={"sandbox_id": sandbox_id})

    def heartbeats(self) -> None:
        """Start a heartbeat (``_beat``) for each sandbox whose agent is connected, at most
        one at a time each, every ``HEARTBEAT_S``. Never waits."""
        now = time.monotonic()
        ids = self.ctx.registry.ids()
        for gone in set(self._beats) - ids:
            del self._beats[gone]
        for sandbox_id in ids:
            if sandbox_id in self._beating or now - self._beats.get(sandbox_id, 0.0) < HEARTBEAT_S:
                continue
            rt = self.ctx.registry.get(sandbox_id)
            if rt is None or rt.agent is None or rt.agent.closed \
                    or self.ctx.registry.locked(sandbox_id):
                continue
            self._beats[sandbox_id] = now
            task = asyncio.get_running_loop().create_task(self._beat(sandbox_id, rt.agent))
            self._beating[sandbox_id] = task
            task.add_done_callback(lambda _t, sid=sandbox_id: self._beating.pop(sid, None))

    async def _beat(self, sandbox_id: str, agent: AgentClient) -> None:
        """One heartbeat: ``hello`` within ``HEARTBEAT_DEADLINE_S``, else ``unanswered``.
        Only a sandbox that is ``running`` when the ping went unanswered, with its lock
        free, is marked (a snapshot or sleep pauses the VM and takes the lock). Nothing is
        read before the ping: with a hundred sandboxes, a record read per beat was the
        server's largest cost while they idled."""
        try:
            await agent.ping(HEARTBEAT_DEADLINE_S)
        except Timeout:
            rec = self.ctx.store.get(sandbox_id)
            if rec is not None and rec.state == State.RUNNING \
                    and not self.ctx.registry.locked(sandbox_id) \
                    and self.ctx.registry.get(sandbox_id) is not None:
                self.unanswered(sandbox_id, "heartbeat", HEARTBEAT_DEADLINE_S)
        except (HangarError, OSError):
            return  # a lost connection: crash handling or the next call reconnects

    def _started(self, sandbox_id: str, command: str | None) -> tuple[str, float]:
        exec_id = "ex-" + secrets.token_hex(6)
        data: dict[str, Any] = {"exec_id": exec_id}
        if command is not None:
            data["command"] = command
        self.ctx.publish("exec.started", sandbox_id, **data)
        return exec_id, time.monotonic()

    def _finished(self, sandbox_id: str, exec_id: str, started: float,
                  result: ExecResult | None) -> float:
        took = time.monotonic() - started
        outcome = "ok" if result is not None else "error"
        if result is not None and result.timed_out:
            outcome = "timed_out"
        self.ctx.metrics.execs.labels("ok" if result is not None else "error").inc()
        self.ctx.metrics.exec_seconds.labels(outcome).observe(took)
        self.ctx.publish("exec.finished", sandbox_id, exec_id=exec_id,
                         exit_code=result.exit_code if result else None,
                         duration_s=round(took, 3),
                         timed_out=bool(result and result.timed_out),
                         **({} if result is not None else {"error": True}))
        return took

    async def exec(self, sandbox_id: str, cmd: Command | dict[str, Any],
                   stdin: bytes | None = None, shown: str | None = None) -> ExecResult:
        """Run a command to completion and return its result (exit code or signal,
        ``timed_out``, the head and tail of each output stream).

        ``cmd`` is a ``Command`` (or, inside the core, the guest's exec request);
        ``stdin`` its whole input; ``shown`` the text events may show (only when
        the caller opted in). Raises LimitExceeded (too many commands in the
        sandbox), InvalidRequest (a command that cannot start), Timeout (the
        guest did not answer within the command's timeout plus 10 s) and the
        errors of ``using``.
        """
        meta = (with_env(cmd, self.launcher.vault.env(sandbox_id)).exec_meta()
                if isinstance(cmd, Command) else cmd)
        result: ExecResult | None = None
        with self.execs.take(sandbox_id):
            async with self.using(sandbox_id) as agent:
                exec_id, started = self._started(sandbox_id, shown)
                try:
                    result = await agent.exec(meta, stdin)
                finally:
                    took = self._finished(sandbox_id, exec_id, started, result)
        log.info("exec", extra={"sandbox_id": sandbox_id, "duration_s": round(took, 3),
                                "exit_code": result.exit_code, "timed_out": result.timed_out})
        return result

    async def exec_stream(self, sandbox_id: str, cmd: Command | dict[str, Any],
                          stdin: bytes | None = None,
                          shown: str | None = None) -> AsyncIterator[ExecEvent]:
        """Run a command, yielding ``stdout``/``stderr`` events as the output comes (at
        the pace the caller takes them), then one ``exit`` event with the result.
        Raises as ``exec`` (a failure midway raises from the iterator)."""
        meta = (with_env(cmd, self.launcher.vault.env(sandbox_id)).exec_meta()
                if isinstance(cmd, Command) else cmd)
        result: ExecResult | None = None
        with self.execs.take(sandbox_id):
            async with self.using(sandbox_id) as agent:
                exec_id, started = self._started(sandbox_id, shown)
                try:
                    async for ev in agent.exec_stream({**meta, "stream": True}, stdin):
                        if ev.kind == "exit":
                            result = ev.result
                        yield ev
                finally:
                    self._finished(sandbox_id, exec_id, started, result)

    async def read_file(self, sandbox_id: str, path: str) -> AsyncIterator[bytes]:
        """A file's bytes, in chunks as the guest sends them (relative paths start at
        ``HOME``). Raises NotFound, InvalidRequest (a folder, a bad path) and the
        errors of ``using``."""
        async with self.using(sandbox_id) as agent:
            async for chunk in agent.read_file(path):
                yield chunk

    async def write_file(self, sandbox_id: str, path: str,
                         chunks: Iterable[bytes] | AsyncIterator[bytes],
                         mode: int = 0o644) -> WriteResult:
        """Write a file from ``chunks`` (atomically: temp file, fsync, rename; parent
        folders made), permission bits ``mode``. Returns its absolute path and the bytes
        written. Relative paths start at ``HOME``."""
        async with self.using(sandbox_id) as agent:
            return WriteResult.model_validate(await agent.write_file(path, chunks, mode))

    async def list_dir(self, sandbox_id: str, path: str = HOME) -> FileList:
        """A folder's absolute ``path`` and its ``entries`` (``FileEntry``), sorted by
        name. Relative paths start at ``HOME``. Raises NotFound, InvalidRequest (not a
        folder, a bad path). The entries are converted ``hangar.turns.EVERY`` at a time, with
        turns of the loop between (16,000 held it 0.2-0.4 s at once, review 29k K-H3)."""
        async with self.using(sandbox_id) as agent:
            folder = await agent.list_dir(path)
        return FileList(path=folder.path, entries=await mapped(_entry, folder.entries))

    async def stat(self, sandbox_id: str, path: str) -> FileEntry:
        """One file's entry (a symlink's own, not its target's). Raises NotFound."""
        async with self.using(sandbox_id) as agent:
            return _entry(await agent.stat(path))

    async def mkdir(self, sandbox_id: str, path: str, parents: bool = True) -> FileEntry:
        """Make a folder (with ``parents``, its missing parents too; an existing folder is
        fine) and return its entry. Raises NotFound (no parent), Conflict (a file is there)."""
        async with self.using(sandbox_id) as agent:
            return _entry(await agent.mkdir(path, parents))

    async def remove(self, sandbox_id: str, path: str, recursive: bool = False) -> None:
        """Remove a file, or a folder (empty, or with ``recursive`` everything in it).
        Raises NotFound, InvalidRequest (``/``), Conflict (a folder not empty)."""
        async with self.using(sandbox_id) as agent:
            await agent.remove(path, recursive)

    @asynccontextmanager
    async def tunnel(self, sandbox_id: str, port: int, *,
                     busy: bool = True) -> AsyncIterator[Tunnel]:
        """A TCP connection to ``127.0.0.1:port`` in the guest, open while the context
        lasts (closed on leaving); with ``busy`` (see ``using``) the sandbox is busy
        meanwhile. ``Tunnel.read`` gives
        bytes (``b""`` at the end), ``Tunnel.write`` sends them.

        Raises InvalidRequest (a port outside 1..65535), NoListener (nothing listens
        on that port), and the errors of ``using``.
        """
        if not PORT_MIN <= port <= PORT_MAX:
            raise InvalidRequest(f"port {port} is outside {PORT_MIN}..{PORT_MAX}", port=port)
        async with self.using(sandbox_id, busy=busy) as agent:
            try:
                conn = await agent.open_tunnel(port)
            except NotFound as exc:
                if exc.context.get("guest_code") == "not_found":
                    raise NoListener(f"nothing listens on port {port} in sandbox {sandbox_id}",
                                     sandbox_id=sandbox_id, port=port) from None
                raise
            try:
                yield conn
            finally:
                await conn.close()

    async def watch(self, sandbox_id: str, path: str,
                    recursive: bool = False) -> AsyncIterator[list[FileEvent]]:
        """Watch ``path`` in the guest: first an empty batch once the watch is in place, then
        batches of ``FileEvent`` until the caller closes the iterator or the path goes
        away (an event the guest sent malformed is dropped). The sandbox is busy
        meanwhile.

        Raises NotFound (no such path), InvalidRequest (too many folders), and the
        errors of ``using``.
        """
        async with self.using(sandbox_id) as agent:
            w = await agent.open_watch(path, recursive)
            try:
                yield []
                while (batch := await w.next()) is not None:
                    yield [e for e in map(_file_event, batch) if e is not None]
            finally:
                await w.close()

    async def agent(self, sandbox_id: str) -> AgentClient:
        """The agent of a running sandbox, for the core's own use (its hello, boot id)."""
        async with self.using(sandbox_id) as agent:
            return agent

