"""Who a command runs as: a user the host names, resolved and switched to in the guest
(standard library only).

An ``exec`` or ``proc_start`` request may carry ``user``: the name of an account of the
guest's passwd database (E2B's default user ``user``, ``hangar.core.e2b_user``). The agent
runs the command as it, with no program in between (util-linux's ``setpriv`` did this
before, one more dynamically linked process per command: 100 ms and more under TCG,
docs/performance.md).

``resolve`` finds the account: its uid, primary gid, supplementary groups (as
``initgroups(3)`` makes them: its own group and every group of the group database that
lists it, ``os.getgrouplist``) and home; an unknown name is a ``LookupError``, never root.
``environ`` gives the variables a login gives (``HOME``, ``USER``, ``LOGNAME``); the
command's cwd defaults to the home (``hangar.guest.ops.process``).

The agent's native spawn (``hangar.guest.spawn``) takes the ids in the child, between its
``clone3`` and its ``execve`` (groups, gid, uid, real, effective and saved; ambient
capabilities cleared), so nothing below happens to the agent's own thread. Where it is
missing, a spawn takes the user's ids this way (``spawning_as``): glibc's ``posix_spawn`` is a
``clone(CLONE_VM | CLONE_VFORK)`` and cannot set ids itself, except that its
``POSIX_SPAWN_RESETIDS`` resets the child's effective uid and gid to its real ones before
``exec``. So for the call the agent's own thread takes the user's real uid and gid and
its supplementary groups (raw ``setresuid``/``setresgid``/``setgroups`` system calls,
which change the calling thread only: glibc's wrappers of the same names change every
thread of the process, and the agent's worker threads would run as the user meanwhile)
while its effective ids stay root's; the child, a copy of that thread, sets its
effective ids to the user's, and its ``execve`` makes the saved ids the same. The command
then holds the user's uid and gid four times over, its groups, and no capability (the
thread's ambient set is cleared first, so none is carried over), as under ``setpriv
--reuid --regid --init-groups``; a set-user-id program it runs (``sudo``) works as
usual. The thread takes back root's ids and its own groups as soon as the call returns;
failing that the agent exits at once (``os._exit``) rather than serve on with another
user's ids. Measured in a TCG guest on a busy host (``bench/e2b_user_bench.py``, p50 of
180): a spawn of ``/bin/true`` as the user 53.5 ms, as root 54.7, through ``setpriv``
152; Python's ``subprocess`` with ``user=`` (a ``fork`` of the spawning process) took
about 25 ms more than a spawn in a first trial.

While a spawn as a user runs (the ``clone`` until the child's ``exec``, a few ms under
emulation), the agent's real uid is the user's, so that user's processes may signal the
agent. The guest is the security boundary, not the agent (``hangar.guest.agent``), and
E2B's default user has passwordless ``sudo`` besides.

A pty's program (``procs.ProcessTable._start_pty``) is forked, not spawned: its child
takes the ids itself (``drop_in_child``) after joining its cgroup.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import pwd
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

NAME_MAX = 32
"""Longest user name taken (``useradd``'s own limit)."""
_SYSCALLS = {  # setgroups, setresuid, setresgid: the kernel's numbers per architecture
    "x86_64": (116, 117, 119),
    "aarch64": (159, 147, 149),
}
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4


@dataclass(frozen=True)
class User:
    """A resolved account: ``name``, ``uid``, ``gid`` (primary), ``groups`` (supplementary,
    the primary one included) and ``home``."""

    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str

    def environ(self) -> dict[str, str]:
        """``HOME``, ``USER`` and ``LOGNAME`` as a login sets them."""
        return {"HOME": self.home, "USER": self.name, "LOGNAME": self.name}


def resolve(name: str) -> User:
    """The account named ``name`` in the guest's passwd and group databases. Raises
    LookupError (its message for the host) for a name that is not one of its users, and
    where the agent cannot take another user's ids (it is not root; an architecture
    without ``_SYSCALLS``)."""
    if not name or len(name) > NAME_MAX or "\0" in name or "/" in name:
        raise LookupError(f"{name[:40]!r} is not a user name")
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        raise LookupError(f"no user {name!r} in the guest (its /etc/passwd)") from None
    me = os.geteuid()
    if pw.pw_uid != me:
        if me != 0:
            raise LookupError(f"the agent runs as uid {me}: it runs no command as {name!r}")
        if platform.machine() not in _SYSCALLS:
            raise LookupError(f"the agent runs no command as another user on "
                              f"{platform.machine()}")
    try:
        groups = os.getgrouplist(name, pw.pw_gid)
    except OSError as exc:  # more groups than NGROUPS_MAX
        raise LookupError(f"the groups of user {name!r}: {exc}") from None
    return User(name, pw.pw_uid, pw.pw_gid, tuple(groups), pw.pw_dir or "/")


_libc: Any = None


def _call(number: int, *args: Any) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    if _libc.syscall(ctypes.c_long(number), *args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _ids(uid: int, gid: int, groups: tuple[int, ...] | list[int]) -> None:
    """The calling thread's real uid and gid and its groups (raw system calls)."""
    setgroups, setresuid, setresgid = _SYSCALLS[platform.machine()]
    keep = ctypes.c_long(-1)  # unchanged: the effective and saved ids stay root's
    _call(setgroups, ctypes.c_long(len(groups)), (ctypes.c_uint * max(1, len(groups)))(*groups))
    _call(setresgid, ctypes.c_long(gid), keep, keep)
    _call(setresuid, ctypes.c_long(uid), keep, keep)


@contextlib.contextmanager
def spawning_as(user: User | None) -> Iterator[None]:
    """For the block, the calling thread's real ids are ``user``'s: a ``posix_spawn`` in
    it with ``resetids=True`` starts its program as that user (see the module docstring).
    Nothing for None or the agent's own uid. Raises OSError when the kernel refuses the
    ids (the thread's own are back then)."""
    if user is None or user.uid == os.geteuid():
        yield
        return
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    _libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    mine = (os.getuid(), os.getgid(), os.getgroups())
    try:
        _ids(user.uid, user.gid, user.groups)
        yield
    finally:
        try:
            _ids(*mine)
        except OSError as exc:  # pragma: no cover -- root takes its own ids back
            print(f"hangar-agent: cannot take back its ids after a spawn as {user.name}: "
                  f"{exc}", file=sys.stderr, flush=True)
            os._exit(70)


def switches(user: User | None) -> bool:
    """Whether a spawn as ``user`` takes other ids (``spawning_as`` does something)."""
    return user is not None and user.uid != os.geteuid()


def drop_in_child(user: User) -> None:
    """In a forked child before ``exec`` (a ``preexec_fn``): become ``user`` for good
    (groups, then gid, then uid: real, effective and saved)."""
    os.setgroups(list(user.groups))
    os.setresgid(user.gid, user.gid, user.gid)
    os.setresuid(user.uid, user.uid, user.uid)
