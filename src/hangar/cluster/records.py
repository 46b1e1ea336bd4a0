"""What the cluster keeps in etcd: keys and record shapes.

Every key lives under ``/hangar/``::

    /hangar/config                 ClusterConfig (JSON), written by ``hangar cluster init``
    /hangar/nodes/<name>           NodeInfo, under the node's lease (gone when it expires)
    /hangar/drain/<name>           present while the node is drained (no lease)
    /hangar/restarts/<name>        present while the node restarts: written at a graceful
                                   stop under a lease of ``restart_grace_s``, deleted when
                                   it registers again (``hangar.cluster.membership``)
    /hangar/leader                 the node whose reconciler handles dead nodes (under its lease)
    /hangar/sandboxes/<id>         SandboxObject: owner, epoch, state, last snapshot
    /hangar/machines/<user>        {"sandboxId": ..., "idleTimeoutSeconds": ..., "createdAt": ...}
    /hangar/snapshots/<id>         a user snapshot in shared storage (forks on any node)
    /hangar/slots/<node>/<k>       one of the node's ``capacity`` VM slots, value: a sandbox id
    /hangar/teams/<name>           TeamRecord: a team's limits (``hangar.cluster.team_records``)
    /hangar/keys/<name>            KeyRecord: a team's key, as its SHA-256 (``hangar.keys``)
    /hangar/quota/<team>           a counter every create and wake of a team with limits
                                   bumps in its claim's transaction: they cannot pass a
                                   limit together (``hangar.cluster.teams``)

A machine's key and its ``hangar.dev/user`` label hold the user id as its node
stores it (``TEAM/user`` for a team's, ``hangar.core.teams.scoped``); a team's
sandbox carries its team in the label ``hangar.dev/team``.

Sandbox records follow the shape of Kubernetes' agent-sandbox ``Sandbox``
(``agents.x-k8s.io``): ``metadata`` (name, labels, creationTimestamp),
``spec`` (what is wanted: ``operatingMode`` Running or Suspended,
``shutdownTime``, the template) and ``status`` (what is: ``nodeName``,
``podIPs``, ``conditions``), plus Hangar's own ``status.epoch``,
``status.state`` and ``status.snapshot``. A Kubernetes backend maps one
record onto one ``Sandbox`` object (docs/cluster.md).

``status.state`` is a ``hangar.core.lifecycle.State`` and moves only by the
table of ``hangar.core.lifecycle``: ``SandboxObject.move`` (one edge,
guarded ones for a failover), ``SandboxObject.follow`` (a node mirrors its
local record: a chain of edges) and ``SandboxObject.want`` (the desired
state, ``spec.desiredState``, checked by ``check_desired``). Records read
from etcd are untrusted: ``SandboxObject.parse`` raises ``BadRecord`` for a
state that is not one of ``State`` or a malformed field, and the directory
answers such a record with a 409 naming it, never a 500.
"""

from __future__ import annotations

import ipaddress
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from hangar.keys import NAME as KEY_NAME_RX
from hangar.teams import NAME as TEAM_NAME_RX
from hangar.core.service import (
    USER_ID, VMM_STATES, Face, Guard, OnExpiry, State, Template, check, check_desired,
    from_public, public_name, walk,
)

ROOT = "/hangar/"
CONFIG = ROOT + "config"
NODES = ROOT + "nodes/"
DRAIN = ROOT + "drain/"
RESTARTS = ROOT + "restarts/"
LEADER = ROOT + "leader"
SANDBOXES = ROOT + "sandboxes/"
MACHINES = ROOT + "machines/"
SNAPSHOTS = ROOT + "snapshots/"
SLOTS = ROOT + "slots/"
TEAMS = ROOT + "teams/"
KEYS = ROOT + "keys/"
QUOTA = ROOT + "quota/"

TEAM_LABEL = "hangar.dev/team"
USER_LABEL = "hangar.dev/user"

API_VERSION = "hangar.dev/v1alpha1"

VMM_HOLDING: frozenset[State] = VMM_STATES - {State.POOLED}
"""States whose sandbox holds a VM slot (pool VMs have no cluster record)."""

# -- what a field read from etcd may look like ------------------------------------------

SANDBOX_ID = re.compile(r"^sb-[0-9a-f]{12}$")
"""A sandbox id (``hangar.core.admission.new_id``): the only form a record's key, name or
``sandboxId`` may take; paths under the data folder are derived from it, never read."""
SNAPSHOT_ID = re.compile(r"^snap-[0-9a-f]{12}$")
"""A snapshot id (``new_id("snap-")``)."""
NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
"""A node's name (``HANGAR_NODE_NAME``; a host name by default): no slash, no leading dot."""
IMAGE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
"""An image name or content id (``<name>-<digest>``)."""
HOST_NAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                       r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$")
WORD = re.compile(r"^[A-Za-z0-9._-]{0,32}$")
"""Engine, accelerator, source: short plain words."""
TEAM_NAME = TEAM_NAME_RX
"""A team's name (``hangar.teams.NAME``)."""
KEY_NAME = KEY_NAME_RX
"""A named key's name (``hangar.keys.NAME``)."""
STORED_USER = re.compile(r"^(?:[a-z0-9][a-z0-9-]{0,62}/)?[A-Za-z0-9][A-Za-z0-9._@-]{0,127}$")
"""A machine's user id as a node stores it: ``USER_ID``, or ``TEAM/`` and one for a team's
(``hangar.core.teams.scoped``)."""
MAX_RECORD_BYTES = 1 << 20
"""Largest value of a record the directory reads (a sandbox's view and template included)."""


class BadRecord(ValueError):
    """A record in etcd that does not parse: an unknown state, a malformed field."""


def check_address(value: str) -> str:
    """``host:port`` as a node advertises it: an IPv4 address, ``[IPv6]`` or a DNS name,
    and a port 1-65535; nothing else (no scheme, path, user). Link-local, multicast and
    unspecified addresses are refused (no node lives there; the cloud metadata service
    does). Returns it; raises ValueError."""
    if not isinstance(value, str) or len(value) > 270:
        raise ValueError("not a host:port string")
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536 or port != str(int(port)):
        raise ValueError(f"{value[:80]!r} is not host:port")
    if host.startswith("[") and host.endswith("]"):
        ip = ipaddress.IPv6Address(host[1:-1])
    elif HOST_NAME.fullmatch(host) and not host.replace(".", "").isdigit():
        return value
    else:
        try:
            ip = ipaddress.IPv4Address(host)
        except ValueError:
            raise ValueError(f"{value[:80]!r} is not host:port") from None
    if ip.is_link_local or ip.is_multicast or ip.is_unspecified:
        raise ValueError(f"{value[:80]!r}: no node can live at that address")
    return value


def _match(rx: re.Pattern[str], what: str) -> Any:
    def check_(v: Any) -> Any:
        if v is not None and not (isinstance(v, str) and rx.fullmatch(v)):
            raise ValueError(f"{what} {str(v)[:80]!r} is malformed")
        return v
    return check_


_M = TypeVar("_M", bound=BaseModel)


def _checked(model: type[_M], what: str, raw: Any) -> _M:
    """``raw`` validated as ``model``; raises BadRecord naming ``what`` and the fields."""
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise _fail(what, exc) from None


def _fail(what: str, exc: Exception) -> BadRecord:
    if isinstance(exc, ValidationError):
        why = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'value'}: "
                        f"{e['msg'].removeprefix('Value error, ')}"[:160]
                        for e in exc.errors()[:3])
    else:
        why = str(exc)[:200]
    return BadRecord(f"unreadable {what}: {why}")


def load_json(value: bytes) -> Any:
    """A record's value as JSON. Raises BadRecord when it is too large, not JSON, or
    nested too deeply to parse."""
    if len(value) > MAX_RECORD_BYTES:
        raise BadRecord(f"record of {len(value)} bytes (at most {MAX_RECORD_BYTES})")
    try:
        return json.loads(value)
    except (ValueError, RecursionError) as exc:
        raise BadRecord(f"record is not JSON: {str(exc)[:80]}") from None


def key_id(key: str, prefix: str, rx: re.Pattern[str]) -> str:
    """The id at the end of ``key`` (after ``prefix``). Raises BadRecord when it does not
    match ``rx`` (a forged key: ``../``, a slash, a stray name)."""
    rest = key[len(prefix):]
    if not rx.fullmatch(rest):
        raise BadRecord(f"malformed key {key[:120]!r}")
    return rest


def node_key(name: str) -> str:
    return NODES + name


def restart_key(name: str) -> str:
    return RESTARTS + name


def sandbox_key(sid: str) -> str:
    return SANDBOXES + sid


def machine_key(user: str) -> str:
    return MACHINES + user


def snapshot_key(snap_id: str) -> str:
    return SNAPSHOTS + snap_id


def slot_key(node: str, k: int) -> str:
    return f"{SLOTS}{node}/{k}"


def team_key(name: str) -> str:
    return TEAMS + name


def key_key(name: str) -> str:
    return KEYS + name


def quota_key(team: str) -> str:
    return QUOTA + team


def iso(t: float | None) -> str | None:
    """Unix seconds as RFC 3339 UTC, or None."""
    return None if t is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


class _Record(BaseModel):
    model_config = ConfigDict(extra="ignore", validate_assignment=True)


class ClusterConfig(_Record):
    """Settings every node shares (``/hangar/config``).

    ``store`` is the shared snapshot storage (``s3://bucket/prefix`` or
    ``file:///path``); ``key_hashes`` the SHA-256 (hex) of the API keys
    every node accepts; ``node_token`` authenticates nodes to each other
    (every forwarded request, merged lists, placements, adoptions, the peer
    probe); ``lease_ttl_s`` the nodes' lease; ``failover_after_s`` how long
    after a node's lease expired its sandboxes are declared failed;
    ``restart_grace_s`` how long that wait becomes for a node that stopped gracefully
    (SIGTERM: a restart, an upgrade) and left a restart mark, so that a rolling restart
    whose start takes longer than the lease keeps its VMs (0: no grace).
    """

    store: str = Field(max_length=2048)
    key_hashes: list[str] = Field(max_length=256)
    node_token: str = Field(pattern=r"^[A-Za-z0-9_-]{32,128}$")
    lease_ttl_s: int = Field(5, ge=2, le=600)
    failover_after_s: float = Field(3.0, ge=0, le=3600)
    restart_grace_s: int = Field(60, ge=0, le=3600)
    created_at: float = Field(default_factory=time.time)

    @field_validator("key_hashes")
    @classmethod
    def _hashes(cls, v: list[str]) -> list[str]:
        for h in v:
            if not re.fullmatch(r"[0-9a-f]{64}", h):
                raise ValueError("a key hash is not 64 hex digits")
        return v

    @classmethod
    def parse(cls, raw: Any) -> "ClusterConfig":
        """Raises BadRecord naming what is wrong."""
        return _checked(cls, "cluster config", raw)

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


class NodeInfo(_Record):
    """A node as it states itself (``/hangar/nodes/<name>``), refreshed every few seconds."""

    name: str = Field(pattern=NODE_NAME.pattern)
    address: str
    """``host:port`` other nodes forward requests to (``check_address``)."""
    capacity: int = Field(ge=0, le=100_000)
    """VM slots (its ``HANGAR_MAX_SANDBOXES``)."""
    free: int = Field(ge=0, le=100_000)
    engine: str = Field(pattern=WORD.pattern)
    accel: str = Field(pattern=WORD.pattern)
    cpu_model: str = Field(max_length=256)
    images: list[str] = Field(max_length=4096)
    memory_free_mib: int = Field(0, ge=0, le=1 << 40)
    pool: int = Field(0, ge=0, le=100_000)
    """Warm-pool VMs ready."""
    draining: bool = False
    started_at: float = Field(default_factory=time.time)
    version: str = Field("", max_length=64)

    _address = field_validator("address")(classmethod(lambda cls, v: check_address(v)))

    @field_validator("images")
    @classmethod
    def _images(cls, v: list[str]) -> list[str]:
        for i in v:
            _match(IMAGE_NAME, "image")(i)
        return v

    @classmethod
    def parse(cls, raw: Any) -> "NodeInfo":
        """Raises BadRecord naming what is wrong."""
        return _checked(cls, "node record", raw)

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @property
    def url(self) -> str:
        return f"http://{self.address}"


class SnapshotMeta(_Record):
    """A snapshot in shared storage as etcd describes it (``status.snapshot`` of a record,
    ``/hangar/snapshots/<id>``)."""

    id: str = Field(pattern=SNAPSHOT_ID.pattern)
    sizeBytes: int = Field(0, ge=0, le=1 << 50)
    createdAt: float | None = None
    kind: Literal["user", "sleep"] | None = None
    node: str | None = Field(None, pattern=NODE_NAME.pattern)
    sandboxId: str | None = Field(None, pattern=SANDBOX_ID.pattern)
    image: str | None = Field(None, pattern=IMAGE_NAME.pattern)
    imageDigest: str | None = Field(None, pattern=r"^[0-9a-f]{0,64}$")
    vcpus: int | None = Field(None, ge=1, le=1024)
    memoryMiB: int | None = Field(None, ge=1, le=1 << 24)
    diskMiB: int | None = Field(None, ge=1, le=1 << 30)
    desktop: str | None = Field(None, max_length=32)
    network: dict[str, Any] | None = None
    engine: str | None = Field(None, pattern=WORD.pattern)
    accel: str | None = Field(None, pattern=WORD.pattern)
    memory: bool | None = None
    """False: a sleep snapshot of the disk alone (booted from, never restored)."""
    team: str | None = Field(None, pattern=TEAM_NAME.pattern)
    """The team whose sandbox it was taken of (None: the operator's)."""


def snapshot_meta(raw: Any, snap_id: str | None = None) -> dict[str, Any]:
    """Shared snapshot metadata checked (``SnapshotMeta``; ``snap_id``: the id its key
    names, which the value must not contradict). Returns the value as read. Raises
    BadRecord."""
    if snap_id is not None and isinstance(raw, dict) and raw.get("id") in (None, snap_id):
        raw = {**raw, "id": snap_id}
    _checked(SnapshotMeta, "snapshot metadata", raw)
    return dict(raw)


class MachineMeta(_Record):
    """``/hangar/machines/<user>``: the user's sandbox."""

    sandboxId: str = Field(pattern=SANDBOX_ID.pattern)
    idleTimeoutSeconds: float | None = Field(None, ge=0, le=10 ** 8)
    createdAt: float | None = None


def machine_meta(raw: Any) -> dict[str, Any]:
    """A machine record checked (``MachineMeta``); returns it. Raises BadRecord."""
    _checked(MachineMeta, "machine record", raw)
    return dict(raw)


class _TemplateIn(_Record):
    image: str = Field(pattern=IMAGE_NAME.pattern)
    imageDigest: str | None = Field(None, pattern=r"^[0-9a-f]{0,64}$")
    engine: str | None = Field(None, pattern=WORD.pattern)
    accel: str | None = Field(None, pattern=WORD.pattern)
    vcpus: int | None = Field(None, ge=1, le=1024)
    memoryMiB: int | None = Field(None, ge=1, le=1 << 24)
    diskMiB: int | None = Field(None, ge=1, le=1 << 30)
    desktop: str | None = Field(None, max_length=32)
    network: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = Field(None, max_length=1024)
    source: str | None = Field(None, max_length=128)
    expiresAt: float | None = None
    lastActiveAt: float | None = None
    e2b: dict[str, Any] | None = Field(None, max_length=16)
    onExpiry: OnExpiry | None = None
    autoResume: bool | None = None
    ttlSeconds: float | None = Field(None, ge=0, le=10 ** 8)
    wakeTtlSeconds: float | None = Field(None, ge=0, le=10 ** 8)
    sleepMemory: bool | None = None


class _SpecIn(_Record):
    template: _TemplateIn | None = None
    desiredState: State | None = None
    operatingMode: Literal["Running", "Suspended"] | None = None
    shutdownTime: str | None = Field(None, max_length=40)


class _StatusIn(_Record):
    nodeName: str | None = Field(None, pattern=NODE_NAME.pattern)
    epoch: int = Field(0, ge=0, le=1 << 62)
    slot: int | None = Field(None, ge=0, le=100_000)
    state: State
    snapshot: SnapshotMeta | None = None
    podIPs: list[str] = Field([], max_length=16)
    view: dict[str, Any] | None = None


class _MetaIn(_Record):
    name: str = Field(pattern=SANDBOX_ID.pattern)
    labels: dict[str, str] = Field({}, max_length=16)
    createdAt: float | None = None

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        for k, val in v.items():
            if len(k) > 64 or len(val) > 256:
                raise ValueError("a label is too long")
        user = v.get(USER_LABEL)
        if user is not None and not STORED_USER.fullmatch(user):
            raise ValueError("the user label is malformed")
        team = v.get(TEAM_LABEL)
        if team is not None and not TEAM_NAME.fullmatch(team):
            raise ValueError("the team label is malformed")
        return v


class _SandboxIn(_Record):
    metadata: _MetaIn
    spec: _SpecIn = _SpecIn()
    status: _StatusIn


@dataclass
class SandboxObject:
    """One sandbox's cluster record, shaped like agent-sandbox's ``Sandbox`` object."""

    name: str
    spec: dict[str, Any]
    status: dict[str, Any]
    labels: dict[str, str] = field(default_factory=dict)
    created_at: float = field(default_factory=time.time)
    mod_revision: int = 0
    """etcd's revision of this record when read (not stored): the compare of a CAS."""

    # -- fields used everywhere -----------------------------------------------------------

    @property
    def node(self) -> str | None:
        return self.status.get("nodeName")

    @property
    def epoch(self) -> int:
        return int(self.status.get("epoch", 0))

    @property
    def state(self) -> State:
        return State(self.status["state"])

    @property
    def desired(self) -> State:
        """``spec.desiredState``; records written before it was kept: from ``operatingMode``."""
        d = self.spec.get("desiredState")
        if d is not None:
            return State(d)
        mode = self.spec.get("operatingMode")
        return from_public(mode, Face.CLUSTER) if mode else State.RUNNING

    @property
    def slot(self) -> int | None:
        s = self.status.get("slot")
        return None if s is None else int(s)

    # -- moves: the table of hangar.core.lifecycle ---------------------------------------

    def move(self, to: State, guard: Guard | None = None) -> None:
        """Move ``status.state`` by one edge of the table (``guard``: a failover's), and the
        stored view's state with it. Raises ``IllegalTransition``; no move when equal."""
        if to == self.state:
            return
        check({self.state}, to, guard)
        self._set(to)

    def follow(self, to: State) -> list[State]:
        """Mirror a local record that reached ``to``: move along ``lifecycle.walk`` (each step
        an edge). Returns the chain. Raises ``IllegalTransition`` when there is none."""
        chain = walk(self.state, to)
        self._set(to)
        return chain

    def want(self, desired: State) -> None:
        """Set the desired state (``spec.desiredState``, and ``operatingMode`` as
        agent-sandbox names it). Raises ``IllegalTransition`` when the state forbids it."""
        check_desired(self.state, desired)
        self.spec["desiredState"] = desired.value
        self.spec["operatingMode"] = public_name(
            State.SLEEPING if desired == State.SLEEPING else State.RUNNING, Face.CLUSTER)

    def _set(self, to: State) -> None:
        self.status["state"] = to.value
        if isinstance(self.status.get("view"), dict):
            self.status["view"] = {**self.status["view"], "state": to.value}

    @property
    def snapshot(self) -> dict[str, Any] | None:
        """The last snapshot in shared storage a machine can go back to, or None."""
        return self.status.get("snapshot")

    @property
    def user(self) -> str | None:
        """The machine's user id as its node stores it (``TEAM/user`` for a team's)."""
        return self.labels.get(USER_LABEL)

    @property
    def team(self) -> str | None:
        """The team whose sandbox it is (label ``hangar.dev/team``), None: the operator's."""
        return self.labels.get(TEAM_LABEL)

    def to_json(self) -> dict[str, Any]:
        ready = self.state == State.RUNNING
        return {
            "apiVersion": API_VERSION, "kind": "Sandbox",
            "metadata": {"name": self.name, "labels": self.labels,
                         "creationTimestamp": iso(self.created_at),
                         "createdAt": self.created_at},
            "spec": self.spec,
            "status": {**self.status, "conditions": [{
                "type": "Ready", "status": "True" if ready else "False",
                "reason": self.state.value, "lastTransitionTime": iso(time.time())}]},
        }

    @classmethod
    def parse(cls, raw: Any, mod_revision: int = 0, sid: str | None = None) -> "SandboxObject":
        """A record as read from etcd, checked like client input (ids, node names, sizes,
        the state: ``_SandboxIn``); ``sid``: the id its key names, which ``metadata.name``
        must equal. Raises ``BadRecord`` naming what is wrong."""
        _checked(_SandboxIn, "sandbox record", raw)
        meta = raw["metadata"]
        if sid is not None and meta["name"] != sid:
            raise BadRecord(f"record names sandbox {meta['name']!r}, its key {sid!r}")
        status = dict(raw["status"])
        status.pop("conditions", None)
        return cls(name=meta["name"], spec=dict(raw.get("spec") or {}), status=status,
                   labels=dict(meta.get("labels") or {}),
                   created_at=float(meta.get("createdAt") or time.time()),
                   mod_revision=mod_revision)


def template_json(t: Template) -> dict[str, Any]:
    """``spec.template`` of a record: what another node needs to recreate the sandbox."""
    return {"image": t.image, "imageDigest": t.image_digest, "engine": t.engine,
            "accel": t.accel, "vcpus": t.vcpus, "memoryMiB": t.memory_mib,
            "diskMiB": t.disk_mib, "desktop": t.desktop, "network": t.network,
            "metadata": t.metadata, "source": t.source, "expiresAt": t.expires_at,
            "lastActiveAt": t.last_active_at, "e2b": t.e2b, "onExpiry": t.on_expiry,
            "autoResume": t.auto_resume, "ttlSeconds": t.ttl_s, "wakeTtlSeconds": t.wake_ttl_s,
            **({"sleepMemory": False} if t.sleep_memory is False else {})}


def parse_template(raw: Any) -> Template:
    """The ``Template`` in ``spec.template``. Raises ``BadRecord`` when a field is missing
    or malformed."""
    t = _checked(_TemplateIn, "sandbox template", raw)
    if t.vcpus is None or t.memoryMiB is None or t.diskMiB is None:
        raise BadRecord("unreadable sandbox template: vcpus, memoryMiB or diskMiB missing")
    return Template(
        image=t.image, image_digest=t.imageDigest or "", engine=t.engine or "",
        accel=t.accel or "", vcpus=t.vcpus, memory_mib=t.memoryMiB, disk_mib=t.diskMiB,
        desktop=t.desktop, network=t.network, metadata=dict(t.metadata or {}),
        source=t.source, expires_at=t.expiresAt, last_active_at=t.lastActiveAt, e2b=t.e2b,
        on_expiry=t.onExpiry.value if t.onExpiry else None, auto_resume=bool(t.autoResume),
        ttl_s=t.ttlSeconds, wake_ttl_s=t.wakeTtlSeconds,
        sleep_memory=False if t.sleepMemory is False else None)
