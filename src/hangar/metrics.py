"""Prometheus metrics (prometheus-client), one registry per server.

Names and units follow Prometheus conventions: durations in seconds,
counters end in ``_total``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

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


class Metrics:
    """The server's metrics; ``registry`` is what /metrics renders."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.creates = Counter("hangar_sandbox_creates_total", "Sandbox creates by outcome",
                               ["outcome"], registry=r)
        self.create_seconds = Histogram("hangar_sandbox_create_seconds",
                                        "Time from create request to a ready guest agent",
                                        buckets=LATENCY_BUCKETS, registry=r)
        self.execs = Counter("hangar_exec_total", "Commands run in sandboxes", ["outcome"],
                             registry=r)
        self.exec_seconds = Histogram("hangar_exec_seconds", "Exec latency, request to result",
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.engine = Info("hangar_engine", "VMM engine in use", registry=r)

    def watch_states(self, counts: Callable[[], dict[str, int]]) -> None:
        """Report ``hangar_sandboxes{state=...}`` from ``counts()`` at each scrape."""
        self.registry.register(_StateCollector(counts))
