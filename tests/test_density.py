"""Density and boot: the memory a sandbox costs (GET), the balloon that gives freed guest
memory back, the phases every boot publishes, KSM only when asked for, and the guest's
address-space randomization (off under TCG unless the operator turns it on).

The VM tests share the session's sandbox, except those about cold boots: a sandbox of the
default size is restored from its image's template snapshot, whose clones neither boot nor
report free pages (docs/performance.md, "Booted templates"); ``cold_sandbox`` asks for
another size, so it boots.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from conftest import Waits, wait_for

from hangar.engines.boot_phases import PHASES, boot_phases
from hangar.engines.memory import smaps_rollup


@pytest.fixture(scope="module")
def cold_sandbox(api: httpx.Client) -> Iterator[str]:
    r = api.post("/sandboxes", json={"memory_mib": 384})
    assert r.status_code == 201, r.text
    assert r.json()["source"] == "cold"
    yield r.json()["id"]
    api.delete(f"/sandboxes/{r.json()['id']}")


def vmm_pid(server, sid: str) -> int:  # type: ignore[no-untyped-def]
    return int((server.data_dir / "sandboxes" / sid / "vmm.pid").read_text())


def pss_mib(pid: int) -> float:
    return smaps_rollup(pid)["Pss"] / 1024


@pytest.mark.vm
def test_get_reports_host_memory_beside_the_guests_own(api: httpx.Client, sandbox: str,
                                                       server, waits: Waits) -> None:  # type: ignore[no-untyped-def]
    def reported() -> dict | None:
        m = api.get(f"/sandboxes/{sandbox}").json()["memory"]
        return m if m and m["guest_used_mib"] is not None else None

    m = wait_for(reported, waits.vm(3), "the guest's balloon reported its memory", every=0.5)
    info = api.get(f"/sandboxes/{sandbox}").json()
    pss = pss_mib(vmm_pid(server, sandbox))
    assert abs(m["host_mib"] - pss) < max(16, pss * 0.15), (m, pss)
    assert m["host_rss_mib"] >= m["host_mib"] > 0
    assert 0 < m["guest_cache_mib"] < m["guest_used_mib"] < m["guest_total_mib"] \
        <= info["memory_mib"], m
    assert 0 <= m["guest_stats_age_s"] < 30
    # The list stays cheap: no figure there.
    listed = api.get("/sandboxes").json()["sandboxes"]
    assert all(sb["memory"] is None for sb in listed)


@pytest.mark.vm
def test_memory_the_guest_frees_goes_back_to_the_host(api: httpx.Client, cold_sandbox: str,
                                                      server, waits: Waits) -> None:  # type: ignore[no-untyped-def]
    sandbox = cold_sandbox
    pid = vmm_pid(server, sandbox)
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    assert any(a.startswith(b"virtio-balloon-device") and b"free-page-reporting=on" in a
               for a in argv), argv
    r = api.post(f"/sandboxes/{sandbox}/exec", json={
        "command": "ls /sys/bus/virtio/drivers/virtio_balloon/ | grep -c virtio"}).json()
    assert r["stdout"].strip() == "1", r

    before = pss_mib(pid)
    hold = ("import time; b = bytearray(256 << 20); b[::4096] = b'x' * len(b[::4096]); "
            "open('/tmp/held', 'w').close(); time.sleep(600)")
    r = api.post(f"/sandboxes/{sandbox}/exec", json={
        "command": f"python3 -c \"{hold}\" >/dev/null 2>&1 & "
                   "while [ ! -e /tmp/held ]; do sleep 0.1; done; echo $!"}).json()
    holder = r["stdout"].strip()
    assert holder.isdigit(), r
    try:
        wait_for(lambda: pss_mib(pid) > before + 200, waits.vm(3),
                 "the host held the guest's 256 MiB", every=0.5)
        held = pss_mib(pid)
    finally:
        api.post(f"/sandboxes/{sandbox}/exec", json={"command": f"kill {holder}; rm -f /tmp/held"})
    # Measured from what the host held, not from before: the translation buffer
    # (HANGAR_TCG_TB_MIB) may grow meanwhile with the code the guest ran, and stays.
    wait_for(lambda: pss_mib(pid) < held - 200, waits.vm(6, floor=60),
             "the 256 MiB the guest freed went back to the host", every=0.5)


@pytest.mark.vm
def test_every_boot_publishes_its_phases(api: httpx.Client, cold_sandbox: str,
                                         server) -> None:  # type: ignore[no-untyped-def]
    sandbox = cold_sandbox
    metrics = api.get("/metrics").text
    for phase in PHASES:
        line = next((ln for ln in metrics.splitlines() if ln.startswith(
            f'hangar_boot_phase_seconds_count{{phase="{phase}"}}')), None)
        assert line is not None and float(line.split()[-1]) >= 1, (phase, metrics[-2000:])
    lines = [json.loads(ln) for ln in server.log.read_text().splitlines()
             if ln.startswith("{") and '"boot ' in ln]
    mine = [ln for ln in lines if ln.get("sandbox_id") == sandbox]
    assert mine, lines[-3:]
    b = mine[-1]
    parts = sum(b[f"{p}_s"] for p in PHASES if p != "total")
    assert abs(parts - b["total_s"]) < 0.01, b
    assert all(b[f"{p}_s"] > 0 for p in ("kernel", "initramfs", "init", "agent")), b
    assert b["event"].startswith(f"boot {b['total_s']:.2f} s (vmm "), b


def test_boot_phases_take_the_guests_word_with_care() -> None:
    hello = {"uptime_s": 3.0, "boot": {"initramfs": 1.0, "init": 1.5, "agent": 1.75}}
    assert boot_phases(hello, 3.5) == {"vmm": 0.5, "kernel": 1.0, "initramfs": 0.5,
                                       "init": 0.25, "agent": 1.25, "total": 3.5}
    # An older guest (no marks), and a lying one: never negative, never above the total.
    assert boot_phases({"uptime_s": 2.0}, 3.0) == {"vmm": 1.0, "guest": 2.0, "total": 3.0}
    lying = boot_phases({"uptime_s": 1e9, "boot": {"initramfs": -5, "init": "x",
                                                  "agent": True}}, 2.0)
    assert lying == {"total": 2.0}
    odd = boot_phases({"uptime_s": 2.0, "boot": {"initramfs": 1.9, "init": 1.0,
                                                 "agent": 9.0}}, 2.5)
    assert all(0 <= v <= 2.5 for v in odd.values()), odd


def test_ksm_and_the_translation_buffer_are_settings(tmp_path: Path) -> None:
    from hangar.config import Settings
    from hangar.engines.base import VMSpec
    from hangar.engines.qemu import MemoryTuning, QemuEngine, without_tuning
    from hangar.images.builder import GuestImage
    from hangar.layout import Layout

    assert Settings(data_dir=tmp_path).ksm is False
    img = GuestImage(name="base", digest="d", dir=tmp_path, kernel=tmp_path / "vmlinuz",
                     initrd=tmp_path / "initrd.img", rootfs=tmp_path / "rootfs.ext4",
                     kernel_version="6.1", vmlinux=tmp_path / "vmlinux")
    spec = VMSpec("sb-1", img, Layout(tmp_path).sandbox("sb-1"))

    def args(engine: QemuEngine) -> list[str]:
        argv = engine.command(spec)
        return [argv[argv.index("-M") + 1], argv[argv.index("-accel") + 1],
                argv[argv.index("-kernel") + 1]]

    assert args(QemuEngine("tcg")) == ["microvm,pit=on,rtc=on,mem-merge=off",
                                       "tcg,thread=multi,tb-size=256", str(tmp_path / "vmlinux")]
    assert args(QemuEngine("tcg", tuning=MemoryTuning(tb_mib=64, ksm=True)))[:2] == [
        "microvm,pit=on,rtc=on,mem-merge=on", "tcg,thread=multi,tb-size=64"]
    assert args(QemuEngine("kvm"))[1] == "kvm"
    no_balloon = QemuEngine("tcg", tuning=MemoryTuning(balloon=False)).command(spec)
    assert not any("balloon" in a for a in no_balloon)
    # Snapshots compare the machine's shape, not how the host holds its memory.
    tuned = QemuEngine("tcg", tuning=MemoryTuning(tb_mib=64, ksm=True))
    assert without_tuning(tuned.tuned_machine_args(spec)) == QemuEngine("tcg").machine_args(spec)


def test_guest_randomization_is_off_under_tcg_only_unless_the_operator_says(
        tmp_path: Path) -> None:
    from hangar.config import Settings
    from hangar.engines.base import VMSpec
    from hangar.engines.qemu import ASLR_CHOICES, MemoryTuning, QemuEngine
    from hangar.images.builder import GuestImage
    from hangar.layout import Layout

    assert Settings(data_dir=tmp_path).guest_aslr == "auto"
    img = GuestImage(name="base", digest="d", dir=tmp_path, kernel=tmp_path / "vmlinuz",
                     initrd=tmp_path / "initrd.img", rootfs=tmp_path / "rootfs.ext4",
                     kernel_version="6.1", vmlinux=tmp_path / "vmlinux")
    spec = VMSpec("sb-1", img, Layout(tmp_path).sandbox("sb-1"))

    def norandmaps(accel: str, choice: str) -> tuple[bool, str]:
        e = QemuEngine(accel, tuning=MemoryTuning(aslr=ASLR_CHOICES[choice]))
        argv = e.command(spec)
        on = "norandmaps" in argv[argv.index("-append") + 1].split()
        assert e.guest_kernel_args() == (("norandmaps",) if on else ())
        return on, e.describe()["guest_aslr"]

    assert norandmaps("tcg", "auto") == (True, "off")
    assert norandmaps("kvm", "auto") == (False, "on")
    assert norandmaps("tcg", "on") == (False, "on")
    assert norandmaps("kvm", "off") == (True, "off")


@pytest.mark.vm
def test_a_guest_randomizes_addresses_as_its_engine_says(api: httpx.Client,
                                                         sandbox: str) -> None:
    """Under TCG a default guest's kernel maps every process at the same addresses (its
    translated code is reused: docs/performance.md); under KVM it randomizes."""
    expected = {"off": "0", "on": "2"}[api.get("/health").json()["engine"]["guest_aslr"]]
    r = api.post(f"/sandboxes/{sandbox}/exec",
                 json={"command": "cat", "args": ["/proc/sys/kernel/randomize_va_space"]})
    assert r.status_code == 200 and r.json()["stdout"].strip() == expected, r.text
