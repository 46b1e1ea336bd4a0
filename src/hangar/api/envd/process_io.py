"""``process.Process``: SendInput, StreamInput (a client stream), CloseStdin, SendSignal,
Update (a terminal's size).

Input goes to a process on a terminal (``pty`` input); a command without
a terminal runs with its input closed, so stdin input is refused with
``invalid_argument`` and CloseStdin succeeds at once. SendSignal's SIGTERM
and SIGKILL end the process (a terminal is hung up: SIGHUP, then SIGKILL
2 s later); an unknown pid is ``not_found`` (the SDK's ``kill`` gives False).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from google.protobuf.message import Message

from hangar.api.envd.connect import Call, Method, RpcError, rpc_error
from hangar.api.envd.messages import P
from hangar.api.envd.process_run import selected
from hangar.errors import HangarError


async def _input(call: Call, proc: Any, data: Any) -> None:
    which = data.WhichOneof("input")
    if which is None:
        return
    try:
        await call.context.processes.write(proc, getattr(data, which), which == "pty")
    except HangarError as exc:
        raise rpc_error(exc) from None


async def send_input(req: Any, call: Call) -> Message:
    await _input(call, selected(call, req.process), req.input)
    return P.SendInputResponse()


async def stream_input(reqs: AsyncIterator[Any], call: Call) -> Message:
    proc = None
    async for req in reqs:
        which = req.WhichOneof("event")
        if which == "start":
            proc = selected(call, req.start.process)
        elif which == "data":
            if proc is None:
                raise RpcError("invalid_argument", "the input stream must start with its "
                                                   "start event (the process)")
            await _input(call, proc, req.data.input)
    return P.StreamInputResponse()


async def close_stdin(req: Any, call: Call) -> Message:
    proc = selected(call, req.process)
    if proc.pty:
        raise RpcError("failed_precondition", "a terminal's input is not closed: send Ctrl+D "
                                              "(0x04) as pty input")
    return P.CloseStdinResponse()


async def send_signal(req: Any, call: Call) -> Message:
    proc = selected(call, req.process)
    try:
        await call.context.processes.signal(proc, int(req.signal))
    except HangarError as exc:
        raise rpc_error(exc) from None
    return P.SendSignalResponse()


async def update(req: Any, call: Call) -> Message:
    proc = selected(call, req.process)
    if req.HasField("pty"):
        try:
            await call.context.processes.resize(proc, req.pty.size.cols, req.pty.size.rows)
        except HangarError as exc:
            raise rpc_error(exc) from None
    return P.UpdateResponse()


METHODS = {
    "process.Process/SendInput": Method("unary", P.SendInputRequest, P.SendInputResponse,
                                        send_input),
    "process.Process/StreamInput": Method("client", P.StreamInputRequest,
                                          P.StreamInputResponse, stream_input),
    "process.Process/CloseStdin": Method("unary", P.CloseStdinRequest, P.CloseStdinResponse,
                                         close_stdin),
    "process.Process/SendSignal": Method("unary", P.SendSignalRequest, P.SendSignalResponse,
                                         send_signal),
    "process.Process/Update": Method("unary", P.UpdateRequest, P.UpdateResponse, update),
}
