"""``/secrets``: the vault (``SandboxService.secrets``): store, list, rotate and delete secrets
that sandboxes use through their egress proxy without holding them (docs/security.md,
"Secrets and the vault"). No route ever answers with a value. A team's key stores, sees and
binds its team's secrets only (another team's is a 404 like a missing one); the operator's
sees a team's as ``TEAM/name`` (``hangar.core.secrets``)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Response

from hangar.api.deps import manager
from hangar.core.service import SandboxManager, SecretView
from hangar.schemas import CreateSecret, RotateSecret, SecretInfo, SecretList
from hangar.schemas.secrets import SECRET_NAME

router = APIRouter(prefix="/secrets", tags=["secrets"])
Manager = Annotated[SandboxManager, Depends(manager)]
Name = Annotated[str, Path(pattern=SECRET_NAME, description="The secret's name.")]


def view(rec: SecretView) -> SecretInfo:
    return SecretInfo(name=rec.name, hosts=list(rec.hosts), created_at=rec.created_at,
                      updated_at=rec.updated_at)


@router.post("", status_code=201, response_model=SecretInfo,
             summary="Store a secret, encrypted, with the hosts it may be sent to",
             responses={409: {"description": "the name is taken (PUT rotates it)"}})
async def create(body: CreateSecret, m: Manager) -> SecretInfo:
    return view(m.secrets.add(body.name, body.value, body.hosts))


@router.get("", response_model=SecretList, summary="List secrets: names and hosts, never values")
async def list_(m: Manager) -> SecretList:
    return SecretList(secrets=[view(r) for r in m.secrets.list()])


@router.get("/{name}", response_model=SecretInfo, summary="One secret's name and hosts")
async def get(name: Name, m: Manager) -> SecretInfo:
    return view(m.secrets.get(name))


@router.put("/{name}", response_model=SecretInfo,
            summary="Rotate a secret: a new value (and hosts); running sandboxes' proxies "
                    "use it from their next request")
async def rotate(name: Name, body: RotateSecret, m: Manager) -> SecretInfo:
    return view(m.secrets.rotate(name, body.value, body.hosts))


@router.delete("/{name}", status_code=204,
               summary="Delete a secret; sandboxes that use it get their placeholder refused")
async def delete(name: Name, m: Manager) -> Response:
    m.secrets.delete(name)
    return Response(status_code=204)
