"""Restarts lose nothing: the server is SIGKILLed at each step of every lifecycle operation.

One data directory, two sandboxes (a plain one and a user's machine) and a
server process restarted for every step: the test-only hook
``HANGAR_TEST_CRASH_AT=<step>`` (``hangar.core.testhooks``) makes the server
kill itself with SIGKILL at that step. After each restart every sandbox
must settle in a state that answers exec (``running``, or ``sleeping``,
which wakes) or be cleanly gone, with exactly one VMM per running sandbox,
no sandbox folder, snapshot folder, VMM or VMM cgroup that no record owns,
and the guest's files intact.
"""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path
from typing import Callable

import httpx
import pytest

from conftest import (Server, Waits, cleanup, free_port, make_data_dir, vmm_cgroup_hierarchy,
                      vmm_cgroups, vmm_pids, wait_for)

pytestmark = pytest.mark.vm

SETTLED = ("running", "sleeping")
VM_S = 240.0
"""How long a step may take to settle (a boot, a restore, a wake), seconds: set from this
machine's measured boot by ``vm_waits``."""


@pytest.fixture(autouse=True)
def vm_waits(waits: Waits) -> None:
    global VM_S
    VM_S = waits.vm(20, floor=90)


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
    assert srv.proc.wait(VM_S) == -signal.SIGKILL, f"{step}: the server did not kill itself"
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


def settle(c: httpx.Client) -> dict[str, str]:
    """Sandboxes by state once none is in a transient state."""
    def states() -> tuple[dict[str, str]] | None:  # a tuple: no sandbox at all is settled too
        now = {s["id"]: s["state"] for s in c.get("/sandboxes").json()["sandboxes"]}
        return (now,) if all(s in SETTLED for s in now.values()) else None

    return wait_for(states, VM_S, "every sandbox settled", every=0.3)[0]


def machine_state(c: httpx.Client, user: str, want: str) -> None:
    wait_for(lambda: c.get(f"/machines/{user}").json()["state"] == want, VM_S,
             f"the machine {want}", every=0.3)


def logged_sandboxes(d: Path) -> set[str]:
    """Every sandbox id (``sb-...``) the server of data directory ``d`` has logged: those
    whose create never answered too (it died in it)."""
    ids = set()
    for line in (d / "server.log").read_text(errors="replace").splitlines():
        if line.startswith("{"):
            sid = json.loads(line).get("sandbox_id")
            if isinstance(sid, str) and sid.startswith("sb-"):
                ids.add(sid)
    return ids


def consistent(d: Path, c: httpx.Client, expect: set[str], gone: set[str] = frozenset()) -> dict:
    """Assert every sandbox answers or is cleanly gone and nothing is orphaned: no VMM,
    sandbox folder, snapshot folder or VMM cgroup of a sandbox that does not run."""
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
    cgroups = vmm_cgroup_hierarchy()
    for sid in logged_sandboxes(d) | running:
        want = len(cgroups.bases) if cgroups is not None and sid in running else 0
        assert len(vmm_cgroups(sid)) == want, f"{sid} ({states.get(sid)}): {vmm_cgroups(sid)}"
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
            r = c.post("/sandboxes", json={"timeout": 0})
            assert r.status_code == 201, r.text
            a = r.json()["id"]
            r = c.post(f"/machines/{user}", json={"idle_timeout": 3600})
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


WAKES = 6


def test_a_machine_slept_by_a_server_that_never_spoke_to_it_wakes_at_once(base_image) -> None:
    """A server SIGKILLed, a new one that puts the machine to sleep before any call: the
    guest was saved with no host on its agent port, its agent reopening the port in a loop.
    Woken, the agent may greet the new host from a session it is already closing, so the
    wake's first call (set_time) goes to a dead session; it must be sent again to the next
    session at once, never wait out its 30 s deadline (a 504 before the fix)."""
    d = make_data_dir(base_image)
    srv = Server(d, free_port())
    try:
        start(srv)
        with srv.client() as c:
            r = c.post("/machines/asleep", json={"idle_timeout": 3600})
            assert r.status_code == 201, r.text
            m = r.json()["sandbox_id"]
            run(c, m, "echo M > /root/who")
        for _ in range(WAKES):
            srv.kill(signal.SIGKILL)
            start(srv)
            with srv.client() as c:
                assert c.post("/machines/asleep/snapshot").json()["state"] == "sleeping"
                r = c.post(f"/sandboxes/{m}/exec", json={"command": "cat /root/who"})
                assert r.status_code == 200 and r.json()["stdout"] == "M\n", r.text
        log = [json.loads(x) for x in srv.log.read_text().splitlines() if x.startswith("{")]
        new_sessions = [x for x in log if x.get("event") == "guest agent began a new session"]
        resent = [x for x in log if "sent again" in str(x.get("event"))]
        print(f"{len(new_sessions)} new agent sessions met, {len(resent)} resends, "
              f"in {WAKES} wakes")
        assert not [x for x in log if x.get("level") == "error"]
    finally:
        leaked = cleanup(srv)
        shutil.rmtree(d, ignore_errors=True)
    assert not leaked
