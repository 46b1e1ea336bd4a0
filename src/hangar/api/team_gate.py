"""What a team's key may reach over HTTP (issue 32's first part).

A key of a team (``hangar key add NAME --team TEAM``) acts for it: core
shows it its team's sandboxes only, stamps what it creates and counts it
against the team's quotas (``hangar.core.teams``). Over HTTP such a key
reaches only the routes whose resources core scopes to a team so far:

* Hangar's sandboxes (``/sandboxes`` and everything below a sandbox:
  commands, files, processes, terminals, the desktop, ports, code, its
  network), but not its snapshots (``/sandboxes/{id}/snapshot``,
  ``/restore``);
* E2B's sandbox routes (``/e2b/sandboxes``, ``/e2b/v2/sandboxes`` and below a
  sandbox), but not its snapshots or forks, nor every sandbox's metrics.

Any other keyed route (snapshots, volumes, secrets, machines, the warm
pool, events, template builds, ``/metrics``, teams) is **403** for a team's
key, naming the route; an operator key (a key without a team) reaches
everything. A sandbox named in a route's path that is not the team's own is
a 404 worded as for a missing one (``Teams.check``), before the route runs.
"""

from __future__ import annotations

import re
from typing import Any

from hangar.errors import Forbidden

TEAM_ROUTES = re.compile(
    r"^(/e2b)?(/v2)?/sandboxes(/\{sandbox_id\}(?!/(snapshots?|restore|fork)\b)(/.*)?)?$")
"""Route templates a team's key reaches (the module docstring; E2B's routes are matched
with and without their ``/e2b`` prefix, as they are served under ``api.<domain>`` too)."""
OPERATOR_ONLY = {"/e2b/sandboxes/metrics", "/sandboxes/metrics"}
"""Templates the pattern matches that stay the operator's (every sandbox's figures)."""


def team_of(state: Any, key_name: str | None) -> str | None:
    """The team of the key called ``key_name`` in the app's key ring (None: operator)."""
    ring = getattr(state, "keys", None)
    if ring is None or key_name is None:
        return None
    return ring.team_of(key_name)


def check_route(scope: Any, team: str | None) -> None:
    """Raise Forbidden unless a key of ``team`` may reach the matched route of ``scope``
    (always, for an operator's key), and NotFound for a sandbox in its path that is not
    the team's (``Teams.check`` of the app's manager)."""
    if team is None:
        return
    route = scope.get("route")
    path = getattr(route, "path", None) or scope.get("path", "")
    if path in OPERATOR_ONLY or not TEAM_ROUTES.match(path):
        raise Forbidden(f"a team's key cannot use {path} (it is the operator's, or not "
                        "scoped to teams yet)", route=path, team=team)
    sandbox_id = (scope.get("path_params") or {}).get("sandbox_id")
    manager = getattr(scope["app"].state, "manager", None)
    if sandbox_id is not None and manager is not None:
        manager.teams.check(sandbox_id)
