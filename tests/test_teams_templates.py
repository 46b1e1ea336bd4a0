"""Teams own machines and E2B templates, against a real server (``hangar.core.machines``,
``hangar.core.builds``): a team's machine and built template are stored under its name, so
two teams may each have ``alice``'s machine or an ``app`` template; another team's is 404
exactly as a missing one is, and absent from lists. The operator's templates and images
are shared (seen and started from, never changed: 403); build events carry the team."""

from __future__ import annotations

import hashlib
import json
import time
import uuid
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
    """Teams ``red`` and ``blue``: a Hangar key and an E2B key of each, and the operator's
    two. Removes every machine, template and sandbox when done, pass or fail."""
    with client(server, server.key) as op:
        for team in ("red", "blue"):
            assert op.post("/teams", json={"name": team}).status_code == 201
        clients = team_keys(server, {"red": "red", "blue": "blue", "red-e2b": "red",
                                     "blue-e2b": "blue", "op-e2b": None})
        clients["op"] = op
        try:
            yield clients
        finally:
            for who in ("red", "blue"):
                for m in clients[who].get("/machines").json()["machines"]:
                    clients[who].delete(f"/machines/{m['user_id']}")
            for who, name in (("red-e2b", "app"), ("blue-e2b", "app"), ("op-e2b", "op-tmpl")):
                clients[who].delete(f"/e2b/templates/{name}")
            for sb in op.get("/sandboxes").json()["sandboxes"]:
                op.delete(f"/sandboxes/{sb['id']}")
            for c in clients.values():
                if c is not op:
                    c.close()


def test_a_teams_machine_is_its_own_and_missing_to_another_team(
        teams: dict[str, httpx.Client]) -> None:
    red, blue, op = teams["red"], teams["blue"], teams["op"]
    r = red.post("/machines/alice", json={"idle_timeout": 600})
    assert r.status_code == 201, r.text
    mine = r.json()
    assert mine["user_id"] == "alice"
    missing = {"error": {"code": "not_found", "message": "user alice has no machine",
                         "user_id": "alice"}}
    for method, path, body in (("GET", "/machines/alice", None),
                               ("POST", "/machines/alice/snapshot", None),
                               ("POST", "/machines/alice/snapshot?wait=false", None),
                               ("POST", "/machines/alice/wake", None),
                               ("POST", "/machines/alice/exec", {"command": "true"}),
                               ("DELETE", "/machines/alice", None)):
        got = blue.request(method, path, json=body)
        assert (got.status_code, got.json()) == (404, missing), (method, path, got.text)
    assert blue.get("/machines").json() == {"machines": []}
    assert [m["user_id"] for m in red.get("/machines").json()["machines"]] == ["alice"]
    assert op.get(f"/sandboxes/{mine['sandbox_id']}").json()["team"] == "red"

    # the same user id in another team is another machine, of that team
    r = blue.post("/machines/alice", json={"idle_timeout": 600})
    assert r.status_code == 201, r.text
    theirs = r.json()
    assert theirs["user_id"] == "alice" and theirs["sandbox_id"] != mine["sandbox_id"]
    assert op.get(f"/sandboxes/{theirs['sandbox_id']}").json()["team"] == "blue"
    assert red.post("/machines/alice").json()["sandbox_id"] == mine["sandbox_id"]  # 200
    time.sleep(3)  # reconcile passes (1 s apart, no team acting) keep both machines
    listed = {m["user_id"]: m["sandbox_id"] for m in op.get("/machines").json()["machines"]}
    assert listed == {"red/alice": mine["sandbox_id"], "blue/alice": theirs["sandbox_id"]}
    r = red.post("/machines/alice/exec", json={"command": "echo", "args": ["red"]})
    assert (r.status_code, r.json()["stdout"]) == (200, "red\n"), r.text
    assert blue.get(f"/sandboxes/{mine['sandbox_id']}").status_code == 404

    assert blue.delete("/machines/alice").status_code == 204
    assert red.get("/machines/alice").json()["sandbox_id"] == mine["sandbox_id"]
    assert red.delete("/machines/alice").status_code == 204
    assert op.get("/machines").json() == {"machines": []}


def _wait(api: httpx.Client, t: str, build: str, timeout_s: float = 600) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        r = api.get(f"/e2b/templates/{t}/builds/{build}/status")
        assert r.status_code == 200, r.text
        if r.json()["status"] in ("ready", "error"):
            return r.json()
        assert time.monotonic() < deadline, r.json()
        time.sleep(0.5)


def _build(api: httpx.Client, t: str, **spec: object) -> str:
    r = api.post("/e2b/v3/templates", json={"name": t})
    assert r.status_code == 202, r.text
    build = r.json()["buildID"]
    r = api.post(f"/e2b/v2/templates/{t}/builds/{build}", json=spec)
    assert r.status_code == 202, r.text
    done = _wait(api, t, build)
    assert done["status"] == "ready", done
    return build


def _events(c: httpx.Client) -> list[dict]:
    """The template build events of the ring that ``c``'s key sees (``Last-Event-ID`` of
    another stream: the whole ring; an event of its own ends the replay)."""
    probe = f"agent.probe.{uuid.uuid4().hex[:8]}"
    assert c.post("/events", json={"kind": probe}).status_code == 201
    seen = []
    with c.stream("GET", "/events", params={"kind": "template.build,agent.probe"},
                  headers={"Last-Event-ID": "another-stream:1"}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                ev = json.loads(line[6:])
                if ev["kind"] == probe:
                    return seen
                if ev["kind"].startswith("template.build."):
                    seen.append(ev)
    raise AssertionError("the stream ended")


def test_a_teams_template_is_its_own_and_the_operators_are_shared_not_changed(
        teams: dict[str, httpx.Client], server: Server) -> None:
    red, blue, op = teams["red-e2b"], teams["blue-e2b"], teams["op-e2b"]
    # the operator's template (built from the base image: no steps), and red's built from it
    _build(op, "op-tmpl", fromImage="e2bdev/base")
    build = _build(red, "app", fromTemplate="op-tmpl", steps=[
        {"type": "RUN", "args": ["echo red > who"], "force": False}])

    # another team: the template is missing, exactly as one never built
    for name in ("app", "nope"):
        gone = {"code": 404, "message": f"template '{name}' was not built here"}
        for method, path, body in (
                ("GET", f"/e2b/templates/{name}/builds/{build}/status", None),
                ("GET", f"/e2b/templates/{name}/builds/{build}/logs", None),
                ("GET", f"/e2b/templates/{name}/tags", None),
                ("GET", f"/e2b/templates/{name}/files/{'0' * 64}", None),
                ("POST", f"/e2b/v2/templates/{name}/builds/{build}",
                 {"fromImage": "e2bdev/base"}),
                ("POST", "/e2b/templates/tags", {"target": name, "tags": ["x"]}),
                ("DELETE", "/e2b/templates/tags", {"name": name, "tags": ["default"]})):
            got = blue.request(method, path, json=body)
            assert (got.status_code, got.json()) == (404, gone), (path, got.text)
        unbuilt = {"code": 404, "message": f"template '{name}' is not built on this server"}
        for path in (f"/e2b/templates/{name}", f"/e2b/templates/aliases/{name}"):
            got = blue.get(path)
            assert (got.status_code, got.json()) == (404, unbuilt), (path, got.text)
        got = blue.delete(f"/e2b/templates/{name}")
        assert (got.status_code, got.json()) == (
            404, {"code": 404, "message": f"no snapshot or template '{name}'"})
        got = blue.post("/e2b/sandboxes", json={"templateID": name})
        assert (got.status_code, got.json()) == (404, {"code": 404, "message": (
            f"template '{name}' is not built on this server: build it with `hangar image "
            f"build {name}` (a recipe) or `hangar template build FILE` (a template), or use "
            "'base'")})
    for path in ("/e2b/templates", "/e2b/v2/templates"):
        listed = {t["templateID"]: t["public"] for t in blue.get(path).json()}
        assert "app" not in listed and listed["op-tmpl"] is True and listed["base"] is True
        listed = {t["templateID"]: t["public"] for t in red.get(path).json()}
        assert listed["app"] is False and listed["op-tmpl"] is True and listed["base"] is True
    listed = {t["templateID"]: t["public"] for t in op.get("/e2b/templates").json()}
    assert listed["red/app"] is False and listed["op-tmpl"] is False  # the operator's view
    assert [t["tag"] for t in red.get("/e2b/templates/app/tags").json()] == ["default"]
    assert red.get("/e2b/templates/aliases/app").json() == {"templateID": "app",
                                                           "public": False}

    # an upload link of red's names its team; it opens red's template alone
    digest = hashlib.sha256(b"red's files").hexdigest()
    link = red.get(f"/e2b/templates/app/files/{digest}").json()
    url = httpx.URL(link["url"])
    expiry, team, mac = url.params["signature"].split(".")
    assert (link["present"], team) == (False, "red")
    with httpx.Client(timeout=60) as anon:
        forged = url.copy_set_param("signature", f"{expiry}.blue.{mac}")
        assert anon.put(forged, content=b"x").status_code == 401
        assert anon.put(url, content=b"x").status_code == 204
    assert red.get(f"/e2b/templates/app/files/{digest}").json() == {"present": True}
    assert (server.data_dir / "builds" / "files" / "red+app" / digest).read_bytes() == b"x"

    # blue's own `app` is another template: a build of it never touches red's
    r = blue.post("/e2b/v3/templates", json={"name": "app"})
    assert r.status_code == 202, r.text
    assert [b["buildID"] for b in blue.get("/e2b/templates/app").json()["builds"]] == [
        r.json()["buildID"]]
    assert blue.delete("/e2b/templates/app").status_code == 204
    assert [b["buildID"] for b in red.get("/e2b/templates/app").json()["builds"]] == [build]

    # the operator's: seen and started from, never changed
    refused = {"code": 403, "message": "template 'op-tmpl' is the operator's: a team may "
               "start sandboxes from it but not build, tag or remove it"}
    op_build = op.get("/e2b/templates/op-tmpl").json()["builds"][0]["buildID"]
    for method, path, body in (
            ("POST", "/e2b/v3/templates", {"name": "op-tmpl"}),
            ("DELETE", "/e2b/templates/op-tmpl", None),
            ("GET", f"/e2b/templates/op-tmpl/builds/{op_build}/status", None),
            ("GET", f"/e2b/templates/op-tmpl/files/{'0' * 64}", None),
            ("POST", "/e2b/templates/tags", {"target": "op-tmpl", "tags": ["x"]})):
        got = red.request(method, path, json=body)
        assert (got.status_code, got.json()) == (403, refused), (path, got.text)
    got = red.delete("/e2b/templates/base")
    assert (got.status_code, got.json()) == (403, {"code": 403, "message": (
        "template 'base' is the operator's: a team may start sandboxes from it but not "
        "build, tag or remove it")})
    assert op.delete("/e2b/templates/base").status_code == 501  # as before teams

    # red starts sandboxes from its own template and from the operator's (both red's)
    for template, expect in (("app", "red\n"), ("op-tmpl", "")):
        r = red.post("/e2b/sandboxes", json={"templateID": template, "timeout": 120})
        assert r.status_code == 201, r.text
        sid = r.json()["sandboxID"]
        try:
            hangar = teams["red"]
            assert hangar.get(f"/sandboxes/{sid}").json()["team"] == "red"
            got = hangar.post(f"/sandboxes/{sid}/exec",
                              json={"command": "sh", "args": ["-c", "cat who 2>/dev/null"],
                                    "cwd": "/home/user"})
            assert got.json()["stdout"] == expect, got.text
        finally:
            assert red.delete(f"/e2b/sandboxes/{sid}").status_code == 204

    # build events carry the team: red's own, none to blue, all to the operator
    red_events = _events(teams["red"])
    assert {e["team"] for e in red_events} == {"red"}
    assert [e["kind"] for e in red_events if e["data"]["build_id"] == build] == [
        "template.build.started", "template.build.sandbox", "template.build.step",
        "template.build.ready"]
    assert all(e["data"]["template"] == "app" for e in red_events)
    assert _events(teams["blue"]) == []
    assert {e["team"] for e in _events(teams["op"])} == {None, "red"}

    assert red.delete("/e2b/templates/app").status_code == 204
    assert red.get("/e2b/templates/app").status_code == 404
    assert op.delete("/e2b/templates/op-tmpl").status_code == 204
