"""E2B's control plane: the unmodified ``e2b`` SDK (the pinned pair of pyproject's test extra)
against a real server and real VMs.

The SDK is configured only by E2B's environment variables (``E2B_API_URL`` =
the server's ``/e2b``, ``E2B_API_KEY`` = a key made by ``hangar key add NAME
--e2b``, ``E2B_SANDBOX_URL`` = its ``/e2b/envd``). What a sandbox holds is
checked through Hangar's own API (``exec``), so these tests need only the
control plane.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta

import httpx
import pytest
from conftest import SRC, Server, Waits, wait_for

e2b = pytest.importorskip("e2b")
from e2b import (  # noqa: E402
    AsyncSandbox, AuthenticationException, Sandbox, SandboxException, SandboxQuery, SandboxState,
)
from e2b.exceptions import SecretException  # noqa: E402

KEY_FORMAT = re.compile(r"^e2b_[0-9a-f]{40}$")


def hangar_cli(server: Server, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(SRC), "HANGAR_DATA_DIR": str(server.data_dir)}
    return subprocess.run([sys.executable, "-m", "hangar.cli", *args], env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def e2b_key(server: Server) -> str:
    """A key made by ``hangar key add NAME --e2b`` (in E2B's format)."""
    r = hangar_cli(server, "key", "add", f"e2b-{uuid.uuid4().hex[:8]}", "--e2b")
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


@pytest.fixture(autouse=True)
def e2b_env(server: Server, e2b_key: str) -> Iterator[None]:
    """The three variables a program written for E2B needs, and no others of E2B's."""
    saved = {k: os.environ.get(k) for k in (
        "E2B_API_URL", "E2B_API_KEY", "E2B_SANDBOX_URL", "E2B_DOMAIN", "E2B_DEBUG")}
    os.environ.update({"E2B_API_URL": server.url + "/e2b", "E2B_API_KEY": e2b_key,
                       "E2B_SANDBOX_URL": server.url + "/e2b/envd"})
    os.environ.pop("E2B_DOMAIN", None)
    os.environ.pop("E2B_DEBUG", None)
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def run(api: httpx.Client, sid: str, command: str) -> dict:
    """Run ``command`` in the sandbox through Hangar's own API."""
    r = api.post(f"/sandboxes/{sid}/exec", json={"command": command, "timeout": 120})
    assert r.status_code == 200, r.text
    return r.json()


# -- no VM ------------------------------------------------------------------------------------

def test_hangar_key_add_e2b_prints_a_key_in_e2bs_format_that_the_server_accepts(
        e2b_key: str) -> None:
    assert KEY_FORMAT.match(e2b_key), e2b_key
    assert isinstance(Sandbox.list().next_items(), list)


def test_a_wrong_key_is_the_sdks_authentication_error() -> None:
    with pytest.raises(AuthenticationException, match="401"):
        Sandbox.list(api_key="e2b_" + "0" * 40).next_items()


def test_a_route_hangar_does_not_serve_is_a_clear_501(server: Server, e2b_key: str) -> None:
    with pytest.raises(SecretException,
                       match=r"^501: Hangar does not serve E2B's POST /secrets: Hangar has no "
                             r"secrets store"):
        e2b.Secret.create("token", "value")
    with httpx.Client(base_url=server.url, headers={"X-API-Key": e2b_key}) as c:
        r = c.get("/e2b/teams/t/metrics/max")
        assert (r.status_code, r.json()) == (501, {
            "code": 501, "message": "Hangar does not serve E2B's GET /teams/{teamID}/metrics/"
            "max: Hangar keeps no history of a team's figures: GET /teams/{teamID}/metrics "
            "answers the figures now, and /metrics' hangar_team_* gauges are for a scraper. "
            "See docs/e2b.md for what it serves."})
        r = c.get("/e2b/no/such/route")
        assert r.status_code == 404
        assert r.json() == {"code": 404, "message": "E2B's API has no route GET /no/such/route; "
                            "see docs/e2b.md for the routes Hangar serves under /e2b"}
        r = c.put("/e2b/sandboxes/sb-000000000000")
        assert r.status_code == 405 and r.headers["allow"] == "DELETE, GET"
        # envd's prefix is never the control plane's to answer
        assert "E2B's API" not in c.get("/e2b/envd/health").text
        assert httpx.get(server.url + "/e2b/health").status_code == 204


def test_a_create_with_an_mcp_gateway_gets_e2bs_error_and_makes_nothing() -> None:
    tag = uuid.uuid4().hex[:8]
    with pytest.raises(SandboxException, match="^400: mcp: Failed to start MCP gateway"):
        Sandbox.create("base", metadata={"suite": tag}, mcp={"invalid_server": {}})
    assert Sandbox.list(query=SandboxQuery(metadata={"suite": tag})).next_items() == []


def test_allow_internet_access_true_alone_is_the_servers_default() -> None:
    """Older SDKs send ``allow_internet_access: true`` with every create: it asks nothing
    (a create from a snapshot, which keeps the snapshot's policy, is then not refused)."""
    from hangar.api.e2b import views
    from hangar.api.e2b.models import NetworkConfig

    assert views.policy(True, None) is None
    assert views.policy(None, NetworkConfig()) is None
    assert views.policy(False, None) == {"egress": "internet", "allow": [],
                                         "deny": ["0.0.0.0/0"]}


def test_templates_are_hangars_images_and_a_missing_one_is_a_404_naming_it(
        server: Server, e2b_key: str) -> None:
    with httpx.Client(base_url=server.url + "/e2b", headers={"X-API-Key": e2b_key}) as c:
        listed = {t["templateID"]: t for t in c.get("/templates").json()}
        assert listed["base"]["buildStatus"] == "ready"
        assert c.get("/templates/base").json()["builds"][0]["status"] == "ready"
    with pytest.raises(SandboxException,
                       match=r"^404: template 'no-such-template' is not built on this server"):
        Sandbox.create("no-such-template")
    if (server.data_dir / "images" / "code-interpreter").exists():
        # built here: the code interpreter's default name is that image
        with httpx.Client(base_url=server.url + "/e2b", headers={"X-API-Key": e2b_key}) as c:
            assert c.get("/templates/aliases/code-interpreter-v1").json() == {
                "templateID": "code-interpreter", "public": True}
            got = c.get("/templates/code-interpreter-v1").json()
            assert got["templateID"] == "code-interpreter"
            assert "code-interpreter-v1" in got["names"]
        return
    with pytest.raises(SandboxException, match=r"^404: template 'code-interpreter-v1' "
                                               r"\(Hangar's image 'code-interpreter'\) is "
                                               r"not built on this server: build it with "
                                               r"`hangar image build code-interpreter`"):
        Sandbox.create("code-interpreter-v1")


# -- real VMs ---------------------------------------------------------------------------------

def metrics_under_load(server: Server, sbx: Sandbox) -> tuple[object, object]:
    """(idle sample, sample while a guest process spins a CPU and holds 96 MiB). The busy
    sample is the first that shows both, taken every 2 s while the load runs (its start
    under emulation on a busy host takes a few seconds)."""
    idle = sbx.get_metrics()[0]
    load = "import time\nb = b'x' * (96 << 20)\nt = time.time() + 60\nwhile time.time() < t: pass"

    def spin() -> None:
        with server.client() as c:
            c.post(f"/sandboxes/{sbx.sandbox_id}/exec",
                   json={"command": "python3", "args": ["-c", load], "timeout": 90})

    thread = threading.Thread(target=spin)
    thread.start()
    deadline = time.monotonic() + 50
    while True:
        time.sleep(2)
        busy = sbx.get_metrics()[0]
        loaded = (busy.cpu_used_pct >= idle.cpu_used_pct + 25
                  and busy.mem_used >= idle.mem_used + (64 << 20))
        if loaded or time.monotonic() > deadline:
            break
    with server.client() as c:  # end the load now rather than in a minute
        run(c, sbx.sandbox_id, "pkill -f '^python3 -c import time' || true")
    thread.join()
    return idle, busy


@pytest.mark.vm
def test_sync_sdk_drives_a_sandbox_through_its_life(server: Server, api: httpx.Client) -> None:
    tag = uuid.uuid4().hex[:8]
    sbx = Sandbox.create("base", metadata={"suite": tag}, envs={"GREETING": "hi"}, timeout=300)
    sid = sbx.sandbox_id
    child: Sandbox | None = None
    try:
        rec = api.get(f"/sandboxes/{sid}").json()
        assert (rec["state"], rec["image"], rec["metadata"]) == ("running", "base",
                                                                 {"suite": tag})
        info = sbx.get_info()
        assert (info.state, info.template_id, info.name, info.metadata) == (
            SandboxState.RUNNING, "base", "base", {"suite": tag})

        again = Sandbox.connect(sid)
        assert again.sandbox_id == sid

        sbx.set_timeout(900)
        expires = api.get(f"/sandboxes/{sid}").json()["expires_at"]
        assert abs(expires - (time.time() + 900)) < 60

        # E2B's older routes, which this SDK no longer calls, answer as the spec says
        with httpx.Client(base_url=server.url + "/e2b",
                          headers={"X-API-Key": os.environ["E2B_API_KEY"]}) as c:
            assert sid in [s["sandboxID"] for s in c.get("/sandboxes").json()]
            assert c.post(f"/sandboxes/{sid}/refreshes", json={"duration": 10}).status_code \
                == 204
            assert api.get(f"/sandboxes/{sid}").json()["expires_at"] == expires  # only extends
            r = c.post(f"/sandboxes/{sid}/resume", json={"timeout": 60})
            assert (r.status_code, r.json()) == (409, {
                "code": 409, "message": f"sandbox {sid} is already running"})
            r = c.post(f"/sandboxes/{sid}/connect", json={"timeout": 60})
            assert r.status_code == 200 and r.json()["sandboxID"] == sid
            token, traffic = r.json()["envdAccessToken"], r.json()["trafficAccessToken"]
            assert r.json()["envdVersion"] == "0.6.4"
            # two capabilities, two values (docs/security.md, class 4)
            assert re.fullmatch(r"[0-9a-f]{64}", token) and re.fullmatch(r"[0-9a-f]{64}", traffic)
            assert token != traffic and traffic == sbx.traffic_access_token

        found = Sandbox.list(query=SandboxQuery(metadata={"suite": tag})).next_items()
        assert [s.sandbox_id for s in found] == [sid]
        assert Sandbox.list(query=SandboxQuery(metadata={"suite": "other"})).next_items() == []

        idle, busy = metrics_under_load(server, sbx)
        assert busy.cpu_used_pct >= idle.cpu_used_pct + 25, (idle, busy)
        assert busy.mem_used >= idle.mem_used + (64 << 20), (idle, busy)
        assert 0 < busy.disk_used < busy.disk_total and busy.cpu_count >= 1
        with httpx.Client(base_url=server.url + "/e2b",
                          headers={"X-API-Key": os.environ["E2B_API_KEY"]},
                          timeout=120) as c:  # a guest sample under load: seconds
            many = c.get("/sandboxes/metrics",
                         params={"sandbox_ids": f"{sid},sb-000000000000"}).json()
            assert list(many["sandboxes"]) == [sid]
            # startedAfter its own startedAt lists it, a microsecond later does not (the
            # shown time is rounded: compared as floats, 38 % of sandboxes dropped out)
            mine = {"metadata": f"suite={tag}"}
            started = c.get("/v2/sandboxes", params=mine).json()[0]["startedAt"]
            later = (datetime.fromisoformat(started) + timedelta(microseconds=1)).isoformat()
            assert [s["sandboxID"] for s in c.get("/v2/sandboxes", params={
                **mine, "startedAfter": started}).json()] == [sid]
            assert c.get("/v2/sandboxes", params={**mine, "startedAfter": later}).json() == []

        # pause keeps a file and a running process; connect resumes it
        pid = run(api, sid, "echo kept > /root/e2b-note; "
                            "nohup sleep 900 >/dev/null 2>&1 & echo $!")["stdout"].strip()
        assert sbx.pause() is True
        assert api.get(f"/sandboxes/{sid}").json()["state"] == "sleeping"
        paused = Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED],
                                                 metadata={"suite": tag})).next_items()
        assert [(s.sandbox_id, s.state) for s in paused] == [(sid, SandboxState.PAUSED)]
        assert sbx.get_metrics() == []
        assert Sandbox.pause(sid) is False  # already paused
        Sandbox.connect(sid, timeout=600)
        assert api.get(f"/sandboxes/{sid}").json()["state"] == "running"
        out = run(api, sid, f"cat /root/e2b-note; kill -0 {pid} && echo alive")["stdout"]
        assert out == "kept\nalive\n"

        # a named snapshot, then a new sandbox from it by its name
        with pytest.raises(SandboxException, match=r"^400: name: 'snap-0123456789ab' is not"):
            sbx.create_snapshot(name="snap-0123456789ab")  # an id's form
        snap = sbx.create_snapshot(name=f"note-{tag}")
        assert snap.names == [f"note-{tag}"]
        assert [s.snapshot_id for s in Sandbox.list_snapshots(name=f"note-{tag}").next_items()] \
            == [snap.snapshot_id]
        assert Sandbox.list_snapshots(name=f"note-{tag}-not").next_items() == []
        child = Sandbox.create(f"note-{tag}", timeout=300)
        assert child.sandbox_id != sid
        assert run(api, child.sandbox_id, "cat /root/e2b-note")["stdout"] == "kept\n"
        assert child.get_info().metadata == {}
        child.kill()
        child = None
        assert Sandbox.delete_snapshot(snap.snapshot_id) is True

        # served (tests/test_egress.py); this suite's server gives guests no NIC
        with pytest.raises(SandboxException, match=r"^409: sandbox sb-[0-9a-f]+ has no network"):
            sbx.update_network({"deny_out": ["0.0.0.0/0"]})

        sbx.kill()
        assert api.get(f"/sandboxes/{sid}").status_code == 404
        assert Sandbox.kill(sid) is False
    finally:
        for s in (child, sbx):
            if s is not None:
                api.delete(f"/sandboxes/{s.sandbox_id}")


@pytest.mark.vm
def test_async_sdk_creates_connects_lists_pauses_on_timeout_and_kills(
        api: httpx.Client) -> None:
    tag = uuid.uuid4().hex[:8]

    async def main() -> str:
        sbx = await AsyncSandbox.create("base", metadata={"suite": tag}, timeout=300,
                                        lifecycle={"on_timeout": "pause"})
        try:
            again = await AsyncSandbox.connect(sbx.sandbox_id)
            assert again.sandbox_id == sbx.sandbox_id
            info = await sbx.get_info()
            assert info.state == SandboxState.RUNNING and info.lifecycle is not None
            found = await AsyncSandbox.list(query=SandboxQuery(metadata={"suite": tag})
                                            ).next_items()
            assert [s.sandbox_id for s in found] == [sbx.sandbox_id]
            # autoPause: when its time runs out, it is paused, not removed
            await sbx.set_timeout(3)
            deadline = time.monotonic() + 180
            while api.get(f"/sandboxes/{sbx.sandbox_id}").json()["state"] != "sleeping":
                assert time.monotonic() < deadline, "the sandbox did not pause on timeout"
                await asyncio.sleep(1)
            assert (await sbx.get_info()).state == SandboxState.PAUSED
            assert api.get(f"/sandboxes/{sbx.sandbox_id}").json()["expires_at"] is None
            # any call wakes it (E2B's auto-resume), and it gets its create's 300 s back
            assert run(api, sbx.sandbox_id, "echo awake")["stdout"] == "awake\n"
            while (expires := api.get(f"/sandboxes/{sbx.sandbox_id}").json()["expires_at"]
                   ) is None:
                assert time.monotonic() < deadline + 60, "no time limit after the wake"
                await asyncio.sleep(0.5)
            assert abs(expires - (time.time() + 300)) < 30
            assert (await sbx.get_info()).state == SandboxState.RUNNING
            assert await sbx.kill() is True
            return sbx.sandbox_id
        finally:
            api.delete(f"/sandboxes/{sbx.sandbox_id}")

    sid = asyncio.run(main())
    assert api.get(f"/sandboxes/{sid}").status_code == 404


@pytest.mark.vm
def test_fork_starts_a_copy_and_keeps_the_source_running(api: httpx.Client) -> None:
    sbx = Sandbox.create("base", timeout=300)
    forks: list[object] = []
    try:
        run(api, sbx.sandbox_id, "echo forked > /root/e2b-fork")
        forks = sbx.fork(count=1)
        assert len(forks) == 1 and isinstance(forks[0], Sandbox), forks
        assert run(api, forks[0].sandbox_id, "cat /root/e2b-fork")["stdout"] == "forked\n"
        assert api.get(f"/sandboxes/{sbx.sandbox_id}").json()["state"] == "running"
        assert Sandbox.list_snapshots(sandbox_id=sbx.sandbox_id).next_items() == []
    finally:
        for s in (*forks, sbx):
            if isinstance(s, Sandbox):
                api.delete(f"/sandboxes/{s.sandbox_id}")


@pytest.mark.vm
def test_connect_extends_a_running_sandbox_and_wakes_one_a_pause_is_putting_to_sleep(
        server: Server, api: httpx.Client, e2b_key: str, waits: Waits) -> None:
    """Core's verbs behind E2B's routes: connect on a running sandbox only ever extends its
    time to live (200); a pause stops its clock; a connect sent while the pause is under way
    waits for it to settle, then wakes the sandbox with the connect's time to live (201)."""
    def expires(sid: str) -> float | None:
        return api.get(f"/sandboxes/{sid}").json()["expires_at"]

    with httpx.Client(base_url=server.url + "/e2b", headers={"X-API-Key": e2b_key},
                      timeout=waits.vm(4)) as c:
        r = c.post("/sandboxes", json={"templateID": "base", "timeout": 120})
        assert r.status_code == 201, r.text
        sid = r.json()["sandboxID"]
        try:
            r = c.post(f"/sandboxes/{sid}/connect", json={"timeout": 600})
            assert (r.status_code, r.json()["sandboxID"]) == (200, sid)
            extended = expires(sid)
            assert extended is not None and abs(extended - (time.time() + 600)) < 30
            assert c.post(f"/sandboxes/{sid}/connect", json={"timeout": 30}).status_code == 200
            assert expires(sid) == extended  # never shortened

            paused: dict[str, httpx.Response] = {}

            def pause() -> None:
                with httpx.Client(base_url=c.base_url, headers=c.headers,
                                  timeout=waits.vm(4)) as c2:
                    paused["r"] = c2.post(f"/sandboxes/{sid}/pause")

            thread = threading.Thread(target=pause)
            thread.start()
            wait_for(lambda: api.get(f"/sandboxes/{sid}").json()["state"] != "running",
                     waits.vm(1), "the pause to begin", every=0.02)
            r = c.post(f"/sandboxes/{sid}/connect", json={"timeout": 900})
            thread.join()
            assert paused["r"].status_code == 204, paused["r"].text
            assert (r.status_code, r.json()["sandboxID"]) == (201, sid), r.text
            rec = api.get(f"/sandboxes/{sid}").json()
            assert rec["state"] == "running" and abs(rec["expires_at"] - (time.time() + 900)) < 60

            # paused: no time limit; a connect gives it its own
            assert c.post(f"/sandboxes/{sid}/pause").status_code == 204
            rec = api.get(f"/sandboxes/{sid}").json()
            assert (rec["state"], rec["expires_at"]) == ("sleeping", None)
            r = c.post(f"/sandboxes/{sid}/connect", json={"timeout": 300})
            assert r.status_code == 201, r.text
            assert abs(expires(sid) - (time.time() + 300)) < 60
        finally:
            api.delete(f"/sandboxes/{sid}")


def test_a_filesystem_only_pause_at_odds_with_its_mode_or_with_auto_resume_is_a_400(
        server: Server, e2b_key: str) -> None:
    """Checked before any sandbox is looked up or made: ``memory`` and ``mode`` must agree,
    and an auto-pause that keeps the filesystem alone cannot be resumed by traffic."""
    with httpx.Client(base_url=server.url + "/e2b", headers={"X-API-Key": e2b_key}) as c:
        r = c.post("/sandboxes/sb-000000000000/pause", json={"memory": False, "mode": "full"})
        assert (r.status_code, r.json()) == (400, {
            "code": 400, "message": "memory: false contradicts mode: full"})
        tag = uuid.uuid4().hex[:8]
        r = c.post("/v2/sandboxes", json={
            "templateID": "base", "autoPause": True, "autoPauseMemory": False,
            "autoResume": {"enabled": True}, "metadata": {"suite": tag}})
        assert (r.status_code, r.json()) == (400, {
            "code": 400, "message": "autoResume: a sandbox that auto-pauses with "
            "autoPauseMemory false keeps its filesystem alone and is resumed only by connect "
            "or resume, never by traffic"})
    assert Sandbox.list(query=SandboxQuery(metadata={"suite": tag})).next_items() == []


@pytest.mark.vm
def test_a_filesystem_only_pause_keeps_the_files_and_connect_boots_the_guest_cold(
        api: httpx.Client, waits: Waits) -> None:
    """``keep_memory: false`` at the end of its time to live (``autoPauseMemory``) and by
    ``pause``: the disk alone is kept, no traffic resumes it, and connect boots the guest
    cold from that disk (the file kept, the process gone, a new boot id, user ``user``)."""
    sbx = Sandbox.create("base", timeout=300,
                         lifecycle={"on_timeout": {"action": "pause", "keep_memory": False}})
    sid = sbx.sandbox_id
    try:
        sbx.files.write("/home/user/kept.txt", "kept")
        boot_id = sbx.files.read("/proc/sys/kernel/random/boot_id")
        pid = run(api, sid, "nohup sleep 900 >/dev/null 2>&1 & echo $!")["stdout"].strip()

        sbx.set_timeout(0)  # E2B's: its time runs out now, and it pauses
        wait_for(lambda: api.get(f"/sandboxes/{sid}").json()["state"] == "sleeping",
                 waits.vm(4), "the auto-pause")
        assert sbx.get_info().state == SandboxState.PAUSED and not sbx.is_running()
        with pytest.raises(SandboxException, match="paused with its filesystem alone"):
            sbx.files.read("/home/user/kept.txt")  # traffic does not resume it
        assert api.get(f"/sandboxes/{sid}").json()["state"] == "sleeping"

        resumed = sbx.connect(timeout=300)
        assert resumed.sandbox_id == sid and resumed.is_running()
        assert resumed.files.read("/home/user/kept.txt") == "kept"
        assert resumed.files.read("/proc/sys/kernel/random/boot_id") != boot_id
        assert run(api, sid, f"kill -0 {pid} 2>/dev/null || echo gone")["stdout"] == "gone\n"
        assert resumed.commands.run("whoami").stdout == "user\n"

        assert resumed.pause(keep_memory=False) is True
        assert api.get(f"/sandboxes/{sid}").json()["state"] == "sleeping"
        assert not resumed.is_running()
        with pytest.raises(SandboxException, match="paused with its filesystem alone"):
            resumed.commands.run("true")
    finally:
        api.delete(f"/sandboxes/{sid}")
