"""Many hosts, one Hangar: three nodes in network namespaces, etcd, S3 (tests/clusterlab.py).

The tests run in order on one module-scoped cluster (each node has one VM
slot; node 3 is restarted with two before the machine moves). Nine VM
starts in all: six boots (three creates, one of twenty racing creates, a
guest with open egress probing the control ports, one machine) and three
restores (the machine's wakes on other nodes). etcd runs with TLS and
client certificates, as ``hangar cluster certs`` and install.sh set it up.
"""

from __future__ import annotations

import concurrent.futures
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from clusterlab import Lab, can_run
from conftest import link_images, server_python, wait_for

pytestmark = pytest.mark.skipif(can_run() is not None, reason=str(can_run()))

USER = "cluster-user"


@pytest.fixture(scope="module")
def lab(base_image: Path) -> Iterator[Lab]:
    lab = Lab(base_image)
    lab.up(slots=1)
    try:
        yield lab
    finally:
        for n in lab.nodes:
            n.stop()
        leaked = lab.leaked()
        lab.close()
    assert not leaked, f"VMM processes outlived the cluster tests: {leaked}"


def exec_(c: httpx.Client, sid: str, cmd: str) -> dict:
    r = c.post(f"/sandboxes/{sid}/exec", json={"command": cmd})
    assert r.status_code == 200, r.text
    return r.json()


state: dict[str, str] = {}


def test_three_nodes_join_and_a_stopped_one_disappears(lab: Lab) -> None:
    nodes = lab.node_ls()
    assert {n: r["state"] for n, r in nodes.items()} == {"n1": "ready", "n2": "ready",
                                                         "n3": "ready"}
    assert all(r["capacity"] == 1 and r["address"] for r in nodes.values())
    # A fourth node (in n1's namespace, another port) joins, then stops.
    n1 = lab.nodes[0]
    d = lab.root / "node4"
    d.mkdir()
    link_images(lab.base_image, d)
    import subprocess

    env = {**lab.env, "HANGAR_DATA_DIR": str(d), "HANGAR_NETWORK": "off", "HANGAR_POOL_SIZE": "0"}
    python = server_python(env)
    p = subprocess.Popen(["ip", "netns", "exec", n1.ns, python, "-m", "hangar.cli", "node",
                          "join", "--etcd", lab.etcd_urls, "--advertise", f"{n1.ip}:8081",
                          "--name", "n4", "--host", n1.ip, "--port", "8081"],
                         env=env, stdout=open(d / "server.log", "ab"), stderr=subprocess.STDOUT,
                         start_new_session=True)
    lab.extra.append(p)
    wait_for(lambda: lab.node_ls().get("n4", {}).get("state") == "ready", 60, "n4 ready",
             every=0.3)
    sent = time.monotonic()
    p.send_signal(signal.SIGTERM)
    listed = lab.node_ls()
    answered = time.monotonic()
    p.wait(20)
    stopped = time.monotonic()
    # A stop leaves its record to its lease, renewed every second (RENEW_S) until the stop:
    # a listing that answered before the lease could have run out shows the node still.
    # The listing is a CLI start, which beside stress-ng took longer than that once; then
    # the lease has run out as designed, and only the end below can be checked.
    if answered - sent < lab.lease_s - 1:
        assert listed.get("n4", {}).get("state") == "ready", listed
    # Gone once its lease ended: no listing begun 7 s past the lease shows it (the listing is
    # a CLI whose own start takes seconds on a busy host, so its end says nothing).
    while True:
        asked = time.monotonic()
        if "n4" not in lab.node_ls():
            break
        assert asked - stopped <= lab.lease_s + 7, "n4 is still listed after its lease ended"
        time.sleep(0.3)


def test_a_record_with_an_unknown_state_is_a_clear_409_and_the_rest_works(lab: Lab) -> None:
    sid = "sb-0000000bad01"
    bad = {"apiVersion": "hangar.dev/v1alpha1", "kind": "Sandbox",
           "metadata": {"name": sid, "labels": {}}, "spec": {},
           "status": {"nodeName": "n2", "epoch": 1, "state": "zombie"}}
    lab.etcd_put(f"/hangar/sandboxes/{sid}", json.dumps(bad))
    try:
        with lab.nodes[0].client() as c:
            for method, path in (("GET", ""), ("DELETE", ""), ("POST", "/exec")):
                r = c.request(method, f"/sandboxes/{sid}{path}",
                              json={"command": "true"} if method == "POST" else None)
                assert r.status_code == 409, r.text
                err = r.json()["error"]
                assert err["code"] == "conflict" and "unreadable" in err["message"], err
                assert f"/hangar/sandboxes/{sid}" in err["message"]
            r = c.get("/sandboxes")
            assert r.status_code == 200 and sid not in {s["id"] for s in r.json()["sandboxes"]}
    finally:
        lab.etcd_put(f"/hangar/sandboxes/{sid}", "")


def test_forged_records_are_ignored_and_a_malformed_node_token_is_401(lab: Lab) -> None:
    """Records written with a valid client certificate (as a stolen one would) but with a
    path in an id or an address no node has: every node leaves them out, logs them, and
    goes on; a bad node token is refused before anything else."""
    good = {"apiVersion": "hangar.dev/v1alpha1", "kind": "Sandbox",
            "metadata": {"name": "sb-0000000bad02", "labels": {}}, "spec": {},
            "status": {"nodeName": "n2", "epoch": 1, "state": "sleeping", "view": {}}}
    traversal = {**good, "status": {**good["status"], "snapshot": {"id": "../../../../etc"}}}
    node = {"name": "n6", "address": "169.254.169.254:80", "capacity": 50, "free": 50,
            "engine": "qemu", "accel": "tcg", "cpu_model": "", "images": []}
    forged = {"/hangar/sandboxes/../../../etc/passwd": good,
              "/hangar/sandboxes/sb-0000000bad02": traversal,
              "/hangar/nodes/n6": node,
              "/hangar/machines/forged-user": {"sandboxId": "../../sb-0000000bad02"}}
    for key, value in forged.items():
        lab.etcd_put(key, json.dumps(value))
    try:
        assert "n6" not in lab.node_ls()
        with lab.nodes[0].client() as c:
            r = c.get("/sandboxes/sb-0000000bad02")
            assert r.status_code == 409 and "unreadable" in r.json()["error"]["message"], r.text
            r = c.get("/machines/forged-user")
            assert r.status_code == 409, r.text
            r = c.get("/sandboxes")
            assert r.status_code == 200 and r.json()["sandboxes"] == [], r.text
        for n in lab.nodes:
            wait_for(lambda: "unreadable cluster record" in n.log_tail(200_000), 10,
                     f"{n.name} logs the forged records", every=0.3)
            assert "/hangar/nodes/n6" in n.log_tail(200_000)
            assert httpx.get(n.url + "/cluster/health", headers={"X-API-Key": lab.key}
                             ).json()["writable"]  # the watch and the lease go on
    finally:
        for key in forged:
            lab.etcd_put(key, "")
    n1 = lab.nodes[0]
    for token in (b"\xff\xfe\x80", b"not a token!", b"x" * 200, b"y" * 43):
        r = httpx.get(n1.url + "/sandboxes", headers=[(b"X-API-Key", lab.key.encode()),
                                                      (b"X-Hangar-Node-Token", token)])
        assert r.status_code == 401, (token, r.text)
        assert "X-Hangar-Node-Token" in r.json()["error"]["message"]
    r = httpx.get(n1.url + "/cluster/health")  # the peer probe needs a node's token or a key
    assert r.status_code == 401, r.text


def test_one_slot_per_node_three_creates_three_nodes_then_429_and_a_race(lab: Lab) -> None:
    n1 = lab.nodes[0]
    with n1.client() as c:
        ids = []
        for _ in range(3):
            r = c.post("/sandboxes", json={})
            assert r.status_code == 201, r.text
            ids.append(r.json()["id"])
        owners = {sid: lab.owner(sid) for sid in ids}
        assert sorted(owners.values()) == ["n1", "n2", "n3"], owners
        r = c.post("/sandboxes", json={})
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "limit_exceeded" and "retry-after" in r.headers
        listed = {s["id"] for s in c.get("/sandboxes").json()["sandboxes"]}
        assert set(ids) <= listed  # every node's sandboxes, listed through any node
        by_node = {v: k for k, v in owners.items()}
        assert c.delete(f"/sandboxes/{by_node['n1']}").status_code == 204
        state.update(b=by_node["n2"], c=by_node["n3"])

    # Twenty creates at once through the three nodes: one free slot, so exactly one wins.
    def create(i: int) -> int:
        with lab.nodes[i % 3].client() as cc:
            return cc.post("/sandboxes", json={}).status_code

    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        codes = list(pool.map(create, range(20)))
    assert codes.count(201) == 1 and codes.count(429) == 19, codes
    running = [n.vmm_ids() for n in lab.nodes]
    assert sum(len(r) for r in running) == 3, running  # never over the cluster's cap
    with n1.client() as c:
        new = [s["id"] for s in c.get("/sandboxes").json()["sandboxes"]
               if s["id"] not in (state["b"], state["c"])]
        assert len(new) == 1 and lab.owner(new[0]) == "n1"
        assert c.delete(f"/sandboxes/{new[0]}").status_code == 204
        assert c.get(f"/sandboxes/{new[0]}").status_code == 404


PROBE = """
import errno, json, socket, sys, time
out = {}
listener = socket.create_server(("127.0.0.1", 0))  # port 0 below: this loopback
for host, port in json.loads(sys.argv[1]):
    s = socket.socket()
    s.settimeout(5)
    t = time.monotonic()
    try:
        s.connect((host, port or listener.getsockname()[1]))
        verdict = "open"
    except OSError as exc:
        verdict = errno.errorcode.get(exc.errno, str(exc))
    out[f"{host}:{port}"] = verdict + " %.1f" % (time.monotonic() - t)
    s.close()
print(json.dumps(out))
"""


def test_a_guest_with_open_egress_reaches_no_control_endpoint_of_any_node(lab: Lab) -> None:
    """From inside a guest under the most open policy: every node's etcd (client and peer
    ports) and API refuse the connection at once (the filter's TCP reset), while the rest
    of the cluster's network (its S3 store) and the guest's own loopback answer. The
    create goes through node 2 with a client's own placement header, which must not ride
    on the node token: the sandbox gets the id the cluster claims."""
    with lab.nodes[1].client() as c:
        r = c.post("/sandboxes", json={"network": {"egress": "open"}},
                   headers={"X-Hangar-Sandbox-Id": "sb-00000000c0de"})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        assert sid != "sb-00000000c0de"
        try:
            assert lab.owner(sid) == "n1"  # the only free slot
            targets = [[n.ip, p] for n in lab.nodes for p in (2379, 2380, 8080)]
            targets += [[f"{lab.net}.254", 9000], ["127.0.0.1", 0]]
            out = exec_(c, sid, f"python3 -c '{PROBE}' '{json.dumps(targets)}'")
            got = json.loads(out["stdout"])
            for n in lab.nodes:
                for p in (2379, 2380, 8080):
                    verdict, took = got[f"{n.ip}:{p}"].split()
                    assert verdict == "ECONNREFUSED" and float(took) < 2, (n.name, p, got)
            assert got[f"{lab.net}.254:9000"].startswith("open"), got
            assert got["127.0.0.1:0"].startswith("open"), got
        finally:
            assert c.delete(f"/sandboxes/{sid}").status_code == 204


def test_calls_sent_to_node1_reach_a_sandbox_on_node3(lab: Lab) -> None:
    sid = state["c"]
    assert lab.owner(sid) == "n3"
    with lab.nodes[0].client() as c:
        assert exec_(c, sid, "hostname")["stdout"].strip() == sid
        lines = []
        with c.stream("POST", f"/sandboxes/{sid}/exec/stream",
                      json={"command": "for i in 1 2 3; do echo $i; sleep 0.2; done"}) as r:
            assert r.status_code == 200
            lines = [ln for ln in r.iter_lines() if ln]
        assert [ln for ln in lines if '"stdout"' in ln] and '"exit"' in lines[-1]
        blob = bytes(range(256)) * 400
        assert c.put(f"/sandboxes/{sid}/files", params={"path": "/root/blob"},
                     content=blob).status_code == 200
        assert c.get(f"/sandboxes/{sid}/files", params={"path": "/root/blob"}).content == blob
        # A raw WebSocket tunnel to a TCP echo server in the guest (the VNC path's transport).
        exec_(c, sid, "nohup python3 -c \"import socket\ns=socket.create_server(('127.0.0.1',7000))\n"
                      "while True:\n c,_=s.accept(); d=c.recv(100); c.sendall(d[::-1]); c.close()\""
                      " >/dev/null 2>&1 &")
        assert exec_(c, sid, "for i in $(seq 100); do python3 -c \"import socket\n"
                             "socket.create_connection(('127.0.0.1', 7000), 1)\" 2>/dev/null"
                             " && exit 0; sleep 0.2; done; exit 1")["exit_code"] == 0  # listening

        assert c.get("/sandboxes/sb-000000000000").status_code == 404
    from websockets.sync.client import connect

    url = lab.nodes[0].url.replace("http://", "ws://") + f"/sandboxes/{sid}/tunnel/7000"
    with connect(url, additional_headers={"X-API-Key": lab.key}) as ws:
        ws.send(b"hangar")
        assert ws.recv(timeout=20) == b"ragnah"
    with pytest.raises(Exception) as info:  # a refusal on node 3 comes back as its status
        with connect(url.replace("/7000", "/7999"), additional_headers={"X-API-Key": lab.key}):
            pass
    assert "503" in str(info.value)
    with pytest.raises(Exception) as info:
        with connect(url, additional_headers={"X-API-Key": "wrong-key-" + "x" * 30}):
            pass
    assert "401" in str(info.value)


def test_machine_sleeps_on_node1_and_wakes_elsewhere_with_file_and_process(lab: Lab) -> None:
    n1, n2, n3 = lab.nodes
    n3.stop()  # a rolling restart with two slots: its sandbox keeps running
    # A start slower than the lease and the failover: the restart mark holds the sandbox.
    wait_for(lambda: lab.node_ls().get("n3", {}).get("state") == "restarting",
             lab.lease_s + 15, "n3 listed as restarting once its lease ended", every=0.3)
    time.sleep(lab.failover_s + 2)  # past the failover's wait for a node without the mark
    raw = lab.etcd_get(f"/hangar/sandboxes/{state['c']}")
    assert raw is not None
    status = json.loads(raw)["status"]  # not handed on: still node 3's, running
    assert (status["nodeName"], status["state"]) == ("n3", "running"), \
        (status, [n.log_tail(800) for n in (n1, n2)])
    assert lab.owner(state["c"]) == "n3"  # its VMM runs on, with no server
    n3.start(slots=2)
    assert lab.owner(state["c"]) == "n3", n3.log_tail(1500)
    with n3.client() as c:
        assert exec_(c, state["c"], "echo alive")["stdout"] == "alive\n"
    with n1.client() as c:
        r = c.post(f"/machines/{USER}", json={"idle_timeout": 3600})
        assert r.status_code == 201, r.text
        sid = state["m"] = r.json()["sandbox_id"]
        assert lab.owner(sid) == "n1"
        before = exec_(c, sid, "echo kept > /root/note; nohup sleep 100000 >/dev/null 2>&1 & "
                               "echo $! > /root/pid; ip -4 -o addr show dev eth0")["stdout"]
        assert "172.31.1." in before
        r = c.post(f"/machines/{USER}/snapshot")
        assert r.status_code == 200 and r.json()["state"] == "sleeping", r.text
    assert lab.owner(sid) is None
    lab.hangar("node", "drain", "n1")
    wait_for(lambda: lab.node_ls()["n1"]["state"] == "draining", 40, "n1 draining", every=0.3)
    with n2.client() as c:  # node 2 is full (its sandbox): the wake lands on node 3
        out = exec_(c, sid, "cat /root/note; kill -0 $(cat /root/pid) && echo running; "
                            "ip -4 -o addr show dev eth0")["stdout"]
        assert out.startswith("kept\nrunning\n"), out
        assert "172.31.3." in out, out  # re-addressed from node 3's pool
        assert c.get(f"/machines/{USER}").json()["state"] == "active"
    assert lab.owner(sid) == "n3"
    lab.hangar("node", "undrain", "n1")


def test_sigkill_of_node3_fails_its_sandboxes_and_puts_its_machines_to_sleep(lab: Lab) -> None:
    n1, _, n3 = lab.nodes
    sid, m = state["c"], state["m"]
    n3.stop(signal.SIGKILL)  # the server only: its VMMs keep running, now without a node
    with n1.client() as c:
        wait_for(lambda: c.get(f"/sandboxes/{sid}").json().get("state") == "failed",
                 lab.lease_s + 25, "the sandbox on lost n3 failed", every=0.3)
        assert "n3" in c.get(f"/sandboxes/{sid}").json()["error"]
        wait_for(lambda: c.get(f"/machines/{USER}").json().get("state") == "sleeping", 10,
                 "the machine on lost n3 sleeping", every=0.3)
        # Listed as lost while a record still names it, then gone once failover has
        # handed on its slots too: the one answer is "gone", in a moment.
        wait_for(lambda: "n3" not in lab.node_ls(), lab.lease_s + 10, "lost n3 unlisted",
                 every=0.3)
    n3.start(slots=2)  # it rejoins: both VMMs have a stale epoch and are killed
    wait_for(lambda: not n3.vmm_ids(), 20, "n3's stale VMMs killed", every=0.3)
    with n1.client() as c:
        assert c.delete(f"/sandboxes/{sid}").status_code == 204
        assert c.get(f"/sandboxes/{sid}").status_code == 404
        assert c.get(f"/machines/{USER}").json()["state"] == "sleeping"
    assert m not in n3.vmm_ids()


def test_cut_node3_fences_itself_and_no_machine_runs_twice(lab: Lab) -> None:
    n1, _, n3 = lab.nodes
    sid = state["m"]
    with n3.client() as c:  # wakes on node 3 (it receives the call and has room)
        assert exec_(c, sid, "cat /root/note")["stdout"] == "kept\n"
    assert lab.owner(sid) == "n3"
    lab.cut(3)
    try:
        # Watch both sides at once: node 3 must stop the VM before the others hand it on.
        fenced_at = handed_at = None
        with n1.client(timeout=10) as c:
            deadline = time.monotonic() + lab.lease_s + 35
            while (fenced_at is None or handed_at is None) and time.monotonic() < deadline:
                if fenced_at is None and sid not in n3.vmm_ids():
                    fenced_at = time.monotonic()
                if handed_at is None and c.get(f"/machines/{USER}").json().get("state") \
                        == "sleeping":
                    handed_at = time.monotonic()
                time.sleep(0.1)
            assert fenced_at is not None and handed_at is not None, (fenced_at, handed_at)
            assert fenced_at < handed_at, "node 3 still ran the machine when it was handed on"
            assert exec_(c, sid, "cat /root/note")["stdout"] == "kept\n"
        assert lab.owner(sid) == "n1"
    finally:
        lab.heal(3)
    wait_for(lambda: lab.node_ls().get("n3", {}).get("state") == "ready", 40, "n3 ready",
             every=0.3)
    time.sleep(2)
    runs = [n.name for n in lab.nodes if sid in n.vmm_ids()]
    assert runs == ["n1"], runs
    with n3.client() as c:  # node 3 serves it again, forwarded to node 1
        assert exec_(c, sid, "echo once")["stdout"] == "once\n"


def test_etcd_one_member_down_works_two_down_writes_503_exec_still_answers(lab: Lab) -> None:
    n1, n2, n3 = lab.nodes
    sid = state["m"]
    assert n3.etcd is not None and n2.etcd is not None
    n3.etcd.send_signal(signal.SIGSTOP)
    try:
        time.sleep(3)
        assert {r["state"] for r in lab.node_ls().values()} == {"ready"}
        with n3.client(timeout=30) as c:
            assert exec_(c, sid, "echo one-down")["stdout"] == "one-down\n"
            r = c.post(f"/sandboxes/{sid}/timeout", json={"timeout": 7200})
            assert r.status_code == 200, r.text
        n2.etcd.send_signal(signal.SIGSTOP)
        try:
            with n1.client(timeout=30) as c:
                wait_for(lambda: c.post(f"/sandboxes/{sid}/timeout",
                                        json={"timeout": 3600}).status_code == 503, 15,
                         "control writes refused without quorum", every=0.3)
                r = c.post("/sandboxes", json={})
                assert r.status_code == 503 and "retry-after" in r.headers, r.text
                assert r.json()["error"]["code"] == "unavailable"
                time.sleep(lab.lease_s + 1)  # past a lease: nobody fences, the machine keeps running
                assert exec_(c, sid, "echo no-quorum")["stdout"] == "no-quorum\n"
            with n2.client(timeout=30) as c:
                assert exec_(c, sid, "echo forwarded")["stdout"] == "forwarded\n"
            assert lab.owner(sid) == "n1"
        finally:
            n2.etcd.send_signal(signal.SIGCONT)
    finally:
        n3.etcd.send_signal(signal.SIGCONT)
    with n1.client(timeout=30) as c:
        answers: list[str] = []

        def written() -> bool:
            r = c.post(f"/sandboxes/{sid}/timeout", json={"timeout": 3600})
            answers.append(f"{r.status_code} {r.text[:300]}")
            return r.status_code == 200

        try:
            wait_for(written, 6 * lab.lease_s, "control writes taken with quorum back",
                     every=0.3)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the last answer: {answers[-1:]}; n1's log: "
                                 f"{n1.log_tail(1500)}") from None
        assert c.delete(f"/machines/{USER}").status_code == 204
    for n in lab.nodes:  # every node takes control writes again once quorum is back
        wait_for(lambda: httpx.get(n.url + "/cluster/health", headers={"X-API-Key": lab.key})
                 .json()["writable"], 6 * lab.lease_s,
                 f"{n.name} writable", every=0.3)
    with lab.nodes[1].client() as c:
        for s in c.get("/sandboxes").json()["sandboxes"]:
            assert c.delete(f"/sandboxes/{s['id']}").status_code == 204
        assert c.get("/sandboxes").json()["sandboxes"] == []
    wait_for(lambda: not any(n.vmm_ids() for n in lab.nodes), 20, "no VMM left",
             every=0.3)
