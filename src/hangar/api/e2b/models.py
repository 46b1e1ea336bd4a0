"""The bodies of E2B's control plane as Hangar serves them: requests it reads, answers it gives.

Field names are E2B's (camelCase, as on the wire), written after E2B's
OpenAPI description (``spec/openapi.yml`` of e2b-dev/E2B) and what its
Python SDK sends. Requests ignore fields they do not know, as E2B adds
fields over time; a field Hangar cannot honour is refused by the route
that reads it, with a message that names it. Times are RFC 3339 strings
(UTC), sizes in MiB where the name says ``MB``, bytes elsewhere.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, field_validator, model_serializer,
)

from hangar.schemas.base import PATH_MAX
from hangar.schemas.bounds import (
    METADATA_ENTRIES, NAME_BYTES, check_env_vars, check_metadata, check_name, check_rules,
)


MASK_HOST = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?(:[0-9]{1,5})?")
"""A ``Host`` value ``network.maskRequestHost`` may give (``${PORT}`` replaced): a host name
or IPv4 address, an optional port."""


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Answer(BaseModel):
    """An answer: a field that is None is left out (E2B's SDK refuses ``null`` for a field
    that is optional but not nullable), except those of ``_null`` (required, nullable)."""

    model_config = ConfigDict(extra="forbid")
    _null: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _without_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        return {k: v for k, v in data.items() if v is not None or k in self._null}


# -- errors ----------------------------------------------------------------------------------

class Error(_Answer):
    """E2B's error body: the HTTP status again, and a message for people."""

    code: int
    message: str


# -- requests ----------------------------------------------------------------------------------

class AutoResume(_Request):
    enabled: bool = False


class NetworkConfig(_Request):
    """Egress rules of a new sandbox. Hangar serves ``allowOut``/``denyOut`` as IPv4 CIDRs,
    addresses and domains (``example.com``, ``*.example.com``; docs/networking.md);
    ``allowPublicTraffic`` (default true) says whether the sandbox's URLs need its traffic
    token (``hangar.core.e2b.url_exposure``); ``maskRequestHost`` is the ``Host`` requests
    through those URLs carry to the guest (``${PORT}`` becomes the port; a host name or
    address with an optional port, else 400); ``egressProxy`` and ``rules`` are refused."""

    allowPublicTraffic: bool | None = None
    allowOut: list[str] | None = None
    denyOut: list[str] | None = None
    egressProxy: dict[str, Any] | None = None
    maskRequestHost: str | None = Field(None, max_length=NAME_BYTES)
    rules: dict[str, Any] | None = None

    @field_validator("maskRequestHost")
    @classmethod
    def _mask(cls, v: str | None) -> str | None:
        if v is not None and not MASK_HOST.fullmatch(v.replace("${PORT}", "1")):
            raise ValueError("network.maskRequestHost must be a host name or address with an "
                             "optional port, where ${PORT} stands for the sandbox's port")
        return v

    _allow = field_validator("allowOut")(classmethod(
        lambda cls, v: check_rules(v, "network.allowOut")))
    _deny = field_validator("denyOut")(classmethod(
        lambda cls, v: check_rules(v, "network.denyOut")))


class NetworkUpdate(_Request):
    """Body of ``PUT /sandboxes/{id}/network``: the egress rules replaced (an omitted list
    is cleared, as E2B does); ``allow_internet_access`` false denies 0.0.0.0/0;
    ``egressProxy`` and ``rules`` are refused."""

    allowOut: list[str] | None = None
    denyOut: list[str] | None = None
    allow_internet_access: bool | None = None
    egressProxy: dict[str, Any] | None = None
    rules: dict[str, Any] | None = None

    _allow = field_validator("allowOut")(classmethod(
        lambda cls, v: check_rules(v, "network.allowOut")))
    _deny = field_validator("denyOut")(classmethod(
        lambda cls, v: check_rules(v, "network.denyOut")))


class VolumeMount(_Request):
    name: str = Field(max_length=NAME_BYTES)
    path: str = Field(max_length=PATH_MAX)


class NewSandbox(_Request):
    """``POST /sandboxes`` (v1). ``timeout``: seconds to live (0: no limit)."""

    templateID: str = Field(min_length=1, max_length=256)
    timeout: int = Field(15, ge=0, le=2_147_483_647)
    autoPause: bool = False
    autoPauseMemory: bool = True
    autoResume: AutoResume | None = None
    secure: bool | None = None
    allow_internet_access: bool | None = None
    network: NetworkConfig | None = None
    metadata: dict[str, str] | None = Field(None, max_length=METADATA_ENTRIES)
    envVars: dict[str, str] | None = None
    mcp: dict[str, Any] | None = None
    iam: dict[str, Any] | None = None
    volumeMounts: list[VolumeMount] | None = Field(None, max_length=64)

    _metadata = field_validator("metadata")(classmethod(
        lambda cls, v: check_metadata(v)))
    _env = field_validator("envVars")(classmethod(
        lambda cls, v: check_env_vars(v)))
    _template = field_validator("templateID")(classmethod(
        lambda cls, v: check_name(v, "templateID")))


class NewSandboxV2(NewSandbox):
    """``POST /v2/sandboxes``: the v1 body with E2B's newer default timeout (300 s)."""

    timeout: int = Field(300, ge=0, le=2_147_483_647)


class ConnectSandbox(_Request):
    """``POST /sandboxes/{id}/connect`` (v1: ``timeout`` required) and its v2 form."""

    timeout: int = Field(ge=0, le=2_147_483_647)
    memory: bool | None = None


class ConnectSandboxV2(ConnectSandbox):
    timeout: int = Field(300, ge=0, le=2_147_483_647)


class ResumedSandbox(_Request):
    """``POST /sandboxes/{id}/resume`` (deprecated by E2B in favour of connect)."""

    timeout: int = Field(15, ge=0, le=2_147_483_647)
    autoPause: bool | None = None


class TimeoutRequest(_Request):
    timeout: int = Field(ge=0, le=2_147_483_647)


class RefreshRequest(_Request):
    duration: int | None = Field(None, ge=0, le=3600)


class PauseRequest(_Request):
    """``POST /sandboxes/{id}/pause``: ``memory`` false (or ``mode`` ``filesystem``) keeps
    the disk alone, and the resume boots the guest cold; omitted: memory is kept."""

    memory: bool | None = None
    mode: Literal["full", "filesystem"] | None = None
    requireHealthyGuest: bool = False


class ForkRequest(_Request):
    timeout: int = Field(15, ge=0, le=2_147_483_647)
    count: int = Field(1, ge=1, le=100)


class SnapshotRequest(_Request):
    name: str | None = None
    memory: bool | None = None


# -- answers: sandboxes -----------------------------------------------------------------------

class Sandbox(_Answer):
    """A created, connected, resumed or forked sandbox: what the SDK needs to reach envd."""

    templateID: str
    sandboxID: str
    alias: str | None = None
    clientID: str
    envdVersion: str
    envdAccessToken: str | None = None
    trafficAccessToken: str | None = None
    domain: str | None = None


class Lifecycle(_Answer):
    autoResume: bool
    onTimeout: Literal["kill", "pause"]


class ListedSandbox(_Answer):
    """One sandbox of a list. ``state``: ``running`` or ``paused``."""

    templateID: str
    alias: str | None = None
    sandboxID: str
    clientID: str
    startedAt: str
    endAt: str
    cpuCount: int
    memoryMB: int
    diskSizeMB: int
    metadata: dict[str, str]
    state: Literal["running", "paused"]
    envdVersion: str
    volumeMounts: list[VolumeMount] = Field(default_factory=list)


class SandboxDetail(ListedSandbox):
    """``GET /sandboxes/{id}``: a listed sandbox, plus how to reach it and its policies."""

    envdAccessToken: str | None = None
    domain: str | None = None
    allowInternetAccess: bool | None = None
    network: dict[str, Any] | None = None
    lifecycle: Lifecycle | None = None


class SandboxMetric(_Answer):
    """One sample: CPU in percent of all the sandbox's vCPUs; memory and disk in bytes."""

    timestamp: str
    timestampUnix: int
    cpuCount: int
    cpuUsedPct: float
    memUsed: int
    memTotal: int
    memCache: int
    diskUsed: int
    diskTotal: int


class SandboxesWithMetrics(_Answer):
    sandboxes: dict[str, SandboxMetric]


class ForkResult(_Answer):
    """One fork's outcome: ``sandbox`` when it started, else ``error``."""

    sandbox: Sandbox | None = None
    error: Error | None = None


# -- answers: snapshots and templates -------------------------------------------------------

class SnapshotInfo(_Answer):
    snapshotID: str
    names: list[str]


class Template(_Answer):
    """A Hangar image or template as an E2B template (always ``ready`` and public)."""

    templateID: str
    buildID: str
    cpuCount: int
    memoryMB: int
    diskSizeMB: int
    public: bool
    aliases: list[str]
    names: list[str]
    createdAt: str
    updatedAt: str
    createdBy: None = None
    lastSpawnedAt: str | None = None
    spawnCount: int
    buildCount: int
    envdVersion: str
    buildStatus: Literal["building", "waiting", "ready", "error"]

    _null = frozenset({"createdBy", "lastSpawnedAt"})


class TemplateBuild(_Answer):
    buildID: str
    status: Literal["building", "waiting", "ready", "error"]
    createdAt: str
    updatedAt: str
    finishedAt: str | None = None
    cpuCount: int
    memoryMB: int
    diskSizeMB: int | None = None
    envdVersion: str | None = None


class TemplateWithBuilds(_Answer):
    templateID: str
    public: bool
    aliases: list[str]
    names: list[str]
    createdAt: str
    updatedAt: str
    lastSpawnedAt: str | None = None
    spawnCount: int
    builds: list[TemplateBuild]

    _null = frozenset({"lastSpawnedAt"})


class TemplateAlias(_Answer):
    templateID: str
    public: bool


# -- teams -----------------------------------------------------------------------------------

class Team(_Answer):
    """One of the caller's teams (``hangar.api.e2b.teams``)."""

    teamID: str
    name: str
    apiKey: str
    isDefault: bool


class TeamMetric(_Answer):
    """A team's figures at one moment; ``timestamp`` ISO 8601 (E2B keeps it, deprecated)."""

    timestamp: str
    timestampUnix: int
    concurrentSandboxes: int
    sandboxStartRate: float
