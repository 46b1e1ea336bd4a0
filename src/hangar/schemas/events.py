"""Wire schemas of live events (``GET /events``, ``POST /events``)."""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field

from hangar.schemas.base import Model, RequestBody


AGENT_KIND = r"^agent(\.[a-z0-9_]{1,32}){1,4}$"
"""Kinds a client may publish: ``agent.`` and up to four dotted lower-case words."""
MAX_EVENT_DATA = 16 * 1024
"""Bytes of JSON a published event's ``data`` may hold."""


class Event(Model):
    """One live event of ``GET /events`` (its SSE ``data:`` line).

    ``id`` is opaque (``<stream>:<n>``): pass the last one seen back as
    ``Last-Event-ID`` to get what was missed. ``kind`` is one of those
    listed in ``hangar.core.events`` (``sandbox.created``,
    ``exec.finished``, ``agent.tool.started``...); ``data`` holds its
    fields (never command output, environment, file contents or secrets).
    """

    id: str
    time: float = Field(description="Unix time, seconds.")
    kind: str
    sandbox_id: str | None = None
    data: dict[str, Any] = Field(default_factory=dict)
    team: str | None = Field(None, description=(
        "The team it concerns (a team's key sees only its team's events); None: the "
        "operator's alone."))


class PublishEvent(RequestBody):
    """Body of ``POST /events``: an event of an agent platform (kinds under ``agent.``)."""

    model_config = ConfigDict(extra="forbid")

    kind: str = Field(pattern=AGENT_KIND, max_length=100,
                      description="e.g. agent.task.started, agent.tool.finished.")
    sandbox_id: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    data: dict[str, Any] = Field(default_factory=dict, max_length=64,
                                 description=f"JSON fields, at most {MAX_EVENT_DATA} bytes.")
