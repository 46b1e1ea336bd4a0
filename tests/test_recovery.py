"""Restarts lose nothing: the server is SIGKILLed at each step of every lifecycle operation.

One data directory, two sandboxes (a plain one and a user's machine) and a
server process restarted for every step: the test-only hook
``HANGAR_TEST_CRASH_AT=<step>`` (``hangar.core.testhooks``) makes the server
kill itself with SIGKILL at that step. After each restart every sandbox
must settle in a state that answers exec (``running``, or ``sleeping``,
which wakes) or be cleanly gone, with exactly one VMM per running sandbox,
no sandbox folder, snapshot folder or VMM that no record owns, and the
guest's files intact.
"""

from __future__ import annotations

import json
import shutil
import signal
import time
from pathlib import Path
from typing import Callable

import httpx
import pytest

from conftest import Server, cleanup, free_port, make_data_dir, vmm_pids

pytestmark = pytest.mark.vm

SETTLED = ("running", "sleeping")


def run(c: httpx.Client, sid: str, command: str) -> str:
    r = c.post(f"/sandboxes/{sid}/exec", json={"command": command})
    assert r.status_code == 200, r.text
    assert r.json()["exit_code"] == 0, r.json()
    return r.json()["stdout"]


def start(srv: Server, crash: str | None = None) -> None:
    srv.env.pop("HANGAR_TEST_CRASH_AT", None)
    if crash:
        srv.env["HANGAR_TEST_CRASH_AT"] = crash
    srv.start()


RECOVERED = {
    "create.booting": ["unfinished create removed"],
    "snapshot.paused": ["paused VM resumed"],
    "snapshot.saved": ["paused VM resumed", "orphan snapshot folder removed"],
    "restore.stopped": ["interrupted restore will be redone"],
    "restore.restored": ["interrupted restore will be redone"],
    "fork.restored": ["unfinished create removed"],
    "sleep.paused": ["paused VM resumed"],
    "wake.restored": ["interrupted wake undone"],
    "sleep.saved": ["interrupted sleep finished"],
    "sleep.stopped": ["interrupted sleep finished"],
    "delete.stopping": ["sandbox deleted"],
}
"""What the restarted server's recovery must log for each step: proof that the
server died there and that recovery took the path meant for it."""


def crash_at(srv: Server, step: str, call: Callable[[httpx.Client], httpx.Response]) -> None:
    """Restart the server armed to die at ``step``, make the call that reaches it, see it
    die there, and restart it; its recovery must have done what that step needs."""
    srv.kill(signal.SIGKILL)
    offset = srv.log.stat().st_size
    start(srv, step)
    with srv.client() as c:
        try:
            r = call(c)
        except httpx.TransportError:
            pass
        else:
            pytest.fail(f"{step}: the call answered {r.status_code} {r.text[:200]}")
    assert srv.proc is not None
    assert srv.proc.wait(60) == -signal.SIGKILL, f"{step}: the server did not kill itself"
    start(srv)
    with open(srv.log, "rb") as f:
        f.seek(offset)
        lines = [json.loads(x) for x in f.read().decode().splitlines() if x.startswith("{")]
    events = [(x.get("event"), x.get("step")) for x in lines]
    assert ("test hook: killing the server", step) in events, f"{step}: died elsewhere"
    died = events.index(("test hook: killing the server", step))
    after = [e for e, _ in events[died:]]
    for want in RECOVERED[step]:
        assert want in after, f"{step}: recovery did not log {want!r}: {after}"
    assert not [x for x in lines[died:] if x.get("level") == "error"], lines[died:]


def settle(c: httpx.Client, timeout: float = 240) -> dict[str, str]:
    """Sandboxes by state once none is in a transient state."""
    deadline = time.monotonic() + timeout
    while True:
        states = {s["id"]: s["state"] for s in c.get("/sandboxes").json()["sandboxes"]}
        if all(s in SETTLED for s in states.values()):
            return states
        assert time.monotonic() < deadline, f"never settled: {states}"
        time.sleep(0.3)


def machine_state(c: httpx.Client, user: str, want: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while (state := c.get(f"/machines/{user}").json()["state"]) != want:
        assert time.monotonic() < deadline, f"machine is {state}, never {want}"
        time.sleep(0.3)


def consistent(d: Path, c: httpx.Client, expect: set[str], gone: set[str] = frozenset()) -> dict:
    """Assert every sandbox answers or is cleanly gone and nothing is orphaned."""
    states = settle(c)
    assert set(states) == expect, f"listed {states}, expected {expect}"
    running = {s for s, st in states.items() if st == "running"}
    sleeping = set(states) - running
    for sid in running:
        assert run(c, sid, "echo ok") == "ok\n"
        assert len(vmm_pids(sid)) == 1, f"{sid} has {vmm_pids(sid)}"
    for sid in sleeping:
        assert vmm_pids(sid) == [], f"sleeping {sid} holds a VMM"
    assert len(vmm_pids(str(d))) == len(running), "a VMM without a running sandbox"
    assert {p.name for p in (d / "sandboxes").iterdir()} == running
    user_snaps = {s["id"] for s in c.get("/snapshots").json()["snapshots"]}
    folders = {p.name for p in (d / "snapshots").iterdir()}
    assert user_snaps <= folders
    assert len(folders - user_snaps) == len(sleeping), (
        f"snapshot folders {folders}: one per user snapshot {user_snaps} and sleeping sandbox")
    for sid in gone:
        assert c.get(f"/sandboxes/{sid}").status_code == 404
        assert vmm_pids(sid) == []
    return states


def test_a_server_killed_at_any_step_comes_back_consistent(base_image) -> None:
    d = make_data_dir(base_image)
    srv = Server(d, free_port())
    user = "crash-user"
    try:
        start(srv)
        with srv.client() as c:
            r = c.post("/sandboxes", json={"memory_mib": 256, "timeout": 0})
            assert r.status_code == 201, r.text
            a = r.json()["id"]
            r = c.post(f"/machines/{user}", json={"idle_timeout": 3600, "memory_mib": 256})
            assert r.status_code == 201, r.text
            m = r.json()["sandbox_id"]
            run(c, a, "echo A > /root/who")
            run(c, m, "echo M > /root/who")
        both = {a, m}

        # Create: the VMM runs, its agent has not answered.
        crash_at(srv, "create.booting", lambda c: c.post("/sandboxes", json={"memory_mib": 256}))
        with srv.client() as c:
            consistent(d, c, both)

        # Snapshot: paused before saving; saved but not recorded (a partial folder).
        for step in ("snapshot.paused", "snapshot.saved"):
            crash_at(srv, step, lambda c: c.post(f"/sandboxes/{a}/snapshot"))
            with srv.client() as c:
                consistent(d, c, both)
                assert c.get("/snapshots").json()["snapshots"] == []
                assert run(c, a, "cat /root/who") == "A\n"

        with srv.client() as c:
            run(c, a, "echo one > /root/mark")
            r = c.post(f"/sandboxes/{a}/snapshot")
            assert r.status_code == 201, r.text
            snap = r.json()["id"]

        # Restore: the old VM ended; the new one running but not yet recorded.
        for step in ("restore.stopped", "restore.restored"):
            with srv.client() as c:
                run(c, a, "echo two > /root/mark")
            crash_at(srv, step, lambda c: c.post(f"/sandboxes/{a}/restore",
                                                 json={"snapshot_id": snap}))
            with srv.client() as c:
                consistent(d, c, both)
                assert run(c, a, "cat /root/mark") == "one\n", f"{step}: the restore was redone"

        # Fork: the new VM runs; its create never answered, so it must be gone.
        crash_at(srv, "fork.restored", lambda c: c.post(f"/snapshots/{snap}/sandboxes", json={}))
        with srv.client() as c:
            consistent(d, c, both)

        # Sleep, paused before its snapshot: resumed, and put to sleep again.
        crash_at(srv, "sleep.paused", lambda c: c.post(f"/machines/{user}/snapshot"))
        with srv.client() as c:
            machine_state(c, user, "sleeping")
            consistent(d, c, both)

        # Wake, restored but not recorded: back to sleep, then woken again.
        crash_at(srv, "wake.restored", lambda c: c.post(f"/machines/{user}/wake"))
        with srv.client() as c:
            machine_state(c, user, "active")
            consistent(d, c, both)
            assert run(c, m, "cat /root/who") == "M\n"

        # Sleep with its snapshot recorded (VM paused), and with its VMM ended.
        for step in ("sleep.saved", "sleep.stopped"):
            crash_at(srv, step, lambda c: c.post(f"/machines/{user}/snapshot"))
            with srv.client() as c:
                assert c.get(f"/machines/{user}").json()["state"] == "sleeping"
                consistent(d, c, both)
                assert run(c, m, "cat /root/who") == "M\n", "a call wakes it, files intact"

        # Delete: stopping, its VMM still running.
        crash_at(srv, "delete.stopping", lambda c: c.delete(f"/sandboxes/{a}"))
        with srv.client() as c:
            consistent(d, c, {m}, gone={a})
            assert c.delete(f"/machines/{user}").status_code == 204
            assert c.delete(f"/snapshots/{snap}").status_code == 204
            consistent(d, c, set(), gone={m})
        assert list((d / "snapshots").iterdir()) == []
    finally:
        leaked = cleanup(srv)
        shutil.rmtree(d, ignore_errors=True)
    assert not leaked
