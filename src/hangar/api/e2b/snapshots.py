"""E2B's snapshot routes: take one of a sandbox, list them.

An E2B snapshot is a Hangar snapshot (memory, devices and disk; the sandbox
runs on). Its ``snapshotID`` is the Hangar snapshot's id, and a create whose
``templateID`` is that id, or its ``name``, starts a sandbox from it (a Hangar
fork; a name stands for the newest snapshot given it, as E2B's next build of a
named snapshot template). ``names`` holds the name (else the id).
``DELETE /templates/{id}`` removes one (``hangar.api.e2b.templates``).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query, Response

from hangar.api.deps import manager
from hangar.api.e2b import views
from hangar.api.e2b.errors import E2BRoute
from hangar.api.e2b.models import SnapshotInfo, SnapshotRequest
from hangar.core.service import SandboxManager, SnapshotView, State, e2b
from hangar.errors import Conflict, InvalidRequest

router = APIRouter(route_class=E2BRoute)
Manager = Annotated[SandboxManager, Depends(manager)]

PAGE = 100
"""Largest page of the list (E2B's ``limit`` maximum)."""


def info(snap: SnapshotView) -> SnapshotInfo:
    return SnapshotInfo(snapshotID=snap.id, names=[snap.name or snap.id])


@router.post("/sandboxes/{sandbox_id}/snapshots", status_code=201, response_model=SnapshotInfo)
async def take(sandbox_id: str, m: Manager, body: SnapshotRequest | None = None) -> SnapshotInfo:
    """Snapshot a running sandbox (it is paused for the moment it takes, then runs on).
    400 for a malformed ``name`` or one of a template here; 409 for a paused sandbox; 503
    while a call to it is in flight."""
    name = body.name if body is not None and body.name else None
    if name is not None and (m.builds.exists(name) or any(
            name == t.name or name in t.aliases for t in e2b.templates(m))):
        raise InvalidRequest(f"name: {name!r} is a template's name here", field="name")
    rec = views.shown(m, sandbox_id)
    if rec.state != State.RUNNING:
        raise Conflict(f"sandbox {sandbox_id} is {views.state_of(rec)}; connect to it "
                       "before taking a snapshot", sandbox_id=sandbox_id)
    return info(await m.snapshot(sandbox_id, name))


@router.get("/snapshots", response_model=list[SnapshotInfo])
async def list_(m: Manager, response: Response, sandboxID: str | None = None,
                name: str | None = None, nextToken: str | None = None,
                limit: Annotated[int, Query(ge=1, le=PAGE)] = PAGE) -> list[SnapshotInfo]:
    """Snapshots, oldest first (of ``sandboxID`` when given; ``name`` is a snapshot's name
    or id, a ``:tag`` ignored); ``X-Next-Token`` when there is another page."""
    snaps = m.list_snapshots(sandboxID)
    if name:
        wanted = name.rsplit(":", 1)[0]
        snaps = [s for s in snaps if wanted in (s.id, s.name)]
    if nextToken and (not (nextToken.isascii() and nextToken.isdigit()) or len(nextToken) > 9):
        raise InvalidRequest(f"nextToken: {nextToken[:40]!r} is not a token this server gave",
                             field="nextToken")
    start = int(nextToken or 0)
    page = snaps[start:start + limit]
    if start + limit < len(snaps):
        response.headers["X-Next-Token"] = str(start + limit)
    return [info(s) for s in page]
