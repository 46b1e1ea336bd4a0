"""Limits on what users' commands can take from the guest (cgroup v2; standard library only).

Every command the agent starts for a user (exec, kept processes, terminals, and what
runs through them: E2B's process service, a template's start command such as the code
interpreter's kernel) runs in a cgroup of its own, ``/sys/fs/cgroup/hangar-user/c<N>``
(``Group``). The parent, ``hangar-user``, holds the limits, set below what the guest has so
that the agent, in ``hangar-agent`` and outside them, always keeps the processes and
memory it needs to answer and to kill them:

================  ================================================================
``pids.max``      ``pids_budget``: 2 per MiB of guest memory, at least 256, and at
                  least ``PIDS_RESERVE`` (128) below ``kernel.threads-max``
``memory.max``    the guest's memory less ``memory_reserve`` (an eighth, at least
                  64 MiB): an OOM is the command's own (``memory.oom.group`` is set
                  on each command's group, so the OOM killer ends that command whole)
``cpu.weight``    100 for commands, 10000 for the agent: a busy guest still answers;
                  each command's group has the same weight as every other, so a
                  command of a thousand processes weighs as much as one of one
================  ================================================================

A command that hits the process limit (a fork bomb) is killed whole: ``Watchdog`` reads
each group's ``pids.events`` every ``WATCH_S`` seconds, and kills (``cgroup.kill``) a group
holding the most processes once forks were refused (``Watchdog.tick``) and marks it
(``Group.limit = "pids"``). An OOM kill shows in the group's ``memory.events``
(``Group.limit = "memory"``). A command's timeout, cancel or kill ends its whole group
(``Group.kill``), so processes it left behind in other sessions die too; a command that
simply exits leaves what it started in the background running, in its group, and the
group is removed once it is empty (``Watchdog`` sweeps).

The agent's native spawn (``hangar.guest.spawn``: ``clone3`` with ``CLONE_INTO_CGROUP``)
starts a command straight in its group, through the group directory's fd (``Group.fd``).
Without it, ``posix_spawn`` cannot start a child in another cgroup, so the agent joins the
command's group around the spawn (``Group.enter``, ``Group.leave``: two writes to
``cgroup.procs``) and the child starts there. Children made with ``subprocess`` join in
their ``preexec_fn`` (``Group.join_self``). A command's group is made ahead, once the
previous command has answered (``new``, ``ahead``), and removed after its own answer. A
move takes the kernel's lock on every thread group, whose writer waits for an RCU grace
period unless a move came just before: 9-13 ms a command under TCG (a move pair, measured
a command apart), more than the rest of the agent's work, and 1-2 ms with cgroup2's
``favordynmods`` (Linux 6.0+), which the initramfs and the guest init mount it with.

Where cgroup v2 or its controllers are missing (a test host running the agent under
``--listen``, not as root), ``setup`` returns False and every ``Group`` is a no-op.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import sys

ROOT = "/sys/fs/cgroup"
AGENT = f"{ROOT}/hangar-agent"
USER = f"{ROOT}/hangar-user"
CONTROLLERS = ("cpu", "memory", "pids")
PIDS_RESERVE = 128
"""Processes kept free below ``kernel.threads-max`` for the agent and PID 1."""
MEMORY_RESERVE_MIN = 64 << 20
"""Bytes of guest memory kept outside commands' reach at least (an eighth when more)."""
AGENT_WEIGHT = 10000
USER_WEIGHT = 100
WATCH_S = 1.0
"""Seconds between the watchdog's reads of ``pids.events`` (and sweeps of empty groups)."""

_enabled = False
_counter = itertools.count(1)
_groups: dict[str, Group] = {}
_spare: Group | None = None
"""The next command's group, made ahead (``ahead``)."""
_watchdogs: set[asyncio.Task[None]] = set()
"""Strong references to the watchdogs' tasks (the loop keeps only weak ones)."""


def _write(path: str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _events(path: str) -> dict[str, int]:
    """A ``key value`` file (``pids.events``, ``memory.events``) as a dict; {} on errors."""
    out: dict[str, int] = {}
    try:
        for line in _read(path).splitlines():
            key, _, value = line.partition(" ")
            out[key] = int(value)
    except (OSError, ValueError):
        pass
    return out


def mem_total() -> int:
    """The guest's memory, bytes (``MemTotal``); 0 when unknown."""
    try:
        for line in _read("/proc/meminfo").splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def memory_reserve(total: int) -> int:
    """Bytes kept for the agent and the kernel out of ``total``."""
    return max(MEMORY_RESERVE_MIN, total // 8)


def pids_budget(total: int, threads_max: int) -> int:
    """Processes (tasks) all commands together may hold: see the module docstring."""
    want = max(256, 2 * (total >> 20))
    return max(16, min(want, threads_max - PIDS_RESERVE))


def enabled() -> bool:
    """True once ``setup`` put the agent and the commands' parent group in place."""
    return _enabled


def setup() -> bool:
    """Make ``hangar-agent`` and ``hangar-user`` with their limits and move this process
    (the agent) into ``hangar-agent``. Idempotent (a restarted agent runs it again);
    False, with the reason on stderr, when the guest has no cgroup v2 to use."""
    global _enabled
    try:
        have = set(_read(f"{ROOT}/cgroup.controllers").split())
        if not set(CONTROLLERS) <= have:
            raise OSError(f"controllers {sorted(set(CONTROLLERS) - have)} missing")
        _write(f"{ROOT}/cgroup.subtree_control", " ".join(f"+{c}" for c in CONTROLLERS))
        for d in (AGENT, USER):
            os.makedirs(d, exist_ok=True)
        _write(f"{USER}/cgroup.subtree_control", " ".join(f"+{c}" for c in CONTROLLERS))
        total = mem_total()
        threads_max = int(_read("/proc/sys/kernel/threads-max"))
        _write(f"{USER}/pids.max", str(pids_budget(total, threads_max)))
        if total:
            _write(f"{USER}/memory.max", str(total - memory_reserve(total)))
        _write(f"{USER}/cpu.weight", str(USER_WEIGHT))
        _write(f"{AGENT}/cpu.weight", str(AGENT_WEIGHT))
        _write(f"{AGENT}/cgroup.procs", str(os.getpid()))
    except (OSError, ValueError) as exc:
        print(f"hangar-agent: no limits on commands (cgroup v2: {exc})", file=sys.stderr,
              flush=True)
        _enabled = False
        return False
    _enabled = True
    return True


def limits() -> dict[str, int | None]:
    """The commands' limits now in force: ``pids_max``, ``memory_max`` (bytes); None
    where there is none (no cgroups)."""
    out: dict[str, int | None] = {"pids_max": None, "memory_max": None}
    if not _enabled:
        return out
    for key, name in (("pids_max", "pids.max"), ("memory_max", "memory.max")):
        try:
            text = _read(f"{USER}/{name}").strip()
            out[key] = None if text == "max" else int(text)
        except (OSError, ValueError):
            pass
    return out


class Group:
    """One command's cgroup (``hangar-user/c<N>``); every method is a no-op without cgroups.

    ``limit`` is ``"pids"`` once the watchdog killed it for the process limit, ``"memory"``
    once ``oom_killed`` saw the OOM killer in it.
    """

    def __init__(self) -> None:
        self.path: str | None = None
        self.fd = -1
        """An open fd of the group's directory (-1: none), until the group is removed."""
        self.limit: str | None = None
        self.refused = 0
        """Forks refused in this group that the watchdog has seen."""
        self.done = False
        """Set by the owner once it no longer needs the group; the watchdog removes it
        when it is also empty."""
        if not _enabled:
            return
        path = f"{USER}/c{next(_counter)}"
        try:
            os.mkdir(path)
            _write(f"{path}/memory.oom.group", "1")
        except OSError as exc:
            print(f"hangar-agent: cannot make {path}: {exc}", file=sys.stderr, flush=True)
            try:
                os.rmdir(path)
            except OSError:
                pass
            return
        self.path = path
        try:  # what the native spawn starts a child in (CLONE_INTO_CGROUP)
            self.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            pass
        _groups[path] = self

    def enter(self) -> bool:
        """Move the agent into this group, so that what it spawns starts there; True when
        it moved, and must ``leave`` (not a context manager: its own cost shows under
        TCG)."""
        if self.path is None:
            return False
        try:
            _write(f"{self.path}/cgroup.procs", str(os.getpid()))
        except OSError:
            return False  # the command runs in the agent's group: still bounded by its pidfd
        return True

    def leave(self) -> None:
        """Move the agent back to its own group, after ``enter``."""
        try:
            _write(f"{AGENT}/cgroup.procs", str(os.getpid()))
        except OSError as exc:  # pragma: no cover -- the agent group never goes away
            print(f"hangar-agent: cannot leave {self.path}: {exc}", file=sys.stderr)

    def join_self(self) -> None:
        """In a child before ``exec`` (``preexec_fn``): move this process into the group."""
        if self.path is not None:
            _write(f"{self.path}/cgroup.procs", "0")

    def kill(self) -> None:
        """SIGKILL every process in the group (``cgroup.kill``), orphans included."""
        if self.path is None:
            return
        try:
            _write(f"{self.path}/cgroup.kill", "1")
        except OSError:
            pass

    def oom_killed(self) -> bool:
        """True when the OOM killer ended a process of this group; sets ``limit``."""
        if self.path is None:
            return False
        events = _events(f"{self.path}/memory.events")
        if events.get("oom_kill", 0) or events.get("oom_group_kill", 0):
            self.limit = self.limit or "memory"
            return True
        return False

    def pids(self) -> int:
        if self.path is None:
            return 0
        try:
            return int(_read(f"{self.path}/pids.current"))
        except (OSError, ValueError):
            return 0

    def populated(self) -> bool:
        if self.path is None:
            return False
        return _events(f"{self.path}/cgroup.events").get("populated", 0) == 1

    def release(self) -> None:
        """The owner is done with the group: removed now if empty, else by the watchdog."""
        self.done = True
        self._remove()

    def _remove(self) -> bool:
        if self.path is None:
            return True
        if self.fd >= 0:  # no spawn into a group its owner is done with
            os.close(self.fd)
            self.fd = -1
        try:
            os.rmdir(self.path)
        except OSError:
            return False
        _groups.pop(self.path, None)
        return True

    def describe(self) -> str:
        """What killed the group, for a command's stderr; "" when no limit did."""
        lim = limits()
        if self.limit == "pids":
            return (f"hangar: the command reached the guest's process limit "
                    f"({lim['pids_max']}) and was killed with all its processes\n")
        if self.limit == "memory":
            mib = (lim["memory_max"] or 0) >> 20
            return (f"hangar: the command ran out of memory (the commands' limit is "
                    f"{mib} MiB) and was killed by the OOM killer\n")
        return ""


def new() -> Group:
    """A command's group: the one made ahead (``ahead``) when there is one, else a new one."""
    global _spare
    group, _spare = _spare, None
    return group if group is not None else Group()


def ahead() -> None:
    """Make the next command's group now (nothing when one is ready, or without cgroups):
    the agent calls this once a command's answer is out, so that the ``mkdir`` and its
    write (1-2 ms under TCG) fall between the host's calls instead of in one."""
    global _spare
    if _enabled and _spare is None:
        _spare = Group()


def runaway() -> Group | None:
    """The group holding the most processes (the one to kill when forks are refused)."""
    best, most = None, 0
    for g in list(_groups.values()):
        n = g.pids()
        if n > most:
            best, most = g, n
    return best


class Watchdog:
    """Kills a command that exhausts the process limit; removes empty groups."""

    def __init__(self) -> None:
        self.refused = _events(f"{USER}/pids.events").get("max", 0) if _enabled else 0
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if _enabled and self.task is None:
            self.task = asyncio.get_running_loop().create_task(self.run())
            _watchdogs.add(self.task)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(WATCH_S)
            try:
                self.tick()
            except Exception as exc:  # noqa: BLE001 -- the watchdog must outlive any error
                print(f"hangar-agent: limits watchdog: {exc!r}", file=sys.stderr, flush=True)

    def tick(self) -> None:
        """One look: when forks were refused since the last (a group's own ``pids.events``:
        Linux counts a refused fork in the forking task's cgroup, whichever ancestor's
        limit refused it; or ``hangar-user``'s, where the kernel counts it there), kill the
        group holding the most processes: the runaway, not the command that merely
        failed to fork beside it. Then remove empty groups whose owner is done."""
        refused = _events(f"{USER}/pids.events").get("max", 0)
        seen = refused > self.refused
        self.refused = refused
        for g in list(_groups.values()):
            if g.path is None:
                continue
            n = _events(f"{g.path}/pids.events").get("max", 0)
            if n > g.refused:
                g.refused = n
                seen = True
        if seen:
            g = runaway()
            if g is not None:
                self.kill(g)
        for g in list(_groups.values()):
            if g.done and not g.populated():
                g._remove()

    @staticmethod
    def kill(g: Group) -> None:
        g.limit = "pids"
        g.kill()
        print(f"hangar-agent: {g.path} reached the process limit; killed "
              f"({g.pids()} processes)", file=sys.stderr, flush=True)
