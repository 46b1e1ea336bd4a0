"""What the core keeps for E2B's protocol: a sandbox's E2B settings, its envd token, templates.

Hangar serves E2B's control plane (``hangar.api.e2b``, under ``/e2b``) and
its sandbox agent's protocol, envd (``hangar.api.envd``, under
``/e2b/envd``). Both are HTTP layers; what they share lives here, once:

``ENVD_VERSION``
    the envd version every sandbox reports (the SDK gates features on it).
``access_token`` / ``check_access_token``
    a sandbox's envd access token (E2B's ``envdAccessToken``), derived,
    never stored: HMAC-SHA256 under the server's port key (``<data>/port-key``,
    ``hangar.core.ports``) of ``e2b-envd-access:v1:<sandbox id>``, 64 hex
    digits. Every sandbox has one (E2B's SDK creates only secured sandboxes);
    it stays the same for the sandbox's life unless the port key is replaced.
``Options`` / ``options`` / ``envs``
    what a create through ``/e2b`` asked for beyond Hangar's own fields
    (the template name it used, default environment variables, whether its
    URLs are public). Kept in the record's own ``e2b`` column, never in the
    client's metadata: it lives and dies with the record, and no request
    writes it but the create that made it. What a timeout does (``autoPause``)
    and the clock across a pause are no E2B matter: the record's generic
    ``on_expiry``, ``ttl_s`` and ``wake_ttl_s``, moved by core's verbs
    (``hangar.core.sleep``: pause, connect, settled).
``url_exposure``
    E2B's sandbox URLs (``{port}-{id}.<HANGAR_DOMAIN>``) open every guest port of
    a sandbox made through ``/e2b``, public unless its create said otherwise.
``resolve`` / ``templates``
    E2B template names onto Hangar's images, templates and snapshots
    (``base`` is Hangar's base image; the code interpreter's
    ``code-interpreter-v1`` is Hangar's ``code-interpreter`` image).
``metrics``
    one sample of a running guest's CPU, memory and disk, read inside it.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hangar.core.admission import default_size
from hangar.core.commands import Command
from hangar.core.lifecycle import State
from hangar.core.ports import Exposure
from hangar.core.store import SandboxRecord, SnapshotRecord
from hangar.errors import GuestError, HangarError, InvalidRequest, NotFound, Unauthorized
from hangar.images import list_images, resolve_image

if TYPE_CHECKING:
    from hangar.core.sandboxes import SandboxManager

__all__ = ["ENVD_VERSION", "KEY", "Metric", "Options", "Source", "TemplateInfo",
           "access_token", "check_access_token", "envs", "metrics", "options", "resolve",
           "sandbox", "templates", "url_exposure", "with_options"]

ENVD_VERSION = "0.5.7"
"""The envd version every sandbox reports. >= 0.3.0: the SDK sends ``stdin``; >= 0.4.0 it
stops forcing user ``user``; >= 0.5.2 ``close_stdin``; >= 0.5.7 octet-stream uploads. Below
0.6.2 the SDK itself refuses file metadata (xattrs) and below 0.6.3 watch entry info, which
Hangar does not serve."""

KEY = "e2b"
"""The metadata key where older servers kept a sandbox's E2B ``Options``; now the record's
``e2b`` column (kept for imports; it is an ordinary key of the client's metadata)."""

TEMPLATE_ALIASES = {"code-interpreter-v1": "code-interpreter"}
"""E2B template names that are another name in Hangar."""

_TOKEN_LABEL = b"e2b-envd-access:v1:"


# -- the envd access token -------------------------------------------------------------

def access_token(manager: SandboxManager, sandbox_id: str) -> str:
    """The envd access token of ``sandbox_id`` (64 hex digits); see the module docstring."""
    key = manager.ports.key.key()
    return hmac.new(key, _TOKEN_LABEL + sandbox_id.encode(), hashlib.sha256).hexdigest()


def check_access_token(manager: SandboxManager, sandbox_id: str, given: str | None) -> bool:
    """True when ``given`` is ``sandbox_id``'s access token (compared in constant time)."""
    if not given:
        return False
    return hmac.compare_digest(given.encode(), access_token(manager, sandbox_id).encode())


# -- a sandbox's E2B settings ------------------------------------------------------------

@dataclass(frozen=True)
class Options:
    """What a create through ``/e2b`` asked for beyond Hangar's own fields.

    ``template``: the template name the client used (E2B's ``alias``);
    ``envs``: environment variables of every process envd starts in it;
    ``public_traffic``: its
    sandbox URLs (``{port}-{id}.<HANGAR_DOMAIN>``) need no credential, as E2B's
    do unless ``network.allowPublicTraffic`` is false (``url_exposure``).
    """

    template: str
    envs: dict[str, str] = field(default_factory=dict)
    public_traffic: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {"template": self.template, "envs": dict(self.envs),
                "public_traffic": self.public_traffic}


def options(rec: SandboxRecord) -> Options | None:
    """The E2B options of ``rec``, or None for a sandbox made through Hangar's own API."""
    raw = rec.e2b
    if not isinstance(raw, dict):
        return None
    env = raw.get("envs")
    return Options(
        template=str(raw.get("template") or rec.image),
        envs={str(k): str(v) for k, v in env.items()} if isinstance(env, dict) else {},
        public_traffic=raw.get("public_traffic") is True,
    )


def with_options(metadata: dict[str, str], opts: Options) -> dict[str, Any]:
    """The fields of a create's ``CreateOptions`` that carry the client's ``metadata``
    (opaque) and ``opts`` (the record's ``e2b`` column)."""
    return {"metadata": dict(metadata), "e2b": opts.as_dict()}


def sandbox(manager: SandboxManager, sandbox_id: str) -> SandboxRecord:
    """The record of a sandbox; raises NotFound (unknown, deleted) or Gone (expired)."""
    return manager.get(sandbox_id)


def envs(manager: SandboxManager, sandbox_id: str) -> dict[str, str]:
    """The default environment variables of ``sandbox_id``'s processes (create's
    ``envVars``; ``{}`` for a sandbox made by Hangar's own API). Raises as ``sandbox``."""
    opts = options(sandbox(manager, sandbox_id))
    return dict(opts.envs) if opts is not None else {}


def url_exposure(manager: SandboxManager, sandbox_id: str, port: int,
                 traffic_token: str | None) -> Exposure | None:
    """How E2B's sandbox URLs reach a port nobody exposed: ``{port}-{id}.<HANGAR_DOMAIN>``,
    what ``sandbox.get_host(port)`` names, opens every guest port of a sandbox made
    through ``/e2b``, as E2B's own do. Its create's ``network.allowPublicTraffic``
    (default true) says whether that needs no credential or the
    ``E2B-Traffic-Access-Token`` header (its ``trafficAccessToken``).

    Returns a public ``Exposure`` for the request when it may pass; None for a sandbox
    made through Hangar's own API (its ports are exposed with ``POST
    /sandboxes/{id}/ports``). Raises Unauthorized (a private sandbox's token is missing
    or wrong), NotFound or Gone (no such sandbox).
    """
    opts = options(sandbox(manager, sandbox_id))
    if opts is None:
        return None
    if not opts.public_traffic and not check_access_token(manager, sandbox_id, traffic_token):
        raise Unauthorized(f"sandbox {sandbox_id} was created with "
                           "network.allowPublicTraffic false: its URLs need its "
                           "trafficAccessToken in the E2B-Traffic-Access-Token header",
                           sandbox_id=sandbox_id, port=port)
    return Exposure(sandbox_id, port, True, "", time.time())


# -- templates -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Source:
    """Where a create of an E2B template name starts from: ``image`` (a Hangar image or
    template, by name) or ``snapshot`` (a Hangar snapshot, by id)."""

    kind: str
    name: str
    asked: str
    """The name the client gave."""


def _untagged(name: str) -> str:
    """``name`` without an E2B tag (``:default``...): Hangar's builds have no tags."""
    return name.rsplit(":", 1)[0] if ":" in name else name


def resolve(manager: SandboxManager, template_id: str) -> Source:
    """The Hangar image or snapshot an E2B template name or snapshot id stands for.

    Raises InvalidRequest (an empty or malformed name), NotFound naming the template
    (nothing of that name is built here, e.g. ``code-interpreter-v1`` before Hangar's
    ``code-interpreter`` image is built)."""
    asked = template_id.strip()
    if not asked or "/" in asked or asked.startswith("."):
        raise InvalidRequest(f"bad template name {template_id!r}", template=template_id)
    name = _untagged(asked)
    try:
        snap: SnapshotRecord = manager.get_snapshot(name)
        return Source("snapshot", snap.id, asked)
    except NotFound:
        pass
    local = TEMPLATE_ALIASES.get(name, name)
    try:
        resolve_image(manager.layout, local)
    except NotFound:
        also = f" (Hangar's image {local!r})" if local != name else ""
        raise NotFound(f"template {asked!r}{also} is not built on this server: build it "
                       f"with `hangar image build {local}` (a recipe) or `hangar template "
                       "build FILE` (a template), or use 'base'", template=asked) from None
    return Source("image", local, asked)


@dataclass(frozen=True)
class TemplateInfo:
    """A built Hangar image or template, as E2B lists templates. Times are Unix seconds."""

    name: str
    build_id: str
    vcpus: int
    memory_mib: int
    disk_mib: int
    created_at: float
    updated_at: float
    builds: int
    aliases: tuple[str, ...]
    """E2B names that stand for it (``code-interpreter-v1`` for ``code-interpreter``)."""


def templates(manager: SandboxManager) -> list[TemplateInfo]:
    """Every image and template with a current build, by name. Raises ImageError."""
    infos = list_images(manager.layout)
    out: list[TemplateInfo] = []
    for info in infos:
        if not info.current:
            continue
        try:
            image = resolve_image(manager.layout, info.name)
        except HangarError:
            continue
        vcpus, memory = default_size(image, manager.settings)
        builds = [i for i in infos if i.name == info.name]
        out.append(TemplateInfo(
            name=info.name, build_id=info.id, vcpus=vcpus, memory_mib=memory,
            disk_mib=manager.settings.default_disk_mib,
            created_at=min(i.built_at for i in builds), updated_at=info.built_at,
            builds=len(builds),
            aliases=tuple(k for k, v in TEMPLATE_ALIASES.items() if v == info.name)))
    return sorted(out, key=lambda t: t.name)


# -- metrics -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Metric:
    """One sample of a guest: ``cpu_pct`` over the last 0.2 s across its ``cpus``
    (0-100); memory and disk in bytes, as its kernel counts them (``mem_used``: total
    less available; ``mem_cache``: the page cache); ``at``: Unix seconds."""

    at: float
    cpus: int
    cpu_pct: float
    mem_used: int
    mem_total: int
    mem_cache: int
    disk_used: int
    disk_total: int


_SAMPLE = ("head -n1 /proc/stat; sleep 0.2; head -n1 /proc/stat; grep -c '^cpu[0-9]' /proc/stat;"
           " grep -E '^(MemTotal|MemAvailable|Cached):' /proc/meminfo; df -Pk / | tail -n1")


def _cpu(line: str) -> tuple[int, int]:
    """(busy, total) jiffies of a ``/proc/stat`` ``cpu`` line."""
    values = [int(v) for v in line.split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    return sum(values) - idle, sum(values)


def parse_sample(text: str, at: float) -> Metric:
    """A ``Metric`` from the output of ``_SAMPLE``. Raises ValueError when it is malformed."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if len(lines) < 7:
        raise ValueError("short sample")
    (b0, t0), (b1, t1) = _cpu(lines[0]), _cpu(lines[1])
    cpus = int(lines[2])
    mem = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in lines[3:6]}
    disk = lines[6].split()
    pct = 100.0 * (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0
    return Metric(at=at, cpus=cpus, cpu_pct=round(max(0.0, min(100.0, pct)), 2),
                  mem_used=mem["MemTotal"] - mem["MemAvailable"], mem_total=mem["MemTotal"],
                  mem_cache=mem["Cached"], disk_used=int(disk[2]) * 1024,
                  disk_total=int(disk[1]) * 1024)


SAMPLE_TIMEOUT_S = 30.0
"""Longest a sample may take (it sleeps 0.2 s; an emulated guest on a busy host is slow)."""


async def metrics(manager: SandboxManager, sandbox_id: str) -> Metric | None:
    """One sample of ``sandbox_id``'s guest, read inside it (a short command: about 0.3 s),
    or None when it is not running (a paused sandbox is not woken to be measured).
    Raises NotFound, Gone, GuestError (no sample within ``SAMPLE_TIMEOUT_S``, or the
    guest's figures could not be read), and the guest call's errors."""
    rec = sandbox(manager, sandbox_id)
    if rec.state != State.RUNNING:
        return None
    result = await manager.exec(sandbox_id, Command(_SAMPLE, timeout_s=SAMPLE_TIMEOUT_S))
    if result.timed_out:
        raise GuestError(f"sandbox {sandbox_id} gave no metrics within "
                         f"{SAMPLE_TIMEOUT_S:.0f} s", sandbox_id=sandbox_id)
    text = result.stdout.head.decode("utf-8", "replace")
    try:
        if result.exit_code != 0:
            raise ValueError(result.stderr.head.decode("utf-8", "replace")[:200])
        return parse_sample(text, time.time())
    except (ValueError, KeyError, IndexError) as exc:
        raise GuestError(f"the metrics of sandbox {sandbox_id} could not be read in its "
                         f"guest: {exc}", sandbox_id=sandbox_id) from None
