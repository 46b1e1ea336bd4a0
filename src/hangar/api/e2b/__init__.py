"""E2B's control plane, served under ``/e2b``: ``E2B_API_URL=http://HOST:8080/e2b``.

Programs written for E2B's SDKs run on Hangar by setting ``E2B_API_URL``,
``E2B_SANDBOX_URL`` (envd's data plane, ``hangar.api.envd``, at
``/e2b/envd``) and ``E2B_API_KEY`` (a Hangar key; ``hangar key add NAME
--e2b`` makes one in E2B's ``e2b_`` format). docs/e2b.md lists every route
with what is served. HTTP only: the routes call ``hangar.core`` (and its
``e2b`` module: tokens, templates, metrics), never the layers below it.

==================  =============================================================
``sandboxes``       create, list (v1, v2), get, kill, timeout, refreshes, connect,
                    pause, resume, fork, metrics
``snapshots``       take one of a sandbox, list them
``builds``          template builds (E2B's ``Template.build``): new build, uploads,
                    start, status and logs, tags (``hangar.core.builds``)
``templates``       list and get (Hangar's images and templates, and those built
                    here), remove a built template or a snapshot
``volumes``         list, create, get, delete (Hangar's named volumes)
``teams``           the key's team and its figures now (``hangar.core.teams``)
``unsupported``     E2B's routes Hangar does not serve (501), and every other
                    path under ``/e2b`` but envd's (404, 405)
``models``          E2B's request and answer bodies (pydantic)
``views``           Hangar's records as those bodies; states, times, egress policies
``errors``          E2B's error shape ``{"code", "message"}`` for every route here
==================  =============================================================

``router`` holds the routes that need a key (``X-API-KEY``: any key of the
server, checked as every Hangar route checks it; a wrong one is E2B's 401);
``public`` holds ``GET /e2b/health`` and the upload of a build's files (its own
token: ``hangar.api.e2b.builds``). The routes are left out of
docs/openapi.json: E2B's API has its own description.
"""

from __future__ import annotations

from fastapi import APIRouter, Response

from hangar.api.e2b import (
    builds, sandboxes, snapshots, teams, templates, unsupported, volumes,
)
from hangar.api.e2b.errors import E2BRoute

__all__ = ["PREFIX", "public", "router"]

PREFIX = "/e2b"

router = APIRouter(prefix=PREFIX, route_class=E2BRoute, include_in_schema=False)
router.include_router(sandboxes.router)
router.include_router(snapshots.router)
router.include_router(builds.router)
router.include_router(templates.router)
router.include_router(volumes.router)
router.include_router(teams.router)
router.include_router(unsupported.router)  # last: the catch-all

public = APIRouter(prefix=PREFIX, route_class=E2BRoute, include_in_schema=False)
public.include_router(builds.uploads)  # its own token, checked before the body is read


@public.get("/health", status_code=204)
async def health() -> Response:
    """E2B's health check: 204, no key needed."""
    return Response(status_code=204)
