"""Limits on real VMs: the cap on concurrent VMs and per-sandbox TTLs."""

from __future__ import annotations

import concurrent.futures as cf
import shutil
import time

import httpx
import pytest

from conftest import Server, Waits, cleanup, free_port, make_data_dir, vmm_pids, wait_for

pytestmark = pytest.mark.vm


def test_create_storm_respects_the_cap(base_image) -> None:
    d = make_data_dir(base_image)
    srv = Server(d, free_port(), {"HANGAR_MAX_SANDBOXES": "3"})
    try:
        srv.start()

        def create(_: int) -> tuple[int, float, dict, dict]:
            with srv.client() as c:
                t = time.monotonic()
                r = c.post("/sandboxes", json={})  # restores of the base template
                return r.status_code, time.monotonic() - t, dict(r.headers), r.json()

        with cf.ThreadPoolExecutor(12) as pool:
            results = list(pool.map(create, range(12)))
        codes = sorted(r[0] for r in results)
        assert codes == [201] * 3 + [429] * 9, codes
        for status, took, headers, body in results:
            if status == 429:
                assert took < 5, f"a refused create took {took:.1f} s"
                assert int(headers["retry-after"]) >= 1
                assert body["error"]["code"] == "limit_exceeded"
        assert len(vmm_pids(str(d))) == 3
        with srv.client() as c:
            assert len(c.get("/sandboxes").json()["sandboxes"]) == 3
    finally:
        leaked = cleanup(srv)
        shutil.rmtree(d, ignore_errors=True)
    assert not leaked


def test_ttl_is_kept_by_reads(api: httpx.Client) -> None:
    sb = api.post("/sandboxes", json={"timeout": 1800}).json()
    sid = sb["id"]
    try:
        expires = sb["expires_at"]
        assert abs(expires - (time.time() + 1800)) < 60
        api.get(f"/sandboxes/{sid}")
        api.get("/sandboxes")
        api.post(f"/sandboxes/{sid}/exec", json={"command": "true"})
        assert api.get(f"/sandboxes/{sid}").json()["expires_at"] == expires
        r = api.post(f"/sandboxes/{sid}/timeout", json={"timeout": 3600})
        assert r.status_code == 200 and r.json()["expires_at"] > expires + 1700
    finally:
        api.delete(f"/sandboxes/{sid}")


def test_expired_sandbox_is_removed_and_says_so(api: httpx.Client, waits: Waits) -> None:
    sid = api.post("/sandboxes", json={"timeout": 2}).json()["id"]
    r = wait_for(lambda: (x := api.get(f"/sandboxes/{sid}")).status_code != 200 and x,
                 2 + waits.vm(4), "the 2 s TTL to expire", every=0.5)
    assert r.status_code == 410 and "expired" in r.json()["error"]["message"]
    assert api.post(f"/sandboxes/{sid}/exec", json={"command": "true"}).status_code == 410
    assert sid not in [s["id"] for s in api.get("/sandboxes").json()["sandboxes"]]
    assert vmm_pids(sid) == []
