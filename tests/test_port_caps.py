"""Connections to exposed ports are capped, and never hold a snapshot off (issue 20, class 5).

A server of this module's own with small caps (2 per port, 3 per sandbox) and one real
VM running a guest app whose requests wait until told: connections over a cap are
answered 429 with ``Retry-After``, and a snapshot taken while connections are open
succeeds (they are paused with the VM and answered after).
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from conftest import Server, cleanup, free_port, make_data_dir, wait_for

pytestmark = pytest.mark.vm

HOLDER = r'''
import os, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
port = int(sys.argv[1])
os.makedirs("/tmp/held", exist_ok=True)
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path.startswith("/hold/"):
            name = f"/tmp/held/{port}-{self.path.rsplit('/', 1)[1]}"
            open(name, "w").close()
            while os.path.exists(name):  # held until the test removes the file
                time.sleep(0.1)
        body = b"done\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
'''


@pytest.fixture(scope="module")
def capped(base_image: Path) -> Iterator[tuple[Server, httpx.Client, str]]:
    d = make_data_dir(base_image)
    srv = Server(d, free_port(), {"HANGAR_PORT_MAX_CONNECTIONS": "2",
                                  "HANGAR_SANDBOX_MAX_PORT_CONNECTIONS": "3"})
    try:
        srv.start()
        with srv.client() as c:
            r = c.post("/sandboxes", json={})
            assert r.status_code == 201, r.text
            sid = r.json()["id"]
            c.put(f"/sandboxes/{sid}/files", params={"path": "/root/holder.py"},
                  content=HOLDER.encode()).raise_for_status()
            for port in (4000, 4001):
                r = c.post(f"/sandboxes/{sid}/exec", json={
                    "command": f"setsid python3 /root/holder.py {port} >/dev/null 2>&1 "
                               "</dev/null &", "timeout": 30})
                assert r.status_code == 200, r.text
                assert c.post(f"/sandboxes/{sid}/ports",
                              json={"port": port, "public": True}).status_code == 201

            def up() -> bool:
                return all(c.get(f"/sandboxes/{sid}/ports/{p}/").status_code == 200
                           for p in (4000, 4001))

            wait_for(up, 60, "the guest's servers to answer", every=0.5)
            yield srv, c, sid
    finally:
        leaked = cleanup(srv)
        shutil.rmtree(d, ignore_errors=True)
        assert not leaked, f"VMM processes outlived the module: {leaked}"


def held(c: httpx.Client, sid: str) -> set[str]:
    r = c.post(f"/sandboxes/{sid}/exec", json={"command": "ls /tmp/held", "timeout": 30})
    assert r.status_code == 200, r.text
    return set(r.json()["stdout"].split())


def test_caps_answer_429_and_a_snapshot_is_not_held_off(capped) -> None:
    srv, c, sid = capped
    answers: dict[str, int] = {}

    def hold(port: int, name: str) -> None:
        with httpx.Client(base_url=srv.url, timeout=300) as anon:
            answers[name] = anon.get(f"/sandboxes/{sid}/ports/{port}/hold/{name}").status_code

    threads = [threading.Thread(target=hold, args=(port, name))
               for port, name in ((4000, "a"), (4000, "b"), (4001, "c"))]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: held(c, sid) == {"4000-a", "4000-b", "4001-c"}, 60,
                 "three connections held in the guest", every=0.5)
        with httpx.Client(base_url=srv.url, timeout=60) as anon:
            r = anon.get(f"/sandboxes/{sid}/ports/4000/")
            assert r.status_code == 429, r.text
            assert r.json()["error"]["code"] == "limit_exceeded"
            assert "port 4000" in r.json()["error"]["message"]
            assert int(r.headers["Retry-After"]) >= 1
            r = anon.get(f"/sandboxes/{sid}/ports/4001/")  # port 4001 has room; the sandbox not
            assert r.status_code == 429, r.text
            assert "3 connections open to its ports" in r.json()["error"]["message"]
            # A WebSocket over the cap is refused the same way, before its upgrade.
            r = anon.get(f"/sandboxes/{sid}/ports/4000/", headers={
                "Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13",
                "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="})
            assert r.status_code == 429, r.text
        # Open connections do not make the sandbox busy: a snapshot goes ahead.
        r = c.post(f"/sandboxes/{sid}/snapshot")
        assert r.status_code == 201, r.text
        c.delete(f"/snapshots/{r.json()['id']}")
    finally:
        c.post(f"/sandboxes/{sid}/exec", json={"command": "rm -f /tmp/held/*", "timeout": 30})
        for t in threads:
            t.join(120)
    # The held connections went on after the snapshot and were answered.
    assert answers == {"a": 200, "b": 200, "c": 200}
    deadline = time.monotonic() + 30
    while c.get(f"/sandboxes/{sid}/ports/4000/").status_code != 200:
        assert time.monotonic() < deadline, "the port never came back under its cap"
        time.sleep(0.5)
