"""VMM processes: spawn, pid file, log tail, kill and reap. Shared by every engine.

A VMM runs in its own session (``start_new_session``) so that a restarted
Hangar server can find and adopt it by its pid file and its command line,
and so that a signal to the server's process group never reaches it. Its pid
is written to the sandbox's ``vmm.pid`` (``hangar.layout.SandboxPaths``)
right after the start; its stdout and stderr go to files the caller names.

``VMMProcesses`` remembers the children this server started, so that each
is reaped (no zombie) once it exits; a VMM adopted from an earlier server is
not our child and is watched through ``/proc`` instead.

A confined VMM (``hangar.engines.confine.Plan``) is started through
``hangar.engines.vmm_exec``, which joins its cgroup, builds its private
view, drops to its user and execs it under the same pid. Its stdout, the
guest's serial console, may go through a pipe to a console logger
(``multilog``) that caps and rotates it; the logger ends when the VMM does.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hangar.engines.confine import Plan

log = logging.getLogger("hangar.engine.process")

KILL_WAIT_S = 5.0
"""Seconds to wait for a process to be gone after SIGKILL."""


def alive(pid: int) -> bool:
    """True while process ``pid`` exists and is not a zombie (read from ``/proc``)."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return False


def argv_of(pid: int) -> list[str] | None:
    """Process ``pid``'s command line from ``/proc``, or None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return [a.decode(errors="replace") for a in raw.split(b"\0")[:-1]]


def kill_process(pid: int | None) -> None:
    """SIGKILL the single process ``pid``, ignoring one that is already gone.

    Only real process ids (> 1) are signalled: ``kill(-1)`` would end every
    process on the host and ``kill(0)`` our own process group.
    """
    if pid is None or pid <= 1:
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def read_pid(pid_file: Path) -> int | None:
    """The pid in ``pid_file``, or None when it is missing or garbled."""
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if pid > 1 else None


def tail(path: Path, lines: int = 3) -> str:
    """The last ``lines`` non-empty lines of a log file joined by `` | ``; "" when none."""
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(line for line in text[-lines:] if line.strip())


class VMMProcesses:
    """The VMM processes this server started; one per engine."""

    def __init__(self) -> None:
        self._children: dict[int, subprocess.Popen[bytes]] = {}
        self._loggers: dict[int, subprocess.Popen[bytes]] = {}

    def spawn(self, argv: Sequence[str], *, cwd: Path, pid_file: Path, stdout: Path,
              stderr: Path | None = None, plan: "Plan | None" = None,
              console: Sequence[str] | None = None,
              pass_fds: Sequence[int] = ()) -> subprocess.Popen[bytes]:
        """Start ``argv`` in its own session in ``cwd`` and write its pid to ``pid_file``.

        stdout is appended to ``stdout``, stderr to ``stderr`` (default: the
        same file); stdin is /dev/null. With ``console`` (a logger's argv, such
        as ``Confinement.console_argv``, whose last item is its folder), stdout
        goes through a pipe to that logger instead, which ends when the VMM's
        end of the pipe closes. With ``plan`` the VMM (and the logger, seeing
        only ``/usr`` and its folder: ``Plan.for_logger``) is
        started by ``hangar.engines.vmm_exec``, which confines it and execs it
        under the same pid. ``pass_fds`` stay open in the VMM under their
        numbers. Raises ``OSError`` when it cannot start.
        """
        vmm_argv = plan.wrap(list(argv)) if plan is not None else list(argv)
        logger: subprocess.Popen[bytes] | None = None
        err_path = stderr if stderr is not None else stdout
        with open(err_path, "ab") as err:
            if console:
                r, w = os.pipe()
                try:
                    log_argv = (plan.for_logger(Path(console[-1])).wrap(list(console))
                                if plan is not None else list(console))
                    logger = subprocess.Popen(log_argv, stdin=r, stdout=subprocess.DEVNULL,
                                              stderr=err, start_new_session=True, cwd=cwd)
                    proc = subprocess.Popen(vmm_argv, stdin=subprocess.DEVNULL, stdout=w,
                                            stderr=err, start_new_session=True, cwd=cwd,
                                            pass_fds=tuple(pass_fds))
                except OSError:
                    if logger is not None:
                        kill_process(logger.pid)
                        logger.wait()
                    raise
                finally:
                    os.close(r)
                    os.close(w)
            else:
                with open(stdout, "ab") as out:
                    proc = subprocess.Popen(
                        vmm_argv, stdin=subprocess.DEVNULL, stdout=out,
                        stderr=err if stderr is not None else subprocess.STDOUT,
                        start_new_session=True, cwd=cwd, pass_fds=tuple(pass_fds))
        self._children[proc.pid] = proc
        if logger is not None:
            self._loggers[proc.pid] = logger
        try:
            pid_file.write_text(f"{proc.pid}\n")
        except OSError:
            kill_process(proc.pid)
            proc.wait()
            self._children.pop(proc.pid, None)
            self._reap_logger(proc.pid, force=True)
            raise
        return proc

    def _reap_logger(self, pid: int, force: bool = False) -> None:
        """Reap the console logger of VMM ``pid`` once it has seen EOF (or kill it)."""
        logger = self._loggers.get(pid)
        if logger is None:
            return
        if force:
            kill_process(logger.pid)
            logger.wait()
        elif logger.poll() is None:
            try:
                logger.wait(timeout=1)
            except subprocess.TimeoutExpired:
                kill_process(logger.pid)
                logger.wait()
        self._loggers.pop(pid, None)

    def child(self, pid: int) -> subprocess.Popen[bytes] | None:
        """Our ``Popen`` of ``pid``, if this server started it and has not reaped it."""
        return self._children.get(pid)

    def exited(self, pid: int) -> bool:
        """Reap ``pid`` if it is our child and has exited; True when it is gone."""
        proc = self._children.get(pid)
        if proc is not None:
            if proc.poll() is None:
                return False
            self._children.pop(pid, None)
            self._reap_logger(pid)
            return True
        return not alive(pid)

    async def wait_gone(self, pid: int, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for ``pid`` to exit (reaping it); True if it did."""
        deadline = time.monotonic() + timeout
        delay = 0.01
        while not self.exited(pid):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.1)
        return True

    async def kill(self, pid: int | None, wait: float = KILL_WAIT_S) -> None:
        """SIGKILL ``pid`` and wait up to ``wait`` seconds until it is gone and reaped."""
        if pid is None or pid <= 1:
            return
        kill_process(pid)
        if not await self.wait_gone(pid, wait):
            log.warning("VMM %d did not exit after SIGKILL", pid)
