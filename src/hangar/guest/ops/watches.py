"""The ``watch`` operation: file changes under a path, from inotify (``hangar.guest.watch``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hangar.guest import watch as watcher
from hangar.guest.ops.common import AgentView, OpError, os_error, resolve

if TYPE_CHECKING:
    from hangar.guest.channel import Channel


async def watch(agent: AgentView, meta: dict[str, Any], ch: Channel) -> dict[str, Any]:
    """File changes under ``path`` (``recursive``: and every folder below it) until the
    host CANCELs the watch or the path goes away; frames and events in
    ``hangar.guest.watch``."""
    path = resolve(meta.get("path"))
    try:
        return await watcher.run(ch, path, bool(meta.get("recursive")))
    except watcher.TooMany:
        raise OpError("invalid", f"more than {watcher.MAX_DIRS} folders under {path}; "
                                 "watch a smaller tree") from None
    except OSError as exc:
        raise os_error(exc, path) from None
