"""Snapshots and restores of real QEMU microVMs, at the engine level (no server).

Each test has its own data directory under /tmp (short, for Unix socket
paths) whose ``images`` links to the shared image cache, and its own engine.
Everything a test starts is stopped in the test's ``finally``; the fixture
then kills and reports any QEMU process whose command line still names the
test's data directory, and removes the directory, pass or fail.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import boot_cold, engine_dir, vmm_pids

from hangar.engines import snapshot_io
from hangar.engines.agent_client import AgentClient
from hangar.engines.base import VM, VMSpec
from hangar.engines.qemu import QemuEngine, choose_accel, streampipe
from hangar.errors import EngineError, NotFound
from hangar.images import resolve_image
from hangar.layout import Layout, SnapshotPaths

pytestmark = pytest.mark.vm

AGENT_TIMEOUT_S = 90.0


qemu_pids = vmm_pids  # conftest: VMM processes whose command line names a marker


class Env:
    """One test's data directory, engine and the VMs it started."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.layout = Layout(root)
        self.layout.ensure()
        self.image = resolve_image(self.layout, "base")
        accel, _ = choose_accel(self.layout, self.image.kernel, self.image.initrd)
        self.engine = QemuEngine(accel)
        self.vms: list[VM] = []
        self.agents: list[AgentClient] = []

    def spec(self, name: str) -> VMSpec:
        sid = f"{name}-{uuid.uuid4().hex[:6]}"
        return VMSpec(sid, self.image, self.layout.sandbox(sid), memory_mib=512)

    def snapshot_dir(self, name: str) -> Path:
        return self.root / "snapshots" / name

    async def boot(self, name: str) -> tuple[VM, AgentClient]:
        vm, agent = await boot_cold(self.engine, self.spec(name), AGENT_TIMEOUT_S)
        self.vms.append(vm)
        self.agents.append(agent)
        return vm, agent

    async def restore(self, name: str, snap: Path) -> tuple[VM, AgentClient]:
        vm = await self.engine.restore(self.spec(name), snap)
        self.vms.append(vm)
        agent = await self.engine.connect_agent(vm, AGENT_TIMEOUT_S)
        self.agents.append(agent)
        return vm, agent

    async def stop(self, vm: VM) -> None:
        await self.engine.stop(vm)
        assert not vm.alive()
        assert not vm.paths.dir.exists()

    async def stop_all(self) -> None:
        for agent in self.agents:
            await agent.close()
        for vm in self.vms:
            try:
                await self.engine.stop(vm)
            except Exception:
                pass


@pytest.fixture
def env(base_image: Path) -> Iterator[Env]:
    with engine_dir(base_image, "hs-") as root:
        yield Env(root)


async def sh(agent: AgentClient, command: str) -> str:
    """Run ``command`` in the guest; returns its stdout, asserting exit status 0."""
    r = await agent.exec({"op": "exec", "shell": command, "timeout": 60})
    assert r.exit_code == 0, (command, r.exit_code, r.stdout.head, r.stderr.head)
    return r.stdout.head.decode()


async def start_sleeper(agent: AgentClient) -> int:
    out = await sh(agent, "nohup sleep 1000 >/dev/null 2>&1 </dev/null & echo $! > /root/sleep.pid;"
                          " cat /root/sleep.pid")
    return int(out)


async def qmp_status(env: Env, vm: VM) -> str:
    return (await env.engine._qmp(vm, "query-status"))["status"]  # type: ignore[index]


def test_restore_keeps_files_processes_and_agent(env: Env) -> None:
    async def body() -> None:
        try:
            t0 = time.monotonic()
            vm, agent = await env.boot("orig")
            await sh(agent, "echo kept > /root/note.txt; sync")
            cold = time.monotonic() - t0
            pid = await start_sleeper(agent)

            snap = env.snapshot_dir("s1")
            t0 = time.monotonic()
            files = await env.engine.snapshot(vm, snap)
            took_snapshot = time.monotonic() - t0
            assert files.dir == snap and files.size_bytes > 0
            m = snapshot_io.read_manifest(snap)
            assert m.state_bytes > 0 and m.disk_bytes > 0
            assert m.total_bytes == files.size_bytes
            assert (m.vcpus, m.memory_mib, m.image_digest) == (1, 512, env.image.digest)
            assert await qmp_status(env, vm) == "postmigrate", "the VM ends paused"

            await env.stop(vm)
            assert not qemu_pids(vm.sandbox_id)

            t0 = time.monotonic()
            vm2, agent2 = await env.restore("restored", snap)
            assert await sh(agent2, "cat /root/note.txt") == "kept\n"
            restore_to_exec = time.monotonic() - t0
            assert agent2.hello["protocol"] == agent.hello["protocol"]
            assert agent2.hello["boot_id"] == agent.hello["boot_id"], "same guest, not a new boot"
            assert await sh(agent2, "cat /root/sleep.pid") == f"{pid}\n"
            assert "sleep" in await sh(agent2, f"kill -0 {pid} && cat /proc/{pid}/cmdline")
            out = await sh(agent2, "echo after > /root/new.txt; sync; cat /root/new.txt")
            assert out == "after\n"
            await agent2.close()  # a later connection to the restored guest works too
            agent3 = await env.engine.connect_agent(vm2, AGENT_TIMEOUT_S)
            env.agents.append(agent3)
            assert await sh(agent3, "cat /root/new.txt") == "after\n"
            print(f"\n512 MiB guest: cold boot to first exec {cold:.2f} s; snapshot "
                  f"{took_snapshot:.2f} s, {files.size_bytes / 2**20:.1f} MiB (state "
                  f"{m.state_bytes / 2**20:.1f} MiB, disk {m.disk_bytes / 2**20:.1f} MiB); "
                  f"restore to first exec {restore_to_exec:.2f} s")
            await env.stop(vm2)
        finally:
            await env.stop_all()

    asyncio.run(body())


def test_one_snapshot_restores_into_independent_forks(env: Env) -> None:
    async def body() -> None:
        try:
            vm, agent = await env.boot("orig")
            await sh(agent, "echo base > /root/base.txt; sync")
            pid = await start_sleeper(agent)
            snap = env.snapshot_dir("s1")
            await env.engine.snapshot(vm, snap)
            await env.stop(vm)

            (f1, a1), (f2, a2) = await asyncio.gather(env.restore("fork1", snap),
                                                      env.restore("fork2", snap))
            await sh(a1, "echo one > /root/fork.txt; sync")
            await sh(a2, "echo two > /root/fork.txt; echo only2 > /root/only2.txt; sync")
            assert await sh(a1, "cat /root/base.txt /root/fork.txt") == "base\none\n"
            assert await sh(a2, "cat /root/base.txt /root/fork.txt") == "base\ntwo\n"
            assert await sh(a1, "test -e /root/only2.txt && echo yes || echo no") == "no\n"
            for a in (a1, a2):
                await sh(a, f"kill -0 {pid}")

            # a fork is an ordinary VM: it can be snapshotted and restored in turn
            snap2 = env.snapshot_dir("s2")
            await env.engine.snapshot(f2, snap2)
            await env.stop(f2)
            assert await sh(a1, "cat /root/fork.txt") == "one\n", "fork 1 outlives fork 2"
            _, a3 = await env.restore("fork3", snap2)
            assert await sh(a3, "cat /root/fork.txt /root/only2.txt") == "two\nonly2\n"
            assert snapshot_io.read_manifest(snap).total_bytes > 0, "snapshot 1 is untouched"
        finally:
            await env.stop_all()

    asyncio.run(body())


def test_refresh_guest_fixes_an_old_clock(env: Env) -> None:
    async def body() -> None:
        try:
            vm, agent = await env.boot("orig")
            # Stand-in for a snapshot that sat on disk for two minutes.
            await sh(agent, "date -s @$(( $(date +%s) - 120 )) >/dev/null")
            snap = env.snapshot_dir("s1")
            await env.engine.snapshot(vm, snap)
            await env.stop(vm)

            _, agent2 = await env.restore("restored", snap)
            behind = time.time() - int(await sh(agent2, "date +%s"))
            assert behind > 100, f"the restored clock should lag, lags {behind:.1f} s"
            r = await snapshot_io.refresh_guest(agent2)
            assert 100 < r["skew_s"] < 200, r
            assert r["reseed_bytes"] == 32
            guest = int(await sh(agent2, "date +%s"))
            assert abs(guest - time.time()) <= 2, (guest, time.time(), r)
        finally:
            await env.stop_all()

    asyncio.run(body())


def test_source_runs_on_after_snapshot(env: Env) -> None:
    async def body() -> None:
        try:
            vm, agent = await env.boot("orig")
            await env.engine.snapshot(vm, env.snapshot_dir("s1"))
            assert await qmp_status(env, vm) == "postmigrate"
            await env.engine.resume(vm)
            assert await qmp_status(env, vm) == "running"
            # the disk is writable again after the migration released it
            assert await sh(agent, "echo more > /root/more.txt; sync; cat /root/more.txt") \
                == "more\n"
            with pytest.raises(EngineError, match="not empty"):
                await env.engine.snapshot(vm, env.snapshot_dir("s1"))
        finally:
            await env.stop_all()

    asyncio.run(body())


def test_restore_refuses_what_cannot_work(env: Env) -> None:
    async def body() -> None:
        with pytest.raises(NotFound):
            await env.engine.restore(env.spec("x"), env.snapshot_dir("missing"))
        snap = env.snapshot_dir("fake")
        snap.mkdir(parents=True)
        SnapshotPaths(snap).state.write_bytes(b"x")
        SnapshotPaths(snap).disk.write_bytes(b"x")
        spec = env.spec("x")
        big = VMSpec(spec.sandbox_id, env.image, spec.paths, memory_mib=1024)
        manifest = snapshot_io.SnapshotManifest(
            engine="qemu", vmm_version=env.engine.version, accel=env.engine.accel,
            image_name="base", image_digest=env.image.digest, kernel_version="",
            vcpus=1, memory_mib=1024, disk_virtual_bytes=1, machine=env.engine.machine_args(big),
            created_at=time.time(), state_bytes=1, disk_bytes=1, save_seconds=0.0)
        snapshot_io.write_manifest(snap, manifest)
        with pytest.raises(EngineError, match="vCPUs, memory"):
            await env.engine.restore(spec, snap)
        assert not spec.paths.dir.exists()
        other = json.loads(SnapshotPaths(snap).manifest.read_text())
        other["image_digest"] = "000000000000"
        SnapshotPaths(snap).manifest.write_text(json.dumps(other))
        with pytest.raises(EngineError, match="needs image"):
            await env.engine.restore(big, snap)
        # a corrupt state file: QEMU fails to load it, and nothing is left behind
        other["image_digest"] = env.image.digest
        SnapshotPaths(snap).manifest.write_text(json.dumps(other))
        SnapshotPaths(snap).disk.unlink()
        subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-F", "raw", "-b",
                        str(env.image.rootfs), str(SnapshotPaths(snap).disk)], check=True)
        with pytest.raises(EngineError):
            await env.engine.restore(big, snap)
        assert not big.paths.dir.exists()
        assert not qemu_pids(big.sandbox_id)

    asyncio.run(body())


COMPRESSION_RATIO = 3.0
"""At least how many times smaller a snapshot's zstd-compressed ``state.mig`` is than the
migration stream (QEMU's bytes sent): measured 3.6 to 4.6 on idle 512 MiB guests."""


def zstd_children() -> list[int]:
    """Pids of this process's ``zstd`` children, zombies included."""
    found = []
    for d in Path("/proc").iterdir():
        try:
            comm, rest = (d / "stat").read_text().rsplit(")", 1)
        except (OSError, ValueError):
            continue
        if comm.endswith("(zstd") and int(rest.split()[1]) == os.getpid():
            found.append(int(d.name))
    return found


def legacy_copy(snap: Path, dest: Path) -> Path:
    """A copy of ``snap`` as a Hangar before compression wrote it: ``state.mig`` as QEMU
    wrote it, manifest format 1 without ``state_compression``."""
    shutil.copytree(snap, dest)
    files = SnapshotPaths(dest)
    subprocess.run(["zstd", "-d", "-q", "-f", "-o", str(files.state_partial), str(files.state)],
                   check=True)
    files.state_partial.replace(files.state)
    raw = json.loads(files.manifest.read_text())
    raw["format"] = 1
    del raw["state_compression"]
    files.manifest.write_text(json.dumps(raw))
    return dest


def test_a_snapshot_stores_memory_compressed_and_old_ones_still_restore(
        env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    async def body() -> None:
        try:
            vm, agent = await env.boot("orig")
            shm = await sh(agent, "yes hangar | head -c 16M > /dev/shm/kept; "
                                  "md5sum /dev/shm/kept")
            pid = await start_sleeper(agent)
            with monkeypatch.context() as m:  # no zstd on PATH: a clear error, VM usable
                m.setenv("PATH", str(env.root))
                with pytest.raises(EngineError, match="zstd is not installed"):
                    await env.engine.snapshot(vm, env.snapshot_dir("nozstd"))
            assert not env.snapshot_dir("nozstd").exists()
            snap = env.snapshot_dir("s1")
            await env.engine.snapshot(vm, snap)
            m = snapshot_io.read_manifest(snap)
            state = SnapshotPaths(snap).state
            assert (m.format, m.state_compression) == (2, "zstd")
            assert state.read_bytes()[:4] == streampipe.MAGIC, "a zstd frame"
            sent = m.extra["ram_transferred"]
            print(f"\nstream {sent / 2**20:.1f} MiB stored in {state.stat().st_size / 2**20:.1f}"
                  f" MiB ({sent / state.stat().st_size:.2f} x)")
            assert state.stat().st_size * COMPRESSION_RATIO < sent
            await env.stop(vm)
            assert zstd_children() == []

            for name, source in (("woken", snap),
                                 ("legacy", legacy_copy(snap, env.snapshot_dir("old")))):
                _, a = await env.restore(name, source)
                assert await sh(a, "md5sum /dev/shm/kept") == shm, name
                assert "sleep" in await sh(a, f"cat /proc/{pid}/cmdline"), name
            assert snapshot_io.read_manifest(env.snapshot_dir("old")).state_compression \
                == "none"
            assert zstd_children() == []
        finally:
            await env.stop_all()

    asyncio.run(body())


def test_a_corrupt_compressed_snapshot_fails_clearly_and_leaves_nothing(env: Env) -> None:
    async def body() -> None:
        try:
            vm, _ = await env.boot("orig")
            snap = env.snapshot_dir("good")
            await env.engine.snapshot(vm, snap)
            await env.stop(vm)
        finally:
            await env.stop_all()
        data = SnapshotPaths(snap).state.read_bytes()
        mid = len(data) // 2
        broken = {  # the content, and what the error must say
            "flipped": (data[:mid] + bytes(b ^ 0x5A for b in data[mid:mid + 4096])
                        + data[mid + 4096:], r"zstd failed reading state\.mig: .*Decoding "
                        r"error|state\.mig is corrupt \(zstd -t: .*Decoding error"),
            "truncated": (data[:mid], r"zstd failed reading state\.mig: .*premature end|"
                          r"state\.mig is corrupt \(zstd -t: .*premature end"),
            "not zstd": (b"QEVM" + bytes(4096), r"zstd failed reading state\.mig: .*"
                         r"unsupported format"),
        }
        for name, (content, says) in broken.items():
            fds = set(os.listdir("/proc/self/fd"))
            bad = env.snapshot_dir(name.replace(" ", "-"))
            shutil.copytree(snap, bad)
            SnapshotPaths(bad).state.write_bytes(content)
            spec = env.spec("bad")
            t0 = time.monotonic()
            with pytest.raises(EngineError, match=says) as exc:
                await env.engine.restore(spec, bad)
            print(f"\n{name}: {exc.value} ({time.monotonic() - t0:.1f} s)")
            assert not spec.paths.dir.exists(), name
            assert not qemu_pids(spec.sandbox_id), name
            assert zstd_children() == [], name
            assert set(os.listdir("/proc/self/fd")) <= fds, f"{name}: a descriptor left open"

        # QEMU may refuse the garbage a corrupt block decodes to before zstd reaches the
        # frame's checksum: then ``zstd -t`` of the whole file tells what is wrong.
        async with streampipe.decompressing(SnapshotPaths(env.snapshot_dir("flipped")).state
                                            ) as pipe:
            found = await pipe.verify()
        assert found is not None and "state.mig is corrupt (zstd -t: " in str(found), found
        async with streampipe.decompressing(SnapshotPaths(snap).state) as pipe:
            assert await pipe.verify() is None
        assert zstd_children() == []

    asyncio.run(body())


def test_a_refused_qmp_connect_logs_no_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             caplog: pytest.LogCaptureFixture) -> None:
    """QEMU's QMP socket exists from its ``bind()`` and refuses until its ``listen()``:
    ``qmp.session`` tries again meanwhile, and what fails in the end is one EngineError.
    ``qemu.qmp`` logs every refused try at ERROR; none of those lines reaches the log
    (a server's log once carried one, which the port tests count as a fault)."""
    import socket

    from hangar.engines.qemu import qmp
    from hangar.layout import SandboxPaths

    paths = SandboxPaths(tmp_path)
    refusing = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    refusing.bind(str(paths.qmp))  # bound, never listening: every connect is refused
    monkeypatch.setattr(qmp, "CONNECT_S", 0.5)
    vm = VM(sandbox_id="sb-refused", engine="qemu", pid=os.getpid(), paths=paths, accel="tcg")
    caplog.set_level(logging.DEBUG)

    async def connect() -> None:
        async with qmp.session(vm):
            pass

    try:
        with pytest.raises(EngineError, match="QMP connect failed"):
            asyncio.run(connect())
    finally:
        refusing.close()
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
