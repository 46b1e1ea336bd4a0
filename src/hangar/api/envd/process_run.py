"""``process.Process``: Start, Connect (server streams) and List.

On the guest's table of processes that outlive their connection (the core's
``SandboxManager.processes``). Start runs ``ProcessConfig`` (``cmd`` and
``args`` as an argv, no shell of its own: E2B's SDK sends ``/bin/bash -l -c
<command>``; ``envs`` over the sandbox's own, those its E2B create named,
added to the guest's environment; as the call's user (E2B's default
``user``, taken by the guest agent itself, or ``root``: ``hangar.core.e2b_user.as_user``);
``cwd``, default its template's ``WORKDIR`` or else that user's home; a pty when asked; a stdin pipe unless ``stdin`` is false)
and streams its start (the guest's pid), output (stdout/stderr, or pty) and
end (exit code; ``exited`` false and status ``signal: ...`` when a signal
ended it). The call's ``Connect-Timeout-Ms`` is the process's lifetime: past
it the guest kills its group and the stream ends with ``deadline_exceeded``
(the SDK's ``TimeoutException``). Leaving a stream (the SDK's
``disconnect``) detaches: the process runs on, and Connect attaches to it
again by pid or tag (output from then on). List names the running ones.
"""

from __future__ import annotations

import signal as signals
from collections.abc import AsyncIterator
from typing import Any

from google.protobuf.message import Message

from hangar.api.envd import fs_entries
from hangar.api.envd.connect import (
    START_MESSAGE, Call, Dropped, Method, RpcError, rpc_error,
)
from hangar.api.envd.messages import P
from hangar.core.service import (
    GONE, Command, ProcessInfo, ProcessOutput, State, e2b, e2b_user,
)
from hangar.errors import HangarError
from hangar.turns import Turns


def selector(sel: Any) -> dict[str, Any]:
    """``pid=`` or ``tag=`` of a ``ProcessSelector``. Raises RpcError."""
    which = sel.WhichOneof("selector")
    if which is None:
        raise RpcError("invalid_argument", "the process selector names no pid or tag")
    return {"pid": sel.pid} if which == "pid" else {"tag": sel.tag}


def end_event(info: ProcessInfo) -> Any:
    """The ``ProcessEvent`` of a process's end. Raises RpcError for one killed at its
    timeout."""
    if info.timed_out:
        raise RpcError("deadline_exceeded", "the process ran past the call's timeout and was "
                                            "killed")
    ev = P.ProcessEvent()
    if info.signal:
        try:
            name = signals.Signals(info.signal).name[3:].lower()
        except ValueError:
            name = str(info.signal)
        ev.end.exit_code, ev.end.exited = -1, False
        ev.end.status = f"signal: {'killed' if name == 'kill' else name}"
    else:
        code = info.exit_code if info.exit_code is not None else -1
        ev.end.exit_code, ev.end.exited, ev.end.status = code, info.exit_code is not None, \
            f"exit status {code}"
    return ev


def _gone(env: Any) -> bool:
    """Whether the call's sandbox is being deleted or gone."""
    rec = env.manager.find(env.sandbox_id)
    return rec is None or rec.state in (State.STOPPING, *GONE)


async def _stream(items: AsyncIterator[ProcessInfo | ProcessOutput],
                  response: type[Message], env: Any) -> AsyncIterator[Message]:
    """The process's events as ``response`` messages; a sandbox deleted meanwhile drops the
    connection (``Dropped``), as E2B's envd does."""
    try:
        async for item in items:
            ev = P.ProcessEvent()
            if isinstance(item, ProcessInfo):
                ev.start.pid = item.pid
            elif item.kind == "end":
                if item.process is None:
                    raise RpcError("internal", "the process ended without its status")
                yield response(event=end_event(item.process))
                return
            else:
                setattr(ev.data, item.kind, item.data)
            yield response(event=ev)
    except HangarError as exc:
        if _gone(env):
            raise Dropped(f"sandbox {env.sandbox_id} was deleted during the call") from None
        raise rpc_error(exc) from None
    finally:
        await items.aclose()  # type: ignore[attr-defined]


async def start(req: Any, call: Call) -> AsyncIterator[Message]:
    env = call.context
    cfg = req.process
    if not cfg.cmd:
        raise RpcError("invalid_argument", "process.cmd is empty")
    try:
        envs = {**e2b.envs_of(env.manager, env.options), **dict(cfg.envs)}
    except HangarError as exc:
        raise rpc_error(exc) from None
    cwd = fs_entries.absolute(cfg.cwd, env.home) if cfg.HasField("cwd") and cfg.cwd else None
    cmd = e2b_user.as_user(Command(command=cfg.cmd, args=list(cfg.args), env=envs or None,
                              cwd=cwd or env.workdir), env.user)
    pty = (req.pty.size.cols or 80, req.pty.size.rows or 24) if req.HasField("pty") else None
    items = env.manager.processes.start_attached(
        env.sandbox_id, cmd, tag=req.tag if req.HasField("tag") else None,
        stdin=req.stdin if req.HasField("stdin") else True, pty=pty, timeout=call.timeout_s)
    async for msg in _stream(items, P.StartResponse, env):
        yield msg


async def _running(items: Any) -> AsyncIterator[ProcessInfo | ProcessOutput]:
    """``items``, but an entry whose process has ended is not found (RpcError
    ``not_found``), as envd forgets a process once it ends, though the guest keeps it
    listed a while (its output ring); so is a stream that does not begin with the entry."""
    try:
        first = True
        async for item in items:
            if first and not isinstance(item, ProcessInfo):
                raise RpcError("not_found", "the process has ended")
            if first and item.state != "running":
                raise RpcError("not_found", f"process with pid {item.pid} not found: it has "
                                            "ended")
            first = False
            yield item
    finally:
        await items.aclose()


async def connect(req: Any, call: Call) -> AsyncIterator[Message]:
    env = call.context
    items = _running(env.manager.processes.attach(env.sandbox_id, **selector(req.process)))
    async for msg in _stream(items, P.ConnectResponse, env):
        yield msg


async def list_processes(req: Any, call: Call) -> Message:
    env = call.context
    try:
        procs = await env.manager.processes.list(env.sandbox_id)
    except HangarError as exc:
        raise rpc_error(exc) from None
    res = P.ListResponse()
    turns = Turns()  # up to 1,024 entries of 256 arguments and variables: ~20 us each
    for p in procs:
        await turns.tick()
        if p.state != "running" or p.origin != "start":
            continue
        info = res.processes.add(pid=p.pid)
        info.config.cmd, args = e2b_user.unwrapped(p.command, list(p.args))
        info.config.args.extend(args)
        info.config.envs.update(p.env)
        info.config.cwd = p.cwd
        if p.tag is not None:
            info.tag = p.tag
    return res


def _keepalive(response: type[Message]) -> Any:
    def make() -> Message:
        ev = P.ProcessEvent()
        ev.keepalive.SetInParent()
        return response(event=ev)
    return make


METHODS = {
    "process.Process/Start": Method("server", P.StartRequest, P.StartResponse, start,
                                    _keepalive(P.StartResponse), max_message=START_MESSAGE),
    "process.Process/Connect": Method("server", P.ConnectRequest, P.ConnectResponse, connect,
                                      _keepalive(P.ConnectResponse)),
    "process.Process/List": Method("unary", P.ListRequest, P.ListResponse, list_processes),
}
