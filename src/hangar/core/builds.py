"""Template builds: a base, uploaded files and steps, saved as a booted template.

A build (``Builds.start``) boots a **build sandbox** from its base (an image,
or a template built here before), runs its steps in the guest
(``hangar.core.build_steps``), starts its start command, waits for its ready
command, then snapshots the sandbox under the template's name and deletes
it. The snapshot is the template: a create of the template's name restores
it, with the start command already running (``source``). Nothing of a build
runs on the host.

State, under ``<data>/builds/`` (the server's own, 0700):

==========================  ======================================================
``templates.json``          every template built here: its builds (status, times,
                            snapshot, the environment (sealed by the vault, as
                            creates' ``envVars``), user and folder its sandboxes
                            get; ``BUILDS_KEPT`` of them), its tags (``default``
                            unless asked), its layers (``LAYERS_KEPT``: a snapshot
                            of the build sandbox after a slow step, by what the
                            steps up to it were)
``files/<name>/<sha256>``   uploaded archives of the files a ``COPY`` places
                            (a team's template: ``files/<team>+<name>/``),
                            by the hash E2B's SDK computes over their paths,
                            modes and contents (``hangar.build_archive`` checks it)
==========================  ======================================================

A build's phases are events (``template.build.started``, ``.sandbox``, ``.step``,
``.ready``, ``.failed``: ``hangar events``). Its log lives in memory
(``LOG_BYTES`` of text at most, the last
``LOGS_KEPT`` builds' logs kept); a build still running when
the server stops is an error after a restart. A build whose base, steps, file
hashes and commands equal a ready build's of the same template reuses that
build's snapshot unless ``force``; otherwise it starts from its deepest layer
whose steps equal its own (up to its first step marked ``force``), and runs
only the steps after it. Uploads are ``hangar.core.build_uploads``'. One build of a template runs at a time
(``Conflict``). Errors: InvalidRequest (a bad name, tag or hash), NotFound (no
such template, build, tag or upload), Conflict (a build of the template runs,
or it is already started), TooLarge (an upload over ``UPLOAD_MAX``), Forbidden
(a team changing the operator's template).

Teams (``hangar.core.teams``): a template built with a team's key is the team's,
kept under ``TEAM/name`` (``scoped``), so two teams may each build ``app``. Every
method takes a name as the acting team gives it: its own template first, then
the operator's, which every team sees and starts sandboxes from (shared, as
E2B's public templates) but may not rebuild, tag, delete, read the builds' logs
of nor upload to (``Forbidden``); another team's is missing (``NotFound``,
worded as for a missing one). A team's build runs with its team acting: its
build sandbox and snapshots are the team's (counted against its quotas), and
its events carry the team.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hangar.core.build_steps import Copy, State, Step, StepFailed, Steps, remove_quietly
from hangar.core.build_registry import DEFAULT_TAG, Registry, bare
from hangar.core.tasks import Tasks
from hangar.core.acting import acting, acting_for
from hangar.core.teams import owner_of, scoped, unscoped
from hangar.errors import Conflict, HangarError, ImageError, LimitExceeded, NotFound

if TYPE_CHECKING:
    from hangar.core.sandboxes import SandboxManager

log = logging.getLogger(__name__)

LOG_BYTES = 4 << 20
"""Characters of log kept per build; later lines are dropped (the build goes on), and one
line says so."""
LINE_COST = 160
"""Bytes a log line costs beyond its text (a LogLine, its float and strings: measured with
``sys.getsizeof`` on CPython 3.11), counted against ``LOG_BYTES``."""
LOGS_KEPT = 32
"""Builds whose logs are kept in memory (the newest); older builds answer no lines."""
READY_TIMEOUT_S = 600.0
"""Longest a build waits for its ready command to pass, seconds."""
ENV_LABEL = "template-build-env:v1"
"""The vault's label of a build's sealed ENV."""
BUILDS_KEPT = 50
"""Records kept per template: past it the oldest builds that no tag names and that do not
run are forgotten (one never started too: its start is then a 404)."""

Launch = Callable[[Callable[[str], None], "str | None"], Awaitable[str]]
"""Boots a build's sandbox from its base, or from the snapshot named (a layer of an
earlier build), saying its progress (a pull) to the callable given; returns its id (the
caller picks the base, its user and sizes)."""
LAYER_MIN_S = 5.0
"""A step that ran at least this long, seconds, is kept as a layer: the build sandbox is
snapshotted after it, and a later build whose base and steps up to it are the same
starts from that snapshot instead of running them again (Docker's layer cache, for the
steps worth it: a snapshot costs about a second and the guest's memory on disk)."""
LAYERS_KEPT = 8
"""Layers kept per template (the newest; an older one's snapshot is removed)."""


@dataclass(frozen=True)
class BuildSpec:
    """What a build runs: its ``steps`` from ``state`` (the base's user, folder and
    environment), then ``start`` in the background until ``ready`` exits 0. ``base``
    names the base (for the cache: a different base is a different build)."""

    base: str
    steps: tuple[Step, ...]
    state: State
    start: str | None = None
    ready: str | None = None
    force: bool = False
    """Reuse nothing: neither a ready build nor a layer."""
    fresh_from: int | None = None
    """The first step no layer may stand for (E2B's ``skip_cache`` on a step: it and
    every later one run)."""

    def digest(self) -> str:
        body = {"base": self.base, "steps": [repr(s) for s in self.steps],
                "state": repr(self.state), "start": self.start, "ready": self.ready}
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()

    def layer_key(self, count: int) -> str:
        """What the sandbox holds after the first ``count`` steps: their base, starting
        state and steps (a ``Copy`` by its files' hash)."""
        body = {"base": self.base, "state": repr(self.state),
                "steps": [repr(s) for s in self.steps[:count]]}
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class LogLine:
    """One line of a build's log: ``at`` Unix seconds, ``level`` (info, warn, error)."""

    at: float
    level: str
    message: str


@dataclass(frozen=True)
class BuildView:
    """A build: ``status`` waiting (made, not started), building, ready or error;
    ``logs`` from the offset asked; ``reason`` and ``step`` (E2B's: a step's 1-based
    number, ``base`` or ``finalize``) when it failed."""

    template: str
    build_id: str
    status: str
    created_at: float
    finished_at: float | None
    vcpus: int | None
    memory_mib: int | None
    tags: tuple[str, ...]
    logs: tuple[LogLine, ...] = ()
    reason: str | None = None
    step: str | None = None


@dataclass(frozen=True)
class BuiltSource:
    """What a create of a built template starts from: its snapshot, and the environment,
    user and folder its steps left."""

    snapshot_id: str
    env: dict[str, str]
    user: str
    workdir: str
    shared: bool = False
    """The operator's template, started by a team: its snapshot is the operator's
    (``SandboxManager.provision``'s ``shared``)."""


@dataclass
class _Running:
    logs: list[LogLine] = field(default_factory=list)
    size: int = 0


class Builds(Registry):
    """Every template built on this server (one per ``SandboxManager``)."""

    def __init__(self, manager: SandboxManager) -> None:
        self.m = manager
        self.root = manager.layout.root / "builds"
        self._file = self.root / "templates.json"
        self._lock = asyncio.Lock()
        self._tasks = Tasks("builds")
        self._logs: dict[str, _Running] = {}
        self._data: dict[str, Any] | None = None

    # -- builds ------------------------------------------------------------------------

    def new(self, name: str, tags: list[str], vcpus: int | None,
            memory_mib: int | None) -> BuildView:
        """A new build of ``name`` (the template made on its first build), waiting for
        ``start``. Raises InvalidRequest (a bad name or tag), Forbidden (a team's build
        of the operator's template), LimitExceeded."""
        self.check_name(name)
        name = self._named(name, change=True) if self.exists(name) else scoped(name)
        tags = list(dict.fromkeys(tags or [DEFAULT_TAG]))
        data = self._load()
        self.check_tags(tags, data["templates"].get(name, {}).get("tags", {}))
        now = time.time()
        cap = self.m.settings.build_templates_max
        if name not in data["templates"] and len(data["templates"]) >= cap:
            raise LimitExceeded(f"this server holds {cap} templates built through E2B's API "
                                "(HANGAR_BUILD_TEMPLATES_MAX); remove one first", limit=cap)
        t = data["templates"].setdefault(name, {"created_at": now, "tags": {}, "builds": {}})
        named = set(t["tags"].values())
        for old in sorted(t["builds"], key=lambda k: t["builds"][k]["created_at"]):
            if len(t["builds"]) < BUILDS_KEPT:
                break
            if old not in named and t["builds"][old]["status"] != "building":
                del t["builds"][old]
        build_id = str(uuid.uuid4())
        t["builds"][build_id] = {"status": "waiting", "created_at": now, "finished_at": None,
                                 "vcpus": vcpus, "memory_mib": memory_mib, "tags": tags}
        self._save()
        return self._view(name, build_id)

    def status(self, name: str, build_id: str, offset: int = 0, limit: int = 100) -> BuildView:
        """Build ``build_id`` of ``name``, with its log lines from ``offset`` (at most
        ``limit``). Raises NotFound, Forbidden (the operator's, to a team)."""
        return self._view(self._named(name, change=True), build_id, offset, limit)

    def _view(self, name: str, build_id: str, offset: int = 0, limit: int = 100) -> BuildView:
        b = self._build(name, build_id)
        run = self._logs.get(build_id)
        lines = tuple(run.logs[max(0, offset):max(0, offset) + limit]) if run else ()
        tags = tuple(k for k, v in self._template(name)["tags"].items() if v == build_id)
        return BuildView(template=unscoped(name), build_id=build_id, status=b["status"],
                         created_at=b["created_at"], finished_at=b.get("finished_at"),
                         vcpus=b.get("vcpus"), memory_mib=b.get("memory_mib"),
                         tags=tags or tuple(b.get("tags") or ()), logs=lines,
                         reason=b.get("reason"), step=b.get("step"))

    def builds(self, name: str) -> list[BuildView]:
        """Every build of ``name``, oldest first (no logs). Raises NotFound."""
        name = self._named(name)
        t = self._template(name)
        order = sorted(t["builds"], key=lambda k: t["builds"][k]["created_at"])
        return [self._view(name, b, limit=0) for b in order]

    def start(self, name: str, build_id: str, spec: BuildSpec, launch: Launch) -> None:
        """Run build ``build_id`` of ``name`` in the background. Raises NotFound,
        InvalidRequest (a ``Copy``'s files hash is not a SHA-256 in hex), Conflict (it was
        started already, or another build of ``name`` runs), Forbidden (the operator's, to
        a team)."""
        name = self._named(name, change=True)
        b = self._build(name, build_id)
        for step in spec.steps:
            if isinstance(step, Copy):
                self._check_hash(step.files)
        if b["status"] != "waiting":
            raise Conflict(f"build {build_id} of template {unscoped(name)!r} was started already",
                           template=unscoped(name), build=build_id)
        if self._tasks.running(name) or any(
                o["status"] == "building" for o in self._template(name)["builds"].values()):
            raise Conflict(f"a build of template {unscoped(name)!r} is running; wait for it",
                           template=unscoped(name))
        b["status"] = "building"
        self._save()
        self._logs[build_id] = _Running()
        while len(self._logs) > LOGS_KEPT:  # dicts keep their order: the oldest first
            del self._logs[next(iter(self._logs))]
        self._tasks.start(name, self._as_owner(name, self._run(name, build_id, spec, launch)))

    @staticmethod
    async def _as_owner(name: str, work: Awaitable[None]) -> None:
        """Run a build's ``work`` with the team of template ``name`` acting (a task runs
        with none): its build sandbox and snapshots are the team's."""
        with acting_for(owner_of(name)):
            await work

    def _say(self, build_id: str) -> Callable[[str, str], None]:
        run = self._logs[build_id]

        def say(level: str, message: str) -> None:
            if run.size > LOG_BYTES:
                return
            run.size += len(message) + LINE_COST
            if run.size > LOG_BYTES:
                level, message = "warn", f"the log is over {LOG_BYTES} characters: later lines " \
                    "are not kept"
            run.logs.append(LogLine(time.time(), level, message))
        return say

    def _event(self, phase: str, name: str, build_id: str, **data: Any) -> None:
        """``template.build.<phase>`` on the live event stream (``hangar events``)."""
        self.m.events.publish(f"template.build.{phase}", data.pop("sandbox_id", None),
                              team=owner_of(name), template=bare(name),
                              build_id=build_id, **data)

    async def _run(self, name: str, build_id: str, spec: BuildSpec, launch: Launch) -> None:
        say = self._say(build_id)
        self._event("started", name, build_id, base=spec.base, steps=len(spec.steps))
        b = self._build(name, build_id)
        digest = spec.digest()
        sid: str | None = None
        failed: tuple[str, str] | None = None  # (message, E2B's step)
        try:
            cached = None if spec.force or spec.fresh_from is not None else \
                self._cached(name, digest)
            if cached is not None:
                say("info", f"CACHED: build {cached['id']} has the same base, steps and "
                    "files; its snapshot is reused")
                b.update(snapshot_id=cached["snapshot_id"], env_sealed=cached["env_sealed"],
                         user=cached["user"], workdir=cached["workdir"])
            else:
                for i, step in enumerate(spec.steps):
                    if isinstance(step, Copy):
                        await self._check_upload(name, step, i)
                first, state, layer = 0, spec.state, self._layer(name, spec)
                if layer is not None:
                    first, rec = layer
                    state = State(user=rec["user"], workdir=rec["workdir"],
                                  env=self._open(rec.get("env_sealed")))
                    say("info", f"CACHED: steps 1-{first} are a layer of an earlier build; "
                        "the build sandbox starts from it")
                else:
                    say("info", f"[builder] FROM {spec.base}: starting the build sandbox")
                try:
                    sid = await launch(lambda line: say("info", line),
                                       layer[1]["snapshot_id"] if layer else None)
                except ImageError as e:  # its base image could not be had (a pull)
                    raise StepFailed(f"FROM {spec.base}: {e}", -2) from None
                except HangarError as e:
                    raise StepFailed(f"the build sandbox did not start: {e}", -2) from None
                self._event("sandbox", name, build_id, sandbox_id=sid)
                # a step's event names its number and instruction only: never its text
                # (an ENV's values, a RUN's command) nor a guest's output
                steps = Steps(self.m, sid, say, lambda h: self._archive(name, h),
                              lambda i, s: self._event("step", name, build_id, step=str(i + 1),
                                                       of=len(spec.steps),
                                                       instruction=type(s).__name__.upper()))
                state = await steps.run(spec.steps, state, first,
                                        self._keeper(name, spec, sid, say))
                await steps.start(spec.start, spec.ready, state, READY_TIMEOUT_S)
                say("info", "[builder] saving the template's snapshot")
                snap = await self.m.snapshot(sid, name=bare(name))
                # a template's ENV may hold keys: sealed by the vault, as creates' envVars
                b.update(snapshot_id=snap.id, env_sealed=self._seal(state.env),
                         user=state.user, workdir=state.workdir)
        except StepFailed as e:
            where = "finalize" if e.step == -1 else "base" if e.step == -2 else str(e.step + 1)
            failed = (e.message, where)
        except HangarError as e:
            failed = (e.message, "finalize")
        except Exception as e:  # a bug: the build fails, the server goes on
            log.exception("template build failed", extra={"template": name})
            failed = (f"internal error: {type(e).__name__}", "finalize")
        finally:
            # the build sandbox is gone before the build says it ended: a client that sees
            # the end finds no sandbox of it, and may start the next build at once
            if sid is not None:
                await remove_quietly(lambda: self.m.delete(sid))
        if failed is not None:
            self._fail(name, build_id, failed[0], failed[1], say)
            # the reason names commands and a guest's output: the build's status says it,
            # events never do (as exec's events carry no command text)
            self._event("failed", name, build_id, step=failed[1])
            return
        async with self._lock:
            b.update(status="ready", finished_at=time.time(), digest=digest)
            self._retag(name, build_id, list(b.get("tags") or [DEFAULT_TAG]))
            self._save()
        say("info", f"build {build_id} of template {bare(name)!r} is ready")
        self._event("ready", name, build_id, snapshot_id=b["snapshot_id"])

    def _fail(self, name: str, build_id: str, message: str, step: str,
              say: Callable[[str, str], None]) -> None:
        say("error", message)
        self._build(name, build_id).update(status="error", reason=message, step=step,
                                           finished_at=time.time())
        self._save()

    def _cached(self, name: str, digest: str) -> dict[str, Any] | None:
        for k, b in self._template(name)["builds"].items():
            if b["status"] == "ready" and b.get("digest") == digest and \
                    b.get("snapshot_id") and self.m.has_snapshot(b["snapshot_id"]):
                return {**b, "id": k}
        return None

    def _layer(self, name: str, spec: BuildSpec) -> tuple[int, dict[str, Any]] | None:
        """The deepest layer of ``name`` this build may start from: (steps it stands
        for, its record), or None."""
        if spec.force:
            return None
        layers = self._template(name).get("layers") or {}
        upto = len(spec.steps) if spec.fresh_from is None else spec.fresh_from
        for count in range(upto, 0, -1):
            rec = layers.get(spec.layer_key(count))
            if rec is not None and self.m.has_snapshot(rec["snapshot_id"]):
                return count, rec
        return None

    def _keeper(self, name: str, spec: BuildSpec, sid: str, say: Callable[[str, str], None]
                ) -> Callable[[int, State, float], Awaitable[None]]:
        """What runs after each step: a step that took ``LAYER_MIN_S`` or more is kept
        as a layer (``LAYERS_KEPT`` per template)."""
        async def keep(index: int, state: State, seconds: float) -> None:
            if seconds < LAYER_MIN_S:
                return
            snap = await self.m.snapshot(sid)
            say("info", f"[builder] step {index + 1} took {seconds:.1f} s: kept as a layer")
            async with self._lock:
                layers = self._template(name).setdefault("layers", {})
                old = layers.pop(spec.layer_key(index + 1), None)  # a forced step's again
                if old is not None:
                    self._drop_snapshot(old["snapshot_id"])
                layers[spec.layer_key(index + 1)] = {
                    "snapshot_id": snap.id, "at": time.time(), "user": state.user,
                    "workdir": state.workdir, "env_sealed": self._seal(state.env)}
                for key in sorted(layers, key=lambda k: layers[k]["at"])[:-LAYERS_KEPT]:
                    self._drop_snapshot(layers.pop(key)["snapshot_id"])
                self._save()
        return keep

    def _drop_snapshot(self, snapshot_id: str) -> None:
        try:
            self.m.delete_snapshot(snapshot_id)
        except HangarError:
            pass

    def _retag(self, name: str, build_id: str, tags: list[str]) -> None:
        """Point ``tags`` of ``name`` at ``build_id``; drop the snapshots of ready builds
        no tag names any more (their records stay, as history)."""
        t = self._template(name)
        for tag in tags:
            t["tags"][tag] = build_id
        live = set(t["tags"].values())
        keep = {t["builds"][b].get("snapshot_id") for b in live}
        for k, b in t["builds"].items():
            sid = b.get("snapshot_id")
            if k not in live and sid and sid not in keep:
                b["snapshot_id"] = None
                self._drop_snapshot(sid)

    # -- templates and tags ------------------------------------------------------------

    def source(self, ref: str) -> BuiltSource | None:
        """The built template ``ref`` (``name`` or ``name:tag``; no tag: ``default``)
        starts from, or None when ``ref`` names no template built here that the acting
        team sees. Raises NotFound for a template built here whose tag has no ready
        build."""
        name, _, tag = ref.partition(":")
        if not self.exists(name):
            return None
        name = self._named(name)
        t = self._template(name)
        build_id = t["tags"].get(tag or DEFAULT_TAG)
        b = t["builds"].get(build_id) if build_id else None
        if b is None or not b.get("snapshot_id"):
            raise NotFound(f"template {ref!r} has no ready build", template=ref)
        return BuiltSource(b["snapshot_id"], self._open(b.get("env_sealed")),
                           b.get("user") or "root", b.get("workdir") or "/",
                           shared=owner_of(name) != acting())

    def _seal(self, env: dict[str, str]) -> str:
        return self.m.vault.seal(ENV_LABEL, json.dumps(env, sort_keys=True).encode())

    def _open(self, sealed: str | None) -> dict[str, str]:
        """A build's ENV; raises ConfigError when the vault cannot open it."""
        if not sealed:
            return {}
        data = json.loads(self.m.vault.open(ENV_LABEL, sealed))
        return {str(k): str(v) for k, v in data.items()}

    def tags(self, name: str) -> list[tuple[str, str, float]]:
        """(tag, build id, when the build was made) of ``name``. Raises NotFound."""
        t = self._template(self._named(name))
        return [(tag, b, t["builds"][b]["created_at"]) for tag, b in sorted(t["tags"].items())]

    async def assign_tags(self, target: str, tags: list[str]) -> tuple[str, list[str]]:
        """Point ``tags`` at the build ``target`` (``name:tag``) names; (its build id,
        the tags). Raises NotFound, InvalidRequest, Forbidden (the operator's, to a team)."""
        name, _, tag = target.partition(":")
        name = self._named(name, change=True)
        async with self._lock:
            t = self._template(name)
            build_id = t["tags"].get(tag or DEFAULT_TAG)
            if build_id is None:
                raise NotFound(f"template {target!r} has no such tag", template=target)
            self.check_tags(tags, t["tags"])
            self._retag(name, build_id, tags)
            self._save()
        return build_id, tags

    async def remove_tags(self, name: str, tags: list[str]) -> None:
        """Remove ``tags`` from ``name`` (a build no tag names loses its snapshot).
        Raises NotFound (no such template or tag), Forbidden (the operator's, to a team)."""
        name = self._named(name, change=True)
        async with self._lock:
            t = self._template(name)
            for tag in tags:
                if tag not in t["tags"]:
                    raise NotFound(f"template {unscoped(name)!r} has no tag {tag!r}",
                                   template=unscoped(name))
            for tag in tags:
                del t["tags"][tag]
            self._retag(name, "", [])
            self._save()

    async def discard(self, name: str, build_id: str) -> None:
        """Forget build ``build_id`` of ``name`` if it never started, and the template when
        it has no other build (nothing was made for either). Raises NotFound, Forbidden."""
        name = self._named(name, change=True)
        async with self._lock:
            t = self._template(name)
            if t["builds"].get(build_id, {}).get("status") != "waiting":
                return
            del t["builds"][build_id]
            if t["builds"]:
                self._save()
                return
        await self._delete(name)

    async def delete(self, name: str) -> None:
        """Remove template ``name``: its snapshots, uploads and records. Raises NotFound,
        Conflict (a build of it runs, or a create restores one of its snapshots now: try
        again), Forbidden (the operator's, to a team)."""
        await self._delete(self._named(name, change=True))

    async def _delete(self, name: str) -> None:
        async with self._lock:
            t = self._template(name)
            if self._tasks.running(name):
                raise Conflict(f"a build of template {unscoped(name)!r} is running",
                               template=unscoped(name))
            for layer in (t.get("layers") or {}).values():
                self._drop_snapshot(layer["snapshot_id"])
            for b in t["builds"].values():
                if b.get("snapshot_id"):
                    try:
                        self.m.delete_snapshot(b["snapshot_id"])
                    except NotFound:
                        pass
                    except Conflict:  # a create restores it now: the template stays
                        self._save()
                        raise
                    b["snapshot_id"] = None
            del self._load()["templates"][name]
            self._save()
        folder = self._folder(name)
        if folder.is_dir():
            for p in folder.iterdir():
                p.unlink(missing_ok=True)
            folder.rmdir()

    async def close(self) -> None:
        """Stop the builds that run (each is then an error, its sandbox deleted)."""
        await self._tasks.stop()

