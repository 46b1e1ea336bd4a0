"""What a team's key may reach over HTTP (issue 32).

A key of a team (``hangar key add NAME --team TEAM``) acts for it: core shows
it its team's resources only (another team's are 404, worded as missing ones),
stamps what it makes and counts it against the team's quotas
(``hangar.core.teams``). Over HTTP such a key reaches the routes of each kind
of resource core scopes to teams (``ROUTES_BY_KIND``): sandboxes and
everything below one, snapshots, machines, templates and their builds,
volumes, secrets, events, and E2B's routes of those kinds plus its ``/teams``
(the key's own team).

What stays the operator's is **403** for a team's key, naming the route:
``/metrics``, ``/teams`` (their management), ``/pool``, and E2B's
all-sandboxes metrics; an operator key (a key without a team) reaches
everything, and acts for a team with ``X-Hangar-Team: NAME`` (``team_for``).
A sandbox named in a route's path that is not the team's own is a 404
worded as for a missing one (``Teams.check``), before the route runs.
"""

from __future__ import annotations

import re
from typing import Any

from hangar.errors import Forbidden, NotFound

E2B = "/e2b"
"""The prefix E2B's control plane is served under (``hangar.api.e2b``)."""

ROUTES_BY_KIND: dict[str, str] = {
    "sandboxes": r"(/e2b)?(/v2)?/sandboxes(/\{sandbox_id\}(/.*)?)?",
    "snapshots": r"(/e2b)?/snapshots(/.*)?",
    "machines": r"/machines(/.*)?",
    "templates": r"(/e2b)?((/v[23])?/templates(/.*)?|/default-templates)",
    "volumes": r"(/e2b)?/volumes(/.*)?",  # a team's own (hangar.core.volumes)
    "secrets": r"/secrets(/.*)?",  # a team's own (hangar.core.secrets)
    "events": r"/events",
    "e2b-teams": r"/e2b/teams(/[^/]+/metrics)?",  # the key's own team (Teams.get)
    "e2b-unserved": r"/e2b/\{path:e2b_not_envd\}",  # E2B's 501/405/404 answers
}
"""The route templates of each kind of resource core scopes to teams (a kind joins when
its ownership is checked in core: ``hangar.core.teams``)."""
TEAM_ROUTES = re.compile("^(" + "|".join(ROUTES_BY_KIND.values()) + ")$")
"""Route templates a team's key reaches (the module docstring; E2B's are matched under
``/e2b``, as ``check_route`` names them)."""
OPERATOR_ONLY = {"/e2b/sandboxes/metrics", "/sandboxes/metrics"}
"""Templates the pattern matches that stay the operator's (every sandbox's figures)."""


def team_of(state: Any, key_name: str | None) -> str | None:
    """The team of the key called ``key_name`` in the app's key ring (None: operator)."""
    ring = getattr(state, "keys", None)
    if ring is None or key_name is None:
        return None
    return ring.team_of(key_name)


ACT_FOR_HEADER = "x-hangar-team"
"""The header with which an operator's key acts for a team (its name): the request then
sees and makes what a key of that team would (``hangar.core.teams``)."""


def team_for(state: Any, key_name: str | None, asked: str | None) -> str | None:
    """The team a request acts for: its key's team (``team_of``) or, for an operator's key
    that sends ``X-Hangar-Team: NAME``, that team. Raises Forbidden when a team's key names
    another team, NotFound when the team named does not exist."""
    team = team_of(state, key_name)
    if asked is None or asked == team:
        return team
    if team is not None:
        raise Forbidden(f"a key of team {team} cannot act for another team",
                        team=team, header="X-Hangar-Team")
    manager = getattr(state, "manager", None)
    if manager is None or not manager.teams.exists(asked):
        raise NotFound(f"no team {asked[:80]!r} (X-Hangar-Team)", team=asked[:80])
    return asked


def check_route(scope: Any, team: str | None) -> None:
    """Raise Forbidden unless a key of ``team`` may reach the matched route of ``scope``
    (always, for an operator's key), and NotFound for a sandbox in its path that is not
    the team's (``Teams.check`` of the app's manager)."""
    if team is None:
        return
    route = scope.get("route")
    path = getattr(route, "path", None) or scope.get("path", "")
    if str(scope.get("path", "")).startswith(E2B + "/") and not path.startswith(E2B + "/"):
        path = E2B + path  # E2B's routes are matched by their templates under its prefix
    if path in OPERATOR_ONLY or not TEAM_ROUTES.match(path):
        raise Forbidden(f"a team's key cannot use {path}: it is the operator's (an operator's "
                        "key acting for a team with X-Hangar-Team is held to the team's "
                        "routes too)", route=path, team=team)
    sandbox_id = (scope.get("path_params") or {}).get("sandbox_id")
    manager = getattr(scope["app"].state, "manager", None)
    if sandbox_id is not None and manager is not None:
        manager.teams.check(sandbox_id)
