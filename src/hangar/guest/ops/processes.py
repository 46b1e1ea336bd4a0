"""The operations on processes that outlive their connection (``hangar.guest.procs``).

A process is named by ``pid`` (int) or, failing that, ``tag`` (the newest
entry with that tag). Every operation but ``proc_start`` and ``proc_list``
answers ERROR ``not_found`` when no entry has it.

===================  ==========================================================
op                   meta → RESPONSE meta
===================  ==========================================================
``proc_start``       argv|shell, user, env, cwd, tag, stdin, pty {cols, rows},
                     timeout, attach → the entry's info; with ``attach`` the channel first
                     streams it as ``proc_attach`` does (``started`` instead of
                     ``attached``), from the process's first byte
``proc_list``        → ``processes``: every entry's info, oldest first
``proc_attach``      pid|tag, replay, follow → DATA {attached, info...}, then DATA
                     {stream: stdout|stderr|pty, [replay], [dropped]} + bytes,
                     then RESPONSE: the info at the end and ``dropped``
``proc_input``       pid|tag, then DATA {stream: stdin} frames and EOF → ``written``
``proc_close_stdin`` pid|tag → the info
``proc_signal``      pid|tag, signal (1..64) → ``delivered`` and the status
``proc_resize``      pid|tag, cols, rows → the info
``proc_remove``      pid|tag → the info once it exited (SIGKILL to its group first
                     while it runs or its output is open, so what a shell left
                     behind goes too; at most ``REMOVE_WAIT_S``); it is forgotten
===================  ==========================================================

An entry's info (``Proc.info``): ``pid``, ``tag``, ``cmd``, ``args``,
``env`` (the request's own variables), ``cwd``, ``truncated``, ``origin``
(``start``, or ``exec`` for the pipes an exec's background program kept),
``pty``, ``cols``, ``rows``, ``running``, ``exit_code`` (128+N when signal N
ended it), ``signal``, ``timed_out``, ``started_at`` and ``ended_at`` (Unix
time, s), ``output_open``, ``output_bytes`` (written in all),
``output_dropped`` (gone from the ring), ``stdin_open``.

An attached channel's CANCEL (or its connection's loss) detaches that
client only; the process runs on. ERROR codes besides ``invalid`` and
``not_found``: ``too_many`` (every slot of the table holds a running
process), ``exists`` (a running process has that tag), ``closed`` (its
input is closed), ``busy`` (it read none of its input for
``procs.INPUT_STALL_S``).
"""

from __future__ import annotations

import asyncio
import signal
from typing import TYPE_CHECKING, Any

from hangar.guest import limits, procs, spawn, terminal
from hangar.guest import protocol as P
from hangar.guest.ops.common import AgentView, OpError
from hangar.guest.ops.process import (
    exec_argv, exec_cwd, exec_env, exec_user, remove_script, spawn_failure,
)

if TYPE_CHECKING:
    from hangar.guest.channel import Channel

REMOVE_WAIT_S = 5.0
"""Seconds ``proc_remove`` waits for a killed process to exit."""
START_SETTLE_S = 0.05
"""Seconds a ``proc_start`` with ``attach``, the agent's one open request, may wait for its
process's exit or first output before it joins the event loop (``spawn.Settle``): a short
command's output and end then go out without turns of the event loop while it runs
(docs/performance.md). Its ``started`` goes out before the wait, as the process starts."""


def _select(agent: AgentView, meta: dict[str, Any]) -> procs.Proc:
    pid, tag = meta.get("pid"), meta.get("tag")
    if pid is not None:
        if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
            raise OpError("invalid", "pid must be a positive integer")
        proc = agent.procs.find(pid=pid)
        if proc is None:
            raise OpError("not_found", f"no process with pid {pid}")
        return proc
    if not isinstance(tag, str) or not tag:
        raise OpError("invalid", "name the process by pid or tag")
    proc = agent.procs.find(tag=tag)
    if proc is None:
        raise OpError("not_found", f"no process tagged {tag[:80]!r}")
    return proc


async def proc_start(agent: AgentView, meta: dict[str, Any], ch: Channel) -> dict[str, Any]:
    """Start a process that outlives this channel; see the module docstring.

    ``argv``, ``shell``, ``user``, ``env`` and ``cwd`` as for exec; ``tag`` (at most
    ``procs.MAX_TAG`` characters); ``stdin`` (bool: a pipe the process reads,
    fed by ``proc_input``; else /dev/null); ``pty`` ({cols, rows}: a terminal
    instead of pipes); ``timeout`` (seconds: its group is killed then);
    ``attach`` (bool: stream its output here until it ends). ERROR
    ``invalid`` for bad input or a program that cannot start, ``exists``,
    ``too_many``.
    """
    tag = meta.get("tag")
    if tag is not None and (not isinstance(tag, str) or not tag or len(tag) > procs.MAX_TAG
                            or "\0" in tag):
        raise OpError("invalid", f"tag must be a string of 1 to {procs.MAX_TAG} characters")
    timeout = meta.get("timeout")
    if timeout is not None and (not isinstance(timeout, (int, float)) or isinstance(
            timeout, bool) or timeout <= 0):
        raise OpError("invalid", "timeout must be a positive number of seconds")
    size = None
    if meta.get("pty") is not None:
        pty = meta["pty"]
        if not isinstance(pty, dict):
            raise OpError("invalid", "pty must be an object {cols, rows}")
        try:
            size = terminal.check_size(pty.get("cols", 80), pty.get("rows", 24))
        except ValueError as exc:
            raise OpError("invalid", str(exc)) from None
    ch.afterwards.append(limits.ahead)  # the next command's group, once this one answered
    user = exec_user(meta)
    argv, script = exec_argv(meta, user)
    att = procs.Attachment() if meta.get("attach") else None
    wake = agent.alone(ch) if att is not None and size is None else None
    settle = None if wake is None else spawn.Settle(
        min(START_SETTLE_S, timeout) if timeout is not None else START_SETTLE_S, wake,
        first_output=True)
    announced = False

    def announce(proc: procs.Proc) -> None:  # at once, so a silent start waits for nothing
        nonlocal announced
        announced = ch.stream_now({"started": True, **proc.info()})

    try:
        env = exec_env(meta.get("env"), user)
        cwd = exec_cwd(meta.get("cwd"), user)
        try:
            proc = await agent.procs.start(
                argv, env, dict(meta.get("env") or {}), cwd, tag=tag,
                stdin=bool(meta.get("stdin")), pty=size, timeout=timeout, script=script,
                user=user, attach=att, settle=settle,
                started=announce if settle is not None else None)
        except KeyError:
            raise OpError("exists", f"a running process has the tag {tag!r}") from None
        except LookupError as exc:
            raise OpError("too_many", f"{exc}; remove one first") from None
        except OSError as exc:
            _, message = spawn_failure(exc, argv[0], cwd)
            raise OpError("invalid", message.strip()) from None
    except BaseException:
        remove_script(script)
        raise
    if att is None:
        return proc.info()
    return await _follow(proc, ch, "started", replay=False, follow=False, att=att,
                         announced=announced)


async def proc_list(agent: AgentView, meta: dict[str, Any], ch: Channel) -> dict[str, Any]:
    """Every entry's info, oldest first: ``{"processes": [...]}`` (at most
    ``procs.MAX_PROCS``)."""
    return {"processes": [p.info() for p in agent.procs.entries()]}


async def proc_attach(agent: AgentView, meta: dict[str, Any], ch: Channel) -> dict[str, Any]:
    """Stream a process's output from now on (``replay``: what its ring holds first) until
    it ends (``follow``: until its output ends); see the module docstring."""
    proc = _select(agent, meta)
    return await _follow(proc, ch, "attached", replay=bool(meta.get("replay")),
                         follow=bool(meta.get("follow")))


async def _follow(proc: procs.Proc, ch: Channel, flag: str, *, replay: bool,
                  follow: bool, att: procs.Attachment | None = None,
                  announced: bool = False) -> dict[str, Any]:
    """Stream ``proc``'s output to ``ch`` (``att``: an attachment it holds already, made
    before the process started; ``announced``: its ``flag`` frame went out already) until
    it ends; its last info and the bytes dropped."""
    backlog = list(proc.ring.chunks) if replay and proc.ring is not None else []
    if att is None:
        att = procs.Attachment()
        proc.attachments.add(att)  # no await since the copy: nothing is missed or repeated
    try:
        if not announced:
            await ch.stream({flag: True, **proc.info()})
        for stream, chunk in backlog:
            await ch.stream({"stream": stream, "replay": True}, chunk)
        dropped = 0
        while True:
            item = att.take()
            if item is not None:
                stream, chunk, lost = item
                dropped += lost
                await ch.stream({"stream": stream, **({"dropped": lost} if lost else {})},
                                chunk)
                continue
            if proc.ended(follow) or proc.ring is None:  # ended, or removed from the table
                break
            att.wake.clear()
            await att.wake.wait()
        return {**proc.info(), "dropped": dropped + att.queue.dropped}
    finally:
        proc.attachments.discard(att)


async def proc_input(agent: AgentView, meta: dict[str, Any], ch: Channel) -> dict[str, Any]:
    """Write the DATA frames that follow (until EOF) to the process's stdin or terminal,
    in order. ``{"written": bytes}``; ERROR ``closed`` once its input is closed, ``busy``
    when it reads none of it for ``procs.INPUT_STALL_S``."""
    proc = _select(agent, meta)
    written = 0
    while True:
        frame = await ch.get()
        if frame.kind == P.Kind.EOF:
            return {"written": written}
        if frame.kind != P.Kind.DATA or not frame.data:
            continue
        try:
            await proc.write(frame.data)
        except (BrokenPipeError, ConnectionResetError):
            raise OpError("closed", f"the input of process {proc.pid} is closed") from None
        except (TimeoutError, asyncio.TimeoutError):
            raise OpError("busy", f"process {proc.pid} read none of its input for "
                                  f"{procs.INPUT_STALL_S:.0f} s") from None
        except OSError as exc:
            raise OpError("closed", f"the input of process {proc.pid}: {exc}") from None
        written += len(frame.data)


async def proc_close_stdin(agent: AgentView, meta: dict[str, Any], ch: Channel,
                           ) -> dict[str, Any]:
    """Close the process's stdin (it reads EOF); the info. ERROR ``invalid`` for a
    terminal (send Ctrl-D, byte 4, instead)."""
    proc = _select(agent, meta)
    if proc.master is not None:
        raise OpError("invalid", "a terminal has no stdin to close; send Ctrl-D (byte 4)")
    proc.close_stdin()
    return proc.info()


async def proc_signal(agent: AgentView, meta: dict[str, Any], ch: Channel) -> dict[str, Any]:
    """Send ``signal`` (1..64) to the process's group: ``delivered`` (false when none of
    its group is left) and its status."""
    proc = _select(agent, meta)
    sig = meta.get("signal")
    if not isinstance(sig, int) or isinstance(sig, bool) or not 0 < sig < 65:
        raise OpError("invalid", "signal must be an integer from 1 to 64")
    return {"delivered": proc.signal(sig), **proc.status()}


async def proc_resize(agent: AgentView, meta: dict[str, Any], ch: Channel) -> dict[str, Any]:
    """Set a terminal process's size (``cols``, ``rows``: 1..1000); the info. ERROR
    ``invalid`` for a process on pipes."""
    proc = _select(agent, meta)
    try:
        cols, rows = terminal.check_size(meta.get("cols"), meta.get("rows"))
        proc.resize(cols, rows)
    except ValueError as exc:
        raise OpError("invalid", f"process {proc.pid}: {exc}") from None
    except OSError as exc:
        raise OpError("closed", f"process {proc.pid}: its terminal: {exc}") from None
    return proc.info()


async def proc_remove(agent: AgentView, meta: dict[str, Any], ch: Channel) -> dict[str, Any]:
    """Kill the process's group (SIGKILL) while it runs or its output is open, wait for
    its exit (at most ``REMOVE_WAIT_S``) and forget it; its info as it was last."""
    proc = _select(agent, meta)
    if proc.running or proc.output_open:  # its group: what a shell left behind too
        proc.signal(signal.SIGKILL)
        loop = asyncio.get_running_loop()
        until = loop.time() + REMOVE_WAIT_S
        while proc.running and loop.time() < until:
            await asyncio.sleep(0.02)
    info = proc.info()
    agent.procs.remove(proc)
    return info
