"""The agent's table of processes that outlive their connection (standard library only).

A process started by the ``proc_start`` operation (``hangar.guest.ops.processes``)
is no request's: it runs on when the host connection that started it goes,
and any host connection may list it, attach to its output, write to its
stdin, signal it, resize its terminal or remove it, by pid or by the tag its
starter chose. An ``exec`` whose command leaves a program behind that still
holds its stdout or stderr (``python3 -m http.server &``) hands those pipes
to the table as well (``ProcessTable.adopt``), so that program's later output
lands in a buffer instead of a closed pipe (where it would get EPIPE and,
for a server that logs each request, fail every request).

Output. Every byte a process writes (stdout and stderr on pipes, or its
terminal's output) is read at once, whatever its readers do, into a ring of
``RING_BYTES`` (1 MiB) per process: the oldest chunks are dropped and counted
(``output_dropped``) once it is full, so a flood costs the guest a fixed
amount of memory and never blocks the process. Each attached client has a
queue of its own, bounded the same way (``ATTACH_BYTES``; what it drops is
counted and reported to it), so a slow client neither holds the process back
nor grows the agent. Attaching gives output from that moment on (as E2B's
``Connect``), or, with ``replay``, what the ring holds first.

End. A process has *ended* for its attached clients once its main process
exited and its output ended (every pipe closed, the terminal hung up), or
``END_GRACE_S`` after the exit while a program it left behind holds the
output open; a client that asks to ``follow`` gets output until the output
ends. The pipes are read for as long as any writer holds them: never closed
while a writer may remain.

Bounds (a client or a guest program controls these counts):

* ``MAX_PROCS`` (64) entries, running and exited. A new entry takes the slot
  of the oldest exited one; when every slot holds a running process, a start
  is refused with ``too_many``.
* An exited entry is kept ``EXITED_KEEP_S`` (10 min) after it exited and its
  output ended, or until it is removed (``remove``) or its slot is taken.
  Reading its status (list, attach) does not remove it.
* An entry removed while a program still holds its output open keeps being
  drained into nothing, by at most ``MAX_ORPHANS`` (128) such drains; past
  that the oldest one's pipes are closed (its writers then get EPIPE).
* Per entry, the command, its arguments, env and cwd as listed are cut to
  ``INFO_BYTES`` of JSON (``truncated`` says so), so a list fits a frame.

The program's group: each process is started in a session (and process
group) of its own, and signals go to that group, so a shell's children get
them too. The pid of an entry whose leader exited stays a group id while a
member of its group lives, so the kernel gives it to no other process
meanwhile.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import json
import os
import signal
import time
from collections.abc import Callable
from typing import Any

from hangar.guest import limits, spawn, terminal, users

RING_BYTES = 1 << 20
"""Bytes of output kept per process; the oldest chunks go first."""
ATTACH_BYTES = 1 << 20
"""Bytes of output waiting for one attached client before its oldest are dropped."""
MAX_PROCS = 64
"""Entries in the table, running and exited."""
MAX_ORPHANS = 128
"""Outputs of removed entries still drained (their writers live on)."""
EXITED_KEEP_S = 600.0
"""Seconds an exited entry whose output ended is kept."""
END_GRACE_S = 0.5
"""Seconds after the exit after which attached clients get the end while a program left
behind still holds the output open."""
INPUT_STALL_S = 5.0
"""Seconds an input write may wait for a process that reads none of it."""
MAX_TAG = 256
"""Characters of a tag."""
INFO_BYTES = 8192
"""Bytes (as JSON) of command, arguments, env and cwd an entry's info carries: 64 entries
stay well within a frame's meta (``protocol.MAX_META``, 1 MiB)."""


class Ring:
    """The last ``limit`` bytes of output, as (stream, chunk) pairs; ``dropped`` counts
    the bytes that went."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.chunks: collections.deque[tuple[str, bytes]] = collections.deque()
        self.size = 0
        self.total = 0
        self.dropped = 0

    def add(self, stream: str, chunk: bytes) -> None:
        self.total += len(chunk)
        self.chunks.append((stream, chunk))
        self.size += len(chunk)
        while self.size > self.limit:
            name, old = self.chunks.popleft()
            over = self.size - self.limit
            if len(old) > over:  # keep the newest part of a chunk that overflows
                self.chunks.appendleft((name, old[over:]))
                old = old[:over]
            self.size -= len(old)
            self.dropped += len(old)

    def clear(self) -> None:
        self.chunks.clear()
        self.size = 0


class Attachment:
    """One client's view of a process: the output waiting for it and a wake-up."""

    def __init__(self) -> None:
        self.queue = Ring(ATTACH_BYTES)
        self.wake = asyncio.Event()

    def push(self, stream: str, chunk: bytes) -> None:
        self.queue.add(stream, chunk)
        self.wake.set()

    def take(self) -> tuple[str, bytes, int] | None:
        """The next chunk and the bytes dropped before it (reset), or None."""
        if not self.queue.chunks:
            return None
        stream, chunk = self.queue.chunks.popleft()
        self.queue.size -= len(chunk)
        dropped, self.queue.dropped = self.queue.dropped, 0
        return stream, chunk, dropped


def _cut(values: list[str], budget: list[int]) -> tuple[list[str], bool]:
    """``values`` while their JSON fits ``budget[0]`` bytes (which it decreases); the one
    that does not fit is cut (conservatively: 12 bytes a character, an escaped astral
    one's worst) and the rest left out. Returns them and whether any was cut."""
    out: list[str] = []
    for v in values:
        size = len(json.dumps(v))
        if size <= budget[0]:
            out.append(v)
            budget[0] -= size
            continue
        if budget[0] >= 12:
            out.append(v[: budget[0] // 12])
        budget[0] = 0
        return out, True
    return out, False


class Proc:
    """One entry: a process the table started or adopted, its output and its status."""

    def __init__(self, table: ProcessTable, pid: int, argv: list[str], env: dict[str, str],
                 cwd: str, *, tag: str | None, origin: str, script: str | None) -> None:
        self.table = table
        self.loop = asyncio.get_running_loop()
        self.pid = pid
        self.argv = argv
        self.env = env
        self.cwd = cwd
        self.tag = tag
        self.origin = origin
        self.script = script
        self.started_at = time.time()
        self.ended_at: float | None = None
        self.exit_mono: float | None = None
        self.returncode: int | None = None
        self.timed_out = False
        self.ring: Ring | None = Ring(RING_BYTES)
        self.attachments: set[Attachment] = set()
        self.cmd: spawn.Command | None = None
        self.master: int | None = None
        self.size: tuple[int, int] | None = None
        self.output_open = True
        self.closed_at = 0.0
        """When the output ended (wall clock, s)."""
        self.input_lock = asyncio.Lock()
        self._timer: asyncio.TimerHandle | None = None
        self.group: limits.Group | None = None
        """Its cgroup (``hangar.guest.limits``): a SIGKILL ends every process in it."""
        self._waiter: asyncio.Task[None] | None = None

    # -- output and status --------------------------------------------------

    def output(self, stream: str, chunk: bytes) -> None:
        """A chunk the process wrote: into the ring and every attached client's queue."""
        if self.ring is not None:
            self.ring.add(stream, chunk)
        for att in self.attachments:
            att.push(stream, chunk)

    def _notify(self) -> None:
        for att in self.attachments:
            att.wake.set()

    def exited(self, rc: int) -> None:
        """The main process was reaped with ``rc`` (``-N``: signal N)."""
        if self.returncode is not None:
            return
        self.returncode = rc
        if self.group is not None:
            self.group.release()  # removed once empty; a kill still reaches what is left
        self.ended_at = time.time()
        self.exit_mono = self.loop.time()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.loop.call_later(END_GRACE_S + 0.01, self._notify)  # a hair late: ``ended``
        self._notify()
        if self.script is not None:  # a long shell script's file (``ops.process.exec_argv``)
            try:
                os.unlink(self.script)
            except OSError:
                pass
            self.script = None

    def output_closed(self) -> None:
        """Every writer of the output has gone."""
        if not self.output_open:
            return
        self.output_open = False
        self._notify()
        if self.cmd is not None:
            self.cmd.close()
        self.table.output_ended(self)

    @property
    def running(self) -> bool:
        return self.returncode is None

    def ended(self, follow: bool) -> bool:
        """True once attached clients get the end (see the module docstring)."""
        if self.returncode is None:
            return False
        if not self.output_open:
            return True
        return not follow and self.exit_mono is not None and (
            self.loop.time() - self.exit_mono >= END_GRACE_S)

    def status(self) -> dict[str, Any]:
        """``running``, ``exit_code`` (128+N for signal N), ``signal``, ``timed_out``."""
        rc = self.returncode
        sig = -rc if rc is not None and rc < 0 else None
        return {"running": rc is None, "exit_code": 128 + sig if sig else rc, "signal": sig,
                "timed_out": self.timed_out}

    def info(self) -> dict[str, Any]:
        """The entry as ``proc_list`` gives it (see ``hangar.guest.ops.processes``)."""
        budget = [INFO_BYTES]
        (cwd,), cut0 = _cut([self.cwd], budget) if len(self.cwd) < 4096 else ([""], True)
        argv, cut1 = _cut(self.argv, budget)
        pairs, cut2 = _cut([f"{k}={v}" for k, v in self.env.items()], budget)
        env = dict(p.partition("=")[::2] for p in pairs)
        ring = self.ring
        return {
            "pid": self.pid, "tag": self.tag, "cmd": argv[0] if argv else "",
            "args": argv[1:], "env": env, "cwd": cwd,
            "truncated": cut0 or cut1 or cut2, "origin": self.origin,
            "pty": self.master is not None,
            "cols": self.size[0] if self.size else None,
            "rows": self.size[1] if self.size else None,
            **self.status(),
            "started_at": round(self.started_at, 3),
            "ended_at": round(self.ended_at, 3) if self.ended_at else None,
            "output_open": self.output_open,
            "output_bytes": ring.total if ring else 0,
            "output_dropped": ring.dropped if ring else 0,
            "stdin_open": self.stdin_open,
        }

    # -- control -------------------------------------------------------------

    @property
    def stdin_open(self) -> bool:
        if self.master is not None:
            return self.output_open
        return self.cmd is not None and self.cmd.stdin is not None

    def signal(self, sig: int) -> bool:
        """Send ``sig`` to the process's group; False when no process of it is left.
        SIGKILL also ends every process of its cgroup (``limits.Group.kill``)."""
        if sig == signal.SIGKILL and self.group is not None:
            alive = self.group.populated()
            self.group.kill()
            if alive:
                try:
                    os.killpg(self.pid, sig)
                except OSError:
                    pass
                return True
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            return False
        except PermissionError:
            return False
        return True

    def expire(self) -> None:
        self._timer = None
        self.timed_out = True
        self.signal(signal.SIGKILL)

    async def write(self, data: bytes) -> None:
        """Write ``data`` to the process's stdin or terminal, in order with other writes.

        Raises BrokenPipeError once its input is closed, TimeoutError when it reads
        none of it for ``INPUT_STALL_S``.
        """
        async with self.input_lock:
            if self.master is not None:
                if not self.output_open:
                    raise BrokenPipeError(errno.EPIPE, "the terminal has closed")
                await _write_fd(self.loop, self.master, data)
                return
            if self.cmd is None or self.cmd.stdin is None:
                raise BrokenPipeError(errno.EPIPE, "stdin is closed")
            await asyncio.wait_for(self.cmd.write_stdin(data), INPUT_STALL_S)

    def close_stdin(self) -> None:
        if self.cmd is not None:
            self.cmd.close_stdin()

    def resize(self, cols: int, rows: int) -> None:
        if self.master is None:
            raise ValueError("not a terminal")
        terminal.set_size(self.master, cols, rows)
        self.size = (cols, rows)

    def discard(self) -> None:
        """Stop keeping output (the entry was removed); reading goes on while writers live."""
        self.ring = None
        for att in self.attachments:
            att.wake.set()

    def close(self) -> None:
        """Close the agent's ends (a terminal's master hangs its session up)."""
        self.output_open = False
        if self.cmd is not None:
            self.cmd.close()
        if self.master is not None:
            self.loop.remove_reader(self.master)
            self.loop.remove_writer(self.master)
            try:
                os.close(self.master)
            except OSError:
                pass
            self.master = None
        self._notify()

    # -- terminal reading ------------------------------------------------------

    def _pty_readable(self) -> None:
        assert self.master is not None
        try:
            chunk = os.read(self.master, 1 << 16)
        except BlockingIOError:
            return
        except OSError:  # EIO: nobody holds the terminal's other end any more
            chunk = b""
        if not chunk:
            self.loop.remove_reader(self.master)
            self.output_closed()
            return
        self.output("pty", chunk)


async def _write_fd(loop: asyncio.AbstractEventLoop, fd: int, data: bytes) -> None:
    """Write all of ``data`` to a non-blocking ``fd``; TimeoutError when it takes nothing
    for ``INPUT_STALL_S``."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
            continue
        except BlockingIOError:
            pass
        ready: asyncio.Future[None] = loop.create_future()

        def wake(f: asyncio.Future[None] = ready) -> None:
            if not f.done():
                f.set_result(None)

        loop.add_writer(fd, wake)
        try:
            await asyncio.wait_for(ready, INPUT_STALL_S)
        finally:
            loop.remove_writer(fd)


class ProcessTable:
    """The agent's processes, by pid; see the module docstring."""

    def __init__(self) -> None:
        self.procs: dict[int, Proc] = {}
        self.orphans: collections.OrderedDict[int, Proc] = collections.OrderedDict()

    # -- lookup ----------------------------------------------------------------

    def sweep(self) -> None:
        """Forget exited entries whose output ended ``EXITED_KEEP_S`` ago."""
        now = time.time()
        for p in list(self.procs.values()):
            if (p.ended_at is not None and not p.output_open
                    and now - max(p.ended_at, p.closed_at) >= EXITED_KEEP_S):
                self.remove(p)

    def find(self, pid: Any = None, tag: Any = None) -> Proc | None:
        """The entry of ``pid``, else the newest with ``tag``; None when there is none."""
        self.sweep()
        if pid is not None:
            return self.procs.get(pid)
        best = None
        for p in self.procs.values():
            if p.tag == tag and (best is None or p.started_at >= best.started_at):
                best = p
        return best

    def entries(self) -> list[Proc]:
        self.sweep()
        return sorted(self.procs.values(), key=lambda p: p.started_at)

    # -- starting ----------------------------------------------------------------

    def _room(self, tag: str | None) -> bool:
        """Make room for one entry; False when every slot holds a running process.
        Raises KeyError when ``tag`` names a running process."""
        self.sweep()
        if tag is not None and any(p.tag == tag and p.running for p in self.procs.values()):
            raise KeyError(tag)
        if len(self.procs) < MAX_PROCS:
            return True
        exited = [p for p in self.procs.values() if not p.running]
        if not exited:
            return False
        self.remove(min(exited, key=lambda p: p.ended_at or 0.0))
        return True

    def _enter(self, proc: Proc) -> None:
        old = self.procs.pop(proc.pid, None)
        if old is not None:
            self._forget(old)
        self.procs[proc.pid] = proc

    async def start(self, argv: list[str], env: dict[str, str], extra_env: dict[str, str],
                    cwd: str, *, tag: str | None, stdin: bool,
                    pty: tuple[int, int] | None, timeout: float | None,
                    script: str | None, user: users.User | None = None,
                    attach: Attachment | None = None,
                    settle: spawn.Settle | None = None,
                    started: Callable[[Proc], object] | None = None) -> Proc:
        """Start ``argv`` as a kept process (as ``user``: ``hangar.guest.users``).
        ``attach``: a client attached from its first byte; ``settle``: the wait for its
        exit (or first output) before it joins the event loop (``spawn.Settle``; pipes
        only, not a terminal); ``started``: called with the entry as soon as its process
        runs, before that wait. Raises KeyError (``tag`` names a running process),
        LookupError (the table is full of running processes), OSError (the program
        cannot start)."""
        if not self._room(tag):
            raise LookupError(f"{MAX_PROCS} processes are running")
        group = limits.new()
        try:
            if pty is None:
                s = spawn.spawn(argv, env, cwd, stdin_pipe=stdin, group=group, user=user)
                proc = Proc(self, s.pid, argv, extra_env, cwd, tag=tag, origin="start",
                            script=script)
                if attach is not None:
                    proc.attachments.add(attach)
                if started is not None:
                    started(proc)
                cmd = spawn.Command(s.pid, s.stdin, s.stdout, s.stderr, proc.output, group=group,
                                    pidfd=s.pidfd, writers=s.writers, settle=settle)
                proc.cmd = cmd
                proc.group = group
                self._watch_pipes(proc, cmd)
            else:
                proc = await self._start_pty(argv, env, extra_env, cwd, tag, pty, script, group,
                                             user)
                if attach is not None:
                    proc.attachments.add(attach)
                if started is not None:
                    started(proc)
        except BaseException:
            group.release()
            raise
        if timeout is not None:
            proc._timer = proc.loop.call_later(timeout, proc.expire)
        self._enter(proc)
        ran = proc.cmd
        if ran is not None and ran.returncode is not None:  # it ended while it settled: its
            proc.exited(ran.returncode)  # end goes out with its start, not a turn later
            if all(f.done() for f in ran.eof.values()):
                proc.output_closed()
        return proc

    def _watch_pipes(self, proc: Proc, cmd: spawn.Command) -> None:
        cmd.exited.add_done_callback(lambda f: proc.exited(f.result()))
        both = asyncio.gather(*cmd.eof.values())
        both.add_done_callback(lambda f: proc.output_closed())

    async def _start_pty(self, argv: list[str], env: dict[str, str],
                         extra_env: dict[str, str], cwd: str, tag: str | None,
                         size: tuple[int, int], script: str | None,
                         group: limits.Group, user: users.User | None) -> Proc:
        master, slave = os.openpty()
        try:
            terminal.set_size(slave, *size)
            os.set_blocking(master, False)
            sub = await asyncio.create_subprocess_exec(
                *argv, stdin=slave, stdout=slave, stderr=slave, cwd=cwd, env=env,
                start_new_session=True,
                preexec_fn=terminal.child_setup(terminal.ignored_signals(), group, user))
        except BaseException:
            os.close(master)
            os.close(slave)
            raise
        os.close(slave)
        proc = Proc(self, sub.pid, argv, extra_env, cwd, tag=tag, origin="start", script=script)
        proc.group = group
        proc.master, proc.size = master, size
        proc.loop.add_reader(master, proc._pty_readable)

        async def wait() -> None:
            proc.exited(await sub.wait())

        proc._waiter = asyncio.create_task(wait())
        return proc

    def adopt(self, cmd: spawn.Command, argv: list[str], extra_env: dict[str, str],
              cwd: str, *, keep: bool = True) -> bool:
        """Take over an exec's pipes that a program it left behind still holds: an entry
        of origin ``exec`` (``keep``), else drained into nothing. False (the caller closes
        them) when they are all closed already."""
        if all(f.done() for f in cmd.eof.values()):
            return False
        proc = Proc(self, cmd.pid, argv, extra_env, cwd, tag=None, origin="exec", script=None)
        proc.cmd = cmd
        proc.group = cmd.group
        cmd.close_stdin()
        cmd.handover(proc.output)
        if cmd.returncode is not None:
            proc.exited(cmd.returncode)
        else:
            cmd.exited.add_done_callback(lambda f: proc.exited(f.result()))
        both = asyncio.gather(*cmd.eof.values())
        both.add_done_callback(lambda f: proc.output_closed())
        if keep and self._room(None):
            self._enter(proc)
        else:
            self._orphan(proc)
        return True

    # -- ending ------------------------------------------------------------------

    def output_ended(self, proc: Proc) -> None:
        """``proc``'s output ended: an adopted entry that never wrote is dropped, an orphan
        is done."""
        proc.closed_at = time.time()
        self.orphans.pop(id(proc), None)
        if proc.master is not None and self.procs.get(proc.pid) is not proc:
            proc.close()  # a removed terminal whose session has ended
        if (proc.origin == "exec" and proc.ring is not None and proc.ring.total == 0
                and self.procs.get(proc.pid) is proc):
            del self.procs[proc.pid]

    def remove(self, proc: Proc) -> None:
        """Forget ``proc``; its output, if still open, is drained into nothing."""
        if self.procs.get(proc.pid) is proc:
            del self.procs[proc.pid]
        self._forget(proc)

    def _forget(self, proc: Proc) -> None:
        proc.discard()
        if proc.output_open and proc.master is None:
            self._orphan(proc)
        elif proc.master is not None and not proc.running:
            proc.close()
        elif proc.master is not None:  # a running terminal no entry names: hang it up
            proc.signal(signal.SIGKILL)

    def _orphan(self, proc: Proc) -> None:
        proc.discard()
        self.orphans[id(proc)] = proc
        while len(self.orphans) > MAX_ORPHANS:
            _, oldest = self.orphans.popitem(last=False)
            oldest.close()


