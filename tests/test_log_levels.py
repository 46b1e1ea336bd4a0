"""Logs that can carry alerts, read from a real server's log: ERROR means the server is at
fault, once per fault; what clients and guests do is INFO (hangar.api.errors, hangar.log,
hangar.api.http_limits)."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import websockets

from conftest import Server, own_server


@pytest.fixture(scope="module")
def srv(base_image: Path) -> Iterator[Server]:
    with own_server(base_image) as s:
        yield s


def lines_after(server: Server, offset: int) -> list[dict[str, object]]:
    out = []
    with open(server.log, "rb") as f:
        f.seek(offset)
        for raw in f.read().splitlines():
            try:
                out.append(json.loads(raw))
            except ValueError:
                out.append({"level": "raw", "event": raw.decode("latin-1")})
    return out


def loud(lines: list[dict[str, object]]) -> list[dict[str, object]]:
    return [ln for ln in lines if ln.get("level") in ("warning", "error", "critical", "raw")]


def test_an_events_client_that_leaves_during_a_replay_is_quiet(srv: Server) -> None:
    with srv.client() as c:
        first = None
        for i in range(1500):
            r = c.post("/events", json={"kind": "agent.note", "data": {"i": i, "pad": "x" * 1000}})
            assert r.status_code == 201
            first = first or r.json()["id"]
    offset = srv.log.stat().st_size
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", srv.port)) as s:
            s.sendall(b"GET /events HTTP/1.1\r\nHost: x\r\nX-API-Key: " + srv.key.encode() +
                      b"\r\nLast-Event-ID: " + str(first).encode() + b"\r\n\r\n")
            assert s.recv(1000).startswith(b"HTTP/1.1 200 ")
    time.sleep(2)
    assert httpx.get(srv.url + "/health").status_code == 200
    assert loud(lines_after(srv, offset)) == []


def test_refused_websocket_handshakes_are_info(srv: Server) -> None:
    offset = srv.log.stat().st_size
    sid = "sb-000000000000"
    cases = [
        (f"/sandboxes/{sid}/vnc", {}, 401),
        (f"/sandboxes/{sid}/vnc?ticket=" + "a" * 43, {}, 401),
        (f"/sandboxes/{sid}/vnc", {"Origin": "http://elsewhere.example"}, 403),
        (f"/sandboxes/{sid}/pty/x?ticket=" + "b" * 43, {}, 401),
        (f"/sandboxes/{sid}/tunnel/80", {}, 401),
        (f"/sandboxes/{sid}/tunnel/80", {"X-API-Key": "hk_" + "w" * 43}, 401),
        (f"/sandboxes/{sid}/ports/80/ws?hangar_token=1.abc", {}, 404),
        ("/no/such/socket", {}, 403),
    ]

    async def status(path: str, headers: dict[str, str]) -> int:
        try:
            async with websockets.connect(f"ws://127.0.0.1:{srv.port}{path}",
                                          additional_headers=headers, open_timeout=20):
                return 101
        except websockets.InvalidStatus as exc:
            return exc.response.status_code

    async def all_() -> list[int]:
        return [await status(p, h) for p, h, _ in cases]

    assert asyncio.run(all_()) == [want for _, _, want in cases]
    time.sleep(0.5)
    lines = lines_after(srv, offset)
    assert loud(lines) == [], loud(lines)
    assert any("WebSocket" in str(ln.get("event")) for ln in lines)


@pytest.fixture(scope="module")
def sandbox(srv: Server) -> Iterator[str]:
    with srv.client() as c:
        r = c.post("/sandboxes", json={})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        yield sid
        c.delete(f"/sandboxes/{sid}")


def test_an_aborted_upload_is_no_error(srv: Server, sandbox: str) -> None:
    offset = srv.log.stat().st_size
    with socket.create_connection(("127.0.0.1", srv.port)) as s:
        s.sendall(f"PUT /sandboxes/{sandbox}/files?path=/tmp/aborted HTTP/1.1\r\nHost: x\r\n"
                  f"X-API-Key: {srv.key}\r\nContent-Length: {10 << 20}\r\n\r\n".encode())
        s.sendall(b"x" * (1 << 20))
        time.sleep(1)
    time.sleep(3)
    with srv.client() as c:  # the sandbox is fine afterwards
        r = c.post(f"/sandboxes/{sandbox}/exec", json={"command": "echo ok"})
        assert r.status_code == 200 and r.json()["stdout"] == "ok\n", r.text
    lines = lines_after(srv, offset)
    assert loud(lines) == [], loud(lines)
    assert not any("Exception in ASGI" in str(ln.get("event")) for ln in lines)


def test_an_unresponsive_sandbox_is_reported_once_not_per_call(srv: Server,
                                                               sandbox: str) -> None:
    offset = srv.log.stat().st_size
    with srv.client() as c:
        r = c.post(f"/sandboxes/{sandbox}/exec", json={"command": "kill -STOP $PPID",
                                                        "timeout": 2})
        assert r.status_code == 504, r.text
        for _ in range(5):
            r = c.post(f"/sandboxes/{sandbox}/exec", json={"command": "true"})
            assert r.status_code == 504, r.text
    lines = lines_after(srv, offset)
    errors = [ln for ln in lines if ln.get("level") in ("error", "critical")]
    assert errors == [], errors
    found = [ln for ln in lines if ln.get("level") == "warning"]
    assert [ln["event"] for ln in found] == ["guest agent unresponsive"], found
