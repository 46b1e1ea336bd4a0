"""Snapshots: take, list, delete, restore in place, and start new sandboxes from one."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response

from hangar.api.deps import manager, placement, queued_until_gone
from hangar.api.models import ForkRequest, RestoreRequest, Sandbox, Snapshot, SnapshotList
from hangar.api.sandboxes import view as sandbox_view
from hangar.core.service import CreateOptions, Placement, SandboxManager, SnapshotView

router = APIRouter(tags=["snapshots"])
Manager = Annotated[SandboxManager, Depends(manager)]


def view(s: SnapshotView) -> Snapshot:
    return Snapshot(id=s.id, sandbox_id=s.sandbox_id, size_bytes=s.size_bytes,
                    created_at=s.created_at, image=s.image,
                    image_id=s.image_id, vcpus=s.vcpus,
                    memory_mib=s.memory_mib, disk_mib=s.disk_mib, team=s.team)


@router.post("/sandboxes/{sandbox_id}/snapshot", response_model=Snapshot, status_code=201,
             summary="Snapshot memory, device state and disk; the sandbox keeps running",
             responses={409: {"description": "not running, or busy with a command (retry)"}})
async def take(sandbox_id: str, m: Manager) -> Snapshot:
    return view(await m.snapshot(sandbox_id))


MISSING_IMAGE = {409: {"description": "image_missing: the image build the snapshot was made "
                                      "from is gone (nothing was changed)"}}


@router.post("/sandboxes/{sandbox_id}/restore", response_model=Sandbox,
             summary="Bring the sandbox back to one of its snapshots", responses=MISSING_IMAGE)
async def restore(sandbox_id: str, body: RestoreRequest, m: Manager) -> Sandbox:
    return sandbox_view(await m.restore(sandbox_id, body.snapshot_id))


@router.get("/snapshots", response_model=SnapshotList)
async def list_(m: Manager, sandbox_id: str | None = None) -> SnapshotList:
    return SnapshotList(snapshots=[view(s) for s in m.list_snapshots(sandbox_id)])


@router.get("/snapshots/{snapshot_id}", response_model=Snapshot)
async def get(snapshot_id: str, m: Manager) -> Snapshot:
    return view(m.get_snapshot(snapshot_id))


@router.delete("/snapshots/{snapshot_id}", status_code=204)
async def delete(snapshot_id: str, m: Manager) -> Response:
    m.delete_snapshot(snapshot_id)
    return Response(status_code=204)


@router.post("/snapshots/{snapshot_id}/sandboxes", response_model=Sandbox, status_code=201,
             summary="Start a new sandbox from a snapshot (a fork)", responses=MISSING_IMAGE)
async def fork(snapshot_id: str, request: Request, m: Manager,
               placed: Annotated[Placement | None, Depends(placement)],
               body: ForkRequest | None = None) -> Sandbox:
    body = body or ForkRequest()
    async with queued_until_gone(request):  # a client gone while queued starts nothing
        rec = await m.fork(snapshot_id, CreateOptions(timeout_s=body.timeout,
                                                      metadata=body.metadata), placed)
    return sandbox_view(rec)
