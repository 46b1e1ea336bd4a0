# Generated from hangar/client/_async/teams.py by scripts/gen_sync.py: do not edit.
"""Teams: the flat client's calls (``/teams``), mixed into ``AsyncHangar``.

A team owns what its keys make and is held to its limits (``max_sandboxes``,
``max_vcpus``, ``max_memory_mib``, ``max_disk_mib``, ``max_volumes_mib``; None is no
limit). Only an operator key (one without a team) may call these; a team's key gets
Forbidden (403). A team's keys are made on the server's host with
``hangar key add NAME --team TEAM``. Source of ``hangar/client/_sync/teams.py``.
"""

from __future__ import annotations

import builtins

from hangar.client import _core
from hangar.client._sync.mixin import flat_client as _client
from hangar.errors import InvalidRequest
from hangar.schemas import LIMIT_NAMES, TeamInfo, TeamList


def _limits(limits: dict[str, int | None]) -> dict[str, int | None]:
    """``limits`` when every name is a team limit; InvalidRequest naming the first that is
    not (before anything is sent)."""
    for k in limits:
        if k not in LIMIT_NAMES:
            raise InvalidRequest(f"{k!r} is not a team limit ({', '.join(LIMIT_NAMES)})",
                                 field=k)
    return limits


class TeamCalls:
    """The flat client's team methods (mixed into ``AsyncHangar``)."""

    def list_teams(self, *, request_timeout: float | None = None,
                         retry: bool | None = None) -> builtins.list[TeamInfo]:
        """``GET /teams``: every team with its limits and use, by name. Raises Forbidden
        (a team's key)."""
        c = _client(self)
        return TeamList.model_validate(c._json(
            "GET", "/teams", retry=retry is not False,
            timeout=c._t(request_timeout, c.config.timeouts.control))).teams

    def get_team(self, name: str, *, request_timeout: float | None = None,
                       retry: bool | None = None) -> TeamInfo:
        """``GET /teams/{name}``: one team, its limits and use. Raises NotFound, Forbidden
        (a team's key)."""
        c = _client(self)
        return TeamInfo.model_validate(c._json(
            "GET", f"/teams/{name}", retry=retry is not False,
            timeout=c._t(request_timeout, c.config.timeouts.control)))

    def create_team(self, name: str, *, request_timeout: float | None = None,
                          retry: bool | None = None, **limits: int | None) -> TeamInfo:
        """``POST /teams``: a team called ``name`` (1-63 of a-z, 0-9, '-') with ``limits``
        (``max_sandboxes=4, max_memory_mib=8192``...; those left out are no limit). Carries
        a new idempotency key, so a retry never makes it twice. Raises InvalidRequest (a
        bad name or limit), Conflict (the name is taken), Forbidden (a team's key)."""
        c = _client(self)
        return TeamInfo.model_validate(c._json(
            "POST", "/teams", json={"name": name, **_limits(limits)},
            retry=retry is not False, idempotency_key=_core.new_idempotency_key(),
            timeout=c._t(request_timeout, c.config.timeouts.control)))

    def update_team(self, name: str, *, request_timeout: float | None = None,
                          retry: bool | None = None, **limits: int | None) -> TeamInfo:
        """``PATCH /teams/{name}``: change the limits named in ``limits`` (a number, or None
        to remove that limit); the others stay. Raises NotFound, InvalidRequest,
        Forbidden (a team's key)."""
        c = _client(self)
        return TeamInfo.model_validate(c._json(
            "PATCH", f"/teams/{name}", json=_limits(limits), retry=retry is not False,
            timeout=c._t(request_timeout, c.config.timeouts.control)))

    def delete_team(self, name: str, *, request_timeout: float | None = None,
                          retry: bool | None = None) -> None:
        """``DELETE /teams/{name}``. Raises NotFound, Conflict (it still holds sandboxes
        or keys: remove them first), Forbidden (a team's key)."""
        c = _client(self)
        c._send("DELETE", f"/teams/{name}", retry=retry is not False,
                      timeout=c._t(request_timeout, c.config.timeouts.control))
