"""Telling a cold boot that can never finish from a slow one, under QEMU.

A one-vCPU microVM's only timer after the kernel sets up its IO-APIC is
the local APIC timer (the microvm machine routes no legacy timer there).
Linux calibrates that timer once at boot (``calibrate_APIC_clock``): it
arms it masked, periodic, at its largest count, and reads it at 25 TSC
ticks of 4 ms. If the vCPU thread is descheduled for 100 ms or more
before the first of them (under TCG the guest's TSC and APIC count host
time, and a contended host can do that), the 25 reads come back to back,
the timer seems to run at a few kHz, the kernel prints "APIC frequency
too slow, disabling apic timer" and leaves the timer in that calibration
state. The guest then has no tick at all: the first ``synchronize_rcu``
(a cgroup2 mount, the freeing of a module's init memory) never returns,
and the agent never starts.

Found in this project's suite: about 1 cold boot in 150 on a 2-core host
at load 20 (QEMU 7.2, Debian's 6.1 kernel), and once in a quiet CI run;
the guest's task dump (sysrq ``w``) showed ``mount`` and a kworker in
``synchronize_rcu`` and the vCPU halted with that timer state.

The calibration's second step can end the same way: the kernel runs the
timer periodic against the jiffies, and if the counts disagree (a stall in
that window) it prints "APIC timer disabled due to verification failure"
and shuts the timer down, masked and still periodic, with a count of 0.

``timer_stalled`` reads either state from QEMU's ``info lapic`` (through
QMP's ``human-monitor-command``): the timer masked, periodic, on Linux's
timer vector. A healthy guest's timer is one-shot once booted (masked only
while no timer is pending: "oneshot stopped"), and periodic only unmasked.
During the calibration itself the timer is in the first state for about
100 ms, so a caller decides only on two readings some seconds apart
(``hangar.engines.base.Engine.connect_agent``).
"""

from __future__ import annotations

import re

LVT_MASKED = 1 << 16
LVT_PERIODIC = 1 << 17
LOCAL_TIMER_VECTOR = 0xEC
"""Linux's vector for the local APIC timer (arch/x86/include/asm/irq_vectors.h)."""
CALIBRATION_COUNT = 0xFFFFFFFF // 16
"""The initial count Linux arms for its calibration: 0xffffffff over the divisor 16."""

_LVTT = re.compile(r"^LVTT\s+0x([0-9a-fA-F]+)", re.MULTILINE)
_INITIAL = re.compile(r"initial_count\s*=\s*(\d+)")

REASON = ("the guest kernel disabled its APIC timer (its calibration was starved of CPU "
          "time by the host) and cannot finish booting without a timer")


def timer_stalled(info_lapic: str) -> bool:
    """Whether QEMU's ``info lapic`` text shows the first vCPU's timer as Linux leaves it
    when its calibration fails (masked, periodic, vector 0xec: at the calibration's count
    0x0fffffff, or 0 after a failed verification); False for any other state and for
    text it cannot read."""
    lvtt = _LVTT.search(info_lapic)
    initial = _INITIAL.search(info_lapic)
    if lvtt is None or initial is None:
        return False
    value = int(lvtt.group(1), 16)
    return (value & LVT_MASKED != 0 and value & LVT_PERIODIC != 0
            and value & 0xFF == LOCAL_TIMER_VECTOR
            and int(initial.group(1)) in (CALIBRATION_COUNT, 0))
