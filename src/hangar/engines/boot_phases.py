"""The phases of one guest boot, from the host's clock and the guest's HELLO.

The guest writes the uptime at which each step began to /run/hangar/boot
(``hangar.guest.paths.BOOT_MARKS``: the initramfs' /init, the guest init,
the agent) and the agent reports them in its HELLO with its own uptime
when it greeted. The host times the whole boot, from asking the engine to
boot to the greeting. Phases, seconds:

==============  ===================================================================
``vmm``         host time before the guest's clock began: the disk overlay, the
                VMM's start, firmware and kernel loading (and the greeting's
                trip back); the total less the guest's uptime at its HELLO
``kernel``      the kernel, up to the initramfs' /init
``initramfs``   modules, the root file system, ``switch_root``
``init``        the guest init's Python start and its set-up, up to the agent's start
``agent``       the agent's Python start (its imports) until it greets the host
``total``       the host's measure of the whole boot
==============  ===================================================================

A guest without marks (an older initramfs) gives ``vmm``, ``guest`` (its
uptime at the HELLO) and ``total`` only. The guest's figures are its own
word: they are clamped to ``[0, total]`` and only ever reported, never acted on.
"""

from __future__ import annotations

from typing import Any

PHASES = ("vmm", "kernel", "initramfs", "init", "agent", "total")


def boot_phases(hello: dict[str, Any], total_s: float) -> dict[str, float]:
    """The phases (seconds, rounded to ms) of a boot that took ``total_s`` on the host
    and ended with the HELLO meta ``hello``; see the module docstring."""
    def num(value: Any) -> float | None:
        if isinstance(value, (int, float)) and not isinstance(value, bool) \
                and 0 <= value < 1e6:
            return min(float(value), total_s)
        return None

    out: dict[str, float] = {}
    uptime = num(hello.get("uptime_s"))
    if uptime is None:
        return {"total": round(total_s, 3)}
    out["vmm"] = total_s - uptime
    raw = hello.get("boot")
    marks = raw if isinstance(raw, dict) else {}
    steps = [num(marks.get(k)) for k in ("initramfs", "init", "agent")]
    if all(s is not None for s in steps):
        initramfs, init, agent = steps  # type: ignore[misc]
        out["kernel"] = initramfs
        out["initramfs"] = max(0.0, init - initramfs)
        out["init"] = max(0.0, agent - init)
        out["agent"] = max(0.0, uptime - agent)
    else:
        out["guest"] = uptime
    out["total"] = total_s
    return {k: round(v, 3) for k, v in out.items()}


def describe(phases: dict[str, float]) -> str:
    """One line for logs: ``3.10 s (vmm 0.45, kernel 1.07, ...)``."""
    parts = ", ".join(f"{k} {v:.2f}" for k, v in phases.items() if k != "total")
    return f"{phases.get('total', 0):.2f} s ({parts})"
