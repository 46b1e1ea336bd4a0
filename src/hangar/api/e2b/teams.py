"""E2B's team routes, for the key's team (``hangar.core.teams``).

E2B's ``GET /teams`` lists the teams of the caller; on Hangar a team's key
(``hangar key add NAME --team TEAM --e2b``) belongs to one team, so the list
holds that team, ``isDefault`` true, its ``teamID`` and ``name`` the team's
name, and ``apiKey`` the key the request was made with (the caller holds it
already; Hangar keeps keys' hashes only, so it has no other to give). An
operator's key is of no team: it gets every team, each with an empty
``apiKey`` and ``isDefault`` false.

``GET /teams/{teamID}/metrics`` answers one point, now: the team's sandboxes
that hold a VM (``concurrentSandboxes``) and the sandboxes it started per
second over the last ``RATE_WINDOW_S``. Hangar keeps no history of these
figures (Prometheus does, from ``/metrics``' ``hangar_team_*`` gauges), so
``start`` and ``end`` are checked, not used, and ``/metrics/max`` is not served
(``hangar.api.e2b.unsupported``). Another team's ``teamID`` is 404, as a
missing one.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request

from hangar.api.deps import manager
from hangar.api.e2b.errors import E2BRoute
from hangar.api.e2b.models import Team, TeamMetric
from hangar.core.service import SandboxManager, acting

router = APIRouter(route_class=E2BRoute)
Manager = Annotated[SandboxManager, Depends(manager)]

RATE_WINDOW_S = 60.0
"""Seconds over which ``sandboxStartRate`` counts a team's starts (one minute, a rate a
dashboard plots per point)."""


@router.get("/teams", response_model=list[Team])
async def list_(request: Request, m: Manager) -> list[Team]:
    team = acting()
    if team is not None:
        got = m.teams.get(team)
        return [Team(teamID=got.team.name, name=got.team.name, isDefault=True,
                     apiKey=request.headers.get("x-api-key", ""))]
    return [Team(teamID=t.team.name, name=t.team.name, apiKey="", isDefault=False)
            for t in m.teams.list()]


@router.get("/teams/{teamID}/metrics", response_model=list[TeamMetric])
async def metrics(teamID: str, m: Manager,  # noqa: N803 (E2B's name)
                  start: Annotated[int | None, Query(ge=0)] = None,
                  end: Annotated[int | None, Query(ge=0)] = None) -> list[TeamMetric]:
    got = m.teams.get(teamID)
    now = time.time()
    rate = m.teams.started(got.team.name, now - RATE_WINDOW_S) / RATE_WINDOW_S
    return [TeamMetric(timestamp=datetime.fromtimestamp(now, UTC).isoformat(),
                       timestampUnix=int(now), concurrentSandboxes=got.usage.sandboxes,
                       sandboxStartRate=round(rate, 4))]
