"""The health monitor: one alert when the server goes down, one notice when it is back.

Agent platforms kept this contract with their earlier client: check
``/health`` every 60 s, raise a critical alert after 3 consecutive
failures, and say once when it answers again; nothing in between. Source
of ``hangar/client/_sync/monitor.py`` (``HealthMonitor``, in a thread).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from hangar.client._async._compat import Background, Stop
from hangar.client._async.client import AsyncHangar
from hangar.errors import HangarError

log = logging.getLogger("hangar.client.monitor")

AlertCallback = Callable[[HangarError, int], object]
"""``on_alert(last_error, consecutive_failures)``."""
RecoverCallback = Callable[[float], object]
"""``on_recover(down_for_s)``: seconds since the first failure of the outage."""


class AsyncHealthMonitor:
    """Checks ``client.health()`` every ``interval`` seconds.

    After ``threshold`` consecutive failures it calls ``on_alert`` once and
    logs a CRITICAL line; the next success calls ``on_recover`` once and
    logs a WARNING line. Each check is one attempt (no retries) with a
    timeout of ``timeout`` seconds (default: the client's health timeout,
    10 s). Callbacks run in the monitor's task or thread; an exception in
    one is logged, never raised.

    Start it with ``start()`` and end it with ``stop()``, or use it as a
    context manager; ``check()`` runs one round by hand.
    """

    def __init__(self, client: AsyncHangar, interval: float = 60.0, threshold: int = 3,
                 on_alert: AlertCallback | None = None,
                 on_recover: RecoverCallback | None = None,
                 timeout: float | None = None) -> None:
        if interval <= 0 or threshold < 1:
            raise ValueError("interval must be > 0 seconds and threshold >= 1")
        self.client = client
        self.interval = interval
        self.threshold = threshold
        self.on_alert = on_alert
        self.on_recover = on_recover
        self.timeout = timeout
        self.failures = 0
        """Consecutive failed checks so far."""
        self.alerting = False
        """True between an alert and the recovery."""
        self.last_error: HangarError | None = None
        self._down_since: float | None = None
        self._stop = Stop()
        self._runner: Background | None = None

    async def check(self) -> bool:
        """Run one check and act on it; True when the server answered."""
        try:
            await self.client.health(request_timeout=self.timeout, retry=False)
        except HangarError as exc:
            self._failed(exc)
            return False
        self._answered()
        return True

    def _failed(self, exc: HangarError) -> None:
        self.failures += 1
        self.last_error = exc
        if self._down_since is None:
            self._down_since = time.monotonic()
        if self.failures == self.threshold and not self.alerting:
            self.alerting = True
            log.critical("Hangar at %s is down: %d consecutive health checks failed (last: %s)",
                         self.client.base_url, self.failures, exc.message)
            if self.on_alert is not None:
                try:
                    self.on_alert(exc, self.failures)
                except Exception:
                    log.exception("on_alert failed")

    def _answered(self) -> None:
        down_for = time.monotonic() - self._down_since if self._down_since is not None else 0.0
        was_alerting = self.alerting
        self.failures = 0
        self.alerting = False
        self._down_since = None
        if was_alerting:
            log.warning("Hangar at %s answers again after %.0f s", self.client.base_url, down_for)
            if self.on_recover is not None:
                try:
                    self.on_recover(down_for)
                except Exception:
                    log.exception("on_recover failed")

    async def run(self) -> None:
        """Check every ``interval`` seconds until ``stop()``."""
        while not self._stop.is_set():
            await self.check()
            if await self._stop.wait(self.interval):
                return

    def start(self) -> None:
        """Run the checks in the background (a task, or a daemon thread when blocking)."""
        if self._runner is not None and self._runner.alive():
            return
        self._stop.clear()
        self._runner = Background(self.run, name="hangar-health-monitor")

    async def stop(self) -> None:
        """Stop the background checks and wait for the current one to end."""
        self._stop.set()
        if self._runner is not None:
            await self._runner.join()
            self._runner = None

    async def __aenter__(self) -> AsyncHealthMonitor:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
