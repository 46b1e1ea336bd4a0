"""Prometheus metrics (prometheus-client), one registry per server.

Names and units follow Prometheus conventions: durations in seconds,
counters end in ``_total``. Labels take a few fixed values only (never an
id), so the number of series stays bounded:

``hangar_sandbox_create_seconds{source, outcome}``  source: template, pool, cold, fork;
                                                    outcome: ok, failed
``hangar_exec_seconds{outcome}``                    ok, error, timed_out
``hangar_snapshot_seconds{kind, outcome}``          kind: user, sleep
``hangar_restore_seconds{outcome}``                 restore in place
``hangar_wake_seconds{outcome}``                    wake from sleep
``hangar_boot_phase_seconds{phase}``                vmm, kernel, initramfs, init, agent,
                                                    total (``hangar.engines.boot_phases``)
``hangar_pool_hits_total``, ``hangar_pool_misses_total``: creates that fit the
warm pool and got, or did not get, a ready VM; ``hangar_pool_refills_total``.
``hangar_errors_total{code}``                       error answers by Hangar's error
                                                    code (a fixed set: hangar.errors)
``hangar_egress_denied_total{via, reason}``         via: dns, proxy; reason: one of
                                                    hangar.net.egress_match.REASONS

``hangar_start_wait_seconds``                      time a start waited in the start queue
``hangar_start_refusals_total{limit}``              start_queue_full, start_queue_wait

Gauges read at each scrape (``watch_capacity``): the VMMs running against
their cap, starts in progress and queued against theirs, guest memory committed against the budget, the warm pool's
ready VMs against its target per template, and the data directory's free
bytes. docs/metrics.md documents every metric.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, Info
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _StateCollector(Collector):
    def __init__(self, counts: Callable[[], dict[str, int]]) -> None:
        self._counts = counts

    def collect(self) -> Iterable[GaugeMetricFamily]:
        g = GaugeMetricFamily("hangar_sandboxes", "Sandboxes by state", labels=["state"])
        for state, n in sorted(self._counts().items()):
            g.add_metric([state], n)
        yield g


class _TeamCollector(Collector):
    """Per-team gauges: ``read()`` gives ``{team: (sandboxes, vCPUs, memory MiB)}``."""

    def __init__(self, read: Callable[[], dict[str, tuple[int, int, int]]]) -> None:
        self._read = read

    def collect(self) -> Iterable[GaugeMetricFamily]:
        n = GaugeMetricFamily("hangar_team_sandboxes", "A team's sandboxes holding a VMM",
                              labels=["team"])
        cpu = GaugeMetricFamily("hangar_team_vcpus", "Their vCPUs", labels=["team"])
        mem = GaugeMetricFamily("hangar_team_memory_bytes", "Their guest memory",
                                labels=["team"])
        for team, (sandboxes, vcpus, memory_mib) in sorted(self._read().items()):
            n.add_metric([team], sandboxes)
            cpu.add_metric([team], vcpus)
            mem.add_metric([team], memory_mib << 20)
        yield n
        yield cpu
        yield mem


class _CapacityCollector(Collector):
    """Gauges from one ``Capacity`` snapshot per scrape."""

    def __init__(self, read: Callable[[], Capacity]) -> None:
        self._read = read

    def collect(self) -> Iterable[GaugeMetricFamily]:
        c = self._read()
        yield GaugeMetricFamily("hangar_vmms", "VMMs that may be running (pool included)",
                                value=c.vmms)
        yield GaugeMetricFamily("hangar_vmm_limit", "Cap on VMMs (HANGAR_MAX_SANDBOXES)",
                                value=c.vmm_limit)
        yield GaugeMetricFamily("hangar_guest_memory_committed_bytes",
                                "Guest memory of every sandbox that may hold a VMM",
                                value=c.memory_committed_mib * 2**20)
        yield GaugeMetricFamily("hangar_guest_memory_budget_bytes",
                                "Host memory budget for guests (HANGAR_MEMORY_BUDGET_MIB)",
                                value=c.memory_budget_mib * 2**20)
        yield GaugeMetricFamily("hangar_guest_memory_allowed_bytes",
                                "Guest memory sandboxes may declare together: the budget × "
                                "HANGAR_MEMORY_OVERCOMMIT", value=c.memory_allowed_mib * 2**20)
        yield GaugeMetricFamily("hangar_vmm_resident_bytes",
                                "Host memory the VMMs hold (their resident sets)",
                                value=c.memory_used_mib * 2**20)
        yield GaugeMetricFamily("hangar_host_memory_available_bytes",
                                "The host's MemAvailable", value=c.host_available_mib * 2**20)
        yield GaugeMetricFamily("hangar_host_memory_headroom_bytes",
                                "Host memory kept available (HANGAR_MEMORY_HEADROOM_MIB)",
                                value=c.headroom_mib * 2**20)
        ready = GaugeMetricFamily("hangar_pool_ready", "Warm-pool VMs ready to be taken",
                                  labels=["template"])
        target = GaugeMetricFamily("hangar_pool_target", "Warm-pool VMs wanted",
                                   labels=["template"])
        for name, want in sorted(c.pool_target.items()):
            target.add_metric([name], want)
            ready.add_metric([name], c.pool_ready.get(name, 0))
        yield ready
        yield target
        yield GaugeMetricFamily("hangar_starts_running",
                                "VMM starts (boots, restores, wakes) in progress",
                                value=c.starts_running)
        yield GaugeMetricFamily("hangar_starts_limit",
                                "Cap on starts in progress (HANGAR_MAX_CONCURRENT_STARTS)",
                                value=c.starts_limit)
        yield GaugeMetricFamily("hangar_start_queue", "Starts waiting for a start slot",
                                value=c.start_queued)
        yield GaugeMetricFamily("hangar_start_queue_limit",
                                "Starts that may wait at once (HANGAR_START_QUEUE)",
                                value=c.start_queue_limit)
        yield GaugeMetricFamily("hangar_data_free_bytes",
                                "Free bytes on the data directory's file system",
                                value=c.data_free_bytes)


@dataclass(frozen=True)
class Capacity:
    """What the capacity gauges show; memory in MiB, disk in bytes."""

    vmms: int
    vmm_limit: int
    memory_committed_mib: int
    memory_budget_mib: int
    pool_ready: dict[str, int]
    pool_target: dict[str, int]
    data_free_bytes: int
    memory_allowed_mib: int = 0
    memory_used_mib: int = 0
    host_available_mib: int = 0
    headroom_mib: int = 0
    starts_running: int = 0
    starts_limit: int = 0
    start_queued: int = 0
    start_queue_limit: int = 0


class Metrics:
    """The server's metrics; ``registry`` is what /metrics renders."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.creates = Counter("hangar_sandbox_creates_total", "Sandbox creates by outcome",
                               ["outcome"], registry=r)
        self.memory_sleeps = Counter("hangar_memory_sleeps_total",
                                     "Idle sandboxes put to sleep because host memory was low",
                                     registry=r)
        self.create_seconds = Histogram("hangar_sandbox_create_seconds",
                                        "Time from create request to a ready guest agent",
                                        ["source", "outcome"], buckets=LATENCY_BUCKETS,
                                        registry=r)
        self.start_wait_seconds = Histogram(
            "hangar_start_wait_seconds", "Time a start waited in the start queue "
            "(hangar.core.starts); starts that found a free slot are not counted",
            buckets=LATENCY_BUCKETS, registry=r)
        self.start_refusals = Counter(
            "hangar_start_refusals_total", "Starts refused by the start queue, by limit: "
            "start_queue_full, start_queue_wait", ["limit"], registry=r)
        self.execs = Counter("hangar_exec_total", "Commands run in sandboxes", ["outcome"],
                             registry=r)
        self.exec_seconds = Histogram("hangar_exec_seconds", "Exec latency, request to result",
                                      ["outcome"], buckets=LATENCY_BUCKETS, registry=r)
        self.snapshot_seconds = Histogram("hangar_snapshot_seconds",
                                          "Time to pause and save a sandbox",
                                          ["kind", "outcome"], buckets=LATENCY_BUCKETS,
                                          registry=r)
        self.restore_seconds = Histogram("hangar_restore_seconds",
                                         "Time to restore a sandbox in place from a snapshot",
                                         ["outcome"], buckets=LATENCY_BUCKETS, registry=r)
        self.wake_seconds = Histogram("hangar_wake_seconds",
                                      "Time to wake a sleeping sandbox (lock wait included)",
                                      ["outcome"], buckets=LATENCY_BUCKETS, registry=r)
        self.boot_phase_seconds = Histogram(
            "hangar_boot_phase_seconds", "Phases of cold boots (hangar.engines.boot_phases)",
            ["phase"], buckets=LATENCY_BUCKETS, registry=r)
        self.boot_stalls = Counter(
            "hangar_boot_stalls_total", "Cold boots given up because their guest could never "
            "finish booting (hangar.errors.BootStalled); each is booted again", registry=r)
        self.pool_hits = Counter("hangar_pool_hits_total",
                                 "Creates served by a warm-pool VM", registry=r)
        self.pool_misses = Counter("hangar_pool_misses_total",
                                   "Creates that fit the warm pool but found no VM ready",
                                   registry=r)
        self.pool_refills = Counter("hangar_pool_refills_total",
                                    "Warm-pool VMs booted and made ready", registry=r)
        self.unresponsive = Counter("hangar_guest_unresponsive_total",
                                    "Sandboxes marked unresponsive: a guest call's deadline "
                                    "passed unanswered", registry=r)
        self.errors = Counter("hangar_errors_total", "Error answers by Hangar's error code",
                              ["code"], registry=r)
        self.egress_denied = Counter(
            "hangar_egress_denied_total", "Guest connections and DNS queries refused by egress "
            "rules (hangar.net.egress)", ["via", "reason"], registry=r)
        self.engine = Info("hangar_engine", "VMM engine in use", registry=r)

    def watch_states(self, counts: Callable[[], dict[str, int]]) -> None:
        """Report ``hangar_sandboxes{state=...}`` from ``counts()`` at each scrape."""
        self.registry.register(_StateCollector(counts))

    def watch_teams(self, read: Callable[[], dict[str, tuple[int, int, int]]]) -> None:
        """Report ``hangar_team_sandboxes``, ``_vcpus`` and ``_memory_bytes`` (label
        ``team``) from ``read()`` at each scrape: ``{team: (sandboxes, vCPUs, MiB)}``."""
        self.registry.register(_TeamCollector(read))

    def watch_capacity(self, read: Callable[[], Capacity]) -> None:
        """Report the capacity gauges (see ``Capacity``) from ``read()`` at each scrape."""
        self.registry.register(_CapacityCollector(read))
