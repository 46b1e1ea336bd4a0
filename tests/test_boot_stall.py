"""A cold boot whose guest kernel disabled its only timer is told apart and given up at once.

Under emulation on a contended host, Linux sometimes judges the local APIC
timer too slow while calibrating it, leaves it masked in its calibration
state and boots on without any tick: the guest never answers (found in the
suite: ``hangar.engines.qemu.stall``). The engine reads that state from
QEMU (``info lapic``) while it waits for a cold guest's agent, and raises
``BootStalled`` after ``STALL_READINGS`` readings instead of waiting out
the boot deadline; the core then boots again.

The state itself cannot be made on demand (QEMU writes a guest's APIC only
from the guest's own vCPU), so the parser is checked on ``info lapic`` text
that QEMU printed for such a guest, and on the live text of a real booted
guest; the engine's wait is checked on a real guest whose agent channel
this test holds, with the one reading replaced.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import engine_dir

from hangar.engines import base
from hangar.engines.base import VM, VMSpec
from hangar.engines.qemu import QemuEngine, choose_accel, stall
from hangar.errors import BootStalled
from hangar.images import resolve_image
from hangar.layout import Layout

pytestmark = pytest.mark.vm

# QEMU 7.2's `info lapic` for a guest found hung in the suite's boot loop (its
# console: "APIC frequency too slow, disabling apic timer"; mount and a kworker in
# synchronize_rcu), as QMP's human-monitor-command returned it.
HUNG = (
    "dumping local APIC state for CPU 0 \r\n\r\n"
    "LVT0\t 0x00010700 active-hi edge  masked                      ExtINT (vec 0)\r\n"
    "LVT1\t 0x00000400 active-hi edge                              NMI   \r\n"
    "LVTPC\t 0x00010000 active-hi edge  masked                      Fixed  (vec 0)\r\n"
    "LVTERR\t 0x000000fe active-hi edge                              Fixed  (vec 254)\r\n"
    "LVTTHMR\t 0x00010000 active-hi edge  masked                      Fixed  (vec 0)\r\n"
    "LVTT\t 0x000300ec active-hi edge  masked         periodic     Fixed  (vec 236)\r\n"
    "Timer\t DCR=0x3 (divide by 16) initial_count = 268435455 current_count = 17516879\r\n"
    "SPIV\t 0x000001ff APIC enabled, focus=off, spurious vec 255\r\n"
    "ISR\t (none)\r\nIRR\t (none)\r\n\r\n"
    "APR 0x00 TPR 0x10 DFR 0x0f LDR 0x01 PPR 0x10\r\n")


def lapic_text(lvtt: str, initial: int) -> str:
    return HUNG.replace("0x000300ec", lvtt).replace("= 268435455", f"= {initial}")


def test_only_the_calibration_state_reads_as_stalled() -> None:
    assert stall.timer_stalled(HUNG)
    # a healthy guest's timer: one-shot, unmasked
    assert not stall.timer_stalled(lapic_text("0x000000ec", 240810))
    # before the kernel touches it (reset state), and periodic but running
    assert not stall.timer_stalled(lapic_text("0x00010000", 0))
    assert not stall.timer_stalled(lapic_text("0x000200ec", 268435455))
    # shut down after a failed verification of the calibration: dead too
    assert stall.timer_stalled(lapic_text("0x000300ec", 0))
    # a healthy guest's one-shot timer with nothing pending ("oneshot stopped")
    assert not stall.timer_stalled(lapic_text("0x000100ec", 0))
    # masked periodic with another count: not a state Linux leaves
    assert not stall.timer_stalled(lapic_text("0x000300ec", 4000000))
    for junk in ("", "unknown command: 'info lapic'", HUNG.replace("LVTT", "LVTX")):
        assert not stall.timer_stalled(junk)


@pytest.fixture
def root(base_image: Path) -> Iterator[Path]:
    with engine_dir(base_image, "hb-") as path:
        yield path


def engine_and_spec(root: Path, cls: type[QemuEngine] = QemuEngine) -> tuple[QemuEngine, VMSpec]:
    layout = Layout(root)
    layout.ensure()
    image = resolve_image(layout, "base")
    accel, _ = choose_accel(layout, image.kernel, image.initrd)
    sid = f"st-{os.urandom(3).hex()}"
    return cls(accel), VMSpec(sid, image, layout.sandbox(sid), memory_mib=512)


def test_a_real_cold_boot_is_watched_and_reads_as_healthy(root: Path) -> None:
    engine, spec = engine_and_spec(root)

    async def run() -> None:
        vm = await engine.boot(spec)
        try:
            agent = await engine.connect_agent(vm, 180, cold=True)
            await agent.close()
            text = await engine._qmp(vm, "human-monitor-command", **{"command-line": "info lapic"})
            assert isinstance(text, str) and "LVTT" in text and "initial_count" in text, text
            assert not stall.timer_stalled(text), text
            assert await engine.boot_stalled(vm) is None
        finally:
            await engine.stop(vm)

    asyncio.run(run())


class Dead(QemuEngine):
    """Reads every guest as one whose timer died (the one stand-in: see the docstring)."""

    readings = 0

    async def boot_stalled(self, vm: VM) -> str | None:
        self.readings += 1
        return stall.REASON


def test_a_stalled_boot_is_given_up_after_its_readings_not_its_deadline(root: Path) -> None:
    engine, spec = engine_and_spec(root, Dead)

    async def run() -> None:
        vm = await engine.boot(spec)
        held = socket.socket(socket.AF_UNIX)
        try:
            held.connect(str(vm.paths.agent))  # the agent's one channel: HELLO never reaches us
            t0 = time.monotonic()
            with pytest.raises(BootStalled) as caught:
                await engine.connect_agent(vm, 180, cold=True)
            took = time.monotonic() - t0
            assert engine.readings == base.STALL_READINGS
            want = base.STALL_FIRST_S + (base.STALL_READINGS - 1) * base.STALL_EVERY_S
            assert want <= took < want + 30, took
            assert caught.value.code == "boot_stalled" and caught.value.status == 502
            assert caught.value.message.startswith(stall.REASON + "; console: ")
            assert caught.value.context["sandbox_id"] == spec.sandbox_id
        finally:
            held.close()
            await engine.stop(vm)

    asyncio.run(run())
