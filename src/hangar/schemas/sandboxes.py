"""Wire schemas of sandboxes (create, timeout, info, memory), health and the warm pool."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, field_validator

from hangar.schemas.base import Model, RequestBody
from hangar.schemas.bounds import (
    DESKTOP_MAX_PIXELS, DISK_MIB_MAX, DISK_MIB_MIN, MEMORY_MIB_MAX, MEMORY_MIB_MIN,
    METADATA_ENTRIES, TTL_MAX_S, VCPUS_MAX, VCPUS_MIN, check_desktop_size, check_metadata,
    check_network,
)
from hangar.schemas.secrets import ENV_NAME, MAX_SECRETS_PER_SANDBOX, SECRET_NAME
from hangar.schemas.volumes import MAX_VOLUMES_PER_SANDBOX, MountPath, MountedVolume, VolumeMount


class CreateSandbox(RequestBody):
    """Body of ``POST /sandboxes``; every field is optional."""

    model_config = ConfigDict(extra="forbid")

    image: str | None = Field(None, description="Template (image recipe) name; default 'base'.",
                              pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")
    vcpus: int | None = Field(None, ge=VCPUS_MIN, le=VCPUS_MAX)
    memory_mib: int | None = Field(None, ge=MEMORY_MIB_MIN, le=MEMORY_MIB_MAX,
                                   description="Guest memory, MiB; default: the image's (desktop "
                                               "and dev: 2048), else the server's (512).")
    disk_mib: int | None = Field(None, ge=DISK_MIB_MIN, le=DISK_MIB_MAX,
                                 description="Writable disk, MiB.")
    timeout: float | None = Field(None, ge=0, le=TTL_MAX_S,
                                  description="Time to live in seconds; 0 keeps it until deleted; "
                                              "default: the server's (one hour).")
    metadata: dict[str, str] = Field(default_factory=dict, max_length=METADATA_ENTRIES)
    network: str | dict[str, object] | None = Field(
        None, description="Egress policy: 'none', 'internet' (public addresses only), 'open', "
                          "or {'egress': ..., 'allow': [...], 'deny': [...]} whose entries are "
                          "IPv4 CIDRs or domains (example.com, *.example.com), each optionally "
                          "with :PORT; the most specific entry wins (docs/networking.md). "
                          "Default: 'internet' with TAP networking.")
    desktop: str | None = Field(
        None, pattern=r"^[1-9][0-9]{2,4}x[1-9][0-9]{2,4}x(16|24)$",
        description="Start a desktop of WIDTHxHEIGHTxDEPTH (pixels, bits), e.g. 1280x800x24; "
                    f"each side 64..8192, at most {DESKTOP_MAX_PIXELS} pixels (4096x4096) in "
                    "all; needs an image with one (the 'desktop' recipe).")
    volumes: dict[MountPath, Annotated[str, Field(max_length=64)] | VolumeMount] | None = Field(
        None, max_length=MAX_VOLUMES_PER_SANDBOX,
        description="Named volumes by guest mount path (absolute, no '..'): a volume's id or "
                    "name (read-write, one writer at a time) or {'volume': ..., 'read_only': "
                    "true} (any number of readers while none writes). A sandbox with volumes "
                    "boots (no template snapshot or warm pool) and cannot be snapshotted or "
                    "put to sleep; see docs/volumes.md.")
    secrets: dict[Annotated[str, Field(pattern=ENV_NAME)],
                  Annotated[str, Field(pattern=SECRET_NAME)]] | None = Field(
        None, max_length=MAX_SECRETS_PER_SANDBOX,
        description="Vault secrets by environment variable, e.g. {'GITHUB_TOKEN': 'gh'}: the "
                    "guest's commands see only a placeholder in that variable; the sandbox's "
                    "egress proxy puts the real value in its place in HTTP headers sent to "
                    "the secret's hosts, and refuses it anywhere else (docs/security.md, "
                    "'Secrets and the vault'). Needs TAP networking.")

    _metadata = field_validator("metadata")(classmethod(
        lambda cls, v: check_metadata(v)))
    _network = field_validator("network")(classmethod(
        lambda cls, v: check_network(v)))
    _desktop = field_validator("desktop")(classmethod(
        lambda cls, v: check_desktop_size(v)))


class SetTimeout(RequestBody):
    """Body of ``POST /sandboxes/{id}/timeout``."""

    model_config = ConfigDict(extra="forbid")

    timeout: float = Field(ge=0, le=TTL_MAX_S,
                           description="Seconds from now until the sandbox expires; 0: never.")


class SandboxMemory(Model):
    """What a running sandbox's memory costs the host, beside what its guest uses; MiB.

    Host figures are the VMM process's (``/proc/PID/smaps_rollup``); guest
    figures come from the guest kernel's balloon driver every few seconds
    (null without a balloon, e.g. under Firecracker, or before its first report).
    """

    host_mib: float = Field(description="Proportional set size of the VMM: its private "
                                        "memory plus its share of pages other processes share "
                                        "(QEMU's code, the guest kernel's file).")
    host_rss_mib: float = Field(description="Resident set size of the VMM.")
    guest_total_mib: float | None = Field(None, description="Memory the guest kernel manages.")
    guest_used_mib: float | None = Field(None, description="Guest memory in use: used plus "
                                                           "buffers and cache (all but free).")
    guest_cache_mib: float | None = Field(None, description="Of which the guest's disk cache.")
    guest_stats_age_s: float | None = Field(None, description="Age of the guest figures, "
                                                              "seconds.")


class SandboxInfo(Model):
    """A sandbox as the API shows it."""

    id: str
    state: str
    image: str
    image_id: str = Field("", description="The image build it runs on and is pinned to, "
                                          "<image>-<digest>; a rebuild never changes it.")
    engine: str
    accel: str
    vcpus: int
    memory_mib: int
    disk_mib: int
    created_at: float = Field(description="Unix time, seconds.")
    expires_at: float | None = Field(None, description="Unix time, seconds; null: no TTL.")
    error: str | None = Field(None, description="Why it failed, or the last error of a "
                                                "background step (e.g. a sleep or wake).")
    metadata: dict[str, str] = Field(default_factory=dict)
    desktop: str | None = None
    network: dict[str, object] | None = Field(None, description="Egress policy; null: no NIC.")
    team: str | None = Field(None, description="The team whose key made it (docs/security.md, "
                                               "teams); null: an operator key's.")
    source: str | None = Field(None, description="Where its VM came from: template "
                                                 "(restored from its image's booted template "
                                                 "snapshot), pool (the warm pool), cold "
                                                 "(booted for it) or fork.")
    memory: SandboxMemory | None = Field(
        None, description="Host memory it costs and its guest's own use; only in "
                          "GET /sandboxes/{id}, and only while its VM runs.")
    volumes: dict[str, MountedVolume] | None = Field(
        None, description="Its named volumes by guest path (volume id and read_only); only in "
                          "the create's answer and GET /sandboxes/{id}.")
    secrets: dict[str, str] | None = Field(
        None, description="Its secrets: environment variable -> secret name (the guest holds "
                          "a placeholder; docs/security.md); only in the create's answer and "
                          "GET /sandboxes/{id}.")


class SandboxList(Model):
    sandboxes: list[SandboxInfo]


class Health(Model):
    status: Literal["ok"]
    version: str
    engine: dict[str, str]
    sandboxes: int = Field(description="Sandboxes that exist (warm-pool VMs not counted).")


class PoolStatus(Model):
    """``GET /pool``: the warm pool of paused VMs, booted ahead of creates."""

    size: int = Field(description="VMs the pool keeps ready (HANGAR_POOL_SIZE).")
    ready: int = Field(description="Paused VMs ready to be taken now.")
    starting: int = Field(description="VMs booting to refill the pool.")
    max_age_s: float = Field(description="A pool VM older than this is replaced, seconds.")
    oldest_age_s: float | None = Field(None, description="Age of the oldest ready VM, seconds.")
    image: str = Field(description="The server's default template.")
    templates: dict[str, int] = Field(default_factory=dict, description=(
        "VMs kept ready per template (HANGAR_POOL_SIZE of the default one, plus "
        "HANGAR_POOL_TEMPLATES)."))


class MemoryStatus(Model):
    """The host's memory as admission sees it (``GET /capacity``), MiB."""

    declared_mib: int = Field(description="Guest memory every VMM declares, pool included.")
    budget_mib: int = Field(description="HANGAR_MEMORY_BUDGET_MIB (unset: 80 % of RAM).")
    overcommit: float = Field(description="HANGAR_MEMORY_OVERCOMMIT.")
    allowed_mib: int = Field(description="What they may declare together: budget × overcommit.")
    used_mib: int = Field(description="What the VMMs hold on the host (resident sets).")
    available_mib: int = Field(description="The host's MemAvailable.")
    headroom_mib: int = Field(description="MemAvailable kept free (HANGAR_MEMORY_HEADROOM_MIB): "
                                          "below it idle sandboxes are put to sleep.")
    slept: int = Field(description="Idle sandboxes put to sleep for memory since start-up.")


class StartsStatus(Model):
    """VMM starts (boots, restores, wakes) in progress and queued (``GET /capacity``)."""

    running: int = Field(description="Starts in progress now.")
    limit: int = Field(description="Starts that may run at once "
                                   "(HANGAR_MAX_CONCURRENT_STARTS; unset: max(2, cores)).")
    queued: int = Field(description="Starts waiting for a slot, oldest first served.")
    queue: int = Field(description="Starts that may wait at once (HANGAR_START_QUEUE); one "
                                   "more gets 429 start_queue_full.")
    max_wait_s: float = Field(description="Seconds a start may wait (HANGAR_START_QUEUE_WAIT_S); "
                                          "beyond it gets 429 start_queue_wait.")
    waited: int = Field(description="Starts that had to wait, since start-up.")
    refused: int = Field(description="Starts the queue refused (full or waited out), since "
                                     "start-up.")


class Capacity(Model):
    """``GET /capacity`` (the operator's): VMMs against their cap, starts against theirs,
    and the host's memory."""

    vmms: int = Field(description="VMMs that may be running, warm pool included.")
    vmm_limit: int = Field(description="HANGAR_MAX_SANDBOXES.")
    starts: StartsStatus
    memory: MemoryStatus
