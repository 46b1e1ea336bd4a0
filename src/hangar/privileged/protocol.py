"""The privileged helper's request table: one strict pydantic model per request.

The unprivileged server sends one JSON object per ``SOCK_SEQPACKET``
message (at most ``MAX_MESSAGE`` bytes; file descriptors ride along as
``SCM_RIGHTS``) and gets one answer: ``{"ok": true, "result": ...}`` or
``{"ok": false, "error": "<message>"}``. Every request is validated with
``Request`` (``strict``, no extra field, bounded sizes) before anything
runs, and then again by its handler against the host (a folder must be a
sandbox folder of the data directory, a pid must run as a VMM uid, ...):
the helper trusts nothing the server sends, since the server parses
network input. The server never writes a request itself: it calls the
typed method of ``hangar.privileged.client.Client`` named like the op,
which builds the model below and reads the answer into the ``TypedDict``
its handler returns (``Claim``, ``Started``, ...). The handlers live in
``hangar.roothelper``, above the engines and the network they drive.

| op | does (as root) |
|---|---|
| ``ping`` | answers ``pong`` (start-up check) |
| ``prepare_vmm`` | the VMM's uid claim, cgroup, folder owner and modes, console folder (``Confinement.prepare``, ``console_argv``) |
| ``spawn_vmm`` | starts QEMU (only the configured binary) confined by the plan ``prepare_vmm`` made, with its console logger; answers its host pid |
| ``kill_vmm`` | SIGKILL to a process whose real uid is a VMM uid |
| ``release_vmm`` | removes a sandbox's cgroup and drops its uid claim |
| ``vmm_memory`` | a VMM's ``Pss``/``Rss`` (another uid's ``/proc/PID/smaps_rollup``) |
| ``net_info``, ``net_start`` | whether TAP networking works; the bridge, sysctls and base nftables rules |
| ``net_attach``, ``net_release`` | a sandbox's TAP, address and nftables rules (its policy parsed by ``Policy``), and their removal |
| ``net_sweep``, ``net_teardown``, ``net_leases`` | TAPs of sandboxes not live; everything; the leases |
| ``net_guard`` | the cluster's control endpoints no guest may reach (IPv4 address, TCP port pairs) |
| ``net_intercept`` | a sandbox's TCP to some ports (or its DNS) redirected to a port of the gateway (``NetworkManager.intercept``, ``redirect_dns``) |
| ``net_admit`` | addresses (and ports) a sandbox's allowed names resolved to, opened until their timeout (``NetworkManager.admit``) |
| ``net_rules`` | a running sandbox's egress rules replaced (``NetworkManager.set_rules``; its policy parsed by ``Policy``) |
| ``image_pull`` | starts ``python -m hangar.images.pull``: a registry's image pulled and built as an image (the registry policy is root's own settings; credentials go to it on stdin) |
| ``image_pull_wait`` | that pull's output lines from an offset, and its exit status once it ended |
"""

from __future__ import annotations

from typing import Annotated, Literal, TypedDict, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, TypeAdapter

MAX_MESSAGE = 64 << 10
"""Bytes of one request or answer."""
MAX_FDS = 2
"""File descriptors one request may carry."""

SandboxId = Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")]
Name = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")]
AbsPath = Annotated[str, Field(min_length=1, max_length=4096, pattern=r"^/")]
Arg = Annotated[str, Field(max_length=8192)]


def normal_path(path: str) -> bool:
    """Whether ``path`` is absolute and already normal: no empty, ``.`` or ``..`` name (a
    ``..`` after a symlink the server put climbs where ``os.path.normpath`` never looks)."""
    return path.startswith("/") and all(n not in ("", ".", "..") for n in path.split("/")[1:])


def _normal(path: str) -> str:
    if not normal_path(path):
        raise ValueError("a path with no empty, '.' or '..' name")
    return path


NormalPath = Annotated[AbsPath, AfterValidator(_normal)]
"""An absolute path with no empty, ``.`` or ``..`` name (``normal_path``)."""


class Claim(TypedDict):
    """``prepare_vmm``'s answer: the VMM's uid (= gid) and its view's root, if any."""

    uid: int
    root: str | None


class Started(TypedDict):
    """``spawn_vmm``'s and ``jail_spawn``'s answer: the VMM's host pid, and its exit
    status when it already ended."""

    pid: int
    exit: int | None


class HostMemory(TypedDict):
    """``vmm_memory``'s answer: the VMM's ``Pss`` and ``Rss``, MiB."""

    host_mib: float
    host_rss_mib: float


class NetStatus(TypedDict):
    """``net_info``'s answer: whether TAP networking works, and why (not)."""

    ok: bool
    reason: str


class JailIds(TypedDict):
    """``jail_prepare``'s answer: the jailed VMM's uid and gid."""

    uid: int
    gid: int


class PullProgress(TypedDict):
    """``image_pull_wait``'s answer: the pull's exit status (None: it runs), its output
    lines from the offset asked for, and the offset to ask for next."""

    exit: int | None
    lines: list[str]
    offset: int


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class Ping(_Strict):
    op: Literal["ping"] = "ping"


class PrepareVmm(_Strict):
    """``Confinement.prepare`` of one sandbox, then its console folder."""

    op: Literal["prepare_vmm"] = "prepare_vmm"
    sandbox_id: SandboxId
    vcpus: int = Field(ge=1, le=64)
    memory_mib: int = Field(ge=16, le=1 << 20)
    accel: Literal["kvm", "tcg"]
    tcg_cache_mib: int = Field(ge=0, le=1 << 16)
    reads: list[NormalPath] = Field(max_length=8)
    owned: list[Name] = Field(max_length=8)
    file_limit: int | None = Field(default=None, ge=1 << 20, le=1 << 44)
    host_network: bool = False
    view_fds: str | None = Field(default=None, max_length=256, pattern=r"^/")
    """Bind the VMM's own ``/proc/self/fd`` at this path of its view (a template's memfd)."""
    tap: Name | None = None
    """The sandbox's TAP (``net_attach`` made it): handed to the VMM open."""


class SpawnVmm(_Strict):
    """Start the sandbox's VMM with the plan ``prepare_vmm`` made for it."""

    op: Literal["spawn_vmm"] = "spawn_vmm"
    sandbox_id: SandboxId
    argv: list[Arg] = Field(min_length=1, max_length=512)
    fds: list[int] = Field(default_factory=list, max_length=MAX_FDS)
    """The numbers the passed descriptors get in the VMM, in the order they were sent."""


class KillVmm(_Strict):
    op: Literal["kill_vmm"] = "kill_vmm"
    pid: int = Field(gt=1, lt=1 << 22)


class ReleaseVmm(_Strict):
    op: Literal["release_vmm"] = "release_vmm"
    sandbox_id: SandboxId


class VmmMemory(_Strict):
    op: Literal["vmm_memory"] = "vmm_memory"
    pid: int = Field(gt=1, lt=1 << 22)


class NetInfo(_Strict):
    op: Literal["net_info"] = "net_info"


class NetStart(_Strict):
    op: Literal["net_start"] = "net_start"


class NetAttach(_Strict):
    """``NetworkManager.attach``; ``policy`` is parsed by ``hangar.net.Policy`` there."""

    op: Literal["net_attach"] = "net_attach"
    sandbox_id: SandboxId
    policy: dict[str, Union[str, list[Annotated[str, Field(max_length=300)]]]] = Field(
        max_length=4)


class NetRelease(_Strict):
    op: Literal["net_release"] = "net_release"
    sandbox_id: SandboxId


class NetSweep(_Strict):
    op: Literal["net_sweep"] = "net_sweep"
    live_ids: list[SandboxId] = Field(max_length=2048)


class NetTeardown(_Strict):
    op: Literal["net_teardown"] = "net_teardown"


class NetLeases(_Strict):
    op: Literal["net_leases"] = "net_leases"


class NetGuard(_Strict):
    """``NetworkManager.guard_control``: at most 256 (IPv4 address, TCP port) pairs."""

    op: Literal["net_guard"] = "net_guard"
    endpoints: list[tuple[Annotated[str, Field(pattern=r"^[0-9]{1,3}(\.[0-9]{1,3}){3}$")],
                          Annotated[int, Field(ge=1, le=65535)]]] = Field(max_length=256)


Port = Annotated[int, Field(ge=1, le=65535)]
IPv4 = Annotated[str, Field(pattern=r"^[0-9]{1,3}(\.[0-9]{1,3}){3}$")]


class NetIntercept(_Strict):
    """``NetworkManager.intercept`` (``kind`` tcp: TCP to ``dports``) or ``redirect_dns``
    (``kind`` dns: UDP and TCP 53): redirected to the gateway's ``port``; null stops it."""

    op: Literal["net_intercept"] = "net_intercept"
    sandbox_id: SandboxId
    kind: Literal["tcp", "dns"]
    port: Annotated[int, Field(ge=1024, le=65535)] | None
    dports: list[Port] = Field(min_length=1, max_length=16)


class NetAdmit(_Strict):
    """``NetworkManager.admit``: at most 256 (IPv4 address, port or null, seconds)."""

    op: Literal["net_admit"] = "net_admit"
    sandbox_id: SandboxId
    entries: list[tuple[IPv4, Port | None, Annotated[int, Field(ge=1, le=86400)]]] = Field(
        min_length=1, max_length=256)


class NetRules(_Strict):
    """``NetworkManager.set_rules``; ``policy`` is parsed by ``hangar.net.Policy`` there."""

    op: Literal["net_rules"] = "net_rules"
    sandbox_id: SandboxId
    policy: dict[str, Union[str, list[Annotated[str, Field(max_length=300)]]]] = Field(
        max_length=4)


class JailPrepare(_Strict):
    """``HostJail.prepare``: claim the sandbox's Firecracker VMM a uid and make its root."""

    op: Literal["jail_prepare"] = "jail_prepare"
    sandbox_id: SandboxId


class JailLink(_Strict):
    """``HostJail.link``: (a file under the data directory, its name in the VMM's root)."""

    op: Literal["jail_link"] = "jail_link"
    sandbox_id: SandboxId
    links: list[tuple[AbsPath, Annotated[str, Field(pattern=r"^[a-z][a-z0-9.]{0,31}$")]]] = Field(
        max_length=4)


class JailSpawn(_Strict):
    """``HostJail.spawn``: start the prepared VMM under the jailer (argv made there)."""

    op: Literal["jail_spawn"] = "jail_spawn"
    sandbox_id: SandboxId
    vcpus: int = Field(ge=1, le=64)
    memory_mib: int = Field(ge=16, le=1 << 20)


class JailRelease(_Strict):
    """``HostJail.release``: the VMM's cgroups, jail and uid claim (the VMM killed first)."""

    op: Literal["jail_release"] = "jail_release"
    sandbox_id: SandboxId


class ImagePull(_Strict):
    """``hangar.images.pull.Pulls.start``: pull ``ref`` (checked again by the puller
    against root's registry policy) as image ``name``, with a build's own credentials."""

    op: Literal["image_pull"] = "image_pull"
    name: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")]
    ref: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/@-]{0,254}$")]
    username: Annotated[str, Field(max_length=256)] | None = None
    password: Annotated[str, Field(max_length=8192)] | None = None


class ImagePullWait(_Strict):
    """``hangar.images.pull.Pulls.poll``: the pull of ``name`` from output byte
    ``offset``."""

    op: Literal["image_pull_wait"] = "image_pull_wait"
    name: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")]
    offset: int = Field(ge=0, le=1 << 40)


Request = Annotated[Union[Ping, PrepareVmm, SpawnVmm, KillVmm, ReleaseVmm, VmmMemory, NetInfo,
                          NetStart, NetAttach, NetRelease, NetSweep, NetTeardown, NetLeases,
                          NetGuard, NetIntercept, NetAdmit, NetRules, JailPrepare, JailLink,
                          JailSpawn, JailRelease, ImagePull, ImagePullWait],
                    Field(discriminator="op")]
REQUEST = TypeAdapter(Request)
"""Parses one request from JSON bytes (``REQUEST.validate_json``); raises ValidationError."""
