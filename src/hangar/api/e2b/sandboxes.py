"""E2B's sandbox routes: create, list, get, kill, timeouts, connect, pause, resume, fork, metrics.

Each route turns E2B's request into calls on Hangar's core and its answer
into E2B's body (``hangar.api.e2b.views``). How E2B's words map:

- **create** (``POST /sandboxes``, and ``POST /v2/sandboxes`` that the SDK
  uses) boots the template's image, or forks when ``templateID`` names a
  snapshot; ``envVars`` become the default environment of envd's processes,
  ``autoPause`` makes the end of the time to live a pause instead of a
  removal (``autoPauseMemory: false``: a pause that keeps the disk alone, the
  record's ``sleep_memory``); ``secure`` is accepted and every sandbox is secured (an envd
  access token in every answer). It is core's ``provision``: the sandbox made,
  E2B's default user, ``user`` with home ``/home/user`` and passwordless sudo, made
  in the guest (``hangar.core.e2b_user.add_user``; envd's calls run as it unless they
  name root), a code interpreter's kernels moved to it and the ``envVars``
  (``e2b_user.prepare``), then its time to live started, all before the answer.
- **pause** is core's ``pause`` (a sleep: memory, devices and disk saved, the
  VMM ended, and the clock stopped in the same move: no time limit); with
  ``memory: false`` (``mode: filesystem``) the disk alone, and the resume boots
  the guest cold from it (files kept, processes gone). **connect**
  and **resume** are core's ``connect``: it wakes a paused one (``201``) with
  their time to live, or only ever extends a running one's (``200``). Woken any
  other way (a call to it), it gets its create's time to live back; ``autoPause``
  is the record's ``on_expiry`` ``sleep`` (``hangar.core.sleep``).
- **fork** snapshots the sandbox once, starts ``count`` sandboxes from the
  snapshot and removes the snapshot.
- **network** (``PUT /sandboxes/{id}/network``) replaces the egress rules of a
  running sandbox (``hangar.core.network``); its ``allowOut``/``denyOut`` take
  addresses, CIDRs and domains, an allowed entry beating a denied one as in E2B.
- **metrics** are one sample read inside the guest (``hangar.core.e2b.metrics``);
  a paused sandbox has none (``[]``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import urllib.parse
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import JSONResponse

from hangar.api.deps import manager, queued_until_gone
from hangar.api.e2b import views
from hangar.api.e2b.errors import E2BRoute
from hangar.api.e2b.models import (
    ConnectSandbox, ConnectSandboxV2, Error, ForkRequest, ForkResult, ListedSandbox, NetworkUpdate,
    NewSandbox, NewSandboxV2, PauseRequest, RefreshRequest, ResumedSandbox, Sandbox, SandboxDetail,
    SandboxesWithMetrics, SandboxMetric, TimeoutRequest,
)
from hangar.core.service import (
    Connect, CreateOptions, Face, OnExpiry, SandboxManager, SandboxView, State, e2b, e2b_user,
    public_name,
)
from hangar.errors import Busy, Conflict, Deleting, HangarError, InvalidRequest, NotFound
from hangar.schemas.bounds import METADATA_ENTRIES, QUERY_BYTES

log = logging.getLogger("hangar.api.e2b")

router = APIRouter(route_class=E2BRoute)
Manager = Annotated[SandboxManager, Depends(manager)]

MAX_METADATA = METADATA_ENTRIES
"""Metadata entries a sandbox may carry (``hangar.schemas.bounds``, as Hangar's own API)."""
REFRESH_S = 15
"""Seconds a refresh without ``duration`` keeps a sandbox alive (E2B's default timeout)."""
PAGE = 100
"""Largest page of a list (E2B's ``limit`` maximum)."""
EXPIRE_NOW_S = 0.001
"""The time to live a ``timeout`` of 0 sets: E2B's sandbox expires at once (Hangar's 0 would
mean no limit)."""


# -- create -----------------------------------------------------------------------------------

def _check_create(body: NewSandbox) -> None:
    """Refuse what Hangar cannot honour, naming the field."""
    if body.volumeMounts and len({v.path for v in body.volumeMounts}) != len(body.volumeMounts):
        raise InvalidRequest("volumeMounts: each path once", field="volumeMounts")
    if body.volumeMounts and body.autoPause:
        raise InvalidRequest("autoPause: a sandbox with volumeMounts cannot pause (volumes are "
                             "left out of snapshots)", field="autoPause")
    if body.autoPause and not body.autoPauseMemory and body.autoResume \
            and body.autoResume.enabled:
        raise InvalidRequest("autoResume: a sandbox that auto-pauses with autoPauseMemory "
                             "false keeps its filesystem alone and is resumed only by connect "
                             "or resume, never by traffic", field="autoResume")
    if body.mcp:
        raise InvalidRequest("mcp: Failed to start MCP gateway: Hangar does not start E2B's "
                             "MCP gateway (no sandbox was made)", field="mcp")
    if body.iam and body.iam.get("tokens"):
        raise InvalidRequest("iam: Hangar has no workload identity tokens", field="iam")
    # metadata and envVars are bounded by the model (``hangar.schemas.bounds``)


async def _create(m: SandboxManager, body: NewSandbox) -> Sandbox:
    _check_create(body)
    built = m.builds.source(body.templateID.strip())
    source = (e2b.resolve(m, body.templateID) if built is None
              else e2b.Source("snapshot", built.snapshot_id, body.templateID.strip(),
                              built.shared))
    network = views.policy(body.allow_internet_access, body.network)
    # a built template's ENV under the create's envVars; its last USER (root, or the
    # default user) and WORKDIR are its commands' defaults
    envs = {**(built.env if built else {}), **dict(body.envVars or {})}
    opts = e2b.Options(template=source.asked, envs=envs,
                       public_traffic=body.network is None
                       or body.network.allowPublicTraffic is not False,
                       user=e2b.ROOT if built and built.user == e2b.ROOT else e2b.DEFAULT_USER,
                       mask_host=body.network.maskRequestHost if body.network else None,
                       workdir=built.workdir if built else None)
    # envVars often hold keys: sealed by the vault before any record keeps them
    fields: Any = {**e2b.with_options(dict(body.metadata or {}), e2b.sealed(m, opts)),
                   "on_expiry": OnExpiry.SLEEP if body.autoPause else OnExpiry.DELETE,
                   "auto_resume": bool(body.autoResume and body.autoResume.enabled),
                   "sleep_memory": False if body.autoPause and not body.autoPauseMemory
                   else None}
    if source.kind == "snapshot":
        if body.volumeMounts:
            raise InvalidRequest("volumeMounts: a sandbox started from a snapshot gets no "
                                 "volumes (snapshots leave them out)", field="volumeMounts")
        if network is not None:
            raise InvalidRequest("network: a sandbox started from a snapshot keeps the "
                                 "snapshot's egress policy", field="network")
        made = CreateOptions(timeout_s=body.timeout, **fields)
    else:
        m.policy(network)  # a policy Hangar cannot enforce is a 400 before anything boots
        volumes = {v.path: v.name for v in body.volumeMounts or ()} or None  # read-write
        made = CreateOptions(image=source.name, timeout_s=body.timeout, network=network,
                             volumes=volumes, **fields)
    # one verb: made, E2B's default user added (idempotent), then its time to live started
    # a built template's build sandbox made the default user (``hangar.api.e2b.builds``)
    rec = await m.provision(made, prepare=functools.partial(
                                e2b_user.prepare, m,
                                made=e2b.DEFAULT_USER if built is not None else None),
                            snapshot_id=source.name if source.kind == "snapshot" else None,
                            shared=source.shared)
    return views.created(m, rec)


@router.post("/sandboxes", status_code=201, response_model=Sandbox)
async def create(body: NewSandbox, request: Request, m: Manager) -> Sandbox:
    async with queued_until_gone(request):  # a client gone while queued starts nothing
        return await _create(m, body)


@router.post("/v2/sandboxes", status_code=201, response_model=Sandbox)
async def create_v2(body: NewSandboxV2, request: Request, m: Manager) -> Sandbox:
    async with queued_until_gone(request):
        return await _create(m, body)


# -- list ---------------------------------------------------------------------------------------

def _metadata_query(query: str | None) -> dict[str, str]:
    """E2B's ``metadata`` filter (``k=v&k2=v2``, keys and values URL-encoded) as a dict."""
    if not query:
        return {}
    if len(query) > QUERY_BYTES:
        raise InvalidRequest(f"metadata: the filter is {len(query)} characters; at most "
                             f"{QUERY_BYTES} are taken", field="metadata", limit=QUERY_BYTES)
    try:
        pairs = urllib.parse.parse_qsl(query, keep_blank_values=True, strict_parsing=True)
    except ValueError:
        raise InvalidRequest(f"metadata: {query[:80]!r} is not of the form key=value&key2=value2",
                             field="metadata") from None
    return {urllib.parse.unquote(k): urllib.parse.unquote(v) for k, v in pairs}


E2B_STATES = frozenset(n for s in State if (n := public_name(s, Face.E2B)) is not None)
"""The names E2B shows (``lifecycle.PUBLIC``): running, paused."""


def _states(raw: str | None) -> set[str]:
    if not raw:
        return set(E2B_STATES)
    states = {s.strip() for s in raw.split(",") if s.strip()}
    bad = states - E2B_STATES
    if bad:
        raise InvalidRequest(f"state: {sorted(bad)[0]!r} is not running or paused",
                             field="state")
    return states


def _matches(rec: SandboxView, metadata: dict[str, str], template: str | None) -> bool:
    mine = views.user_metadata(rec)
    if any(mine.get(k) != v for k, v in metadata.items()):
        return False
    return template is None or template in views.template_names(rec)


def _offset(token: str | None) -> int:
    if not token:
        return 0
    if not (token.isascii() and token.isdigit()) or len(token) > 9:
        raise InvalidRequest(f"nextToken: {token[:40]!r} is not a token this server gave",
                             field="nextToken")
    return int(token)


@router.get("/sandboxes", response_model=list[ListedSandbox])
async def list_v1(m: Manager, metadata: str | None = None) -> list[ListedSandbox]:
    """Running sandboxes only, as E2B's v1 list."""
    wanted = _metadata_query(metadata)
    return [views.listed(r) for r in m.list()
            if views.state_of(r) == "running" and _matches(r, wanted, None)]


@router.get("/v2/sandboxes", response_model=list[ListedSandbox])
async def list_v2(m: Manager, response: Response, metadata: str | None = None,
                  state: str | None = None, order: str = "desc",
                  startedAfter: datetime | None = None, template: str | None = None,
                  nextToken: str | None = None,
                  limit: Annotated[int, Query(ge=1, le=PAGE)] = PAGE) -> list[ListedSandbox]:
    """Running and paused sandboxes (or those of ``state``), newest first unless ``order``
    is ``asc``; ``X-Next-Token`` when there is another page, ``X-Total-Running``."""
    if order not in ("asc", "desc"):
        raise InvalidRequest(f"order: {order!r} is not asc or desc", field="order")
    wanted, states = _metadata_query(metadata), _states(state)
    after = startedAfter
    if after is not None and after.tzinfo is None:
        after = after.replace(tzinfo=UTC)
    # compared as the times shown (``startedAt``: microseconds, rounded), so a sandbox's
    # own startedAt as startedAfter lists it (as floats, 38 % of them dropped out)
    found = [r for r in m.list() if views.state_of(r) in states
             and _matches(r, wanted, template)
             and (after is None or datetime.fromtimestamp(r.created_at, UTC) >= after)]
    found.sort(key=lambda r: r.created_at, reverse=order == "desc")
    if "running" in states:
        response.headers["X-Total-Running"] = str(
            sum(1 for r in found if views.state_of(r) == "running"))
    start = _offset(nextToken)
    page = found[start:start + limit]
    if start + limit < len(found):
        response.headers["X-Next-Token"] = str(start + limit)
    return [views.listed(r) for r in page]


@router.get("/sandboxes/metrics", response_model=SandboxesWithMetrics)
async def metrics_of_many(m: Manager, sandbox_ids: str) -> SandboxesWithMetrics:
    """One sample of each running sandbox of ``sandbox_ids`` (comma-separated, at most 100);
    unknown and paused ones, and those whose guest gives no sample, are left out."""
    ids = list(dict.fromkeys(s.strip() for s in sandbox_ids.split(",") if s.strip()))
    if not ids or len(ids) > 100:
        raise InvalidRequest("sandbox_ids: give 1 to 100 comma-separated ids",
                             field="sandbox_ids")

    async def one(sid: str) -> SandboxMetric | None:
        try:
            views.shown(m, sid)
            sample = await e2b.metrics(m, sid)
        except HangarError:  # gone, paused meanwhile, or its guest did not answer
            return None
        return views.metric(sample) if sample is not None else None

    got = await asyncio.gather(*(one(s) for s in ids))
    return SandboxesWithMetrics(sandboxes={s: v for s, v in zip(ids, got) if v is not None})


# -- one sandbox ----------------------------------------------------------------------------------

@router.get("/sandboxes/{sandbox_id}", response_model=SandboxDetail)
async def get(sandbox_id: str, m: Manager) -> SandboxDetail:
    return views.detail(m, views.shown(m, sandbox_id))


@router.delete("/sandboxes/{sandbox_id}", status_code=204)
async def kill(sandbox_id: str, m: Manager) -> Response:
    """Remove the sandbox (running, paused or failed). One already being deleted is
    404, as E2B's answer for a killed sandbox (its SDK's ``kill()`` then returns False)."""
    try:
        await m.delete(sandbox_id)
    except Deleting:
        raise NotFound(f"sandbox {sandbox_id} not found", sandbox_id=sandbox_id) from None
    return Response(status_code=204)


@router.put("/sandboxes/{sandbox_id}/network", status_code=204)
async def update_network(sandbox_id: str, body: NetworkUpdate, m: Manager) -> Response:
    """E2B's network update: Hangar's ``PATCH /sandboxes/{id}/network`` with both lists."""
    if body.egressProxy or body.rules:
        raise InvalidRequest("network.egressProxy and network.rules are not supported by "
                             "Hangar (egress rules are allowOut/denyOut lists)")
    deny = list(body.denyOut or [])
    if body.allow_internet_access is False and "0.0.0.0/0" not in deny:
        deny.append("0.0.0.0/0")
    allow, deny = views.e2b_rules(list(body.allowOut or []), deny)
    await m.network.change(sandbox_id, allow=allow, deny=deny)
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/timeout", status_code=204)
async def set_timeout(sandbox_id: str, body: TimeoutRequest, m: Manager) -> Response:
    """The sandbox's time runs out ``timeout`` seconds from now (0: now, as E2B's: it is
    removed, or paused with ``autoPause``, at the next reconcile)."""
    views.shown(m, sandbox_id)
    m.set_timeout(sandbox_id, body.timeout or EXPIRE_NOW_S)
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/refreshes", status_code=204)
async def refresh(sandbox_id: str, m: Manager, body: RefreshRequest | None = None) -> Response:
    """Keep the sandbox alive at least ``duration`` seconds more (default ``REFRESH_S``)."""
    views.shown(m, sandbox_id)
    duration = body.duration if body is not None and body.duration is not None else REFRESH_S
    m.extend(sandbox_id, duration)
    return Response(status_code=204)


# -- pause, connect, resume ------------------------------------------------------------------

def _keeps_memory(body: PauseRequest) -> bool:
    """Whether a pause keeps memory: not when ``memory`` is false or ``mode`` is
    ``filesystem``; both given and at odds is a 400."""
    if body.memory is not None and body.mode is not None \
            and body.memory != (body.mode == "full"):
        raise InvalidRequest(f"memory: {str(body.memory).lower()} contradicts mode: "
                             f"{body.mode}", field="memory")
    return body.memory is not False and body.mode != "filesystem"


@router.post("/sandboxes/{sandbox_id}/pause", status_code=204)
async def pause(sandbox_id: str, m: Manager, body: PauseRequest | None = None) -> Response:
    """Sleep the sandbox: memory, devices and disk saved, its VMM ended, no time limit;
    with ``memory: false`` (``mode: filesystem``) its disk alone, once the guest flushed
    it, and the resume boots the guest cold. 409 when it is paused already (the SDK's
    ``pause`` then returns False); 503 while a call to it is in flight or it is between
    states (retry)."""
    memory = _keeps_memory(body or PauseRequest())
    rec = views.shown(m, sandbox_id)
    if views.state_of(rec) == "paused":
        raise Conflict(f"sandbox {sandbox_id} is already paused", sandbox_id=sandbox_id)
    if rec.state != State.RUNNING:
        raise Busy(f"sandbox {sandbox_id} is {rec.state.value}; retry once it runs",
                   retry_after=2.0)
    await m.pause(sandbox_id, memory)  # no time limit while paused; given back when it wakes
    return Response(status_code=204)


async def _connect(m: SandboxManager, sandbox_id: str, timeout: int) -> JSONResponse:
    views.visible(await m.settled(sandbox_id))  # a failed or stopping one is a 404
    done = await m.connect(sandbox_id, timeout)
    status = 201 if done.did == Connect.WOKE else 200
    return JSONResponse(views.created(m, done.record).model_dump(), status_code=status)


@router.post("/sandboxes/{sandbox_id}/connect", response_model=Sandbox,
             responses={201: {"model": Sandbox}})
async def connect(sandbox_id: str, body: ConnectSandbox, m: Manager) -> JSONResponse:
    """The sandbox, woken if paused (201) or as it runs (200); its time to live is set
    (woken) or only ever extended (running)."""
    return await _connect(m, sandbox_id, body.timeout)


@router.post("/v2/sandboxes/{sandbox_id}/connect", response_model=Sandbox,
             responses={201: {"model": Sandbox}})
async def connect_v2(sandbox_id: str, m: Manager,
                     body: ConnectSandboxV2 | None = None) -> JSONResponse:
    """As ``connect``; ``memory: false`` (a cold boot from disk) is refused."""
    body = body or ConnectSandboxV2()
    if body.memory is False:
        raise InvalidRequest("memory: false is not supported: Hangar resumes a paused "
                             "sandbox with its memory", field="memory")
    return await _connect(m, sandbox_id, body.timeout)


@router.post("/sandboxes/{sandbox_id}/resume", status_code=201, response_model=Sandbox)
async def resume(sandbox_id: str, m: Manager, body: ResumedSandbox | None = None) -> Sandbox:
    """Wake a paused sandbox; 409 when it runs."""
    body = body or ResumedSandbox()
    rec = views.visible(await m.settled(sandbox_id))
    if rec.state != State.SLEEPING:
        raise Conflict(f"sandbox {sandbox_id} is already running", sandbox_id=sandbox_id)
    return views.created(m, (await m.connect(sandbox_id, body.timeout)).record)


# -- fork -----------------------------------------------------------------------------------------

@router.post("/sandboxes/{sandbox_id}/fork", status_code=201, response_model=list[ForkResult])
async def fork(sandbox_id: str, m: Manager, body: ForkRequest | None = None) -> list[ForkResult]:
    """Snapshot the running sandbox once, start ``count`` sandboxes from it (one after
    another), remove the snapshot. Each result holds a sandbox or the error that kept it
    from starting."""
    body = body or ForkRequest()
    rec = views.shown(m, sandbox_id)
    if rec.state != State.RUNNING:
        raise Conflict(f"sandbox {sandbox_id} is {views.state_of(rec)}; connect to it first",
                       sandbox_id=sandbox_id)
    opts = e2b.sealed(m, e2b.options(rec) or e2b.Options(template=rec.image))
    fields: Any = {**e2b.with_options(views.user_metadata(rec), opts),
                   "on_expiry": rec.on_expiry or OnExpiry.DELETE,
                   "auto_resume": bool(rec.auto_resume), "sleep_memory": rec.sleep_memory}
    snap = await m.snapshot(sandbox_id)
    results: list[ForkResult] = []
    try:
        for _ in range(body.count):
            try:
                child = await m.fork(snap.id, CreateOptions(timeout_s=body.timeout, **fields))
                results.append(ForkResult(sandbox=views.created(m, child)))
            except HangarError as exc:
                status = 404 if exc.status == 410 else exc.status
                results.append(ForkResult(error=Error(code=status, message=exc.message)))
    finally:
        try:
            m.delete_snapshot(snap.id)
        except HangarError as exc:
            log.warning("fork snapshot left behind", extra={"snapshot_id": snap.id,
                                                             "error": exc.message})
    return results


# -- metrics ----------------------------------------------------------------------------------

@router.get("/sandboxes/{sandbox_id}/metrics", response_model=list[SandboxMetric])
async def metrics(sandbox_id: str, m: Manager, start: Annotated[int | None, Query(ge=0)] = None,
                  end: Annotated[int | None, Query(ge=0)] = None) -> list[SandboxMetric]:
    """The sandbox's CPU, memory and disk now, as a list of one sample (``[]`` when it is
    paused, or ``[]`` for a range that ``end``s before the sandbox was made). Hangar keeps
    no history: ``start`` changes nothing."""
    rec = views.shown(m, sandbox_id)
    if end is not None and end < int(rec.created_at):
        return []  # a range that ended before the sandbox existed
    sample = await e2b.metrics(m, sandbox_id)
    return [views.metric(sample)] if sample is not None else []
