"""``/machines/{user_id}``: per-user machines that sleep when idle and wake on demand."""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import StreamingResponse

from hangar.api.deps import placement
from hangar.api.models import ExecRequest, ExecResponse, Machine, MachineList, MachineRequest
from hangar.api.sandboxes import _meta, _shown, _stdin, exec_answer
from hangar.core.service import CreateOptions, MachineManager, Placement

router = APIRouter(prefix="/machines/{user_id}", tags=["machines"])
listing = APIRouter(tags=["machines"])


async def machines(request: Request) -> MachineManager:
    return request.app.state.machines


Machines = Annotated[MachineManager, Depends(machines)]


@listing.get("/machines", response_model=MachineList, summary="List users' machines")
async def list_(mm: Machines) -> MachineList:
    return MachineList(machines=[Machine(**asdict(m)) for m in mm.list()])


@router.post("", response_model=Machine, summary="Get the user's machine, creating it if none",
             responses={201: {"model": Machine, "description": "created"}})
async def get_or_create(user_id: str, mm: Machines, response: Response,
                        placed: Annotated[Placement | None, Depends(placement)],
                        body: MachineRequest | None = None) -> Machine:
    body = body or MachineRequest()
    m, created = await mm.get_or_create(user_id, body.idle_timeout, CreateOptions(
        image=body.image, vcpus=body.vcpus, memory_mib=body.memory_mib, disk_mib=body.disk_mib,
        network=body.network), placed)
    response.status_code = 201 if created else 200
    return Machine(**asdict(m))


@router.get("", response_model=Machine)
async def get(user_id: str, mm: Machines) -> Machine:
    return Machine(**asdict(mm.get(user_id)))


Wait = Annotated[bool, Query(description="Answer once done (default), or at once with 202 "
                                         "after setting the desired state; the reconcile "
                                         "loop then acts.")]


@router.post("/snapshot", response_model=Machine, summary="Put the machine to sleep",
             responses={409: {"description": "busy with a command (retry)"},
                        202: {"model": Machine, "description": "accepted (wait=false)"}})
async def sleep(user_id: str, mm: Machines, response: Response, wait: Wait = True) -> Machine:
    m = await mm.sleep(user_id, wait)
    response.status_code = 200 if wait else 202
    return Machine(**asdict(m))


@router.post("/wake", response_model=Machine, summary="Wake the machine",
             responses={202: {"model": Machine, "description": "accepted (wait=false)"},
                        409: {"description": "image_missing: its image build is gone"}})
async def wake(user_id: str, mm: Machines, response: Response, wait: Wait = True) -> Machine:
    m = await mm.wake(user_id, wait)
    response.status_code = 200 if wait else 202
    return Machine(**asdict(m))


@router.delete("", status_code=204, summary="Remove the machine and everything it held")
async def delete(user_id: str, mm: Machines) -> Response:
    await mm.delete(user_id)
    return Response(status_code=204)


@router.post("/exec", response_model=ExecResponse, response_model_exclude_none=True,
             summary="Run a command on the machine, waking it first if it sleeps")
async def exec_(user_id: str, body: ExecRequest,
                mm: Machines) -> ExecResponse | StreamingResponse:
    m = mm.get(user_id)
    return exec_answer(await mm.sandboxes.exec(m.sandbox_id, _meta(body), _stdin(body),
                                               shown=_shown(body)))
