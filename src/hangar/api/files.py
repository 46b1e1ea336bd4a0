"""``/sandboxes/{id}/files``: raw-byte read and write, list, stat, mkdir, remove, watch.

``PUT`` and ``GET /sandboxes/{id}/files?path=...`` carry the file's raw
bytes (``application/octet-stream``), streamed in both directions; writes
are atomic in the guest (temp file, fsync, rename).

Paths: absolute, or relative to the guest's home ``/root``
(``hangar.core.commands.HOME``), which is also where ``exec`` runs a
command without ``cwd``: ``PUT ...?path=notes.txt`` and then ``exec``
``cat notes.txt`` read the same file, as in E2B (whose relative paths and
commands both start at its user's home). Answers give absolute paths.
``GET .../files/list`` without ``path`` lists the home.

``GET /sandboxes/{id}/files/watch?path=...&recursive=true`` streams changes
(inotify in the guest, ``hangar.guest.watch``) as they happen, one
``FileEvent`` each: Server-Sent Events by default (``data: {...}`` per
event, a ``: keep-alive`` comment after ``KEEPALIVE_S`` s of quiet), or
NDJSON with ``format=ndjson`` or ``Accept: application/x-ndjson`` (one
JSON object per line, an empty line as keep-alive). The answer starts
only once the watch is in place, so every change made after the response
headers arrive is reported; a missing path is a 404 before any stream.
The stream ends when the watched path itself is removed (after its
``delete`` event) or the client goes away; the sandbox counts as busy
meanwhile. A client that reads slowly holds the guest back (flow control):
the server keeps at most one window of events, and once the guest's
inotify queue overflows the client gets an ``overflow`` event.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Header, Query, Request, Response
from fastapi.responses import StreamingResponse

from hangar.api.deps import manager
from hangar.api.models import PATH_MAX, FileEntry, FileList, PathBody, WriteResult
from hangar.core.service import HOME, SandboxManager, Tasks
from hangar.errors import HangarError
from hangar.schemas import FileEvent

router = APIRouter(prefix="/sandboxes/{sandbox_id}/files", tags=["files"])
Manager = Annotated[SandboxManager, Depends(manager)]
RAW_BODY = [("PUT", router.prefix)]
"""Routes whose body is streamed to the guest, not bound by the JSON body limit
(``hangar.api.limits``)."""
PathQ = Annotated[str, Query(min_length=1, max_length=PATH_MAX, description=(
    f"Path in the guest: absolute, or relative to its home {HOME}."))]
KEEPALIVE_S = 15.0
"""Seconds of quiet before a watch stream sends a keep-alive."""


@router.get("", response_class=StreamingResponse, summary="Read a file's raw bytes",
            responses={200: {"content": {"application/octet-stream": {}}}})
async def read(sandbox_id: str, path: PathQ, m: Manager) -> StreamingResponse:
    chunks = m.files.read(sandbox_id, path)
    try:
        first = await anext(chunks)
    except StopAsyncIteration:
        first = b""

    async def body() -> AsyncIterator[bytes]:
        try:
            if first:
                yield first
            async for chunk in chunks:
                yield chunk
        finally:
            await chunks.aclose()

    return StreamingResponse(body(), media_type="application/octet-stream")


@router.put("", response_model=WriteResult, summary="Write a file from the raw request body")
async def write(sandbox_id: str, path: PathQ, request: Request, m: Manager,
                mode: Annotated[int, Query(ge=0, le=0o7777)] = 0o644) -> WriteResult:
    async def chunks() -> AsyncIterator[bytes]:
        async for chunk in request.stream():
            if chunk:
                yield chunk

    return await m.files.write(sandbox_id, path, chunks(), mode)


@router.get("/list", response_model=FileList,
            summary=f"List a directory (default: the guest's home, {HOME})")
async def list_dir(sandbox_id: str, m: Manager, path: PathQ = HOME) -> FileList:
    return await m.files.list(sandbox_id, path)


@router.get("/stat", response_model=FileEntry)
async def stat(sandbox_id: str, path: PathQ, m: Manager) -> FileEntry:
    return await m.files.stat(sandbox_id, path)


@router.post("/mkdir", response_model=FileEntry, status_code=201)
async def mkdir(sandbox_id: str, body: PathBody, m: Manager) -> FileEntry:
    return await m.files.mkdir(sandbox_id, body.path, body.parents)


@router.delete("", status_code=204, summary="Remove a file or (recursive=true) a directory")
async def remove(sandbox_id: str, path: PathQ, m: Manager, recursive: bool = False) -> Response:
    await m.files.remove(sandbox_id, path, recursive)
    return Response(status_code=204)


@router.get("/watch", response_class=StreamingResponse,
            summary="Stream file changes under a path (create, modify, delete, move)",
            responses={200: {"content": {"text/event-stream": {}, "application/x-ndjson": {}},
                             "description": "One FileEvent per SSE message or NDJSON line."}})
async def watch(sandbox_id: str, path: PathQ, m: Manager,
                recursive: Annotated[bool, Query(description="Watch every folder below too.")]
                = False,
                format: Annotated[Literal["sse", "ndjson"] | None, Query(
                    description="sse (default) or ndjson.")] = None,
                accept: Annotated[str | None, Header(max_length=1000)] = None,
                ) -> StreamingResponse:
    fmt = format or ("ndjson" if "application/x-ndjson" in (accept or "") else "sse")
    batches = m.files.watch(sandbox_id, path, recursive)
    try:
        await anext(batches)  # the watch is in place (or its error is this answer's)
    except BaseException:
        await batches.aclose()
        raise
    # One batch at a time between the guest's channel and the client: batches not yet
    # taken stay in the guest (flow control), so a slow client holds the server at one
    # window, and the guest's inotify queue overflows instead.
    queue: asyncio.Queue[list[FileEvent] | None] = asyncio.Queue(maxsize=1)

    async def pump() -> None:
        try:
            async for batch in batches:
                await queue.put(batch)
        except HangarError:  # the guest went away: the stream ends
            pass
        finally:
            await batches.aclose()
        await queue.put(None)

    async def body() -> AsyncIterator[bytes]:
        tasks = Tasks(f"watch {sandbox_id}")
        tasks.start("pump", pump())
        try:
            if fmt == "sse":
                yield b"retry: 1000\n\n"
            while True:
                try:
                    batch = await asyncio.wait_for(queue.get(), KEEPALIVE_S)
                except asyncio.TimeoutError:
                    yield b": keep-alive\n\n" if fmt == "sse" else b"\n"
                    continue
                if batch is None:
                    return
                out = []
                for e in batch:
                    line = e.model_dump_json(exclude_none=True)
                    out.append(f"data: {line}\n\n" if fmt == "sse" else line + "\n")
                if out:
                    yield "".join(out).encode()
        finally:
            await tasks.stop()

    media = "text/event-stream" if fmt == "sse" else "application/x-ndjson"
    return StreamingResponse(body(), media_type=media, headers={
        "Cache-Control": "no-store", "X-Accel-Buffering": "no"})
