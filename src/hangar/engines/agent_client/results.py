"""What the guest's calls answer: exec results and events, terminal exits, and the exec request.

Plain data, decoded from the guest's frames here and nowhere else:
``exec_result`` reads an exec's RESPONSE (its two captured streams follow
the meta in the frame's data), ``pty_exit`` reads a terminal's. Both raise
``ValueError`` or ``TypeError`` for a guest that sent something else, so a
caller turns any malformed answer into one ``GuestError``.
``exec_meta`` builds the request those results answer.

Captures are bounded by what the host asked, never by what the guest says:
an exec asks for ``head`` and ``tail`` bytes of each stream (``OWN_HEAD`` and
``OWN_TAIL`` when its caller gives none: the host's own commands), and
``exec_result`` refuses (``CaptureTooLong``) a stream of more than
``head + tail`` bytes, or a tail over ``tail``, however long the guest states
it is (review 29k K-H4: up to the frame's 4 MiB otherwise, parsed on the loop).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hangar.guest import protocol as P

OWN_HEAD = 64 << 10
"""Bytes of each output stream an exec keeps from its start when its request names no
``head`` (``AgentClient.exec_stream`` sets it): the host's own commands, whose output is a
number, a few lines of ``/proc`` figures, an error message or a guest's ``env`` (a few
KiB in a real guest). Callers that show output to a client (REST exec) ask for theirs."""
OWN_TAIL = 4 << 10
"""Bytes of each output stream kept from its end when the request names no ``tail``:
room for the end of an error message past ``OWN_HEAD``."""


class CaptureTooLong(ValueError):
    """An exec answer whose captured stream is longer than its request asked for."""


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
    def from_frame(cls, m: dict[str, Any], data: memoryview, head: int, tail: int,
                   ) -> tuple[StreamCapture, memoryview]:
        """Decode one capture whose bytes start ``data``; returns it and the rest.

        ``head`` and ``tail`` are the bytes the request asked to keep: a capture of
        more than ``head + tail`` bytes, or a tail over ``tail``, raises
        ``CaptureTooLong`` before any byte is copied (an honest guest keeps at most
        ``head`` and ``tail``, and a whole output of up to ``head + tail`` bytes as its
        head alone). ValueError or TypeError for lengths that are not counts."""
        h, t = int(m.get("head", 0)), int(m.get("tail", 0))
        if h < 0 or t < 0:
            raise ValueError("negative capture length")
        if h + t > head + tail or t > tail:
            raise CaptureTooLong(f"{h + t} bytes of output where at most {head + tail} "
                                 f"were asked for ({head} of head, {tail} of tail)")
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
    user: str | None = None,
) -> dict[str, Any]:
    """The REQUEST meta of an exec: ``argv`` as is, else ``command`` run by ``/bin/sh -c``.

    ``timeout`` in seconds; ``head`` and ``tail`` in bytes kept of each
    captured stream; ``stream`` asks for output as it comes; ``stdin`` says
    DATA frames of input follow; ``user`` names the guest's user who runs it (with its
    groups, ``HOME``, ``USER`` and ``LOGNAME``, its home as the default ``cwd``; None:
    root). Unset options are left out: ``AgentClient.exec_stream``
    gives a missing ``timeout``, ``head`` or ``tail`` its own (``Deadlines.exec_max_s``,
    ``OWN_HEAD``, ``OWN_TAIL``). See ``hangar.guest.agent`` for the operation itself.
    """
    meta: dict[str, Any] = {"op": "exec", "stream": stream, "stdin": stdin}
    if argv is not None:
        meta["argv"] = argv
    else:
        meta["shell"] = command
    for key, value in (("env", env), ("cwd", cwd), ("timeout", timeout), ("head", head),
                       ("tail", tail), ("user", user)):
        if value is not None:
            meta[key] = value
    return meta


def int_or_none(value: Any) -> int | None:
    """``value`` when it is an int (not a bool) or None; ValueError otherwise."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise ValueError(f"not an integer: {value!r}")


def exec_result(frame: P.Frame, head: int, tail: int) -> ExecResult:
    """The exec result in a RESPONSE whose request asked for ``head`` and ``tail`` bytes of
    each stream (0 and 0 for a streamed exec, whose output came as DATA); ValueError,
    TypeError or AttributeError when the guest sent something else, ``CaptureTooLong``
    (a ValueError) when a stream is longer than asked."""
    meta = frame.meta
    stdout, rest = StreamCapture.from_frame(meta.get("stdout", {}), memoryview(frame.data),
                                            head, tail)
    stderr, _ = StreamCapture.from_frame(meta.get("stderr", {}), rest, head, tail)
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
