"""The front door against a real server (no VM is booted): nothing is read before the
sender is known, and the HTTP server's own limits hold (hangar.api.frontdoor,
hangar.api.http_limits)."""

from __future__ import annotations

import json
import os
import secrets
import socket
import sqlite3
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from conftest import SRC, Server, own_server

BIG = 8 << 20


@pytest.fixture(scope="module")
def srv(base_image: Path) -> Iterator[Server]:
    with own_server(base_image) as s:
        yield s


def raw(server: Server, data: bytes, *, read_timeout: float = 10.0) -> bytes:
    """Send ``data`` on a new connection and return the answer: its head and the
    ``Content-Length`` bytes of body (or what came until ``read_timeout``)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=read_timeout) as s:
        s.sendall(data)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
                head, sep, body = out.partition(b"\r\n\r\n")
                length = [int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
                          if line.startswith(b"content-length:")]
                if sep and length and len(body) >= length[0]:
                    break
        except (socket.timeout, ConnectionResetError):
            pass
        return out


def test_unauthenticated_bodies_are_refused_unread_and_stall_no_one(srv: Server) -> None:
    # A head that announces 8 MiB and sends none of it is answered 401: nothing waited
    # for the body.
    started = time.monotonic()
    answer = raw(srv, b"POST /sandboxes HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                      b"\r\nContent-Length: %d\r\n\r\n" % BIG, read_timeout=3)
    assert answer.startswith(b"HTTP/1.1 401 "), answer[:200]
    assert time.monotonic() - started < 2.5
    # Exposed ports and envd admit from headers too: a port of no sandbox is a 404; envd
    # without a credential a 401, for no sandbox as for one (it tells the unauthenticated
    # nothing of ids: docs/security.md, round 3, class 8), both without waiting for the body.
    for head, want in ((b"POST /sandboxes/sb-000000000000/ports/8080/x HTTP/1.1\r\n", b"404"),
                       (b"POST /e2b/envd/files HTTP/1.1\r\nE2b-Sandbox-Id: sb-000000000000"
                        b"\r\n", b"401")):
        answer = raw(srv, head + b"Host: x\r\nContent-Length: %d\r\n\r\n" % BIG,
                     read_timeout=3)
        assert answer.startswith(b"HTTP/1.1 " + want + b" "), answer[:200]
    # The same under /e2b, in E2B's error shape.
    answer = raw(srv, b"POST /e2b/sandboxes HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
                      % BIG, read_timeout=3)
    assert answer.startswith(b"HTTP/1.1 401 ") and b'"code": 401' in answer, answer[:300]

    # Just under the JSON body cap (8 MiB), so a server that reads before it checks parses
    # them whole: a map of 600,000 keys takes Python's parser about half a second.
    n = BIG - 4096
    many = json.dumps({f"k{i}": i for i in range(n // 14)}).encode()
    bodies = {
        "large": b'{"metadata": ' + many[:n - 64].rpartition(b",")[0] + b"}}",
        "malformed": many[:n],
        "nested": b"[" * n,
    }
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        def health_latency(n: int) -> list[float]:
            out = []
            for _ in range(n):
                t0 = time.perf_counter()
                assert c.get("/health").status_code == 200
                out.append(time.perf_counter() - t0)
                time.sleep(0.02)
            return out

        baseline = statistics.median(health_latency(30))
        stop = threading.Event()
        answers: list[tuple[str, int, float]] = []

        def flood() -> None:
            with httpx.Client(base_url=srv.url, timeout=60) as attacker:
                while not stop.is_set():
                    for name, body in bodies.items():
                        t0 = time.perf_counter()
                        r = attacker.post("/sandboxes", content=body,
                                          headers={"Content-Type": "application/json"})
                        answers.append((name, r.status_code, time.perf_counter() - t0))

        floods = [threading.Thread(target=flood) for _ in range(2)]
        for t in floods:
            t.start()
        try:
            time.sleep(0.3)
            during = statistics.median(health_latency(40))
        finally:
            stop.set()
            for t in floods:
                t.join(60)
    assert answers and {code for _, code, _ in answers} == {401}, answers[:5]
    assert {name for name, _, _ in answers} == set(bodies)
    # Sending 8 MiB over loopback is all an attacker's request costs (the old server parsed
    # it: 2 s each, and /health waited as long).
    slowest = max(took for _, _, took in answers)
    print(f"\n/health median {baseline * 1000:.1f} ms alone, {during * 1000:.1f} ms during "
          f"{len(answers)} refused 8 MiB bodies; slowest refusal {slowest * 1000:.0f} ms")
    assert slowest < 1.5, answers
    # Another client's calls: the median is unchanged within a generous factor for a loaded
    # 2-core machine (the old behaviour put it near a second).
    assert during < max(4 * baseline, baseline + 0.1), (baseline, during)


def test_authenticated_large_and_deep_json_is_a_clear_400(srv: Server) -> None:
    from hangar.json_items import MAX_ITEMS

    with srv.client() as c:
        # past the values a body may hold, refused as it is read (hangar.json_items)
        r = c.post("/sandboxes", content=b"[" * (1 << 20),
                   headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["limit_items"] == MAX_ITEMS
        # under it, nested past what the parser takes: a 400 that says so
        r = c.post("/sandboxes", content=b"[" * 20_000,
                   headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"]
        r = c.post("/sandboxes", content=b'{"a": ' + b"1" * (2 << 20),
                   headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def test_a_64_mib_header_is_refused_431(srv: Server) -> None:
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ")
        sent, answer = 0, b""
        chunk = b"a" * (1 << 20)
        try:
            while sent < 64 << 20:
                s.sendall(chunk)
                sent += len(chunk)
                s.setblocking(False)
                try:
                    answer += s.recv(65536)
                except BlockingIOError:
                    pass
                s.setblocking(True)
                if answer:
                    break
        except (BrokenPipeError, ConnectionResetError):
            pass
        s.settimeout(5)
        try:
            while more := s.recv(65536):
                answer += more
        except (socket.timeout, ConnectionResetError, BlockingIOError):
            pass
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert sent < 32 << 20, "the client could send half the header before the refusal"
    assert httpx.get(srv.url + "/health").status_code == 200


def test_a_slow_request_head_is_cut_off(srv: Server) -> None:
    from hangar.api.http_limits import HEADER_TIMEOUT_S

    with socket.create_connection(("127.0.0.1", srv.port), timeout=HEADER_TIMEOUT_S + 10) as s:
        started = time.monotonic()
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
        assert s.recv(100) == b""  # closed by the server, unanswered
        took = time.monotonic() - started
    assert HEADER_TIMEOUT_S - 1 < took < HEADER_TIMEOUT_S + 8, took


def test_malformed_credentials_are_4xx(srv: Server) -> None:
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        for params in ({"hangar_token": "²²²².abc"}, {"hangar_token": "x" * 5000},
                       {"hangar_token": "1.é"}):
            r = c.get("/sandboxes/sb-000000000000/ports/8080/", params=params)
            assert r.status_code == 404, r.text  # no such sandbox: answered before any token
        r = c.get("/sandboxes", headers={"X-API-Key": "é".encode("latin-1") * 100})
        assert r.status_code == 401
        r = c.get("/e2b/envd/health", headers={"E2b-Sandbox-Id": "sb-000000000000",
                                               "E2b-Sandbox-Port": "²".encode("latin-1")})
        assert r.status_code == 400, r.text
        r = c.get("/files", params={"signature": "v1_x", "signature_expiration": "²",
                                    "path": "/a"})
        assert r.status_code == 401, r.text
    log = srv.log.read_text()
    assert '"level": "error"' not in log, log[-2000:]


def hangar_cli(server: Server, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HANGAR_DATA_DIR": str(server.data_dir), "HANGAR_URL": server.url,
           "PYTHONPATH": str(SRC)}
    env.pop("HANGAR_API_KEY", None)
    return subprocess.run([sys.executable, "-m", "hangar.cli", *args], env=env, text=True,
                          capture_output=True, timeout=120)


def test_a_removed_key_gets_401_on_an_idempotent_repeat(srv: Server, tmp_path: Path) -> None:
    r = hangar_cli(srv, "key", "add", "idem")
    assert r.returncode == 0, r.stderr
    key = r.stdout.strip().split()[-1]
    event = {"kind": "agent.note", "data": {"n": 1}}
    headers = {"X-API-Key": key, "Idempotency-Key": "k-" + secrets.token_hex(8)}
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        first = c.post("/events", json=event, headers=headers)
        assert first.status_code == 201, first.text
        again = c.post("/events", json=event, headers=headers)
        assert again.status_code == 201 and again.headers["idempotent-replayed"] == "true"
        assert again.json() == first.json()
        assert hangar_cli(srv, "key", "rm", "idem").returncode == 0
        gone = c.post("/events", json=event, headers=headers)
        assert gone.status_code == 401, gone.text
        assert "idempotent-replayed" not in gone.headers
    # The stored answer is sealed: its bytes are not in the database in clear, and a
    # backup leaves the table out (its rows and their pages).
    db = srv.data_dir / "hangar.db"
    with sqlite3.connect(db) as con:
        stored = con.execute("SELECT body FROM idempotency_keys").fetchall()
    assert stored and all(row[0].startswith(b"hs1:") for row in stored)
    assert all(first.json()["id"].encode() not in p.read_bytes()
               for p in db.parent.glob("hangar.db*"))
    out = hangar_cli(srv, "backup", str(tmp_path), "--data-dir", str(srv.data_dir))
    assert out.returncode == 0, out.stderr
    copy = next(tmp_path.glob("hangar-*.db"))
    with sqlite3.connect(copy) as con:
        assert con.execute("SELECT count(*) FROM idempotency_keys").fetchone() == (0,)
        assert con.execute("SELECT count(*) FROM sandboxes").fetchone() is not None
    assert stored[0][0][4:40] not in copy.read_bytes()


def test_open_paths_need_no_key_and_every_other_route_does(srv: Server) -> None:
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        for path, status in (("/health", 200), ("/openapi.json", 200), ("/ui/", 200),
                             ("/e2b/health", 204)):
            assert c.get(path).status_code == status, path
        spec = c.get("/openapi.json").json()
        for path, ops in spec["paths"].items():
            if path == "/health":
                continue
            for method in ops:
                r = c.request(method.upper(), path.replace("{", "").replace("}", ""))
                assert r.status_code == 401, (method, path, r.status_code)
