"""E2B's template routes, read-only, over Hangar's images and templates.

Every image or template with a current build (``hangar image build``,
``hangar template build``) is an E2B template: ready, public, one build (the
current one). Its ``templateID`` is its Hangar name (``base``, ``dev``...);
E2B names that stand for a Hangar one are its ``aliases`` (the code
interpreter's ``code-interpreter-v1`` for Hangar's ``code-interpreter``).
Templates built through E2B's API (``hangar.api.e2b.builds``) are listed too,
with their builds. ``DELETE /templates/{id}`` removes such a template, or a
snapshot (what E2B's SDK also calls it for), and refuses to remove an image.

A team's key (``hangar.core.builds``: teams) sees its own built templates and the
operator's (``public``: shared, as E2B's public templates), and every image; another
team's are missing (404) and absent from lists. It may remove only its own: an image
or the operator's template is a 403 naming why.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query, Response

from hangar.api.deps import manager
from hangar.api.e2b.errors import E2BRoute
from hangar.api.e2b.models import Template, TemplateAlias, TemplateBuild, TemplateWithBuilds
from hangar.api.e2b.views import rfc3339
from hangar.core.service import SandboxManager, acting, e2b
from hangar.errors import Forbidden, HangarError, InvalidRequest, NotFound

router = APIRouter(route_class=E2BRoute)
Manager = Annotated[SandboxManager, Depends(manager)]

PAGE = 100


def template(t: e2b.TemplateInfo) -> Template:
    names = [t.name, *t.aliases]
    return Template(
        templateID=t.name, buildID=t.build_id, cpuCount=t.vcpus, memoryMB=t.memory_mib,
        diskSizeMB=t.disk_mib, public=True, aliases=names, names=names,
        createdAt=rfc3339(t.created_at), updatedAt=rfc3339(t.updated_at), spawnCount=0,
        buildCount=t.builds, envdVersion=e2b.ENVD_VERSION, buildStatus="ready")


def built(m: SandboxManager) -> list[Template]:
    """Templates built here (``hangar.core.builds``) with a ready build, as E2B lists them."""
    out = []
    for name in m.builds.names():
        ready = [b for b in m.builds.builds(name) if b.status == "ready"]
        if not ready:
            continue
        b = ready[-1]
        vcpus, memory = b.vcpus or 2, b.memory_mib or 512
        out.append(Template(
            templateID=name, buildID=b.build_id, cpuCount=vcpus, memoryMB=memory,
            diskSizeMB=m.settings.default_disk_mib, public=m.builds.shared(name),
            aliases=[name], names=[name],
            createdAt=rfc3339(m.builds.builds(name)[0].created_at),
            updatedAt=rfc3339(b.finished_at), spawnCount=0, buildCount=len(ready),
            envdVersion=e2b.ENVD_VERSION, buildStatus="ready"))
    return out


def find(m: SandboxManager, name: str) -> e2b.TemplateInfo:
    """The template ``name`` (a Hangar name or an E2B alias, a ``:tag`` ignored). Raises
    NotFound naming it."""
    wanted = name.rsplit(":", 1)[0]
    for t in e2b.templates(m):
        if wanted == t.name or wanted in t.aliases:
            return t
    raise NotFound(f"template {name!r} is not built on this server", template=name)


@router.get("/templates", response_model=list[Template])
async def list_v1(m: Manager) -> list[Template]:
    return [template(t) for t in e2b.templates(m)] + built(m)


@router.get("/default-templates", response_model=list[Template])
async def defaults(m: Manager) -> list[Template]:
    """The same list: every template of a Hangar server is one of its defaults."""
    return [template(t) for t in e2b.templates(m)]


@router.get("/v2/templates", response_model=list[Template])
async def list_v2(m: Manager, response: Response, nextToken: str | None = None,
                  limit: Annotated[int, Query(ge=1, le=PAGE)] = PAGE) -> list[Template]:
    if nextToken and (not (nextToken.isascii() and nextToken.isdigit()) or len(nextToken) > 9):
        raise InvalidRequest(f"nextToken: {nextToken[:40]!r} is not a token this server gave",
                             field="nextToken")
    every = [template(t) for t in e2b.templates(m)] + built(m)
    start = int(nextToken or 0)
    if start + limit < len(every):
        response.headers["X-Next-Token"] = str(start + limit)
    return every[start:start + limit]


@router.get("/templates/aliases/{alias}", response_model=TemplateAlias)
async def alias(alias: str, m: Manager) -> TemplateAlias:
    name, _, tag = alias.partition(":")
    if m.builds.exists(name):
        if tag and tag not in {t for t, _b, _at in m.builds.tags(name)}:
            raise NotFound(f"template {name!r} has no tag {tag[:128]!r}", template=alias)
        return TemplateAlias(templateID=name, public=m.builds.shared(name))
    return TemplateAlias(templateID=find(m, alias).name, public=True)


@router.get("/templates/{template_id}", response_model=TemplateWithBuilds)
async def get(template_id: str, m: Manager) -> TemplateWithBuilds:
    """The template and its builds (one, the current, for Hangar's images)."""
    name = template_id.rsplit(":", 1)[0]
    if m.builds.exists(name):
        views = m.builds.builds(name)
        builds = [TemplateBuild(
            buildID=b.build_id, status=b.status,  # type: ignore[arg-type]
            createdAt=rfc3339(b.created_at), updatedAt=rfc3339(b.finished_at or b.created_at),
            finishedAt=rfc3339(b.finished_at) if b.finished_at else None,
            cpuCount=b.vcpus or 2, memoryMB=b.memory_mib or 512,
            envdVersion=e2b.ENVD_VERSION) for b in views]
        return TemplateWithBuilds(templateID=name, public=m.builds.shared(name), aliases=[name],
                                  names=[name],
                                  createdAt=rfc3339(views[0].created_at),
                                  updatedAt=rfc3339(views[-1].finished_at
                                                    or views[-1].created_at),
                                  spawnCount=0, builds=builds)
    t = find(m, template_id)
    names = [t.name, *t.aliases]
    build = TemplateBuild(buildID=t.build_id, status="ready", createdAt=rfc3339(t.updated_at),
                          updatedAt=rfc3339(t.updated_at), finishedAt=rfc3339(t.updated_at),
                          cpuCount=t.vcpus, memoryMB=t.memory_mib, diskSizeMB=t.disk_mib,
                          envdVersion=e2b.ENVD_VERSION)
    return TemplateWithBuilds(templateID=t.name, public=True, aliases=names, names=names,
                              createdAt=rfc3339(t.created_at), updatedAt=rfc3339(t.updated_at),
                              spawnCount=0, builds=[build])


@router.delete("/templates/{template_id}", status_code=204)
async def delete(template_id: str, m: Manager) -> Response:
    """Remove a template built here (its snapshots and uploads) or the snapshot
    ``template_id`` (E2B's ``Sandbox.delete_snapshot``). An image or a template of
    ``hangar template build`` is not removed through E2B's API (501; 403 to a team's key,
    as the operator's template built here is); anything else is a 404."""
    snapshot_id = template_id.rsplit(":", 1)[0]
    if m.builds.exists(snapshot_id):
        await m.builds.delete(snapshot_id)
        return Response(status_code=204)
    try:
        m.delete_snapshot(snapshot_id)
        return Response(status_code=204)
    except NotFound:
        pass
    try:
        find(m, template_id)
    except NotFound:
        raise NotFound(f"no snapshot or template {template_id!r}",
                       template=template_id) from None
    if acting() is not None:
        raise Forbidden(f"template {template_id!r} is the operator's: a team may start "
                        "sandboxes from it but not build, tag or remove it",
                        template=template_id)
    raise _NotServed(f"DELETE /templates/{template_id}: Hangar does not remove images or "
                     "templates through E2B's API; remove builds with `hangar image gc`")


class _NotServed(HangarError):
    status, code = 501, "not_implemented"
