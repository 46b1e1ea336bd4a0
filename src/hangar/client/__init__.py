"""Python SDK for Hangar's REST API, blocking and asyncio from one source.

The object surface::

    from hangar.client import Sandbox, Machine

    with Sandbox.create() as sb:                 # killed when the block ends
        r = sb.exec("python3 -c 'print(6*7)'")
        print(r.stdout, r.exit_code)             # "42\\n" 0
        sb.files.write("/root/data.txt", "hello")
        snap = sb.snapshot()

    m = Machine.get_or_create("alice")            # sleeps when idle, wakes on demand
    m.exec("ls /root")

The flat client has one method per REST route (``Hangar``, and
``AsyncHangar`` with the same methods, awaited). Results are the typed
models of ``hangar.schemas``; failures raise the classes of
``hangar.errors``. Safe calls are retried (``RetryPolicy``), every call
has a timeout (``Timeouts``, or ``request_timeout=``), ``HealthMonitor``
watches ``/health`` and ``Hangar.events()`` follows what the server does,
live.

Names starting with ``Async`` are the asyncio twins; ``_sync/`` is
generated from ``_async/`` (``scripts/gen_sync.py``).
"""

from hangar.client._async.client import AsyncHangar
from hangar.client._async.monitor import AsyncHealthMonitor
from hangar.client._async.objects import AsyncDesktop, AsyncFiles, AsyncMachine, AsyncSandbox
from hangar.client._async.processes import AsyncProcesses
from hangar.client._async.streams import AsyncFileWatch, AsyncTerminal
from hangar.client._core import RetryPolicy, Timeouts
from hangar.client._sync.client import Hangar
from hangar.client._sync.monitor import HealthMonitor
from hangar.client._sync.objects import Desktop, Files, Machine, Sandbox
from hangar.client._sync.processes import Processes
from hangar.client._sync.streams import FileWatch, Terminal
from hangar.client.execution import (
    CodeContext, Execution, ExecutionError, Logs, OutputMessage, Result,
)
from hangar.dockerfile import BuildLog, DockerfileError, TemplateBuild
from hangar.schemas import (
    ActionResult, DisplayInfo, Event, ExecResult, ExecStreamEvent, FileEntry, FileEvent, Health,
    KeyResult, MachineInfo, NetworkRules, PoolStatus, PortInfo, ProcessEvent, ProcessInfo, PtySession,
    PtyTicket, SandboxInfo, Snapshot, VncTicket, WriteResult,
)
from hangar.schemas import TeamInfo, TeamUsage

__all__ = [
    "Hangar", "AsyncHangar", "Sandbox", "AsyncSandbox", "Machine", "AsyncMachine", "Files",
    "AsyncFiles", "Desktop", "AsyncDesktop", "HealthMonitor", "AsyncHealthMonitor",
    "Terminal", "AsyncTerminal", "FileWatch", "AsyncFileWatch", "Processes", "AsyncProcesses",
    "RetryPolicy", "Timeouts",
    "CodeContext", "Execution", "ExecutionError", "Logs", "OutputMessage", "Result",
    "ActionResult", "DisplayInfo", "Event", "ExecResult", "ExecStreamEvent", "FileEntry",
    "FileEvent", "Health", "KeyResult", "MachineInfo", "NetworkRules", "PoolStatus", "PortInfo",
    "ProcessEvent", "ProcessInfo", "PtySession",
    "PtyTicket", "SandboxInfo", "Snapshot", "VncTicket", "WriteResult",
    "BuildLog", "DockerfileError", "TemplateBuild",
    "TeamInfo", "TeamUsage",
]
