"""``/volumes``: named volumes that outlive sandboxes: make, list, get, grow, delete, check and
repair, and read their files without a sandbox (``SandboxService.volumes``; docs/volumes.md).
A volume whose filesystem a guest damaged is a 409 ``volume_corrupt`` naming the repair
(``POST /volumes/{id}/fsck``). A team's key makes, sees and names its team's volumes only
(another team's is a 404 like a missing one); the operator's sees a team's as ``TEAM/name``
(``hangar.core.volumes``)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Response

from hangar.api.deps import manager
from hangar.core.service import SandboxManager, VolumeView
from hangar.schemas import (
    CreateVolume, ResizeVolume, VolumeAttachment, VolumeFileEntry, VolumeFileList, VolumeFsck,
    VolumeInfo, VolumeList,
)
from hangar.schemas.base import PATH_MAX

router = APIRouter(prefix="/volumes", tags=["volumes"])
Manager = Annotated[SandboxManager, Depends(manager)]
ATTACHED = {409: {"description": "the volume is attached to a sandbox (or being changed: "
                                 "busy, retry)"}}
CORRUPT = {409: {"description": "the volume is attached to a sandbox (or being changed: busy, "
                                "retry), or its filesystem is damaged (volume_corrupt: repair "
                                "it with POST /volumes/{id}/fsck)"}}


def view(rec: VolumeView) -> VolumeInfo:
    return VolumeInfo(id=rec.id, name=rec.name, size_mib=rec.size_mib,
                      created_at=rec.created_at, updated_at=rec.updated_at,
                      attached=[VolumeAttachment(sandbox_id=a.sandbox_id, path=a.path,
                                                 read_only=a.read_only)
                                for a in rec.attached])


@router.post("", status_code=201, response_model=VolumeInfo,
             summary="Make an empty named volume (an ext4 filesystem of size_mib MiB)",
             responses={409: {"description": "the name is taken"}})
async def create(body: CreateVolume, m: Manager) -> VolumeInfo:
    return view(await m.volumes.create(body.name, body.size_mib))


@router.get("", response_model=VolumeList, summary="List volumes")
async def list_(m: Manager) -> VolumeList:
    return VolumeList(volumes=[view(r) for r in m.volumes.list()])


@router.get("/{volume}", response_model=VolumeInfo, summary="One volume, by id or name")
async def get(volume: str, m: Manager) -> VolumeInfo:
    return view(m.volumes.get(volume))


@router.patch("/{volume}", response_model=VolumeInfo, responses=CORRUPT,
              summary="Grow a volume (offline: refused while a sandbox holds it)")
async def resize(volume: str, body: ResizeVolume, m: Manager) -> VolumeInfo:
    return view(await m.volumes.resize(volume, body.size_mib))


@router.delete("/{volume}", status_code=204, responses=ATTACHED,
               summary="Delete a volume and its data (refused while a sandbox holds it)")
async def delete(volume: str, m: Manager) -> Response:
    m.volumes.delete(volume)
    return Response(status_code=204)


@router.post("/{volume}/fsck", response_model=VolumeFsck, responses={
    409: {"description": "the volume is attached to a sandbox (or busy), or e2fsck could not "
                         "repair it (volume_corrupt)"}},
             summary="Check and repair a volume's filesystem (e2fsck -f -y; refused while a "
                     "sandbox holds it)")
async def fsck(volume: str, m: Manager) -> VolumeFsck:
    got = await m.volumes.fsck(volume)
    return VolumeFsck(id=got.id, name=got.name, exit_code=got.exit_code,
                      repaired=got.repaired, output=got.output)


@router.get("/{volume}/files", summary="List a folder of a volume, or read a file of it "
                                       "(at most 16 MiB), without a sandbox",
            responses={**CORRUPT, 200: {"content": {"application/json": {
                "schema": {"$ref": "#/components/schemas/VolumeFileList"}},
                "application/octet-stream": {}},
                "description": "a folder's entries (JSON), or a file's bytes"}})
async def files(volume: str, m: Manager,
                path: Annotated[str, Query(max_length=PATH_MAX)] = "/") -> Any:
    kind, got = await m.volumes.files(volume, path)
    if kind == "file":
        return Response(got, media_type="application/octet-stream")
    entries, total = got
    return VolumeFileList(path=path, total=total, entries=[
        VolumeFileEntry(name=e.name, type=e.type, size=e.size, mode=e.mode, uid=e.uid,
                        gid=e.gid) for e in entries])
