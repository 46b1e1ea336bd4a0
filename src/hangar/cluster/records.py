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
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

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

VMM_HOLDING = frozenset({"creating", "running", "unresponsive", "snapshotting", "waking",
                         "restoring", "stopping"})
"""States whose sandbox holds a VM slot."""


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
    def state(self) -> str:
        return str(self.status.get("state", "creating"))

    @property
    def slot(self) -> int | None:
        s = self.status.get("slot")
        return None if s is None else int(s)

    @property
    def snapshot(self) -> dict[str, Any] | None:
        """The last snapshot in shared storage a machine can go back to, or None."""
        return self.status.get("snapshot")

    @property
    def user(self) -> str | None:
        return self.labels.get("hangar.dev/user")

    def to_json(self) -> dict[str, Any]:
        ready = self.state == "running"
        return {
            "apiVersion": API_VERSION, "kind": "Sandbox",
            "metadata": {"name": self.name, "labels": self.labels,
                         "creationTimestamp": iso(self.created_at),
                         "createdAt": self.created_at},
            "spec": self.spec,
            "status": {**self.status, "conditions": [{
                "type": "Ready", "status": "True" if ready else "False",
                "reason": self.state, "lastTransitionTime": iso(time.time())}]},
        }

    @classmethod
    def parse(cls, raw: dict[str, Any], mod_revision: int = 0) -> "SandboxObject":
        meta = raw.get("metadata") or {}
        status = dict(raw.get("status") or {})
        status.pop("conditions", None)
        return cls(name=meta.get("name", ""), spec=dict(raw.get("spec") or {}), status=status,
                   labels=dict(meta.get("labels") or {}),
                   created_at=float(meta.get("createdAt") or time.time()),
                   mod_revision=mod_revision)
