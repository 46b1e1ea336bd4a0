"""Starting a command in the guest and collecting its output (standard library only).

``spawn`` starts a program with ``os.posix_spawn`` in a session of its own
(``setsid``), stdin from /dev/null or a pipe, stdout and stderr on pipes,
every signal at its default action and none blocked (``SIGDEF``), whatever
the agent ignores or blocks itself. glibc's posix_spawn is
a ``clone(CLONE_VM | CLONE_VFORK)``: the agent's page tables are not
copied, and an ``execve`` error comes back as the call's own error.
A command of another user starts the same way, its ids taken for the call
(``hangar.guest.users.spawning_as``, ``POSIX_SPAWN_RESETIDS``), with no
program in between and no ``fork``.

``Command`` then watches the child on the event loop with no thread and
no transport: its pipes through ``loop.add_reader`` and its exit through a
pidfd (``os.pidfd_open``, Linux 5.3+; a waiting thread where there is none),
then reaps it with ``waitpid``. In streaming mode (``paced``) a pipe is
read again only once the previous chunk is on its way (``resume``), so a
slow host slows the command down instead of filling the guest's memory.

Why not ``asyncio.create_subprocess_exec``: under TCG every line of Python
costs about 25 times its native time, and that path runs ``Popen``'s
Python code, starts a child-watcher thread per command and builds three
transports; together about 8 ms of a 25 ms ``true``. ``bench/sandbox_bench.py``
measures what is left above the guest's own ``posix_spawn`` of ``/bin/true``.

Where the initramfs carries ``hangar.guest._spawn`` (a C extension built from
``_spawn.c`` by ``hangar.images.initramfs`` with the host's C compiler; x86-64),
``spawn`` uses it instead (``METHOD`` says which): a ``clone3`` that starts the
child straight into the command's cgroup (``CLONE_INTO_CGROUP``) and hands back its
pidfd (``CLONE_PIDFD``), and takes the user's ids in the child itself. So the agent
never moves itself into the command's group and back around the spawn (each move
takes the kernel's cgroup lock) nor changes its own thread's ids: an exec of ``true``
about 2.6 ms (6 %) quicker under TCG on a quiet host (41.8 against 44.4 ms p50, two
servers' sandboxes in turn, docs/performance.md).
A kernel without ``clone3`` (ENOSYS, or EINVAL for ``CLONE_INTO_CGROUP`` before
Linux 5.7) turns it off for good: ``posix_spawn`` then.

Program lookup follows ``execvpe``: a name without ``/`` is searched in the
command's own ``PATH`` (``os.get_exec_path(env)``); a candidate that does
not exist is skipped; when none can run, the error is that of the first
candidate that exists but failed (EACCES, ENOEXEC...), else ENOENT. The
working directory is entered by the agent itself around the call (the
agent is single-threaded where it spawns and returns to its own directory
at once), so a bad ``cwd`` raises ``OSError`` whose ``filename`` is the cwd.
"""

from __future__ import annotations

import asyncio
import errno
import os
import select
import signal
import time
from collections.abc import Callable, Mapping
from typing import NamedTuple

from hangar.guest import users
from hangar.guest.limits import Group

try:  # built into the initramfs where the host has a C compiler (hangar.images.initramfs)
    from hangar.guest import _spawn as _native  # type: ignore[attr-defined]
except ImportError:
    _native = None

CHUNK = 1 << 16
"""Bytes read from a pipe at a time."""
SIGDEF = tuple(s for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP))
"""Signals a command starts with at their default action: all of them. A child inherits
ignored signals across ``exec`` (Python itself ignores SIGPIPE and SIGXFSZ; an agent started
under ``nohup`` or as a background job also SIGHUP, SIGINT, SIGQUIT), and POSIX lets no
non-interactive shell trap a signal that was ignored when it started, so a command would be
deaf to a hang-up or an interrupt it means to handle (see ``terminal.ignored_signals``)."""
STREAMS = ("stdout", "stderr")

_home: tuple[str, int] | None = None
_devnull = -1

METHOD = "clone3" if _native is not None else "posix_spawn"
"""How commands start: ``clone3`` (the native spawn) or ``posix_spawn``; the agent's
HELLO says it (``spawn``)."""


class Started(NamedTuple):
    """A started child: its pid, the agent's ends of its pipes (stdin None without a
    pipe), its pidfd (None: ``Command`` opens one) and the agent's copies of the write
    ends of its stdout and stderr, which ``Command`` closes once the child exited (see
    ``Command``); a caller that makes no ``Command`` closes them."""

    pid: int
    stdin: int | None
    stdout: int
    stderr: int
    pidfd: int | None = None
    writers: tuple[int, ...] = ()


def _here() -> tuple[str, int]:
    """The agent's working directory: its path and an fd to return to it."""
    global _home
    if _home is None:
        _home = (os.getcwd(), os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
    return _home


def program_paths(program: str, env: Mapping[str, str]) -> list[str]:
    """Where ``program`` may be, in search order (see the module docstring)."""
    if "/" in program:
        return [program]
    return [os.path.join(d, program) for d in os.get_exec_path(dict(env))]


def _existing(candidates: list[str]) -> list[str]:
    """``candidates`` without the absolute paths that do not exist, unless none is left.

    The native child tries each candidate in turn, as ``execvpe``; under Linux 6.1 an
    ``execve`` of a missing path still sets up a new address space before its lookup
    fails, and ``true`` is fourth in the default ``PATH``: looking first here makes an
    exec of ``true`` about 2 % quicker under TCG (docs/performance.md). A relative
    candidate (a relative ``PATH`` entry) stays, since the child looks it up from the
    command's cwd; when nothing is left, all stay, so the child fails as before.
    """
    if len(candidates) < 2:
        return candidates
    left = [p for p in candidates
            if not p.startswith("/") or os.access(p, os.F_OK, follow_symlinks=False)]
    return left or candidates


def _spawn_first(argv: list[str], env: Mapping[str, str], actions: list[tuple],
                 resetids: bool = False) -> int:
    first_error: OSError | None = None
    candidates = program_paths(argv[0], env)
    for path in candidates:
        if len(candidates) > 1 and not os.access(path, os.F_OK, follow_symlinks=False):
            continue
        try:
            return os.posix_spawn(path, argv, env, file_actions=actions, setsid=True,
                                  setsigdef=SIGDEF, setsigmask=(), resetids=resetids)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ENOTDIR):
                continue
            if first_error is None:
                first_error = exc
    if first_error is not None:
        raise first_error
    raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), argv[0])


def _start_native(argv: list[str], env: Mapping[str, str], cwd: str, fds: tuple[int, int, int],
                  group: Group | None, user: users.User | None) -> tuple[int, int | None]:
    """(pid, pidfd) of a child started by ``_native`` with ``fds`` as its 0, 1, 2."""
    assert _native is not None
    ids = (user.uid, user.gid, user.groups) if user is not None and users.switches(user) \
        else (-1, -1, ())
    return _native.spawn(  # type: ignore[no-any-return]
        _existing(program_paths(argv[0], env)), argv, env if type(env) is dict else dict(env), fds,
        None if cwd == _here()[0] else cwd, group.fd if group is not None else -1, *ids)


def _start_posix(argv: list[str], env: Mapping[str, str], cwd: str, fds: tuple[int, int, int],
                 group: Group | None, user: users.User | None) -> tuple[int, int | None]:
    """(pid, None) of a child started by ``posix_spawn`` with ``fds`` as its 0, 1, 2."""
    actions: list[tuple] = [(os.POSIX_SPAWN_DUP2, fd, i) for i, fd in enumerate(fds)]
    here, here_fd = _here()
    moved = cwd != here
    if moved:
        os.chdir(cwd)
    try:
        # into the group as root (the agent moves itself), then the user's ids; no
        # context managers on root's way: each costs a fraction of a ms under TCG
        moved_group = group is not None and group.enter()
        try:
            if user is None:
                pid = _spawn_first(argv, env, actions)
            else:
                with users.spawning_as(user):
                    pid = _spawn_first(argv, env, actions, users.switches(user))
        finally:
            if moved_group:
                assert group is not None
                group.leave()
    finally:
        if moved:
            os.fchdir(here_fd)
    return pid, None


def spawn(argv: list[str], env: Mapping[str, str], cwd: str, *, stdin_pipe: bool,
          group: Group | None = None, user: users.User | None = None) -> Started:
    """Start ``argv`` in ``cwd``; returns the child's pid, the agent's non-blocking ends of
    its pipes and, from the native spawn, its pidfd (``Started``).

    With ``group``, the child starts in that cgroup (``hangar.guest.limits``); with
    ``user``, as that user (``hangar.guest.users``: its uid, gid and groups; the program
    is looked up and executed with its permissions). Raises ``OSError`` as ``execve``
    would, with the cwd as its ``filename`` when that was what failed (see the module
    docstring); ``ValueError`` for a NUL byte in argv or env.
    """
    global _native, _devnull, METHOD
    in_r = in_w = None
    if stdin_pipe:
        in_r, in_w = os.pipe()
    elif _devnull < 0:
        _devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    fds = (in_r if in_r is not None else _devnull, out_w, err_w)
    try:
        started = None
        if _native is not None:
            try:
                started = _start_native(argv, env, cwd, fds, group, user)
            except OSError as exc:
                if exc.filename is not None or exc.errno not in (errno.ENOSYS, errno.EINVAL):
                    raise
                _native, METHOD = None, "posix_spawn"  # no clone3 into a cgroup here
        if started is None:
            started = _start_posix(argv, env, cwd, fds, group, user)
    except BaseException:
        for fd in (in_w, out_r, err_r, out_w, err_w):
            if fd is not None:
                os.close(fd)
        raise
    finally:
        if in_r is not None:
            os.close(in_r)
    for fd in (in_w, out_r, err_r):
        if fd is not None:
            os.set_blocking(fd, False)
    return Started(started[0], in_w, out_r, err_r, started[1], (out_w, err_w))


DRAIN_READS = 16
"""Chunks read from a pipe, at most, in the turn that reaps its command (``Command._drain``)."""


class Settle(NamedTuple):
    """How long a ``Command`` may wait for its child's exit before it joins the event loop.

    The wait blocks the agent's event loop, for at most ``budget_s`` seconds, and ends
    as soon as any of the ``wake`` fds is readable (the host's connections: a frame that
    arrives is served at once). So a command that ends within it, as most short ones do,
    is answered without a turn of the event loop: its pipes, pidfd, futures and
    callbacks there cost about 3 ms of a 25 ms ``true`` under TCG (docs/performance.md).
    Only an exec that is the agent's one open request, without stdin or streaming,
    settles (``hangar.guest.ops.commands``), so no other request waits on it; what
    does: a frame the agent read in the same turn but has not dispatched yet, and the
    output of background processes (``hangar.guest.procs``; their pipes hold 64 KiB),
    each for ``budget_s`` at most.

    ``first_output``: the wait ends at the child's first output too (a started process
    whose client is attached, ``hangar.guest.ops.processes``: its start event went out
    before the wait, and its output goes out as soon as it comes).
    """

    budget_s: float
    wake: tuple[int, ...] = ()
    first_output: bool = False


class Command:
    """A started command watched on the running event loop.

    ``sink(name, chunk)`` receives each chunk read from ``stdout`` or
    ``stderr``; with ``paced``, that pipe is not read again until
    ``resume(name)``. ``exited`` resolves to the exit code (``-N`` for signal
    N, as ``subprocess``) once the child is reaped; ``eof[name]`` resolves
    when that pipe is closed by every process that held it. ``close`` stops
    reading and closes the agent's ends; the exit watcher stays until the
    child is reaped, so no zombie is left.

    ``writers``: the agent's copies of the pipes' write ends (``Started.writers``), held
    until the child is reaped. A command's exit closes its stdout, then its stderr, then
    signals its pidfd; with no other writer, each woke the agent, which preempted the
    exiting child three times (the guest has one vCPU), where one wake-up is enough: with
    the agent's copies open, the pipes end only when the agent closes them, after the
    pidfd, and their ends come in the same turn of the agent's (docs/performance.md).
    """

    def __init__(self, pid: int, stdin: int | None, stdout: int, stderr: int,
                 sink: Callable[[str, bytes], None], *, paced: bool = False,
                 group: Group | None = None, pidfd: int | None = None,
                 writers: tuple[int, ...] = (), settle: Settle | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        self.pid = pid
        self.group = group
        """The command's cgroup (``hangar.guest.limits``): SIGKILL ends all of it."""
        self.stdin = stdin
        self.returncode: int | None = None
        self.expired = False
        """Set by the exec when its timeout killed the command's group."""
        self.exited: asyncio.Future[int] = self.loop.create_future()
        self.eof: dict[str, asyncio.Future[None]] = {n: self.loop.create_future() for n in STREAMS}
        self._fds: dict[str, int] = {"stdout": stdout, "stderr": stderr}
        self._sink = sink
        self._paced = paced
        self._writers = list(writers)
        self._blocked = False
        self._watched = False  # its pipes are on the event loop (not while it settles)
        self._pidfd: int | None = pidfd
        if self._pidfd is None:
            try:
                self._pidfd = os.pidfd_open(pid)
            except OSError:  # no pidfd here: a thread waits instead (below)
                pass
        if settle is not None and self._pidfd is not None and not paced:
            self._settle(settle)
        self._watched = True
        for name, fd in self._fds.items():
            self.loop.add_reader(fd, self._readable, name)
        if self.returncode is not None:
            return
        if self._pidfd is None:
            waiter = self.loop.run_in_executor(None, os.waitpid, pid, 0)
            waiter.add_done_callback(lambda f: self._reaped(f.result()[1]))
        else:
            self.loop.add_reader(self._pidfd, self._on_pidfd)

    def _settle(self, settle: Settle) -> None:
        """Wait here, blocking the event loop, for the child's exit (see ``Settle``)."""
        assert self._pidfd is not None
        poller = select.poll()
        poller.register(self._pidfd, select.POLLIN)
        names = {fd: name for name, fd in self._fds.items()}
        for fd in (*names, *settle.wake):
            poller.register(fd, select.POLLIN)
        deadline = time.monotonic() + settle.budget_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            reaped = output = False
            for fd, _ in poller.poll(left * 1000):
                if fd == self._pidfd:
                    reaped = True
                elif fd in names:
                    self._readable(names[fd])
                    output = True
                    if names[fd] not in self._fds:  # its end (never before the reap)
                        poller.unregister(fd)
                        del names[fd]
                else:
                    return  # the host sent a frame: back to the event loop
            if reaped:
                self._on_pidfd(registered=False)
                return
            if output and settle.first_output:
                return

    def _on_pidfd(self, registered: bool = True) -> None:
        assert self._pidfd is not None
        if registered:
            self.loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        self._pidfd = None
        _, status = os.waitpid(self.pid, 0)
        self._reaped(status)

    def _reaped(self, status: int) -> None:
        self._close_writers()
        if not self._paced:  # what the pipes hold, and their ends, in this same turn
            for name in [n for n in STREAMS if n in self._fds]:
                self._drain(name)
        self.returncode = os.waitstatus_to_exitcode(status)
        if not self.exited.done():
            self.exited.set_result(self.returncode)

    def _drain(self, name: str) -> None:
        """Read ``name``'s pipe, up to ``DRAIN_READS`` chunks, until it would block or ends:
        with the agent's own write ends closed, a pipe that no other process holds ends
        here, in the turn that reaped the command, not at a later wake-up."""
        self._blocked = False
        for _ in range(DRAIN_READS):
            if name not in self._fds or self._blocked:
                return
            self._readable(name)

    def _readable(self, name: str) -> None:
        fd = self._fds.get(name)
        if fd is None:
            return
        try:
            chunk = os.read(fd, CHUNK)
        except BlockingIOError:
            self._blocked = True
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._close(name)
            return
        if self._paced:
            self.loop.remove_reader(fd)
        self._sink(name, chunk)

    def resume(self, name: str) -> None:
        """Read ``name`` again (paced mode), after its last chunk went out."""
        fd = self._fds.get(name)
        if fd is not None:
            self.loop.add_reader(fd, self._readable, name)

    def _close(self, name: str) -> None:
        fd = self._fds.pop(name, None)
        if fd is not None:
            if self._watched:
                self.loop.remove_reader(fd)
            os.close(fd)
        if not self.eof[name].done():
            self.eof[name].set_result(None)

    def handover(self, sink: Callable[[str, bytes], None]) -> None:
        """Give the pipes still open to ``sink``, read as fast as they fill (not paced):
        the process table (``hangar.guest.procs``) takes them over from an exec whose
        command left a program behind that still holds them."""
        self._sink = sink
        self._paced = False
        for name, fd in self._fds.items():
            self.loop.add_reader(fd, self._readable, name)

    def kill(self, sig: int) -> None:
        """Send ``sig`` to the command's process group (its session); SIGKILL also ends
        every process of its cgroup, wherever it went (``limits.Group.kill``)."""
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        if sig == signal.SIGKILL and self.group is not None:
            self.group.kill()

    async def write_stdin(self, data: bytes) -> None:
        """Write ``data`` to the command's stdin; raises BrokenPipeError once it is closed."""
        fd = self.stdin
        if fd is None:
            raise BrokenPipeError(errno.EPIPE, "stdin is closed")
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(fd, view):]
            except BlockingIOError:
                ready: asyncio.Future[None] = self.loop.create_future()

                def writable(ready: asyncio.Future[None] = ready) -> None:
                    if not ready.done():
                        ready.set_result(None)

                self.loop.add_writer(fd, writable)
                try:
                    await ready
                finally:
                    if self.stdin == fd:  # not closed (and its number reused) meanwhile
                        self.loop.remove_writer(fd)
                if self.stdin != fd:
                    raise BrokenPipeError(errno.EPIPE, "stdin is closed")

    def close_stdin(self) -> None:
        if self.stdin is not None:
            self.loop.remove_writer(self.stdin)
            os.close(self.stdin)
            self.stdin = None

    def _close_writers(self) -> None:
        while self._writers:
            os.close(self._writers.pop())

    def close(self) -> None:
        """Stop reading output and close the agent's ends of the pipes."""
        for name in STREAMS:
            self._close(name)
        self.close_stdin()
        self._close_writers()
