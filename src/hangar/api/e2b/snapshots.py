"""E2B's snapshot routes: take one of a sandbox, list them.

An E2B snapshot is a Hangar snapshot (memory, devices and disk; the sandbox
runs on). Its ``snapshotID`` is the Hangar snapshot's id, and a create whose
``templateID`` is that id starts a sandbox from it (a Hangar fork). Hangar's
snapshots have no names: a snapshot ``name`` is refused, and ``names`` holds
the id. ``DELETE /templates/{id}`` removes one (``hangar.api.e2b.templates``).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query, Response

from hangar.api.deps import manager
from hangar.api.e2b import views
from hangar.api.e2b.errors import E2BRoute
from hangar.api.e2b.models import SnapshotInfo, SnapshotRequest
from hangar.core.service import SandboxManager, SnapshotView, State
from hangar.errors import Conflict, InvalidRequest

router = APIRouter(route_class=E2BRoute)
Manager = Annotated[SandboxManager, Depends(manager)]

PAGE = 100
"""Largest page of the list (E2B's ``limit`` maximum)."""


def info(snap: SnapshotView) -> SnapshotInfo:
    return SnapshotInfo(snapshotID=snap.id, names=[snap.id])


@router.post("/sandboxes/{sandbox_id}/snapshots", status_code=201, response_model=SnapshotInfo)
async def take(sandbox_id: str, m: Manager, body: SnapshotRequest | None = None) -> SnapshotInfo:
    """Snapshot a running sandbox (it is paused for the moment it takes, then runs on).
    400 for a ``name``; 409 for a paused sandbox; 503 while a call to it is in flight."""
    if body is not None and body.name:
        raise InvalidRequest("name: Hangar's snapshots have no names; leave it out and use "
                             "the snapshotID of the answer", field="name")
    rec = views.shown(m, sandbox_id)
    if rec.state != State.RUNNING:
        raise Conflict(f"sandbox {sandbox_id} is {views.state_of(rec)}; connect to it "
                       "before taking a snapshot", sandbox_id=sandbox_id)
    return info(await m.snapshot(sandbox_id))


@router.get("/snapshots", response_model=list[SnapshotInfo])
async def list_(m: Manager, response: Response, sandboxID: str | None = None,
                name: str | None = None, nextToken: str | None = None,
                limit: Annotated[int, Query(ge=1, le=PAGE)] = PAGE) -> list[SnapshotInfo]:
    """Snapshots, oldest first (of ``sandboxID`` when given; ``name`` is a snapshot id,
    a ``:tag`` ignored); ``X-Next-Token`` when there is another page."""
    snaps = m.list_snapshots(sandboxID)
    if name:
        wanted = name.rsplit(":", 1)[0]
        snaps = [s for s in snaps if s.id == wanted]
    if nextToken and (not (nextToken.isascii() and nextToken.isdigit()) or len(nextToken) > 9):
        raise InvalidRequest(f"nextToken: {nextToken[:40]!r} is not a token this server gave",
                             field="nextToken")
    start = int(nextToken or 0)
    page = snaps[start:start + limit]
    if start + limit < len(snaps):
        response.headers["X-Next-Token"] = str(start + limit)
    return [info(s) for s in page]
