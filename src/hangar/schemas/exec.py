"""Wire schemas of running a command: ``POST /sandboxes/{id}/exec`` and its stream."""

from __future__ import annotations

import base64
from typing import Literal

from pydantic import ConfigDict, Field

from hangar.schemas.base import CommandRequest, Model
from hangar.schemas.bounds import EXEC_TIMEOUT_MAX_S


class ExecRequest(CommandRequest):
    """Body of ``POST /sandboxes/{id}/exec``.

    ``command`` is a shell string run by ``/bin/sh -c``; when ``args`` is
    given, ``command`` is instead the program and ``args`` its arguments,
    with no shell involved.
    """

    model_config = ConfigDict(extra="forbid")

    command: str = Field(min_length=1, max_length=1 << 20)
    args: list[str] | None = None
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    stdin: str | None = Field(None, description="Text fed to stdin; none means EOF at once.")
    stdin_b64: str | None = Field(None, description="Bytes fed to stdin, base64.")
    timeout: float | None = Field(60.0, gt=0, le=EXEC_TIMEOUT_MAX_S,
                                  description="Seconds; the whole process group is killed then. "
                                              "null means the maximum, 86400 (24 h). The call "
                                              "fails with 504 when the guest has not answered "
                                              "10 s after it.")
    max_output: int = Field(1 << 20, ge=0, le=3 << 19,
                            description="Bytes kept from the start of each stream; the last "
                                        "max_output/4 bytes are kept as the tail.")
    show_command: bool = Field(False, description="Put the command text in the live events "
                                                  "(exec.started); off by default.")


class ExecResult(Model):
    """Result of a command.

    ``stdout``/``stderr`` are UTF-8 text (invalid bytes become U+FFFD; the
    exact bytes are then in ``stdout_b64``/``stderr_b64``). When a stream
    is larger than the kept bytes, ``*_truncated`` is true, ``stdout`` holds
    the head, ``stdout_tail`` the last bytes, and ``*_bytes`` the total.
    ``exit_code`` is 128+N when the process died of signal N.
    """

    stdout: str
    stderr: str
    exit_code: int | None
    signal: int | None = None
    timed_out: bool = False
    duration_s: float
    stdout_bytes: int
    stderr_bytes: int
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    stdout_tail: str = ""
    stderr_tail: str = ""
    stdout_b64: str | None = None
    stderr_b64: str | None = None

    @property
    def ok(self) -> bool:
        """True when the command exited 0 and did not time out."""
        return self.exit_code == 0 and not self.timed_out


class ExecStreamEvent(Model):
    """One line of ``POST /sandboxes/{id}/exec/stream`` (NDJSON).

    ``type`` is ``stdout`` or ``stderr`` (with ``data``, or ``data_b64``
    when the bytes are not UTF-8), then one ``exit`` with ``exit_code``,
    ``signal``, ``timed_out``, ``duration_s`` and the byte totals; or, when
    the call fails after the stream began (the guest stopped answering:
    ``timeout``; its connection was lost: ``guest_error``), one ``error``
    line with ``code`` and ``message``, and nothing after it.
    """

    type: Literal["stdout", "stderr", "exit", "error"]
    data: str | None = None
    data_b64: str | None = None
    exit_code: int | None = None
    signal: int | None = None
    timed_out: bool = False
    duration_s: float | None = None
    stdout_bytes: int | None = None
    stderr_bytes: int | None = None
    code: str | None = None
    message: str | None = None

    @property
    def payload(self) -> bytes:
        """The output chunk's exact bytes (empty for ``exit``)."""
        if self.data_b64 is not None:
            return base64.b64decode(self.data_b64)
        return (self.data or "").encode()
