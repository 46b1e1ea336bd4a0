"""Tasks: one sub-agent's tools at one tier, with a cost guard; the proxy an agent loop calls.

::

    async with hangar.tools.task(tier="vm", user_id="u-42", name="Test Runner") as t:
        r = await t.call("run_command", {"command": "yarn test"})
        t.report_tokens(1234)

    with hangar.tools.sync_task(tier="in-process", user_id="u-42", name="Scratch") as t:
        print(t.call("run_command", {"command": "echo hi"}).output)

Entering a task acquires its sandbox: a bubblewrap folder pair for
``in-process``; for ``vm`` and ``browser`` a new sandbox on the Hangar server
(``POST /sandboxes``: a warm-pool VM when one fits, else a cold boot; the
task's ``source`` says which). Leaving deletes it, whatever the way out:
normal exit, an exception, cancellation, or a cost-guard stop. Each task
gets its own VM, created for it and deleted after it, so no task ever sees
another's files or processes. As a safety net against a caller that dies
without leaving, the VM is created with a time to live of the task's wall
limit plus two minutes, so the server removes it by itself.

``call`` never raises for a tool's failure: bad arguments, unknown tools, a
command that fails, a server error, a stopped task all come back as a failed
``ToolResult``. It raises only ``asyncio.CancelledError`` when the caller is
cancelled. Calls on one task run one at a time.

Security: a task's VM receives nothing of the caller's environment; the API
key stays in the caller's process (in headers to the server) and never
reaches a guest.
"""

from __future__ import annotations

import asyncio
import logging
import secrets as random_tokens
import threading
import time
from collections.abc import Awaitable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from hangar.errors import HangarError
from hangar.tools.backend import Backend, SandboxInfo
from hangar.tools.definitions import TIER_TOOLS, Tier, check_tier, validate
from hangar.tools.events import EventSink, ServerSink, ToolEvent
from hangar.tools.format import summarize
from hangar.tools.inprocess import InProcessTools, ProcessLimits
from hangar.tools.limits import CostGuard, Limits, Usage
from hangar.tools.results import ToolResult
from hangar.tools.toolset import ToolSet, tier_classes

log = logging.getLogger("hangar.tools")

T = TypeVar("T")

IMAGES: dict[str, str] = {"vm": "dev", "browser": "desktop"}
"""Image each VM tier uses unless the task names one."""
DEFAULT_SCREEN = "1024x768x24"
"""The browser tier's display (pixels, bits)."""
TTL_MARGIN_S = 120.0
"""Seconds added to the wall limit for the VM's time to live (the safety net)."""


@dataclass(frozen=True)
class TaskResult:
    """How a task ended. ``reason``: ``done``, ``error``, ``cancelled`` or ``limit:<name>``
    (``tool_calls``, ``tokens``, ``wall_time``, ``vm_seconds``)."""

    task_id: str
    name: str
    tier: str
    user_id: str
    reason: str
    usage: Usage
    sandbox_id: str | None
    source: str
    """``pool``, ``cold`` or ``none`` (in-process)."""
    vcpus: int
    memory_mib: int
    message: str | None = None
    """Why a limit stopped it, or the error's text."""


class Task:
    """One sub-agent's tools. Use ``async with`` (or ``start``/``end``).

    ``tier``: ``in-process``, ``vm`` or ``browser``. ``user_id`` and ``name``
    label the task (sandbox metadata and events). ``limits``: ``Limits`` or a
    dict of its fields. ``url``/``api_key`` find the server (default: as the
    SDK: ``HANGAR_URL``, ``HANGAR_API_KEY``, the key file); or pass a
    ``backend`` to share one. ``sink`` receives the events (default: the
    server's ``POST /events``). ``image``, ``vcpus``, ``memory_mib``,
    ``network`` and ``desktop`` override the VM's shape (default: the tier's
    image and that image's size: dev and desktop both have 2 vCPU/2048 MiB;
    the server's default egress policy, ``internet`` with TAP networking; ``network``
    may name domains: ``{"allow": ["*.github.com"], "deny": ["0.0.0.0/0"]}``).
    ``volumes`` (guest path -> volume) and ``secrets`` (env var -> secret name: the
    guest sees a placeholder) are the VM's too (docs/volumes.md, docs/security.md).
    ``process_limits`` and ``env`` apply to ``in-process``.

    Raises ValueError for an unknown tier or bad limits (at construction),
    and ``hangar.errors`` classes when the sandbox cannot be had (at start).
    """

    def __init__(self, tier: str, user_id: str, name: str,
                 limits: Limits | dict[str, Any] | None = None, *,
                 url: str | None = None, api_key: str | None = None,
                 backend: Backend | None = None, sink: EventSink | None = None,
                 image: str | None = None, vcpus: int | None = None,
                 memory_mib: int | None = None, network: Any = None,
                 desktop: str | None = None, process_limits: ProcessLimits | None = None,
                 env: dict[str, str] | None = None, volumes: dict[str, Any] | None = None,
                 secrets: dict[str, str] | None = None) -> None:
        self.tier: Tier = check_tier(tier)
        self.user_id = str(user_id)
        self.name = str(name)
        self.limits = Limits.of(limits)
        self.task_id = "task-" + random_tokens.token_hex(6)
        self._own_backend = False
        self._backend = backend
        self._url, self._api_key = url, api_key
        self._sink = sink
        self._shape = {"image": image, "vcpus": vcpus, "memory_mib": memory_mib,
                       "network": network, "desktop": desktop, "volumes": volumes,
                       "secrets": secrets}
        self._process_limits = process_limits
        self._env = env
        self.guard = CostGuard(self.limits)
        self.sandbox: SandboxInfo | None = None
        self._tools: ToolSet | None = None
        self._lock = asyncio.Lock()
        self._inflight: asyncio.Task[ToolResult] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._stop_result: ToolResult | None = None
        self._stopping: asyncio.Task[None] | None = None
        self._ending: asyncio.Task[TaskResult] | None = None
        self.result: TaskResult | None = None
        """Set once the task has ended."""

    # -- properties ---------------------------------------------------------------------------

    @property
    def sandbox_id(self) -> str | None:
        return self.sandbox.id if self.sandbox else None

    @property
    def source(self) -> str:
        """``pool``, ``cold`` or ``none`` (in-process)."""
        return self.sandbox.source if self.sandbox else "none"

    @property
    def tools(self) -> tuple[str, ...]:
        """Names of the tools this task offers."""
        return TIER_TOOLS[self.tier]

    @property
    def ended(self) -> bool:
        return self.result is not None or self._stop_result is not None

    def usage(self) -> Usage:
        return self.guard.usage()

    # -- events -------------------------------------------------------------------------------

    def _emit(self, kind: str, **data: Any) -> None:
        if self._sink is not None:
            self._sink.emit(ToolEvent(kind, self.sandbox_id, {"task_id": self.task_id, **data}))

    # -- lifecycle ----------------------------------------------------------------------------

    async def __aenter__(self) -> "Task":
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: Any) -> None:
        if exc_type is None:
            reason, message = "done", None
        elif issubclass(exc_type, asyncio.CancelledError):
            reason, message = "cancelled", None
        else:
            reason, message = "error", f"{exc_type.__name__}: {exc}"[:500]
        await _finish(self.end(reason, message))

    async def start(self) -> "Task":
        """Start the clocks, then acquire the sandbox.

        The wall clock starts before the sandbox is asked for, and a VM's
        VM-seconds count from its create request: boot (and the browser
        tier's Chromium start) is spent by the task like any tool call. When
        acquiring alone used up a clock limit, the task ends at once with that
        limit (its VM released) and every call returns it.
        """
        self.guard.started = time.monotonic()
        wants_server = self.tier != "in-process" or self._url or self._api_key
        if wants_server and self._backend is None:
            self._backend = Backend(self._url, self._api_key)
            self._own_backend = True
        if self._sink is None:
            from hangar.tools.events import NullSink

            self._sink = ServerSink(self._backend) if self._backend is not None else NullSink()
        try:
            if self.tier == "in-process":
                self._tools = InProcessTools(self._process_limits, self._env)
            else:
                # Said before the VM is asked for: acquiring it (a restore, or a
                # cold boot under emulation) can take long, and a person watching
                # sees the task from its first moment.
                self._emit("agent.task.starting", name=self.name, tier=self.tier)
                self._tools = await self._acquire_vm()
        except BaseException:
            if self._own_backend and self._backend is not None:
                await self._backend.close()
            raise
        vcpus = self.sandbox.vcpus if self.sandbox else 0
        self._emit("agent.task.started", name=self.name, tier=self.tier, vcpus=vcpus,
                   memory_mib=self.sandbox.memory_mib if self.sandbox else 0, source=self.source)
        self._watchdog = asyncio.get_running_loop().create_task(self._watch())
        return self

    async def _acquire_vm(self) -> ToolSet:
        assert self._backend is not None
        s = self._shape
        ttl = self.limits.max_wall_s + TTL_MARGIN_S if self.limits.max_wall_s else None
        desktop = s["desktop"] or (DEFAULT_SCREEN if self.tier == "browser" else None)
        asked = time.monotonic()
        # Shielded: a create cancelled half-way would leave a VM nobody knows of.
        self.sandbox = await _finish(self._backend.create(
            s["image"] or IMAGES[self.tier], vcpus=s["vcpus"], memory_mib=s["memory_mib"],
            timeout_s=ttl, desktop=desktop, network=s["network"], volumes=s["volumes"],
            secrets=s["secrets"],
            metadata={"hangar.task": self.task_id, "hangar.user": self.user_id[:200],
                      "hangar.tier": self.tier}))
        self.guard.vm_started(self.sandbox.vcpus, since=asked)
        tools = tier_classes()[self.tier](self._backend, self.sandbox)  # type: ignore[call-arg]
        try:
            await _finish(tools.prepare())
        except BaseException:
            await _finish(self._delete_vm(tools))
            raise
        return tools

    async def _delete_vm(self, tools: ToolSet | None) -> None:
        if tools is not None:
            try:
                await tools.close()
            except Exception:
                log.exception("closing the task's tools failed")
        if self.sandbox is not None and self._backend is not None:
            for attempt in range(3):
                try:
                    await self._backend.delete(self.sandbox.id)
                    break
                except HangarError as exc:
                    log.warning("sandbox delete failed", extra={
                        "sandbox_id": self.sandbox.id, "error": exc.message, "attempt": attempt})
                    if not exc.retryable:
                        break
                    await asyncio.sleep(1 + attempt)
        self.guard.vm_stopped()

    async def end(self, reason: str = "done", message: str | None = None) -> TaskResult:
        """Release the sandbox and record how the task ended. Idempotent: a second call
        (even a concurrent one) returns the first result."""
        if self._ending is None:
            self._ending = asyncio.get_running_loop().create_task(self._end(reason, message))
        return await asyncio.shield(self._ending)

    async def _end(self, reason: str, message: str | None) -> TaskResult:
        if self._stop_result is not None:  # a limit stopped it: that is the reason
            reason = str(self._stop_result.data.get("reason", reason))
            message = self._stop_result.error
        if self._watchdog is not None:
            self._watchdog.cancel()
        tools, self._tools = self._tools, None
        await self._delete_vm(tools)
        self.result = TaskResult(
            task_id=self.task_id, name=self.name, tier=self.tier, user_id=self.user_id,
            reason=reason, usage=self.guard.usage(), sandbox_id=self.sandbox_id,
            source=self.source, vcpus=self.sandbox.vcpus if self.sandbox else 0,
            memory_mib=self.sandbox.memory_mib if self.sandbox else 0, message=message)
        self._emit("agent.task.ended", reason=reason, usage=self.result.usage.as_dict())
        if self._sink is not None:
            await self._sink.aclose()
        if self._own_backend and self._backend is not None:
            await self._backend.close()
        log.info("task ended", extra={"task_id": self.task_id, "reason": reason,
                                      "sandbox_id": self.sandbox_id})
        return self.result

    # -- the cost guard -----------------------------------------------------------------------

    def _limit_result(self, name: str, what: str) -> ToolResult:
        where = "its VM was deleted" if self.tier != "in-process" else "its folders were removed"
        return ToolResult.failure(f"limit reached: {what}; the task has ended and {where}",
                                  limit=name, reason=f"limit:{name}")

    def _stop(self, name: str, what: str) -> Awaitable[None]:
        """End the task for a limit (once): cancel the call in flight, release the VM."""
        if self._stop_result is None:
            self._stop_result = self._limit_result(name, what)
            if self._inflight is not None:
                self._inflight.cancel()
            self._stopping = asyncio.get_running_loop().create_task(
                self._ended_by_limit(name, what))
        assert self._stopping is not None
        return asyncio.shield(self._stopping)

    async def _ended_by_limit(self, name: str, what: str) -> None:
        async with self._lock:  # after the cancelled call has returned its result
            await self.end(f"limit:{name}", f"limit reached: {what}")

    async def _watch(self) -> None:
        while True:
            left = self.guard.seconds_left()
            if left is None:
                return
            await asyncio.sleep(left + 0.05)
            over = self.guard.over()
            if over and over[0] in ("wall_time", "vm_seconds"):
                await self._stop(*over)
                return

    def report_tokens(self, n: int) -> None:
        """Add ``n`` model tokens to the task's usage. Over ``max_tokens``, the task ends:
        its sandbox is released in the background and later calls return the limit."""
        if n < 0:
            raise ValueError("tokens must be >= 0")
        self.guard.tokens += int(n)
        over = self.guard.over()
        if over and over[0] == "tokens" and not self.ended:
            self._stop(*over)

    # -- the proxy ----------------------------------------------------------------------------

    async def call(self, name: str, arguments: dict[str, Any] | None = None) -> ToolResult:
        """Run tool ``name`` with ``arguments`` in this task's tier; see the module doc."""
        args = arguments if arguments is not None else {}
        if self._stop_result is not None:
            return self._stop_result
        if self.result is not None or self._tools is None:
            return ToolResult.failure("the task has ended" if self.result else
                                      "the task has not started")
        if name not in self.tools:
            why = validate(name, args) if name not in TIER_TOOLS["browser"] else None
            return ToolResult.failure(why or f"the {self.tier} tier has no tool {name!r}; it "
                                             f"offers {', '.join(self.tools)}")
        over = self.guard.over(next_call=True)
        if over is not None:
            await self._stop(*over)
            assert self._stop_result is not None
            return self._stop_result
        self.guard.tool_calls += 1
        problem = validate(name, args)
        if problem is not None:
            return ToolResult.failure(f"invalid arguments for {name}: {problem}")
        async with self._lock:
            if self._stop_result is not None:
                return self._stop_result
            self._emit("agent.tool.started", tool=name, summary=summarize(name, args))
            started = time.monotonic()
            left = self.guard.seconds_left()  # a command may not outlast the task's clock;
            # one second of grace lets the watchdog, not the command's timeout, end it
            inner = asyncio.get_running_loop().create_task(
                self._run(name, args, None if left is None else left + 1.0))
            self._inflight = inner
            try:
                result = await asyncio.shield(inner)
            except asyncio.CancelledError:
                if self._stop_result is not None and not _cancelling():
                    result = self._stop_result  # the watchdog cut it short
                else:
                    inner.cancel()
                    while not inner.done():  # let the tool clean up (kill, reap) first
                        try:
                            await asyncio.wait({inner})
                        except asyncio.CancelledError:
                            pass
                    self._emit("agent.tool.finished", tool=name, ok=False,
                               duration_s=round(time.monotonic() - started, 3))
                    raise
            finally:
                self._inflight = None
            took = time.monotonic() - started
            if result.duration_s == 0.0 and result is not self._stop_result:
                result = _with_duration(result, took)
            self._emit("agent.tool.finished", tool=name, ok=result.ok,
                       duration_s=round(took, 3))
            return result

    async def _run(self, name: str, args: dict[str, Any], left: float | None) -> ToolResult:
        assert self._tools is not None
        started = time.monotonic()
        try:
            return await self._tools.call(name, args, left)
        except asyncio.CancelledError:
            if self._stop_result is not None:
                return self._stop_result
            raise
        except HangarError as exc:
            return ToolResult.failure(exc.message, time.monotonic() - started,
                                      code=exc.code)
        except Exception as exc:  # a tool's bug is a result, not a crash of the loop
            log.exception("tool failed", extra={"task_id": self.task_id, "tool": name})
            return ToolResult.failure(f"internal error in {name}: {type(exc).__name__}: {exc}",
                                      time.monotonic() - started)


def _with_duration(r: ToolResult, took: float) -> ToolResult:
    return ToolResult(ok=r.ok, output=r.output, error=r.error, truncated=r.truncated,
                      duration_s=round(took, 3), image=r.image, data=r.data)


def _cancelling() -> bool:
    """True when the current task itself is being cancelled (not just an inner one)."""
    t = asyncio.current_task()
    return bool(t is not None and t.cancelling())


async def _finish(aw: Awaitable[T]) -> T:
    """Await ``aw`` to the end even if the caller is cancelled meanwhile (clean-up must
    finish); the cancellation is re-raised afterwards."""
    fut = asyncio.ensure_future(aw)
    cancelled = False
    while not fut.done():
        try:
            await asyncio.wait({fut})  # never cancels fut
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return fut.result()


def task(tier: str, user_id: str, name: str,
         limits: Limits | dict[str, Any] | None = None, **options: Any) -> Task:
    """A ``Task`` for ``async with``; see ``Task`` for the options."""
    return Task(tier, user_id, name, limits, **options)


# ---------------------------------------------------------------------------------------------
# the sync twin


class SyncTask:
    """``Task`` for code without an event loop: the same methods, blocking.

    Runs a private event loop in a background thread for the task's lifetime.
    """

    def __init__(self, tier: str, user_id: str, name: str,
                 limits: Limits | dict[str, Any] | None = None, **options: Any) -> None:
        self._task = Task(tier, user_id, name, limits, **options)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name=f"hangar-{self._task.task_id}")

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def __enter__(self) -> "SyncTask":
        self._thread.start()
        try:
            self._run(self._task.start())
        except BaseException:
            self._close_loop()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: Any) -> None:
        try:
            if exc_type is None:
                self._run(self._task.end("done"))
            elif issubclass(exc_type, KeyboardInterrupt):
                self._run(self._task.end("cancelled"))
            else:
                self._run(self._task.end("error", f"{exc_type.__name__}: {exc}"[:500]))
        finally:
            self._close_loop()

    def _close_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        if not self._loop.is_running():
            self._loop.close()

    def call(self, name: str, arguments: dict[str, Any] | None = None) -> ToolResult:
        return self._run(self._task.call(name, arguments))

    def report_tokens(self, n: int) -> None:
        self._loop.call_soon_threadsafe(self._task.report_tokens, n)

    def end(self, reason: str = "done") -> TaskResult:
        return self._run(self._task.end(reason))

    def __getattr__(self, attr: str) -> Any:  # task_id, sandbox_id, source, result, usage...
        return getattr(self._task, attr)


def sync_task(tier: str, user_id: str, name: str,
              limits: Limits | dict[str, Any] | None = None, **options: Any) -> SyncTask:
    """A ``SyncTask`` for ``with``; see ``Task`` for the options."""
    return SyncTask(tier, user_id, name, limits, **options)

