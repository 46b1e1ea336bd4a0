"""``hangar shell ID``: a sandbox's terminal in the user's own terminal (public SDK only).

The local terminal is put in raw mode (every key, ctrl+c included, goes to
the sandbox), its size is sent at start and on every SIGWINCH, and the
command exits with the remote program's exit code (1 when it is unknown).
Output is written by a thread that reads the session's WebSocket; keys are
read in the main thread. When the connection drops, the session is
attached again (``RECONNECTS`` times, ``RECONNECT_DELAY_S`` apart) from the
last byte received, so nothing printed meanwhile is lost. The remote
``TERM`` is the local one when the guest is likely to know it, else
``xterm-256color``.

When the standard input is not a terminal (``echo date | hangar shell ID``,
a file, /dev/null), the session still runs on an 80x24 terminal, and the
end of the input is a ctrl+d at the start of a line (see ``end_of_input``
for a last line without a newline), as a user would type it. No command given, the
shell is ``PIPED_SHELL``: bash with its line editor off, so the terminal
stays in line mode. (With the editor on, a ctrl+d that arrives before bash
has switched the terminal to its raw mode is turned into a NUL byte by the
kernel's line discipline, so bash never sees the end, and the session
would never end.) The command exits with the shell's status: its last
command's.
"""

from __future__ import annotations

import os
import selectors
import signal
import sys
import termios
import threading
import time
import tty
from typing import Any

from hangar.client import Hangar, Terminal
from hangar.errors import HangarError

RECONNECTS = 5
RECONNECT_DELAY_S = 1.0
PIPED_SHELL = ("if [ -x /bin/bash ]; then exec /bin/bash --noediting -l; "
               "else exec /bin/sh -l; fi")
"""The program of a session whose input is not a terminal, when no command is given."""
KNOWN_TERMS = ("xterm", "xterm-256color", "xterm-color", "screen", "screen-256color", "tmux",
               "tmux-256color", "linux", "vt100", "vt220", "rxvt-unicode", "dumb")
"""Terminal types of Debian's ncurses-base, which every guest image has."""


def _size(fd: int) -> tuple[int, int]:
    try:
        s = os.get_terminal_size(fd)
    except OSError:
        return 80, 24
    if s.columns <= 0 or s.lines <= 0:  # a terminal that never had a size set
        return 80, 24
    return min(s.columns, 1000), min(s.lines, 1000)


def run(h: Hangar, sandbox_id: str, command: str | None = None, cwd: str | None = None) -> int:
    """Run the session until its program ends; the exit code to leave with."""
    fd_in, fd_out = sys.stdin.fileno(), sys.stdout.fileno()
    interactive = os.isatty(fd_in)
    if not interactive and command is None:
        command = PIPED_SHELL
    cols, rows = _size(fd_in if interactive else fd_out)
    local = os.environ.get("TERM", "")
    env = {"TERM": local if local in KNOWN_TERMS else "xterm-256color"}
    term = h.terminal(sandbox_id, command, cols=cols, rows=rows, cwd=cwd, env=env)
    lock = threading.Lock()
    done_r, done_w = os.pipe()
    winch_r, winch_w = os.pipe()
    failure: list[HangarError] = []

    def receive() -> None:
        tries = 0
        try:
            while True:
                try:
                    data = term.recv()
                except HangarError as exc:
                    if tries >= RECONNECTS:
                        failure.append(exc)
                        return
                    tries += 1
                    time.sleep(RECONNECT_DELAY_S)
                    try:
                        with lock:
                            term.reattach()
                    except HangarError as again:
                        failure[:] = [again]
                    continue
                if not data:
                    return
                tries = 0
                os.write(fd_out, data)
        finally:
            os.write(done_w, b"x")

    def on_winch(signum: int, frame: Any) -> None:
        os.write(winch_w, b"w")

    old = termios.tcgetattr(fd_in) if interactive else None
    previous = signal.signal(signal.SIGWINCH, on_winch) if interactive else None
    reader = threading.Thread(target=receive, name="hangar-shell-output", daemon=True)
    sel = selectors.DefaultSelector()
    try:
        if interactive:
            tty.setraw(fd_in)
        reader.start()
        try:
            sel.register(fd_in, selectors.EVENT_READ, "in")
        except PermissionError:  # a regular file or /dev/null: no waiting, read it whole
            last = b"\n"
            while data := os.read(fd_in, 1 << 14):
                _send(term, lock, data=data)
                last = data[-1:]
            _send(term, lock, data=end_of_input(last))
        last = b"\n"
        sel.register(winch_r, selectors.EVENT_READ, "winch")
        sel.register(done_r, selectors.EVENT_READ, "done")
        while True:
            for key, _ in sel.select():
                if key.data == "done":
                    reader.join()
                    if failure and not term.exited:
                        raise failure[-1]
                    return term.exit_code if term.exit_code is not None else 1
                if key.data == "winch":
                    os.read(winch_r, 64)
                    _send(term, lock, size=_size(fd_in))
                    continue
                data = os.read(fd_in, 1 << 14)
                if not data:  # stdin ended (not a terminal): end of input for the program
                    sel.unregister(fd_in)
                    data = end_of_input(last)
                last = data[-1:]
                _send(term, lock, data=data)
    finally:
        sel.close()
        if old is not None:
            termios.tcsetattr(fd_in, termios.TCSADRAIN, old)
        if interactive:
            signal.signal(signal.SIGWINCH, previous)
        for fd in (done_r, done_w, winch_r, winch_w):
            os.close(fd)
        term.close()


def end_of_input(last: bytes) -> bytes:
    """The keys that end a terminal's input in line mode after ``last`` was sent: ctrl+d.

    After a line left open, the first ctrl+d only hands that line over; the
    second ends the input of a program that reads bytes (``cat``), while a
    shell takes it as the end of its last line and runs it, so a third ends
    the shell's input too. One that is left over is an end of input still.
    """
    return b"\x04" if last in (b"\n", b"\r", b"\x04", b"") else b"\x04\x04\x04"


def _send(term: Terminal, lock: threading.Lock, data: bytes | None = None,
          size: tuple[int, int] | None = None) -> None:
    """Send keys or a new size; dropped while the connection is down (the reader reattaches)."""
    try:
        with lock:
            if data is not None:
                term.send(data)
            if size is not None:
                term.resize(*size)
    except HangarError:
        pass
