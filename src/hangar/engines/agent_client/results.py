"""What the guest's calls answer: exec results and events, terminal exits, and the exec request.

Plain data, decoded from the guest's frames here and nowhere else:
``exec_result`` reads an exec's RESPONSE (its two captured streams follow
the meta in the frame's data), ``pty_exit`` reads a terminal's. Both raise
``ValueError`` or ``TypeError`` for a guest that sent something else, so a
caller turns any malformed answer into one ``GuestError``.
``exec_meta`` builds the request those results answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hangar.guest import protocol as P


@dataclass
class StreamCapture:
    """One output stream as captured by the agent.

    ``head`` is the whole output when ``truncated`` is false; otherwise the
    first bytes, with ``tail`` the last ones and ``total`` the byte count.
    """

    head: bytes = b""
    tail: bytes = b""
    total: int = 0
    truncated: bool = False

    @classmethod
    def from_frame(cls, m: dict[str, Any], data: memoryview) -> tuple[StreamCapture, memoryview]:
        """Decode one capture whose bytes start ``data``; returns it and the rest."""
        h, t = int(m.get("head", 0)), int(m.get("tail", 0))
        cap = cls(head=bytes(data[:h]), tail=bytes(data[h:h + t]),
                  total=int(m.get("total", 0)), truncated=bool(m.get("truncated", False)))
        return cap, data[h + t:]


@dataclass
class ExecResult:
    """Outcome of one command in the guest.

    ``exit_code`` is 128+N when the process died of signal N (``signal``);
    ``timed_out`` is set when Hangar killed the process group at its timeout.
    """

    exit_code: int | None
    signal: int | None
    timed_out: bool
    duration_s: float
    stdout: StreamCapture = field(default_factory=StreamCapture)
    stderr: StreamCapture = field(default_factory=StreamCapture)


@dataclass
class ExecEvent:
    """One streamed event: ``kind`` is ``stdout``, ``stderr`` (``data`` set) or ``exit``."""

    kind: str
    data: bytes = b""
    result: ExecResult | None = None


@dataclass
class PtyExit:
    """How a pty's program ended: ``exit_code`` is 128+N when signal N killed it."""

    exit_code: int | None
    signal: int | None = None
    duration_s: float = 0.0
    input_dropped: int = 0
    """Input bytes dropped because the program did not read them (see ``hangar.guest.terminal``)."""


def exec_meta(
    command: str | None = None,
    argv: list[str] | None = None,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    timeout: float | None = None,
    stdin: bool = False,
    stream: bool = False,
    head: int | None = None,
    tail: int | None = None,
) -> dict[str, Any]:
    """The REQUEST meta of an exec: ``argv`` as is, else ``command`` run by ``/bin/sh -c``.

    ``timeout`` in seconds; ``head`` and ``tail`` in bytes kept of each
    captured stream; ``stream`` asks for output as it comes; ``stdin`` says
    DATA frames of input follow. Unset options are left out (the guest's
    defaults apply). See ``hangar.guest.agent`` for the operation itself.
    """
    meta: dict[str, Any] = {"op": "exec", "stream": stream, "stdin": stdin}
    if argv is not None:
        meta["argv"] = argv
    else:
        meta["shell"] = command
    for key, value in (("env", env), ("cwd", cwd), ("timeout", timeout), ("head", head),
                       ("tail", tail)):
        if value is not None:
            meta[key] = value
    return meta


def int_or_none(value: Any) -> int | None:
    """``value`` when it is an int (not a bool) or None; ValueError otherwise."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise ValueError(f"not an integer: {value!r}")


def exec_result(frame: P.Frame) -> ExecResult:
    """The exec result in a RESPONSE; ValueError, TypeError or AttributeError when
    the guest sent something else."""
    meta = frame.meta
    stdout, rest = StreamCapture.from_frame(meta.get("stdout", {}), memoryview(frame.data))
    stderr, _ = StreamCapture.from_frame(meta.get("stderr", {}), rest)
    return ExecResult(
        exit_code=int_or_none(meta.get("exit_code")),
        signal=int_or_none(meta.get("signal")),
        timed_out=bool(meta.get("timed_out")),
        duration_s=float(meta.get("duration_s", 0.0)),
        stdout=stdout,
        stderr=stderr,
    )


def pty_exit(meta: dict[str, Any]) -> PtyExit:
    """The exit in a terminal's RESPONSE meta; ValueError or TypeError when the guest
    sent something else."""
    return PtyExit(int_or_none(meta.get("exit_code")), int_or_none(meta.get("signal")),
                   float(meta.get("duration_s") or 0.0), int(meta.get("input_dropped") or 0))
