"""The REST API's contract: lifecycle, auth, errors, spec, metrics, restarts."""

from __future__ import annotations

import shutil
import signal

import httpx
import pytest

from conftest import Server, cleanup, free_port, make_data_dir, vmm_pids


def test_health_needs_no_key(server: Server) -> None:
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "ok"
    assert body["engine"]["engine"] == "qemu"
    assert body["engine"]["accel"] in ("kvm", "tcg")


@pytest.mark.parametrize("headers", [{}, {"X-API-Key": "wrong"}, {"X-API-Key": ""}])
def test_key_is_required(server: Server, headers: dict[str, str]) -> None:
    for method, path in [("GET", "/sandboxes"), ("POST", "/sandboxes"), ("GET", "/metrics"),
                         ("GET", "/sandboxes/sb-1/files?path=/x")]:
        r = httpx.request(method, server.url + path, headers=headers)
        assert r.status_code == 401, (method, path, r.text)
        assert r.json()["error"]["code"] == "unauthorized"


def test_key_file_is_private_and_never_logged(server: Server) -> None:
    key_file = server.data_dir / "api-key"
    assert key_file.stat().st_mode & 0o777 == 0o600
    assert server.key not in server.log.read_text()


def test_openapi_lists_the_contract(server: Server) -> None:
    spec = httpx.get(server.url + "/openapi.json").json()
    paths = spec["paths"]
    for path, method in [("/sandboxes", "post"), ("/sandboxes", "get"),
                         ("/sandboxes/{sandbox_id}", "get"), ("/sandboxes/{sandbox_id}", "delete"),
                         ("/sandboxes/{sandbox_id}/exec", "post"),
                         ("/sandboxes/{sandbox_id}/exec/stream", "post"),
                         ("/sandboxes/{sandbox_id}/files", "put"),
                         ("/sandboxes/{sandbox_id}/files", "get"), ("/health", "get")]:
        assert method in paths[path], (path, method)
    assert "APIKeyHeader" in spec["components"]["securitySchemes"]
    exec_req = spec["components"]["schemas"]["ExecRequest"]
    assert exec_req["required"] == ["command"]


@pytest.mark.vm
def test_lifecycle(api: httpx.Client) -> None:
    r = api.post("/sandboxes", json={"memory_mib": 384, "metadata": {"owner": "t"}})
    assert r.status_code == 201, r.text
    sb = r.json()
    sid = sb["id"]
    try:
        assert sb["state"] == "running" and sb["memory_mib"] == 384
        assert api.get(f"/sandboxes/{sid}").json()["metadata"] == {"owner": "t"}
        assert sid in [s["id"] for s in api.get("/sandboxes").json()["sandboxes"]]
        mem = api.post(f"/sandboxes/{sid}/exec",
                       json={"command": "awk '/MemTotal/{print $2}' /proc/meminfo"}).json()
        assert 300_000 < int(mem["stdout"]) <= 384 * 1024
        assert len(vmm_pids(sid)) == 1
    finally:
        assert api.delete(f"/sandboxes/{sid}").status_code == 204
    assert api.get(f"/sandboxes/{sid}").status_code == 404
    assert api.delete(f"/sandboxes/{sid}").status_code == 404
    assert sid not in [s["id"] for s in api.get("/sandboxes").json()["sandboxes"]]
    assert vmm_pids(sid) == []


def test_bad_input_is_a_clear_error(api: httpx.Client) -> None:
    cases = [
        (api.post("/sandboxes", json={"memory_mib": 1}), 422),
        (api.post("/sandboxes", json={"vcpus": "many"}), 422),
        (api.post("/sandboxes", json={"nonsense": True}), 422),
        (api.post("/sandboxes", json={"image": "no-such-image"}), 404),
        (api.post("/sandboxes", content=b"{not json", headers={"content-type": "application/json"}), 400),
        (api.post("/sandboxes/sb-000000000000/exec", content=b"command=true",
                  headers={"content-type": "application/x-www-form-urlencoded"}), 400),
        (api.get("/sandboxes/sb-000000000000"), 404),
        (api.delete("/sandboxes/sb-000000000000"), 404),
        (api.post("/sandboxes/sb-000000000000/exec", json={"command": ""}), 422),
        (api.post("/sandboxes/sb-000000000000/exec", json={"command": "true", "timeout": -1}), 422),
    ]
    for r, status in cases:
        assert r.status_code == status, (r.request.url, r.text)
        err = r.json()["error"]
        assert err["code"] and err["message"]
    # What was wrong, in words a curl user reads: where the JSON broke, which header.
    assert "not valid JSON at character 1" in cases[4][0].json()["error"]["message"]
    assert "Content-Type: application/json" in cases[5][0].json()["error"]["message"]


@pytest.mark.vm
def test_metrics(api: httpx.Client, sandbox: str) -> None:
    api.post(f"/sandboxes/{sandbox}/exec", json={"command": "true"})
    text = api.get("/metrics").text
    assert 'hangar_sandboxes{state="running"}' in text
    assert "hangar_exec_seconds_bucket" in text
    assert 'hangar_sandbox_creates_total{outcome="ok"}' in text
    assert 'hangar_engine_info{' in text and 'engine="qemu"' in text


def metric(text: str, name: str, default: float | None = None) -> float:
    """The value of the sample ``name`` (with its labels) in a Prometheus exposition."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    if default is not None:
        return default
    raise AssertionError(f"{name} not in /metrics")


@pytest.mark.vm
def test_capacity_and_error_metrics(api: httpx.Client, sandbox: str) -> None:
    not_found = 'hangar_errors_total{code="not_found"}'
    before = metric(api.get("/metrics").text, not_found, 0.0)
    assert api.get("/sandboxes/sb-000000000000").status_code == 404
    assert api.get("/sandboxes/sb-000000000001").status_code == 404
    text = api.get("/metrics").text
    assert metric(text, not_found) == before + 2
    assert metric(text, "hangar_vmms") >= 1
    assert metric(text, "hangar_vmm_limit") >= metric(text, "hangar_vmms")
    mine = api.get(f"/sandboxes/{sandbox}").json()["memory_mib"] * 2**20
    assert metric(text, "hangar_guest_memory_committed_bytes") >= mine
    assert metric(text, "hangar_guest_memory_budget_bytes") > 0
    assert metric(text, "hangar_data_free_bytes") > 0


@pytest.mark.vm
def test_failed_create_leaves_nothing(base_image) -> None:
    d = make_data_dir(base_image)
    # A cold boot that cannot answer in 0.5 s: without template snapshots, since a
    # restore from one that another server just made may well answer in time.
    srv = Server(d, free_port(), {"HANGAR_BOOT_TIMEOUT_S": "0.5",
                                  "HANGAR_TEMPLATE_SNAPSHOTS": "0"})
    try:
        srv.start()
        with srv.client() as c:
            r = c.post("/sandboxes", json={})
            assert r.status_code == 504, r.text
            assert r.json()["error"]["code"] == "timeout"
            assert c.get("/sandboxes").json()["sandboxes"] == []
        assert list((d / "sandboxes").iterdir()) == []
        assert vmm_pids(str(d)) == []
        assert "Traceback" not in srv.log.read_text()
    finally:
        leaked = cleanup(srv)
        shutil.rmtree(d, ignore_errors=True)
    assert not leaked


@pytest.mark.vm
def test_restarted_server_knows_its_sandboxes(base_image) -> None:
    d = make_data_dir(base_image)
    srv = Server(d, free_port())
    try:
        srv.start()
        with srv.client() as c:
            sid = c.post("/sandboxes", json={}).json()["id"]
            c.put(f"/sandboxes/{sid}/files", params={"path": "/root/keep"}, content=b"kept")
        srv.kill(signal.SIGKILL)
        assert len(vmm_pids(sid)) == 1, "the VM outlives its server"
        srv.start()
        with srv.client() as c:
            assert c.get(f"/sandboxes/{sid}").json()["state"] == "running"
            r = c.post(f"/sandboxes/{sid}/exec", json={"command": "cat /root/keep"})
            assert r.status_code == 200 and r.json()["stdout"] == "kept"
    finally:
        leaked = cleanup(srv)
        shutil.rmtree(d, ignore_errors=True)
    assert not leaked


# -- one error renderer ----------------------------------------------------------------------


@pytest.mark.parametrize(("seconds", "header"), [
    (0, "1"), (0.2, "1"), (1, "1"), (1.0, "1"), (1.01, "2"), (4.5, "5"), (30, "30"),
    ("2.5", "3"), (float("nan"), "1"), (None, "1")])
def test_retry_after_is_whole_seconds_rounded_up_at_least_one(seconds: object,
                                                              header: str) -> None:
    from hangar.error_body import retry_after_header

    assert retry_after_header(seconds) == header


def test_every_asgi_layer_renders_an_error_the_same_way() -> None:
    """The route handlers, a WebSocket denial and the port proxy answer a retryable error
    with the same status, headers and body (one renderer, one rounding rule)."""
    import asyncio
    import json

    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from hangar.api import errors
    from hangar.api.proxy import Refused
    from hangar.error_body import render_error
    from hangar.errors import Busy, LimitExceeded, Timeout

    cases = [Busy("busy now", retry_after=0.25, sandbox_id="sb-1"),
             LimitExceeded("too many", retry_after=2.5, limit="execs"),
             Timeout("unresponsive", retry_after=5.0, sandbox_id="sb-2")]
    app = FastAPI()
    errors.install(app)

    @app.get("/raise/{n}")
    async def _raise(n: int) -> None:
        raise cases[n]

    client = TestClient(app)
    for n, exc in enumerate(cases):
        status, headers, body = render_error(exc)
        r = client.get(f"/raise/{n}")
        assert (r.status_code, r.content) == (status, body)
        assert r.headers["retry-after"] == dict(headers)[b"retry-after"].decode()
        assert r.headers["content-type"] == "application/json"
        assert Refused.of(exc).answer == (status, headers, body)
        denial = errors.error_response(exc.status, exc.code, exc.message,
                                       **errors.context_of(exc))
        assert (denial.status_code, denial.body) == (status, body)
        assert denial.headers["retry-after"] == r.headers["retry-after"]
    doc = json.loads(render_error(cases[0])[2])
    assert doc == {"error": {"code": "busy", "message": "busy now", "sandbox_id": "sb-1",
                             "retry_after": 0.25}}
    assert dict(render_error(cases[0])[1])[b"retry-after"] == b"1"
    assert dict(render_error(cases[1])[1])[b"retry-after"] == b"3"

    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(errors.send_error(send, render_error(cases[2])))
    assert sent[0]["status"] == 504 and (b"retry-after", b"5") in sent[0]["headers"]
    assert sent[1]["body"] == render_error(cases[2])[2]


def test_the_api_app_is_built_from_given_parts_without_a_data_dir(tmp_path) -> None:
    """api/app.py builds routes and middleware only: no data directory, engine or key file
    is touched (the server assembly, hangar.server, does that)."""
    from hangar.api.app import create_app
    from hangar.config import Settings

    d = tmp_path / "data"
    app = create_app(Settings(data_dir=d))
    assert "/sandboxes/{sandbox_id}/files/list" in app.openapi()["paths"]
    assert not d.exists()


def test_a_routing_middleware_sits_between_idempotency_and_the_routes(tmp_path) -> None:
    """The server assembly hands a cluster node's gateway to api/app.py as ``routing``; it
    is built as ``routing(app, state=app.state)`` just outside the routes."""
    from functools import partial

    from fastapi.testclient import TestClient

    from hangar.api.app import create_app
    from hangar.config import Settings

    seen: list[tuple[str, object]] = []

    class Routing:
        def __init__(self, app, node: str, state: object) -> None:
            self.app, self.node, self.state = app, node, state

        async def __call__(self, scope, receive, send) -> None:
            if scope["type"] == "http":
                seen.append((scope["path"], self.node))
            await self.app(scope, receive, send)

    app = create_app(Settings(data_dir=tmp_path / "data"), routing=partial(Routing, node="n1"))
    names = [getattr(m.cls, "func", m.cls).__name__ for m in app.user_middleware]
    assert names == ["E2bHosts", "FrontDoor", "PortProxy", "EnvdGateway", "BodyLimit",
                     "IdempotencyMiddleware", "Routing"]
    with TestClient(app, raise_server_exceptions=False) as client:
        client.get("/openapi.json")
    assert seen == [("/openapi.json", "n1")]
