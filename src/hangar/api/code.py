"""``/sandboxes/{id}/code``: the code interpreter of a ``code-interpreter`` sandbox.

``POST .../code/execute`` runs a cell and streams NDJSON, one object a line
as the kernel produces it, in E2B's code interpreter shapes (``stdout``,
``stderr``, ``result``, ``error``, ``number_of_executions``,
``end_of_execution``); ``.../code/contexts`` creates, lists, restarts and
removes contexts (kernels with their own variables). The calls go to the
guest's server through ``SandboxService.code`` (``hangar.core.interpreter``). A sandbox of another
image answers 409 ``no_interpreter``. A context create or restart answers
at once with the guest's spare kernel; one made before the next spare is
ready waits for it, and answers 504 ``timeout`` when none is ready within
the guest server's 240 s (the start goes on: try again).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field

from hangar.api.deps import manager
from hangar.core.service import MAX_CODE_CHARS, SandboxManager
from hangar.errors import InvalidRequest
from hangar.schemas.base import PATH_MAX
from hangar.schemas.bounds import EXEC_TIMEOUT_MAX_S

router = APIRouter(prefix="/sandboxes", tags=["code interpreter"])
Manager = Annotated[SandboxManager, Depends(manager)]


class RunCode(BaseModel):
    code: str = Field(max_length=MAX_CODE_CHARS, description="The cell's code.")
    context_id: str | None = Field(default=None, max_length=64,
                                   description="The context to run in (default: the default "
                                               "Python context).")
    language: str | None = Field(default=None, max_length=32,
                                 description="Only \"python\" is served.")
    env_vars: dict[str, str] | None = Field(default=None, max_length=256,
                                            description="Environment for this cell only.")
    timeout: float | None = Field(default=None, gt=0, le=EXEC_TIMEOUT_MAX_S,
                                  description="Seconds the cell may run (none: no limit).")


class CreateContext(BaseModel):
    language: str | None = Field(default=None, max_length=32)
    cwd: str | None = Field(default=None, max_length=PATH_MAX,
                            description="The kernel's working folder (default: /root).")


class CodeContext(BaseModel):
    id: str
    language: str
    cwd: str


@router.post(
    "/{sandbox_id}/code/execute",
    summary="Run code in the code interpreter, streaming its outputs as NDJSON",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/x-ndjson": {}}, "description": (
        "One JSON object a line: {\"type\": \"stdout\"|\"stderr\", \"text\", \"timestamp\" "
        "(ns)}; {\"type\": \"result\", \"is_main_result\", and one key per format: text, "
        "html, markdown, svg, png, jpeg (base64), pdf, latex, json, javascript, extra}; "
        "{\"type\": \"error\", \"name\", \"value\", \"traceback\"}; "
        "{\"type\": \"number_of_executions\", \"execution_count\"}; last "
        "{\"type\": \"end_of_execution\"}.")}},
)
async def execute(sandbox_id: str, body: RunCode, m: Manager) -> StreamingResponse:
    lines = await m.code.execute(sandbox_id, body.code, context_id=body.context_id,
                                 language=body.language, env_vars=body.env_vars,
                                 timeout=body.timeout)
    return StreamingResponse(lines, media_type="application/x-ndjson")


@router.post("/{sandbox_id}/code/contexts", response_model=CodeContext,
             summary="Create a code context (a kernel of its own)")
async def create_context(sandbox_id: str, m: Manager,
                         body: CreateContext | None = None) -> Any:
    return await m.code.call(sandbox_id, "POST", "/contexts",
                             (body or CreateContext()).model_dump(exclude_none=True))


@router.get("/{sandbox_id}/code/contexts", response_model=list[CodeContext],
            summary="List the code contexts")
async def list_contexts(sandbox_id: str, m: Manager) -> Any:
    return await m.code.call(sandbox_id, "GET", "/contexts")


@router.post("/{sandbox_id}/code/contexts/{context_id}/restart", status_code=204,
             summary="Restart a code context's kernel (its variables are lost)")
async def restart_context(sandbox_id: str, context_id: str, m: Manager) -> Response:
    await m.code.call(sandbox_id, "POST", f"/contexts/{_cid(context_id)}/restart")
    return Response(status_code=204)


@router.delete("/{sandbox_id}/code/contexts/{context_id}", status_code=204,
               summary="Remove a code context")
async def remove_context(sandbox_id: str, context_id: str, m: Manager) -> Response:
    await m.code.call(sandbox_id, "DELETE", f"/contexts/{_cid(context_id)}")
    return Response(status_code=204)


def _cid(context_id: str) -> str:
    if not context_id.isalnum() or len(context_id) > 64:
        raise InvalidRequest(f"context id {context_id!r} must be letters and digits")
    return context_id
