"""Teams against a real server: snapshots belong to the team of the sandbox they were
taken of, events to the team they concern, an operator's key acts for a team with
``X-Hangar-Team``, and E2B's ``/teams`` routes answer for the key's team."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from conftest import Server, own_server
from hangar.client import Hangar
from team_support import cli, client, team_keys


@pytest.fixture(scope="module")
def server(base_image: Path) -> Iterator[Server]:
    with own_server(base_image) as srv:
        yield srv


@pytest.fixture(scope="module")
def teams(server: Server) -> Iterator[dict[str, httpx.Client]]:
    """Teams ``red`` and ``blue``, a Hangar key of each, an E2B key of red's, and the
    operator's key."""
    with client(server, server.key) as op:
        for name in ("red", "blue"):
            assert op.post("/teams", json={"name": name}).status_code == 201
        clients = team_keys(server, {"red": "red", "blue": "blue", "red-e2b": "red"})
        clients["op"] = op
        try:
            yield clients
        finally:
            for sb in op.get("/sandboxes").json()["sandboxes"]:
                op.delete(f"/sandboxes/{sb['id']}")
            for snap in op.get("/snapshots").json()["snapshots"]:
                op.delete(f"/snapshots/{snap['id']}")
            for c in clients.values():
                if c is not op:
                    c.close()


def test_a_snapshot_belongs_to_its_sandboxs_team(teams: dict[str, httpx.Client]) -> None:
    red, blue, op, red_e2b = teams["red"], teams["blue"], teams["op"], teams["red-e2b"]
    r = red.post("/sandboxes", json={})
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    r = red.post(f"/sandboxes/{sid}/snapshot")
    assert r.status_code == 201, r.text
    snap = r.json()["id"]
    assert r.json()["team"] == "red"
    missing = blue.get("/snapshots/snap-000000000000")
    assert missing.status_code == 404
    for method, path, body in (("GET", f"/snapshots/{snap}", None),
                               ("DELETE", f"/snapshots/{snap}", None),
                               ("POST", f"/snapshots/{snap}/sandboxes", {})):
        got = blue.request(method, path, json=body)
        assert got.status_code == 404, (path, got.text)
        assert got.json()["error"] == missing.json()["error"] | {
            "message": f"no snapshot {snap}", "snapshot_id": snap}, (path, got.text)
    assert blue.get("/snapshots").json() == {"snapshots": []}
    assert [s["id"] for s in red.get("/snapshots").json()["snapshots"]] == [snap]
    assert [(s["id"], s["team"]) for s in op.get("/snapshots").json()["snapshots"]] == [
        (snap, "red")]
    # E2B: a snapshot is a template of its team's only
    assert blue.get("/e2b/snapshots").json() == []
    assert [s["snapshotID"] for s in red_e2b.get("/e2b/snapshots").json()] == [snap]
    r = blue.post("/e2b/sandboxes", json={"templateID": snap})
    assert (r.status_code, r.json()["message"].split(":")[0]) == (
        404, f"template '{snap}' is not built on this server"), r.text
    assert op.get("/sandboxes").json()["sandboxes"][0]["id"] == sid  # nothing started
    assert len(op.get("/sandboxes").json()["sandboxes"]) == 1
    # its own team forks it: the fork is red's too
    r = red.post(f"/snapshots/{snap}/sandboxes", json={})
    assert r.status_code == 201, r.text
    assert r.json()["team"] == "red"
    assert red.delete(f"/sandboxes/{r.json()['id']}").status_code == 204
    assert red.delete(f"/snapshots/{snap}").status_code == 204
    assert red.delete(f"/sandboxes/{sid}").status_code == 204


def _events(c: httpx.Client, stream_id: str, marker: str) -> list[dict[str, object]]:
    """Events ``c`` sees, replayed from the ring (``Last-Event-ID`` ``<stream>:0``), up to
    the one whose ``data.marker`` is ``marker``."""
    seen: list[dict[str, object]] = []
    with c.stream("GET", "/events", headers={"Last-Event-ID": f"{stream_id}:0"},
                  timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                ev = json.loads(line[len("data: "):])
                seen.append(ev)
                if ev["data"].get("marker") == marker:
                    return seen
    raise AssertionError(f"no event {marker} in {seen}")


def test_a_team_sees_its_own_events_only(teams: dict[str, httpx.Client]) -> None:
    red, blue, op = teams["red"], teams["blue"], teams["op"]
    r = red.post("/sandboxes", json={})
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    try:
        assert red.post(f"/sandboxes/{sid}/exec", json={"command": "true"}).status_code == 200
        r = blue.post("/events", json={"kind": "agent.task.started", "sandbox_id": sid})
        assert (r.status_code, r.json()["error"]["message"]) == (404, f"no sandbox {sid}")
        r = blue.post("/events", json={"kind": "agent.task.started", "data": {"team": "red"}})
        assert r.status_code == 400, r.text
        mine = red.post("/events", json={"kind": "agent.task.started", "sandbox_id": sid,
                                          "data": {"marker": "red-1"}})
        assert mine.status_code == 201, mine.text
        assert mine.json()["team"] == "red"
        stream_id = mine.json()["id"].split(":")[0]
        assert blue.post("/events", json={"kind": "agent.task.started",
                                          "data": {"marker": "blue-1"}}).json()["team"] == "blue"
        for who, marker in ((red, "red-end"), (blue, "blue-end")):
            assert who.post("/events", json={"kind": "agent.task.ended",
                                             "data": {"marker": marker}}).status_code == 201
        red_saw = _events(red, stream_id, "red-end")
        blue_saw = _events(blue, stream_id, "blue-end")
        op_saw = _events(op, stream_id, "blue-end")
        assert {e["team"] for e in red_saw} == {"red"}
        assert {e["team"] for e in blue_saw} == {"blue"}
        kinds = [(e["kind"], e["sandbox_id"]) for e in red_saw]
        assert ("sandbox.created", sid) in kinds and ("exec.finished", sid) in kinds
        assert not any(e["sandbox_id"] == sid for e in blue_saw)
        assert [e["data"].get("marker") for e in blue_saw] == ["blue-1", "blue-end"]
        markers = [e["data"].get("marker") for e in op_saw if e["kind"].startswith("agent.")]
        assert markers == ["red-1", "blue-1", "red-end", "blue-end"]
        r = blue.get("/events", params={"sandbox_id": sid})
        assert (r.status_code, r.json()["error"]["message"]) == (404, f"no sandbox {sid}")
    finally:
        assert red.delete(f"/sandboxes/{sid}").status_code == 204


def test_the_operator_acts_for_a_team_with_x_hangar_team(server: Server,
                                                         teams: dict[str, httpx.Client]
                                                         ) -> None:
    red, blue, op = teams["red"], teams["blue"], teams["op"]
    r = red.post("/sandboxes", json={})
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    try:
        as_blue = op.get("/sandboxes", headers={"X-Hangar-Team": "blue"})
        assert as_blue.json() == {"sandboxes": []}, as_blue.text
        as_red = op.get("/sandboxes", headers={"X-Hangar-Team": "red"})
        assert [s["id"] for s in as_red.json()["sandboxes"]] == [sid]
        r = op.get("/metrics", headers={"X-Hangar-Team": "red"})  # as red: red's routes only
        assert r.status_code == 403, r.text
        r = op.get("/sandboxes", headers={"X-Hangar-Team": "nosuch"})
        assert (r.status_code, r.json()["error"]["message"]) == (
            404, "no team 'nosuch' (X-Hangar-Team)")
        r = blue.get("/sandboxes", headers={"X-Hangar-Team": "red"})
        assert (r.status_code, r.json()["error"]["message"]) == (
            403, "a key of team blue cannot act for another team")
        assert red.get("/sandboxes", headers={"X-Hangar-Team": "red"}).status_code == 200
        r = httpx.get(server.url + f"/e2b/sandboxes/{sid}",
                      headers={"X-API-Key": server.key, "X-Hangar-Team": "blue"})
        assert (r.status_code, r.json()) == (404, {"code": 404,
                                                   "message": f"no sandbox {sid}"})
    finally:
        assert red.delete(f"/sandboxes/{sid}").status_code == 204


def test_e2b_teams_answer_for_the_keys_team(server: Server,
                                            teams: dict[str, httpx.Client]) -> None:
    red, op = teams["red-e2b"], teams["op"]
    key = red.headers["X-API-Key"]
    assert red.get("/e2b/teams").json() == [
        {"teamID": "red", "name": "red", "apiKey": key, "isDefault": True}]
    assert sorted((t["teamID"], t["apiKey"], t["isDefault"])
                  for t in op.get("/e2b/teams").json()) == [("blue", "", False),
                                                            ("red", "", False)]
    r = red.get("/e2b/teams/blue/metrics")
    assert (r.status_code, r.json()) == (404, {"code": 404, "message": "no team 'blue'"})
    point, = red.get("/e2b/teams/red/metrics").json()
    assert point["concurrentSandboxes"] == 0
    assert set(point) == {"timestamp", "timestampUnix", "concurrentSandboxes",
                          "sandboxStartRate"}
    r = red.get("/e2b/teams/red/metrics/max", params={"metric": "concurrent_sandboxes"})
    assert r.status_code == 501, r.text


def test_hangar_status_shows_each_teams_use(server: Server,
                                            teams: dict[str, httpx.Client]) -> None:
    assert teams["op"].patch("/teams/blue", json={"max_sandboxes": 3}).status_code == 200
    lines = cli(server.data_dir, "status", url=server.url, key=server.key).splitlines()
    assert [ln for ln in lines if ln.startswith("team ")] == [
        "team blue: 0 sandboxes (of 3), 0 vCPUs, 0 MiB of memory, 0 MiB of disk, 0 MiB of "
        "volumes",
        "team red: 0 sandboxes, 0 vCPUs, 0 MiB of memory, 0 MiB of disk, 0 MiB of volumes"]
    shown = cli(server.data_dir, "status", url=server.url,
                key=teams["red"].headers["X-API-Key"])
    assert shown.startswith("Hangar ")  # the health line, and the engine's facts
    assert "team " not in shown and "warm pool" not in shown


def test_hangar_ls_names_each_sandboxs_team_for_the_operator(
        server: Server, teams: dict[str, httpx.Client]) -> None:
    made = teams["red"].post("/sandboxes", json={})
    assert made.status_code == 201, made.text
    sid = made.json()["id"]
    try:
        def table(key: str) -> list[list[str]]:  # rich's rows, cell by cell
            shown = cli(server.data_dir, "ls", url=server.url, key=key, width=200)
            return [[c.strip() for c in re.split("[┃│]", ln) if c.strip()]
                    for ln in shown.splitlines() if "┃" in ln or "│" in ln]

        rows = table(server.key)
        assert rows[0][-1] == "team", rows[0]
        assert [r[-1] for r in rows if r[0] == sid] == ["red"]
        mine = table(teams["red"].headers["X-API-Key"])  # a team's own list: its own only
        assert [(r[0], r[-1]) for r in mine[1:]] == [(sid, "red")]
    finally:
        assert teams["op"].delete(f"/sandboxes/{sid}").status_code == 204


def test_a_team_is_removed_only_once_it_holds_nothing(server: Server,
                                                     teams: dict[str, httpx.Client]) -> None:
    op = teams["op"]
    assert op.post("/teams", json={"name": "green"}).status_code == 201
    cli(server.data_dir, "key", "add", "green-key", "--team", "green")
    # the operator makes them on green's behalf: X-Hangar-Team, the SDK's team=
    r = op.post("/volumes", json={"name": "v", "size_mib": 16},
                headers={"X-Hangar-Team": "green"})
    assert (r.status_code, r.json()["name"]) == (201, "v"), r.text
    with Hangar(server.url, server.key, team="green") as as_green:
        assert as_green.create_secret("s", "x", ["example.com"]).name == "s"
        r = op.delete("/teams/green")
        assert (r.status_code, r.json()["error"]) == (409, {
            "code": "conflict", "message": "team green holds 1 volume, 1 secret, 1 key "
            "(green-key: hangar key rm NAME); delete them first", "team": "green",
            "volumes": 1, "secrets": 1, "keys": 1})
        vol = next(v for v in op.get("/volumes").json()["volumes"] if v["name"] == "green/v")
        assert op.delete(f"/volumes/{vol['id']}").status_code == 204  # by id
        as_green.delete_secret("s")  # by the name the team gave it
    assert [s["name"] for s in op.get("/secrets").json()["secrets"]] == []
    cli(server.data_dir, "key", "rm", "green-key")
    assert op.delete("/teams/green").status_code == 204
