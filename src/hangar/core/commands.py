"""The typed surface of guest calls: commands, their results, file entries, the guest's home.

What the API (and a cluster node) hands the core, and what it gets back;
how these travel to the guest agent is the core's business
(``hangar.engines.agent_client``), never the caller's:

==================  ===============================================================
``Command``         a program to run: shell text or an argv, env, cwd, timeout, how
                    much output to keep; for ``exec`` and terminal sessions
``ExecResult``      a finished command: exit code or signal, ``timed_out``,
                    ``duration_s``, stdout and stderr as ``StreamCapture`` (head,
                    tail, total bytes, ``truncated``)
``ExecEvent``       one event of a streamed command: ``kind`` ``stdout``/``stderr``
                    with ``data``, or ``exit`` with ``result``
``FileEntry``       a file in the guest: name, absolute path, type, size, mode, mtime;
                    ``FileList`` a folder's path and entries; ``WriteResult`` a
                    written file's path and size; ``FileEvent`` a change a watch saw
                    (the wire schemas, ``hangar.schemas``)
``Tunnel``          a TCP connection to a guest port: ``read``, ``write``, ``close``
``HOME``            where relative paths start, for files and commands alike
==================  ===============================================================

Relative paths: every guest call resolves a relative path against
``HOME`` (``/root``, the guest's ``$HOME``), and a command without ``cwd``
runs there; so ``files.write("notes.txt")`` and ``exec("cat notes.txt")``
name the same file, as in E2B, whose relative paths start at its user's
home (``/home/user``), where its commands run too. (The agent tools'
``/work`` is the task's own folder, the same in every tier; the tools
always send absolute paths.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hangar.engines.agent_client import ExecEvent, ExecResult, StreamCapture, Tunnel, exec_meta
from hangar.errors import InvalidRequest
from hangar.guest import paths
from hangar.schemas import FileEntry, FileEvent, FileList, WriteResult

__all__ = ["HOME", "Command", "ExecEvent", "ExecResult", "FileEntry", "FileEvent", "FileList",
           "StreamCapture", "Tunnel", "WriteResult"]

HOME = paths.HOME
"""The guest's home (``/root``): relative paths of file calls start here, and commands run here unless
given a ``cwd``."""


@dataclass(frozen=True)
class Command:
    """A program to run in a guest.

    ``command`` is shell text run by ``/bin/sh -c`` when ``args`` is None,
    else the program of the argv ``[command, *args]`` (no shell); None only
    for a terminal session, which then runs the guest's login shell. ``env``
    adds to the guest's base environment; ``cwd`` defaults to ``HOME``.
    ``timeout_s``: seconds until the command is killed (None: the guest's
    maximum, 24 h). ``head``/``tail``: bytes of each output stream kept from
    its start and its end (None: the host's own small capture, 64 KiB and 4 KiB,
    ``hangar.engines.agent_client.OWN_HEAD``; a guest that answers with more fails
    the call with GuestError). ``user``: the guest's user who runs it, by name (the
    guest gives it that user's groups, ``HOME``, ``USER`` and ``LOGNAME`` under ``env``,
    and its home as the default ``cwd``; an unknown one is an InvalidRequest, never
    root); None: root. Terminal sessions run as root only.
    """

    command: str | None = None
    args: list[str] | None = None
    env: dict[str, str] | None = None
    cwd: str | None = None
    timeout_s: float | None = None
    head: int | None = None
    tail: int | None = None
    user: str | None = None

    @property
    def argv(self) -> list[str] | None:
        """The argv when run without a shell, else None."""
        if self.args is None or self.command is None:
            return None
        return [self.command, *self.args]

    def exec_meta(self, stream: bool = False) -> dict[str, Any]:
        """The guest's ``exec`` request for this command. Raises InvalidRequest without one."""
        if self.command is None:
            raise InvalidRequest("a command is needed")
        return exec_meta(self.command, argv=self.argv,
                         env=self.env or None, cwd=self.cwd, timeout=self.timeout_s,
                         stream=stream, head=self.head, tail=self.tail, user=self.user)

    def pty_meta(self, cols: int, rows: int) -> dict[str, Any]:
        """The guest's ``pty`` request for this command (None: the login shell) on a
        ``cols`` x ``rows`` terminal. Raises InvalidRequest for a ``user`` (a terminal
        session runs as root)."""
        if self.user is not None:
            raise InvalidRequest("a terminal session runs as root: it takes no user")
        meta: dict[str, Any] = {"cols": cols, "rows": rows}
        if self.argv is not None:
            meta["argv"] = self.argv
        elif self.command is not None:
            meta["shell"] = self.command
        if self.env:
            meta["env"] = self.env
        if self.cwd:
            meta["cwd"] = self.cwd
        return meta

