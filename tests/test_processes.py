"""Background processes through the real server, on real VMs (``/sandboxes/{id}/processes``).

A process started in the background outlives its request and every
client: it is listed, attached to again by pid (output from then on, or the
ring's first with ``replay``), fed stdin, signalled and killed; its exit code
is kept. A server a command leaves running with ``&`` and no redirection
keeps answering, and its log lines land in the process table. Bounds: a
flood fills the 1 MiB ring without growing the agent, and a 65th running
process is refused with 429. ``test_processes_agent.py`` tests the guest's
table itself without a VM.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from conftest import Server

pytestmark = pytest.mark.vm

MIB = 1 << 20


def run(api: httpx.Client, sid: str, command: str, **body: object) -> dict:
    r = api.post(f"/sandboxes/{sid}/exec", json={"command": command, **body})
    assert r.status_code == 200, r.text
    return r.json()


def start(api: httpx.Client, sid: str, command: str, **body: object) -> dict:
    r = api.post(f"/sandboxes/{sid}/processes", json={"command": command, **body})
    assert r.status_code == 201, r.text
    return r.json()


def entry(api: httpx.Client, sid: str, pid: int) -> dict | None:
    r = api.get(f"/sandboxes/{sid}/processes")
    assert r.status_code == 200, r.text
    found = [p for p in r.json()["processes"] if p["pid"] == pid]
    return found[0] if found else None


def payload(ev: dict) -> bytes:
    if ev.get("data_b64") is not None:
        return base64.b64decode(ev["data_b64"])
    return (ev.get("data") or "").encode()


@contextmanager
def attach(api: httpx.Client, sid: str, pid: int, **params: object) -> Iterator[Iterator[dict]]:
    """The NDJSON events of an attach; leaving the block closes the HTTP stream."""
    query = {k: str(v).lower() for k, v in params.items()}
    with api.stream("GET", f"/sandboxes/{sid}/processes/{pid}", params=query) as r:
        assert r.status_code == 200, r.read().decode()
        assert r.headers["content-type"].startswith("application/x-ndjson")
        yield (json.loads(line) for line in r.iter_lines() if line)


def read_until(events: Iterator[dict], want: bytes, limit: int = 200) -> tuple[bytes, list[dict]]:
    out, seen = b"", []
    for ev in events:
        seen.append(ev)
        out += payload(ev)
        if want in out or ev["type"] == "end" or len(seen) > limit:
            break
    return out, seen


def test_start_leave_attach_again_stdin_and_exit_code(api: httpx.Client, sandbox: str) -> None:
    p = start(api, sandbox, "echo ready; while read l; do echo got:$l; done; echo bye; exit 3",
              stdin=True, tag="reader")
    pid = p["pid"]
    assert (p["state"], p["tag"], p["stdin_open"], p["origin"]) == ("running", "reader", True,
                                                                     "start")
    assert entry(api, sandbox, pid)["state"] == "running"

    with attach(api, sandbox, pid, replay=True) as events:
        out, seen = read_until(events, b"ready\n")
        assert seen[0]["type"] == "attached" and seen[0]["process"]["pid"] == pid
        assert out == b"ready\n"  # from the ring, or live if it had not run yet
    # The client left; the process runs on and takes input meanwhile.
    r = api.post(f"/sandboxes/{sandbox}/processes/{pid}/stdin", json={"data": "one\n"})
    assert r.status_code == 200 and r.json() == {"written": 4, "stdin_open": True}
    time.sleep(1)
    assert entry(api, sandbox, pid)["state"] == "running"

    with attach(api, sandbox, pid) as events:  # from now on: no "ready", no "got:one"
        assert next(events)["type"] == "attached"
        r = api.post(f"/sandboxes/{sandbox}/processes/{pid}/stdin",
                     json={"data_b64": base64.b64encode(b"two\n").decode()})
        assert r.status_code == 200, r.text
        out, _ = read_until(events, b"got:two\n")
        assert out == b"got:two\n"
        r = api.post(f"/sandboxes/{sandbox}/processes/{pid}/stdin", json={"close": True})
        assert r.json() == {"written": 0, "stdin_open": False}
        out, seen = read_until(events, b"never")
        assert out == b"bye\n" and seen[-1]["type"] == "end"
        assert seen[-1]["process"]["exit_code"] == 3
    kept = entry(api, sandbox, pid)
    assert (kept["state"], kept["exit_code"], kept["output_bytes"]) == ("exited", 3, 26)
    r = api.post(f"/sandboxes/{sandbox}/processes/{pid}/stdin", json={"data": "late\n"})
    assert r.status_code == 409, r.text


def test_signal_kill_and_errors(api: httpx.Client, sandbox: str) -> None:
    pid = start(api, sandbox, "sleep", args=["300"])["pid"]
    r = api.post(f"/sandboxes/{sandbox}/processes/{pid}/signal", json={"signal": "SIGTERM"})
    assert r.status_code == 200 and r.json()["delivered"] is True
    for _ in range(50):
        if entry(api, sandbox, pid)["state"] == "exited":
            break
        time.sleep(0.2)
    e = entry(api, sandbox, pid)
    assert (e["state"], e["exit_code"], e["signal"]) == ("exited", 143, 15)

    pid = start(api, sandbox, "sleep", args=["300"])["pid"]
    r = api.delete(f"/sandboxes/{sandbox}/processes/{pid}")
    assert r.status_code == 200, r.text
    assert (r.json()["state"], r.json()["exit_code"]) == ("exited", 137)
    assert entry(api, sandbox, pid) is None
    assert api.delete(f"/sandboxes/{sandbox}/processes/{pid}").status_code == 404
    assert api.get(f"/sandboxes/{sandbox}/processes/{pid}").status_code == 404

    r = api.post(f"/sandboxes/{sandbox}/processes/1/signal", json={"signal": "SIGNOPE"})
    assert r.status_code == 422 and "SIGNOPE" in r.text  # the API's validation status
    r = api.post(f"/sandboxes/{sandbox}/processes", json={"command": "x", "tag": "t" * 257})
    assert r.status_code == 422
    start(api, sandbox, "sleep", args=["30"], tag="only-one")
    r = api.post(f"/sandboxes/{sandbox}/processes",
                 json={"command": "true", "tag": "only-one"})
    assert r.status_code == 409 and "only-one" in r.json()["error"]["message"]
    r = api.post(f"/sandboxes/{sandbox}/processes", json={"command": "no-such-program-x",
                                                          "args": []})
    assert r.status_code == 400 and "not found" in r.text


def test_a_terminal_process_and_an_sse_attach(api: httpx.Client, sandbox: str) -> None:
    pid = start(api, sandbox, "/bin/sh", args=[], pty={"cols": 80, "rows": 24})["pid"]
    r = api.post(f"/sandboxes/{sandbox}/processes/{pid}/resize", json={"cols": 101, "rows": 33})
    assert r.status_code == 200 and (r.json()["cols"], r.json()["rows"]) == (101, 33)
    with api.stream("GET", f"/sandboxes/{sandbox}/processes/{pid}",
                    headers={"Accept": "text/event-stream"}) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = resp.iter_lines()
        api.post(f"/sandboxes/{sandbox}/processes/{pid}/stdin",
                 json={"data": "stty size; exit 6\n"})
        out, types = b"", []
        for line in lines:
            if line.startswith("data: "):
                ev = json.loads(line[6:])
                types.append(ev["type"])
                out += payload(ev)
                if ev["type"] == "end":
                    assert ev["process"]["exit_code"] == 6
                    break
    assert b"33 101" in out and types[0] == "attached" and "pty" in types


def test_a_server_left_running_with_an_ampersand_keeps_answering(
        api: httpx.Client, sandbox: str) -> None:
    """The defect of issue 18: ``python3 -m http.server 8000 &`` with no redirection got
    EPIPE on its first log line after the exec returned, and closed every connection
    unanswered. The first write after the exec is the one that failed, so requests spread
    over 30 s (each one a new log line, the last long after the exec) show it is fixed."""
    r = run(api, sandbox, "cd /tmp && python3 -m http.server 8000 &", timeout=30)
    assert r["exit_code"] == 0
    probe = ("python3 -c \"import urllib.request as u; "
             "print(u.urlopen('http://127.0.0.1:8000/', timeout=10).status)\"")
    for _ in range(60):  # the server's own start, under emulation
        if run(api, sandbox, probe + " 2>/dev/null || true")["stdout"] == "200\n":
            break
        time.sleep(1)
    else:
        pytest.fail("the server never answered")
    t0 = time.monotonic()
    answers = 1
    for i in range(5):
        time.sleep(max(0.0, t0 + 6 * (i + 1) - time.monotonic()))
        assert run(api, sandbox, probe)["stdout"] == "200\n", f"request {i + 2} unanswered"
        answers += 1
    assert time.monotonic() - t0 >= 30
    [kept] = [p for p in api.get(f"/sandboxes/{sandbox}/processes").json()["processes"]
              if p["origin"] == "exec" and "http.server" in " ".join(p["args"])]
    assert kept["output_open"] and kept["exit_code"] == 0
    with attach(api, sandbox, kept["pid"], replay=True) as events:
        out, _ = read_until(events, b"never")  # the replay, then the end after the grace
    assert out.count(b'"GET / HTTP/1.1" 200') == answers, out.decode()[-2000:]
    # Killing the entry kills the group the shell left behind: the server stops.
    assert api.delete(f"/sandboxes/{sandbox}/processes/{kept['pid']}").status_code == 200
    time.sleep(1)
    assert run(api, sandbox, probe + " 2>/dev/null || echo down")["stdout"] == "down\n"


def test_bounds_a_flood_and_too_many(api: httpx.Client, fresh_sandbox: str) -> None:
    sid = fresh_sandbox
    rss = "grep VmRSS /proc/$PPID/status | tr -s ' ' | cut -d' ' -f2"  # the agent's, KiB
    before = int(run(api, sid, rss)["stdout"])
    pid = start(api, sid, "head -c 40000000 /dev/zero")["pid"]
    for _ in range(300):
        e = entry(api, sid, pid)
        if e["state"] == "exited" and not e["output_open"]:
            break
        time.sleep(0.5)
    assert (e["exit_code"], e["output_bytes"]) == (0, 40_000_000)
    assert e["output_dropped"] == 40_000_000 - MIB
    after = int(run(api, sid, rss)["stdout"])
    assert after - before < 8 * 1024, f"agent RSS grew {before} -> {after} KiB"

    for i in range(63):  # the flood's exited entry is the 64th; a start takes its slot
        start(api, sid, "sleep", args=["600"])
    assert entry(api, sid, pid) is not None
    start(api, sid, "sleep", args=["600"])
    assert entry(api, sid, pid) is None
    r = api.post(f"/sandboxes/{sid}/processes", json={"command": "sleep", "args": ["1"]})
    assert r.status_code == 429, r.text
    assert "64 processes are running" in r.json()["error"]["message"]
    assert len(api.get(f"/sandboxes/{sid}/processes").json()["processes"]) == 64


def test_the_sdk_surface(server: Server, sandbox: str) -> None:
    from hangar.client import Sandbox

    sb = Sandbox.connect(sandbox, base_url=server.url, api_key=server.key)
    try:
        p = sb.processes.start("cat", args=[], stdin=True, tag="sdk-cat")
        assert p.state == "running" and p.pid in [q.pid for q in sb.processes.list()]
        assert sb.processes.send_stdin(p.pid, "hello\n").written == 6
        events = sb.processes.attach(p.pid, replay=True)
        first = next(events)
        assert first.type == "attached"
        assert next(events).payload == b"hello\n"
        events.close()
        gone = sb.processes.kill(p.pid)
        assert gone.exit_code == 137
    finally:
        sb.client.close()
