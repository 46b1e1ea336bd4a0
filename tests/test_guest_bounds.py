"""A hostile or stuck guest cannot grow the server's memory or hold a sandbox, on real VMs.

* Flow control: guests writing as fast as they can to readers that take
  1 KiB a second (an exec stream, a file download, a tunnel) keep the
  server's memory flat, never hold up another call, and are stopped in the
  guest when their reader goes away.
* Deadlines: an agent frozen with SIGSTOP fails the call with 504 within
  the exec's timeout plus its grace, the sandbox shows ``unresponsive``,
  answers at once with 504 and Retry-After, comes back to ``running`` when
  the agent runs again, and can be deleted. Closing a terminal meanwhile
  answers at once; its hang-up reaches the guest when it runs again.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from conftest import Server, Waits, vmm_pids, wait_for

pytestmark = pytest.mark.vm

MIB = 1 << 20
EXEC_GRACE_S = 10.0
"""The server's grace after an exec's own timeout (``Deadlines.exec_grace_s``)."""


def run(api: httpx.Client, sid: str, command: str, **body: object) -> dict:
    r = api.post(f"/sandboxes/{sid}/exec", json={"command": command, **body})
    assert r.status_code == 200, r.text
    return r.json()


def rss(pid: int) -> int:
    """Resident memory of ``pid``, bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def slow_socket(server: Server) -> socket.socket:
    """A TCP connection to the server with a tiny receive buffer (a reader that lags)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", server.port))
    return s


def send_request(s: socket.socket, server: Server, method: str, path: str,
                 body: bytes = b"", headers: dict[str, str] | None = None) -> None:
    head = {"Host": f"127.0.0.1:{server.port}", "X-API-Key": server.key,
            "Content-Length": str(len(body)), **(headers or {})}
    s.sendall(f"{method} {path} HTTP/1.1\r\n".encode()
              + "".join(f"{k}: {v}\r\n" for k, v in head.items()).encode() + b"\r\n" + body)


def serve_in_guest(api: httpx.Client, sid: str, port: int, name: str, serve: str,
                   waits: Waits) -> None:
    """Start a guest service that takes one connection on ``127.0.0.1:port`` and runs
    ``serve`` (Python, the connection is ``c``), and return once it listens: the exec waits
    in the guest until ``ss`` shows the listener (a VM under load may take seconds to start
    Python), within the measured ``waits.vm(1)``."""
    script = ("import socket\n"
              "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
              f"s.bind((\"127.0.0.1\", {port})); s.listen()\n"
              f"c, _ = s.accept()\n{serve}")
    r = run(api, sid, f"setsid python3 -c '{script}' {name} >/dev/null 2>&1 & "
                      f"until ss -Hltn 'sport = :{port}' | grep -q LISTEN; do sleep 0.1; done",
            timeout=waits.vm(1))
    assert r["exit_code"] == 0, f"nothing listens on {port} in the guest: {r}"


@pytest.fixture
def readers(server: Server) -> Iterator[list[socket.socket]]:
    socks: list[socket.socket] = []
    yield socks
    for s in socks:
        s.close()


def test_slow_readers_keep_server_memory_flat(api: httpx.Client, sandbox: str, server: Server,
                                              readers: list[socket.socket],
                                              waits: Waits) -> None:
    sid = sandbox
    assert server.proc is not None
    pid = server.proc.pid
    # A guest service that writes as fast as it can to whoever connects.
    serve_in_guest(api, sid, 7070, "fill-7070", "while True: c.sendall(b\"z\" * 65536)", waits)
    base = rss(pid)

    # 1. an exec stream of 2 GiB
    exec_sock = slow_socket(server)
    readers.append(exec_sock)
    body = json.dumps({"command": "yes | head -c 2G", "timeout": 600}).encode()
    send_request(exec_sock, server, "POST", f"/sandboxes/{sid}/exec/stream", body,
                 {"Content-Type": "application/json"})
    # 2. an endless file download
    file_sock = slow_socket(server)
    readers.append(file_sock)
    send_request(file_sock, server, "GET", f"/sandboxes/{sid}/files?path=/dev/zero")
    # 3. a tunnel to the guest service
    ws_sock = slow_socket(server)
    readers.append(ws_sock)
    send_request(ws_sock, server, "GET", f"/sandboxes/{sid}/tunnel/7070", headers={
        "Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Version": "13",
        "Sec-WebSocket-Key": base64.b64encode(os.urandom(16)).decode()})

    got = {"exec": b"", "file": b"", "tunnel": b""}
    peak = base
    concurrent_ok = False
    started = time.monotonic()
    while time.monotonic() - started < 20:
        for name, s in (("exec", exec_sock), ("file", file_sock), ("tunnel", ws_sock)):
            s.setblocking(False)
            try:
                got[name] += s.recv(1024)
            except BlockingIOError:
                pass
        peak = max(peak, rss(pid))
        if not concurrent_ok and time.monotonic() - started > 5:
            # Other calls on the same guest connection are not held up.
            t = time.monotonic()
            assert run(api, sid, "echo other")["stdout"] == "other\n"
            assert time.monotonic() - t < 30
            concurrent_ok = True
        time.sleep(1)
    assert b"200 OK" in got["exec"][:200] and b'"type": "stdout"' in got["exec"]
    assert b"200 OK" in got["file"][:200]
    assert b"101 Switching Protocols" in got["tunnel"][:200]
    grew = peak - base
    print(f"server RSS {base / MIB:.1f} MiB, peak {peak / MIB:.1f} MiB (+{grew / MIB:.1f})")
    assert grew < 64 * MIB, f"server RSS grew {grew / MIB:.1f} MiB under three slow readers"

    # The readers go away: the guest stops writing for them.
    for s in readers:
        s.close()
    wait_for(lambda: not run(api, sid, "pgrep -x yes; pgrep -x head; pgrep -f fill-707[0]; "
                                       "true")["stdout"].strip(),
             waits.vm(4), "the guest's writers to end with their readers", every=1)
    assert api.get(f"/sandboxes/{sid}").json()["state"] == "running"
    assert run(api, sid, "head -c 3000000 /dev/zero | wc -c")["stdout"] == "3000000\n"


def test_a_tunnel_carries_more_than_a_window_both_ways_intact(api: httpx.Client, sandbox: str,
                                                             server: Server, waits: Waits) -> None:
    """The tools' local tunnel to a guest echo service: 3 MiB out and back, every byte."""
    import asyncio

    from hangar.tools.tunnel import LocalTunnel

    serve_in_guest(api, sandbox, 7071, "echo-7071", "while (d := c.recv(65536)): c.sendall(d)",
                   waits)
    blob = os.urandom(3 * MIB)

    async def go() -> bytes:
        async with LocalTunnel("ws" + server.url[4:], {"X-API-Key": server.key}, sandbox,
                               7071) as tunnel:
            reader, writer = await asyncio.open_connection("127.0.0.1", tunnel.port)

            async def send() -> None:
                for i in range(0, len(blob), 100_000):
                    writer.write(blob[i:i + 100_000])
                    await writer.drain()

            sender = asyncio.create_task(send())
            back = await asyncio.wait_for(reader.readexactly(len(blob)), 120)
            await sender
            writer.close()
            return back

    assert asyncio.run(go()) == blob


def test_a_frozen_agent_makes_the_sandbox_unresponsive(api: httpx.Client,
                                                      fresh_sandbox: str, waits: Waits) -> None:
    sid = fresh_sandbox
    r = api.post(f"/sandboxes/{sid}/pty", json={"command": "sleep 600", "grace": 600})
    assert r.status_code == 201, r.text
    session = r.json()["id"]
    # The exec stops its own agent ($PPID) and leaves a process that lets it go on in 25 s.
    t = time.monotonic()
    r = api.post(f"/sandboxes/{sid}/exec", json={
        "command": "A=$PPID; setsid sh -c \"sleep 25; kill -CONT $A\" >/dev/null 2>&1 & "
                   "kill -STOP $A", "timeout": 3})
    took = time.monotonic() - t
    assert r.status_code == 504, r.text
    assert r.json()["error"]["code"] == "timeout"
    assert took <= 3 + EXEC_GRACE_S + 3, f"504 came after {took:.1f} s"
    rec = api.get(f"/sandboxes/{sid}").json()
    assert rec["state"] == "unresponsive" and "did not answer" in rec["error"]
    # While it is unresponsive, calls get 504 at once, with Retry-After.
    t = time.monotonic()
    r = api.post(f"/sandboxes/{sid}/exec", json={"command": "true"})
    assert r.status_code == 504 and int(r.headers["Retry-After"]) >= 1
    assert time.monotonic() - t < 5
    assert api.get(f"/sandboxes/{sid}/files/stat", params={"path": "/"}).status_code == 504
    # Closing a terminal never waits for the guest; the hang-up reaches it once it runs.
    t = time.monotonic()
    assert api.delete(f"/sandboxes/{sid}/pty/{session}").status_code == 204
    assert time.monotonic() - t < 5
    # SIGCONT: the agent answers the server's probe and the sandbox runs again.
    rec = wait_for(lambda: (x := api.get(f"/sandboxes/{sid}").json())["state"] == "running"
                   and x, waits.vm(8, floor=60), "the thawed sandbox running", every=0.5)
    assert rec["error"] is None, rec
    assert run(api, sid, "echo back")["stdout"] == "back\n"
    wait_for(lambda: not run(api, sid, "pgrep -f 'sleep 60[0]' || true")["stdout"].strip(),
             waits.vm(4), "the hang-up of the terminal closed while frozen", every=0.5)
    # Frozen for good: still deletable, and the VMM is gone.
    r = api.post(f"/sandboxes/{sid}/exec", json={"command": "kill -STOP $PPID", "timeout": 1})
    assert r.status_code == 504
    assert api.get(f"/sandboxes/{sid}").json()["state"] == "unresponsive"
    assert api.delete(f"/sandboxes/{sid}").status_code == 204
    assert api.get(f"/sandboxes/{sid}").status_code == 404
    assert vmm_pids(sid) == []
