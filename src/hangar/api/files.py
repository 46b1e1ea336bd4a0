"""``/sandboxes/{id}/files``: raw-byte read and write, list, stat, mkdir, remove.

``PUT`` and ``GET /sandboxes/{id}/files?path=...`` carry the file's raw
bytes (``application/octet-stream``), streamed in both directions; writes
are atomic in the guest (temp file, fsync, rename). Relative paths start
at ``/root``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import StreamingResponse

from hangar.api.deps import manager
from hangar.api.models import FileEntry, FileList, PathBody, WriteResult
from hangar.core.sandboxes import SandboxManager

router = APIRouter(prefix="/sandboxes/{sandbox_id}/files", tags=["files"])
Manager = Annotated[SandboxManager, Depends(manager)]
RAW_BODY = [("PUT", router.prefix)]
"""Routes whose body is streamed to the guest, not bound by the JSON body limit
(``hangar.api.limits``)."""
PathQ = Annotated[str, Query(min_length=1, max_length=4096, description="Path in the guest.")]


@router.get("", response_class=StreamingResponse, summary="Read a file's raw bytes",
            responses={200: {"content": {"application/octet-stream": {}}}})
async def read(sandbox_id: str, path: PathQ, m: Manager) -> StreamingResponse:
    chunks = m.read_file(sandbox_id, path)
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

    return WriteResult(**await m.write_file(sandbox_id, path, chunks(), mode))


@router.get("/list", response_model=FileList, summary="List a directory")
async def list_dir(sandbox_id: str, m: Manager, path: PathQ = "/root") -> FileList:
    return FileList(**await m.file_op(sandbox_id, "list_dir", path=path))


@router.get("/stat", response_model=FileEntry)
async def stat(sandbox_id: str, path: PathQ, m: Manager) -> FileEntry:
    return FileEntry(**await m.file_op(sandbox_id, "stat", path=path))


@router.post("/mkdir", response_model=FileEntry, status_code=201)
async def mkdir(sandbox_id: str, body: PathBody, m: Manager) -> FileEntry:
    return FileEntry(**await m.file_op(sandbox_id, "mkdir", path=body.path, parents=body.parents))


@router.delete("", status_code=204, summary="Remove a file or (recursive=true) a directory")
async def remove(sandbox_id: str, path: PathQ, m: Manager, recursive: bool = False) -> Response:
    await m.file_op(sandbox_id, "remove", path=path, recursive=recursive)
    return Response(status_code=204)
