"""``/teams``: the operator's management of teams (``SandboxService.teams``).

Only an operator's key (a key without a team) reaches these routes; a team's key
gets 403 (``hangar.api.team_gate``). A team's keys are made on the host with
``hangar key add NAME --team TEAM``; a team is removed only once it holds no
sandbox and no key (409 naming what is left).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Response

from hangar.api.deps import manager
from hangar.core.service import SandboxManager, TeamView
from hangar.schemas.teams import (
    CreateTeam, TEAM_NAME, TeamInfo, TeamList, TeamUsage, UpdateTeam,
)

router = APIRouter(prefix="/teams", tags=["teams"])
Manager = Annotated[SandboxManager, Depends(manager)]
Name = Annotated[str, Path(pattern=TEAM_NAME, description="The team's name.")]


def view(t: TeamView) -> TeamInfo:
    u = t.usage
    return TeamInfo(name=t.team.name, created_at=t.team.created, **t.team.limits(),
                    usage=TeamUsage(sandboxes=u.sandboxes, vcpus=u.vcpus,
                                    memory_mib=u.memory_mib, disk_mib=u.disk_mib,
                                    volumes_mib=u.volumes_mib))


@router.get("", response_model=TeamList, summary="List teams with their limits and use")
async def list_(m: Manager) -> TeamList:
    return TeamList(teams=[view(t) for t in m.teams.list()])


@router.post("", status_code=201, response_model=TeamInfo, summary="Make a team",
             responses={409: {"description": "the name is taken"}})
async def create(body: CreateTeam, m: Manager) -> TeamInfo:
    limits = body.model_dump(exclude={"name"})
    return view(m.teams.create(body.name, **limits))


@router.get("/{name}", response_model=TeamInfo, summary="One team, its limits and use")
async def get(name: Name, m: Manager) -> TeamInfo:
    return view(m.teams.get(name))


@router.patch("/{name}", response_model=TeamInfo,
              summary="Change a team's limits (null removes one); what it holds stays")
async def update(name: Name, body: UpdateTeam, m: Manager) -> TeamInfo:
    return view(m.teams.update(name, **body.model_dump(exclude_unset=True)))


@router.delete("/{name}", status_code=204, summary="Remove a team that holds nothing",
               responses={409: {"description": "it holds sandboxes or keys"}})
async def delete(name: Name, m: Manager) -> Response:
    m.teams.remove(name)
    return Response(status_code=204)
