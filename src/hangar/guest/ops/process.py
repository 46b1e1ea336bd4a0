"""A command's argv, environment, working directory and user, checked; how a failed
start reads.

Shared by the operations that start programs: ``exec`` (``commands``),
``proc_start`` (``processes``) and ``pty`` (``terminals``). Each check raises
``OpError`` ``invalid`` (or ``not_directory`` for a cwd that is not one) with the
field it rejects.
"""

from __future__ import annotations

import errno
import os
import stat as stat_mod
from typing import Any

from hangar.guest import paths, users
from hangar.guest.ops.common import (
    BASE_ENV, ERRNO_CODES, OpError, check_text, mkstemp, os_error, resolve,
)

SHELL_INLINE_MAX = 64 << 10
"""Bytes of a shell string passed as ``sh -c`` argument; longer ones go through a file."""
ENOENT_EXIT, NOEXEC_EXIT = 127, 126  # the shell's codes (POSIX, "Command Search and Execution")


def exec_user(meta: dict[str, Any]) -> users.User | None:
    """The user a request's command runs as (``meta["user"]``, a name; None: the agent's
    own, root). OpError ``invalid`` for a name that is no user of the guest, never a
    command run as root instead (``hangar.guest.users.resolve``)."""
    name = meta.get("user")
    if name is None:
        return None
    if not isinstance(name, str):
        raise OpError("invalid", "user must be a user name")
    check_text("user", name)
    try:
        return users.resolve(name)
    except LookupError as exc:
        raise OpError("invalid", str(exc)) from None


def exec_argv(meta: dict[str, Any], user: users.User | None = None,
              ) -> tuple[list[str], str | None]:
    """The argv of an exec request and the script file it made (None: none).

    ``meta["argv"]`` runs as is; ``meta["shell"]`` runs by ``/bin/sh -c``,
    through a 0600 file in ``paths.SCRIPT_DIR`` (``user``'s, who runs it) when longer
    than ``SHELL_INLINE_MAX``.
    """
    argv = meta.get("argv")
    shell = meta.get("shell")
    if argv is not None:
        if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
            raise OpError("invalid", "argv must be a non-empty list of strings")
        if not argv[0]:
            raise OpError("invalid", "the program name is empty")
        for i, a in enumerate(argv):
            check_text("the program name" if i == 0 else f"args[{i - 1}]", a)
        return argv, None
    if not isinstance(shell, str):
        raise OpError("invalid", "exec needs argv or shell")
    check_text("command", shell)
    script = shell.encode("utf-8", "surrogateescape")
    if len(script) <= SHELL_INLINE_MAX:
        return ["/bin/sh", "-c", shell], None
    try:
        directory = paths.SCRIPT_DIR if os.path.isdir(paths.SCRIPT_DIR) else "/tmp"
        fd, path = mkstemp(directory, "exec-", ".sh")
        with os.fdopen(fd, "wb") as f:
            if user is not None:
                os.fchown(f.fileno(), user.uid, user.gid)
            f.write(script)
    except OSError as exc:
        raise os_error(exc, "the script file") from None
    return ["/bin/sh", "-c", f". {path}"], path


def remove_script(script: str | None) -> None:
    """Remove the script file ``exec_argv`` made, if any; never raises."""
    if script is not None:
        try:
            os.unlink(script)
        except OSError:
            pass


def exec_env(extra: Any, user: users.User | None = None) -> dict[str, str]:
    """``BASE_ENV``, then ``user``'s ``HOME``, ``USER`` and ``LOGNAME``, updated with the
    request's ``env``; OpError ``invalid`` for a bad one."""
    env = dict(BASE_ENV)
    if user is not None:
        env.update(user.environ())
    if extra is None:
        return env
    if not isinstance(extra, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in extra.items()
    ):
        raise OpError("invalid", "env must map strings to strings")
    for name, value in extra.items():
        if not name:
            raise OpError("invalid", "env has an empty variable name")
        if "=" in name:
            raise OpError("invalid", f"env name {name[:40]!r} must not contain '='")
        check_text("env names", name)
        check_text(f"env[{name[:40]!r}]", value)
    env.update(extra)
    return env


def exec_cwd(value: Any, user: users.User | None = None) -> str:
    """The absolute working directory of an exec (by default, and for a relative one, from
    the home: ``user``'s, else the commands' ``HOME``); OpError naming ``cwd`` when
    unusable."""
    if value is None or value == "":
        if user is None:
            return BASE_ENV["HOME"]
        value = user.home
    if not isinstance(value, str):
        raise OpError("invalid", "cwd must be a string")
    check_text("cwd", value)
    cwd = (resolve(value) if user is None
           else os.path.normpath(os.path.join(user.home, value)))
    try:
        st = os.stat(cwd)
    except FileNotFoundError:
        raise OpError("invalid", f"cwd {cwd}: no such directory") from None
    except OSError as exc:
        raise OpError(ERRNO_CODES.get(exc.errno or 0, "invalid"),
                      f"cwd {cwd}: {os.strerror(exc.errno or 0)}") from None
    if not stat_mod.S_ISDIR(st.st_mode):
        raise OpError("not_directory", f"cwd {cwd}: not a directory")
    return cwd


def spawn_failure(exc: OSError, program: str, cwd: str) -> tuple[int, str]:
    """(exit code, stderr text) for a program that could not be started, as a shell says it.

    Raises OpError for what is no missing or unrunnable program: arguments
    over the kernel's limit (E2BIG), an unusable cwd, the commands' process limit
    reached (EAGAIN: ``too_many``, which the host answers 429 with ``Retry-After``;
    ``hangar.guest.limits`` kills a runaway command within seconds), or a failure of
    the guest itself (ENOMEM...).
    """
    err = exc.errno or 0
    if err == errno.EAGAIN:
        from hangar.guest import limits

        most = limits.limits()["pids_max"]
        raise OpError("too_many", "the guest's commands hold all the processes they may "
                                  f"({most if most is not None else 'the kernel limit'}); "
                                  "retry shortly, or end some") from None
    if err == errno.E2BIG:
        raise OpError("invalid", "args and env are too long for the guest kernel (E2BIG: "
                                 "at most 128 KiB per string and about 2 MiB in all); pass "
                                 "large data through stdin or a file") from None
    if exc.filename == cwd and program != cwd:
        raise OpError(ERRNO_CODES.get(err, "invalid"),
                      f"cwd {cwd}: {os.strerror(err)}") from None
    if err == errno.ENOENT:
        if "/" not in program:
            return ENOENT_EXIT, f"{program}: command not found\n"
        return ENOENT_EXIT, f"{program}: {os.strerror(err)}\n"
    if err in (errno.EACCES, errno.EPERM, errno.ENOEXEC, errno.EISDIR, errno.ENOTDIR,
               errno.ELOOP, errno.ENAMETOOLONG, errno.ETXTBSY, errno.ELIBBAD):
        return NOEXEC_EXIT, f"{program}: {os.strerror(err)}\n"
    raise os_error(exc, program) from None
