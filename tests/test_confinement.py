"""Every VMM confined, every resource bounded: real server, real microVMs.

One server with small caps and one sandbox (256 MiB, 512 MiB disk) serve
the whole module; the tests run in file order, the disk-filling one last.
What this host offers decides which cgroup version is checked: cgroup v1
here (memory.limit_in_bytes, cpu.cfs_quota_us/cfs_period_us, pids.max),
cgroup v2 (memory.max, cpu.max, pids.max) where it is the host's; the
file-level logic of both is checked on a fake tree in
``test_cgroup_files_of_both_versions``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from conftest import SRC, Server, Waits, make_data_dir, own_server, vmm_pids, wait_for
from hangar.engines.cgroups import CPU_PERIOD_US, Hierarchy, Limits
from hangar.engines.confine import OVERHEAD_MIB, PIDS_MAX
from hangar.engines.qemu import MemoryTuning

MEMORY_MIB = 256
DISK_MIB = 512
CONSOLE_BYTES = 64 << 10
SNAPSHOT_CAP = 300 << 20
BUDGET_MIB = 1024
MAX_EXECS = 2


@pytest.fixture(scope="module")
def srv(base_image) -> Iterator[Server]:  # noqa: ANN001
    with own_server(base_image, {
        "HANGAR_MAX_EXECS_PER_SANDBOX": str(MAX_EXECS),
        "HANGAR_MEMORY_BUDGET_MIB": str(BUDGET_MIB),
        "HANGAR_CONSOLE_LOG_BYTES": str(CONSOLE_BYTES),
        "HANGAR_SNAPSHOT_STORAGE_BYTES": str(SNAPSHOT_CAP),
        "HANGAR_MAX_DISK_MIB": "1024",
    }) as s:
        yield s


@pytest.fixture(scope="module")
def api(srv: Server) -> Iterator[httpx.Client]:
    with srv.client() as c:
        yield c


@pytest.fixture(scope="module")
def sid(api: httpx.Client) -> str:
    r = api.post("/sandboxes", json={"memory_mib": MEMORY_MIB, "disk_mib": DISK_MIB})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def vmm_pid(sandbox_id: str) -> int:
    pids = vmm_pids(f"hangar-{sandbox_id}")
    assert len(pids) == 1, pids
    return pids[0]


def status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.strip() for k, _, v in (line.partition(":") for line in lines)}


def cgroups_of(pid: int) -> dict[str, str]:
    """controller (or "" for v2) -> path, from /proc/PID/cgroup."""
    out = {}
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        for n in names.split(",") if names else [""]:
            out[n] = path
    return out


def mount_of(controller: str) -> Path:
    for line in Path("/proc/self/mounts").read_text().splitlines():
        dev, mnt, fstype, opts = line.split()[:4]
        if controller == "" and fstype == "cgroup2":
            if (Path(mnt) / "cgroup.controllers").read_text().split():
                return Path(mnt)
        elif fstype == "cgroup" and controller in opts.split(","):
            return Path(mnt)
    raise AssertionError(f"no cgroup mount for {controller!r}")


def run(api: httpx.Client, sandbox_id: str, command: str, timeout: float = 60) -> dict:
    r = api.post(f"/sandboxes/{sandbox_id}/exec", json={"command": command, "timeout": timeout})
    assert r.status_code == 200, r.text
    return r.json()


def test_vmm_runs_confined(srv: Server, api: httpx.Client, sid: str) -> None:
    pid = vmm_pid(sid)
    st = status(pid)
    uids, gids = st["Uid"].split(), st["Gid"].split()
    assert "0" not in uids and "0" not in gids, (uids, gids)
    assert st["Seccomp"] == "2"
    assert st["NoNewPrivs"] == "1"
    assert st["Groups"] == ""
    # Its own pid namespace, in which it is pid 1: no host process is in its sight.
    assert st["NSpid"].split() == [str(pid), "1"], st["NSpid"]
    assert os.readlink(f"/proc/{pid}/ns/pid") != os.readlink("/proc/self/ns/pid")
    assert (srv.data_dir / "sandboxes" / sid / "vmm.pid").read_text().strip() == str(pid)

    accel = api.get(f"/sandboxes/{sid}").json().get("accel", "tcg")
    # The server's default translation buffer (HANGAR_TCG_TB_MIB) counts under TCG.
    tb_mib = MemoryTuning().tb_mib
    want_mem = (MEMORY_MIB + OVERHEAD_MIB + (tb_mib if accel != "kvm" else 0)) << 20
    groups = cgroups_of(pid)
    if "memory" in groups:  # cgroup v1 (this project's CI host)
        mem = mount_of("memory") / groups["memory"].lstrip("/")
        cpu = mount_of("cpu") / groups["cpu"].lstrip("/")
        pids = mount_of("pids") / groups["pids"].lstrip("/")
        assert mem.name == cpu.name == pids.name == sid
        assert int((mem / "memory.limit_in_bytes").read_text()) == want_mem
        assert int((cpu / "cpu.cfs_quota_us").read_text()) == CPU_PERIOD_US  # one vCPU
        assert int((cpu / "cpu.cfs_period_us").read_text()) == CPU_PERIOD_US
        assert int((pids / "pids.max").read_text()) == PIDS_MAX
        peak = int((mem / "memory.max_usage_in_bytes").read_text())
    else:  # cgroup v2
        g = mount_of("") / groups[""].lstrip("/")
        assert g.name == sid
        assert int((g / "memory.max").read_text()) == want_mem
        assert (g / "cpu.max").read_text().split() == [str(CPU_PERIOD_US), str(CPU_PERIOD_US)]
        assert int((g / "pids.max").read_text()) == PIDS_MAX
        peak = int((g / "memory.peak").read_text()) if (g / "memory.peak").exists() else 0
    print(f"VMM peak memory: {peak >> 20} MiB for a {MEMORY_MIB} MiB guest ({accel})",
          file=sys.stderr)

    # The key file: unreadable for the VMM's uid on the host, and absent from its view.
    key = srv.data_dir / "api-key"
    assert key.exists()
    as_uid = subprocess.run(["setpriv", f"--reuid={uids[0]}", f"--regid={gids[0]}",
                             "--clear-groups", "cat", str(key)], capture_output=True, text=True)
    assert as_uid.returncode != 0 and "Permission denied" in as_uid.stderr, as_uid
    inside = subprocess.run(["nsenter", "-t", str(pid), "-m", "-S", uids[0], "-G", gids[0],
                             "cat", str(key)], capture_output=True, text=True)
    assert inside.returncode != 0 and "No such file" in inside.stderr, inside
    seen = sorted(os.listdir(f"/proc/{pid}/root{srv.data_dir}"))
    # (images: bound at their resolved path, inside the data dir only if they are there)
    inside = (srv.data_dir / "images").resolve().is_relative_to(srv.data_dir.resolve())
    assert seen == (["images", "sandboxes"] if inside else ["sandboxes"]), seen
    assert os.listdir(f"/proc/{pid}/root{srv.data_dir}/sandboxes") == [sid]
    assert set(os.listdir(f"/proc/{pid}/root/dev")) <= {"null", "random", "urandom", "zero", "kvm"}
    for ns in ("mnt", "net", "ipc"):  # no NIC here: not even the host's network
        assert os.readlink(f"/proc/{pid}/ns/{ns}") != os.readlink(f"/proc/self/ns/{ns}"), ns
    # The server's own files in the sandbox folder are out of the VMM's reach.
    folder = srv.data_dir / "sandboxes" / sid
    for name in ("vmm.pid", "vmm.log"):
        w = subprocess.run(["nsenter", "-t", str(pid), "-m", "-S", uids[0], "-G", gids[0],
                            "sh", "-c", f"echo 1 > {folder / name} || rm -f {folder / name}"],
                           capture_output=True, text=True)
        assert w.returncode != 0, (name, w)
    assert (folder / "vmm.pid").read_text().strip() == str(pid)
    assert run(api, sid, "echo ok")["stdout"] == "ok\n"


def test_concurrent_exec_cap(api: httpx.Client, sid: str, waits: Waits) -> None:
    results: dict[str, dict] = {}

    def long(name: str, seconds: int) -> None:
        results[name] = run(api, sid, f"touch /tmp/started-{name}; sleep {seconds}; echo {name}")

    threads = {name: threading.Thread(target=long, args=(name, secs))
               for name, secs in (("short", 4), ("long", 12))}
    for t in threads.values():
        t.start()
    try:
        for name in threads:  # file calls are not commands: they do not take a slot
            wait_for(lambda: api.get(f"/sandboxes/{sid}/files/stat",
                                     params={"path": f"/tmp/started-{name}"}).status_code == 200,
                     waits.vm(6), f"the {name} command to start")
        r = api.post(f"/sandboxes/{sid}/exec", json={"command": "true"})
        assert r.status_code == 429, r.text
        body = r.json()["error"]
        assert body["code"] == "limit_exceeded"
        assert f"at most {MAX_EXECS} commands" in body["message"]
        assert int(r.headers["retry-after"]) >= 1
        s = api.post(f"/sandboxes/{sid}/exec/stream", json={"command": "true"})
        assert s.status_code == 429, s.text
        threads["short"].join(30)
        assert results["short"]["stdout"] == "short\n"
        assert threads["long"].is_alive()
        assert run(api, sid, "echo again")["stdout"] == "again\n"
    finally:
        for t in threads.values():
            t.join(30)
    assert results["long"]["stdout"] == "long\n"


def test_memory_budget(api: httpx.Client, sid: str) -> None:
    before = len(api.get("/sandboxes").json()["sandboxes"])
    r = api.post("/sandboxes", json={"memory_mib": BUDGET_MIB})
    assert r.status_code == 429, r.text
    msg = r.json()["error"]["message"]
    assert f"memory budget is {BUDGET_MIB} MiB" in msg and "HANGAR_MEMORY_BUDGET_MIB" in msg
    assert f"hold {MEMORY_MIB} MiB" in msg
    assert int(r.headers["retry-after"]) >= 1
    assert len(api.get("/sandboxes").json()["sandboxes"]) == before


def test_disk_cap_at_create(api: httpx.Client) -> None:
    r = api.post("/sandboxes", json={"disk_mib": 2048})
    assert r.status_code == 400, r.text
    assert "1024 MiB" in r.json()["error"]["message"]


def test_snapshot_storage_cap(api: httpx.Client, sid: str) -> None:
    """One snapshot fits under the cap and a second is refused while it is held.

    A snapshot's memory is stored compressed, so the guest first holds 80 MiB that
    does not compress: the first snapshot then holds over 80 MiB, and the second's
    bound (its 256 MiB of memory plus its disk) cannot fit beside it in 300 MiB."""
    assert run(api, sid, "head -c 80M /dev/urandom > /dev/shm/noise")["exit_code"] == 0
    try:
        _two_snapshots_one_cap(api, sid)
    finally:
        assert run(api, sid, "rm -f /dev/shm/noise")["exit_code"] == 0


def _two_snapshots_one_cap(api: httpx.Client, sid: str) -> None:
    first = api.post(f"/sandboxes/{sid}/snapshot")
    assert first.status_code == 201, first.text
    snap = first.json()["id"]
    try:
        second = api.post(f"/sandboxes/{sid}/snapshot")
        assert second.status_code == 429, second.text
        msg = second.json()["error"]["message"]
        assert f"capped at {SNAPSHOT_CAP} bytes" in msg and "HANGAR_SNAPSHOT_STORAGE_BYTES" in msg
        assert len(api.get("/snapshots").json()["snapshots"]) == 1
    finally:
        assert api.delete(f"/snapshots/{snap}").status_code == 204
    third = api.post(f"/sandboxes/{sid}/snapshot")
    assert third.status_code == 201, third.text
    assert api.delete(f"/snapshots/{third.json()['id']}").status_code == 204
    assert run(api, sid, "echo alive")["stdout"] == "alive\n"


def test_console_log_is_capped_and_rotated(srv: Server, api: httpx.Client, sid: str,
                                           waits: Waits) -> None:
    console = srv.data_dir / "sandboxes" / sid / "console"
    serial = srv.data_dir / "sandboxes" / sid / "serial.log"
    assert serial.resolve() == console / "current"
    # About ten times the cap, as fast as the guest can write to its console.
    r = run(api, sid, "yes 'console flood 0123456789abcdef' | head -c 700000 > /dev/console; "
                      "echo END-OF-FLOOD > /dev/console", timeout=300)
    assert r["exit_code"] == 0, r
    wait_for(lambda: b"END-OF-FLOOD" in serial.read_bytes(), waits.vm(3),
             "the console's last line in the log", every=0.2)
    files = {p.name: p.stat().st_size for p in console.iterdir()}
    rotated = [n for n in files if n.startswith("@")]
    assert 1 <= len(rotated) <= 3, files
    logs = sum(size for n, size in files.items() if n == "current" or n.startswith("@"))
    assert logs <= CONSOLE_BYTES + 4096, files


def test_confined_vmm_is_adopted_after_a_restart(srv: Server, api: httpx.Client,
                                                 sid: str) -> None:
    pid = vmm_pid(sid)
    cgroup_dirs = (srv.data_dir / "sandboxes" / sid / "vmm.cgroup").read_text().split()
    assert cgroup_dirs and all(Path(d).is_dir() for d in cgroup_dirs)
    srv.kill()
    srv.start()
    assert vmm_pid(sid) == pid
    assert run(api, sid, "echo adopted")["stdout"] == "adopted\n"
    assert status(pid)["Seccomp"] == "2"


def test_disk_full_inside_bounded_outside(srv: Server, api: httpx.Client, sid: str) -> None:
    disk = srv.data_dir / "sandboxes" / sid / "disk.qcow2"
    r = run(api, sid, "dd if=/dev/zero of=/fill bs=1M 2>&1; sync; df -m / | tail -1",
            timeout=600)
    out = r["stdout"]
    assert "No space left on device" in out, out
    assert disk.stat().st_size <= (DISK_MIB + 64) << 20, disk.stat().st_size
    assert run(api, sid, "rm -f /fill; sync; echo freed")["stdout"] == "freed\n"
    # Deleting ends the VMM and removes its cgroup.
    cgroup_dirs = (srv.data_dir / "sandboxes" / sid / "vmm.cgroup").read_text().split()
    assert api.delete(f"/sandboxes/{sid}").status_code == 204
    assert not vmm_pids(f"hangar-{sid}")
    assert not any(Path(d).exists() for d in cgroup_dirs)


def test_doctor_reports_each_measure(srv: Server) -> None:
    out = subprocess.run([sys.executable, "-m", "hangar.cli", "doctor"], capture_output=True,
                         text=True, timeout=120,
                         env={**os.environ, "HANGAR_DATA_DIR": str(srv.data_dir),
                              "PYTHONPATH": str(SRC), "HANGAR_NETWORK": "off"})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    for name in ("qemu vmm user", "qemu vmm seccomp", "qemu vmm cgroup", "qemu vmm view",
                 "console log cap", "firecracker jailer"):
        line = next((x for x in lines if x.startswith(name + ": ")), None)
        assert line is not None, (name, out.stdout)
        assert line.split(": ", 1)[1].startswith(("on (", "off (")), line
    assert "qemu vmm user: on (" in out.stdout  # these tests run as root
    assert "qemu vmm seccomp: on (" in out.stdout


@pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="no /dev/kvm on this host")
def test_confined_qemu_opens_kvm(base_image) -> None:  # noqa: ANN001
    """Under KVM the VMM's uid opens its own /dev/kvm node. This host's nested KVM runs no
    ordinary guest (QEMU stops at setting MSRs), so what is checked is that a confined
    QEMU gets exactly as far as an unconfined one, and never meets a permission error."""
    import asyncio

    from hangar.engines.base import VMSpec
    from hangar.engines.confine import ConfineConfig, Confinement
    from hangar.engines.qemu import QemuEngine
    from hangar.errors import HangarError
    from hangar.images import resolve_image
    from hangar.layout import Layout

    async def attempt(enabled: bool, root: Path) -> tuple[bool, str, int | None]:
        layout = Layout(root)
        layout.ensure()
        engine = QemuEngine("kvm", confine=Confinement(ConfineConfig(enabled=enabled)))
        spec = VMSpec(f"sb-kvm{int(enabled)}", resolve_image(layout, "base"),
                      layout.sandbox(f"sb-kvm{int(enabled)}"), memory_mib=256)
        vm = None
        try:
            vm = await engine.boot(spec)
            deadline = time.monotonic() + 5
            while vm.alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            uid = int(status(vm.pid)["Uid"].split()[0]) if vm.alive() else None
            return vm.alive(), spec.paths.vmm_log.read_text(), uid
        except HangarError as exc:
            return False, exc.message, None
        finally:
            if vm is not None:
                await engine.stop(vm)

    d = make_data_dir(base_image)
    try:
        confined = asyncio.run(attempt(True, d))
        plain = asyncio.run(attempt(False, d))
    finally:
        for pid in vmm_pids(str(d)):
            os.kill(pid, 9)
        shutil.rmtree(d, ignore_errors=True)
    for words in ("Permission denied", "Could not access KVM", "vmm_exec"):
        assert words not in confined[1], confined[1]
    assert confined[0] == plain[0], (confined, plain)
    if confined[0]:
        assert confined[2] != 0
    else:  # both stopped at the same place
        assert confined[1].strip().splitlines()[-1] == plain[1].strip().splitlines()[-1]


def test_cgroup_files_of_both_versions(tmp_path: Path) -> None:
    """What each version writes, and the groups it lists (the start-up sweep's), on a
    fake tree (no kernel involved)."""
    limits = Limits(memory_bytes=700 << 20, cpus=2.0, pids=PIDS_MAX)
    v2root = tmp_path / "v2"
    v2root.mkdir()
    (v2root / "cgroup.subtree_control").write_text("memory\n")
    v2 = Hierarchy("2", (v2root / "hangar",))
    (v2root / "hangar").mkdir()
    (v2root / "hangar" / "cgroup.subtree_control").write_text("")
    g2 = v2.create("sb-x", limits)
    d = v2root / "hangar" / "sb-x"
    assert (d / "memory.max").read_text() == str(700 << 20)
    assert (d / "cpu.max").read_text() == f"{2 * CPU_PERIOD_US} {CPU_PERIOD_US}"
    assert (d / "pids.max").read_text() == str(PIDS_MAX)
    assert (v2root / "cgroup.subtree_control").read_text() == "+cpu +pids"
    assert g2.read() == limits

    bases = tuple(tmp_path / c / "srv" / "hangar" for c in ("memory", "cpu", "pids"))
    v1 = Hierarchy("1", bases)
    g1 = v1.create("sb-x", limits)
    assert (bases[0] / "sb-x" / "memory.limit_in_bytes").read_text() == str(700 << 20)
    assert (bases[1] / "sb-x" / "cpu.cfs_quota_us").read_text() == str(2 * CPU_PERIOD_US)
    assert (bases[1] / "sb-x" / "cpu.cfs_period_us").read_text() == str(CPU_PERIOD_US)
    assert (bases[2] / "sb-x" / "pids.max").read_text() == str(PIDS_MAX)
    assert g1.read() == limits

    assert v2.names() == {"sb-x"}
    (bases[2] / "sb-y").mkdir()  # a group left in one hierarchy only
    (bases[1] / "cgroup.procs").write_text("")  # a base's own files are no group
    assert v1.names() == {"sb-x", "sb-y"}
    assert Hierarchy("1", (tmp_path / "none",)).names() == set()
