"""Template snapshots of real QEMU microVMs: clones share the template's memory.

Engine level (no server), as tests/test_qemu_snapshot.py. One template
(the base image, 256 MiB, booted with ``VMSpec.template_source`` and saved
with ``snapshot(..., template=True)``) is made per module; each test
restores its own clones from it and stops them. Figures measured on the
2-core TCG host (docs/performance.md, "Template memory"): ten idle clones
hold 0.25 times the Pss of ten idle cold boots (0.30 counting the
template's sealed copy once), and a clone that writes 100 MiB holds about
114 MiB more, its siblings about 2 MiB more (idle drift).
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import boot_cold, engine_dir, vmm_pids

from hangar.engines import process, snapshot_io
from hangar.engines.agent_client import AgentClient
from hangar.engines.base import VM, VMSpec
from hangar.engines.qemu import QemuEngine, choose_accel
from hangar.errors import EngineError
from hangar.images import GuestImage, resolve_image
from hangar.layout import Layout

pytestmark = pytest.mark.vm

AGENT_TIMEOUT_S = 180.0
MEMORY_MIB = 256
CLONES = 10
BOOTS_AT_ONCE = 2
"""Cold boots started together (the host's two cores)."""
SETTLE_S = 20.0
"""Seconds every VM idles before its Pss is read (the balloon reports every 5 s)."""
PSS_RATIO_MAX = 0.40
"""Ten clones' Pss over ten cold boots' (measured 0.25)."""
HOST_RATIO_MAX = 0.45
"""The same with the template's sealed copy counted once, mapped or not (measured 0.30)."""
WRITE_MIB = 100
PUNCH_HOLE, KEEP_SIZE = 0x02, 0x01  # fallocate(2) modes
SIBLING_GROWTH_MAX_MIB = 10.0
"""A sibling's Rss may grow this much while another clone writes (measured 0-3 MiB)."""


@dataclass
class Template:
    """The module's template snapshot and the engine that made it."""

    root: Path
    layout: Layout
    image: GuestImage
    engine: QemuEngine
    snap: Path

    def spec(self, name: str, memory_mib: int = MEMORY_MIB) -> VMSpec:
        sid = f"{name}-{uuid.uuid4().hex[:6]}"
        return VMSpec(sid, self.image, self.layout.sandbox(sid), memory_mib=memory_mib)


def smaps(pid: int) -> dict[str, float]:
    """``/proc/PID/smaps_rollup`` in MiB."""
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[2] == "kB":
            out[parts[0].rstrip(":")] = int(parts[1]) / 1024
    return out


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


async def sh(agent: AgentClient, command: str) -> str:
    """Run ``command`` in the guest; returns its stdout, asserting exit status 0."""
    r = await agent.exec({"op": "exec", "shell": command, "timeout": 120})
    assert r.exit_code == 0, (command, r.exit_code, r.stdout.head, r.stderr.head)
    return r.stdout.head.decode()


class Running:
    """The VMs and agents one test started, stopped in its ``finally``."""

    def __init__(self, t: Template) -> None:
        self.t = t
        self.vms: list[VM] = []
        self.agents: list[AgentClient] = []

    async def boot(self, name: str) -> tuple[VM, AgentClient]:
        vm, agent = await boot_cold(self.t.engine, self.t.spec(name), AGENT_TIMEOUT_S)
        self.vms.append(vm)
        self.agents.append(agent)
        return vm, agent

    async def boot_all(self, names: list[str]) -> list[tuple[VM, AgentClient]]:
        """``boot`` each of ``names``, ``BOOTS_AT_ONCE`` at a time (a boot under emulation
        keeps one core busy: one at a time leaves the other idle); in ``names``' order."""
        gate = asyncio.Semaphore(BOOTS_AT_ONCE)

        async def one(name: str) -> tuple[VM, AgentClient]:
            async with gate:
                return await self.boot(name)

        got = await asyncio.gather(*(one(n) for n in names), return_exceptions=True)
        for g in got:  # every boot ended (its VM in ``vms``, for ``stop_all``) before a raise
            if isinstance(g, BaseException):
                raise g
        return [g for g in got if not isinstance(g, BaseException)]

    async def restore(self, name: str, snap: Path | None = None) -> tuple[VM, AgentClient]:
        vm = await self.t.engine.restore(self.t.spec(name), snap or self.t.snap)
        self.vms.append(vm)
        agent = await self.t.engine.connect_agent(vm, AGENT_TIMEOUT_S)
        self.agents.append(agent)
        return vm, agent

    async def stop_all(self) -> None:
        for agent in self.agents:
            await agent.close()
        for vm in self.vms:
            try:
                await self.t.engine.stop(vm)
            except Exception:
                pass


@pytest.fixture(scope="module")
def template(base_image: Path) -> Iterator[Template]:
    with engine_dir(base_image, "ht-") as root:
        layout = Layout(root)
        layout.ensure()
        image = resolve_image(layout, "base")
        accel, _ = choose_accel(layout, image.kernel, image.initrd)
        engine = QemuEngine(accel)
        t = Template(root, layout, image, engine, root / "snapshots" / "tmpl")

        async def make() -> None:
            spec = VMSpec("source", image, layout.sandbox("source"), memory_mib=MEMORY_MIB,
                          template_source=True)
            vm, agent = await boot_cold(engine, spec, AGENT_TIMEOUT_S)
            try:
                await sh(agent, "echo template > /root/made.txt; sync")
                await asyncio.sleep(5)  # the guest settles, as a template's ready check would
                await engine.snapshot(vm, t.snap, template=True)
                await agent.close()
            finally:
                await engine.stop(vm)

        asyncio.run(make())
        yield t


def test_template_files_hold_memory_once_and_device_state_only(template: Template) -> None:
    m = snapshot_io.read_manifest(template.snap)
    memory = snapshot_io.template_memory(template.snap)
    assert m.template and m.vmm_version == template.engine.version
    assert m.memory_sha256 == sha256(memory)
    assert memory.stat().st_size == MEMORY_MIB << 20
    assert memory.stat().st_mode & 0o777 == 0o444, "immutable: nobody's to write"
    assert m.memory_bytes == memory.stat().st_blocks * 512 < (MEMORY_MIB << 20) // 2
    assert m.state_bytes < 1 << 20, "the stream holds device state, not RAM"
    assert m.total_bytes == m.state_bytes + m.disk_bytes + m.memory_bytes


def test_ten_clones_share_pages(template: Template) -> None:
    async def body() -> None:
        run = Running(template)
        try:
            cold = await run.boot_all([f"cold{i}" for i in range(CLONES)])
            with pytest.raises(EngineError, match="template source"):
                await template.engine.snapshot(cold[0][0], template.root / "no", template=True)
            assert not (template.root / "no").exists()
            clones = []
            for i in range(CLONES):
                vm, agent = await run.restore(f"clone{i}")
                assert await sh(agent, "cat /root/made.txt") == "template\n"
                clones.append((vm, agent))
            await asyncio.sleep(SETTLE_S)
            cold_pss = sum(smaps(vm.pid)["Pss"] for vm, _ in cold)
            clone_pss = sum(smaps(vm.pid)["Pss"] for vm, _ in clones)
            maps = Path(f"/proc/{clones[0][0].pid}/maps").read_text()
            assert "memfd:hangar-template" in maps
            assert str(template.snap) not in maps, "clones never map the template file"
            sealed_mib = template.engine.template_memory_bytes() / 2**20
            used = [(await template.engine.memory(vm)) for vm, _ in clones]
            guest = [u.guest_used_mib for u in used if u is not None and u.guest_used_mib]
            ratio, host_ratio = clone_pss / cold_pss, (clone_pss + sealed_mib) / cold_pss
            print(f"\n{CLONES} idle {MEMORY_MIB} MiB guests: cold boots {cold_pss:.0f} MiB Pss, "
                  f"template clones {clone_pss:.0f} MiB (ratio {ratio:.2f}); with the sealed "
                  f"template copy ({sealed_mib:.0f} MiB) once: {host_ratio:.2f}; guest's own "
                  f"use {sum(guest) / max(len(guest), 1):.0f} MiB each")
            assert ratio <= PSS_RATIO_MAX
            assert host_ratio <= HOST_RATIO_MAX
        finally:
            await run.stop_all()

    asyncio.run(body())


def test_a_write_stays_in_its_clone(template: Template) -> None:
    async def body() -> None:
        run = Running(template)
        memory = snapshot_io.template_memory(template.snap)
        saved = snapshot_io.read_manifest(template.snap).memory_sha256
        try:
            (writer, wa), *siblings = [await run.restore(f"c{i}") for i in range(3)]
            await asyncio.sleep(3)
            before = {vm.pid: smaps(vm.pid) for vm in run.vms}
            await sh(wa, f"head -c {WRITE_MIB}M /dev/urandom > /dev/shm/x")
            await asyncio.sleep(2)
            after = {vm.pid: smaps(vm.pid) for vm in run.vms}
            grew = after[writer.pid]["Private_Dirty"] - before[writer.pid]["Private_Dirty"]
            assert grew >= WRITE_MIB * 0.95, f"the writer holds its {WRITE_MIB} MiB: +{grew:.0f}"
            for vm, agent in siblings:
                assert after[vm.pid]["Rss"] - before[vm.pid]["Rss"] <= SIBLING_GROWTH_MAX_MIB
                assert await sh(agent, "ls /dev/shm") == ""
                assert await sh(agent, "cat /root/made.txt") == "template\n"
            assert sha256(memory) == saved, "the template file is unchanged"

            # Freed pages: clones report none (QEMU 7.2 would punch the shared memory).
            await sh(wa, "rm /dev/shm/x; echo 3 > /proc/sys/vm/drop_caches")
            await asyncio.sleep(8)
            assert sha256(memory) == saved
            assert "fallocate" not in writer.paths.vmm_log.read_text()
            assert "free-page-reporting=off" in " ".join(process.argv_of(writer.pid) or [])
            _, late = await run.restore("late")
            assert await sh(late, "cat /root/made.txt; ls /dev/shm") == "template\n"
        finally:
            await run.stop_all()

    asyncio.run(body())


def _tampered(template: Template, name: str, **fields: object) -> Path:
    """A copy of the template whose manifest has ``fields`` changed."""
    dest = template.root / "snapshots" / name
    shutil.copytree(template.snap, dest)
    path = snapshot_io.SnapshotPaths(dest).manifest
    raw = json.loads(path.read_text())
    raw.update(fields)
    path.write_text(json.dumps(raw))
    return dest


def test_a_mismatched_template_is_refused(template: Template) -> None:
    engine = template.engine

    async def refused(spec: VMSpec, snap: Path, match: str) -> None:
        started = time.monotonic()
        with pytest.raises(EngineError, match=match):
            await engine.restore(spec, snap)
        assert time.monotonic() - started < 5.0
        assert not spec.paths.dir.exists(), "no half-made sandbox"
        assert not vmm_pids(spec.sandbox_id), "no guest was started"

    async def body() -> None:
        other_qemu = _tampered(template, "qemu", vmm_version="QEMU emulator version 7.1.0")
        await refused(template.spec("ver"), other_qemu, "rebuild the template")
        await refused(template.spec("size", memory_mib=512), template.snap, "machine")
        other_machine = _tampered(template, "machine", machine=["-M", "microvm", "-smp", "2"])
        await refused(template.spec("mach"), other_machine, "machine")
        other_image = _tampered(template, "image", image_digest="000000000000")
        await refused(template.spec("img"), other_image, "needs image")

        changed = _tampered(template, "bytes")
        memory = snapshot_io.template_memory(changed)
        memory.chmod(0o644)
        with open(memory, "r+b") as f:
            f.seek(MEMORY_MIB << 19)
            f.write(b"\xff" * 4096)
        await refused(template.spec("bytes"), changed, "has changed")
        engine.release_snapshot(changed)

        run = Running(template)
        try:  # the template itself still restores
            _, agent = await run.restore("ok")
            assert await sh(agent, "cat /root/made.txt") == "template\n"
        finally:
            await run.stop_all()

    asyncio.run(body())


def test_a_clone_argv_maps_the_memory_privately(tmp_path: Path) -> None:
    from hangar.engines.qemu import RamFile, without_tuning

    img = GuestImage(name="base", digest="d", dir=tmp_path, kernel=tmp_path / "vmlinuz",
                     initrd=tmp_path / "initrd.img", rootfs=tmp_path / "rootfs.ext4",
                     kernel_version="6.1", vmlinux=tmp_path / "vmlinux")
    spec = VMSpec("sb-1", img, Layout(tmp_path).sandbox("sb-1"), memory_mib=256)
    engine = QemuEngine("tcg")
    clone = engine.command(spec, ram=RamFile("/vmm-fd/9", shared=False))
    assert clone[clone.index("-M") + 1].endswith(",memory-backend=microvm.ram")
    assert clone[clone.index("-object") + 1] == (
        "memory-backend-file,id=microvm.ram,mem-path=/vmm-fd/9,size=256M,share=off,"
        "merge=off,x-use-canonical-path-for-ramblock-id=off")
    assert any("free-page-reporting=off" in a for a in clone)
    assert any("free-page-reporting=on" in a for a in engine.command(spec))
    source = engine.command(spec, ram=RamFile("/s/memory.ram", shared=True))
    assert "share=on" in source[source.index("-object") + 1]
    machine = [a for a in clone[clone.index("-M"):clone.index("-m") + 2]]
    assert without_tuning(machine) == engine.machine_args(spec), "backing is not shape"


def test_the_sealed_copy_refuses_writes_and_checks_its_bytes(tmp_path: Path) -> None:
    from hangar.engines.qemu.template import TemplateMemories

    snap = tmp_path / "snap"
    snap.mkdir()
    memory = snapshot_io.template_memory(snap)
    data = os.urandom(1 << 20) + bytes(3 << 20)
    memory.write_bytes(data)
    good = hashlib.sha256(data).hexdigest()
    memories = TemplateMemories()

    async def body() -> None:
        fd = await memories.open(snap, len(data), good)
        again = await memories.open(snap, len(data), good)
        assert os.fstat(again).st_ino == os.fstat(fd).st_ino and again != fd, "filled once"
        assert (1 << 20) <= memories.resident_bytes() <= (1 << 20) + (64 << 10), \
            "zero chunks stay holes"
        memories.release(snap)
        assert os.pread(again, 16, 0) == data[:16], "a caller's descriptor outlives a release"
        os.close(again)
        assert os.pread(fd, 16, 0) == data[:16]
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"x", 0)
        with pytest.raises(PermissionError):
            os.posix_fallocate(fd, 0, 8 << 20)
        libc = ctypes.CDLL(None, use_errno=True)  # what QEMU 7.2 does to a discarded page
        assert libc.fallocate(fd, PUNCH_HOLE | KEEP_SIZE, ctypes.c_long(0),
                              ctypes.c_long(4096)) == -1
        assert ctypes.get_errno() == errno.EPERM
        assert os.pread(fd, 16, 0) == data[:16]
        os.close(fd)
        memories.release(snap)
        with pytest.raises(EngineError, match="has changed"):
            await memories.open(snap, len(data), "0" * 64)
        with pytest.raises(EngineError, match="manifest says"):
            await memories.open(snap, len(data) * 2, good)
        os.close(await memories.open(snap, len(data), good))
        memory.unlink()  # a deleted template's copy goes at the next open
        with pytest.raises(EngineError, match="no memory file"):
            await memories.open(snap, len(data), good)
        assert len(memories) == 0

    asyncio.run(body())
