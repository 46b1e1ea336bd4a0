"""The start gate (issue 33): at most ``HANGAR_MAX_CONCURRENT_STARTS`` VMM starts at once,
the rest queued in FIFO order up to ``HANGAR_START_QUEUE``, one more refused at once with
429 ``start_queue_full``; a client that disconnects while queued starts nothing; the
operator sees the figures in ``/capacity``, ``/metrics`` and ``hangar status``.

The gate's own order (FIFO hand-over, the maximum wait, leaving) is checked on the
gate itself, in this process; the rest on a real server with real VMs (one start slot,
a queue of two, no warm pool)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from conftest import Server, own_server
from hangar.core.starts import StartGate, leave_when
from hangar.errors import LimitExceeded
from team_support import cli, client

WAIT_S = 90.0
"""The test server's ``HANGAR_START_QUEUE_WAIT_S`` (the default)."""


# -- the gate itself ---------------------------------------------------------------------------

def test_the_gate_hands_slots_over_in_arrival_order_and_bounds_the_wait() -> None:
    async def scenario() -> None:
        gate = StartGate(limit=1, queue=3, max_wait_s=0.4)
        order: list[str] = []
        most = 0

        async def start(name: str, hold_s: float) -> None:
            nonlocal most
            async with gate.turn():
                most = max(most, gate.running)
                order.append(name)
                await asyncio.sleep(hold_s)

        first = asyncio.create_task(start("a", 0.1))
        await asyncio.sleep(0)
        rest = [asyncio.create_task(start(n, 0.05)) for n in "bcd"]
        await asyncio.sleep(0)
        assert gate.view().queued == 3
        with pytest.raises(LimitExceeded) as full:  # a fifth: the queue is full
            async with gate.turn():
                pass
        assert full.value.context["limit"] == "start_queue_full"
        assert not gate.try_take()  # the warm pool's way: none free
        await asyncio.gather(first, *rest)
        assert (order, most, gate.running, gate.view().queued) == (list("abcd"), 1, 0, 0)

        # past the maximum wait a start is refused, and the slot it never got stays free
        holder = asyncio.create_task(start("long", 1.0))
        await asyncio.sleep(0)
        with pytest.raises(LimitExceeded) as waited:
            async with gate.turn():
                pass
        assert waited.value.context["limit"] == "start_queue_wait"
        # a client gone while queued leaves at once
        gone = asyncio.Event()
        asyncio.get_running_loop().call_later(0.05, gone.set)
        with leave_when(gone), pytest.raises(LimitExceeded) as left:
            async with gate.turn():
                pass
        assert left.value.context["limit"] == "client_gone"
        await holder
        assert (gate.running, gate.view().queued, gate.refused) == (0, 0, 2)

    asyncio.run(scenario())


def test_a_pool_refill_holding_the_slot_gets_no_client_refused() -> None:
    """The queue holds one more client per refill under way: a burst that finds the only
    slot taken by the warm pool's refill waits for it, as it would have waited behind a
    client's start, instead of the last of it being refused."""
    async def scenario() -> None:
        gate = StartGate(limit=1, queue=2, max_wait_s=5.0)
        assert gate.try_take()  # the pool's refill holds the only slot
        done: list[int] = []

        async def start(i: int) -> None:
            async with gate.turn():
                done.append(i)

        clients = [asyncio.create_task(start(i)) for i in range(3)]
        await asyncio.sleep(0)
        assert (gate.view().queued, gate.refused) == (3, 0)
        with pytest.raises(LimitExceeded) as full:  # a fourth: past the queue and the refill
            async with gate.turn():
                pass
        assert full.value.context["limit"] == "start_queue_full"
        gate.release(refill=True)
        await asyncio.gather(*clients)
        assert (done, gate.running, gate.refilling, gate.refused) == ([0, 1, 2], 0, 0, 1)

    asyncio.run(scenario())


# -- a real server -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(base_image: Path) -> Iterator[Server]:
    with own_server(base_image, {"HANGAR_MAX_CONCURRENT_STARTS": "1",
                                 "HANGAR_START_QUEUE": "2"}) as srv:
        yield srv


@pytest.fixture
def api(server: Server) -> Iterator[httpx.Client]:
    with client(server, server.key) as c:
        try:
            yield c
        finally:
            for sb in c.get("/sandboxes").json()["sandboxes"]:
                c.delete(f"/sandboxes/{sb['id']}")


def starts(api: httpx.Client) -> dict[str, float]:
    r = api.get("/capacity")
    assert r.status_code == 200, r.text
    return dict(r.json()["starts"])


def until(api: httpx.Client, what: str, ok: object, timeout: float = 60.0
          ) -> dict[str, float]:
    """``/capacity``'s ``starts`` once ``ok(starts)`` holds (polled every 20 ms)."""
    deadline = time.monotonic() + timeout
    while True:
        got = starts(api)
        if ok(got):  # type: ignore[operator]
            return got
        assert time.monotonic() < deadline, f"{what}: starts stayed {got}"
        time.sleep(0.02)


def gauges(api: httpx.Client) -> dict[str, float]:
    r = api.get("/metrics")
    assert r.status_code == 200, r.text
    out = {}
    for line in r.text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith(("hangar_start", "hangar_vmm")):
            out[name] = float(value)
    return out


def test_four_creates_at_once_one_runs_two_wait_one_is_refused(server: Server,
                                                               api: httpx.Client) -> None:
    answers: list[httpx.Response] = []

    def create() -> None:
        with client(server, server.key) as c:
            answers.append(c.post("/sandboxes", json={}))

    threads = [threading.Thread(target=create) for _ in range(4)]
    for t in threads:
        t.start()
    busiest = until(api, "one start and two queued, the fourth refused",
                    lambda s: s["queued"] == 2 and s["refused"] == 1)
    assert busiest == {"running": 1, "limit": 1, "queued": 2, "queue": 2,
                       "max_wait_s": WAIT_S, "waited": 2, "refused": 1}
    for t in threads:
        t.join(300)
    refused = [r for r in answers if r.status_code != 201]
    assert (len(answers), len(refused), refused[0].status_code) == (4, 1, 429)
    assert refused[0].headers["retry-after"] == "5"
    assert refused[0].json()["error"] == {
        "code": "limit_exceeded", "message": "every start slot is busy "
        "(HANGAR_MAX_CONCURRENT_STARTS=1) and the start queue is full (HANGAR_START_QUEUE=2 "
        "waiting); retry later", "limit": "start_queue_full", "max_concurrent_starts": 1,
        "start_queue": 2, "queued": 2, "retry_after": 5.0}
    made = {r.json()["id"] for r in answers if r.status_code == 201}
    assert {sb["id"] for sb in api.get("/sandboxes").json()["sandboxes"]} == made
    # the operator sees the limits and what they let through
    g = gauges(api)
    assert {k: g[k] for k in ("hangar_starts_running", "hangar_starts_limit",
                              "hangar_start_queue", "hangar_start_queue_limit",
                              "hangar_vmms", "hangar_vmm_limit",
                              'hangar_start_refusals_total{limit="start_queue_full"}',
                              "hangar_start_wait_seconds_count")} == {
        "hangar_starts_running": 0, "hangar_starts_limit": 1, "hangar_start_queue": 0,
        "hangar_start_queue_limit": 2, "hangar_vmms": 3, "hangar_vmm_limit": 30,
        'hangar_start_refusals_total{limit="start_queue_full"}': 1,
        "hangar_start_wait_seconds_count": 2}
    shown = cli(server.data_dir, "status", url=server.url, key=server.key)
    assert ("limits: 3 of 30 VMs live (sandboxes and the warm pool), 0 of 1 starts in "
            "progress, 0 of 2 queued "
            "(wait at most 90 s; 1 refused since start-up)") in shown.splitlines()


def test_a_client_that_disconnects_while_queued_starts_nothing(server: Server,
                                                               api: httpx.Client) -> None:
    held: list[httpx.Response] = []

    def hold() -> None:  # a cold boot (a size the template is not): seconds of the slot
        with client(server, server.key) as c:
            held.append(c.post("/sandboxes", json={"memory_mib": 384}))

    holder = threading.Thread(target=hold)
    holder.start()
    before = until(api, "the cold boot holds the slot", lambda s: s["running"] == 1)
    body = b"{}"
    with socket.create_connection(("127.0.0.1", server.port)) as raw:
        raw.sendall(b"POST /sandboxes HTTP/1.1\r\nHost: hangar\r\nX-API-Key: "
                    + server.key.encode() + b"\r\nContent-Type: application/json\r\n"
                    b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        until(api, "the second create queued", lambda s: s["queued"] == 1)
    left = until(api, "the gone client's create left the queue", lambda s: s["queued"] == 0)
    assert (left["running"], left["waited"], left["refused"]) == (
        1, before["waited"] + 1, before["refused"])  # the cold boot still runs; no refusal
    holder.join(300)
    assert held[0].status_code == 201, held[0].text
    assert [sb["id"] for sb in api.get("/sandboxes").json()["sandboxes"]] == [
        held[0].json()["id"]]
    assert starts(api)["running"] == 0
    assert "client left the start queue" in (server.data_dir / "server.log").read_text()
