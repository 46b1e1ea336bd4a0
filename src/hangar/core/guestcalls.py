"""Guest calls: exec, files and tunnels through a running sandbox's agent.

``GuestCalls.using`` hands out the agent of a running sandbox for one
call: it wakes a sleeping sandbox first, waits while a lifecycle change
holds the sandbox's lock, and connects the agent on first use (a VM
adopted after a restart is reconnected then, the connection proven by a
``hello`` probe: ``Launcher.reconnect``). While the call runs the
sandbox is ``busy``: it is neither snapshotted nor put to sleep.

Exec publishes ``exec.started`` and ``exec.finished`` events with an
``exec_id``, the exit code and duration; never output or environment, and
the command text only when the caller opted in.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import Any

from hangar.core.context import Context
from hangar.core.launch import Launcher
from hangar.core.lifecycle import State
from hangar.core.sleep import Sleeper
from hangar.errors import Busy, Conflict, GuestError
from hangar.engines.agent_client import AgentClient, ExecEvent, ExecResult

log = logging.getLogger("hangar.sandboxes")

AGENT_CONNECT_S = 20.0
"""How long a guest call waits to reconnect a VM's agent (adopted after a restart, or
whose connection dropped), seconds."""
TOUCH_S = 1.0
"""A sandbox's ``last_active_at`` is written at most this often, seconds (it is read
for idle timeouts of minutes)."""
TRANSIENT_WAIT = (State.SNAPSHOTTING, State.WAKING, State.RESTORING, State.CREATING)


class GuestCalls:
    """Runs calls in sandboxes' guests."""

    def __init__(self, ctx: Context, launcher: Launcher, sleeper: Sleeper) -> None:
        self.ctx = ctx
        self.launcher = launcher
        self.sleeper = sleeper

    @asynccontextmanager
    async def using(self, sandbox_id: str) -> AsyncIterator[AgentClient]:
        """The agent of a running sandbox for one call; wakes a sleeping one first.

        Raises NotFound, Gone, Conflict (not running), Busy (it keeps
        changing state: retry).
        """
        ctx = self.ctx
        for attempt in range(3):
            # A sandbox this server holds a VM for is not asleep (a wake in progress holds
            # the lock taken below), so the common call reads its record once, not twice.
            if attempt or ctx.registry.get(sandbox_id) is None:
                rec = ctx.record(sandbox_id)
                if rec.state in (State.SLEEPING, State.WAKING):
                    await self.sleeper.wake(sandbox_id)
            async with ctx.registry.lock(sandbox_id):
                rec = ctx.record(sandbox_id)
                rt = ctx.registry.get(sandbox_id)
                if rec.state == State.SLEEPING:
                    continue  # it fell asleep between the wake and the lock
                if rec.state in TRANSIENT_WAIT:
                    raise Busy(f"sandbox {sandbox_id} is {rec.state.value}; retry shortly",
                               sandbox_id=sandbox_id, state=rec.state.value)
                if rec.state != State.RUNNING or rt is None:
                    raise Conflict(f"sandbox {sandbox_id} is {rec.state.value}, not running",
                                   sandbox_id=sandbox_id, state=rec.state.value)
                rt.busy += 1
            break
        else:
            raise Busy(f"sandbox {sandbox_id} keeps falling asleep; retry", sandbox_id=sandbox_id)
        try:
            async with rt.connect_lock:
                if rt.agent is None or rt.agent.closed:
                    if not rt.vm.alive():
                        raise Conflict(f"sandbox {sandbox_id} has stopped", sandbox_id=sandbox_id)
                    rt.agent = await self.launcher.reconnect(rt.vm, AGENT_CONNECT_S)
            yield rt.agent
        finally:
            rt.busy -= 1
            # Recorded once the caller's answer is on its way (the next turn of the loop),
            # at most once per TOUCH_S: a database write is the slowest step of a short
            # call on the host.
            now = time.time()
            if now - rt.touched_at >= TOUCH_S:
                rt.touched_at = now
                asyncio.get_running_loop().call_soon(self._touch, sandbox_id, now)

    def _touch(self, sandbox_id: str, when: float) -> None:
        try:
            self.ctx.store.update(sandbox_id, last_active_at=when)
        except Exception as exc:  # a late write must never break the loop
            log.warning("last activity not recorded", extra={"sandbox_id": sandbox_id,
                                                              "error": str(exc)})

    def _started(self, sandbox_id: str, command: str | None) -> tuple[str, float]:
        exec_id = "ex-" + secrets.token_hex(6)
        data: dict[str, Any] = {"exec_id": exec_id}
        if command is not None:
            data["command"] = command
        self.ctx.publish("exec.started", sandbox_id, **data)
        return exec_id, time.monotonic()

    def _finished(self, sandbox_id: str, exec_id: str, started: float,
                  result: ExecResult | None) -> float:
        took = time.monotonic() - started
        outcome = "ok" if result is not None else "error"
        if result is not None and result.timed_out:
            outcome = "timed_out"
        self.ctx.metrics.execs.labels("ok" if result is not None else "error").inc()
        self.ctx.metrics.exec_seconds.labels(outcome).observe(took)
        self.ctx.publish("exec.finished", sandbox_id, exec_id=exec_id,
                         exit_code=result.exit_code if result else None,
                         duration_s=round(took, 3),
                         timed_out=bool(result and result.timed_out),
                         **({} if result is not None else {"error": True}))
        return took

    async def exec(self, sandbox_id: str, meta: dict[str, Any], stdin: bytes | None = None,
                   command: str | None = None) -> ExecResult:
        """Run a command to completion (``meta`` from ``engines.agent_client.exec_meta``).

        ``command`` is the text events may show (only when the caller opted in).
        """
        result: ExecResult | None = None
        async with self.using(sandbox_id) as agent:
            exec_id, started = self._started(sandbox_id, command)
            try:
                result = await agent.exec(meta, stdin)
            finally:
                took = self._finished(sandbox_id, exec_id, started, result)
        log.info("exec", extra={"sandbox_id": sandbox_id, "duration_s": round(took, 3),
                                "exit_code": result.exit_code, "timed_out": result.timed_out})
        return result

    async def exec_stream(self, sandbox_id: str, meta: dict[str, Any],
                          stdin: bytes | None = None,
                          command: str | None = None) -> AsyncIterator[ExecEvent]:
        """Run a command, yielding output events then an ``exit`` event."""
        result: ExecResult | None = None
        async with self.using(sandbox_id) as agent:
            exec_id, started = self._started(sandbox_id, command)
            try:
                async for ev in agent.exec_stream({**meta, "stream": True}, stdin):
                    if ev.kind == "exit":
                        result = ev.result
                    yield ev
            finally:
                self._finished(sandbox_id, exec_id, started, result)

    async def read_file(self, sandbox_id: str, path: str) -> AsyncIterator[bytes]:
        async with self.using(sandbox_id) as agent:
            async for chunk in agent.read_file(path):
                yield chunk

    async def write_file(self, sandbox_id: str, path: str,
                         chunks: Iterable[bytes] | AsyncIterator[bytes],
                         mode: int = 0o644) -> dict[str, Any]:
        async with self.using(sandbox_id) as agent:
            return await agent.write_file(path, chunks, mode)

    async def file_op(self, sandbox_id: str, op: str, **meta: Any) -> dict[str, Any]:
        """``list_dir``, ``stat``, ``mkdir`` or ``remove`` in the guest."""
        if op not in ("list_dir", "stat", "mkdir", "remove"):
            raise GuestError(f"unknown file operation {op}")
        async with self.using(sandbox_id) as agent:
            return await agent.call(op, **meta)

    async def agent(self, sandbox_id: str) -> AgentClient:
        """The agent of a running sandbox (for long-lived uses such as tunnels)."""
        async with self.using(sandbox_id) as agent:
            return agent

