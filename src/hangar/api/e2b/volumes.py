"""E2B's volume routes (``/volumes``) on Hangar's named volumes (``hangar.core.volumes``).

E2B's spec (``spec/openapi.yml``: ``Volume``, ``NewVolume``, ``VolumeAndToken``)
names a volume and gives it no size: one made here is ``E2B_VOLUME_MIB``
(sparse; the host holds what is written; ``PATCH /volumes/{id}`` of Hangar's own
API grows it). ``volumeID`` is Hangar's id. ``token`` is empty: Hangar does not
serve E2B's volume content API; read a volume's files with Hangar's
``GET /volumes/{id}/files``, or mount it (``volumeMounts`` at create,
read-write: ``hangar.api.e2b.sandboxes``). A name Hangar cannot take (it must
start with a letter or digit) is E2B's 400; a volume a sandbox holds cannot be
deleted (409).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Response
from pydantic import BaseModel, ConfigDict, Field

from hangar.api.deps import manager
from hangar.api.e2b.errors import E2BRoute
from hangar.core.service import SandboxManager, VolumeView

router = APIRouter(route_class=E2BRoute)
Manager = Annotated[SandboxManager, Depends(manager)]

E2B_VOLUME_MIB = 1024
"""Size of a volume made through E2B's API, MiB (its API has no size)."""


class NewVolume(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=63, pattern=r"^[a-zA-Z0-9_-]+$")


class Volume(BaseModel):
    volumeID: str
    name: str


class VolumeAndToken(Volume):
    token: str = ""


@router.get("/volumes", response_model=list[Volume])
async def list_(m: Manager) -> list[Volume]:
    """Every volume, oldest first."""
    return [Volume(volumeID=v.id, name=v.name) for v in m.volumes.list()]


@router.post("/volumes", status_code=201, response_model=VolumeAndToken)
async def create(body: NewVolume, m: Manager) -> VolumeAndToken:
    """A new empty volume of ``E2B_VOLUME_MIB`` MiB; 400 for a name Hangar cannot take,
    409 when it is taken."""
    v: VolumeView = await m.volumes.create(body.name, E2B_VOLUME_MIB)
    return VolumeAndToken(volumeID=v.id, name=v.name)


@router.get("/volumes/{volume_id}", response_model=VolumeAndToken)
async def get(volume_id: str, m: Manager) -> VolumeAndToken:
    """One volume by id (or name); 404."""
    v = m.volumes.get(volume_id)
    return VolumeAndToken(volumeID=v.id, name=v.name)


@router.delete("/volumes/{volume_id}", status_code=204)
async def delete(volume_id: str, m: Manager) -> Response:
    """Delete a volume and its data; 404, 409 while a sandbox holds it."""
    m.volumes.delete(volume_id)
    return Response(status_code=204)
