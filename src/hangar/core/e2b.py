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
    It opens everything of its sandbox: envd, the code interpreter, every port.
``traffic_token`` / ``check_traffic_token`` / ``traffic_admits``
    a sandbox's traffic access token (E2B's ``trafficAccessToken``): derived the
    same way from ``e2b-traffic-access:v1:<sandbox id>``, so a different value.
    It opens the sandbox's user ports only, never envd (``ENVD_PORT``) nor the
    code interpreter's server (``INTERPRETER_PORT``), save the one narrow case
    ``traffic_admits`` names (the code interpreter's SDK sends only this token
    when it manages contexts; it never runs code with it).
``Options`` / ``options`` / ``envs`` / ``sealed``
    what a create through ``/e2b`` asked for beyond Hangar's own fields
    (the template name it used, default environment variables, whether its
    URLs are public, the ``Host`` they pass to the guest: ``request_host``). The environment variables (``envVars``: they often hold
    keys) are sealed by the vault (``hangar.core.secrets.Vault.seal``, label
    ``ENVS_LABEL``) before the record is written, so the database holds
    ciphertext only; ``envs`` opens them when a process starts. Kept in the record's own ``e2b`` column, never in the
    client's metadata: it lives and dies with the record, and no request
    writes it but the create that made it. What a timeout does (``autoPause``)
    and the clock across a pause are no E2B matter: the record's generic
    ``on_expiry``, ``ttl_s`` and ``wake_ttl_s``, moved by core's verbs
    (``hangar.core.sleep``: pause, connect, settled).
``DEFAULT_USER`` / ``add_user`` / ``user_for`` / ``as_user`` / ``home``
    E2B's default user: a sandbox made through ``/e2b`` runs envd's commands,
    PTYs and file operations as ``user`` (home ``/home/user``, passwordless
    ``sudo``) unless a call names ``root``. Made in the guest as root through the
    guest's exec (no image change), in every template snapshot before it is saved, else
    at create; the guest agent starts its commands as it (``Command.user``: no program
    in between).
``url_exposure``
    E2B's sandbox URLs (``{port}-{id}.<HANGAR_DOMAIN>``) open every user port of
    a sandbox made through ``/e2b``, public unless its create said otherwise;
    envd's and the code interpreter's ports (``CONTROL_PORTS``) are never public
    and need the envd access token.
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
import json
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from hangar.core import interpreter
from hangar.core.admission import default_size
from hangar.core.commands import Command
from hangar.core.lifecycle import State
from hangar.core.ports import Exposure
from hangar.core.store import SandboxRecord
from hangar.core.views import SandboxView
from hangar.errors import (
    Forbidden, GuestError, HangarError, InvalidRequest, NotFound, Unauthorized,
)
from hangar.images import list_images, resolve_image

if TYPE_CHECKING:
    from hangar.core.sandboxes import SandboxManager

__all__ = ["CONTROL_PORTS", "DEFAULT_USER", "ENVD_PORT", "ENVD_VERSION", "INTERPRETER_PORT",
           "KEY", "ROOT", "Metric", "Options", "Source", "TemplateInfo", "access_token",
           "check_access_token", "check_traffic_token", "envs", "metrics", "options",
           "request_host", "resolve", "sandbox", "sealed", "templates", "traffic_admits", "traffic_token",
           "url_exposure", "with_options"]

ENVD_VERSION = "0.6.4"
"""The envd version every sandbox reports. >= 0.3.0: the SDK sends ``stdin``; >= 0.4.0 it
stops forcing user ``user``; >= 0.5.2 ``close_stdin``; >= 0.5.7 octet-stream uploads;
>= 0.6.2 file metadata (``X-Metadata-*`` upload headers, kept as ``user.e2b.*`` xattrs);
>= 0.6.3 entry info in watch events; >= 0.6.4 ``allow_network_mounts`` on a watch. All are
served; nothing above 0.6.4 is promised."""

KEY = "e2b"
"""The metadata key where older servers kept a sandbox's E2B ``Options``; now the record's
``e2b`` column (kept for imports; it is an ordinary key of the client's metadata)."""
DEFAULT_USER = "user"
"""E2B's default user: envd's commands, PTYs and files of a sandbox made through ``/e2b``
(made by ``hangar.core.e2b_user.add_user``)."""
ROOT = "root"

TEMPLATE_ALIASES = {"code-interpreter-v1": "code-interpreter"}
"""E2B template names that are another name in Hangar."""

_TOKEN_LABEL = b"e2b-envd-access:v1:"
_TRAFFIC_LABEL = b"e2b-traffic-access:v1:"
ENVD_PORT = 49983
"""The guest port E2B's SDK names for envd itself (served by Hangar, ``hangar.api.envd``)."""
INTERPRETER_PORT = interpreter.PORT
"""The code interpreter's server (49999, ``hangar.core.interpreter.PORT``)."""
CONTROL_PORTS = frozenset({ENVD_PORT, INTERPRETER_PORT})
"""Ports that run code in the guest: only the envd access token (or a Hangar key) opens
them, never the traffic token, and E2B's public sandbox URLs never make them public."""
ENVS_LABEL = "e2b-envs:v1"
"""The vault's label (associated data) of a record's sealed ``envVars``."""


# -- the envd access token -------------------------------------------------------------

def _token(manager: SandboxManager, label: bytes, sandbox_id: str) -> str:
    """HMAC-SHA256 of ``label`` and ``sandbox_id`` under the port key, as 64 hex digits."""
    key = manager.ports.key.key()
    return hmac.new(key, label + sandbox_id.encode(), hashlib.sha256).hexdigest()


def _same(given: str | None, token: str) -> bool:
    """True when ``given`` is ``token`` (compared in constant time); False when empty."""
    return bool(given) and hmac.compare_digest(str(given).encode(), token.encode())


def access_token(manager: SandboxManager, sandbox_id: str) -> str:
    """The envd access token of ``sandbox_id`` (64 hex digits); see the module docstring."""
    return _token(manager, _TOKEN_LABEL, sandbox_id)


def check_access_token(manager: SandboxManager, sandbox_id: str, given: str | None) -> bool:
    """True when ``given`` is ``sandbox_id``'s access token (compared in constant time)."""
    return _same(given, access_token(manager, sandbox_id))


def traffic_token(manager: SandboxManager, sandbox_id: str) -> str:
    """The traffic access token of ``sandbox_id`` (64 hex digits, never its envd access
    token); see the module docstring."""
    return _token(manager, _TRAFFIC_LABEL, sandbox_id)


def check_traffic_token(manager: SandboxManager, sandbox_id: str, given: str | None) -> bool:
    """True when ``given`` is ``sandbox_id``'s traffic access token (constant time)."""
    return _same(given, traffic_token(manager, sandbox_id))


def traffic_admits(port: int, method: str, path: str) -> bool:
    """Whether the traffic token may open this request to ``port`` (``path``: the guest's
    path as sent, without its query): every user port; of the code interpreter's server
    only its context routes (``/contexts``, ``/contexts/<id>``, ``/contexts/<id>/restart``),
    which E2B's code interpreter SDK calls with that token alone and which run no code, and
    only spelled plainly (no ``%``: a server that decodes the path must see the same route);
    never envd, never ``/execute``."""
    if port not in CONTROL_PORTS:
        return True
    if port != INTERPRETER_PORT or method not in ("GET", "POST", "DELETE") or "%" in path:
        return False
    parts = path.split("?", 1)[0].rstrip("/").split("/")[1:]
    return parts[:1] == ["contexts"] and len(parts) <= 3 and ".." not in parts \
        and (len(parts) < 3 or parts[2] == "restart")


# -- a sandbox's E2B settings ------------------------------------------------------------

@dataclass(frozen=True)
class Options:
    """What a create through ``/e2b`` asked for beyond Hangar's own fields.

    ``template``: the template name the client used (E2B's ``alias``);
    ``envs``: environment variables of every process envd starts in it, in clear (only
    in memory: ``sealed`` turns them into ``sealed_envs`` before a record keeps them);
    ``sealed_envs``: the same, sealed by the vault (``ENVS_LABEL``), as records keep them;
    ``public_traffic``: its
    sandbox URLs (``{port}-{id}.<HANGAR_DOMAIN>``) need no credential, as E2B's
    do unless ``network.allowPublicTraffic`` is false (``url_exposure``);
    ``mask_host``: E2B's ``network.maskRequestHost``, the ``Host`` a request through those
    URLs carries to the guest (``${PORT}`` there becomes the port: ``request_host``), or
    None to pass the client's.
    """

    template: str
    envs: dict[str, str] = field(default_factory=dict)
    public_traffic: bool = False
    sealed_envs: str | None = None
    user: str = "root"
    """The user envd's calls run as when they name none: ``DEFAULT_USER`` for a create of
    this version (``add_user``), ``root`` for sandboxes made before it."""
    mask_host: str | None = None
    workdir: str | None = None
    """Where envd's commands run when they name no folder: the folder a built template's
    steps left (``hangar.core.builds``); None for the user's home."""

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"template": self.template, "public_traffic": self.public_traffic,
                               "user": self.user}
        if self.mask_host is not None:
            out["mask_host"] = self.mask_host
        if self.workdir is not None:
            out["workdir"] = self.workdir
        if self.sealed_envs is not None:
            out["envs_sealed"] = self.sealed_envs
        if self.envs:
            out["envs"] = dict(self.envs)
        return out


def sealed(manager: SandboxManager, opts: Options) -> Options:
    """``opts`` with its ``envs`` sealed by the vault (``sealed_envs``) and none in clear:
    what a record may keep. Raises ConfigError when the vault has no usable key."""
    if not opts.envs:
        return opts
    box = manager.vault.seal(ENVS_LABEL, json.dumps(opts.envs, sort_keys=True).encode())
    return replace(opts, envs={}, sealed_envs=box)


def options(rec: SandboxRecord | SandboxView) -> Options | None:
    """The E2B options of ``rec``, or None for a sandbox made through Hangar's own API.
    Its environment stays sealed (``sealed_envs``; ``envs`` holds only what a record of an
    older server kept in clear)."""
    raw = rec.e2b
    if not isinstance(raw, dict):
        return None
    env = raw.get("envs")
    box = raw.get("envs_sealed")
    mask = raw.get("mask_host")
    return Options(
        template=str(raw.get("template") or rec.image),
        envs={str(k): str(v) for k, v in env.items()} if isinstance(env, dict) else {},
        public_traffic=raw.get("public_traffic") is True,
        sealed_envs=box if isinstance(box, str) else None,
        user=DEFAULT_USER if raw.get("user") == DEFAULT_USER else ROOT,
        mask_host=mask if isinstance(mask, str) else None,
        workdir=raw["workdir"] if isinstance(raw.get("workdir"), str) else None,
    )


def with_options(metadata: dict[str, str], opts: Options) -> dict[str, Any]:
    """The fields of a create's ``CreateOptions`` that carry the client's ``metadata``
    (opaque) and ``opts`` (the record's ``e2b`` column; pass ``sealed(manager, opts)``)."""
    return {"metadata": dict(metadata), "e2b": opts.as_dict()}


def sandbox(manager: SandboxManager, sandbox_id: str) -> SandboxView:
    """The record of a sandbox; raises NotFound (unknown, deleted) or Gone (expired)."""
    return manager.get(sandbox_id)


def envs(manager: SandboxManager, sandbox_id: str) -> dict[str, str]:
    """The default environment variables of ``sandbox_id``'s processes (``envs_of`` its
    options). Raises as ``sandbox``, and ConfigError when the vault cannot open them."""
    return envs_of(manager, options(sandbox(manager, sandbox_id)))


def envs_of(manager: SandboxManager, opts: Options | None) -> dict[str, str]:
    """The default environment variables of the processes of a sandbox whose options are
    ``opts`` (create's ``envVars``, opened from the vault; ``{}`` for a sandbox made by
    Hangar's own API: None). Raises ConfigError when the vault cannot open them."""
    if opts is None:
        return {}
    out = dict(opts.envs)
    if opts.sealed_envs is not None:
        opened = json.loads(manager.vault.open(ENVS_LABEL, opts.sealed_envs))
        out.update({str(k): str(v) for k, v in opened.items()})
    return out


def url_exposure(manager: SandboxManager, sandbox_id: str, port: int,
                 traffic: str | None, access: str | None = None, method: str = "GET",
                 path: str = "/") -> Exposure | None:
    """How E2B's sandbox URLs reach a port nobody exposed: ``{port}-{id}.<HANGAR_DOMAIN>``,
    what ``sandbox.get_host(port)`` names, opens every user port of a sandbox made
    through ``/e2b``, as E2B's own do. Its create's ``network.allowPublicTraffic``
    (default true) says whether that needs no credential or a token: the
    ``E2B-Traffic-Access-Token`` header (``traffic``: its ``trafficAccessToken``) or
    ``X-Access-Token`` (``access``: its envd access token). ``CONTROL_PORTS`` are never
    public: they need the envd access token (the traffic token only where
    ``traffic_admits`` says, for ``method`` and the guest's ``path``).

    Returns a public ``Exposure`` for the request when it may pass; None for a sandbox
    made through Hangar's own API (its ports are exposed with ``POST
    /sandboxes/{id}/ports``). Raises Unauthorized (a control port's token is missing or
    wrong), Forbidden (a private sandbox's traffic token is missing or wrong: E2B's 403),
    NotFound or Gone (no such sandbox).
    """
    opts = options(sandbox(manager, sandbox_id))
    if opts is None:
        return None
    if check_access_token(manager, sandbox_id, access):
        return Exposure(sandbox_id, port, True, "", time.time())
    if port in CONTROL_PORTS:
        if not (traffic_admits(port, method, path)
                and check_traffic_token(manager, sandbox_id, traffic)):
            raise Unauthorized(f"port {port} of sandbox {sandbox_id} runs code in its guest "
                               "(envd, the code interpreter): it is never public and needs "
                               "the sandbox's envdAccessToken in the X-Access-Token header",
                               sandbox_id=sandbox_id, port=port)
    elif not opts.public_traffic and not check_traffic_token(manager, sandbox_id, traffic):
        raise Forbidden(f"sandbox {sandbox_id} was created with "
                           "network.allowPublicTraffic false: its URLs need its "
                           "trafficAccessToken in the E2B-Traffic-Access-Token header",
                           sandbox_id=sandbox_id, port=port)
    return Exposure(sandbox_id, port, True, "", time.time())


def request_host(manager: SandboxManager, sandbox_id: str, port: int) -> bytes | None:
    """The ``Host`` a request through ``sandbox_id``'s E2B URL for ``port`` carries to the
    guest: its create's ``network.maskRequestHost`` with ``${PORT}`` replaced by ``port``,
    or None (the client's own ``Host``) when it set none or was not made through ``/e2b``.
    Raises NotFound or Gone (no such sandbox)."""
    opts = options(sandbox(manager, sandbox_id))
    if opts is None or opts.mask_host is None:
        return None
    return opts.mask_host.replace("${PORT}", str(port)).encode("ascii")


# -- templates -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Source:
    """Where a create of an E2B template name starts from: ``image`` (a Hangar image or
    template, by name) or ``snapshot`` (a Hangar snapshot, by id)."""

    kind: str
    name: str
    asked: str
    """The name the client gave."""
    shared: bool = False
    """A snapshot of the operator's that a team starts from (a built template's:
    ``SandboxManager.provision``'s ``shared``)."""


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
    # a team sees its own snapshots only (hangar.core.teams): another's is missing
    for find in (manager.get_snapshot, manager.named_snapshot):
        try:  # a snapshot's id, or its name: its newest snapshot
            return Source("snapshot", find(name).id, asked)
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
SAMPLE_BYTES = 4 << 10
"""Bytes of a sample's output read (``_SAMPLE``'s seven lines of figures are about 300
bytes; envd's ``/metrics`` reads as many): a guest's longer lines are cut there, and fail
to parse, instead of taking the loop (review 29k K-H4: 0.6 s for 4 MiB)."""


async def metrics(manager: SandboxManager, sandbox_id: str) -> Metric | None:
    """One sample of ``sandbox_id``'s guest, read inside it (a short command: about 0.3 s),
    or None when it is not running (a paused sandbox is not woken to be measured).
    Raises NotFound, Gone, GuestError (no sample within ``SAMPLE_TIMEOUT_S``, or the
    guest's figures could not be read), and the guest call's errors."""
    rec = sandbox(manager, sandbox_id)
    if rec.state != State.RUNNING:
        return None
    result = await manager.exec(sandbox_id, Command(_SAMPLE, timeout_s=SAMPLE_TIMEOUT_S,
                                                    head=SAMPLE_BYTES, tail=0))
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
