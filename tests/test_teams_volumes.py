"""Teams' volumes and vault secrets against real servers (issue 32): a volume or secret made
with a team's key is the team's. Another team's is 404 in the words of a missing one (by id
or name, through Hangar's API and E2B's), absent from lists, and never mounted or bound; the
same name may exist in each team and the operator's, who sees every one as ``TEAM/name``.
A team's volumes together stay within its ``max_volumes_mib`` (429 naming the quota, also
with 10 creates at once). One real sandbox of a team mounts its volume and takes its secret
(a server on TAP networking in the network namespaces of tests/test_secrets.py)."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from conftest import Server, own_server
from team_support import cli, client, team_keys
from netns import can_netns  # its namespaces' fixed names: one worker (tests/schedule.py)


@pytest.fixture(scope="module")
def server(base_image: Path) -> Iterator[Server]:
    with own_server(base_image) as srv:
        yield srv


def clean(clients: dict[str, httpx.Client]) -> None:
    """Delete every sandbox, volume and secret of the server: the operator's key sees
    all, and each team's key deletes its team's secrets by the names it gave them."""
    op = clients["op"]
    for sb in op.get("/sandboxes").json()["sandboxes"]:
        op.delete(f"/sandboxes/{sb['id']}")
    for v in op.get("/volumes").json()["volumes"]:
        op.delete(f"/volumes/{v['id']}")
    for c in clients.values():
        for s in c.get("/secrets").json()["secrets"]:
            if "/" not in s["name"]:
                c.delete(f"/secrets/{s['name']}")
    assert op.get("/volumes").json()["volumes"] == []
    assert op.get("/secrets").json()["secrets"] == []


@pytest.fixture(scope="module")
def teams(server: Server) -> Iterator[dict[str, httpx.Client]]:
    """Teams ``red``, ``blue`` and ``quota`` (at most 100 MiB of volumes), a Hangar key of
    each, E2B keys of red and blue, and the operator's key."""
    with client(server, server.key) as op:
        for body in ({"name": "red"}, {"name": "blue"},
                     {"name": "quota", "max_volumes_mib": 100}):
            assert op.post("/teams", json=body).status_code == 201
        clients = team_keys(server, {"red": "red", "blue": "blue", "quota": "quota",
                                     "red-e2b": "red", "blue-e2b": "blue"})
        clients["op"] = op
        try:
            yield clients
        finally:
            clean({k: c for k, c in clients.items() if not k.endswith("-e2b")})
            for c in clients.values():
                if c is not op:
                    c.close()


def missing_volume(ref: str) -> dict:
    return {"error": {"code": "not_found", "message": f"no volume {ref!r}", "volume": ref}}


def missing_secret(name: str) -> dict:
    return {"error": {"code": "not_found", "message": f"no secret {name!r}"}}


def made(c: httpx.Client, path: str, body: dict) -> dict:
    r = c.post(path, json=body)
    assert r.status_code == 201, r.text
    return r.json()


def test_a_teams_volumes_are_its_own(teams: dict[str, httpx.Client]) -> None:
    red, blue, op = teams["red"], teams["blue"], teams["op"]
    # the same name in two teams and the operator's; each team sees its own by its name
    mine = made(red, "/volumes", {"name": "data", "size_mib": 16})
    assert mine["name"] == "data"
    theirs = made(blue, "/volumes", {"name": "data", "size_mib": 16})
    ops = made(op, "/volumes", {"name": "data", "size_mib": 16})
    only = made(red, "/volumes", {"name": "only-red", "size_mib": 16})
    assert len({mine["id"], theirs["id"], ops["id"]}) == 3
    r = red.post("/volumes", json={"name": "data", "size_mib": 16})
    assert (r.status_code, r.json()["error"]["message"]) == (
        409, "a volume named 'data' exists already")
    assert [(v["id"], v["name"]) for v in red.get("/volumes").json()["volumes"]] == [
        (mine["id"], "data"), (only["id"], "only-red")]
    assert [(v["id"], v["name"]) for v in blue.get("/volumes").json()["volumes"]] == [
        (theirs["id"], "data")]
    assert red.get("/volumes/data").json()["id"] == mine["id"]
    assert blue.get("/volumes/data").json()["id"] == theirs["id"]
    assert op.get("/volumes/data").json()["id"] == ops["id"]
    # the operator sees every one, a team's as TEAM/name
    assert sorted((v["id"], v["name"]) for v in op.get("/volumes").json()["volumes"]) == sorted(
        [(mine["id"], "red/data"), (theirs["id"], "blue/data"), (ops["id"], "data"),
         (only["id"], "red/only-red")])
    assert op.get(f"/volumes/{only['id']}").json()["name"] == "red/only-red"
    assert op.get("/teams/red").json()["usage"]["volumes_mib"] == 32

    # another team's volume, by id or name, is a missing one: same status, same body
    assert blue.get("/volumes/vol-000000000000").json() == missing_volume("vol-000000000000")
    for ref in (only["id"], "only-red"):
        for method, path, body in (("GET", f"/volumes/{ref}", None),
                                   ("PATCH", f"/volumes/{ref}", {"size_mib": 32}),
                                   ("GET", f"/volumes/{ref}/files?path=/", None),
                                   ("POST", f"/volumes/{ref}/fsck", None),
                                   ("DELETE", f"/volumes/{ref}", None)):
            got = blue.request(method, path, json=body)
            assert (got.status_code, got.json()) == (404, missing_volume(ref)), (method, path)
    # and through E2B's API
    e2b = teams["blue-e2b"]
    assert [v["volumeID"] for v in e2b.get("/e2b/volumes").json()] == [theirs["id"]]
    gone = e2b.get("/e2b/volumes/vol-000000000000")
    for method in ("GET", "DELETE"):
        got = e2b.request(method, f"/e2b/volumes/{only['id']}")
        assert got.status_code == 404 and got.json() == gone.json() | {
            "message": gone.json()["message"].replace("vol-000000000000", only["id"])}, got.text
    r = teams["red-e2b"].post("/e2b/volumes", json={"name": "from-e2b"})
    assert r.status_code == 201 and r.json()["name"] == "from-e2b", r.text
    assert op.get(f"/volumes/{r.json()['volumeID']}").json()["name"] == "red/from-e2b"
    assert teams["red-e2b"].delete(f"/e2b/volumes/{r.json()['volumeID']}").status_code == 204

    # the team's own: read, grow, delete; the operator's volume is left untouched
    assert red.get(f"/volumes/{only['id']}/files?path=/").status_code == 200
    assert red.patch("/volumes/only-red", json={"size_mib": 32}).json()["size_mib"] == 32
    assert red.delete("/volumes/only-red").status_code == 204
    assert op.get(f"/volumes/{ops['id']}").json()["name"] == "data"


def test_a_teams_secrets_are_its_own(teams: dict[str, httpx.Client]) -> None:
    red, blue, op = teams["red"], teams["blue"], teams["op"]
    value = "red-value-" + "x" * 20
    host = {"hosts": ["api.example.test"]}
    assert made(red, "/secrets", {"name": "gh", "value": value, **host})["name"] == "gh"
    made(blue, "/secrets", {"name": "gh", "value": "blue-value", **host})
    made(op, "/secrets", {"name": "gh", "value": "op-value", **host})
    made(red, "/secrets", {"name": "only-red", "value": value, **host})
    r = red.post("/secrets", json={"name": "gh", "value": value, **host})
    assert r.status_code == 409 and r.json()["error"]["message"].startswith(
        "a secret named 'gh' exists; rotate it"), r.text
    assert [s["name"] for s in red.get("/secrets").json()["secrets"]] == ["gh", "only-red"]
    assert [s["name"] for s in blue.get("/secrets").json()["secrets"]] == ["gh"]
    listed = op.get("/secrets")
    assert [s["name"] for s in listed.json()["secrets"]] == [
        "blue/gh", "gh", "red/gh", "red/only-red"]
    assert value not in listed.text and "blue-value" not in listed.text
    assert red.get("/secrets/gh").json()["name"] == "gh"

    assert blue.get("/secrets/nope").json() == missing_secret("nope")
    for method, body in (("GET", None), ("PUT", {"value": "stolen"}), ("DELETE", None)):
        got = blue.request(method, "/secrets/only-red", json=body)
        assert (got.status_code, got.json()) == (404, missing_secret("only-red")), method
    # a rotation by blue changed nothing of red's; red rotates and deletes its own
    before = red.get("/secrets/only-red").json()
    r = red.put("/secrets/only-red", json={"value": "rotated"})
    assert r.status_code == 200 and r.json()["updated_at"] > before["updated_at"], r.text
    assert red.delete("/secrets/only-red").status_code == 204
    assert blue.get("/secrets/gh").status_code == 200  # blue's own gh was never touched


def test_a_create_naming_another_teams_volume_or_secret_is_404_and_starts_nothing(
        teams: dict[str, httpx.Client]) -> None:
    red, blue, op = teams["red"], teams["blue"], teams["op"]
    vol = made(red, "/volumes", {"name": "red-only-vol", "size_mib": 16})
    made(red, "/secrets", {"name": "red-only-secret", "value": "v" * 12,
                           "hosts": ["api.example.test"]})
    try:
        for body, answer in (
                ({"volumes": {"/data": vol["id"]}}, missing_volume(vol["id"])),
                ({"volumes": {"/data": "red-only-vol"}}, missing_volume("red-only-vol")),
                ({"volumes": {"/data": {"volume": "red-only-vol", "read_only": True}}},
                 missing_volume("red-only-vol")),
                ({"secrets": {"TOKEN": "red-only-secret"}}, missing_secret("red-only-secret"))):
            r = blue.post("/sandboxes", json=body)
            assert (r.status_code, r.json()) == (404, answer), body
        r = teams["blue-e2b"].post("/e2b/sandboxes", json={
            "templateID": "base", "volumeMounts": [{"name": "red-only-vol", "path": "/d"}]})
        assert r.status_code == 404 and "red-only-vol" in r.json()["message"], r.text
        assert op.get("/sandboxes").json()["sandboxes"] == []
        assert op.get(f"/volumes/{vol['id']}").json()["attached"] == []
    finally:
        assert red.delete(f"/volumes/{vol['id']}").status_code == 204
        assert red.delete("/secrets/red-only-secret").status_code == 204


def test_max_volumes_mib_is_429_naming_the_quota_also_with_ten_creates_at_once(
        teams: dict[str, httpx.Client]) -> None:
    team, op = teams["quota"], teams["op"]

    def create(i: int) -> httpx.Response:
        return team.post("/volumes", json={"name": f"q{i}", "size_mib": 20})

    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        answers = list(pool.map(create, range(10)))
    ids = [a.json()["id"] for a in answers if a.status_code == 201]
    refused = [a for a in answers if a.status_code != 201]

    def over(used: int, needed: int) -> dict:
        return {"error": {
            "code": "quota_exceeded", "message": f"team quota may hold 100 MiB of volumes "
            f"(max_volumes_mib) and holds {used}; this volume needs {needed} more",
            "quota": "max_volumes_mib", "limit": 100, "used": used, "needed": needed,
            "team": "quota"}}

    try:
        assert len(ids) == 5, [a.text for a in answers]
        assert {a.status_code for a in refused} == {429}
        assert all(a.json() == over(100, 20) for a in refused), [a.text for a in refused]
        assert "retry-after" not in refused[0].headers
        assert len(team.get("/volumes").json()["volumes"]) == 5  # nothing else was made
        assert op.get("/teams/quota").json()["usage"]["volumes_mib"] == 100
        r = team.patch(f"/volumes/{ids[0]}", json={"size_mib": 36})
        assert (r.status_code, r.json()) == (429, over(100, 16))
        assert team.get(f"/volumes/{ids[0]}").json()["size_mib"] == 20
        assert team.delete(f"/volumes/{ids.pop()}").status_code == 204
        r = team.patch(f"/volumes/{ids[0]}", json={"size_mib": 36})  # 96 MiB: within
        assert r.status_code == 200 and r.json()["size_mib"] == 36, r.text
        r = team.post("/volumes", json={"name": "one-more", "size_mib": 16})
        assert (r.status_code, r.json()) == (429, over(96, 16))
        # the operator's volumes count against no team
        r = op.post("/volumes", json={"name": "op-big", "size_mib": 512})
        assert r.status_code == 201, r.text
        ids.append(r.json()["id"])
        assert op.get("/teams/quota").json()["usage"]["volumes_mib"] == 96
    finally:
        for vid in ids:
            assert op.delete(f"/volumes/{vid}").status_code == 204


# -- one real sandbox of a team, with its volume and its secret (TAP networking) -----------


@pytest.mark.vm
def test_a_teams_sandbox_mounts_its_volume_and_takes_its_secret(base_image: Path) -> None:
    """In the namespaces of tests/test_secrets.py (skipped where they cannot be made): red's
    sandbox mounts red's ``data`` and its proxy puts red's ``gh`` in its requests, though
    the operator holds a ``gh`` and a ``data`` too."""
    from test_secrets import (CLIENT, INET, REAL, _can_netns, stand_in_internet,
                              start_server, stop_server)

    if (why := can_netns() or _can_netns()) is not None:
        pytest.skip(why)
    with stand_in_internet() as inet:
        h = start_server(inet, base_image)
        red = None
        try:
            op: httpx.Client = h.client  # type: ignore[assignment]
            assert op.post("/teams", json={"name": "red"}).status_code == 201
            key = cli(h.data, "key", "add", "red-key", "--team", "red")
            red = httpx.Client(transport=httpx.HTTPTransport(uds=str(h.data / "api.sock")),
                               base_url="http://hangar", headers={"X-API-Key": key},
                               timeout=300)
            host = ["api.example.test"]
            made(op, "/secrets", {"name": "gh", "value": "the-operator's", "hosts": host})
            made(red, "/secrets", {"name": "gh", "value": REAL, "hosts": host})
            vol = made(red, "/volumes", {"name": "data", "size_mib": 16})
            made(op, "/volumes", {"name": "data", "size_mib": 16})
            sb = made(red, "/sandboxes", {"volumes": {"/data": "data"},
                                          "secrets": {"GITHUB_TOKEN": "gh"}})
            sid = sb["id"]
            assert sb["secrets"] == {"GITHUB_TOKEN": "gh"}
            assert sb["volumes"] == {"/data": {"volume": vol["id"], "read_only": False}}
            assert op.get(f"/sandboxes/{sid}").json()["secrets"] == {"GITHUB_TOKEN": "red/gh"}

            def guest(*args: str) -> str:
                r = red.post(f"/sandboxes/{sid}/exec",  # type: ignore[union-attr]
                             json={"command": args[0], "args": list(args[1:]), "timeout": 60})
                assert r.status_code == 200 and r.json()["exit_code"] == 0, r.text
                return r.json()["stdout"].strip()

            # red's value, not the operator's, reaches the secret's host
            assert guest("python3", "-c", CLIENT, "api.example.test", "443", "GITHUB_TOKEN",
                         "/", INET) == "200 ok"
            assert guest("/bin/sh", "-c", "echo red-wrote > /data/note && sync") == ""
            assert red.delete(f"/sandboxes/{sid}").status_code == 204
            r = red.get("/volumes/data/files", params={"path": "/note"})
            assert (r.status_code, r.content) == (200, b"red-wrote\n")
            assert REAL not in op.get("/secrets").text
        finally:
            if red is not None:
                red.close()
            leaked = stop_server(h)
        assert not leaked, leaked
