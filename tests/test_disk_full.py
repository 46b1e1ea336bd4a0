"""A full guest disk is the caller's problem: 409 ``disk_full`` at once, never retried.

On a real VM with the smallest disk, a file the size of the free space fills
it; then a raw upload, the SDK's ``write_file`` and envd's upload are refused
at once (Hangar: 409 naming the path and the free space; envd: 507, E2B's
``NotEnoughSpaceException``), the SDK makes one attempt only, and once the
file is removed the same write works.
"""

from __future__ import annotations

import time

import httpx
import pytest

from conftest import Server, Waits

from hangar.client import Hangar
from hangar.errors import DiskFull

pytestmark = pytest.mark.vm

FILL = "/root/fill.bin"


def _sh(c: httpx.Client, sid: str, script: str, timeout: float = 120) -> dict:
    r = c.post(f"/sandboxes/{sid}/exec", json={"command": script, "timeout": timeout})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_full_guest_disk_is_409_not_retried_and_the_sandbox_recovers(
        server: Server, waits: Waits) -> None:
    with server.client() as c:
        r = c.post("/sandboxes", json={"disk_mib": 512, "timeout": 900, "memory_mib": 256})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        try:
            # Fill the root file system to the last block an unprivileged writer may use
            # (fallocate takes the size at once; dd tops up what it leaves).
            out = _sh(c, sid, f"free=$(($(stat -f -c '%a*%S' /root))); "
                              f"fallocate -l $free {FILL} || true; "
                              f"dd if=/dev/zero of={FILL}.tail bs=64k 2>/dev/null; "
                              "sync; stat -f -c '%a' /root", timeout=300)
            assert out["exit_code"] == 0, out
            assert int(out["stdout"].split()[-1]) <= 16, out  # (nearly) no block left

            data = b"x" * (1 << 20)
            started = time.monotonic()
            r = c.put(f"/sandboxes/{sid}/files", params={"path": "/root/new.bin"},
                      content=data)
            took = time.monotonic() - started
            assert r.status_code == 409, r.text
            err = r.json()["error"]
            assert err["code"] == "disk_full"
            assert err["path"].startswith("/root/")
            assert err["errno"] == "ENOSPC"
            assert isinstance(err["free_bytes"], int) and err["free_bytes"] < 1 << 20
            assert err["total_bytes"] > 100 << 20
            assert "No space left on device" in err["message"]
            assert str(err["free_bytes"]) in err["message"]
            assert took < waits.vm(1.0), took  # at once: no retry, no wait on the guest

            # The SDK raises DiskFull after one attempt, with no retry.
            sent: list[float] = []
            http = httpx.Client(event_hooks={"request": [lambda req: sent.append(1)]})
            try:
                h = Hangar(server.url, server.key, http_client=http)
                with pytest.raises(DiskFull) as info:
                    h.write_file(sid, "/root/sdk.bin", data)
            finally:
                http.close()
            assert len(sent) == 1, f"{len(sent)} attempts"
            assert info.value.retryable is False and info.value.status == 409
            assert info.value.context.get("free_bytes") is not None
            # A large upload too: the server reads the rest of the refused body, so the
            # client hears the 409 rather than a broken connection it would retry.
            sent.clear()
            http = httpx.Client(event_hooks={"request": [lambda req: sent.append(1)]})
            try:
                h = Hangar(server.url, server.key, http_client=http)
                with pytest.raises(DiskFull):
                    h.write_file(sid, "/root/big.bin", b"y" * (64 << 20))
            finally:
                http.close()
            assert len(sent) == 1, f"{len(sent)} attempts"

            # envd (E2B's data plane) answers 507: E2B's SDK raises NotEnoughSpaceException.
            token = c.get(f"/e2b/sandboxes/{sid}").json()["envdAccessToken"]
            r = httpx.post(f"{server.url}/e2b/envd/files", params={"path": "/root/e2b.bin"},
                           content=data, timeout=60,
                           headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983",
                                    "X-Access-Token": token,
                                    "Content-Type": "application/octet-stream"})
            assert r.status_code == 507, r.text
            assert "No space left on device" in r.json()["message"]

            # Freed, the same write works and the sandbox runs on.
            out = _sh(c, sid, f"rm -f {FILL} {FILL}.tail && sync && echo ok")
            assert out["stdout"].strip() == "ok", out
            r = c.put(f"/sandboxes/{sid}/files", params={"path": "/root/new.bin"},
                      content=data)
            assert r.status_code == 200, r.text
            assert r.json()["size"] == len(data)
            assert _sh(c, sid, "wc -c < /root/new.bin")["stdout"].strip() == str(len(data))
        finally:
            c.delete(f"/sandboxes/{sid}")
