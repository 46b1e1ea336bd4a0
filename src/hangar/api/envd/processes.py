"""The processes envd's RPCs name by pid: each one's output, fanned out to its streams.

A ``Proc`` is one started process, owned by the server, not by the HTTP
stream that started it: a pump task reads its output and hands each piece
to every stream attached at that moment (``subscribe``: Start's own stream,
then any Connect). A stream that leaves (the SDK's ``disconnect``) leaves
the process running; output made while no stream is attached is not kept,
as with envd. Each subscriber's queue is bounded (``QUEUE``), and the pump
waits for the slowest, so a slow client slows the program's output rather
than growing the server.

Backends, from the core's typed operations:

* a command without a terminal runs as an exec stream
  (``SandboxManager.exec_stream``); its pid is this table's own number
  (``FIRST_PID`` up: the exec stream names no guest pid); it has no stdin,
  and a signal ends it (the stream is cancelled, which kills its process
  group in the guest);
* a command on a terminal is a terminal session (``SandboxManager.terminals``),
  its pid the guest's; input, resize and hang-up go to the session.

A process is forgotten once it ended and its end went to the streams
attached then. Events are tuples: ``("stdout"|"stderr"|"pty", bytes)``,
``("end", End)``, ``("error", HangarError)``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import signal as signals
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from hangar.core.commands import Command
from hangar.core.sandboxes import SandboxManager
from hangar.errors import Conflict, HangarError, InvalidRequest, NotFound

log = logging.getLogger("hangar.envd")

QUEUE = 64
"""Output pieces a stream may lag behind before the process's output waits for it."""
FIRST_PID = 1_000_000
"""First pid given to a command without a terminal (above any guest pid)."""
NO_TIMEOUT_S = 86_400.0
"""A process started without a deadline lives at most this long (the guest's own cap)."""


@dataclass(frozen=True)
class End:
    """How a process ended, as envd reports it."""

    exit_code: int
    exited: bool
    status: str
    timed_out: bool = False
    error: str | None = None


def end_of(exit_code: int | None, signal: int | None, timed_out: bool = False) -> End:
    if signal:
        try:
            name = signals.Signals(signal).name[3:].lower()
        except ValueError:
            name = str(signal)
        return End(-1, False, f"signal: {'killed' if name == 'kill' else name}", timed_out)
    code = exit_code if exit_code is not None else -1
    return End(code, exit_code is not None, f"exit status {code}", timed_out)


@dataclass
class Proc:
    """One process; see the module docstring."""

    pid: int
    sandbox_id: str
    cmd: str
    args: list[str]
    envs: dict[str, str]
    cwd: str | None
    tag: str | None
    pty: bool
    terminal: Any = None
    """The terminal session (``hangar.core.terminals.Terminal``) of a pty process."""
    task: asyncio.Task[None] | None = None
    ended: End | None = None
    killed: bool = False
    _subs: list[asyncio.Queue[tuple[str, Any]]] = field(default_factory=list)

    def subscribe(self) -> asyncio.Queue[tuple[str, Any]]:
        q: asyncio.Queue[tuple[str, Any]] = asyncio.Queue(QUEUE)
        self._subs.append(q)
        return q

    def unsubscribe(self, q: asyncio.Queue[tuple[str, Any]]) -> None:
        if q in self._subs:
            self._subs.remove(q)
        while not q.empty():  # a pump waiting to put into it goes on
            q.get_nowait()

    async def _emit(self, event: tuple[str, Any]) -> None:
        for q in list(self._subs):
            await q.put(event)

    async def events(self, q: asyncio.Queue[tuple[str, Any]]) -> AsyncIterator[tuple[str, Any]]:
        """The events ``q`` receives until the end (or an error); unsubscribes on leaving."""
        try:
            while True:
                ev = await q.get()
                yield ev
                if ev[0] in ("end", "error"):
                    return
        finally:
            self.unsubscribe(q)


class Processes:
    """Every process started through envd on this server, by sandbox and pid."""

    def __init__(self) -> None:
        self._procs: dict[tuple[str, int], Proc] = {}
        self._pids = itertools.count(FIRST_PID)

    def list(self, sandbox_id: str) -> list[Proc]:
        return [p for (sid, _), p in sorted(self._procs.items()) if sid == sandbox_id
                and p.ended is None]

    def find(self, sandbox_id: str, pid: int | None = None, tag: str | None = None) -> Proc:
        """The running process of that pid (or tag). Raises NotFound."""
        for p in self.list(sandbox_id):
            if (pid is not None and p.pid == pid) or (tag is not None and p.tag == tag):
                return p
        what = f"pid {pid}" if pid is not None else f"tag {tag!r}"
        raise NotFound(f"process with {what} not found in sandbox {sandbox_id}")

    async def start(self, manager: SandboxManager, sandbox_id: str, cmd: Command, *,
                    tag: str | None, pty: tuple[int, int] | None,
                    timeout_s: float | None) -> tuple[Proc, asyncio.Queue[tuple[str, Any]]]:
        """Start ``cmd`` (on a ``pty`` of (cols, rows), or not) and subscribe to it;
        ``timeout_s`` ends it then (None: ``NO_TIMEOUT_S``). Raises the core's errors
        (a terminal that cannot start)."""
        if tag is not None and any(p.tag == tag for p in self.list(sandbox_id)):
            raise Conflict(f"a process with tag {tag!r} runs already")
        base = dict(sandbox_id=sandbox_id, cmd=cmd.command or "", args=list(cmd.args or []),
                    envs=dict(cmd.env or {}), cwd=cmd.cwd, tag=tag)
        if pty is None:
            proc = Proc(pid=next(self._pids), pty=False, **base)  # type: ignore[arg-type]
            q = proc.subscribe()
            run = Command(command=cmd.command, args=cmd.args, env=cmd.env, cwd=cmd.cwd,
                          timeout_s=timeout_s)
            proc.task = asyncio.ensure_future(self._pump_exec(manager, proc, run))
        else:
            grace = timeout_s or NO_TIMEOUT_S
            t = await manager.terminals.open(sandbox_id, cmd, cols=pty[0], rows=pty[1],
                                             grace_s=grace)
            proc = Proc(pid=t.pid, pty=True, terminal=t, **base)  # type: ignore[arg-type]
            q = proc.subscribe()
            proc.task = asyncio.ensure_future(self._pump_pty(manager, proc, timeout_s))
        self._procs[(sandbox_id, proc.pid)] = proc
        return proc, q

    async def _finish(self, proc: Proc, event: tuple[str, Any]) -> None:
        if event[0] == "end":
            proc.ended = event[1]
        else:
            proc.ended = End(-1, False, "error", error=str(event[1]))
        self._procs.pop((proc.sandbox_id, proc.pid), None)
        await proc._emit(event)

    async def _pump_exec(self, manager: SandboxManager, proc: Proc, cmd: Command) -> None:
        event: tuple[str, Any]
        try:
            async for ev in manager.exec_stream(proc.sandbox_id, cmd):
                if ev.kind == "exit" and ev.result is not None:
                    r = ev.result
                    event = ("end", end_of(r.exit_code, r.signal, r.timed_out))
                    break
                await proc._emit((ev.kind, ev.data))
            else:
                event = ("error", HangarError("the command's stream ended without its exit"))
        except asyncio.CancelledError:
            event = ("end", end_of(None, signals.SIGKILL))
        except HangarError as exc:
            event = ("error", exc)
        except Exception as exc:  # never leave a stream waiting
            log.exception("envd process pump failed", extra={"sandbox_id": proc.sandbox_id})
            event = ("error", HangarError(f"the command failed: {type(exc).__name__}"))
        await self._finish(proc, event)

    async def _pump_pty(self, manager: SandboxManager, proc: Proc,
                        timeout_s: float | None) -> None:
        t = proc.terminal
        a = t.attach(None)
        timer = asyncio.get_running_loop().call_later(
            timeout_s or NO_TIMEOUT_S, lambda: asyncio.ensure_future(self._hang_up(proc)))
        try:
            while (chunk := await t.next(a)) is not None:
                await proc._emit(("pty", chunk))
        finally:
            timer.cancel()
            t.detach(a)
        code = t.exit.exit_code if t.exit is not None else None
        sig = t.exit.signal if t.exit is not None else None
        if proc.killed and code is None:
            sig = signals.SIGKILL
        manager.terminals.delivered_exit(t)
        await self._finish(proc, ("end", end_of(code, sig)))

    async def _hang_up(self, proc: Proc) -> None:
        proc.killed = True
        try:
            await proc.terminal.hang_up()
        except HangarError:
            pass

    async def signal(self, proc: Proc, signum: int) -> None:
        """End ``proc`` (SIGKILL or SIGTERM: a command's stream is cancelled, a terminal
        hung up). Raises InvalidRequest for another signal."""
        if signum not in (signals.SIGKILL, signals.SIGTERM):
            raise InvalidRequest(f"signal {signum} is not one envd sends (SIGTERM, SIGKILL)")
        proc.killed = True
        if proc.pty:
            await self._hang_up(proc)
        elif proc.task is not None:
            proc.task.cancel()

    async def write(self, proc: Proc, data: bytes, to_pty: bool) -> None:
        """Send input. Raises InvalidRequest when the process has no such input."""
        if proc.pty and to_pty:
            await proc.terminal.write(data)
            return
        if proc.pty:
            raise InvalidRequest(f"process {proc.pid} runs on a terminal: send its input as "
                                 "pty input")
        raise InvalidRequest(f"process {proc.pid} has no stdin: commands without a terminal "
                             "run with their input closed on this server")

    async def resize(self, proc: Proc, cols: int, rows: int) -> None:
        if not proc.pty:
            raise InvalidRequest(f"process {proc.pid} has no terminal to resize")
        if not (0 < cols <= 1000 and 0 < rows <= 1000):
            raise InvalidRequest(f"a terminal of {cols}x{rows} is outside 1..1000")
        await proc.terminal.resize(cols, rows)
