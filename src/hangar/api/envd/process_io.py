"""``process.Process``: SendInput, StreamInput (a client stream), CloseStdin, SendSignal,
Update (a terminal's size).

On the guest's process table (``SandboxManager.processes``). Input goes to
a process's stdin pipe or its terminal, in order (a process that reads none
of it for 5 s: ``unavailable``, retry); CloseStdin closes the pipe (a
terminal: ``invalid_argument``, send Ctrl+D). SendSignal's SIGTERM and
SIGKILL go to the process's group; a pid that names no running process is
``not_found`` (the SDK's ``kill`` gives False).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from google.protobuf.message import Message

from hangar.api.envd.connect import MAX_MESSAGE, Call, Method, RpcError, rpc_error
from hangar.api.envd.messages import P
from hangar.api.envd.process_run import selector
from hangar.errors import HangarError


async def _input(call: Call, sel: dict[str, Any], data: Any) -> None:
    which = data.WhichOneof("input")
    if which is None:
        return
    env = call.context
    try:
        await env.manager.processes.send_input(env.sandbox_id, getattr(data, which), **sel)
    except HangarError as exc:
        raise rpc_error(exc) from None


async def send_input(req: Any, call: Call) -> Message:
    await _input(call, selector(req.process), req.input)
    return P.SendInputResponse()


MAX_IDLE_MESSAGES = 1024
"""Most messages in a row of one StreamInput that carry no input (a start again, a
keep-alive, an empty message): each costs the event loop work and does nothing."""


async def stream_input(reqs: AsyncIterator[Any], call: Call) -> Message:
    sel: dict[str, Any] | None = None
    idle = 0
    async for req in reqs:
        which = req.WhichOneof("event")
        if which == "data":
            if sel is None:
                raise RpcError("invalid_argument", "the input stream must start with its "
                                                   "start event (the process)")
            idle = 0
            await _input(call, sel, req.data.input)
            continue
        idle += 1
        if idle > MAX_IDLE_MESSAGES:
            raise RpcError("invalid_argument", f"more than {MAX_IDLE_MESSAGES} input messages "
                                               "in a row carry no input")
        if which == "start":
            sel = selector(req.start.process)
    return P.StreamInputResponse()


async def close_stdin(req: Any, call: Call) -> Message:
    env = call.context
    try:
        await env.manager.processes.close_stdin(env.sandbox_id, **selector(req.process))
    except HangarError as exc:
        raise rpc_error(exc) from None
    return P.CloseStdinResponse()


async def send_signal(req: Any, call: Call) -> Message:
    env = call.context
    sig = int(req.signal)
    if sig not in (9, 15):
        raise RpcError("invalid_argument", f"signal {sig} is not one envd sends (SIGTERM, "
                                           "SIGKILL)")
    try:
        done = await env.manager.processes.signal(env.sandbox_id, sig, **selector(req.process))
    except HangarError as exc:
        raise rpc_error(exc) from None
    if not done.delivered:
        raise RpcError("not_found", "the process has ended")
    return P.SendSignalResponse()


async def update(req: Any, call: Call) -> Message:
    env = call.context
    if req.HasField("pty"):
        try:
            await env.manager.processes.resize(env.sandbox_id, req.pty.size.cols,
                                               req.pty.size.rows, **selector(req.process))
        except HangarError as exc:
            raise rpc_error(exc) from None
    return P.UpdateResponse()


METHODS = {
    "process.Process/SendInput": Method("unary", P.SendInputRequest, P.SendInputResponse,
                                        send_input, max_message=MAX_MESSAGE),
    "process.Process/StreamInput": Method("client", P.StreamInputRequest,
                                          P.StreamInputResponse, stream_input,
                                          max_message=MAX_MESSAGE),
    "process.Process/CloseStdin": Method("unary", P.CloseStdinRequest, P.CloseStdinResponse,
                                         close_stdin),
    "process.Process/SendSignal": Method("unary", P.SendSignalRequest, P.SendSignalResponse,
                                         send_signal),
    "process.Process/Update": Method("unary", P.UpdateRequest, P.UpdateResponse, update),
}
