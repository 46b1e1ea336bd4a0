"""``process.Process``: Start, Connect (server streams) and List.

Start runs ``ProcessConfig`` (``cmd`` and ``args`` as an argv, no shell of
its own: E2B's SDK sends ``/bin/bash -l -c <command>``; ``envs`` added to
the guest's environment; ``cwd``, default the guest's home) and streams
its start (pid), output (stdout/stderr, or pty) and end (exit code;
``exited`` false and status ``signal: ...`` when a signal ended it). The
call's ``Connect-Timeout-Ms`` is the process's lifetime: past it the
process is killed and the stream ends with ``deadline_exceeded`` (the
SDK's ``TimeoutException``). Connect streams the events of a running
process from now on; List names the running ones.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from google.protobuf.message import Message

from hangar.api.envd.connect import Call, Method, RpcError, rpc_error
from hangar.api.envd.messages import P
from hangar.api.envd.processes import Proc
from hangar.core.commands import Command
from hangar.errors import HangarError


def selected(call: Call, selector: Any) -> Proc:
    """The process a ``ProcessSelector`` names. Raises RpcError ``not_found``."""
    env = call.context
    which = selector.WhichOneof("selector")
    if which is None:
        raise RpcError("invalid_argument", "the process selector names no pid or tag")
    try:
        return env.processes.find(env.sandbox_id, pid=selector.pid if which == "pid" else None,
                                  tag=selector.tag if which == "tag" else None)
    except HangarError as exc:
        raise rpc_error(exc) from None


def _event(kind: str, value: Any) -> Any:
    """A ``ProcessEvent`` of one table event. Raises RpcError for an error or a timeout."""
    ev = P.ProcessEvent()
    if kind in ("stdout", "stderr", "pty"):
        setattr(ev.data, kind, value)
    elif kind == "end":
        if value.timed_out:
            raise RpcError("deadline_exceeded", "the process ran past the call's timeout and "
                                                "was killed")
        ev.end.exit_code, ev.end.exited, ev.end.status = value.exit_code, value.exited, \
            value.status
        if value.error:
            ev.end.error = value.error
    else:
        raise rpc_error(value) if isinstance(value, HangarError) else \
            RpcError("internal", str(value))
    return ev


async def _stream(proc: Proc, q: Any, response: type[Message]) -> AsyncIterator[Message]:
    start = P.ProcessEvent()
    start.start.pid = proc.pid
    yield response(event=start)
    async for kind, value in proc.events(q):
        yield response(event=_event(kind, value))


async def start(req: Any, call: Call) -> AsyncIterator[Message]:
    env = call.context
    cfg = req.process
    if not cfg.cmd:
        raise RpcError("invalid_argument", "process.cmd is empty")
    cmd = Command(command=cfg.cmd, args=list(cfg.args), env=dict(cfg.envs) or None,
                  cwd=cfg.cwd if cfg.HasField("cwd") and cfg.cwd else None)
    pty = (req.pty.size.cols or 80, req.pty.size.rows or 24) if req.HasField("pty") else None
    try:
        proc, q = await env.processes.start(
            env.manager, env.sandbox_id, cmd, tag=req.tag if req.HasField("tag") else None,
            pty=pty, timeout_s=call.timeout_s)
    except HangarError as exc:
        raise rpc_error(exc) from None
    async for msg in _stream(proc, q, P.StartResponse):
        yield msg


async def connect(req: Any, call: Call) -> AsyncIterator[Message]:
    proc = selected(call, req.process)
    async for msg in _stream(proc, proc.subscribe(), P.ConnectResponse):
        yield msg


async def list_processes(req: Any, call: Call) -> Message:
    env = call.context
    res = P.ListResponse()
    for p in env.processes.list(env.sandbox_id):
        info = res.processes.add(pid=p.pid)
        info.config.cmd = p.cmd
        info.config.args.extend(p.args)
        info.config.envs.update(p.envs)
        if p.cwd:
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
                                    _keepalive(P.StartResponse)),
    "process.Process/Connect": Method("server", P.ConnectRequest, P.ConnectResponse, connect,
                                      _keepalive(P.ConnectResponse)),
    "process.Process/List": Method("unary", P.ListRequest, P.ListResponse, list_processes),
}
