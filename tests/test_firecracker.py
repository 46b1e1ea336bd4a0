"""The Firecracker engine against the real firecracker and jailer v1.12.1 binaries.

The binaries are fetched (``hangar.engines.firecracker.binaries.fetch``) when
missing. Every test checks afterwards, explicitly, that no firecracker or
jailer process of its own, no file and no cgroup of it is left.

Tests that need a guest to run (agent over vsock, exec) are skipped unless
the Firecracker probe boot succeeds: on a host whose KVM is nested and
paravirtual (like our build machines) no ordinary guest kernel runs, so
those run only on a real KVM host. Everything up to a running VMM (API,
InstanceStart, pause, resume, snapshots, restore, jailer, cleanup) is
tested here for real.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gzip
import json
import os
import secrets
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hangar.engines.base import VM, VMSpec
from hangar.engines.agent_client import AgentClient
from hangar.engines.firecracker import (
    FirecrackerAPI,
    FirecrackerAPIError,
    FirecrackerEngine,
    JailerConfig,
    cgroup_mounts,
    find_firecracker,
    find_jailer,
    probe_boot,
    read_snapshot,
)
from hangar.engines.firecracker.binaries import BINARY_SHA256, FIRECRACKER_VERSION, fetch
from hangar.engines.process import vmm_pids
from hangar.errors import EngineError, ImageError, InvalidRequest, NotFound, Timeout
from hangar.guest import protocol as P
from hangar.images import ensure_vmlinux, extract_vmlinux
from hangar.layout import Layout, SandboxPaths

from conftest import SHARED

MARK = "hangar-fct"  # every Firecracker --id of these tests starts with it


# -- fixtures -----------------------------------------------------------------------


@pytest.fixture(scope="session")
def fc_bins() -> dict[str, Path]:
    """firecracker and jailer, fetched into the default directory when missing."""
    fc, jailer = find_firecracker(), find_jailer()
    if fc is None or jailer is None:
        return fetch()
    return {"firecracker": fc, "jailer": jailer}


@pytest.fixture(scope="session")
def image(base_image: Path):  # noqa: ANN201
    from hangar.images import resolve_image

    return resolve_image(Layout(SHARED), "base")


@pytest.fixture(scope="session")
def guest_runs(image, fc_bins) -> tuple[bool, str]:  # noqa: ANN001
    """Whether a guest reaches userspace under Firecracker here (the probe boot)."""
    from hangar.engines.doctor import firecracker_usable

    return firecracker_usable(Layout(SHARED), image, fc_bins["firecracker"])


def our_pids() -> list[int]:
    """Pids of firecracker/jailer processes started by these tests (by their --id)."""
    return vmm_pids(MARK, programs=(b"firecracker", b"jailer"))


def our_cgroups() -> list[Path]:
    mounts = cgroup_mounts()
    return [d for base in [*mounts["v1"], *mounts["v2"]]
            for d in (base / "hangar").glob(f"{MARK}*") if d.is_dir()]


@pytest.fixture
def work() -> Iterator[Path]:
    """A short private directory under /tmp (Unix socket paths are limited to 107 bytes).

    After the test: no process, cgroup or sandbox file of this test may be left.
    """
    d = Path(tempfile.mkdtemp(prefix="hfc-", dir="/tmp"))
    before = set(our_pids())
    yield d
    leaked = [p for p in our_pids() if p not in before]
    cgroups = our_cgroups()
    left = sorted(str(p.relative_to(d)) for p in d.iterdir()
                  if p.name.startswith("sb-"))
    for pid in leaked:
        os.kill(pid, 9)
    for cg in cgroups:
        shutil.rmtree(cg, ignore_errors=True)
    shutil.rmtree(d, ignore_errors=True)
    assert not leaked, f"firecracker processes left behind: {leaked}"
    assert not cgroups, f"cgroups left behind: {cgroups}"
    assert not left, f"sandbox files left behind: {left}"


def new_id() -> str:
    return f"fct-{secrets.token_hex(3)}"


def spec_for(image, work: Path, memory_mib: int = 256, **kw) -> VMSpec:  # noqa: ANN001
    sid = f"sb-{new_id()}"
    return VMSpec(sid, image, SandboxPaths(work / sid), memory_mib=memory_mib,
                  disk_mib=kw.pop("disk_mib", 512), **kw)


def run(coro):  # noqa: ANN001, ANN201
    return asyncio.run(coro)


async def state_of(engine: FirecrackerEngine, vm: VM) -> str:
    async with FirecrackerAPI(engine.files_of(vm).api) as api:
        return (await api.get_instance_info()).state


def proc_status(pid: int) -> dict[str, str]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        k, _, v = line.partition(":")
        out[k] = v.strip()
    return out


# -- binaries and kernel --------------------------------------------------------------


def test_fetch_is_idempotent_and_checked(fc_bins: dict[str, Path]) -> None:
    d = Path(tempfile.mkdtemp(prefix="hfc-bin-", dir="/tmp"))
    try:
        paths = fetch(d)
        assert set(paths) == {"firecracker", "jailer"}
        mtimes = {n: p.stat().st_mtime_ns for n, p in paths.items()}
        for name, p in paths.items():
            assert os.access(p, os.X_OK)
            out = subprocess.run([str(p), "--version"], capture_output=True, text=True)
            assert f"v{FIRECRACKER_VERSION}" in out.stdout, out.stdout
        again = fetch(d)
        assert {n: p.stat().st_mtime_ns for n, p in again.items()} == mtimes
        assert len(BINARY_SHA256) == 2
    finally:
        shutil.rmtree(d)


def test_lookup_order(fc_bins: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HANGAR_FIRECRACKER", str(fc_bins["firecracker"]))
    assert find_firecracker(Path("/nonexistent")) == fc_bins["firecracker"]
    monkeypatch.setenv("HANGAR_FIRECRACKER", "/nonexistent/firecracker")
    assert find_firecracker() is None  # an explicit path that is wrong is not silently replaced
    monkeypatch.delenv("HANGAR_FIRECRACKER")
    assert find_firecracker(fc_bins["firecracker"].parent) == fc_bins["firecracker"]


def test_vmlinux_from_the_images_bzimage(image) -> None:  # noqa: ANN001
    out = ensure_vmlinux(image)
    head = out.read_bytes()[:20]
    assert head[:4] == b"\x7fELF" and head[4] == 2 and head[18:20] == b"\x3e\x00"
    assert out.parent == image.dir and out.name == "vmlinux"
    mtime = out.stat().st_mtime_ns
    assert ensure_vmlinux(image) == out and out.stat().st_mtime_ns == mtime  # cached


def test_extract_vmlinux_scans_for_a_payload() -> None:
    elf = b"\x7fELF\x02\x01\x01" + bytes(11) + b"\x3e\x00" + os.urandom(2000)
    data, fmt = extract_vmlinux(b"not a boot header" * 40 + gzip.compress(elf) + b"tail")
    assert (data, fmt) == (elf, "gzip")
    with pytest.raises(ImageError, match="no compressed x86_64 ELF"):
        extract_vmlinux(os.urandom(4096).replace(b"\x1f\x8b", b"xx"))


# -- the API client on a bare process ---------------------------------------------------


def start_bare(fc: Path, cwd: Path, name: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([str(fc), "--id", f"{MARK}-{name}", "--api-sock", "api.sock"],
                            cwd=cwd, stdin=subprocess.DEVNULL, stdout=open(cwd / "out", "ab"),
                            stderr=subprocess.STDOUT, start_new_session=True)


@pytest.fixture
def taps() -> Iterator[list[str]]:
    """Two TAP devices, or none when this host cannot make them."""
    made: list[str] = []
    for _ in range(2):
        name = f"fct{secrets.token_hex(3)}"
        if subprocess.run(["ip", "tuntap", "add", "dev", name, "mode", "tap"],
                          capture_output=True).returncode == 0:
            made.append(name)
    yield made if len(made) == 2 else []
    for name in made:
        subprocess.run(["ip", "tuntap", "del", "dev", name, "mode", "tap"], capture_output=True)


def test_every_api_call(fc_bins, image, work: Path, taps: list[str]) -> None:  # noqa: ANN001
    fc = fc_bins["firecracker"]
    tap = taps[0] if taps else None
    vm_dir, restored_dir = work / "a", work / "b"
    vm_dir.mkdir()
    restored_dir.mkdir()
    for d in (vm_dir, restored_dir):
        os.link(ensure_vmlinux(image), d / "vmlinux")
        os.link(image.initrd, d / "initrd.img")
        os.link(image.rootfs, d / "rootfs.ext4")
        with open(d / "scratch.img", "wb") as f:
            f.truncate(64 << 20)
    (vm_dir / "fc.log").touch()
    (vm_dir / "metrics.json").touch()
    procs = [start_bare(fc, vm_dir, "api")]

    async def go() -> dict[str, float]:
        t: dict[str, float] = {}
        async with FirecrackerAPI(vm_dir / "api.sock") as api:
            info = await api.wait_ready(5, alive=lambda: procs[0].poll() is None)
            assert (info.state, info.vmm_version, info.id) == ("Not started", "1.12.1",
                                                               f"{MARK}-api")
            assert await api.get_version() == "1.12.1"
            mc = await api.get_machine_config()
            assert (mc.vcpu_count, mc.mem_size_mib, mc.track_dirty_pages) == (1, 128, False)
            await api.put_logger("fc.log", "Info", show_level=True)
            await api.put_metrics("metrics.json")
            await api.put_machine_config(1, 256, track_dirty_pages=True)
            mc = await api.get_machine_config()
            assert (mc.mem_size_mib, mc.track_dirty_pages) == (256, True)
            await api.put_boot_source("vmlinux", "console=ttyS0 reboot=k panic=-1 pci=off",
                                      "initrd.img")
            await api.put_drive("rootfs", "rootfs.ext4", is_read_only=True)
            await api.put_drive("scratch", "scratch.img", cache_type="Unsafe", io_engine="Sync")
            await api.put_vsock(3, "v.sock")
            if tap:
                await api.put_network_interface("eth0", tap, guest_mac="06:00:ac:10:00:02")
            cfg = await api.get_vm_config()
            assert [d["drive_id"] for d in cfg["drives"]] == ["rootfs", "scratch"]
            assert cfg["drives"][0]["is_read_only"] is True
            assert cfg["vsock"]["uds_path"] == "v.sock"
            assert cfg["boot-source"]["initrd_path"] == "initrd.img"
            if tap:
                assert cfg["network-interfaces"][0]["host_dev_name"] == tap

            s = time.perf_counter()
            await api.instance_start()
            t["instance_start"] = time.perf_counter() - s
            assert (await api.get_instance_info()).state == "Running"
            assert (vm_dir / "v.sock").exists()
            with pytest.raises(FirecrackerAPIError) as err:
                await api.instance_start()
            assert err.value.status_code == 400
            assert "not supported after starting" in err.value.fault_message
            await api.flush_metrics()
            await api.send_ctrl_alt_del()

            s = time.perf_counter()
            await api.patch_vm("Paused")
            t["pause"] = time.perf_counter() - s
            assert (await api.get_instance_info()).state == "Paused"
            await api.patch_vm("Resumed")
            assert (await api.get_instance_info()).state == "Running"
            await api.patch_vm("Paused")
            s = time.perf_counter()
            await api.put_snapshot_create("full.vmstate", "full.mem", "Full")
            t["snapshot_full"] = time.perf_counter() - s
            await api.patch_vm("Resumed")
            await asyncio.sleep(0.2)
            await api.patch_vm("Paused")
            await api.put_snapshot_create("diff.vmstate", "diff.mem", "Diff")
        assert (vm_dir / "full.mem").stat().st_size == 256 << 20
        assert (vm_dir / "diff.mem").stat().st_blocks * 512 < 256 << 20  # sparse: dirty pages
        assert (vm_dir / "full.vmstate").stat().st_size > 0
        assert b"InstanceStart" in (vm_dir / "fc.log").read_bytes()
        assert b'"utc_timestamp_ms"' in (vm_dir / "metrics.json").read_bytes()

        # The first VM keeps running and holds its TAP device: the restored
        # one can only start on another, through network_overrides.
        procs.append(start_bare(fc, restored_dir, "api-restored"))
        async with FirecrackerAPI(restored_dir / "api.sock") as api:
            await api.wait_ready(5)
            s = time.perf_counter()
            await api.put_snapshot_load(
                str(vm_dir / "full.vmstate"), str(vm_dir / "full.mem"),
                enable_diff_snapshots=True, resume_vm=True,
                network_overrides=[{"iface_id": "eth0", "host_dev_name": taps[1]}]
                if taps else None)
            t["snapshot_load"] = time.perf_counter() - s
            assert (await api.get_instance_info()).state == "Running"
            # drives and vsock were reopened relative to the new process's directory
            assert (restored_dir / "v.sock").exists()
            if taps:
                cfg = await api.get_vm_config()
                assert cfg["network-interfaces"][0]["host_dev_name"] == taps[1]
        return t

    try:
        timings = run(go())
        print("\nraw API timings (ms):",
              {k: round(v * 1000, 1) for k, v in timings.items()})
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert not [p for p in our_pids() if p in {x.pid for x in procs}]


def test_api_faults_carry_firecrackers_message(fc_bins, work: Path) -> None:  # noqa: ANN001
    proc = start_bare(fc_bins["firecracker"], work, "faults")

    async def go() -> None:
        async with FirecrackerAPI(work / "api.sock") as api:
            await api.wait_ready(5)
            with pytest.raises(FirecrackerAPIError) as err:
                await api.put_machine_config(0, 256)
            e = err.value
            assert isinstance(e, EngineError) and e.status_code == 400
            assert "number of vCPUs" in e.fault_message and e.fault_message in e.message
            assert (e.method, e.path) == ("PUT", "/machine-config")
            with pytest.raises(FirecrackerAPIError, match="No such file"):
                await api.put_drive("x", "missing.img")
            with pytest.raises(FirecrackerAPIError):
                await api.put_snapshot_load("missing.vmstate", "missing.mem")
            with pytest.raises(FirecrackerAPIError, match="unknown field"):
                await api.request("PUT", "/machine-config",
                                  {"vcpu_count": 1, "mem_size_mib": 128, "bogus": 1})
        proc.kill()
        proc.wait()
        async with FirecrackerAPI(work / "api.sock") as api:
            with pytest.raises(EngineError, match="unreachable") as err2:
                await api.get_version()
            assert not isinstance(err2.value, FirecrackerAPIError)

    try:
        run(go())
    finally:
        proc.kill()
        proc.wait()


# -- the engine ---------------------------------------------------------------------------


def test_boot_pause_resume_stop(fc_bins, image, work: Path) -> None:  # noqa: ANN001
    engine = FirecrackerEngine(fc_bins["firecracker"], unjailed=True)
    spec = spec_for(image, work)

    async def go() -> None:
        s = time.perf_counter()
        vm = await engine.boot(spec)
        boot_s = time.perf_counter() - s
        p = spec.paths
        try:
            assert vm.alive() and vm.engine == "firecracker"
            assert int(p.pid_file.read_text()) == vm.pid
            assert os.readlink(f"/proc/{vm.pid}/cwd") == str(p.dir)  # private working dir
            names = {x.name for x in p.dir.iterdir()}
            assert {"vmlinux", "initrd.img", "rootfs.ext4", "disk.ext4", "firecracker.sock",
                    "agent.sock", "serial.log", "vmm.pid", "vm.json"} <= names
            assert (p.dir / "rootfs.ext4").stat().st_ino == image.rootfs.stat().st_ino
            disk = (p.dir / "disk.ext4").stat()
            assert disk.st_size == 512 << 20 and disk.st_blocks * 512 < 16 << 20  # sparse
            assert await state_of(engine, vm) == "Running"
            async with FirecrackerAPI(engine.files_of(vm).api) as api:
                cfg = await api.get_vm_config()
            args = cfg["boot-source"]["boot_args"]
            assert "hangar.overlay=/dev/vdb" in args and "hangar.channel=vsock" in args
            assert [d["is_read_only"] for d in cfg["drives"]] == [True, False]
            assert cfg["machine-config"]["mem_size_mib"] == 256

            s = time.perf_counter()
            await engine.pause(vm)
            pause_s = time.perf_counter() - s
            assert await state_of(engine, vm) == "Paused"
            await engine.resume(vm)
            assert await state_of(engine, vm) == "Running"
            print(f"\nengine boot {boot_s * 1000:.0f} ms, pause {pause_s * 1000:.1f} ms")

            adopted = engine.adopt(spec.sandbox_id, p, vm.pid)
            assert adopted is not None and adopted.extra["vm_id"] == vm.extra["vm_id"]
            assert engine.adopt("sb-other", p, vm.pid) is None
            assert engine.adopt(spec.sandbox_id, p, os.getpid()) is None
        finally:
            await engine.stop(vm)
        assert not vm.alive() and not p.dir.exists()
        assert engine.adopt(spec.sandbox_id, p, vm.pid) is None

    run(go())


def test_connect_agent_handshake_times_out_without_a_guest(fc_bins, image,  # noqa: ANN001
                                                            work: Path) -> None:
    """Here no guest runs: CONNECT 52 gets no OK and connect_agent ends with Timeout."""
    engine = FirecrackerEngine(fc_bins["firecracker"], unjailed=True)
    spec = spec_for(image, work)

    async def go() -> None:
        vm = await engine.boot(spec)
        try:
            s = time.monotonic()
            with pytest.raises(Timeout, match="console"):
                await engine.connect_agent(vm, 1.5)
            assert time.monotonic() - s < 5
            assert vm.alive()
        finally:
            await engine.stop(vm)

    run(go())


def test_snapshot_and_restore(fc_bins, image, work: Path) -> None:  # noqa: ANN001
    engine = FirecrackerEngine(fc_bins["firecracker"], unjailed=True)
    spec = spec_for(image, work)
    dest = work / "snap"

    async def go() -> None:
        vm = await engine.boot(spec)
        vm2 = None
        try:
            s = time.perf_counter()
            snap = await engine.snapshot(vm, dest)
            snap_s = time.perf_counter() - s
            assert await state_of(engine, vm) == "Paused"  # the VM ends paused
            assert {x.name for x in dest.iterdir()} == {"vmstate", "memory", "disk.ext4",
                                                        "snapshot.json"}
            sizes = {x.name: x.stat().st_blocks * 512 for x in dest.iterdir()}
            assert all(v > 0 for v in sizes.values()), sizes
            assert snap.size_bytes == sizes["vmstate"] + sizes["memory"] + sizes["disk.ext4"]
            assert (dest / "memory").stat().st_size == 256 << 20
            m = read_snapshot(dest)
            assert (m.engine, m.vcpus, m.memory_mib, m.image_digest) == (
                "firecracker", 1, 256, image.digest)
            assert m.extra["type"] == "Full"
            print(f"\nsnapshot of a 256 MiB VM: {snap_s * 1000:.0f} ms, files {sizes} bytes "
                  f"allocated, memory apparent {(dest / 'memory').stat().st_size} bytes")

            with pytest.raises(EngineError, match="not empty"):
                await engine.snapshot(vm, dest)

            spec2 = spec_for(image, work)
            s = time.perf_counter()
            vm2 = await engine.restore(spec2, dest)
            restore_s = time.perf_counter() - s
            print(f"restore (new process + snapshot load + resume): {restore_s * 1000:.0f} ms")
            assert vm2.pid != vm.pid and vm2.alive()
            assert await state_of(engine, vm2) == "Running"
            files2 = engine.files_of(vm2)
            assert files2.disk.stat().st_ino != (dest / "disk.ext4").stat().st_ino  # a copy
            assert files2.vsock.exists()  # recreated in the new sandbox's directory
            await engine.resume(vm)
            assert await state_of(engine, vm) == "Running"

            bad = dataclasses.replace(spec_for(image, work), memory_mib=512)
            with pytest.raises(InvalidRequest, match="256 MiB"):
                await engine.restore(bad, dest)
            assert not bad.paths.dir.exists()
        finally:
            await engine.stop(vm)
            if vm2 is not None:
                await engine.stop(vm2)
        assert read_snapshot(dest).extra["type"] == "Full"  # the snapshot outlives its VMs
        shutil.rmtree(dest)

    run(go())


def test_diff_snapshot_equals_a_full_one(fc_bins, image, work: Path) -> None:  # noqa: ANN001
    engine = FirecrackerEngine(fc_bins["firecracker"], unjailed=True)
    spec = spec_for(image, work)

    async def go() -> None:
        vm = await engine.boot(spec)
        restored = None
        try:
            await engine.snapshot(vm, work / "s1")
            await engine.resume(vm)
            await asyncio.sleep(0.5)
            s = time.perf_counter()
            d = await engine.snapshot(vm, work / "s2", diff=True)
            diff_s = time.perf_counter() - s
            assert read_snapshot(work / "s2").extra["type"] == "Diff"
            assert read_snapshot(work / "s2").extra["base"] == str(work / "s1")
            # Nothing ran since (the VM stays paused): a full snapshot now must match.
            vm.extra.pop("last_snapshot")
            await engine.snapshot(vm, work / "s3")
            assert read_snapshot(work / "s3").extra["type"] == "Full"
            assert (work / "s2" / "memory").read_bytes() == (work / "s3" / "memory").read_bytes()
            print(f"\ndiff snapshot {diff_s * 1000:.0f} ms, {d.size_bytes} bytes allocated")
            restored = await engine.restore(spec_for(image, work), work / "s2")
            assert await state_of(engine, restored) == "Running"
            # the restored VM tracks dirty pages against the snapshot it came from
            await engine.snapshot(restored, work / "s4", diff=True)
            assert read_snapshot(work / "s4").extra["base"] == str(work / "s2")
        finally:
            await engine.stop(vm)
            if restored is not None:
                await engine.stop(restored)
        for n in ("s1", "s2", "s3", "s4"):
            shutil.rmtree(work / n, ignore_errors=True)

    run(go())


def test_failures_leave_nothing_behind(fc_bins, image, work: Path) -> None:  # noqa: ANN001
    engine = FirecrackerEngine(fc_bins["firecracker"], unjailed=True)

    async def go() -> None:
        # Firecracker refuses the machine config: its fault message comes through.
        spec = spec_for(image, work, vcpus=64)
        with pytest.raises(FirecrackerAPIError, match="number of vCPUs"):
            await engine.boot(spec)
        assert not spec.paths.dir.exists()

        # A missing image file fails before the VMM starts.
        broken = dataclasses.replace(image, initrd=work / "missing-initrd.img")
        spec = spec_for(broken, work)
        with pytest.raises(EngineError, match="missing-initrd"):
            await engine.boot(spec)
        assert not spec.paths.dir.exists()

        # The VMM dies under a running VM: stop still removes everything.
        spec = spec_for(image, work)
        vm = await engine.boot(spec)
        os.kill(vm.pid, 9)
        with pytest.raises(EngineError, match="unreachable"):
            await engine.pause(vm)
        with pytest.raises(EngineError):
            await engine.snapshot(vm, work / "never")
        assert not (work / "never").exists()
        await engine.stop(vm)
        assert not spec.paths.dir.exists()

        # A restore whose snapshot is unusable removes the half-made sandbox.
        (work / "junk").mkdir()
        spec = spec_for(image, work)
        with pytest.raises(NotFound):
            await engine.restore(spec, work / "junk")
        assert not spec.paths.dir.exists()
        shutil.rmtree(work / "junk")

    run(go())


def test_failed_start_reports_the_vmm_error(fc_bins, image, work: Path,  # noqa: ANN001
                                            ) -> None:
    """A VMM that exits at start (here: its log file is a directory) fails boot cleanly."""
    engine = FirecrackerEngine(fc_bins["firecracker"], unjailed=True)
    spec = spec_for(image, work)
    orig = engine._prepare

    def sabotage(s: VMSpec, files) -> None:  # noqa: ANN001
        orig(s, files)
        files.log.unlink()
        files.log.mkdir()

    engine._prepare = sabotage  # type: ignore[method-assign]

    async def go() -> None:
        with pytest.raises(EngineError, match="exited before its API answered") as err:
            await engine.boot(spec)
        assert "logger" in err.value.message.lower() or "Is a directory" in err.value.message
        assert not spec.paths.dir.exists()

    run(go())


def test_jailer(fc_bins, image, work: Path) -> None:  # noqa: ANN001
    if os.geteuid() != 0:
        pytest.skip("the jailer needs root")
    config = JailerConfig(fc_bins["jailer"])
    engine = FirecrackerEngine(fc_bins["firecracker"], jailer=config)
    spec = spec_for(image, work)

    async def go() -> None:
        vm = await engine.boot(spec)
        vm2 = None
        try:
            files = engine.files_of(vm)
            uid = int(vm.extra["uid"])
            assert config.allocator().lookup(spec.paths.dir) == uid
            root = spec.paths.dir / "firecracker" / files.vm_id / "root"
            assert files.root == root and root.is_dir()
            st = proc_status(vm.pid)
            assert st["Uid"].split() == [str(uid)] * 4 and st["Gid"].split() == [str(uid)] * 4
            assert st["NSpid"].split() == [str(vm.pid), "1"]  # --new-pid-ns: its own
            assert (spec.paths.pid_file).read_text().strip() == str(vm.pid)
            # pivot_root in its own mount namespace: its / is the jail's root
            assert os.readlink(f"/proc/{vm.pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")
            seen = set(os.listdir(f"/proc/{vm.pid}/root"))
            assert seen == {x.name for x in root.iterdir()} and "etc" not in seen
            assert root.stat().st_uid == uid
            kvm = (root / "dev" / "kvm").stat()
            assert stat.S_ISCHR(kvm.st_mode) and kvm.st_uid == uid
            assert (root / "firecracker").is_file()  # the jailer's copy of the binary
            assert (root / "disk.ext4").stat().st_uid == uid
            assert {"vmlinux", "initrd.img", "rootfs.ext4", "firecracker.sock",
                    "agent.sock"} <= {x.name for x in root.iterdir()}
            assert await state_of(engine, vm) == "Running"
            if engine.cgroup_version == "1":
                mem = Path("/sys/fs/cgroup/memory/hangar") / files.vm_id
                assert int((mem / "memory.limit_in_bytes").read_text()) == (256 + 128) << 20
                assert str(vm.pid) in (mem / "tasks").read_text().split()
                cpu = Path("/sys/fs/cgroup/cpu/hangar") / files.vm_id
                assert int((cpu / "cpu.cfs_quota_us").read_text()) == 100_000
            elif engine.cgroup_version == "2":
                cg = Path(Path(f"/proc/{vm.pid}/cgroup").read_text().split("::")[-1].strip())
                assert cg.name == files.vm_id
            # snapshot under the jailer, restore into another jail (another uid)
            snap = await engine.snapshot(vm, work / "jsnap")
            assert snap.size_bytes > 0
            assert all(x.stat().st_uid == 0 for x in (work / "jsnap").iterdir())
            vm2 = await engine.restore(spec_for(image, work), work / "jsnap")
            assert await state_of(engine, vm2) == "Running"
            assert proc_status(vm2.pid)["Uid"].split()[0] == vm2.extra["uid"]
            assert engine.adopt(spec.sandbox_id, spec.paths, vm.pid) is not None
        finally:
            await engine.stop(vm)
            if vm2 is not None:
                await engine.stop(vm2)
        assert not spec.paths.dir.exists()
        shutil.rmtree(work / "jsnap", ignore_errors=True)

    run(go())
    assert not our_cgroups()


def test_probe_boot_leaves_nothing(fc_bins, image) -> None:  # noqa: ANN001
    before = set(Path("/tmp").glob("hangar-fcprobe-*"))
    ok, reason = probe_boot(image, fc_bins["firecracker"], timeout=2)
    assert isinstance(ok, bool) and reason
    assert set(Path("/tmp").glob("hangar-fcprobe-*")) == before
    assert not [p for p in our_pids()]


# -- doctor ---------------------------------------------------------------------------------


def test_doctor_and_choose_engine(fc_bins, image, guest_runs) -> None:  # noqa: ANN001
    from hangar.engines.doctor import choose_engine, diagnose
    from hangar.engines.qemu import QemuEngine

    d = Path(tempfile.mkdtemp(prefix="hfc-doc-", dir="/tmp"))
    try:
        for cache in ("engine-probe.json", "firecracker-probe.json"):
            if (SHARED / cache).exists():
                shutil.copy(SHARED / cache, d / cache)
        layout = Layout(d)
        report = diagnose(layout, image)
        text = "\n".join(report.lines())
        assert f"firecracker: {FIRECRACKER_VERSION}" in text
        assert f"jailer: {FIRECRACKER_VERSION}" in text
        assert "qemu-system-x86_64:" in text and "engine 'auto' picks:" in text
        assert report.firecracker_boots is guest_runs[0]
        engine = choose_engine("auto", layout, image)
        if guest_runs[0]:
            assert report.auto_engine == "firecracker" and engine.name == "firecracker"
        else:
            assert report.auto_engine == "qemu" and isinstance(engine, QemuEngine)
            assert "Firecracker's probe boot failed" in report.auto_reason
        assert choose_engine("firecracker", layout, image).name == "firecracker"
        assert choose_engine("qemu", layout, image).name == "qemu"
        with pytest.raises(InvalidRequest):
            choose_engine("vmware", layout, image)
        print("\n" + text)
    finally:
        shutil.rmtree(d)


# -- agent channel pieces that run without a guest -------------------------------------------


def test_agent_from_streams_over_a_real_agent(tmp_path: Path) -> None:
    from hangar.guest.agent import Agent, serve_unix

    async def go() -> None:
        path = Path(tempfile.mkdtemp(prefix="hfc-ag-", dir="/tmp")) / "a.sock"
        server = asyncio.create_task(serve_unix(Agent(), str(path)))
        try:
            for _ in range(100):
                if path.exists():
                    break
                await asyncio.sleep(0.01)
            reader, writer = await asyncio.open_unix_connection(str(path))
            client = await AgentClient.from_streams(reader, writer, 5)
            assert client.hello["protocol"] == P.VERSION
            r = await client.exec({"op": "exec", "argv": ["echo", "hi"]})
            assert r.exit_code == 0 and r.stdout.head == b"hi\n"
            await client.close()
            # a stream that never says HELLO
            a, b = socket.socketpair()
            r2, w2 = await asyncio.open_connection(sock=a)
            with pytest.raises(Timeout):
                await AgentClient.from_streams(r2, w2, 0.3)
            b.close()
        finally:
            server.cancel()
            await asyncio.gather(server, return_exceptions=True)
            shutil.rmtree(path.parent, ignore_errors=True)

    run(go())


def test_kernel_channel(tmp_path: Path) -> None:
    from hangar.guest.agent import kernel_channel

    f = tmp_path / "cmdline"
    f.write_text("console=ttyS0 root=/dev/vda hangar.channel=vsock quiet\n")
    assert kernel_channel(str(f)) == "vsock"
    f.write_text("console=ttyS0\n")
    assert kernel_channel(str(f)) is None
    assert kernel_channel(str(tmp_path / "absent")) is None


def test_serve_vsock_listens() -> None:
    """The agent's vsock listener binds its port (this host has vsock, but no loopback)."""
    from hangar.guest.agent import Agent, serve_vsock

    try:
        socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM).close()
    except (OSError, AttributeError):
        pytest.skip("this host has no AF_VSOCK")
    port = 40000 + secrets.randbelow(20000)

    async def go() -> None:
        task = asyncio.create_task(serve_vsock(Agent(), port))
        try:
            await asyncio.sleep(0.2)
            assert not task.done()
            probe = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)
            with pytest.raises(OSError):  # EADDRINUSE: the agent holds the port
                probe.bind((socket.VMADDR_CID_ANY, port))
            probe.close()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    run(go())


# -- with a running guest (a KVM host that runs ordinary guest kernels) --------------------------


def test_agent_over_vsock_exec_snapshot_restore(fc_bins, image, work: Path,  # noqa: ANN001
                                                guest_runs) -> None:
    if not guest_runs[0]:
        pytest.skip(f"no guest runs under Firecracker on this host: {guest_runs[1]}")
    engine = FirecrackerEngine(fc_bins["firecracker"], unjailed=True)
    spec = spec_for(image, work)

    async def go() -> None:
        vm = await engine.boot(spec)
        vm2 = None
        try:
            agent = await engine.connect_agent(vm, 60)
            r = await agent.exec({"op": "exec", "shell": "echo hello; cat /proc/cmdline"})
            assert r.exit_code == 0 and b"hello" in r.stdout.head
            assert b"hangar.channel=vsock" in r.stdout.head
            await agent.exec({"op": "exec", "shell": "echo kept > /root/mark"})
            await agent.close()
            await engine.snapshot(vm, work / "gsnap")
            vm2 = await engine.restore(spec_for(image, work), work / "gsnap")
            agent2 = await engine.connect_agent(vm2, 30)  # vsock reconnect after restore
            r = await agent2.exec({"op": "exec", "shell": "cat /root/mark"})
            assert r.stdout.head == b"kept\n"
            await agent2.close()
        finally:
            await engine.stop(vm)
            if vm2 is not None:
                await engine.stop(vm2)
        shutil.rmtree(work / "gsnap", ignore_errors=True)

    run(go())


SPLIT_SCRIPT = r'''
import asyncio, json, os, sys
from pathlib import Path

from hangar.engines.base import VMSpec
from hangar.engines.confine import ConfineConfig, Confinement
from hangar.engines.firecracker import FirecrackerAPI, FirecrackerEngine, JailerConfig
from hangar.engines.firecracker.hostjail import HostJail
from hangar.images import resolve_image
from hangar.layout import Layout
from hangar.roothelper import split

data, fc, jb, jails, sid1, sid2 = sys.argv[1:7]
layout = Layout(Path(data))
layout.ensure()
image = resolve_image(layout, "base")
config = JailerConfig(Path(jb), chroot_base=Path(jails))
_, helper = split(layout, Confinement(ConfineConfig()), "hangar", None,
                  lambda gid: HostJail(config, Path(fc), gid))
engine = FirecrackerEngine(Path(fc), jailer=config, helper=helper)


def status(pid):
    return dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())


async def state(vm):
    async with FirecrackerAPI(engine.files_of(vm).api) as api:
        return (await api.get_instance_info()).state


async def go():
    out = {"server": [os.getuid(), os.getgid()], "describe": engine.describe()}
    vm = await engine.boot(VMSpec(sid1, image, layout.sandbox(sid1), memory_mib=256, disk_mib=512))
    vm2 = None
    try:
        files = engine.files_of(vm)
        st = status(vm.pid)
        out["vmm"] = [st["Uid"].split(), st["Gid"].split(), st["NSpid"].split()]
        out["pid"] = vm.pid
        out["root"] = str(files.root)
        out["root_mode"] = oct(files.root.stat().st_mode & 0o7777)
        out["linked"] = [os.stat(files.rootfs).st_ino == os.stat(image.rootfs).st_ino]
        out["state"] = await state(vm)
        dest = layout.snapshots / "s1"
        await engine.snapshot(vm, dest)
        out["snapshot"] = sorted((f.name, f.stat().st_uid) for f in dest.iterdir())
        vm2 = await engine.restore(VMSpec(sid2, image, layout.sandbox(sid2), memory_mib=256,
                                          disk_mib=512), dest)
        out["state2"] = await state(vm2)
        out["uid2"] = status(vm2.pid)["Uid"].split()[0]
        out["adopt"] = engine.adopt(sid1, layout.sandbox(sid1), vm.pid) is not None
    finally:
        await engine.stop(vm)
        if vm2 is not None:
            await engine.stop(vm2)
    out["alive"] = [os.path.exists(f"/proc/{vm.pid}")]
    out["sandboxes_left"] = os.listdir(layout.sandboxes)
    print(json.dumps(out))


asyncio.run(go())
'''


def test_jailer_through_the_privileged_helper(fc_bins, base_image) -> None:  # noqa: ANN001
    """A server split from root (HANGAR_PRIVSEP, the default) runs Firecracker jailed: its
    helper claims the uid, makes the jail (root's, outside the server's folders), links
    the image in and starts the jailer; the unprivileged server boots, snapshots (files
    of its own), restores into another jail and stops, leaving nothing."""
    if os.geteuid() != 0:
        pytest.skip("the split starts as root")
    from conftest import SRC, make_data_dir

    d = make_data_dir(base_image, privsep=True)
    # The binaries in the server's own data directory (``<data>/bin``, as an install puts
    # them): the shared cache is root's alone (0700), which the dropped server cannot enter.
    (d / "bin").mkdir()
    bins = {n: d / "bin" / n for n in ("firecracker", "jailer")}
    for n, dst in bins.items():
        shutil.copy(fc_bins[n], dst)
        dst.chmod(0o755)
    jails = Path(tempfile.mkdtemp(prefix="hfj-", dir="/tmp"))
    sid1, sid2 = f"sb-{new_id()}", f"sb-{new_id()}"
    try:
        out = subprocess.run(
            [sys.executable, "-c", SPLIT_SCRIPT, str(d), str(bins["firecracker"]),
             str(bins["jailer"]), str(jails), sid1, sid2],
            capture_output=True, text=True, timeout=300,
            env={**os.environ, "PYTHONPATH": str(SRC)})
        assert out.returncode == 0, out.stderr[-3000:]
        got = json.loads(out.stdout.strip().splitlines()[-1])
        jails_left = os.listdir(jails / "firecracker")
        err = out.stderr[-2000:]
    finally:
        shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(jails, ignore_errors=True)
    import pwd
    hangar = pwd.getpwnam("hangar")
    assert got["server"] == [hangar.pw_uid, hangar.pw_gid]
    assert got["describe"]["jailer"] == "on, through the privileged helper"
    uids, gids, nspid = got["vmm"]
    assert len(set(uids)) == 1 and 500_000 <= int(uids[0]) < 500_000 + 65_536, uids
    assert gids == [str(hangar.pw_gid)] * 4  # the server's group: it reaches the sockets
    assert nspid[-1] == "1"  # --new-pid-ns
    assert got["root"].startswith(str(jails) + "/firecracker/hangar-")
    assert got["root_mode"] == "0o770"
    assert got["linked"] == [True], err  # linked by the helper, not copied
    assert got["state"] == "Running" and got["state2"] == "Running"
    assert got["uid2"] != uids[0]
    assert {uid for _, uid in got["snapshot"]} == {hangar.pw_uid}  # the server's own copies
    assert "snapshot.json" in {n for n, _ in got["snapshot"]}
    assert got["adopt"] is True
    assert got["alive"] == [False]
    assert got["sandboxes_left"] == [] and jails_left == []
    assert not our_cgroups()
