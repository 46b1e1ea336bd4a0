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
view, forks into a new pid namespace (``Plan.pid_ns``: the VMM is pid 1
there; ``vmm_exec`` reports its host pid on a pipe and exits), drops to its
user and execs it. Such a VMM is not our child but our orphaned grandchild:
the server makes itself a child subreaper (``PR_SET_CHILD_SUBREAPER``), so
the VMM is reparented to it, its host pid cannot be reused until the server
reaps it, and ``VMMHandle`` reaps it with ``waitpid``. A launcher that
writes the VMM's pid to a file (Firecracker's jailer with ``--new-pid-ns``)
is handled the same way (``spawn(pid_from=...)``). Its stdout, the
guest's serial console, may go through a pipe to a console logger
(``multilog``) that caps and rotates it; the logger ends when the VMM does.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from hangar.engines import safefs
from hangar.errors import HangarError

if TYPE_CHECKING:
    from hangar.engines.confine import Plan
    from hangar.privileged import Client

log = logging.getLogger("hangar.engine.process")

KILL_WAIT_S = 5.0
"""Seconds to wait for a process to be gone after SIGKILL."""
REPORT_WAIT_S = 30.0
"""Seconds a launcher gets to report the VMM's pid (it does within milliseconds)."""
PR_SET_CHILD_SUBREAPER = 36

_subreaper = False


def become_subreaper() -> None:
    """Make this process the reaper of its orphaned descendants (once; never raises)."""
    global _subreaper
    if _subreaper:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0:
        _subreaper = True
    else:
        log.warning("cannot become a child subreaper: %s", os.strerror(ctypes.get_errno()))


class VMMHandle:
    """A VMM this server started, by its host pid: ``pid``, ``poll()``, ``wait()``.

    Either our direct child (``popen``), or a descendant reparented to us
    (the server is a subreaper), reaped with ``waitpid``; if it is neither
    (no subreaper), its end is read from ``/proc``.
    """

    def __init__(self, pid: int, popen: subprocess.Popen[bytes] | None = None) -> None:
        self.pid = pid
        self.popen = popen
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """None while it runs; its exit code (or -signal) once it ended and was reaped."""
        if self.popen is not None:
            return self.popen.poll()
        if self.returncode is not None:
            return self.returncode
        try:
            got, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            if alive(self.pid):
                return None
            self.returncode = -9
            return self.returncode
        if got == 0:
            return None
        self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Block until it ended; raises ``subprocess.TimeoutExpired`` after ``timeout`` s."""
        if self.popen is not None:
            return self.popen.wait(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0)
            time.sleep(0.01)
        return code


def _read_report(fd: int, launcher: subprocess.Popen[bytes]) -> int | None:
    """The pid a launcher writes on pipe ``fd`` (then closes), or None if it wrote none."""
    import select

    data = b""
    deadline = time.monotonic() + REPORT_WAIT_S
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.5)
        if not ready:
            if launcher.poll() is not None and not data:
                break
            continue
        chunk = os.read(fd, 64)
        if not chunk:
            break
        data += chunk
    try:
        pid = int(data.strip())
    except ValueError:
        return None
    return pid if pid > 1 else None


def _pid_from_file(path: Path, launcher: subprocess.Popen[bytes]) -> int | None:
    """Wait for ``launcher`` to exit, then the pid it wrote to ``path``, or None."""
    try:
        launcher.wait(REPORT_WAIT_S)
    except subprocess.TimeoutExpired:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_uid != os.geteuid():  # not the launcher's: the VMM's own
            return None
        pid = int(os.read(fd, 64).strip())
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    return pid if pid > 1 else None


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


def vmm_pids(marker: str,
             programs: tuple[bytes, ...] = (b"qemu-system", b"firecracker")) -> list[int]:
    """Pids of the processes whose program path contains one of ``programs`` (by default
    QEMU and Firecracker; Firecracker's tests add ``jailer``) and whose command line
    contains ``marker`` (e.g. a data directory, or ``hangar-<sandbox id>``), read from
    ``/proc``; for cleanup and for checks that nothing outlived its owner."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and any(p in argv[0] for p in programs) and any(
                marker.encode() in a for a in argv):
            pids.append(int(d.name))
    return pids


def kill_process(pid: int | None, helper: "Client | None" = None) -> None:
    """SIGKILL the single process ``pid``, ignoring one that is already gone.

    Only real process ids (> 1) are signalled: ``kill(-1)`` would end every
    process on the host and ``kill(0)`` our own process group. A VMM of another
    uid, which a server split from root may not signal, is killed by its root
    helper (``helper``: its client, or None).
    """
    if pid is None or pid <= 1:
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    except PermissionError:  # a VMM's uid, from an unprivileged server: the helper may
        if helper is not None:
            try:
                helper.kill_vmm(pid)
            except HangarError as exc:
                log.warning("%s", exc.message)


def read_pid(pid_file: Path) -> int | None:
    """The pid in ``pid_file``, or None when it is missing or garbled."""
    try:
        pid = int(safefs.read_own(pid_file.parent, pid_file.name, 64).strip())
    except (OSError, ValueError):
        return None
    return pid if pid > 1 else None


def describe_exit(code: int) -> str:
    """A process's exit code as words: ``"status 1"``, or ``"killed by SIGKILL"`` for a
    negative code (``-signal``, as ``poll`` gives it)."""
    if code >= 0:
        return f"status {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def tail(path: Path, lines: int = 3, within: Path | None = None) -> str:
    """The last ``lines`` non-empty lines of a log file joined by `` | ``; "" when none.

    Read as ``hangar.engines.safefs.read_tail`` does (its last 64 KiB, no symlink
    followed below ``within``, default: the file's own folder), since a confined VMM
    may write the folder: a log it replaced by a link is read as no log.
    """
    folder = within if within is not None else path.parent
    try:
        raw = safefs.read_tail(folder, path.relative_to(folder))
    except (OSError, ValueError):
        return ""
    text = raw.decode(errors="replace").strip().splitlines()
    return " | ".join(line for line in text[-lines:] if line.strip())


class VMMProcesses:
    """The VMM processes this server started; one per engine. ``helper``: the root
    helper's client of a server split from root, which starts the VMMs it prepared
    (``Plan.remote``) and kills those of other uids; None: no split."""

    def __init__(self, helper: "Client | None" = None) -> None:
        self.helper = helper
        self._children: dict[int, VMMHandle] = {}
        self._loggers: dict[int, subprocess.Popen[bytes]] = {}

    def spawn(self, argv: Sequence[str], *, cwd: Path, pid_file: Path, stdout: Path,
              stderr: Path | None = None, plan: "Plan | None" = None,
              console: Sequence[str] | None = None,
              pass_fds: Sequence[int] = (), pid_from: Path | None = None) -> VMMHandle:
        """Start ``argv`` in its own session in ``cwd`` and write its pid to ``pid_file``.

        stdout is appended to ``stdout``, stderr to ``stderr`` (default: the
        same file); stdin is /dev/null. With ``console`` (a logger's argv, such
        as ``Confinement.console_argv``, whose last item is its folder), stdout
        goes through a pipe to that logger instead, which ends when the VMM's
        end of the pipe closes. With ``plan`` the VMM (and the logger, seeing
        only ``/usr`` and its folder: ``Plan.for_logger``) is
        started by ``hangar.engines.vmm_exec``, which confines it and execs it
        (in a pid namespace of its own with ``Plan.pid_ns``, its host pid then
        reported on a pipe). ``pid_from``: ``argv`` is a launcher that writes
        the VMM's pid to that file and exits (the jailer's ``--new-pid-ns``).
        ``pass_fds`` stay open in the VMM under their numbers. Returns the
        VMM's handle (its host pid); a launcher that failed before it started
        the VMM gives the launcher's own, already ended. Raises ``OSError``
        when it cannot start.
        """
        if plan is not None and plan.remote is not None:
            return self._spawn_remote(plan.remote, argv, pass_fds)
        report_r: int | None = None
        fds = list(pass_fds)
        if plan is not None and plan.pid_ns or pid_from is not None:
            become_subreaper()
        if plan is not None and plan.pid_ns:
            report_r, report_w = os.pipe()
            plan.report_fd = report_w
            fds.append(report_w)
        vmm_argv = plan.wrap(list(argv)) if plan is not None else list(argv)
        logger: subprocess.Popen[bytes] | None = None
        err_path = stderr if stderr is not None else stdout
        try:
            with os.fdopen(safefs.open_append(err_path.parent, err_path.name), "ab") as err:
                if console:
                    r, w = os.pipe()
                    try:
                        log_argv = (plan.for_logger(Path(console[-1])).wrap(list(console))
                                    if plan is not None else list(console))
                        logger = subprocess.Popen(log_argv, stdin=r, stdout=subprocess.DEVNULL,
                                                  stderr=err, start_new_session=True, cwd=cwd)
                        proc = subprocess.Popen(vmm_argv, stdin=subprocess.DEVNULL, stdout=w,
                                                stderr=err, start_new_session=True, cwd=cwd,
                                                pass_fds=tuple(fds))
                    except OSError:
                        if logger is not None:
                            kill_process(logger.pid)
                            logger.wait()
                        raise
                    finally:
                        os.close(r)
                        os.close(w)
                else:
                    with os.fdopen(safefs.open_append(stdout.parent, stdout.name), "ab") as out:
                        proc = subprocess.Popen(
                            vmm_argv, stdin=subprocess.DEVNULL, stdout=out,
                            stderr=err if stderr is not None else subprocess.STDOUT,
                            start_new_session=True, cwd=cwd, pass_fds=tuple(fds))
        finally:
            if plan is not None and plan.report_fd is not None:
                os.close(plan.report_fd)
                plan.report_fd = None
        handle = VMMHandle(proc.pid, proc)
        pid: int | None = None
        if report_r is not None:
            try:
                pid = _read_report(report_r, proc)
            finally:
                os.close(report_r)
        elif pid_from is not None:
            pid = _pid_from_file(pid_from, proc)
        if pid is not None:
            proc.wait()  # the launcher, which exits once it reported
            handle = VMMHandle(pid)
        self._children[handle.pid] = handle
        if logger is not None:
            self._loggers[handle.pid] = logger
        try:
            safefs.replace_file(pid_file.parent, pid_file.name, f"{handle.pid}\n".encode())
        except OSError:
            kill_process(handle.pid, self.helper)
            handle.wait()
            self._children.pop(handle.pid, None)
            self._reap_logger(handle.pid, force=True)
            raise
        return handle

    def _spawn_remote(self, sandbox_id: str, argv: Sequence[str],
                      pass_fds: Sequence[int]) -> VMMHandle:
        """Have the privileged helper start the VMM it prepared (``Plan.remote``)."""
        if self.helper is None:
            raise OSError("no privileged helper")
        try:
            got = self.helper.spawn_vmm(sandbox_id, argv, pass_fds)
        except HangarError as exc:
            raise OSError(exc.message) from None
        handle = VMMHandle(got["pid"])
        if got["exit"] is not None:
            handle.returncode = got["exit"]
        return handle

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

    def child(self, pid: int) -> VMMHandle | None:
        """Our handle of ``pid``, if this server started it and has not reaped it."""
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
        kill_process(pid, self.helper)
        if not await self.wait_gone(pid, wait):
            log.warning("VMM %d did not exit after SIGKILL", pid)
