"""Placement: which nodes a new sandbox, a fork or a wake should go to, best first.

Hangar's own policy, as E2B keeps its own on top of Nomad. A node is a
candidate when it is alive, not drained and runs the engine (and, for a
snapshot, the accelerator and CPU model) the sandbox needs: a QEMU
migration stream restores only under the same ``-cpu``/``-accel``
arguments, so a snapshot made under KVM on one CPU model is not offered to
another. Candidates are scored (higher is better)::

    free slots            10 points each (spreads load)
    free memory           1 point per GiB, at most 16
    warm-pool VMs         5 points each when the template is pooled there
    image present         20 points (no download before the boot)
    the snapshot's node   15 points (a wake there downloads nothing)
    the receiving node    3 points (no forwarding hop on a tie)

The gateway tries the first few in order; the slot claim (a
compare-and-set per slot) decides, so a stale score costs one retry, never
an overshoot.
"""

from __future__ import annotations

from dataclasses import dataclass

from hangar.cluster.records import NodeInfo

TRIES = 3
"""Candidates a placement tries before answering 429."""


@dataclass(frozen=True)
class Need:
    """What a sandbox needs of a node."""

    image_id: str | None = None
    """``<name>-<digest>`` when pinned (wake, fork), or None (a create: the node's current
    build)."""
    image_name: str | None = None
    engine: str | None = None
    accel: str | None = None
    cpu_model: str | None = None
    prefer: str | None = None
    """The node that already holds the snapshot's files."""


def score(node: NodeInfo, need: Need, here: str | None = None) -> float:
    s = 10.0 * max(0, node.free) + min(16, node.memory_free_mib // 1024)
    if need.image_id and need.image_id in node.images:
        s += 20
    elif need.image_name and any(i.startswith(need.image_name + "-") for i in node.images):
        s += 20
    if node.pool:
        s += 5 * node.pool
    if need.prefer and node.name == need.prefer:
        s += 15
    if here and node.name == here:
        s += 3
    return s


def compatible(node: NodeInfo, need: Need) -> bool:
    if need.engine and node.engine != need.engine:
        return False
    if need.accel and need.accel == "kvm" and node.accel != "kvm":
        return False
    if need.accel == "kvm" and need.cpu_model and node.cpu_model != need.cpu_model:
        return False
    return True


def rank(nodes: list[NodeInfo], need: Need, here: str | None = None,
         limit: int = TRIES) -> list[NodeInfo]:
    """The best ``limit`` candidates among ``nodes`` (alive, not drained: the caller's
    filter), best first; nodes without a free slot last."""
    ok = [n for n in nodes if compatible(n, need)]
    ok.sort(key=lambda n: (n.free > 0, score(n, need, here)), reverse=True)
    return ok[:limit]
