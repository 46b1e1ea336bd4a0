"""Live events (``GET /events``, the SDK iterator, ``hangar events``) and the health monitor."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from conftest import SRC, Server, cleanup, free_port, make_data_dir, wait_for
from tcpproxy import TcpProxy

from hangar.client import (
    AsyncHangar, AsyncHealthMonitor, Event, Hangar, HealthMonitor,
)
from hangar.errors import HangarError, InvalidRequest
from hangar.cli.events_view import EventView


def seqs(events: list[Event]) -> list[int]:
    return [int(e.data["seq"]) for e in events]


def test_reconnecting_with_last_event_id_misses_nothing(server: Server) -> None:
    kind = f"agent.test{os.getpid()}"
    with Hangar(server.url, server.key) as h:
        start = h.publish_event(f"{kind}.mark", seq=-1)
        for i in range(3):
            h.publish_event(f"{kind}.step", seq=i)
        first = h.events(kinds=[kind], last_event_id=start.id)
        got = [next(first) for _ in range(3)]
        first.close()  # the client goes away...
        for i in range(3, 8):
            h.publish_event(f"{kind}.step", seq=i)  # ...while these happen
        again = h.events(kinds=[kind], last_event_id=got[-1].id)
        got += [next(again) for _ in range(5)]
        again.close()
    assert seqs(got) == list(range(8))
    assert all(e.kind == f"{kind}.step" and e.time > 0 for e in got)
    # An id of another stream (the server restarted since) replays the whole ring.
    with Hangar(server.url, server.key) as h:
        stream = h.events(kinds=[f"{kind}.mark"], last_event_id="0badc0de:99999")
        assert next(stream).id == start.id
        stream.close()


def test_the_iterator_reconnects_by_itself_after_a_broken_connection(server: Server) -> None:
    kind = f"agent.cut{os.getpid()}"
    proxy = TcpProxy(server.port)
    try:
        with Hangar(server.url, server.key) as direct, Hangar(proxy.url, server.key) as h:
            start = direct.publish_event(f"{kind}.mark", seq=-1)
            for i in range(2):
                direct.publish_event(f"{kind}.step", seq=i)
            stream = h.events(kinds=[f"{kind}.step"], last_event_id=start.id)
            got = [next(stream) for _ in range(2)]
            proxy.cut()
            for i in range(2, 6):
                direct.publish_event(f"{kind}.step", seq=i)
            got += [next(stream) for _ in range(4)]
            stream.close()
        assert seqs(got) == list(range(6))
        assert proxy.connections == 2
    finally:
        proxy.close()


def test_published_events_are_checked(server: Server) -> None:
    with Hangar(server.url, server.key) as h:
        for kind in ("sandbox.created", "agent", "agent.", "Agent.task", "agent.a b"):
            with pytest.raises(InvalidRequest):
                h.publish_event(kind)
        with pytest.raises(InvalidRequest, match="not allowed"):
            h.publish_event("agent.task.started", id="x")
        with pytest.raises(InvalidRequest, match="bytes"):
            h.publish_event("agent.task.started", blob="x" * 20000)
        ev = h.publish_event("agent.task.started", "sb-000000000000", task_id="t", usage={"a": 1})
        assert ev.kind == "agent.task.started" and ev.sandbox_id == "sb-000000000000"
        assert ev.data == {"task_id": "t", "usage": {"a": 1}}
    for method in ("GET", "POST"):
        r = httpx.request(method, server.url + "/events", json={"kind": "agent.x"}, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"


def test_the_view_renders_agent_tasks_like_the_chat() -> None:
    view = EventView()
    t0 = 1_700_000_000.0

    def ev(n: int, kind: str, **data: object) -> Event:
        return Event(id=f"s:{n}", time=t0 + n, kind=kind, sandbox_id="sb-a3f2c0ffee00",
                     data=dict(data))

    line = view.line(ev(1, "agent.task.started", task_id="t1", name="Test Runner", tier="vm",
                        sandbox_id="sb-a3f2c0ffee00", vcpus=2, memory_mib=2048, source="pool"))
    assert line.endswith("Test Runner (vm)  started (pool), VM sb-a3f2…, 2 vCPU, 2 GB")
    assert view.line(ev(2, "agent.tool.started", task_id="t1", tool="bash",
                        summary="yarn test")).endswith("Test Runner (vm)  running: yarn test")
    assert view.blocks(now=t0 + 14) == [
        "Test Runner (vm) running: yarn test (12 s elapsed), VM sb-a3f2…, 2 vCPU, 2 GB"]
    assert view.line(ev(20, "agent.tool.finished", task_id="t1", tool="bash", duration_s=18,
                        ok=False)).endswith("Test Runner (vm)  bash failed in 18.00 s")
    assert view.line(ev(21, "agent.task.ended", task_id="t1",
                        reason="completed")).endswith("Test Runner (vm)  ended: completed")
    assert view.blocks() == []
    view.line(ev(30, "exec.started", exec_id="ex-1", command="make"))
    assert view.blocks(now=t0 + 33) == ["sb-a3f2c0ffee00 exec 'make' running 3 s"]
    assert view.line(ev(34, "exec.finished", exec_id="ex-1", exit_code=2, duration_s=4.0,
                        timed_out=False)).endswith("exec 'make' finished: exit 2 in 4.00 s")


@pytest.mark.vm
def test_hangar_events_shows_what_another_process_does(server: Server) -> None:
    env = {**os.environ, "HANGAR_URL": server.url, "HANGAR_API_KEY": server.key,
           "PYTHONPATH": str(SRC), "COLUMNS": "200"}
    # Started as a terminal's foreground job is, with SIGINT at its default: a suite started
    # in the background by a non-interactive shell (`scripts/test.sh &`) ignores SIGINT, and
    # so, inherited, would the CLI (POSIX), which Ctrl-C could then not stop.
    cli = subprocess.Popen([sys.executable, "-m", "hangar.cli", "events"], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines: list[tuple[float, str]] = []

    def read() -> None:
        assert cli.stdout is not None
        for line in cli.stdout:
            lines.append((time.monotonic(), line.rstrip("\n")))

    threading.Thread(target=read, daemon=True).start()

    def seen(*parts: str) -> float | None:
        for t, line in list(lines):
            if all(p in line for p in parts):
                return t
        return None

    sid = None
    try:
        with Hangar(server.url, server.key) as h:
            ping = f"agent.ping{os.getpid()}"
            deadline = time.monotonic() + 60
            while seen(ping) is None:  # until the CLI listens
                assert time.monotonic() < deadline and cli.poll() is None, cli.stderr
                h.publish_event(ping)
                time.sleep(0.3)
            sb = h.create()
            sid = sb.id
            created = time.monotonic()
            r = h.exec(sid, "echo x; exit 3")
            finished = time.monotonic()
            assert r.exit_code == 3
            h.publish_event("agent.task.started", sid, task_id="t1", name="Test Runner",
                            tier="vm", vcpus=1, memory_mib=512)
            h.delete(sid)
            deleted = time.monotonic()
            sid = None
            wait_for(lambda: seen(sb.id, "deleted"), 5, "the delete line")
        for done, parts in ((created, (sb.id, "created (base")),
                            (finished, (sb.id, "exec finished: exit 3 in")),
                            (deleted, (sb.id, "deleted"))):
            t = seen(*parts)
            assert t is not None and t - done < 1.0, (parts, lines)
        assert seen("Test Runner (vm)", "started, VM sb-", "1 vCPU, 512 MB")
    finally:
        if sid is not None:
            Hangar(server.url, server.key).delete(sid)
        cli.send_signal(signal.SIGINT)
        try:
            cli.wait(15)
        except subprocess.TimeoutExpired:
            cli.kill()
            cli.wait()
    assert cli.returncode == 0, cli.stderr.read() if cli.stderr else ""


@pytest.fixture(scope="module")
def own_server(base_image: Path) -> Iterator[Server]:
    """A server of this module's own, which the test stops and starts again."""
    d = make_data_dir(base_image)
    srv = Server(d, free_port())
    srv.start()
    yield srv
    leaked = cleanup(srv)
    shutil.rmtree(d, ignore_errors=True)
    assert not leaked


def test_health_monitor_alerts_once_and_recovers_once(own_server: Server,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    alerts: list[tuple[str, int]] = []
    recoveries: list[tuple[str, float]] = []
    checks: list[int] = []

    def on_alert(who: str) -> Callable[[HangarError, int], None]:
        return lambda err, failures: alerts.append((who, failures))

    def on_recover(who: str) -> Callable[[float], None]:
        return lambda down_s: recoveries.append((who, down_s))

    stop_async = threading.Event()

    async def run_async() -> None:
        async with AsyncHangar(own_server.url, own_server.key) as ah:
            async with AsyncHealthMonitor(ah, interval=0.2, threshold=3,
                                          on_alert=on_alert("async"),
                                          on_recover=on_recover("async")):
                while not stop_async.is_set():
                    await asyncio.sleep(0.05)

    async_thread = threading.Thread(target=asyncio.run, args=(run_async(),))
    caplog.set_level(logging.WARNING, logger="hangar.client.monitor")
    with Hangar(own_server.url, own_server.key) as h:
        mon = HealthMonitor(h, interval=0.2, threshold=3, on_alert=on_alert("sync"),
                            on_recover=on_recover("sync"))
        real_check = mon.check

        def counted() -> bool:
            ok = real_check()
            checks.append(mon.failures)
            return ok

        mon.check = counted  # type: ignore[method-assign]
        async_thread.start()
        with mon:
            wait_for(lambda: len(checks) >= 3, 5, "healthy checks")
            assert alerts == [] and set(checks) == {0}
            own_server.kill()
            wait_for(lambda: len(alerts) == 2, 10, "both alerts")
            assert sorted(alerts) == [("async", 3), ("sync", 3)]
            time.sleep(1.0)  # more failures: no second alert
            assert mon.failures >= 6 and len(alerts) == 2
            own_server.start()
            wait_for(lambda: len(recoveries) == 2, 60, "both recoveries")
            time.sleep(0.6)
        stop_async.set()
        async_thread.join(20)
    assert len(alerts) == 2 and sorted(r[0] for r in recoveries) == ["async", "sync"]
    assert all(down_s >= 1.0 for _, down_s in recoveries)
    critical = [r for r in caplog.records if r.levelno == logging.CRITICAL]
    back = [r for r in caplog.records if "answers again" in r.getMessage()]
    assert len(critical) == 2 and len(back) == 2
    assert "3 consecutive health checks failed" in critical[0].getMessage()
