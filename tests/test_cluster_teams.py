"""Teams across a cluster (issue 32): teams and their keys in etcd, quotas counted on every node.

One lab for the module (tests/clusterlab.py: three nodes in network
namespaces, real etcd with TLS, two VM slots each), five VM boots of 256 MiB:
a sandbox of team alpha, two of team gamma (of four creates sent at once), and
two machines of the same user id, one for alpha and one for beta; one sleep
(alpha's machine, whose wake past alpha's lowered limit is refused).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from clusterlab import Lab, can_run
from conftest import wait_for

pytestmark = pytest.mark.skipif(can_run() is not None, reason=str(can_run()))


@pytest.fixture(scope="module")
def lab(base_image: Path) -> Iterator[Lab]:
    lab = Lab(base_image)
    lab.up(slots=2)
    try:
        yield lab
    finally:
        try:  # what a failed test left (a node keeps its VMMs over a stop, for a restart)
            with lab.nodes[0].client(timeout=60) as c:
                for s in c.get("/sandboxes").json()["sandboxes"]:
                    c.delete(f"/sandboxes/{s['id']}")
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        for n in lab.nodes:
            n.stop()
        leaked = lab.leaked()
        lab.close()
    assert not leaked, f"VMM processes outlived the cluster team tests: {leaked}"


keys: dict[str, str] = {}
state: dict[str, str] = {}


def client(lab: Lab, i: int, key: str, timeout: float = 300) -> httpx.Client:
    return httpx.Client(base_url=lab.nodes[i].url, headers={"X-API-Key": key},
                        timeout=timeout)


def key_add(lab: Lab, name: str, team: str) -> str:
    r = lab.hangar("key", "add", name, "--team", team, "--etcd", lab.etcd_urls)
    return r.stdout.strip()


def test_a_team_and_its_key_made_once_work_on_every_node(lab: Lab) -> None:
    with lab.nodes[0].client() as c:
        for name, limits in (("alpha", {}), ("beta", {}), ("gamma", {"max_sandboxes": 2})):
            r = c.post("/teams", json={"name": name, **limits})
            assert r.status_code == 201, r.text
        assert c.post("/teams", json={"name": "alpha"}).status_code == 409
        assert c.post("/teams", json={"name": "alpha", "max_vcpus": "8"}).status_code == 422
    for name, team in (("a1", "alpha"), ("b1", "beta"), ("g1", "gamma")):
        keys[team] = key_add(lab, name, team)
    r = lab.hangar("key", "add", "op2", "--etcd", lab.etcd_urls, check=False)
    assert r.returncode == 2 and "--team" in r.stderr  # operator keys: the config's
    r = lab.hangar("key", "add", "a1", "--team", "beta", "--etcd", lab.etcd_urls, check=False)
    assert r.returncode == 1 and "exists" in r.stderr
    listed = lab.hangar("key", "ls", "--etcd", lab.etcd_urls).stdout
    assert all(n in listed for n in ("a1", "b1", "g1")) and keys["alpha"] not in listed
    for i in range(3):  # every node knows the teams (/teams) and accepts their keys
        with lab.nodes[i].client() as c:
            r = c.get("/teams/gamma")
            assert r.status_code == 200 and r.json()["max_sandboxes"] == 2, r.text
        for team, key in keys.items():
            with client(lab, i, key) as c:
                wait_for(lambda: c.get("/sandboxes").status_code == 200, 10,
                         f"{team}'s key on n{i + 1}")
                assert c.get("/teams").status_code == 403  # the operator's
                assert c.get("/sandboxes").json()["sandboxes"] == []


def test_another_teams_sandbox_is_404_through_any_node_and_not_listed(lab: Lab) -> None:
    with client(lab, 0, keys["alpha"]) as c:
        r = c.post("/sandboxes", json={})
        assert r.status_code == 201, r.text
        sid = state["alpha"] = r.json()["id"]
    owner = lab.owner(sid)
    others = [i for i, n in enumerate(lab.nodes) if n.name != owner]
    for i in range(3):
        with client(lab, i, keys["beta"]) as c:
            for method, path, body in (("GET", "", None), ("POST", "/exec", {"command": "id"}),
                                       ("DELETE", "", None)):
                r = c.request(method, f"/sandboxes/{sid}{path}", json=body)
                assert r.status_code == 404, (i, method, r.text)
                assert r.json()["error"]["message"] == f"no sandbox {sid}"
            assert sid not in {s["id"] for s in c.get("/sandboxes").json()["sandboxes"]}
        with client(lab, i, keys["alpha"]) as c:
            assert [s["id"] for s in c.get("/sandboxes").json()["sandboxes"]] == [sid]
    with client(lab, others[0], keys["alpha"]) as c:  # its own team acts on it anywhere
        r = c.post(f"/sandboxes/{sid}/exec", json={"command": "echo hi"})
        assert r.status_code == 200 and r.json()["stdout"] == "hi\n", r.text
    with lab.nodes[others[1]].client() as c:  # the operator sees every team's
        assert sid in {s["id"] for s in c.get("/sandboxes").json()["sandboxes"]}
        r = c.get("/sandboxes", headers={"X-Hangar-Team": "beta"})
        assert r.status_code == 200 and r.json()["sandboxes"] == []
        r = c.get("/teams/alpha")
        assert r.json()["usage"]["sandboxes"] == 1, r.text


def test_a_teams_quota_holds_for_creates_sent_at_once_through_two_nodes(lab: Lab) -> None:
    def create(i: int) -> httpx.Response:
        with client(lab, i % 2, keys["gamma"]) as c:
            return c.post("/sandboxes", json={"memory_mib": 256})

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(create, range(4)))
    codes = sorted(r.status_code for r in answers)
    assert codes == [201, 201, 429, 429], [r.text for r in answers]
    for r in answers:
        if r.status_code == 429:
            assert r.json()["error"] == {  # the very body of one host (tests/test_teams.py)
                "code": "quota_exceeded", "message": "team gamma may hold 2 sandboxes "
                "(max_sandboxes) and holds 2; this sandbox needs 1 more",
                "quota": "max_sandboxes", "limit": 2, "used": 2, "needed": 1, "team": "gamma"}
            assert "retry-after" not in r.headers  # waiting does not help
    made = [r.json()["id"] for r in answers if r.status_code == 201]
    with client(lab, 2, keys["gamma"]) as c:  # a third node counts them too
        r = c.post("/sandboxes", json={})
        assert r.status_code == 429 and r.json()["error"]["quota"] == "max_sandboxes", r.text
        assert sorted(s["id"] for s in c.get("/sandboxes").json()["sandboxes"]) == sorted(made)
        for sid in made:
            assert c.delete(f"/sandboxes/{sid}").status_code == 204
    with lab.nodes[0].client() as c:
        wait_for(lambda: c.get("/teams/gamma").json()["usage"]["sandboxes"] == 0, 30,
                 "gamma's sandboxes gone from the cluster's count")


def test_two_teams_machines_of_one_user_id_are_distinct(lab: Lab) -> None:
    ids = {}
    for team, i in (("alpha", 1), ("beta", 2)):
        with client(lab, i, keys[team]) as c:
            r = c.post("/machines/u1", json={"idle_timeout": 3600})
            assert r.status_code == 201, r.text  # a new machine
            ids[team] = r.json()["sandbox_id"]
            assert r.json()["user_id"] == "u1"
    assert ids["alpha"] != ids["beta"]
    for team, other in (("alpha", "beta"), ("beta", "alpha")):
        with client(lab, 0, keys[team]) as c:
            assert c.get("/machines/u1").json()["sandbox_id"] == ids[team]
            assert [m["sandbox_id"] for m in c.get("/machines").json()["machines"]] \
                == [ids[team]]
            assert c.get(f"/sandboxes/{ids[other]}").status_code == 404
    with lab.nodes[2].client() as c:
        users = {m["user_id"]: m["sandbox_id"] for m in c.get("/machines").json()["machines"]}
        assert users == {"alpha/u1": ids["alpha"], "beta/u1": ids["beta"]}
    # A wake counts too: alpha's machine asleep, its limit lowered to what it runs (its
    # sandbox, on another node: only the cluster's count refuses), the wake through a third
    # node is the 429 and the machine sleeps on.
    assert lab.owner(ids["alpha"]) not in (None, lab.owner(state["alpha"]))
    with client(lab, 1, keys["alpha"]) as c:
        r = c.post("/machines/u1/snapshot")
        assert r.status_code == 200 and r.json()["state"] == "sleeping", r.text
    with lab.nodes[0].client() as c:
        assert c.patch("/teams/alpha", json={"max_sandboxes": 1}).status_code == 200
    with client(lab, 2, keys["alpha"]) as c:
        r = c.post("/machines/u1/wake")
        assert r.status_code == 429 and r.json()["error"]["message"] == (
            "team alpha may hold 1 sandbox (max_sandboxes) and holds 1; this sandbox needs "
            "1 more"), r.text
        assert c.get("/machines/u1").json()["state"] == "sleeping"
    with lab.nodes[0].client() as c:
        assert c.patch("/teams/alpha", json={"max_sandboxes": None}).status_code == 200


def test_a_removed_key_stops_everywhere_and_a_team_goes_once_it_holds_nothing(lab: Lab) -> None:
    with lab.nodes[1].client() as c:
        r = c.delete("/teams/gamma")
        assert r.status_code == 409 and "g1" in r.json()["error"]["message"], r.text
    lab.hangar("key", "rm", "g1", "--etcd", lab.etcd_urls)
    for i in range(3):
        with client(lab, i, keys["gamma"]) as c:
            wait_for(lambda: c.get("/sandboxes").status_code == 401, 10, f"g1 refused on {i}")
    with lab.nodes[1].client() as c:
        assert c.delete("/teams/gamma").status_code == 204
        assert "gamma" not in {t["name"] for t in c.get("/teams").json()["teams"]}
        r = c.delete("/teams/alpha")  # its key, a sandbox and a machine
        assert r.status_code == 409, r.text
        assert "a1" in r.json()["error"]["message"] and r.json()["error"]["sandboxes"] == 2
        for s in c.get("/sandboxes").json()["sandboxes"]:
            assert c.delete(f"/sandboxes/{s['id']}").status_code == 204
