"""Live events as a person reads them: ``hangar events``.

``EventView`` turns each event into one line, the way an agent platform's
chat shows its work::

    12:00:01  sb-3f9c0a1b2c4d  created (base, cold, 4.2 s)
    12:00:02  sb-3f9c0a1b2c4d  exec 'yarn test' started
    12:00:14  sb-3f9c0a1b2c4d  exec 'yarn test' finished: exit 0 in 12.03 s
    12:00:02  Test Runner (vm)  started, VM sb-a3f2…, 2 vCPU, 2 GB
    12:00:03  Test Runner (vm)  running: yarn test

and keeps what is under way (agent tasks with their running tool, execs)
as blocks that a terminal redraws every second::

    Test Runner (vm) running: yarn test (12 s elapsed), VM sb-a3f2…, 2 vCPU, 2 GB

The agent-task events are those the tools tier publishes (``agent.task.started``
{task_id, name, tier, vcpus, memory_mib, source},
``agent.tool.started`` {task_id, tool, summary}, ``agent.tool.finished``
{task_id, tool, duration_s, ok}, ``agent.task.ended`` {task_id, reason, usage}).
Uses only the public SDK (``hangar.client``) and its models.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from hangar.client import Event


def short(sandbox_id: str | None) -> str:
    """``sb-a3f2…`` for a sandbox id (blocks are narrow); '-' for none."""
    if not sandbox_id:
        return "-"
    return sandbox_id[:7] + "…" if len(sandbox_id) > 8 else sandbox_id


def memory(mib: Any) -> str:
    """MiB as a person says it: 2048 -> '2 GB', 512 -> '512 MB'."""
    try:
        n = float(mib)
    except (TypeError, ValueError):
        return "?"
    return f"{n / 1024:g} GB" if n >= 1024 else f"{n:g} MB"


def seconds(value: Any) -> str:
    try:
        return f"{float(value):.2f} s"
    except (TypeError, ValueError):
        return "? s"


@dataclass
class Task:
    """An agent task under way."""

    name: str
    tier: str
    sandbox_id: str | None
    vcpus: Any = None
    memory_mib: Any = None
    tool: str | None = None
    summary: str | None = None
    tool_started: float = 0.0
    started: float = field(default_factory=time.time)

    @property
    def badge(self) -> str:
        return f"{self.name} ({self.tier})"

    def where(self) -> str:
        parts = [f"VM {short(self.sandbox_id)}"]
        if self.vcpus is not None:
            parts.append(f"{self.vcpus} vCPU")
        if self.memory_mib is not None:
            parts.append(memory(self.memory_mib))
        return ", ".join(parts)


@dataclass
class RunningExec:
    sandbox_id: str | None
    command: str | None
    started: float


class EventView:
    """State of what is under way, fed one event at a time. Safe to read from another thread."""

    def __init__(self) -> None:
        self.tasks: dict[str, Task] = {}
        self.execs: dict[str, RunningExec] = {}
        self._lock = threading.Lock()

    def line(self, ev: Event) -> str:
        """The event as one line (time, who, what), after updating what is under way."""
        with self._lock:
            who, what = self._describe(ev)
        stamp = time.strftime("%H:%M:%S", time.localtime(ev.time))
        return f"{stamp}  {who}  {what}"

    def blocks(self, now: float | None = None) -> list[str]:
        """One line per agent task and per exec under way, with elapsed seconds."""
        now = time.time() if now is None else now
        out = []
        with self._lock:
            for t in self.tasks.values():
                if t.tool:
                    doing = (f"running: {t.summary or t.tool} "
                             f"({now - t.tool_started:.0f} s elapsed)")
                else:
                    doing = f"thinking ({now - t.started:.0f} s elapsed)"
                out.append(f"{t.badge} {doing}, {t.where()}")
            for x in self.execs.values():
                cmd = f"exec '{x.command}'" if x.command else "exec"
                out.append(f"{x.sandbox_id} {cmd} running {now - x.started:.0f} s")
        return out

    def _describe(self, ev: Event) -> tuple[str, str]:
        d = ev.data
        sid = ev.sandbox_id or "-"
        k = ev.kind
        if k == "sandbox.created":
            return sid, f"created ({d.get('image', '?')}, {d.get('source', '?')}, " \
                        f"{float(d.get('duration_s') or 0):.1f} s)"
        if k in ("sandbox.deleted", "sandbox.expired"):
            return sid, k.split(".", 1)[1]
        if k == "sandbox.crashed":
            return sid, f"crashed: {d.get('error', 'the VMM died')}"
        if k == "exec.started":
            self.execs[str(d.get("exec_id"))] = RunningExec(ev.sandbox_id, d.get("command"),
                                                            ev.time)
            return sid, f"{self._exec_name(d.get('command'))} started"
        if k == "exec.finished":
            started = self.execs.pop(str(d.get("exec_id")), None)
            cmd = d.get("command") or (started.command if started else None)
            if d.get("exit_code") is None and d.get("error"):
                return sid, f"{self._exec_name(cmd)} failed: {d['error']}"
            extra = ", timed out" if d.get("timed_out") else ""
            return sid, (f"{self._exec_name(cmd)} finished: exit {d.get('exit_code')} in "
                         f"{seconds(d.get('duration_s'))}{extra}")
        if k.startswith("machine."):
            return f"{d.get('user_id', '?')} ({sid})", k.split(".", 1)[1]
        if k == "pool.take":
            return sid, "taken from the warm pool"
        if k == "pool.refill":
            return sid, "warm pool refilled"
        if k == "snapshot.created":
            size = d.get("size_bytes")
            mib = f", {float(size) / 2**20:.1f} MiB" if size is not None else ""
            return sid, f"snapshot {d.get('snapshot_id', '?')} made{mib}"
        if k == "snapshot.restored":
            return sid, f"restored to {d.get('snapshot_id', '?')}"
        if k == "snapshot.forked":
            return sid, f"forked from {d.get('snapshot_id', '?')}"
        if k == "pty.opened":
            return sid, f"terminal {d.get('session', '?')} opened ({d.get('program', 'shell')})"
        if k == "pty.closed":
            return sid, f"terminal {d.get('session', '?')} closed: exit {d.get('exit_code')}"
        if k == "port.exposed":
            return sid, f"port {d.get('port', '?')} exposed" + (
                " (public)" if d.get("public") else "")
        if k == "port.closed":
            return sid, f"port {d.get('port', '?')} closed"
        if k.startswith("agent."):
            return self._agent(ev)
        return sid, f"{k} {json.dumps(d, separators=(',', ':'))[:200]}"

    @staticmethod
    def _exec_name(command: Any) -> str:
        return f"exec '{command}'" if command else "exec"

    def _agent(self, ev: Event) -> tuple[str, str]:
        d = ev.data
        tid = str(d.get("task_id", ""))
        task = self.tasks.get(tid)
        if ev.kind == "agent.task.started":
            task = Task(str(d.get("name") or "task"), str(d.get("tier") or "?"),
                        d.get("sandbox_id") or ev.sandbox_id, d.get("vcpus"),
                        d.get("memory_mib"), started=ev.time)
            self.tasks[tid] = task
            source = f" ({d['source']})" if d.get("source") else ""
            return task.badge, f"started{source}, {task.where()}"
        badge = task.badge if task else f"task {tid or '?'}"
        if ev.kind == "agent.task.starting":
            name = str(d.get("name") or "task")
            return f"{name} ({d.get('tier') or '?'})", "starting: asking for its VM"
        if ev.kind == "agent.tool.started":
            if task:
                task.tool, task.summary, task.tool_started = (str(d.get("tool") or "tool"),
                                                              d.get("summary"), ev.time)
            return badge, f"running: {d.get('summary') or d.get('tool', '?')}"
        if ev.kind == "agent.tool.finished":
            if task:
                task.tool = task.summary = None
            verdict = "done" if d.get("ok", True) else "failed"
            return badge, f"{d.get('tool', '?')} {verdict} in {seconds(d.get('duration_s'))}"
        if ev.kind == "agent.task.ended":
            self.tasks.pop(tid, None)
            usage = d.get("usage")
            tail = f" ({json.dumps(usage, separators=(',', ':'))[:120]})" if usage else ""
            return badge, f"ended: {d.get('reason', '?')}{tail}"
        return badge, f"{ev.kind} {json.dumps(d, separators=(',', ':'))[:200]}"
