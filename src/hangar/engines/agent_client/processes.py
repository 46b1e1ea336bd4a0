"""Processes that outlive their connection, host side: their info, events and attached stream.

The guest keeps a table of them (``hangar.guest.procs``, operations in
``hangar.guest.ops.processes``); ``AgentClient`` (``client``) makes the calls,
and this module reads what they answer: ``ProcInfo`` (an entry as listed),
``ProcEvent`` (one piece of an attached stream), ``ProcSignalled`` (a
signal's answer) and ``ProcessStream`` (the handle of an attached channel). A guest is hostile: every field is checked
and every string cut to a bound (``proc_info`` raises ValueError or TypeError
for what is no entry, which the caller turns into one ``GuestError``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hangar.engines.agent_client.channel import Channel
from hangar.engines.agent_client.results import int_or_none
from hangar.errors import GuestError, HangarError
from hangar.guest import protocol as P

MAX_TEXT = 4096
"""Characters kept of any string a guest sends in an entry's info."""
MAX_ITEMS = 256
"""Arguments and env variables kept of an entry's info."""
PROCS_EVERY = 32
"""Entries of a process list converted between two turns of the event loop: a hostile
guest's list holds up to 1,024 entries of ``MAX_ITEMS`` arguments and variables each, about
0.1 ms an entry to read and convert (1,000 held the loop ~100 ms at once, review 29j J-M1)."""


@dataclass
class ProcInfo:
    """One process of the guest's table (``hangar.guest.ops.processes``).

    ``exit_code`` is 128+N when signal N ended it (``signal``), None while
    it runs. ``origin`` is ``start`` (started by ``proc_start``) or
    ``exec`` (the pipes of an exec that a program it left behind still
    held; ``pid`` is the exec's). Times are Unix seconds. ``output_bytes``
    counts every byte it wrote, ``output_dropped`` those the 1 MiB ring
    no longer holds.
    """

    pid: int
    tag: str | None = None
    cmd: str = ""
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    cwd: str = ""
    truncated: bool = False
    origin: str = "start"
    pty: bool = False
    cols: int | None = None
    rows: int | None = None
    running: bool = True
    exit_code: int | None = None
    signal: int | None = None
    timed_out: bool = False
    started_at: float = 0.0
    ended_at: float | None = None
    output_open: bool = True
    output_bytes: int = 0
    output_dropped: int = 0
    stdin_open: bool = False


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError("not a string")
    return value[:MAX_TEXT]


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


def proc_info(m: dict[str, Any]) -> ProcInfo:
    """The entry in a guest's meta; ValueError or TypeError when it is none."""
    pid = int_or_none(m.get("pid"))
    if pid is None or pid <= 0:
        raise ValueError("no pid")
    args = m.get("args") or []
    env = m.get("env") or {}
    if not isinstance(args, list) or not isinstance(env, dict):
        raise TypeError("args or env of the wrong type")
    tag = m.get("tag")
    origin = m.get("origin")
    return ProcInfo(
        pid=pid, tag=None if tag is None else _text(tag), cmd=_text(m.get("cmd", "")),
        args=[_text(a) for a in args[:MAX_ITEMS]],
        env={_text(k): _text(v) for k, v in list(env.items())[:MAX_ITEMS]},
        cwd=_text(m.get("cwd", "")), truncated=bool(m.get("truncated")),
        origin=origin if origin in ("start", "exec") else "start", pty=bool(m.get("pty")),
        cols=int_or_none(m.get("cols")), rows=int_or_none(m.get("rows")),
        running=bool(m.get("running")), exit_code=int_or_none(m.get("exit_code")),
        signal=int_or_none(m.get("signal")), timed_out=bool(m.get("timed_out")),
        started_at=float(m.get("started_at") or 0.0), ended_at=_opt_float(m.get("ended_at")),
        output_open=bool(m.get("output_open")),
        output_bytes=int_or_none(m.get("output_bytes")) or 0,
        output_dropped=int_or_none(m.get("output_dropped")) or 0,
        stdin_open=bool(m.get("stdin_open")),
    )


def checked_info(m: dict[str, Any]) -> ProcInfo:
    """``proc_info``, a malformed answer raised as ``GuestError``."""
    try:
        return proc_info(m)
    except (TypeError, ValueError, AttributeError):
        raise GuestError("the guest agent sent a malformed process entry") from None


@dataclass
class ProcSignalled:
    """The answer to a signal: ``delivered`` (some process of the group was left to get
    it) and the process's status just after."""

    delivered: bool
    running: bool
    exit_code: int | None
    signal: int | None


def proc_signalled(m: dict[str, Any]) -> ProcSignalled:
    """The signal answer in a guest's meta; ValueError or TypeError when it is none."""
    return ProcSignalled(m.get("delivered") is True, bool(m.get("running")),
                         int_or_none(m.get("exit_code")), int_or_none(m.get("signal")))


@dataclass
class ProcEvent:
    """One piece of an attached stream.

    ``kind`` ``stdout``, ``stderr`` or ``pty``: ``data`` as written
    (``replay``: it came from the ring, written before the attach;
    ``dropped``: bytes this client lost just before it, its queue being
    full). ``end``: the process ended; ``info`` is its final entry and
    ``dropped`` the bytes this client lost in all.
    """

    kind: str
    data: bytes = b""
    replay: bool = False
    dropped: int = 0
    info: ProcInfo | None = None


class ProcessStream:
    """The output of a guest process, attached (``attach_process``) or as it starts
    (``start_process(attach=True)``).

    ``info`` is the entry when the stream opened. ``next`` gives events until
    the ``end`` one, then None. No deadline while it runs (a quiet process is
    no stuck guest); output the host has not taken waits in the guest (which
    drops the oldest past 1 MiB and says so). ``close`` detaches: the process
    runs on.
    """

    def __init__(self, client: Any, ch: Channel, info: ProcInfo) -> None:
        self._client = client
        self._ch = ch
        self.info = info
        self.pid = info.pid
        self.ended: ProcInfo | None = None
        """The final entry, once the ``end`` event came."""
        self.error: HangarError | None = None
        """Why the stream ended without an ``end`` event (a lost connection...)."""

    async def next(self) -> ProcEvent | None:
        """The next event; None after ``end`` or once the stream broke (``error``)."""
        while self.ended is None and self.error is None:
            try:
                frame = await self._ch.get()
            except HangarError as exc:
                self.error = exc
                break
            if frame.kind == P.Kind.DATA:
                stream = frame.meta.get("stream")
                if stream not in ("stdout", "stderr", "pty") or not frame.data:
                    continue
                return ProcEvent(stream, frame.data, replay=bool(frame.meta.get("replay")),
                                 dropped=int_or_none(frame.meta.get("dropped")) or 0)
            if frame.kind == P.Kind.RESPONSE:
                try:
                    self.ended = proc_info(frame.meta)
                    dropped = int_or_none(frame.meta.get("dropped")) or 0
                except (TypeError, ValueError, AttributeError):
                    self.error = GuestError("the guest agent sent a malformed process end")
                    break
                self._ch.close()
                return ProcEvent("end", dropped=dropped, info=self.ended)
            if frame.kind == P.Kind.ERROR:
                try:
                    self._client._raise(frame)
                except HangarError as exc:
                    self.error = exc
        self._ch.close()
        return None

    async def close(self) -> None:
        """Detach (CANCEL in the guest: the process runs on). Never waits."""
        self._ch.close()


def proc_meta(
    command: str | None = None,
    argv: list[str] | None = None,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    tag: str | None = None,
    stdin: bool = False,
    pty: tuple[int, int] | None = None,
    timeout: float | None = None,
    user: str | None = None,
) -> dict[str, Any]:
    """The REQUEST meta of a ``proc_start``: ``argv`` as is, else ``command`` by
    ``/bin/sh -c``; ``pty`` (cols, rows) puts it on a terminal; ``stdin`` gives it a
    pipe fed by ``send_process_input``; ``timeout`` (s) kills its group then; ``user``
    runs it as that user of the guest (as ``exec_meta``)."""
    meta: dict[str, Any] = {"op": "proc_start", "stdin": stdin}
    if argv is not None:
        meta["argv"] = argv
    else:
        meta["shell"] = command
    if pty is not None:
        meta["pty"] = {"cols": pty[0], "rows": pty[1]}
    for key, value in (("env", env), ("cwd", cwd), ("tag", tag), ("timeout", timeout),
                       ("user", user)):
        if value is not None:
            meta[key] = value
    return meta
