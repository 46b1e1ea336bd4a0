"""The cost guard: per-task limits on tool calls, wall time, VM-seconds and tokens.

A task checks its guard before every tool call and a watchdog checks the
clocks while the task idles. Going over any limit ends the task: its VM is
released and every later call returns the same failed ``ToolResult`` naming
the limit ("limit reached: ..."); the task's end reason is
``limit:<name>``. Tokens are what the caller reports (``Task.report_tokens``)
from its model's usage figures; Hangar never sees the model.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Limits:
    """What one task may spend. ``None`` means no limit on that figure."""

    max_tool_calls: int | None = 10
    """Tool calls (the agent loop's iterations)."""
    max_wall_s: float | None = 15 * 60.0
    """Seconds from the task's start: from the moment it begins acquiring its sandbox, so a
    VM's boot counts."""
    max_vm_s: float | None = None
    """VM-seconds: seconds the task's VM has existed (from its create request), times its
    vCPUs."""
    max_tokens: int | None = 100_000
    """Model tokens reported with ``report_tokens``."""

    @classmethod
    def of(cls, value: "Limits | dict[str, Any] | None") -> "Limits":
        """A ``Limits`` from itself, a dict of its fields, or None (the defaults).

        Raises ValueError for unknown fields or negative figures.
        """
        if value is None:
            return cls()
        if isinstance(value, Limits):
            return value
        unknown = set(value) - {f for f in cls.__dataclass_fields__}
        if unknown:
            raise ValueError(f"unknown limits: {', '.join(sorted(unknown))}")
        limits = cls(**value)
        for name, v in asdict(limits).items():
            if v is not None and v < 0:
                raise ValueError(f"limit {name} must be >= 0, not {v}")
        return limits


@dataclass
class Usage:
    """What a task has spent so far."""

    tool_calls: int = 0
    wall_s: float = 0.0
    vm_s: float = 0.0
    """Seconds the VM existed times its vCPUs (0 in-process)."""
    tokens: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"tool_calls": self.tool_calls, "wall_s": round(self.wall_s, 3),
                "vm_s": round(self.vm_s, 3), "tokens": self.tokens}


@dataclass
class CostGuard:
    """Tracks one task's usage against its limits. Times from ``time.monotonic``."""

    limits: Limits = field(default_factory=Limits)
    started: float = field(default_factory=time.monotonic)
    vm_since: float | None = None
    vcpus: int = 0
    tool_calls: int = 0
    tokens: int = 0
    vm_s_before: float = 0.0

    def vm_started(self, vcpus: int, since: float | None = None) -> None:
        """Count VM-seconds of a VM with ``vcpus`` from ``since`` (``time.monotonic``; the
        moment its create was asked for) or from now."""
        self.vm_since = time.monotonic() if since is None else since
        self.vcpus = vcpus

    def vm_stopped(self) -> None:
        if self.vm_since is not None:
            self.vm_s_before += (time.monotonic() - self.vm_since) * self.vcpus
            self.vm_since = None

    def usage(self) -> Usage:
        now = time.monotonic()
        vm_s = self.vm_s_before
        if self.vm_since is not None:
            vm_s += (now - self.vm_since) * self.vcpus
        return Usage(self.tool_calls, now - self.started, vm_s, self.tokens)

    def over(self, next_call: bool = False) -> tuple[str, str] | None:
        """(limit name, message) of the first limit reached, or None.

        With ``next_call`` the tool-call limit counts the call about to start.
        """
        lim, u = self.limits, self.usage()
        if lim.max_tool_calls is not None and (
                self.tool_calls + (1 if next_call else 0)) > lim.max_tool_calls:
            return "tool_calls", (f"{self.tool_calls} tool calls used, the most allowed "
                                  f"(max_tool_calls={lim.max_tool_calls})")
        if lim.max_tokens is not None and u.tokens > lim.max_tokens:
            return "tokens", f"{u.tokens} tokens reported (max_tokens={lim.max_tokens})"
        if lim.max_wall_s is not None and u.wall_s >= lim.max_wall_s:
            return "wall_time", f"{u.wall_s:.0f} s of wall time (max_wall_s={lim.max_wall_s:g})"
        if lim.max_vm_s is not None and u.vm_s >= lim.max_vm_s:
            return "vm_seconds", f"{u.vm_s:.0f} VM-seconds (max_vm_s={lim.max_vm_s:g})"
        return None

    def seconds_left(self) -> float | None:
        """Seconds until a clock limit (wall time or VM-seconds) is reached; None: no clock."""
        lim, u = self.limits, self.usage()
        left: list[float] = []
        if lim.max_wall_s is not None:
            left.append(lim.max_wall_s - u.wall_s)
        if lim.max_vm_s is not None and self.vm_since is not None and self.vcpus:
            left.append((lim.max_vm_s - u.vm_s) / self.vcpus)
        return max(0.0, min(left)) if left else None
