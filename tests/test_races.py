"""Races on real VMs: a delete during a create, pool retirement against a storm of
takes; and options that must reach the record (a machine's network policy)."""

from __future__ import annotations

import concurrent.futures as cf
import json
import shutil
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from conftest import Server, Waits, cleanup, free_port, make_data_dir, vmm_pids, wait_for

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def user_net(base_image) -> Iterator[Server]:
    """A server whose guests get QEMU's user-mode network (no host devices involved),
    so that an 'open' policy is accepted and stored while 'internet' is refused."""
    d = make_data_dir(base_image)
    srv = Server(d, free_port(), {"HANGAR_NETWORK": "user", "HANGAR_NET_USER_OPEN": "1"})
    srv.start()
    yield srv
    leaked = cleanup(srv)
    shutil.rmtree(d, ignore_errors=True)
    assert not leaked


def test_delete_during_create_answers_409_and_leaves_nothing(user_net: Server) -> None:
    srv = user_net
    result: dict = {}

    def create() -> None:
        with srv.client() as c:
            r = c.post("/sandboxes", json={"memory_mib": 256})
            result["status"], result["body"] = r.status_code, r.json()

    t = threading.Thread(target=create)
    t.start()
    with srv.client() as c:
        deadline = time.monotonic() + 60
        sid = None
        while sid is None and time.monotonic() < deadline:
            sid = next((s["id"] for s in c.get("/sandboxes").json()["sandboxes"]
                        if s["state"] == "creating"), None)
            time.sleep(0.02)
        assert sid, "never saw the sandbox while it was being created"
        r = c.delete(f"/sandboxes/{sid}")
        assert r.status_code == 204, r.text
        assert vmm_pids(sid) == [], "the delete returns once the VM is gone"
        assert not (srv.data_dir / "sandboxes" / sid).exists()
        t.join(120)
        assert result["status"] == 409, result
        assert "deleted while being created" in result["body"]["error"]["message"]
        assert c.get(f"/sandboxes/{sid}").status_code == 404
        assert sid not in [s["id"] for s in c.get("/sandboxes").json()["sandboxes"]]
        assert vmm_pids(sid) == []
    log = [json.loads(x) for x in srv.log.read_text().splitlines() if x.startswith("{")]
    mine = [x for x in log if x.get("sandbox_id") == sid or sid in str(x.get("path", ""))]
    assert not [x for x in mine if x["level"] == "error"], mine


def test_a_machine_keeps_its_network_policy(user_net: Server) -> None:
    with user_net.client() as c:
        r = c.post("/machines/net-user", json={"network": "internet", "memory_mib": 256})
        assert r.status_code == 400, "user-mode networking cannot filter: the option was read"
        assert c.get("/machines/net-user").status_code == 404, "and nothing was made"
        r = c.post("/machines/net-user", json={"network": "open"})
        assert r.status_code == 201, r.text
        sid = r.json()["sandbox_id"]
        try:
            sb = c.get(f"/sandboxes/{sid}").json()
            assert sb["network"] == {"egress": "open", "allow": [], "deny": []}, sb
            out = c.post(f"/sandboxes/{sid}/exec", json={"command": "ls /sys/class/net"}).json()
            assert set(out["stdout"].split()) - {"lo"}, "the guest has a NIC"
        finally:
            assert c.delete("/machines/net-user").status_code == 204


def test_pool_retirement_racing_20_takes(base_image, waits: Waits) -> None:  # noqa: ANN001
    d = make_data_dir(base_image)
    srv = Server(d, free_port(), {"HANGAR_POOL_SIZE": "2", "HANGAR_POOL_MAX_AGE_S": "3",
                                  "HANGAR_MAX_SANDBOXES": "4"})

    def refills(c: httpx.Client) -> int:
        line = next(x for x in c.get("/metrics").text.splitlines()
                    if x.startswith("hangar_pool_refills_total"))
        return int(float(line.split()[-1]))

    try:
        srv.start()
        with srv.client() as c:
            wait_for(lambda: refills(c) >= 1, waits.vm(8), "a ready pool VM")
            # That VM turns 3 s old now: fire 20 creates as the loop comes to retire it.
            time.sleep(2.7)
            barrier = threading.Barrier(20)

            def create(_: int) -> tuple[int, dict]:
                with srv.client() as c2:
                    barrier.wait()
                    r = c2.post("/sandboxes", json={})
                    return r.status_code, r.json()

            with cf.ThreadPoolExecutor(20) as ex:
                results = list(ex.map(create, range(20)))
            codes = sorted(code for code, _ in results)
            assert set(codes) <= {201, 429}, codes
            made = [body["id"] for code, body in results if code == 201]
            assert made and len(set(made)) == len(made), "no VM was handed out twice"
            time.sleep(3)  # several retirement passes later, every handed-out VM still runs
            for sid in made:
                r = c.post(f"/sandboxes/{sid}/exec", json={"command": "echo mine"})
                assert r.status_code == 200 and r.json()["stdout"] == "mine\n", r.text
                assert len(vmm_pids(sid)) == 1
            listed = {s["id"]: s["state"] for s in c.get("/sandboxes").json()["sandboxes"]}
            assert listed == {sid: "running" for sid in made}, "pool VMs are never listed"
            text = c.get("/metrics").text
            assert "hangar_pool_hits_total" in text and "hangar_pool_misses_total" in text
            assert 'hangar_sandbox_create_seconds_count{outcome="ok",source=' in text
            for sid in made:
                assert c.delete(f"/sandboxes/{sid}").status_code == 204
    finally:
        leaked = cleanup(srv)
        shutil.rmtree(d, ignore_errors=True)
    assert not leaked
