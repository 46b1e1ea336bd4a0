"""The records of teams in etcd: a team's limits, a team's key, a team's quota counter.

``/hangar/teams/<name>``, ``/hangar/keys/<name>`` and ``/hangar/quota/<team>``
(``hangar.cluster.records`` lists every key; ``hangar.cluster.teams`` uses
them). Read as untrusted input like every record: ``team_record`` and
``key_record`` raise ``BadRecord`` naming what is wrong, and the directory
leaves such a record out with a warning.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from hangar.cluster.records import (
    KEY_NAME, TEAM_NAME, BadRecord, _checked as checked, _Record as Record,
)
from hangar.teams import LIMIT_MAX, Team


class TeamRecord(Record):
    """``/hangar/teams/<name>``: a team's limits (``hangar.teams``; None: no limit)."""

    created: float = Field(0.0, ge=0, le=1 << 40)
    max_sandboxes: int | None = Field(None, ge=0, le=LIMIT_MAX, strict=True)
    max_vcpus: int | None = Field(None, ge=0, le=LIMIT_MAX, strict=True)
    max_memory_mib: int | None = Field(None, ge=0, le=LIMIT_MAX, strict=True)
    max_disk_mib: int | None = Field(None, ge=0, le=LIMIT_MAX, strict=True)
    max_volumes_mib: int | None = Field(None, ge=0, le=LIMIT_MAX, strict=True)


def team_record(name: str, raw: Any) -> Team:
    """The team ``name`` (the key's last part) from its record. Raises BadRecord."""
    if not TEAM_NAME.fullmatch(name):
        raise BadRecord(f"malformed team name {name[:80]!r}")
    t = checked(TeamRecord, "team record", raw)
    return Team(name, t.created, t.max_sandboxes, t.max_vcpus, t.max_memory_mib,
                t.max_disk_mib, t.max_volumes_mib)


def team_json(t: Team) -> dict[str, Any]:
    """A team's record value."""
    return {"created": t.created, **t.limits()}


class KeyRecord(Record):
    """``/hangar/keys/<name>``: a team's API key as its SHA-256 (never the key itself)."""

    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    team: str = Field(pattern=TEAM_NAME.pattern)
    created: float = Field(0.0, ge=0, le=1 << 40)


def key_record(name: str, raw: Any) -> KeyRecord:
    """The key ``name`` (the key's last part) from its record. Raises BadRecord."""
    if not KEY_NAME.fullmatch(name):
        raise BadRecord(f"malformed key name {name[:80]!r}")
    return checked(KeyRecord, "key record", raw)


def quota_count(value: bytes) -> int:
    """The counter of ``/hangar/quota/<team>`` (0 when unreadable: only its revision
    matters)."""
    try:
        n = int(value.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        return 0
    return n if 0 <= n < 1 << 62 else 0
