"""E2B's template builds (its SDK's ``Template.build``), onto ``hangar.core.builds``.

The flow E2B's SDK follows, as served here:

1. ``POST /v3/templates`` ``{name, tags, cpuCount, memoryMB}``: a new build of
   template ``name`` (``name:tag`` adds a tag); **202** with its ``templateID``
   (the name) and ``buildID``.
2. For each ``COPY``: ``GET /templates/{id}/files/{hash}``: **201**
   ``{present, url}``; when not present the SDK PUTs the files' tar archive
   to ``url``, a signed URL as a presigned object-store URL is: its
   ``signature`` lets its holder upload that one archive for an hour and do
   nothing else (``signature`` is a parameter Hangar's logs never show). The
   upload route needs no API key; it checks the signature and the declared
   size before it reads a byte, and streams the body to disk (``UPLOAD_MAX``).
3. ``POST /v2/templates/{id}/builds/{build}`` with the steps: **202**; the build
   runs in a build sandbox (``hangar.core.builds``).
4. ``GET /templates/{id}/builds/{build}/status?logsOffset=N``: its status
   (building, ready, error) and log lines from N; ``.../logs`` the same lines.
5. Tags: ``POST /templates/tags``, ``DELETE /templates/tags``,
   ``GET /templates/{id}/tags``. A template is removed by
   ``DELETE /templates/{id}`` (``hangar.api.e2b.templates``).

Bases: ``fromImage`` ``e2bdev/base`` (E2B's base image, Hangar's ``base``:
``from_base_image()``), ``fromTemplate`` (a Hangar image, a template built
here, or an E2B alias), and any other ``fromImage``: an image of a registry
the operator allows (``hangar.core.pulls``, ``hangar.images.registry``),
pulled as root and built into a Hangar image when the build runs; a
reference that does not parse or names a registry not allowed is a 400 at
once, one that cannot be pulled a failed build naming the registry.
``fromImageRegistry`` brings the build's own credentials: ``registry``
(username and password) and ``gcp`` (a service account's JSON key, which
Google's registries take as the password of user ``_json_key``); ``aws`` is a
400 (give ECR's password, ``aws ecr get-login-password``, as ``registry``).
The first step's user is E2B's default user ``user`` in ``/home/user``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from hangar.api.deps import manager
from hangar.api.e2b.errors import E2BRoute
from hangar.api.e2b.models import _Answer
from hangar.api.e2b.views import rfc3339
from hangar.api.e2b_hosts import client_path
from hangar.core.service import (
    UPLOAD_MAX, BuildSpec, BuildState, BuildView, Copy, CreateOptions, Credentials, Env, Run,
    SandboxManager,
    Step, User, Workdir, e2b, e2b_user,
)
from hangar.errors import InvalidRequest, NotFound, TooLarge, Unauthorized
from hangar.schemas.bounds import MEMORY_MIB_MAX, MEMORY_MIB_MIN, VCPUS_MAX, VCPUS_MIN

router = APIRouter(route_class=E2BRoute)
uploads = APIRouter(route_class=E2BRoute)
"""The upload route: no API key, a signed URL instead (see the module)."""
Manager = Annotated[SandboxManager, Depends(manager)]

BASE_IMAGES = {"e2bdev/base": "base", "e2bdev/base:latest": "base"}
"""E2B's base image, as ``fromImage`` names it, and the Hangar image it stands for."""
STEPS_MAX = 1000
ARG_MAX = 65536
"""Longest argument of a step, characters."""
BUILD_TTL_S = 7200.0
"""A build sandbox's time to live, seconds: the longest a build may take (its sandbox then
expires, and the build fails)."""
START_USER = e2b.DEFAULT_USER
START_DIR = f"/home/{e2b.DEFAULT_USER}"


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class NewBuild(_Request):
    name: str | None = Field(default=None, max_length=200)
    alias: str | None = Field(default=None, max_length=200)
    tags: list[Annotated[str, Field(max_length=200)]] | None = Field(default=None,
                                                                     max_length=64)
    cpuCount: int | None = Field(default=None, ge=VCPUS_MIN, le=VCPUS_MAX)
    memoryMB: int | None = Field(default=None, ge=MEMORY_MIB_MIN, le=MEMORY_MIB_MAX)


class BuildStep(_Request):
    type: str = Field(max_length=32)
    args: list[Annotated[str, Field(max_length=ARG_MAX)]] = Field(default=[], max_length=256)
    filesHash: str | None = Field(default=None, max_length=64)
    force: bool = False


class ImageRegistry(_Request):
    type: Literal["registry", "aws", "gcp"]
    username: str | None = Field(default=None, max_length=256)
    password: str | None = Field(default=None, max_length=8192)
    serviceAccountJson: str | None = Field(default=None, max_length=8192)

    def __repr__(self) -> str:  # never a password in a log or a traceback
        return f"ImageRegistry(type={self.type!r}, ...)"


class StartBuild(_Request):
    fromImage: str | None = Field(default=None, max_length=500)
    fromTemplate: str | None = Field(default=None, max_length=200)
    fromImageRegistry: ImageRegistry | None = None
    force: bool = False
    steps: list[BuildStep] = Field(default=[], max_length=STEPS_MAX)
    startCmd: str | None = Field(default=None, max_length=ARG_MAX)
    readyCmd: str | None = Field(default=None, max_length=ARG_MAX)


class TagsRequest(_Request):
    target: str = Field(max_length=300)
    tags: list[Annotated[str, Field(max_length=200)]] = Field(max_length=64)


class UntagRequest(_Request):
    name: str = Field(max_length=300)
    tags: list[Annotated[str, Field(max_length=200)]] = Field(max_length=64)


class BuildCreated(_Answer):
    templateID: str
    buildID: str
    public: bool
    names: list[str]
    tags: list[str]
    aliases: list[str]


class FileUpload(_Answer):
    present: bool
    url: str | None = None


class LogEntry(_Answer):
    timestamp: str
    level: Literal["debug", "info", "warn", "error"]
    message: str


class Reason(_Answer):
    message: str
    step: str | None = None
    logEntries: list[LogEntry] | None = None


class BuildInfo(_Answer):
    templateID: str
    buildID: str
    status: Literal["building", "waiting", "ready", "error"]
    logs: list[str]
    logEntries: list[LogEntry]
    reason: Reason | None = None


class BuildLogs(_Answer):
    logs: list[LogEntry]


class AssignedTags(_Answer):
    tags: list[str]
    buildID: str


class Tag(_Answer):
    tag: str
    buildID: str
    createdAt: str


def _entries(view: BuildView) -> list[LogEntry]:
    return [LogEntry(timestamp=rfc3339(line.at), level=line.level,  # type: ignore[arg-type]
                     message=line.message) for line in view.logs]


@router.post("/v3/templates", status_code=202, response_model=BuildCreated)
async def new_build(body: NewBuild, m: Manager) -> BuildCreated:
    """A new build of ``name`` (or the older ``alias``); ``name:tag`` adds ``tag``."""
    given = body.name or body.alias
    if not given:
        raise InvalidRequest("name: a template name is needed", field="name")
    name, _, tag = given.partition(":")
    if name in e2b.TEMPLATE_ALIASES or _is_image(m, name):
        raise InvalidRequest(f"name: {name!r} is one of Hangar's images; choose another name",
                             field="name")
    tags = [*([tag] if tag else []), *(body.tags or [])]
    view = m.builds.new(name, tags, body.cpuCount, body.memoryMB)
    return BuildCreated(templateID=name, buildID=view.build_id, public=False, names=[name],
                        tags=list(view.tags), aliases=[name])


def _is_image(m: SandboxManager, name: str) -> bool:
    try:
        return e2b.resolve(m, name).kind == "image"
    except NotFound:
        return False


@router.get("/templates/{template_id}/files/{files_hash}", status_code=201,
            response_model=FileUpload)
async def upload_link(template_id: str, files_hash: str, request: Request,
                      m: Manager) -> FileUpload:
    """Whether the archive ``files_hash`` is here; else a signed URL to upload it to."""
    if m.builds.has_files(template_id, files_hash):
        return FileUpload(present=True)
    url = request.url_for("e2b_template_upload", template_id=template_id,
                          files_hash=files_hash)
    url = url.replace(path=client_path(request.scope, url.path))  # api.<domain> has no /e2b
    signature = m.builds.upload_token(template_id, files_hash)
    return FileUpload(present=False, url=str(url.include_query_params(signature=signature)))


@uploads.put("/templates/{template_id}/files/{files_hash}/upload", status_code=204,
             name="e2b_template_upload")
async def upload(template_id: str, files_hash: str, request: Request, m: Manager,
                 signature: Annotated[str, Query(max_length=200)] = "") -> Response:
    """The files of one ``COPY`` (a tar, gzip'd or not), streamed to disk; the signature
    and the declared size are checked first."""
    stored = m.builds.check_upload_token(template_id, files_hash, signature) \
        if signature else None
    if stored is None:
        raise Unauthorized("signature: not a valid upload signature for these files")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > UPLOAD_MAX:
        raise TooLarge(f"the upload is larger than {UPLOAD_MAX} bytes", limit_bytes=UPLOAD_MAX)
    await m.builds.save_files(stored, files_hash, request.stream())
    return Response(status_code=204)


RAW_BODY = [("PUT", "/e2b/templates/{template_id}/files/{files_hash}/upload")]
"""The upload streams its body (``hangar.api.limits``)."""


def _step(i: int, s: BuildStep) -> Step:
    where = f"steps[{i}]"
    a = s.args
    kind = s.type.upper()
    if kind == "COPY":
        if len(a) < 2 or not s.filesHash:
            raise InvalidRequest(f"{where}: COPY needs a source, a destination and filesHash",
                                 field="steps")
        mode = a[3] if len(a) > 3 and a[3] else None
        if mode is not None and not (mode.isdigit() and set(mode) <= set("01234567")
                                     and int(mode, 8) <= 0o7777):
            raise InvalidRequest(f"{where}: mode {mode[:20]!r} is not octal permission bits",
                                 field="steps")
        return Copy(files=s.filesHash, src=a[0], dest=a[1], owner=(a[2] if len(a) > 2 and
                    a[2] else None), mode=int(mode, 8) if mode else None)
    if kind == "RUN" and a:
        return Run(command=a[0], user=a[1] if len(a) > 1 and a[1] else None)
    if kind == "ENV" and a and len(a) % 2 == 0:
        return Env(values=tuple(zip(a[::2], a[1::2], strict=True)))
    if kind == "WORKDIR" and len(a) == 1:
        return Workdir(path=a[0])
    if kind == "USER" and len(a) == 1:
        return User(name=a[0])
    raise InvalidRequest(f"{where}: {s.type[:32]!r} with {len(a)} arguments is not a step "
                         "this server runs (COPY, RUN, ENV, WORKDIR, USER)", field="steps")


def _base(m: SandboxManager, body: StartBuild) -> tuple[e2b.Source, BuildState]:
    """Where the build sandbox starts from, and the first step's state."""
    if body.fromTemplate:
        name = body.fromTemplate
    elif body.fromImage in BASE_IMAGES:
        name = BASE_IMAGES[body.fromImage]
    elif body.fromImage:
        try:
            name = m.pulls.check(body.fromImage)
        except InvalidRequest as e:
            raise InvalidRequest(f"fromImage: {e.message}", field="fromImage") from None
        return e2b.Source("registry", name, body.fromImage), BuildState(user=START_USER,
                                                                        workdir=START_DIR)
    else:
        raise InvalidRequest("fromImage or fromTemplate is needed", field="fromImage")
    try:
        built = m.builds.source(name)
        if built is not None:
            return e2b.Source("snapshot", built.snapshot_id, name, built.shared), BuildState(
                user=built.user, workdir=built.workdir, env=built.env)
        return e2b.resolve(m, name), BuildState(user=START_USER, workdir=START_DIR)
    except NotFound:
        raise InvalidRequest(f"fromTemplate: {name[:200]!r} is not an image or a template of "
                             "this server (a registry's image is fromImage)",
                             field="fromTemplate") from None


def _credentials(body: StartBuild) -> Credentials | None:
    """The build's own registry credentials; raises InvalidRequest for a kind not
    served here."""
    r = body.fromImageRegistry
    if r is None or not body.fromImage or body.fromImage in BASE_IMAGES:
        return None
    if r.type == "aws":
        raise InvalidRequest("fromImageRegistry: aws is not served by this server; give "
                             "the registry's password (aws ecr get-login-password) with user "
                             "AWS as a registry login", field="fromImageRegistry")
    if r.type == "gcp":
        if not r.serviceAccountJson:
            raise InvalidRequest("fromImageRegistry: gcp needs serviceAccountJson",
                                 field="fromImageRegistry")
        return Credentials("_json_key", r.serviceAccountJson)
    if not r.username or not r.password:
        raise InvalidRequest("fromImageRegistry: a registry login needs username and "
                             "password", field="fromImageRegistry")
    return Credentials(r.username, r.password)


async def _launch(m: SandboxManager, source: e2b.Source, view: BuildView,
                  creds: Credentials | None, say: Callable[[str], None],
                  layer: str | None) -> str:
    """Boot the build sandbox of ``view`` from ``source`` (or from the snapshot ``layer``
    of an earlier build), with E2B's default user; an image of a registry is pulled
    first (``core.pulls``)."""
    if source.kind == "registry" and layer is None:
        await m.pulls.image(source.asked, creds, say)
    opts = e2b.Options(template=source.asked, user=e2b.DEFAULT_USER)
    meta = {"template_build": f"{view.template}:{view.build_id}"}
    fields: dict[str, Any] = {**e2b.with_options(meta, opts), "timeout_s": BUILD_TTL_S}
    snapshot = layer or (source.name if source.kind == "snapshot" else None)
    if snapshot is not None:
        made = CreateOptions(**fields)
    else:
        made = CreateOptions(image=source.name, vcpus=view.vcpus, memory_mib=view.memory_mib,
                             **fields)
    rec = await m.provision(made, prepare=functools.partial(e2b_user.add_user, m),
                            snapshot_id=snapshot, shared=source.shared and layer is None)
    return rec.id


@router.post("/v2/templates/{template_id}/builds/{build_id}", status_code=202)
async def start_build(template_id: str, build_id: str, body: StartBuild,
                      m: Manager) -> Response:
    """Start build ``build_id`` with ``body``'s base and steps. A build refused here (a
    bad step, a base that is not served) is forgotten, and its template with it when it
    has no other build."""
    view = m.builds.status(template_id, build_id, limit=0)
    try:
        steps = tuple(_step(i, s) for i, s in enumerate(body.steps))
        source, state = _base(m, body)
        creds = _credentials(body)
    except InvalidRequest:
        await m.builds.discard(template_id, build_id)
        raise
    base = source.asked if source.kind == "registry" else source.name
    spec = BuildSpec(base=f"{source.kind}:{base}", steps=steps, state=state,
                     start=body.startCmd or None, ready=body.readyCmd or None,
                     force=body.force,
                     fresh_from=next((i for i, s in enumerate(body.steps) if s.force), None))
    m.builds.start(template_id, build_id, spec,
                   functools.partial(_launch, m, source, view, creds))
    return Response(status_code=202)


@router.get("/templates/{template_id}/builds/{build_id}/status", response_model=BuildInfo)
async def status(template_id: str, build_id: str, m: Manager,
                 logsOffset: Annotated[int, Query(ge=0, le=10**9)] = 0,
                 limit: Annotated[int, Query(ge=0, le=100)] = 100) -> BuildInfo:
    """The build's status and its log lines from ``logsOffset`` (100 at most)."""
    view = m.builds.status(template_id, build_id, logsOffset, limit)
    reason = (Reason(message=view.reason, step=view.step) if view.reason else None)
    return BuildInfo(templateID=template_id, buildID=build_id,
                     status=view.status,  # type: ignore[arg-type]
                     logs=[], logEntries=_entries(view), reason=reason)


@router.get("/templates/{template_id}/builds/{build_id}/logs", response_model=BuildLogs)
async def logs(template_id: str, build_id: str, m: Manager,
               cursor: Annotated[int, Query(ge=0, le=10**9)] = 0,
               limit: Annotated[int, Query(ge=0, le=100)] = 100) -> BuildLogs:
    """The build's log lines from line ``cursor`` (100 at most)."""
    return BuildLogs(logs=_entries(m.builds.status(template_id, build_id, cursor, limit)))


@router.post("/templates/tags", status_code=201, response_model=AssignedTags)
async def assign_tags(body: TagsRequest, m: Manager) -> AssignedTags:
    build_id, tags = await m.builds.assign_tags(body.target, body.tags)
    return AssignedTags(tags=tags, buildID=build_id)


@router.delete("/templates/tags", status_code=204)
async def remove_tags(body: UntagRequest, m: Manager) -> Response:
    await m.builds.remove_tags(body.name.partition(":")[0], body.tags)
    return Response(status_code=204)


@router.get("/templates/{template_id}/tags", response_model=list[Tag])
async def tags(template_id: str, m: Manager) -> list[Tag]:
    return [Tag(tag=t, buildID=b, createdAt=rfc3339(at))
            for t, b, at in m.builds.tags(template_id.partition(":")[0])]
