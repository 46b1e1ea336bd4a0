"""The agent's ``pty`` operation: one program on a pseudo-terminal (standard library only).

Frames on the request's channel (``hangar.guest.protocol``, version 2)::

    host → guest  REQUEST  {"op": "pty", "argv" | "shell", "env", "cwd", "cols", "rows"}
    guest → host  DATA     {"stream": "pty", "started": true, "pid": N}    (no data; first)
    guest → host  DATA     {"stream": "pty"} + output bytes                 (any number)
    host → guest  DATA     {"stream": "stdin"} + input bytes                (any number)
    host → guest  SIGNAL   {"cols": C, "rows": R}     resize (TIOCSWINSZ; the kernel sends
                                                      SIGWINCH to the foreground group)
    host → guest  SIGNAL   {"signal": N}              signal N to the process group
    host → guest  SIGNAL   {"hangup": true}           hang up: SIGHUP (and SIGCONT) to the
                                                      group, SIGKILL ``HANGUP_GRACE_S`` later;
                                                      output and the RESPONSE still come
    host → guest  CANCEL                              the host abandons the terminal: hang up
                                                      as above, and send nothing more
    guest → host  RESPONSE {"exit_code", "signal", "duration_s", "input_dropped"}

The program runs in a new session whose controlling terminal is the pty
(``setsid`` + ``TIOCSCTTY``), so job control, ``tty`` and full-screen programs
work as in a terminal emulator. It starts with every signal at its default
action and none blocked, as a login session does, whatever the agent itself
ignores: a shell cannot trap a signal that was ignored when it started, so
an agent run under ``nohup`` would otherwise make every hang-up deaf. A lost
host connection cancels the request (``Session.close``), which hangs up as
CANCEL does, so no terminal outlives the server that could reach it. Input
has no end of its own: a terminal ends when its program exits or by a
hang-up (an EOF from the host is ignored).

Flow control, both ways (``Channel.stream``, ``Channel.get`` and ``Channel.ack``):

* Output: the pty master is read one chunk (at most ``CHUNK`` bytes) at a
  time, and the next read waits until that chunk went out within the host's
  window. So a host that reads slowly makes the program block on its writes
  once the pty's own buffer is full, as a slow terminal would; nothing is
  read ahead.
* Input: frames are taken off the channel as they come, so a resize, a
  signal or a hang-up acts at once, but the window is granted back only as
  the input is written into the pty, i.e. as the program reads it: a paste
  larger than the window waits in the host for a program that reads slowly,
  and at most one window waits here. Input that the program has left
  unread for ``INPUT_STALL_S`` (it read none of it) is dropped and counted
  (``input_dropped``), and so is later input until it reads again, as a
  terminal discards typeahead: a program that never reads cannot hold its
  host's writes for longer than that.

After the program exits, its output is read until nothing came for
``DRAIN_GRACE_S`` (a background job may hold the pty open), for at most
``DRAIN_MAX_S`` of time in which the host's window was open.
"""

from __future__ import annotations

import asyncio
import collections
import fcntl
import os
import signal
import struct
import termios
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hangar.guest import limits, users
from hangar.guest import protocol as P

if TYPE_CHECKING:
    from hangar.guest.channel import Channel

INPUT_STALL_S = 5.0
"""Seconds input may wait for a program that reads none of it before it is dropped."""
DRAIN_GRACE_S = 0.5
"""Seconds of quiet after which the output of a program that exited is taken as complete."""
DRAIN_MAX_S = 2.0
"""Seconds at most to read output after the program exited (not counting waits for the
host's window): a background job that holds the pty and writes for ever is cut off."""
HANGUP_GRACE_S = 2.0
"""Seconds between SIGHUP and SIGKILL when the host hangs up."""
MAX_SIDE = 1000
"""Largest number of columns or rows."""


def set_size(fd: int, cols: int, rows: int) -> None:
    """Set a terminal's size in characters (``TIOCSWINSZ``, struct winsize of tty_ioctl(4))."""
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def check_size(cols: Any, rows: Any) -> tuple[int, int]:
    """(cols, rows) when both are integers in 1..``MAX_SIDE``; ValueError otherwise."""
    for v in (cols, rows):
        if not isinstance(v, int) or isinstance(v, bool) or not 0 < v <= MAX_SIDE:
            raise ValueError(f"cols and rows must be integers from 1 to {MAX_SIDE}")
    return cols, rows


def ignored_signals() -> tuple[int, ...]:
    """Signals the agent ignores (``SIG_IGN``), as it inherited them or set them itself.

    A child inherits ignored signals across ``exec``, and POSIX lets no
    non-interactive shell trap a signal that was ignored when it started:
    an agent started with SIGHUP ignored (``nohup``, a runner's background
    job) would make every hang-up deaf, the program's HUP trap would never
    run, and only the SIGKILL ``HANGUP_GRACE_S`` later would end it.
    """
    out = []
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            if signal.getsignal(sig) == signal.SIG_IGN:
                out.append(int(sig))
        except (OSError, ValueError):
            continue
    return tuple(out)


def child_setup(ignored: tuple[int, ...], group: limits.Group | None = None,
                user: users.User | None = None) -> Callable[[], None]:
    """The child's set-up, run after ``setsid`` and before ``exec``: into ``group`` (its
    cgroup, ``hangar.guest.limits``), every signal at its
    default action and none blocked, as a login session starts (whatever the agent
    inherited: see ``ignored_signals``); then stdin (the pty) becomes the controlling
    terminal; last, the child becomes ``user`` (``hangar.guest.users.drop_in_child``)."""

    def setup() -> None:
        if group is not None:
            group.join_self()
        for sig in ignored:
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, ())
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)
        if user is not None and users.switches(user):
            users.drop_in_child(user)

    return setup


async def _readable(fd: int) -> None:
    """Wait until ``fd`` can be read (or has hung up)."""
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(fd, wake)
    try:
        await ready
    finally:
        loop.remove_reader(fd)


class _Input:
    """Input on its way into the pty master; see "Input" in the module docstring.

    Frames wait in ``backlog`` (the bytes left of each, and the frame's size)
    until the pty takes them; each frame's window is granted back once all
    of its bytes are in the pty.
    """

    def __init__(self, ch: Channel, master: int) -> None:
        self.ch = ch
        self.master = master
        self.loop = asyncio.get_running_loop()
        self.backlog: collections.deque[list[Any]] = collections.deque()
        self.since = self.loop.time()
        """When the pty last took input, or input began to wait."""
        self.stalled = False
        """The program read nothing for ``INPUT_STALL_S``: input is dropped until it reads."""
        self.dropped = 0
        self.timer: asyncio.TimerHandle | None = None

    def take(self, frame: P.Frame) -> None:
        """A DATA frame from the host (taken with ``get(ack=False)``)."""
        if not frame.data:
            self.ch.ack(frame.size)
            return
        if not self.backlog:
            self.since = self.loop.time()  # the clock starts as input begins to wait
        self.backlog.append([memoryview(frame.data), frame.size])
        if len(self.backlog) > 1:
            return  # the writer is registered and the clock runs
        if not self.push() and self.stalled:  # still reads nothing: drop at once
            self.discard(count=True)
            return
        if self.backlog:
            self.loop.add_writer(self.master, self.push)
            if self.timer is None:
                self.timer = self.loop.call_later(INPUT_STALL_S, self.check)

    def push(self) -> int:
        """Write waiting input into the pty as far as it takes it; returns bytes written."""
        wrote = 0
        while self.backlog:
            entry = self.backlog[0]
            try:
                n = os.write(self.master, entry[0])
            except BlockingIOError:
                break
            except OSError:  # the program closed its end: the input goes nowhere
                self.discard(count=False)
                break
            if n:
                wrote += n
                self.since = self.loop.time()
                self.stalled = False
            if n < len(entry[0]):
                entry[0] = entry[0][n:]
                break
            self.backlog.popleft()
            self.ch.ack(entry[1])  # the program has it: the host may send as much again
        if not self.backlog:
            self.loop.remove_writer(self.master)
        return wrote

    def check(self) -> None:
        self.timer = None
        if not self.backlog:
            return
        idle = self.loop.time() - self.since
        if idle >= INPUT_STALL_S:  # the program read none of it: drop what waits
            self.discard(count=True)
            self.stalled = True
        else:
            self.timer = self.loop.call_later(INPUT_STALL_S - idle, self.check)

    def discard(self, count: bool) -> None:
        """Drop the input that waits, granting its window back."""
        while self.backlog:
            view, size = self.backlog.popleft()
            if count:
                self.dropped += len(view)
            self.ch.ack(size)
        self.loop.remove_writer(self.master)

    def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.loop.remove_writer(self.master)


async def run(ch: Channel, argv: list[str], env: dict[str, str], cwd: str, cols: int,
              rows: int) -> dict[str, Any]:
    """Run ``argv`` on a new pty until it exits; see the module docstring.

    Returns the RESPONSE meta. Raises OSError when the program cannot be
    started. Cancelled (CANCEL, or the host's connection went), it hangs the
    program up and returns nothing.
    """
    loop = asyncio.get_running_loop()
    master, slave = os.openpty()
    group = limits.Group()
    try:
        set_size(slave, cols, rows)
        os.set_blocking(master, False)
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=slave, stdout=slave, stderr=slave, cwd=cwd, env=env,
            start_new_session=True, preexec_fn=child_setup(ignored_signals(), group))
    except BaseException:
        group.release()
        os.close(master)
        os.close(slave)
        raise
    os.close(slave)
    started = time.monotonic()
    state: dict[str, Any] = {"sending": False, "last_read": loop.time()}
    hangup: asyncio.TimerHandle | None = None
    keys = _Input(ch, master)

    def killpg(sig: int) -> None:
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        if sig == signal.SIGKILL:
            group.kill()  # what it left behind in other sessions too

    def hang_up() -> None:
        nonlocal hangup
        killpg(signal.SIGHUP)
        killpg(signal.SIGCONT)
        if hangup is None:  # left to run: it also ends the group's members left behind
            hangup = loop.call_later(HANGUP_GRACE_S, killpg, signal.SIGKILL)

    async def pump() -> None:
        """Output: one chunk read, then sent within the host's window, then the next."""
        while True:
            await _readable(master)
            try:
                data = os.read(master, P.CHUNK)
            except BlockingIOError:
                continue
            except OSError:  # EIO: no process holds the pty's other end any more
                return
            if not data:
                return
            state["last_read"] = loop.time()
            state["sending"] = True
            try:
                await ch.stream({"stream": "pty"}, data)
            finally:
                state["sending"] = False

    async def feed() -> None:
        """Input and control frames, taken as they come; input's window is granted back
        as the pty takes it (``_Input``)."""
        while True:
            frame = await ch.get(ack=False)
            if frame.kind == P.Kind.DATA:
                keys.take(frame)
                continue
            if frame.kind in P.FLOW_KINDS:
                ch.ack(frame.size)  # EOF: input has no end of its own
            if frame.kind != P.Kind.SIGNAL:
                continue
            meta = frame.meta
            if meta.get("hangup"):
                hang_up()
            elif "cols" in meta or "rows" in meta:
                try:
                    set_size(master, *check_size(meta.get("cols"), meta.get("rows")))
                except (ValueError, OSError):
                    pass
            else:
                sig = meta.get("signal")
                if isinstance(sig, int) and not isinstance(sig, bool) and 0 < sig < 65:
                    killpg(sig)

    tasks: list[asyncio.Task[None]] = []
    try:
        await ch.stream({"stream": "pty", "started": True, "pid": proc.pid})  # first
        pumper = asyncio.create_task(pump())
        tasks += [pumper, asyncio.create_task(feed())]
        rc = await proc.wait()
        # Deliver what the program wrote: until the pty is quiet for DRAIN_GRACE_S, for at
        # most DRAIN_MAX_S while the host's window is open (a background job may hold the
        # pty open and write for ever).
        exited = loop.time()
        spent = 0.0
        while not pumper.done():
            t = loop.time()
            await asyncio.wait({pumper}, timeout=0.1)
            if state["sending"]:
                continue  # the host's window is full: its reader sets the pace
            spent += loop.time() - t
            quiet = loop.time() - max(state["last_read"], exited)
            if quiet >= DRAIN_GRACE_S or spent >= DRAIN_MAX_S:
                break
    except asyncio.CancelledError:
        hang_up()  # CANCEL or a lost connection: hang up, as closing a terminal does
        raise
    finally:
        if proc.returncode is None and hangup is None:  # never leave the group behind
            killpg(signal.SIGKILL)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        keys.close()
        os.close(master)
        group.release()
    sig = -rc if rc < 0 else None
    return {"exit_code": 128 + sig if sig else rc, "signal": sig,
            "duration_s": round(time.monotonic() - started, 6),
            "input_dropped": keys.dropped}
