"""Agent tools by tier: one proxy that runs a sub-agent's tools on this host in bubblewrap,
in a microVM, or in a microVM with a real browser; with a cost guard and visible events.

::

    import hangar.tools as ht

    tools = ht.anthropic_tools("vm")            # or ht.openai_tools("vm"): JSON Schemas
    async with ht.task(tier="vm", user_id="u-42", name="Test Runner",
                       limits={"max_tool_calls": 20}) as t:
        result = await t.call("run_command", {"command": "yarn test"})
        print(result.ok, result.output, result.error)
        t.report_tokens(usage.input_tokens + usage.output_tokens)
    print(t.result.reason, t.result.usage)     # done, {tool_calls: 1, ...}

Modules: ``definitions`` (tools, schemas, ``TIER_TOOLS``), ``results``
(``ToolResult``), ``task`` (``Task``, ``task``, ``SyncTask``, ``sync_task``),
``limits`` (``Limits``: the cost guard), ``events`` (sinks), ``toolset``
(``ToolSet``: each tier's one table of handlers), ``inprocess``
(bubblewrap), ``vm``, ``browser`` (Playwright over CDP), ``tunnel`` (a local
port to a guest port), ``backend`` (the one adapter over the SDK),
``mcp_server`` (``hangar mcp``).
"""

from hangar.tools.definitions import (
    TIER_TOOLS,
    TIERS,
    TOOLS,
    WORK_DIR,
    Tier,
    ToolSpec,
    anthropic_tools,
    openai_tools,
    tools_for,
    validate,
)
from hangar.tools.events import CallbackSink, EventSink, ListSink, NullSink, ServerSink, ToolEvent
from hangar.tools.inprocess import ProcessLimits
from hangar.tools.limits import Limits, Usage
from hangar.tools.results import ToolResult
from hangar.tools.task import SyncTask, Task, TaskResult, sync_task, task

__all__ = [
    "TIERS", "TIER_TOOLS", "TOOLS", "WORK_DIR", "Tier", "ToolSpec", "anthropic_tools",
    "openai_tools", "tools_for", "validate",
    "ToolResult", "Limits", "Usage", "ProcessLimits",
    "Task", "TaskResult", "task", "SyncTask", "sync_task",
    "EventSink", "ToolEvent", "ServerSink", "ListSink", "CallbackSink", "NullSink",
]
