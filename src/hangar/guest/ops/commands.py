"""The ``exec`` operation: run a command to its end, its output captured or streamed.

The program starts by ``hangar.guest.spawn`` in a process group of its own;
argv, env and cwd are checked by ``hangar.guest.ops.process``. See
``exec_command`` for the request and the result.
"""

from __future__ import annotations

import asyncio
import math
import signal
import time
from typing import TYPE_CHECKING, Any

from hangar.guest import protocol as P
from hangar.guest import limits, spawn
from hangar.guest.ops.common import AgentView, OpError
from hangar.guest.ops.process import (
    exec_argv, exec_cwd, exec_env, exec_user, remove_script, spawn_failure,
)

if TYPE_CHECKING:
    from hangar.guest.channel import Channel

DEFAULT_HEAD = 1 << 20  # bytes of output kept from the start
DEFAULT_TAIL = 1 << 18  # bytes of output kept from the end
MAX_HEAD = 3 << 19  # 1.5 MiB: two streams' head and tail fit one frame (MAX_DATA)
MAX_TAIL = 1 << 19
DRAIN_GRACE_S = 0.5  # seconds to keep reading pipes after the command exits
SETTLE_S = 0.25
"""Seconds an exec that is the agent's one open request may wait for its command's exit
before it joins the event loop (``spawn.Settle``)."""


class Capture:
    """Bounded capture of one output stream: a head, a tail and a byte count."""

    def __init__(self, head: int, tail: int) -> None:
        self.head_limit = head
        self.tail_limit = tail
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.head_limit - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk and self.tail_limit > 0:
            self.tail += chunk
            if len(self.tail) > 2 * self.tail_limit:
                del self.tail[: len(self.tail) - self.tail_limit]

    def result(self) -> tuple[dict[str, Any], bytes]:
        """Meta (``head``/``tail`` lengths, ``total``, ``truncated``) and the kept bytes."""
        if len(self.tail) > self.tail_limit:
            del self.tail[: len(self.tail) - self.tail_limit]
        truncated = self.total > len(self.head) + len(self.tail)
        if not truncated:
            whole, tail = bytes(self.head + self.tail), b""
        else:
            whole, tail = bytes(self.head), bytes(self.tail)
        meta = {"head": len(whole), "tail": len(tail), "total": self.total, "truncated": truncated}
        return meta, whole + tail


async def exec_command(agent: AgentView, meta: dict[str, Any], ch: Channel,
                       ) -> tuple[dict[str, Any], bytes]:
    """Run a command.

    meta: ``argv`` (list of str) or ``shell`` (str, run by /bin/sh -c);
    ``user`` (str: a user of the guest, who runs the command, with its groups and its
    ``HOME``, ``USER`` and ``LOGNAME``: ``hangar.guest.users``; default root);
    ``env`` (dict, over the base and the user's variables), ``cwd`` (str, default the
    user's home, /root for root), ``stdin`` (bool: DATA
    frames of stream ``stdin`` and an EOF follow; false means EOF at
    once), ``timeout`` (seconds; the whole process group and cgroup are killed),
    ``stream`` (bool: send stdout/stderr as DATA frames), ``head`` and
    ``tail`` (bytes kept of each stream when not streaming). Streamed
    output goes out as the host's window allows, so a slow reader makes
    the command wait on its pipe; after the command exits its pipes are
    drained for ``DRAIN_GRACE_S``, or while the host's window is full up
    to the timeout (then the rest is dropped; the totals count what was
    sent). Pipes still open then (a program the command started in the
    background holds them) are handed to the process table
    (``hangar.guest.procs``), which reads them for as long as that program
    writes: its output goes to a buffer, never to a closed pipe.

    The command runs in a cgroup of its own under the commands' limits
    (``hangar.guest.limits``); one killed by a limit (a fork bomb's process limit, the
    OOM killer) says so in a line on its stderr and in ``limit`` (``pids``, ``memory``).

    Returns (as RESPONSE meta) ``exit_code`` (128+N when killed by signal N), ``signal``,
    ``timed_out``, ``duration_s``, and per stream ``stdout``/``stderr``
    captures (``head`` and ``tail`` lengths, ``total`` bytes, a
    ``truncated`` flag); the RESPONSE data holds stdout's head and tail
    then stderr's, back to back.

    A shell string longer than ``process.SHELL_INLINE_MAX`` bytes is written to
    a file under ``paths.SCRIPT_DIR`` and sourced by ``/bin/sh -c``, so scripts
    of any size run (one argument may not exceed 128 KiB). A program
    that cannot be started (``argv``) is answered as a shell would: exit
    127 when it is not found, 126 when it cannot be executed, with the
    reason on stderr and ``not_started`` set. ERROR ``invalid`` for NUL
    bytes in argv, env or cwd, an env name that is empty or holds
    ``=``, a missing cwd, a ``user`` the guest does not have (never run as root
    instead), or arguments over the kernel's limit (E2BIG);
    ``not_directory`` for a cwd that is not a directory.
    """
    user = exec_user(meta)
    argv, script = exec_argv(meta, user)
    try:
        env = exec_env(meta.get("env"), user)
        cwd = exec_cwd(meta.get("cwd"), user)
        timeout = meta.get("timeout")
        if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
            raise OpError("invalid", "timeout must be a positive number of seconds")
        stream = bool(meta.get("stream"))
        want_stdin = bool(meta.get("stdin"))
        try:
            head = min(int(meta.get("head", DEFAULT_HEAD)), MAX_HEAD)
            tail = min(int(meta.get("tail", DEFAULT_TAIL)), MAX_TAIL)
        except (TypeError, ValueError):
            raise OpError("invalid", "head and tail must be byte counts") from None

        started = time.monotonic()
        group = limits.new()
        ch.afterwards.append(limits.ahead)  # the next command's group, once this one answered
        try:
            s = spawn.spawn(argv, env, cwd, stdin_pipe=want_stdin, group=group, user=user)
        except OSError as exc:
            group.release()
            code, message = spawn_failure(exc, argv[0], cwd)
            return await _not_started(ch, stream, head, tail, code, message, started)
        captures = {"stdout": Capture(head, tail), "stderr": Capture(head, tail)}
        chunks: asyncio.Queue[tuple[str, bytes]] | None = asyncio.Queue() if stream else None
        wake = None if stream or want_stdin else agent.alone(ch)
        settle = None if wake is None else spawn.Settle(
            min(SETTLE_S, timeout) if timeout is not None else SETTLE_S, wake)
        cmd = spawn.Command(s.pid, s.stdin, s.stdout, s.stderr,
                            (lambda name, chunk: chunks.put_nowait((name, chunk)))
                            if chunks is not None
                            else (lambda name, chunk: captures[name].add(chunk)),
                            paced=stream, group=group, pidfd=s.pidfd, writers=s.writers,
                            settle=settle)
        try:
            return await _run(ch, cmd, captures, chunks, want_stdin, timeout, started)
        finally:
            ch.afterwards.append(group.release)  # its rmdir, once the answer is out
            killed = cmd.returncode is None or cmd.expired
            if cmd.returncode is None:  # cancelled: never leave the group behind
                cmd.kill(signal.SIGKILL)
            # A program the command left behind may still hold its stdout or stderr:
            # the process table reads them from now on (``hangar.guest.procs``), so it
            # never writes to a closed pipe; when the group was killed (cancelled, timed
            # out), into nothing, as what is left is no program the caller meant to keep.
            if not agent.procs.adopt(cmd, argv, meta.get("env") or {}, cwd, keep=not killed):
                cmd.close()
    finally:
        remove_script(script)


async def _not_started(ch: Channel, stream: bool, head: int, tail: int, code: int,
                       message: str, started: float) -> tuple[dict[str, Any], bytes]:
    """The result of a program that could not be started: ``code`` and ``message``
    on stderr, as a shell reports it (127 not found, 126 not executable)."""
    err = message.encode("utf-8", "replace")
    result: dict[str, Any] = {"exit_code": code, "signal": None, "timed_out": False,
                              "duration_s": round(time.monotonic() - started, 6),
                              "pid": None, "not_started": True}
    if stream:
        await ch.stream({"stream": "stderr"}, err)
        result["stdout"], result["stderr"] = {"total": 0}, {"total": len(err)}
        return result, b""
    out_cap, err_cap = Capture(head, tail), Capture(head, tail)
    err_cap.add(err)
    (result["stdout"], out_kept), (result["stderr"], err_kept) = (out_cap.result(),
                                                                  err_cap.result())
    return result, out_kept + err_kept


async def _run(ch: Channel, cmd: spawn.Command, captures: dict[str, Capture],
               chunks: asyncio.Queue[tuple[str, bytes]] | None, want_stdin: bool,
               timeout: float | None, started: float) -> tuple[dict[str, Any], bytes]:
    """Wait for a started command, feeding stdin and relaying signals; see ``exec_command``.

    Streaming (``chunks``): each chunk goes out once the host's window has
    room, and only then is that pipe read again (``Command.resume``), so a
    slow reader makes the command wait on its pipe.
    """
    stream = chunks is not None

    async def relay() -> None:
        assert chunks is not None
        while True:
            name, chunk = await chunks.get()
            await ch.stream({"stream": name}, chunk)  # waits while the window is full
            captures[name].total += len(chunk)
            cmd.resume(name)

    def signal_from(frame: P.Frame) -> None:
        """A SIGNAL frame: its signal (default SIGKILL) to the command's group."""
        sig = frame.meta.get("signal", signal.SIGKILL)
        if isinstance(sig, int) and 0 < sig < 65:
            cmd.kill(sig)

    async def feed() -> None:
        """Route inbound frames: stdin data, stdin EOF, signals."""
        stdin_open = True
        while True:
            frame = await ch.get()
            if frame.kind == P.Kind.DATA and stdin_open:
                try:
                    await cmd.write_stdin(frame.data)
                except (BrokenPipeError, ConnectionResetError):
                    stdin_open = False
            elif frame.kind == P.Kind.EOF and stdin_open:
                stdin_open = False
                cmd.close_stdin()
            elif frame.kind == P.Kind.SIGNAL:
                signal_from(frame)

    def on_frame(frame: P.Frame) -> None:
        """Without stdin only signals matter: each is sent as it arrives, with no task."""
        if frame.kind in P.FLOW_KINDS:
            ch.ack(frame.size)
        elif frame.kind == P.Kind.SIGNAL:
            signal_from(frame)

    feeder = asyncio.create_task(feed()) if want_stdin else None
    if feeder is None:
        ch.listen(on_frame)
    relayer = asyncio.create_task(relay()) if stream else None
    expired: list[bool] = []

    def expire() -> None:
        expired.append(True)
        cmd.expired = True
        cmd.kill(signal.SIGKILL)

    timer = (asyncio.get_running_loop().call_later(  # from the start: it may have settled
        max(0.0, started + timeout - time.monotonic()), expire) if timeout is not None else None)
    try:
        await asyncio.shield(cmd.exited)  # a cancel must not cancel the exit's future
        if expired:
            cmd.kill(signal.SIGKILL)  # members of the group that outlived the leader
        # Drain: output to its end (streaming: every chunk sent). A pipe still open
        # DRAIN_GRACE_S after the exit (a background process holds it) is left to the
        # process table (``exec_command``),
        # unless the relay waits for the host's window (a slow reader), which it may
        # do until the timeout.
        until = time.monotonic() + DRAIN_GRACE_S
        if not expired:
            until = max(until, started + timeout + DRAIN_GRACE_S if timeout else math.inf)
        pending = {f for f in cmd.eof.values() if not f.done()}
        while pending:
            if relayer is not None and relayer.done():
                break
            _, pending = await asyncio.wait(
                pending, timeout=max(0.0, min(DRAIN_GRACE_S, until - time.monotonic())))
            if pending and (not ch.outflow.waiting or time.monotonic() >= until):
                break
        if relayer is not None and relayer.done() and relayer.exception() is not None:
            raise relayer.exception()  # type: ignore[misc]
    finally:
        if timer is not None:
            timer.cancel()
        for t in (feeder, relayer):
            if t is not None:
                t.cancel()
        ending = [t for t in (feeder, relayer) if t is not None]
        if ending:
            await asyncio.gather(*ending, return_exceptions=True)
        cmd.close_stdin()
    timed_out = bool(expired)
    group = cmd.group
    note = ""
    if group is not None and cmd.returncode is not None and cmd.returncode < 0:
        group.oom_killed()
        note = group.describe()
    if note:  # a limit killed it: say so on stderr, as a shell would report a signal
        if stream:
            await ch.stream({"stream": "stderr"}, note.encode())
            captures["stderr"].total += len(note)
        else:
            captures["stderr"].add(note.encode())

    rc = cmd.returncode
    sig = -rc if rc is not None and rc < 0 else None
    result: dict[str, Any] = {
        "exit_code": 128 + sig if sig else rc,
        "signal": sig,
        "timed_out": timed_out,
        "duration_s": round(time.monotonic() - started, 6),
        "pid": cmd.pid,
    }
    if group is not None and group.limit:
        result["limit"] = group.limit
    data = b""
    for name, cap in captures.items():
        if stream:
            result[name] = {"total": cap.total}
        else:
            result[name], kept = cap.result()
            data += kept
    return result, data
