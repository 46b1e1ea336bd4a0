"""``/sandboxes``: create, list, get, delete, and exec (JSON and NDJSON stream)."""

from __future__ import annotations

import asyncio
import base64
import codecs
import dataclasses
import json
import shlex
from collections.abc import AsyncIterator, Iterator
from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import StreamingResponse

from hangar.api.deps import manager, placement, queued_until_gone
from hangar.api.models import (
    CreateSandbox, ExecRequest, ExecResponse, Sandbox, SandboxList, SetTimeout,
)
from hangar.schemas import MountedVolume, SandboxMemory
from hangar.core.service import (
    Command, CreateOptions, ExecResult, Placement, SandboxManager, StreamCapture, sandbox_view,
)
from hangar.errors import HangarError, InvalidRequest

router = APIRouter(prefix="/sandboxes", tags=["sandboxes"])
Manager = Annotated[SandboxManager, Depends(manager)]
Placed = Annotated[Placement | None, Depends(placement)]


view = sandbox_view
"""A sandbox as the API shows it (``hangar.core.views.sandbox_view``)."""


@router.post("", status_code=201, response_model=Sandbox,
             summary="Create a sandbox; answers once its guest agent is ready")
async def create(request: Request, m: Manager, placed: Placed,
                 body: CreateSandbox | None = None) -> Sandbox:
    body = body or CreateSandbox()
    m.policy(body.network)  # a bad or unenforceable policy is a 400 before anything else
    async with queued_until_gone(request):  # a client gone while queued starts nothing
        rec = await m.create(CreateOptions(
            image=body.image, vcpus=body.vcpus, memory_mib=body.memory_mib,
            disk_mib=body.disk_mib, timeout_s=body.timeout, metadata=body.metadata,
            desktop=body.desktop, network=body.network,
            volumes={p: v if isinstance(v, str) else v.model_dump()
                     for p, v in body.volumes.items()} if body.volumes else None,
            secrets=dict(body.secrets) if body.secrets else None,
        ), placed)
    return _in_full(m, view(rec))


def _in_full(m: SandboxManager, out: Sandbox) -> Sandbox:
    """``out`` with its volumes and its secrets' names (never a value or placeholder)."""
    got = m.volumes.of_sandbox(out.id)
    if got:
        out.volumes = {path: MountedVolume(**v) for path, v in got.items()}
    names = m.secrets.of_sandbox(out.id)
    if names is not None:
        out.secrets = names
    return out


@router.get("", response_model=SandboxList, summary="List sandboxes that are not deleted")
async def list_(m: Manager) -> SandboxList:
    return SandboxList(sandboxes=[view(r) for r in m.list()])


@router.get("/{sandbox_id}", response_model=Sandbox,
            summary="One sandbox, with the host memory its VM costs beside its guest's use")
async def get(sandbox_id: str, m: Manager) -> Sandbox:
    out = _in_full(m, view(m.get(sandbox_id)))
    if out.state == "running":
        usage = await m.memory(sandbox_id)
        if usage is not None:
            out.memory = SandboxMemory(**dataclasses.asdict(usage))
    return out


@router.delete("/{sandbox_id}", status_code=204, summary="End the VM and remove its files")
async def delete(sandbox_id: str, m: Manager) -> Response:
    await m.delete(sandbox_id)
    return Response(status_code=204)


@router.post("/{sandbox_id}/timeout", response_model=Sandbox,
             summary="Set the sandbox's time to live, counted from now")
async def set_timeout(sandbox_id: str, body: SetTimeout, m: Manager) -> Sandbox:
    return view(m.set_timeout(sandbox_id, body.timeout))


def _stdin(body: ExecRequest) -> bytes | None:
    if body.stdin is not None and body.stdin_b64 is not None:
        raise InvalidRequest("give stdin or stdin_b64, not both")
    if body.stdin_b64 is not None:
        try:
            return base64.b64decode(body.stdin_b64, validate=True)
        except ValueError:
            raise InvalidRequest("stdin_b64 is not valid base64") from None
    return body.stdin.encode() if body.stdin is not None else None


def _shown(body: ExecRequest) -> str | None:
    """The command text events may carry: only when the request opted in."""
    if not body.show_command:
        return None
    return shlex.join([body.command, *body.args]) if body.args is not None else body.command


def _meta(body: ExecRequest) -> Command:
    """The command an exec request asks for (no ``cwd``: the guest's home, ``HOME``)."""
    return Command(body.command, body.args, env=body.env or None, cwd=body.cwd,
                   timeout_s=body.timeout, head=body.max_output, tail=body.max_output // 4)


def _text(cap: StreamCapture) -> tuple[str, str, str | None]:
    """(head text, tail text, base64 of head+tail when not valid UTF-8)."""
    raw = cap.head + cap.tail
    try:
        raw.decode("utf-8")
        # Valid as a whole; head and tail may still split a character.
        b64 = None
    except UnicodeDecodeError:
        b64 = base64.b64encode(raw).decode()
    return (cap.head.decode("utf-8", "replace"), cap.tail.decode("utf-8", "replace"), b64)


def exec_response(r: ExecResult) -> ExecResponse:
    out, out_tail, out_b64 = _text(r.stdout)
    err, err_tail, err_b64 = _text(r.stderr)
    return ExecResponse(
        stdout=out, stderr=err, exit_code=r.exit_code, signal=r.signal, timed_out=r.timed_out,
        duration_s=r.duration_s, stdout_bytes=r.stdout.total, stderr_bytes=r.stderr.total,
        stdout_truncated=r.stdout.truncated, stderr_truncated=r.stderr.truncated,
        stdout_tail=out_tail, stderr_tail=err_tail, stdout_b64=out_b64, stderr_b64=err_b64,
    )


STREAMED_ANSWER_BYTES = 64 << 10
"""An exec answer whose output (head and tail of both streams) is over this many bytes is
sent as JSON streamed ``ANSWER_PIECE`` bytes of output at a time, each piece decoded and
encoded from the captured bytes only when it is sent: the ASGI server writes a piece once
the client has taken the ones before (its flow control), so a client that does not read
holds the captured bytes and a piece, never the answer's text (review 29l H2 and 29m M1: up
to 22.5 MiB of JSON, or 20 MiB of decoded text, a request at the largest ``max_output``)."""
ANSWER_PIECE = 1 << 16
"""Bytes of one output of a streamed exec answer decoded and encoded at a time (a few ms)."""


def exec_answer(r: ExecResult) -> ExecResponse | StreamingResponse:
    """``exec_response(r)``, streamed (``_answer_pieces``) when its output is over
    ``STREAMED_ANSWER_BYTES``: the same JSON object either way."""
    size = sum(len(c.head) + len(c.tail) for c in (r.stdout, r.stderr))
    if size <= STREAMED_ANSWER_BYTES:
        return exec_response(r)
    return StreamingResponse(_answer_pieces(r), media_type="application/json")


def _valid_utf8(*parts: bytes) -> bool:
    """Whether ``parts`` joined are valid UTF-8 (without joining them)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        for part in parts:
            decoder.decode(part)
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        return False
    return True


def _text_pieces(data: bytes) -> Iterator[bytes]:
    """``data`` decoded as UTF-8 (errors replaced, as ``bytes.decode`` does) and escaped as
    the inside of a JSON string, ``ANSWER_PIECE`` bytes at a time."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    view = memoryview(data)
    for at in range(0, len(view), ANSWER_PIECE):
        text = decoder.decode(view[at:at + ANSWER_PIECE], final=at + ANSWER_PIECE >= len(view))
        yield json.dumps(text, ensure_ascii=False)[1:-1].encode()


def b64_pieces(*parts: bytes) -> Iterator[bytes]:
    """The base64 of ``parts`` joined (without joining them), about ``ANSWER_PIECE`` bytes
    of input a piece (each a multiple of 3 but the last, so the pieces join without
    padding); also what a streamed screenshot's PNG is sent with (``api.desktop``)."""
    carry = b""
    for part in parts:
        view = memoryview(part)
        for at in range(0, len(view), ANSWER_PIECE):
            data = carry + view[at:at + ANSWER_PIECE]
            whole = len(data) - len(data) % 3
            yield base64.b64encode(data[:whole])
            carry = data[whole:]
    yield base64.b64encode(carry)


async def _answer_pieces(r: ExecResult) -> AsyncIterator[bytes]:
    """``exec_response(r)`` as JSON (``None`` fields left out, as the route's model says),
    each output's text made from ``r``'s bytes a piece at a time with a turn of the loop
    between: the model is built with those fields empty and they are filled in here."""
    bare = {name: dataclasses.replace(cap, head=b"", tail=b"")
            for name, cap in (("stdout", r.stdout), ("stderr", r.stderr))}
    shape = exec_response(dataclasses.replace(r, **bare))
    b64: dict[str, str | None] = {}
    for name, cap in (("stdout", r.stdout), ("stderr", r.stderr)):
        b64[f"{name}_b64"] = None if _valid_utf8(cap.head, cap.tail) else ""
    shape = shape.model_copy(update=b64)
    sources = {"stdout": lambda: _text_pieces(r.stdout.head),
               "stdout_tail": lambda: _text_pieces(r.stdout.tail),
               "stderr": lambda: _text_pieces(r.stderr.head),
               "stderr_tail": lambda: _text_pieces(r.stderr.tail),
               "stdout_b64": lambda: b64_pieces(r.stdout.head, r.stdout.tail),
               "stderr_b64": lambda: b64_pieces(r.stderr.head, r.stderr.tail)}
    sep = b"{"
    for key, value in shape.model_dump(exclude_none=True).items():
        head = sep + json.dumps(key).encode() + b":"
        sep = b","
        if key not in sources:
            yield head + json.dumps(value, ensure_ascii=False).encode()
            continue
        yield head + b'"'
        for piece in sources[key]():
            yield piece
            await asyncio.sleep(0)
        yield b'"'
    yield b"}"


@router.post("/{sandbox_id}/exec", response_model=ExecResponse, response_model_exclude_none=True,
             summary="Run a command and return its result")
async def exec_(sandbox_id: str, body: ExecRequest,
                m: Manager) -> ExecResponse | StreamingResponse:
    result = await m.exec(sandbox_id, _meta(body), _stdin(body), shown=_shown(body))
    return exec_answer(result)


@router.post(
    "/{sandbox_id}/exec/stream",
    summary="Run a command, streaming its output as NDJSON",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/x-ndjson": {}}, "description": (
        "One JSON object a line: {\"type\": \"stdout\"|\"stderr\", \"data\": text} "
        "(or \"data_b64\" when the bytes are not UTF-8), then "
        "{\"type\": \"exit\", \"exit_code\", \"signal\", \"timed_out\", \"duration_s\"}; "
        "or, when the call fails midway, {\"type\": \"error\", \"code\", \"message\"}. "
        "Output is produced as fast as the client reads it (flow control)."
    )}},
)
async def exec_stream(sandbox_id: str, body: ExecRequest, m: Manager) -> StreamingResponse:
    events = m.exec_stream(sandbox_id, _meta(body), _stdin(body), shown=_shown(body))
    # Pull the first event before answering, so a 404/409 is a real status code.
    first = await anext(events)

    async def lines() -> AsyncIterator[bytes]:
        decoders = {"stdout": codecs.getincrementaldecoder("utf-8")(),
                    "stderr": codecs.getincrementaldecoder("utf-8")()}
        ev = first
        try:
            while True:
                if ev.kind == "exit":
                    r = ev.result
                    assert r is not None
                    yield (json.dumps({
                        "type": "exit", "exit_code": r.exit_code, "signal": r.signal,
                        "timed_out": r.timed_out, "duration_s": r.duration_s,
                        "stdout_bytes": r.stdout.total, "stderr_bytes": r.stderr.total,
                    }) + "\n").encode()
                    return
                dec = decoders[ev.kind]
                try:
                    text = dec.decode(ev.data)
                    line = {"type": ev.kind, "data": text}
                except UnicodeDecodeError:
                    dec.reset()
                    line = {"type": ev.kind, "data_b64": base64.b64encode(ev.data).decode()}
                if line.get("data") != "":
                    yield (json.dumps(line) + "\n").encode()
                try:
                    ev = await anext(events)
                except HangarError as e:  # the guest stopped answering, or went away
                    yield (json.dumps({"type": "error", "code": e.code,
                                       "message": e.message}) + "\n").encode()
                    return
        finally:
            await events.aclose()

    return StreamingResponse(lines(), media_type="application/x-ndjson")
