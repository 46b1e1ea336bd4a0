"""Wire schemas of teams (``/teams``, the operator's key only): a team, its limits and use.

A team owns the resources its keys make and is held to its limits (``hangar.teams``).
Every limit is a whole number, or null for no limit; sizes are MiB, times Unix seconds.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import ConfigDict, Field

from hangar.schemas.base import Model, RequestBody

TEAM_NAME = r"^[a-z0-9][a-z0-9-]{0,62}$"
"""A team's name: 1-63 of a-z, 0-9 and '-', a letter or digit first (``hangar.teams.NAME``)."""
LIMIT_MAX = 1 << 40
"""Largest value a limit may have (``hangar.teams.LIMIT_MAX``)."""
Limit = Annotated[int | None, Field(ge=0, le=LIMIT_MAX, strict=True)]
"""One limit: a whole number from 0 to ``LIMIT_MAX``, or None (null) for no limit."""


class TeamLimits(RequestBody):
    """A team's limits. As a ``PATCH`` body, only the fields sent change (null removes a
    limit); the field names are ``hangar.teams.LIMITS``."""

    model_config = ConfigDict(extra="forbid")

    max_sandboxes: Limit = Field(None, description="Live sandboxes at once; null: no limit.")
    max_vcpus: Limit = Field(None, description="vCPUs of its live sandboxes; null: no limit.")
    max_memory_mib: Limit = Field(None, description="Memory of its live sandboxes, MiB; "
                                                    "null: no limit.")
    max_disk_mib: Limit = Field(None, description="Disk of its live sandboxes, MiB; null: "
                                                  "no limit.")
    max_volumes_mib: Limit = Field(None, description="Sizes of its named volumes together, "
                                                     "MiB; null: no limit.")


LIMIT_NAMES: tuple[str, ...] = tuple(TeamLimits.model_fields)
"""The limits' names, in the order ``hangar team ls`` shows them."""


class CreateTeam(TeamLimits):
    """Body of ``POST /teams``: a new team (409 if the name is taken); limits left out are
    none."""

    name: str = Field(pattern=TEAM_NAME, description="1-63 of a-z 0-9 -, a letter or digit "
                                                     "first.")


class UpdateTeam(TeamLimits):
    """Body of ``PATCH /teams/{name}``: the limits to change."""


class TeamUsage(Model):
    """What a team holds now, counted against its limits."""

    sandboxes: int = Field(description="Live sandboxes.")
    vcpus: int = Field(description="Their vCPUs.")
    memory_mib: int = Field(description="Their memory, MiB.")
    disk_mib: int = Field(description="Their disk, MiB.")
    volumes_mib: int = Field(0, description="The sizes of its named volumes together, MiB "
                                            "(0 from a server older than the field).")


class TeamInfo(Model):
    """A team as the API shows it: its limits (None: no limit) and its use."""

    name: str
    created_at: float = Field(description="Unix time, seconds.")
    max_sandboxes: int | None = None
    max_vcpus: int | None = None
    max_memory_mib: int | None = None
    max_disk_mib: int | None = None
    max_volumes_mib: int | None = None
    usage: TeamUsage

    def limits(self) -> dict[str, int | None]:
        """``{limit name: value}`` of every limit (``LIMIT_NAMES``)."""
        return {k: getattr(self, k) for k in LIMIT_NAMES}


class TeamList(Model):
    teams: list[TeamInfo]
