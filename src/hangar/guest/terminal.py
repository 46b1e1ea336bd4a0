"""The agent's ``pty`` operation: one program on a pseudo-terminal (standard library only).

Frames on the request's channel (``hangar.guest.protocol``; no new kinds)::

    host → guest  REQUEST  {"op": "pty", "argv" | "shell", "env", "cwd", "cols", "rows"}
    guest → host  DATA     {"stream": "pty", "started": true, "pid": N}    (no data; first)
    guest → host  DATA     {"stream": "pty"} + output bytes                 (any number)
    host → guest  DATA     {"stream": "stdin"} + input bytes                (any number)
    host → guest  SIGNAL   {"cols": C, "rows": R}     resize (TIOCSWINSZ; the kernel sends
                                                      SIGWINCH to the foreground group)
    host → guest  SIGNAL   {"signal": N}              signal N to the process group
    host → guest  EOF      {"stream": "stdin"}        hang up: SIGHUP, then SIGKILL after
                                                      ``HANGUP_GRACE_S``
    guest → host  RESPONSE {"exit_code", "signal", "duration_s", "input_dropped"}

The program runs in a new session whose controlling terminal is the pty
(``setsid`` + ``TIOCSCTTY``), so job control, ``tty`` and full-screen programs
work as in a terminal emulator. The agent treats a lost host connection as a
hang-up, so no terminal outlives the server that could reach it.

Flow control: output is read from the pty master only while fewer than
``OUT_QUEUE`` chunks wait to be sent, so a slow host makes the program block
on its writes, as a slow terminal would. Input waits in a backlog of at most
``MAX_INPUT_BACKLOG`` bytes for a program that does not read it; input past
that is dropped and counted (``input_dropped``).
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import signal
import struct
import termios
import time
from collections.abc import Awaitable, Callable
from typing import Any

from hangar.guest import protocol as P

MAX_INPUT_BACKLOG = 1 << 20
"""Bytes of input kept for a program that does not read them."""
OUT_QUEUE = 16
"""Output chunks read ahead of the host before reading pauses."""
DRAIN_GRACE_S = 0.5
"""Seconds to keep reading output after the program exits (background jobs may hold the pty)."""
HANGUP_GRACE_S = 2.0
"""Seconds between SIGHUP and SIGKILL when the host hangs up."""
MAX_SIDE = 1000
"""Largest number of columns or rows."""

Send = Callable[..., Awaitable[None]]


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


async def run(send: Send, cid: int, inbox: asyncio.Queue[P.Frame], argv: list[str],
              env: dict[str, str], cwd: str, cols: int, rows: int) -> dict[str, Any]:
    """Run ``argv`` on a new pty until it exits; see the module docstring.

    Raises OSError when the program cannot be started.
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
    await send(P.Kind.DATA, cid, {"stream": "pty", "started": True, "pid": proc.pid})

    out: asyncio.Queue[bytes | None] = asyncio.Queue()
    state: dict[str, Any] = {"reading": True, "eof": False, "dropped": 0, "sending": False,
                             "last_read": 0.0}
    backlog = bytearray()

    def killpg(sig: int) -> None:
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def readable() -> None:
        try:
            data = os.read(master, P.CHUNK)
        except BlockingIOError:
            return
        except OSError:  # EIO: no process holds the pty's other end any more
            data = b""
        if not data:
            loop.remove_reader(master)
            state["reading"] = False
            state["eof"] = True
            out.put_nowait(None)
            return
        out.put_nowait(data)
        state["last_read"] = loop.time()
        if out.qsize() >= OUT_QUEUE:
            loop.remove_reader(master)
            state["reading"] = False

    def writable() -> None:
        try:
            n = os.write(master, backlog)
        except BlockingIOError:
            return
        except OSError:
            n = len(backlog)
        del backlog[:n]
        if not backlog:
            loop.remove_writer(master)

    hangup: asyncio.TimerHandle | None = None

    def hang_up() -> None:
        nonlocal hangup
        killpg(signal.SIGHUP)
        killpg(signal.SIGCONT)
        if hangup is None:
            hangup = loop.call_later(HANGUP_GRACE_S, killpg, signal.SIGKILL)

    async def pump() -> None:
        while True:
            chunk = await out.get()
            if chunk is None:
                return
            parts = [chunk]
            size = len(chunk)
            while size < P.CHUNK and not out.empty():
                more = out.get_nowait()
                if more is None:
                    out.put_nowait(None)
                    break
                parts.append(more)
                size += len(more)
            if not state["reading"] and not state["eof"] and out.qsize() < OUT_QUEUE // 2:
                state["reading"] = True
                loop.add_reader(master, readable)
            state["sending"] = True
            try:
                await send(P.Kind.DATA, cid, {"stream": "pty"}, b"".join(parts))
            finally:
                state["sending"] = False

    async def feed() -> None:
        while True:
            frame = await inbox.get()
            if frame.kind == P.Kind.DATA:
                room = MAX_INPUT_BACKLOG - len(backlog)
                take = frame.data[:max(0, room)]
                state["dropped"] += len(frame.data) - len(take)
                if take:
                    if not backlog:
                        loop.add_writer(master, writable)
                    backlog.extend(take)
            elif frame.kind == P.Kind.EOF:
                hang_up()
            elif frame.kind == P.Kind.SIGNAL:
                meta = frame.meta
                if meta.get("disconnect"):
                    hang_up()
                elif "cols" in meta or "rows" in meta:
                    try:
                        set_size(master, *check_size(meta.get("cols"), meta.get("rows")))
                    except (ValueError, OSError):
                        pass
                else:
                    sig = meta.get("signal", signal.SIGKILL)
                    if isinstance(sig, int) and 0 < sig < 65:
                        killpg(sig)

    loop.add_reader(master, readable)
    pumper = asyncio.create_task(pump())
    feeder = asyncio.create_task(feed())
    try:
        rc = await proc.wait()
        # Deliver what the program wrote; stop waiting once nothing has come for
        # DRAIN_GRACE_S (a background job may hold the pty open for ever).
        while not pumper.done():
            await asyncio.wait({pumper}, timeout=DRAIN_GRACE_S)
            if (not state["sending"] and out.empty()
                    and loop.time() - state["last_read"] >= DRAIN_GRACE_S):
                break
    finally:
        if proc.returncode is None:  # cancelled: never leave the group behind
            killpg(signal.SIGKILL)
        if hangup is not None:
            hangup.cancel()
        for t in (pumper, feeder):
            t.cancel()
        await asyncio.gather(pumper, feeder, return_exceptions=True)
        loop.remove_reader(master)
        loop.remove_writer(master)
        os.close(master)
    sig = -rc if rc < 0 else None
    return {"exit_code": 128 + sig if sig else rc, "signal": sig,
            "duration_s": round(time.monotonic() - started, 6),
            "input_dropped": state["dropped"]}
