"""What the cluster keeps in etcd: keys and record shapes.

Every key lives under ``/hangar/``::

    /hangar/config                 ClusterConfig (JSON), written by ``hangar cluster init``
    /hangar/nodes/<name>           NodeInfo, under the node's lease (gone when it expires)
    /hangar/drain/<name>           present while the node is drained (no lease)
    /hangar/leader                 the node whose reconciler handles dead nodes (under its lease)
    /hangar/sandboxes/<id>         SandboxObject: owner, epoch, state, last snapshot
    /hangar/machines/<user>        {"sandboxId": ..., "idleTimeoutSeconds": ..., "createdAt": ...}
    /hangar/snapshots/<id>         a user snapshot in shared storage (forks on any node)
    /hangar/slots/<node>/<k>       one of the node's ``capacity`` VM slots, value: a sandbox id

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

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from hangar.core.handover import Template
from hangar.core.lifecycle import (
    VMM_STATES, Guard, State, check, check_desired, walk,
)

ROOT = "/hangar/"
CONFIG = ROOT + "config"
NODES = ROOT + "nodes/"
DRAIN = ROOT + "drain/"
LEADER = ROOT + "leader"
SANDBOXES = ROOT + "sandboxes/"
MACHINES = ROOT + "machines/"
SNAPSHOTS = ROOT + "snapshots/"
SLOTS = ROOT + "slots/"

API_VERSION = "hangar.dev/v1alpha1"

VMM_HOLDING: frozenset[State] = VMM_STATES - {State.POOLED}
"""States whose sandbox holds a VM slot (pool VMs have no cluster record)."""


class BadRecord(ValueError):
    """A record in etcd that does not parse: an unknown state, a malformed field."""


def node_key(name: str) -> str:
    return NODES + name


def sandbox_key(sid: str) -> str:
    return SANDBOXES + sid


def machine_key(user: str) -> str:
    return MACHINES + user


def snapshot_key(snap_id: str) -> str:
    return SNAPSHOTS + snap_id


def slot_key(node: str, k: int) -> str:
    return f"{SLOTS}{node}/{k}"


def iso(t: float | None) -> str | None:
    """Unix seconds as RFC 3339 UTC, or None."""
    return None if t is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


@dataclass
class ClusterConfig:
    """Settings every node shares (``/hangar/config``).

    ``store`` is the shared snapshot storage (``s3://bucket/prefix`` or
    ``file:///path``); ``key_hashes`` the SHA-256 (hex) of the API keys
    every node accepts; ``node_token`` authenticates nodes to each other
    (forwarded placements, adoptions); ``lease_ttl_s`` the nodes' lease;
    ``failover_after_s`` how long after a node's lease expired its
    sandboxes are declared failed.
    """

    store: str
    key_hashes: list[str]
    node_token: str
    lease_ttl_s: int = 5
    failover_after_s: float = 3.0
    created_at: float = field(default_factory=time.time)

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> "ClusterConfig":
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in raw.items() if k in known})

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class NodeInfo:
    """A node as it states itself (``/hangar/nodes/<name>``), refreshed every few seconds."""

    name: str
    address: str
    """``host:port`` other nodes forward requests to."""
    capacity: int
    """VM slots (its ``HANGAR_MAX_SANDBOXES``)."""
    free: int
    engine: str
    accel: str
    cpu_model: str
    images: list[str]
    memory_free_mib: int = 0
    pool: int = 0
    """Warm-pool VMs ready."""
    draining: bool = False
    started_at: float = field(default_factory=time.time)
    version: str = ""

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> "NodeInfo":
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in raw.items() if k in known})

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def url(self) -> str:
        return f"http://{self.address}"


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
        return State.SLEEPING if self.spec.get("operatingMode") == "Suspended" else State.RUNNING

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
        self.spec["operatingMode"] = "Suspended" if desired == State.SLEEPING else "Running"

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
        return self.labels.get("hangar.dev/user")

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
    def parse(cls, raw: Any, mod_revision: int = 0) -> "SandboxObject":
        """A record as read from etcd. Raises ``BadRecord`` naming what is wrong."""
        try:
            if not isinstance(raw, dict):
                raise ValueError("not an object")
            meta = raw.get("metadata") or {}
            status = dict(raw.get("status") or {})
            status.pop("conditions", None)
            rec = cls(name=str(meta.get("name", "")), spec=dict(raw.get("spec") or {}),
                      status=status, labels=dict(meta.get("labels") or {}),
                      created_at=float(meta.get("createdAt") or time.time()),
                      mod_revision=mod_revision)
            state = status.get("state")
            if state not in State._value2member_map_:
                raise ValueError(f"state {str(state)[:40]!r} is not a sandbox state")
            rec.desired, rec.epoch, rec.slot  # noqa: B018 (each raises on a malformed value)
            node = status.get("nodeName")
            if node is not None and not isinstance(node, str):
                raise ValueError("nodeName is not a string")
            if not isinstance(rec.spec.get("template") or {}, dict):
                raise ValueError("spec.template is not an object")
            if rec.snapshot is not None and not (isinstance(rec.snapshot, dict)
                                                 and isinstance(rec.snapshot.get("id"), str)):
                raise ValueError("snapshot has no id")
        except (TypeError, ValueError, AttributeError) as exc:
            raise BadRecord(f"unreadable sandbox record: {exc}") from None
        return rec


def template_json(t: Template) -> dict[str, Any]:
    """``spec.template`` of a record: what another node needs to recreate the sandbox."""
    return {"image": t.image, "imageDigest": t.image_digest, "engine": t.engine,
            "accel": t.accel, "vcpus": t.vcpus, "memoryMiB": t.memory_mib,
            "diskMiB": t.disk_mib, "desktop": t.desktop, "network": t.network,
            "metadata": t.metadata, "source": t.source, "expiresAt": t.expires_at,
            "lastActiveAt": t.last_active_at, "e2b": t.e2b}


def parse_template(raw: Any) -> Template:
    """The ``Template`` in ``spec.template``. Raises ``BadRecord`` when a field is missing
    or malformed."""
    try:
        if not isinstance(raw, dict):
            raise ValueError("no template")
        expires = raw.get("expiresAt")
        active = raw.get("lastActiveAt")
        network = raw.get("network")
        metadata = raw.get("metadata") or {}
        if not isinstance(metadata, dict) or not (network is None or isinstance(network, dict)):
            raise ValueError("metadata or network is not an object")
        e2b = raw.get("e2b")
        if e2b is not None and not isinstance(e2b, dict):
            raise ValueError("e2b is not an object")
        return Template(
            image=str(raw["image"]), image_digest=str(raw.get("imageDigest") or ""),
            engine=str(raw.get("engine") or ""), accel=str(raw.get("accel") or ""),
            vcpus=int(raw["vcpus"]), memory_mib=int(raw["memoryMiB"]),
            disk_mib=int(raw["diskMiB"]),
            desktop=None if raw.get("desktop") is None else str(raw["desktop"]),
            network=network, metadata=dict(metadata),
            source=None if raw.get("source") is None else str(raw["source"]),
            expires_at=None if expires is None else float(expires),
            last_active_at=None if active is None else float(active), e2b=e2b)
    except (KeyError, TypeError, ValueError) as exc:
        raise BadRecord(f"unreadable sandbox template: {exc!r}") from None

