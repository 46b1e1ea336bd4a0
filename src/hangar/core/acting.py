"""The team acting in the current task: a context variable the API sets once per request,
before the route, from the key that made it (``act_as``), or a block sets around work done
for a team (``acting_for``); tasks the request starts inherit it. None: an operator's
request, or the server's own work. What a team acting may see and use is
``hangar.core.teams``'s; this module only carries who it is, and imports nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

ACTING: ContextVar[str | None] = ContextVar("hangar_acting_team", default=None)
"""The team whose key made the request being served (None: an operator's, or none)."""


def acting() -> str | None:
    """The team acting now, or None."""
    return ACTING.get()


def act_as(team: str | None) -> None:
    """Make ``team`` act for the rest of the current task (a request served in a task
    of its own; ``acting_for`` scopes a block instead)."""
    ACTING.set(team)


@contextmanager
def acting_for(team: str | None) -> Iterator[None]:
    """Run the block with ``team`` acting (tests, and callers outside a request)."""
    token = ACTING.set(team)
    try:
        yield
    finally:
        ACTING.reset(token)
