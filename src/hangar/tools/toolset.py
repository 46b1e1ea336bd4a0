"""One table of tool handlers per tier: the base class every tier's tools share.

A tier's class (``InProcessTools``, ``VmTools``, ``BrowserTools``) lists its
tools once, in ``HANDLERS``: tool name → handler. A handler is a coroutine
function ``handler(tools, args, time_left) -> ToolResult`` (``args`` already
checked against the tool's schema; ``time_left`` seconds the task's clock
allows, or None). ``ToolSet.call`` looks the name up there and nowhere
else, so the table is the tier: ``tests/test_tools.py`` checks that each
tier's table names exactly ``definitions.TIER_TOOLS[tier]``, and
``tier_classes`` says which class serves which tier.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, ClassVar

from hangar.tools.results import ToolResult

Handler = Callable[[Any, dict[str, Any], "float | None"], Awaitable[ToolResult]]
"""``handler(tools, args, time_left) -> ToolResult``."""


class ToolSet:
    """A tier's tools: ``HANDLERS`` (its one table), ``call`` and the lifecycle hooks."""

    tier: ClassVar[str]
    HANDLERS: ClassVar[Mapping[str, Handler]]

    async def prepare(self) -> None:
        """Get the tools ready (folders, a browser); nothing by default."""

    async def close(self) -> None:
        """Release what ``prepare`` made; nothing by default."""

    async def call(self, name: str, args: dict[str, Any], time_left: float | None) -> ToolResult:
        """Run tool ``name``; a name missing from ``HANDLERS`` is a failed result."""
        handler = self.HANDLERS.get(name)
        if handler is None:
            return ToolResult.failure(f"the {self.tier} tier has no tool {name!r}")
        return await handler(self, args, time_left)


def tier_classes() -> dict[str, type[ToolSet]]:
    """Tier name → the ``ToolSet`` class that serves it (imported on demand)."""
    from hangar.tools.browser import BrowserTools
    from hangar.tools.inprocess import InProcessTools
    from hangar.tools.vm import VmTools

    return {"in-process": InProcessTools, "vm": VmTools, "browser": BrowserTools}
