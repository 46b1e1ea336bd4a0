"""Wire schemas of terminals: pseudo-terminal sessions and their WebSocket tickets."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from hangar.schemas.base import CommandRequest, Model, check_sizes


PTY_MAX_SIDE = 1000
"""Largest terminal side, in characters."""


class PtyRequest(CommandRequest):
    """Body of ``POST /sandboxes/{id}/pty``: what to run on a new pseudo-terminal.

    Without ``command`` the guest's login shell runs (``/bin/bash -l``).
    ``command`` is a shell string (``/bin/sh -c``), or with ``args`` the
    program and its arguments, as for exec.
    """

    model_config = ConfigDict(extra="forbid")

    command: str | None = Field(None, min_length=1, max_length=1 << 16)
    args: list[str] | None = Field(None, max_length=4096)
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    cols: int = Field(80, ge=1, le=PTY_MAX_SIDE, description="Terminal width, characters.")
    rows: int = Field(24, ge=1, le=PTY_MAX_SIDE, description="Terminal height, characters.")
    grace: float = Field(60.0, ge=1, le=86400, description=(
        "Seconds the session lives without a viewer before it is hung up (SIGHUP, then "
        "SIGKILL); also how long an ended session waits for a viewer to collect its exit code."))

    @model_validator(mode="after")
    def _sizes(self) -> "PtyRequest":
        """Replaces CommandRequest's check (same name): args without a program first."""
        if self.args is not None and self.command is None:
            raise ValueError("args need a command (the program to run)")
        check_sizes(self.command or "", self.args, self.env)
        return self


class PtySession(Model):
    """A terminal session (``/sandboxes/{id}/pty/{session}``)."""

    id: str
    sandbox_id: str
    state: Literal["running", "exited"]
    kind: Literal["shell", "command"] = Field(description="A login shell, or a given command.")
    pid: int = Field(description="The program's process id in the guest.")
    cols: int
    rows: int
    created_at: float = Field(description="Unix time, seconds.")
    attached: bool = Field(description="A viewer is connected now.")
    output_bytes: int = Field(description="Output produced so far (the offset of the next byte).")
    grace: float = Field(description="Seconds it lives without a viewer.")
    exit_code: int | None = Field(None, description="Once exited: 128+N when killed by signal "
                                                    "N; null when the guest went away.")


class PtySessionList(Model):
    sessions: list[PtySession]


class PtyTicket(Model):
    """A single-use ticket (valid 30 s) to attach to a terminal session over its WebSocket."""

    ticket: str
    session_id: str
    expires_at: float = Field(description="Unix time, seconds.")
    expires_in_s: float
    url: str = Field(description="Path of the WebSocket, ticket included (single use); add "
                                 "&offset=N to resume after the N-th output byte.")
