"""Snapshots, machines that sleep and wake, the warm pool and crash recovery, on real VMs."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import httpx
import pytest

from conftest import (SRC, Server, Waits, cleanup, free_port, make_data_dir, vmm_cgroup_hierarchy,
                      vmm_cgroups, vmm_pids, wait_for)

from hangar.client import Hangar

pytestmark = pytest.mark.vm


def run(api: httpx.Client, sid: str, command: str, **body: object) -> dict:
    r = api.post(f"/sandboxes/{sid}/exec", json={"command": command, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_five_sleep_wake_cycles_keep_every_file(api: httpx.Client) -> None:
    r = api.post("/machines/cycle-user", json={"idle_timeout": 3600})
    assert r.status_code == 201, r.text
    m = r.json()
    assert m["state"] == "active" and m["desired_state"] == "active"
    assert api.post("/machines/cycle-user").status_code == 200, "a second call gets, not creates"
    sid = m["sandbox_id"]
    try:
        for i in range(1, 6):
            run(api, sid, f"echo cycle {i} > /root/cycle-{i}")
            slept = api.post("/machines/cycle-user/snapshot")
            assert slept.status_code == 200, slept.text
            assert slept.json()["state"] == "sleeping"
            assert vmm_pids(sid) == [], "a sleeping machine holds no VMM"
            woke = api.post("/machines/cycle-user/wake")
            assert woke.status_code == 200, woke.text
            assert woke.json()["state"] == "active"
            listing = run(api, sid, "cat /root/cycle-*")["stdout"]
            assert listing == "".join(f"cycle {j}\n" for j in range(1, i + 1))
    finally:
        assert api.delete("/machines/cycle-user").status_code == 204
    assert api.get("/machines/cycle-user").status_code == 404
    assert vmm_pids(sid) == []


def test_calls_wake_a_sleeping_machine_and_idle_machines_sleep(api: httpx.Client,
                                                               waits: Waits) -> None:
    m = api.post("/machines/idle-user", json={"idle_timeout": 4}).json()
    sid = m["sandbox_id"]
    try:
        run(api, sid, "sleep 600 & echo $! > /root/pid")
        wait_for(lambda: api.get("/machines/idle-user").json()["state"] == "sleeping",
                 4 + waits.vm(4), "the idle machine asleep", every=0.5)
        # Any call wakes it; its processes are still there.
        out = api.post("/machines/idle-user/exec",
                       json={"command": "kill -0 $(cat /root/pid) && echo alive"})
        assert out.status_code == 200 and out.json()["stdout"] == "alive\n"
        assert api.get("/machines/idle-user").json()["state"] == "active"
        r = api.get(f"/sandboxes/{sid}/files", params={"path": "/root/pid"})
        assert r.status_code == 200 and r.content.strip().isdigit()
    finally:
        api.delete("/machines/idle-user")


def test_bad_user_id(api: httpx.Client) -> None:
    r = api.post("/machines/bad%20id")
    assert r.status_code == 400
    assert api.get("/machines/nobody").status_code == 404
    assert api.post("/machines/nobody/wake").status_code == 404


def identity(api: httpx.Client, sid: str) -> tuple[str, str, int]:
    """(hostname, /etc/machine-id, fork generation) as the guest sees them."""
    out = run(api, sid, "hostname; cat /etc/machine-id /run/hangar/fork-generation")["stdout"]
    host, machine_id, generation = out.split()
    return host, machine_id, int(generation)


def test_snapshot_restore_fork_and_clock(api: httpx.Client, fresh_sandbox: str) -> None:
    sid = fresh_sandbox
    host, source_id, generation = identity(api, sid)
    # A cold boot is generation 0; a restore of its image's booted template (or a pooled
    # clone of it) was re-identified, and took the next value of the server-wide counter.
    source = api.get(f"/sandboxes/{sid}").json()["source"]
    assert host == sid and len(source_id) == 32
    assert generation == 0 if source == "cold" else generation > 0, (source, generation)
    run(api, sid, "echo before > /root/state; sleep 900 & echo $! > /root/pid")
    # Move the guest's clock 120 s back: after a restore it must be right at once.
    run(api, sid, "date -s @$(( $(date +%s) - 120 ))")
    r = api.post(f"/sandboxes/{sid}/snapshot")
    assert r.status_code == 201, r.text
    snap = r.json()
    assert snap["size_bytes"] > 1 << 20 and snap["sandbox_id"] == sid
    assert snap["id"] in [s["id"] for s in api.get("/snapshots").json()["snapshots"]]
    run(api, sid, "echo after > /root/state; kill $(cat /root/pid)")
    r = api.post(f"/sandboxes/{sid}/restore", json={"snapshot_id": snap["id"]})
    assert r.status_code == 200, r.text
    asked = time.time()
    out = run(api, sid, "date +%s; cat /root/state; kill -0 $(cat /root/pid) && echo alive")
    answered = time.time()
    guest_now, state, alive = out["stdout"].split()
    # The guest read its clock while the call ran (a loaded host makes that long, not wrong).
    assert int(asked) - 1 <= int(guest_now) <= answered + 1, (asked, guest_now, answered)
    assert (state, alive) == ("before", "alive")
    # A restored copy is a machine of its own: same name, new machine-id, a generation.
    host, restored_id, restored_gen = identity(api, sid)
    assert host == sid and restored_id != source_id and restored_gen > 0
    forks = []
    try:
        for _ in range(2):
            r = api.post(f"/snapshots/{snap['id']}/sandboxes", json={})
            assert r.status_code == 201, r.text
            forks.append(r.json()["id"])
        for n, fid in enumerate(forks):
            run(api, fid, f"echo fork{n} > /root/state")
        for n, fid in enumerate(forks):
            assert run(api, fid, "cat /root/state")["stdout"] == f"fork{n}\n"
            assert run(api, fid, "head -c 16 /dev/urandom | od -An -tx1")["exit_code"] == 0
        assert run(api, sid, "cat /root/state")["stdout"] == "before\n"
        # Clones reseed: their random streams differ.
        draws = {run(api, fid, "head -c 16 /dev/urandom | od -An -tx1")["stdout"] for fid in forks}
        assert len(draws) == 2
        # Forks are distinct machines: hostname (their id), machine-id, fork generation.
        ids = [identity(api, fid) for fid in forks]
        assert [i[0] for i in ids] == forks
        assert len({i[1] for i in ids} | {source_id, restored_id}) == 4
        assert len({i[2] for i in ids} | {restored_gen}) == 3
        assert all(i[2] > restored_gen for i in ids), "generations only grow"
        # ... and each fork's generation is published with its snapshot.forked event.
        with Hangar(str(api.base_url), api.headers["X-API-Key"]) as h:
            for fid, (_, _, gen) in zip(forks, ids):
                stream = h.events(kinds=["snapshot.forked"], sandbox_id=fid,
                                  last_event_id="0:0")  # another stream's id: the whole ring
                assert next(stream).data == {"snapshot_id": snap["id"], "generation": gen}
                stream.close()
    finally:
        for fid in forks:
            api.delete(f"/sandboxes/{fid}")
    assert api.delete(f"/snapshots/{snap['id']}").status_code == 204
    assert api.get(f"/snapshots/{snap['id']}").status_code == 404
    r = api.post(f"/sandboxes/{sid}/restore", json={"snapshot_id": snap["id"]})
    assert r.status_code == 404


def test_snapshot_during_a_command_is_a_retryable_409(api: httpx.Client, fresh_sandbox: str,
                                                     server: Server) -> None:
    import threading

    sid = fresh_sandbox

    def slow() -> None:
        with server.client() as c:
            c.post(f"/sandboxes/{sid}/exec", json={"command": "sleep 4"})

    t = threading.Thread(target=slow)
    t.start()
    time.sleep(1.5)
    r = api.post(f"/sandboxes/{sid}/snapshot")
    t.join()
    assert r.status_code == 409, r.text
    assert r.json()["error"]["code"] == "busy"
    assert int(r.headers["Retry-After"]) >= 1
    r = api.post(f"/sandboxes/{sid}/snapshot")
    assert r.status_code == 201, r.text
    snap = r.json()["id"]
    for _ in range(2):
        assert api.post(f"/sandboxes/{sid}/restore", json={"snapshot_id": snap}).status_code == 200
        assert run(api, sid, "echo ok")["stdout"] == "ok\n"
    api.delete(f"/snapshots/{snap}")


def test_killed_vmm_is_noticed_and_released(api: httpx.Client, fresh_sandbox: str,
                                           server: Server) -> None:
    sid = fresh_sandbox
    (pid,) = vmm_pids(sid)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and api.get(f"/sandboxes/{sid}").json()["state"] != "failed":
        time.sleep(0.3)
    rec = api.get(f"/sandboxes/{sid}").json()
    assert rec["state"] == "failed" and rec["error"]
    assert not (server.data_dir / "sandboxes" / sid).exists(), "its disk and sockets are gone"
    r = api.post(f"/sandboxes/{sid}/exec", json={"command": "true"})
    assert r.status_code == 409


def test_server_crash_recovery(base_image) -> None:
    """The server SIGKILLed with three sandboxes, one of whose VMMs dies while it is down:
    the restarted one adopts two and fails the third. No cgroup is left that no live
    sandbox owns: the dead VMM's group goes although its removal, finding no VM, took its
    folder before the start-up sweep (every run of the suite leaked it before); a group of
    an id this data directory never had (another server's, maybe made for a VMM about to
    join it) stays."""
    d = make_data_dir(base_image)
    srv = Server(d, free_port())
    cgroups = vmm_cgroup_hierarchy()
    foreign = cgroups.group(f"sb-{os.urandom(6).hex()}").dirs if cgroups else ()
    ids: list[str] = []
    try:
        srv.start()
        with srv.client() as c:
            ids = [c.post("/sandboxes", json={}).json()["id"] for _ in range(3)]
        # One VMM dies while the server is down too.
        srv.kill(signal.SIGKILL)
        (victim,) = vmm_pids(ids[0])
        os.kill(victim, signal.SIGKILL)
        for g in foreign:
            g.mkdir()
        time.sleep(0.5)
        srv.start()
        with srv.client() as c:
            listed = {s["id"]: s["state"] for s in c.get("/sandboxes").json()["sandboxes"]}
            for sid in ids:
                if listed.get(sid) == "running":
                    assert run(c, sid, "echo alive")["stdout"] == "alive\n"
                else:
                    assert vmm_pids(sid) == []
                    assert not (d / "sandboxes" / sid).exists()
                    assert vmm_cgroups(sid) == [], f"the cgroup of {listed.get(sid)} {sid}"
            assert listed[ids[0]] == "failed"
            assert listed[ids[1]] == listed[ids[2]] == "running"
        if cgroups is not None:
            for sid in ids[1:]:
                assert len(vmm_cgroups(sid)) == len(cgroups.bases), f"{sid} lost its cgroup"
            assert all(g.is_dir() for g in foreign), "another server's cgroup was removed"
    finally:
        leaked = cleanup(srv)
        for g in foreign:
            if g.is_dir():
                g.rmdir()
        shutil.rmtree(d, ignore_errors=True)
    assert not leaked
    assert not [g for sid in ids for g in vmm_cgroups(sid)], "cgroups outlived their delete"


def test_warm_pool(base_image, waits: Waits) -> None:  # noqa: ANN001
    d = make_data_dir(base_image)
    srv = Server(d, free_port(), {"HANGAR_POOL_SIZE": "2", "HANGAR_POOL_MAX_AGE_S": "600"})
    try:
        srv.start()
        with srv.client() as c:
            def pooled() -> int:
                text = c.get("/metrics").text
                line = next(x for x in text.splitlines() if x.startswith('hangar_sandboxes{state="pooled"}'))
                return int(float(line.split()[-1]))

            wait_for(lambda: pooled() == 2, waits.vm(8), "two pool VMs", every=0.5)
            assert c.get("/sandboxes").json()["sandboxes"] == [], "pool VMs are not listed"
            t = time.monotonic()
            sb = c.post("/sandboxes", json={}).json()
            took = time.monotonic() - t
            assert took < 3, f"a pooled create took {took:.1f} s"
            asked = time.time()
            guest_now = int(run(c, sb["id"], "date +%s")["stdout"])
            assert int(asked) - 1 <= guest_now <= time.time() + 1, (asked, guest_now)
            # The pool refills; the taken VM is never handed out again.
            wait_for(lambda: pooled() == 2, waits.vm(8), "the pool refilled", every=0.5)
            others = [c.post("/sandboxes", json={}).json()["id"] for _ in range(2)]
            assert sb["id"] not in others and len(set(others)) == 2
            # A create with another shape does not use the pool.
            assert c.post("/sandboxes", json={"memory_mib": 256}).status_code == 201
    finally:
        leaked = cleanup(srv)
        shutil.rmtree(d, ignore_errors=True)
    assert not leaked


def test_machine_cli(server: Server) -> None:
    env = {**os.environ, "HANGAR_URL": server.url, "HANGAR_API_KEY": server.key,
           "PYTHONPATH": str(SRC), "HANGAR_NO_STDIN": "1"}

    def hangar(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "hangar.cli", *args], env=env,
                              capture_output=True, text=True, timeout=300)

    try:
        r = hangar("machine", "get", "cli-user")
        assert r.returncode == 0 and "active" in r.stdout, r.stderr
        assert "sleeping" in hangar("machine", "sleep", "cli-user").stdout
        assert "sleeping" in hangar("machine", "show", "cli-user").stdout
        assert "active" in hangar("machine", "wake", "cli-user").stdout
    finally:
        assert hangar("machine", "rm", "cli-user").returncode == 0


def test_pool_vms_are_replaced_after_their_maximum_age(base_image, waits: Waits) -> None:  # noqa: ANN001
    d = make_data_dir(base_image)
    srv = Server(d, free_port(), {"HANGAR_POOL_SIZE": "1", "HANGAR_POOL_MAX_AGE_S": "6"})

    def pooled_ids() -> set[str]:
        return {p.name for p in (d / "sandboxes").iterdir()}

    try:
        srv.start()
        wait_for(pooled_ids, waits.vm(4), "a pool VM", every=0.5)
        (first,) = pooled_ids()
        wait_for(lambda: first not in pooled_ids() and pooled_ids(), 6 + waits.vm(4),
                 "the old pool VM retired and replaced", every=0.5)
        assert len(pooled_ids()) == 1, "and replaced by a fresh one"
        assert vmm_pids(first) == []
    finally:
        leaked = cleanup(srv)
        shutil.rmtree(d, ignore_errors=True)
    assert not leaked
