"""Teams against a real server (split from root, as installed): keys of a team see and act
on their team's sandboxes only (another team's are 404, absent from lists, through Hangar's
API and E2B's), creates count against the team's quotas (429 naming the quota, also with
10 creates at once), and the operator's routes are 403 for a team's key."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from conftest import Server, own_server
from team_support import client, team_keys


@pytest.fixture(scope="module")
def server(base_image: Path) -> Iterator[Server]:
    with own_server(base_image) as srv:
        yield srv


@pytest.fixture(scope="module")
def teams(server: Server) -> Iterator[dict[str, httpx.Client]]:
    """Teams ``red`` (at most 2 sandboxes) and ``blue``, a Hangar key and an E2B key of
    each, and the operator's key."""
    with client(server, server.key) as op:
        r = op.post("/teams", json={"name": "red", "max_sandboxes": 2})
        assert r.status_code == 201, r.text
        assert r.json() == {"name": "red", "created_at": r.json()["created_at"],
                            "max_sandboxes": 2, "max_vcpus": None, "max_memory_mib": None,
                            "max_disk_mib": None, "max_volumes_mib": None,
                            "usage": {"sandboxes": 0, "vcpus": 0, "memory_mib": 0,
                                      "disk_mib": 0, "volumes_mib": 0}}
        assert op.post("/teams", json={"name": "blue"}).status_code == 201
        clients = team_keys(server, {"red": "red", "blue": "blue", "red-e2b": "red",
                                     "blue-e2b": "blue"})
        clients["op"] = op
        try:
            yield clients
        finally:
            for sb in op.get("/sandboxes").json()["sandboxes"]:
                op.delete(f"/sandboxes/{sb['id']}")
            for c in clients.values():
                if c is not op:
                    c.close()


def test_a_team_sees_and_acts_on_its_own_sandboxes_only(teams: dict[str, httpx.Client]
                                                        ) -> None:
    red, blue, op = teams["red"], teams["blue"], teams["op"]
    r = red.post("/sandboxes", json={})
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    try:
        missing = blue.get("/sandboxes/sb-000000000000")
        assert missing.status_code == 404
        for method, path, body in (("GET", f"/sandboxes/{sid}", None),
                                   ("POST", f"/sandboxes/{sid}/exec", {"command": "true"}),
                                   ("GET", f"/sandboxes/{sid}/files?path=/etc/hostname", None),
                                   ("POST", f"/sandboxes/{sid}/timeout", {"timeout_s": 60}),
                                   ("DELETE", f"/sandboxes/{sid}", None)):
            got = blue.request(method, path, json=body)
            assert got.status_code == 404, (path, got.text)
            assert got.json()["error"] == missing.json()["error"] | {
                "message": f"no sandbox {sid}", "sandbox_id": sid}, (path, got.text)
        assert [s["id"] for s in blue.get("/sandboxes").json()["sandboxes"]] == []
        assert [s["id"] for s in red.get("/sandboxes").json()["sandboxes"]] == [sid]
        assert sid in [s["id"] for s in op.get("/sandboxes").json()["sandboxes"]]
        assert op.get(f"/sandboxes/{sid}").json()["team"] == "red"  # the operator sees whose
        r = red.post(f"/sandboxes/{sid}/exec", json={"command": "echo", "args": ["mine"]})
        assert r.json()["stdout"] == "mine\n"
        assert op.post(f"/sandboxes/{sid}/exec", json={"command": "true"}).status_code == 200
    finally:
        assert red.delete(f"/sandboxes/{sid}").status_code == 204


def test_a_teams_e2b_key_lists_only_its_teams_sandboxes(teams: dict[str, httpx.Client]
                                                        ) -> None:
    red, blue = teams["red-e2b"], teams["blue-e2b"]
    r = red.post("/e2b/sandboxes", json={"templateID": "base", "timeout": 120})
    assert r.status_code == 201, r.text
    sid = r.json()["sandboxID"]
    try:
        listed = red.get("/e2b/v2/sandboxes")
        assert isinstance(listed.json(), list), listed.text
        assert [s["sandboxID"] for s in listed.json()] == [sid], listed.text
        assert blue.get("/e2b/v2/sandboxes").json() == []
        assert blue.get("/e2b/sandboxes").json() == []
        assert blue.get(f"/e2b/sandboxes/{sid}").status_code == 404
        assert blue.post(f"/e2b/sandboxes/{sid}/pause").status_code == 404
        assert teams["red"].get(f"/sandboxes/{sid}").status_code == 200  # the same team
    finally:
        assert red.delete(f"/e2b/sandboxes/{sid}").status_code == 204


def test_a_team_at_its_limit_gets_429_naming_the_quota_also_with_ten_creates_at_once(
        teams: dict[str, httpx.Client]) -> None:
    red, op = teams["red"], teams["op"]

    def create(_: int) -> httpx.Response:
        return red.post("/sandboxes", json={})

    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        answers = list(pool.map(create, range(10)))
    made = [a.json()["id"] for a in answers if a.status_code == 201]
    refused = [a for a in answers if a.status_code != 201]
    try:
        assert len(made) == 2, [a.text for a in answers]
        assert {a.status_code for a in refused} == {429}
        assert refused[0].json()["error"] == {
            "code": "quota_exceeded", "message": "team red may hold 2 sandboxes "
            "(max_sandboxes) and holds 2; this sandbox needs 1 more", "quota": "max_sandboxes",
            "limit": 2, "used": 2, "needed": 1, "team": "red"}
        assert "retry-after" not in refused[0].headers  # waiting does not help
        usage = op.get("/teams/red").json()["usage"]
        assert usage["sandboxes"] == 2
        figures = op.get("/metrics").text.splitlines()
        assert 'hangar_team_sandboxes{team="red"} 2.0' in figures
        memory = [float(ln.split()[-1]) for ln in figures
                  if ln.startswith('hangar_team_memory_bytes{team="red"} ')]
        assert memory == [usage["memory_mib"] << 20]
        assert op.delete("/teams/red").status_code == 409
    finally:
        for sid in made:
            assert red.delete(f"/sandboxes/{sid}").status_code == 204
    assert red.post("/sandboxes", json={}).status_code == 201  # room again


def test_the_operators_routes_are_403_for_a_teams_key(teams: dict[str, httpx.Client]
                                                      ) -> None:
    blue = teams["blue"]
    for method, path in (("GET", "/metrics"), ("GET", "/teams"), ("POST", "/teams"),
                         ("GET", "/teams/blue"), ("GET", "/pool"),
                         ("GET", "/e2b/sandboxes/metrics")):
        r = blue.request(method, path, json={} if method == "POST" else None)
        assert r.status_code == 403, (path, r.text)
    assert teams["op"].get("/metrics").status_code == 200
