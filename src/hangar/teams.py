"""Teams: the owners of a shared server's resources, and their quotas.

A key made with ``hangar key add NAME --team TEAM`` acts for that team
(``hangar.keys``): it sees and acts on the team's own resources only, and
what it creates counts against the team's limits (``hangar.core.teams``).
A key without a team is an **operator** key (every key before teams
existed is one): it sees everything and manages teams and keys.

One file in the data directory, ``teams.json`` (0600)::

    {"teams": {"NAME": {"created": UNIX_SECONDS, "max_sandboxes": N | null,
                        "max_vcpus": N | null, "max_memory_mib": N | null,
                        "max_disk_mib": N | null, "max_volumes_mib": N | null}}}

A limit of null is no limit. Writers take the data directory's ``flock``
(``hangar.keys.locked``) and replace the file by rename; readers reload it
when its (inode, size, mtime) changes, so a change made by one process is
seen by the others on their next look. Errors: InvalidRequest (a bad name
or limit), NotFound, Conflict (the name exists), LimitExceeded (past
``TEAMS_MAX``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hangar.durable import atomic_write, read_small
from hangar.errors import Conflict, InvalidRequest, LimitExceeded, NotFound

log = logging.getLogger("hangar.teams")

NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
"""A team's name: 1-63 of a-z, 0-9 and '-', a letter or digit first."""
LIMITS = ("max_sandboxes", "max_vcpus", "max_memory_mib", "max_disk_mib", "max_volumes_mib")
"""A team's quotas: live sandboxes, their vCPUs, memory and disk (MiB), and the sizes of
its named volumes together (MiB)."""
LIMIT_MAX = 1 << 40
"""Largest value a limit may have (far above any host's)."""
TEAMS_MAX = 10_000
"""Teams one server holds."""
MAX_FILE_BYTES = 4 << 20
"""Most bytes read from ``teams.json``."""


@dataclass(frozen=True)
class Team:
    """A team and its limits (None: no limit); ``created`` in Unix seconds."""

    name: str
    created: float
    max_sandboxes: int | None = None
    max_vcpus: int | None = None
    max_memory_mib: int | None = None
    max_disk_mib: int | None = None
    max_volumes_mib: int | None = None

    def limits(self) -> dict[str, int | None]:
        """``{limit name: value}`` of every quota."""
        return {k: getattr(self, k) for k in LIMITS}


def check_name(name: str) -> None:
    """Raise InvalidRequest unless ``name`` is a team name (``NAME``)."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise InvalidRequest(f"team name {str(name)[:80]!r} must be 1-63 of a-z, 0-9 and "
                             "'-', starting with a letter or digit", field="name")


def check_limits(limits: dict[str, Any]) -> dict[str, int | None]:
    """``limits`` checked: known names, whole numbers from 0 to ``LIMIT_MAX`` or None.
    Raises InvalidRequest naming the first bad one."""
    out: dict[str, int | None] = {}
    for k, v in limits.items():
        if k not in LIMITS:
            raise InvalidRequest(f"{k!r} is not a team limit ({', '.join(LIMITS)})", field=k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)
                              or not 0 <= v <= LIMIT_MAX):
            raise InvalidRequest(f"{k} must be a whole number from 0 to {LIMIT_MAX}, or "
                                 "null for no limit", field=k)
        out[k] = v
    return out


def _parse(raw: bytes, path: Path) -> dict[str, Team]:
    try:
        data = json.loads(raw)
        entries = data["teams"]
        if not isinstance(entries, dict):
            raise TypeError("teams is not an object")
    except (ValueError, KeyError, TypeError) as exc:
        log.error("teams file unreadable", extra={"file": str(path), "reason": str(exc)})
        return {}
    teams: dict[str, Team] = {}
    for name, body in entries.items():
        try:
            check_name(name)
            if not isinstance(body, dict):
                raise InvalidRequest("not an object")
            limits = check_limits({k: body.get(k) for k in LIMITS})
            teams[name] = Team(name, float(body.get("created") or 0.0), **limits)
        except (InvalidRequest, TypeError, ValueError) as exc:
            log.error("team ignored", extra={"team": str(name)[:80], "reason": str(exc)})
    return teams


class TeamStore:
    """The teams of one data directory (``<data>/teams.json``)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._seen: tuple[int, int, int] | None = None
        self._teams: dict[str, Team] = {}

    def _signature(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def _read(self) -> dict[str, Team]:
        sig = self._signature()
        if sig != self._seen:
            try:
                raw = read_small(self.path, MAX_FILE_BYTES)
            except FileNotFoundError:
                raw = b'{"teams": {}}'
            self._teams, self._seen = _parse(raw, self.path), sig
        return self._teams

    def all(self) -> list[Team]:
        """Every team, by name."""
        return [t for _, t in sorted(self._read().items())]

    def get(self, name: str) -> Team:
        """Team ``name``; raises NotFound."""
        team = self._read().get(name)
        if team is None:
            raise NotFound(f"no team {name[:80]!r}", team=name[:80])
        return team

    def exists(self, name: str) -> bool:
        return name in self._read()

    def _write(self, teams: dict[str, Team]) -> None:
        body = {"teams": {n: {k: v for k, v in asdict(t).items() if k != "name"}
                          for n, t in sorted(teams.items())}}
        atomic_write(self.path, json.dumps(body, indent=1).encode(), mode=0o600)
        self._seen = None

    def create(self, name: str, **limits: Any) -> Team:
        """Make team ``name`` with ``limits``. Raises InvalidRequest, Conflict,
        LimitExceeded."""
        from hangar.keys import locked
        check_name(name)
        checked = check_limits(limits)
        with locked(self.path.parent):
            self._seen = None
            teams = dict(self._read())
            if name in teams:
                raise Conflict(f"a team called {name!r} exists", team=name)
            if len(teams) >= TEAMS_MAX:
                raise LimitExceeded(f"this server holds {TEAMS_MAX} teams", limit=TEAMS_MAX)
            teams[name] = Team(name, time.time(), **checked)
            self._write(teams)
        return teams[name]

    def update(self, name: str, **limits: Any) -> Team:
        """Change ``name``'s limits named in ``limits`` (None: no limit). Raises
        InvalidRequest, NotFound."""
        from hangar.keys import locked
        checked = check_limits(limits)
        with locked(self.path.parent):
            self._seen = None
            teams = dict(self._read())
            old = teams.get(name)
            if old is None:
                raise NotFound(f"no team {name[:80]!r}", team=name[:80])
            teams[name] = Team(name, old.created, **{**old.limits(), **checked})
            self._write(teams)
        return teams[name]

    def keys_of(self, name: str) -> list[str]:
        """The names of team ``name``'s keys in ``api-keys``, sorted."""
        from hangar.keys import read_named
        return sorted(k.name for k in read_named(self.path.parent / "api-keys")[0]
                      if k.team == name)

    def remove(self, name: str) -> None:
        """Forget team ``name`` (the caller checks it holds no sandbox). Raises NotFound,
        Conflict while a key of it is in ``api-keys`` (read under the lock that ``hangar
        key add`` takes, so no key of it can appear meanwhile)."""
        from hangar.keys import locked, read_named
        with locked(self.path.parent):
            self._seen = None
            teams = dict(self._read())
            if name not in teams:
                raise NotFound(f"no team {name[:80]!r}", team=name[:80])
            keys = [k.name for k in read_named(self.path.parent / "api-keys")[0]
                    if k.team == name]
            if keys:
                raise Conflict(f"team {name} has keys ({', '.join(sorted(keys)[:10])}); "
                               "remove them first (hangar key rm NAME)", team=name)
            del teams[name]
            self._write(teams)
