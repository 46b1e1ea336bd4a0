"""``/sandboxes/{id}/processes``: background processes that outlive their connection.

``POST`` starts one (``ProcessStart``; 201 with its entry), ``GET`` lists
them, ``GET .../{pid}`` attaches to its output, ``POST .../{pid}/stdin``
feeds it (and closes its stdin), ``.../signal`` signals its process group,
``.../resize`` resizes its terminal, ``DELETE .../{pid}`` kills its group
(SIGKILL) and forgets it. A program an exec left running with ``&`` is
listed too (``origin: exec``), with the output it wrote since.

The attach answers NDJSON by default (``ProcessEvent`` per line), or
Server-Sent Events with ``format=sse`` or ``Accept: text/event-stream``
(``data: {...}`` per event). It starts only once attached (a pid the guest
lacks is a 404 before any stream), gives output from then on (``replay``:
the 1 MiB ring's first), a keep-alive after ``KEEPALIVE_S`` s of quiet, and
ends with ``end`` once the process has ended (``follow``: once its output
has), or when the client leaves, which only detaches. One event waits
between the guest and the client: a client that reads slowly loses the
oldest output past 1 MiB in the guest (``dropped`` says how much), never
holding the process back.

Routes speak to the core only (``hangar.core.processes``).
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Header, Path, Query
from fastapi.responses import StreamingResponse

from hangar.api.deps import manager
from hangar.core.service import Command, ProcessInfo, ProcessOutput, SandboxManager, Tasks
from hangar.errors import HangarError, InvalidRequest
from hangar.schemas import (
    ProcessInput, ProcessInputResult, ProcessList, ProcessResize, ProcessSignal,
    ProcessSignalResult, ProcessStart,
)

router = APIRouter(prefix="/sandboxes/{sandbox_id}/processes", tags=["processes"])
Manager = Annotated[SandboxManager, Depends(manager)]
Pid = Annotated[int, Path(gt=0, lt=1 << 22, description="The process's id in the guest.")]
KEEPALIVE_S = 15.0
"""Seconds of quiet before an attach stream sends a keep-alive."""


@router.post("", response_model=ProcessInfo, status_code=201,
             summary="Start a process in the background")
async def start(sandbox_id: str, body: ProcessStart, m: Manager) -> ProcessInfo:
    cmd = Command(body.command, body.args, body.env or None, body.cwd)
    pty = (body.pty.cols, body.pty.rows) if body.pty is not None else None
    return await m.processes.start(sandbox_id, cmd, tag=body.tag, stdin=body.stdin, pty=pty,
                                   timeout=body.timeout)


@router.get("", response_model=ProcessList, summary="List the sandbox's processes")
async def list_(sandbox_id: str, m: Manager) -> ProcessList:
    return ProcessList(processes=await m.processes.list(sandbox_id))


def _line(ev: ProcessOutput | ProcessInfo | None, dropped_total: int = 0) -> dict:
    """The ``ProcessEvent`` of a core item (None: a keep-alive)."""
    if ev is None:
        return {"type": "keepalive"}
    if isinstance(ev, ProcessInfo):
        return {"type": "attached", "process": ev.model_dump()}
    if ev.kind == "end":
        return {"type": "end", "dropped": ev.dropped,
                "process": ev.process.model_dump() if ev.process else None}
    line: dict = {"type": ev.kind}
    try:
        line["data"] = ev.data.decode("utf-8")
    except UnicodeDecodeError:
        line["data_b64"] = base64.b64encode(ev.data).decode()
    if ev.replay:
        line["replay"] = True
    if ev.dropped:
        line["dropped"] = ev.dropped
    return line


@router.get("/{pid}", response_class=StreamingResponse,
            summary="Attach to a process's output (NDJSON or SSE)",
            responses={200: {"content": {"application/x-ndjson": {}, "text/event-stream": {}},
                             "description": "One ProcessEvent per NDJSON line or SSE message: "
                                            "attached, then stdout/stderr/pty output, "
                                            "keepalive, and end (or error)."}})
async def attach(sandbox_id: str, pid: Pid, m: Manager,
                 replay: Annotated[bool, Query(description="First what its 1 MiB ring holds.")]
                 = False,
                 follow: Annotated[bool, Query(description=(
                     "After its exit, go on while a program it left running holds its "
                     "output."))] = False,
                 format: Annotated[Literal["ndjson", "sse"] | None, Query(
                     description="ndjson (default) or sse.")] = None,
                 accept: Annotated[str | None, Header(max_length=1000)] = None,
                 ) -> StreamingResponse:
    fmt = format or ("sse" if "text/event-stream" in (accept or "") else "ndjson")
    items = m.processes.attach(sandbox_id, pid, replay=replay, follow=follow)
    try:
        first = await anext(items)  # attached (or its error is this answer's)
    except BaseException:
        await items.aclose()
        raise
    queue: asyncio.Queue[ProcessOutput | ProcessInfo | HangarError | None] = asyncio.Queue(
        maxsize=1)

    async def pump() -> None:
        try:
            async for item in items:
                await queue.put(item)
        except HangarError as exc:  # the guest went away: say so, then end
            await queue.put(exc)
        finally:
            await items.aclose()
        await queue.put(None)

    def encode(line: dict) -> bytes:
        text = json.dumps(line, separators=(",", ":"))
        return (f"data: {text}\n\n" if fmt == "sse" else text + "\n").encode()

    async def body() -> AsyncIterator[bytes]:
        tasks = Tasks(f"attach {sandbox_id} {pid}")
        tasks.start("pump", pump())
        try:
            yield encode(_line(first))
            while True:
                try:
                    item = await asyncio.wait_for(queue.get(), KEEPALIVE_S)
                except asyncio.TimeoutError:
                    yield encode(_line(None))
                    continue
                if item is None:
                    return
                if isinstance(item, HangarError):
                    yield encode({"type": "error", "code": item.code, "message": item.message})
                    return
                yield encode(_line(item))
                if isinstance(item, ProcessOutput) and item.kind == "end":
                    return
        finally:
            await tasks.stop()

    media = "text/event-stream" if fmt == "sse" else "application/x-ndjson"
    return StreamingResponse(body(), media_type=media, headers={
        "Cache-Control": "no-store", "X-Accel-Buffering": "no"})


@router.post("/{pid}/stdin", response_model=ProcessInputResult,
             summary="Write to a process's stdin (or terminal); optionally close its stdin")
async def stdin(sandbox_id: str, pid: Pid, body: ProcessInput, m: Manager) -> ProcessInputResult:
    try:
        data = body.payload()
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    written = await m.processes.send_input(sandbox_id, data, pid) if data else 0
    if body.close:
        info = await m.processes.close_stdin(sandbox_id, pid)
        return ProcessInputResult(written=written, stdin_open=info.stdin_open)
    return ProcessInputResult(written=written, stdin_open=True)


@router.post("/{pid}/signal", response_model=ProcessSignalResult,
             summary="Send a signal to a process's group")
async def signal(sandbox_id: str, pid: Pid, body: ProcessSignal,
                 m: Manager) -> ProcessSignalResult:
    assert isinstance(body.signal, int)
    r = await m.processes.signal(sandbox_id, body.signal, pid)
    return ProcessSignalResult(delivered=r.delivered,
                               state="running" if r.running else "exited",
                               exit_code=r.exit_code, signal=r.signal)


@router.post("/{pid}/resize", response_model=ProcessInfo, summary="Resize a process's terminal")
async def resize(sandbox_id: str, pid: Pid, body: ProcessResize, m: Manager) -> ProcessInfo:
    return await m.processes.resize(sandbox_id, body.cols, body.rows, pid)


@router.delete("/{pid}", response_model=ProcessInfo,
               summary="Kill a process's group (SIGKILL) and forget it")
async def kill(sandbox_id: str, pid: Pid, m: Manager) -> ProcessInfo:
    return await m.processes.kill(sandbox_id, pid)
