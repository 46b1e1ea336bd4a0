"""The ``pty`` operation: a program on a pseudo-terminal (``hangar.guest.terminal``).

argv, env and cwd are checked as for ``exec`` (``hangar.guest.ops.process``);
the terminal's frames (input, output, resize, exit) are ``hangar.guest.terminal``'s.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from hangar.guest import terminal
from hangar.guest.ops.common import AgentView, OpError
from hangar.guest.ops.process import (
    exec_argv, exec_cwd, exec_env, remove_script, spawn_failure,
)

if TYPE_CHECKING:
    from hangar.guest.channel import Channel


async def pty(agent: AgentView, meta: dict[str, Any], ch: Channel) -> dict[str, Any]:
    """A program on a pseudo-terminal; frames in ``hangar.guest.terminal``.

    meta: ``argv`` or ``shell`` as for exec (neither: ``/bin/bash -l``,
    else ``/bin/sh``), ``env``, ``cwd``, ``cols`` and ``rows`` (1..1000,
    default 80x24). ERROR ``invalid`` for bad input or a program that
    cannot be started.
    """
    if meta.get("argv") is None and meta.get("shell") is None:
        shell = "/bin/bash" if os.access("/bin/bash", os.X_OK) else "/bin/sh"
        argv, script = [shell, "-l"], None
    else:
        argv, script = exec_argv(meta)
    try:
        env = exec_env(meta.get("env"))
        cwd = exec_cwd(meta.get("cwd"))
        try:
            cols, rows = terminal.check_size(meta.get("cols", 80), meta.get("rows", 24))
        except ValueError as exc:
            raise OpError("invalid", str(exc)) from None
        try:
            return await terminal.run(ch, argv, env, cwd, cols, rows)
        except OSError as exc:
            _, message = spawn_failure(exc, argv[0], cwd)
            raise OpError("invalid", message.strip()) from None
    finally:
        remove_script(script)
