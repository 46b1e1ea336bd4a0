"""Wire schemas of processes that outlive their connection.

Starting one, listing them, their stdin, signals, terminal size and output events.
"""

from __future__ import annotations

import base64
from typing import Literal

from pydantic import ConfigDict, Field, field_validator

from hangar.schemas.base import CommandRequest, Model, RequestBody, _no_nul, _show
from hangar.schemas.bounds import EXEC_TIMEOUT_MAX_S
from hangar.schemas.pty import PTY_MAX_SIDE


PROCESS_TAG_MAX = 256
"""Characters of a process's tag."""
PROCESS_INPUT_MAX = 1 << 20
"""Bytes of stdin one ``POST .../processes/{pid}/stdin`` carries."""
SIGNAL_NAMES = {"SIGHUP": 1, "SIGINT": 2, "SIGQUIT": 3, "SIGKILL": 9, "SIGUSR1": 10,
                "SIGUSR2": 12, "SIGTERM": 15, "SIGCONT": 18, "SIGSTOP": 19}
"""Signals a request may name (Linux numbers); any other is given by number."""


class ProcessPty(Model):
    """A terminal for a process, in characters."""

    model_config = ConfigDict(extra="forbid")

    cols: int = Field(80, ge=1, le=PTY_MAX_SIDE)
    rows: int = Field(24, ge=1, le=PTY_MAX_SIDE)


class ProcessStart(CommandRequest):
    """Body of ``POST /sandboxes/{id}/processes``: a process that runs in the background.

    ``command`` is a shell string (``/bin/sh -c``), or with ``args`` the
    program and its arguments, as for exec. The process outlives the request
    and any client: list it, attach to its output, write to its stdin,
    signal or kill it by pid (or ``tag``). ``stdin`` gives it a pipe to
    write to (else it reads /dev/null); ``pty`` runs it on a terminal;
    ``timeout`` kills its process group after that many seconds (none: it
    runs until it ends or is killed).
    """

    model_config = ConfigDict(extra="forbid")

    command: str = Field(min_length=1, max_length=1 << 20)
    args: list[str] | None = Field(None, max_length=4096)
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    tag: str | None = Field(None, min_length=1, max_length=PROCESS_TAG_MAX,
                            description="A name of the caller's choosing; unique among "
                                        "running processes.")
    stdin: bool = Field(False, description="Give it a stdin pipe (fed by .../stdin).")
    pty: ProcessPty | None = Field(None, description="Run it on a terminal of this size.")
    timeout: float | None = Field(None, gt=0, le=EXEC_TIMEOUT_MAX_S,
                                  description="Seconds until its process group is killed.")

    @field_validator("tag")
    @classmethod
    def _tag(cls, value: str | None) -> str | None:
        if value is not None:
            _no_nul("tag", value)
        return value


class ProcessInfo(Model):
    """A process of the sandbox's table (``GET /sandboxes/{id}/processes``).

    ``origin`` is ``start`` (started by ``POST .../processes``) or ``exec``:
    the output of a program an exec left running in the background (``cmd
    &``), kept here so it never writes to a closed pipe; its ``pid`` is the
    exec's shell. ``exit_code`` is 128+N when signal N ended it. Output is
    kept in a ring of 1 MiB per process: ``output_bytes`` counts all it
    wrote, ``output_dropped`` what the ring no longer holds. ``command``,
    ``args`` and ``env`` are cut to 4096 characters in all (``truncated``).
    """

    pid: int
    tag: str | None = None
    command: str
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str
    truncated: bool = False
    origin: Literal["start", "exec"] = "start"
    pty: bool = False
    cols: int | None = None
    rows: int | None = None
    state: Literal["running", "exited"]
    exit_code: int | None = None
    signal: int | None = None
    timed_out: bool = False
    started_at: float = Field(description="Unix time, seconds.")
    ended_at: float | None = Field(None, description="Unix time, seconds.")
    output_open: bool = Field(description="A process still holds its output open.")
    output_bytes: int
    output_dropped: int
    stdin_open: bool


class ProcessList(Model):
    processes: list[ProcessInfo]


class ProcessInput(RequestBody):
    """Body of ``POST /sandboxes/{id}/processes/{pid}/stdin``: bytes for its stdin (or its
    terminal), text in ``data`` or base64 in ``data_b64``; ``close`` then closes its stdin
    (it reads EOF; not for a terminal: send Ctrl-D, ``\\u0004``)."""

    model_config = ConfigDict(extra="forbid")

    data: str | None = Field(None, max_length=PROCESS_INPUT_MAX)
    data_b64: str | None = Field(None, max_length=(PROCESS_INPUT_MAX // 3 + 1) * 4)
    close: bool = False

    def payload(self) -> bytes:
        """The bytes to write. Raises ValueError for bad base64 or too many bytes."""
        if self.data_b64 is not None:
            try:
                raw = base64.b64decode(self.data_b64, validate=True)
            except ValueError:
                raise ValueError("data_b64 is not valid base64") from None
        else:
            raw = (self.data or "").encode()
        if len(raw) > PROCESS_INPUT_MAX:
            raise ValueError(f"at most {PROCESS_INPUT_MAX} bytes of input per call")
        return raw


class ProcessInputResult(Model):
    written: int = Field(description="Bytes written.")
    stdin_open: bool


class ProcessSignal(RequestBody):
    """Body of ``POST /sandboxes/{id}/processes/{pid}/signal``: a signal for its process
    group, by number (1..64) or name (``SIGTERM``, ``TERM``, ``SIGKILL``...)."""

    model_config = ConfigDict(extra="forbid")

    signal: int | str = Field(description="1..64, or a name such as SIGTERM.")

    @field_validator("signal")
    @classmethod
    def _signal(cls, value: int | str) -> int:
        if isinstance(value, str):
            name = value.upper()
            num = SIGNAL_NAMES.get(name) or SIGNAL_NAMES.get("SIG" + name)
            if num is None:
                raise ValueError(f"unknown signal {_show(value)}; give its number (1..64) or "
                                 f"one of {', '.join(SIGNAL_NAMES)}")
            return num
        if not 0 < value < 65:
            raise ValueError("signal must be from 1 to 64")
        return value


class ProcessSignalResult(Model):
    delivered: bool = Field(description="False when no process of its group was left.")
    state: Literal["running", "exited"]
    exit_code: int | None = None
    signal: int | None = None


class ProcessResize(RequestBody):
    """Body of ``POST /sandboxes/{id}/processes/{pid}/resize``: a terminal's new size."""

    model_config = ConfigDict(extra="forbid")

    cols: int = Field(ge=1, le=PTY_MAX_SIDE)
    rows: int = Field(ge=1, le=PTY_MAX_SIDE)


class ProcessEvent(Model):
    """One line of ``GET /sandboxes/{id}/processes/{pid}`` (NDJSON, or SSE ``data:``).

    ``attached`` first (``process``: the entry then); then ``stdout``,
    ``stderr`` or ``pty`` with ``data`` (or ``data_b64`` when the chunk is
    not UTF-8): ``replay`` marks output written before the attach (asked
    with ``replay=true``), ``dropped`` bytes this client lost before it
    (it read too slowly; 1 MiB waits for it at most); ``keepalive`` every
    15 s of quiet; then ``end`` with the final ``process`` and the total
    ``dropped``, or ``error`` (``code``, ``message``) when the stream broke.
    """

    type: Literal["attached", "stdout", "stderr", "pty", "keepalive", "end", "error"]
    data: str | None = None
    data_b64: str | None = None
    replay: bool = False
    dropped: int = 0
    process: ProcessInfo | None = None
    code: str | None = None
    message: str | None = None

    @property
    def payload(self) -> bytes:
        """The output chunk's exact bytes (empty for other events)."""
        if self.data_b64 is not None:
            return base64.b64decode(self.data_b64)
        return (self.data or "").encode()
