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
work as in a terminal emulator. A lost host connection cancels the request
(``Session.close``), which hangs up as CANCEL does, so no terminal outlives
the server that could reach it. Input has no end of its own: a terminal
ends when its program exits or by a hang-up (an EOF from the host is ignored).

Flow control, both ways (``Channel.stream`` and ``Channel.get``):

* Output: the pty master is read one chunk (at most ``CHUNK`` bytes) at a
  time, and the next read waits until that chunk went out within the host's
  window. So a host that reads slowly makes the program block on its writes
  once the pty's own buffer is full, as a slow terminal would; nothing is
  read ahead.
* Input: frames are taken off the channel as they come (granting the host
  window back at once), into a backlog of at most ``MAX_INPUT_BACKLOG``
  bytes for a program that does not read; input past that is dropped and
  counted (``input_dropped``), as a terminal's line discipline drops what
  overflows its buffer. The host's writes never wait on the program, only
  on the agent, so a host waiting for window knows the agent is stuck.

After the program exits, its output is read until nothing came for
``DRAIN_GRACE_S`` (a background job may hold the pty open), for at most
``DRAIN_MAX_S`` of time in which the host's window was open.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import signal
import struct
import termios
import time
from typing import TYPE_CHECKING, Any

from hangar.guest import protocol as P

if TYPE_CHECKING:
    from hangar.guest.agent import Channel

MAX_INPUT_BACKLOG = 1 << 20
"""Bytes of input kept for a program that does not read them."""
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


def _controlling_tty() -> None:
    """In the child, after ``setsid``: make stdin (the pty) the controlling terminal."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


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


async def run(ch: Channel, argv: list[str], env: dict[str, str], cwd: str, cols: int,
              rows: int) -> dict[str, Any]:
    """Run ``argv`` on a new pty until it exits; see the module docstring.

    Returns the RESPONSE meta. Raises OSError when the program cannot be
    started. Cancelled (CANCEL, or the host's connection went), it hangs the
    program up and returns nothing.
    """
    loop = asyncio.get_running_loop()
    master, slave = os.openpty()
    try:
        set_size(slave, cols, rows)
        os.set_blocking(master, False)
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=slave, stdout=slave, stderr=slave, cwd=cwd, env=env,
            start_new_session=True, preexec_fn=_controlling_tty)
    except BaseException:
        os.close(master)
        os.close(slave)
        raise
    os.close(slave)
    started = time.monotonic()
    state: dict[str, Any] = {"sending": False, "last_read": loop.time(), "dropped": 0}
    backlog = bytearray()
    hangup: asyncio.TimerHandle | None = None

    def killpg(sig: int) -> None:
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def hang_up() -> None:
        nonlocal hangup
        killpg(signal.SIGHUP)
        killpg(signal.SIGCONT)
        if hangup is None:  # left to run: it also ends the group's members left behind
            hangup = loop.call_later(HANGUP_GRACE_S, killpg, signal.SIGKILL)

    def writable() -> None:
        try:
            n = os.write(master, backlog)
        except BlockingIOError:
            return
        except OSError:  # the program closed its end: the input goes nowhere
            n = len(backlog)
        del backlog[:n]
        if not backlog:
            loop.remove_writer(master)

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
        """Input and control frames, taken as they come (``get`` grants window back)."""
        while True:
            frame = await ch.get()
            if frame.kind == P.Kind.DATA:
                room = MAX_INPUT_BACKLOG - len(backlog)
                take = frame.data[:max(0, room)]
                state["dropped"] += len(frame.data) - len(take)
                if take:
                    if not backlog:
                        loop.add_writer(master, writable)
                    backlog.extend(take)
            elif frame.kind == P.Kind.SIGNAL:
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
        loop.remove_writer(master)
        os.close(master)
    sig = -rc if rc < 0 else None
    return {"exit_code": 128 + sig if sig else rc, "signal": sig,
            "duration_s": round(time.monotonic() - started, 6),
            "input_dropped": state["dropped"]}
