"""Host memory against real servers and VMs (issue 33): sandboxes may declare the budget ×
``HANGAR_MEMORY_OVERCOMMIT``, and below the headroom idle sandboxes are put to sleep, oldest
idle first and losing nothing, before a start is refused with 429.

The host's ``MemAvailable`` is read from a file the test writes
(``HANGAR_TEST_MEMINFO``, in ``/proc/meminfo``'s format): this machine's 24 GiB cannot be
brought below a headroom on demand, and the figure must not move under the test."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from conftest import Server, make_data_dir, own_server
from team_support import client

IDLE_S = 6.0
"""The test server's ``HANGAR_MEMORY_PRESSURE_IDLE_S``."""
HEADROOM_MIB = 1000


def set_available(path: Path, mib: int) -> None:
    """Write ``MemAvailable`` (and a 24 GiB ``MemTotal``) as ``/proc/meminfo`` has them."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"MemTotal: {24 << 20} kB\nMemAvailable: {mib << 10} kB\n")
    tmp.chmod(0o644)
    os.replace(tmp, path)


@pytest.fixture(scope="module")
def server(base_image: Path) -> Iterator[Server]:
    d = make_data_dir(base_image)
    meminfo = d / "meminfo"
    set_available(meminfo, 8000)
    with own_server(base_image, {
            "HANGAR_TEST_MEMINFO": str(meminfo), "HANGAR_MEMORY_HEADROOM_MIB": str(HEADROOM_MIB),
            "HANGAR_MEMORY_PRESSURE_IDLE_S": str(IDLE_S), "HANGAR_MEMORY_BUDGET_MIB": "512",
            "HANGAR_MEMORY_OVERCOMMIT": "2", "HANGAR_DEFAULT_MEMORY_MIB": "256"},
            data_dir=d) as srv:
        yield srv


@pytest.fixture
def api(server: Server) -> Iterator[httpx.Client]:
    with client(server, server.key) as c:
        try:
            yield c
        finally:
            set_available(server.data_dir / "meminfo", 8000)
            for sb in c.get("/sandboxes").json()["sandboxes"]:
                c.delete(f"/sandboxes/{sb['id']}")


def made(api: httpx.Client) -> str:
    r = api.post("/sandboxes", json={})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def state(api: httpx.Client, sid: str) -> str:
    r = api.get(f"/sandboxes/{sid}")
    assert r.status_code == 200, r.text
    return str(r.json()["state"])


def test_guests_may_declare_the_budget_times_the_overcommit(api: httpx.Client) -> None:
    ids = [made(api) for _ in range(4)]  # 4 × 256 MiB = 512 MiB × 2
    r = api.post("/sandboxes", json={})
    assert (r.status_code, r.json()["error"]) == (429, {
        "code": "limit_exceeded", "message": "the host memory budget is 512 MiB "
        "(HANGAR_MEMORY_BUDGET_MIB) × 2 (HANGAR_MEMORY_OVERCOMMIT) = 1024 MiB and running "
        "sandboxes hold 1024 MiB; this one needs 256 MiB", "limit": "memory_budget_mib",
        "budget_mib": 512, "overcommit": 2.0, "used_mib": 1024, "needed_mib": 256,
        "retry_after": 5.0})
    mem = api.get("/capacity").json()["memory"]
    assert (mem["declared_mib"], mem["allowed_mib"], mem["budget_mib"], mem["overcommit"],
            mem["available_mib"], mem["headroom_mib"]) == (1024, 1024, 512, 2.0, 8000, 1000)
    assert 4 * 20 < mem["used_mib"] < 4 * 256 + 4 * 200  # the VMMs' resident sets
    assert len(ids) == 4


def test_below_the_headroom_the_oldest_idle_sandbox_sleeps_and_loses_nothing(
        server: Server, api: httpx.Client) -> None:
    old, busy = made(api), made(api)
    r = api.put(f"/sandboxes/{old}/files", params={"path": "/root/keep"}, content=b"kept\n")
    assert r.status_code == 200, r.text
    meminfo = server.data_dir / "meminfo"
    # both used just now: nothing idle to put to sleep, so a create is refused at once
    assert api.post(f"/sandboxes/{busy}/exec", json={"command": "true"}).status_code == 200
    set_available(meminfo, HEADROOM_MIB - 50)
    r = api.post("/sandboxes", json={})
    assert (r.status_code, r.json()["error"]) == (429, {
        "code": "limit_exceeded", "message": f"host memory is low: {HEADROOM_MIB - 50} MiB "
        f"available and {HEADROOM_MIB} MiB are kept (HANGAR_MEMORY_HEADROOM_MIB); no idle "
        "sandbox is left to put to sleep", "limit": "host_memory_low",
        "available_mib": HEADROOM_MIB - 50, "headroom_mib": HEADROOM_MIB, "needed_mib": 100,
        "retry_after": 5.0})
    assert r.headers["retry-after"] == "5"
    # the busy one keeps being used; the old one goes idle and is put to sleep
    deadline = time.monotonic() + IDLE_S + 60
    while state(api, old) != "sleeping":
        assert time.monotonic() < deadline, state(api, old)
        assert api.post(f"/sandboxes/{busy}/exec", json={"command": "true"}).status_code == 200
        time.sleep(1)
    assert state(api, busy) == "running"
    assert api.get("/capacity").json()["memory"]["slept"] == 1
    assert "hangar_memory_sleeps_total 1.0" in api.get("/metrics").text.splitlines()
    set_available(meminfo, 8000)
    r = api.post(f"/sandboxes/{old}/exec", json={"command": "cat", "args": ["/root/keep"]})
    assert (r.status_code, r.json()["stdout"]) == (200, "kept\n")  # woken by the call
    assert state(api, old) == "running"
