"""``/teams`` on a cluster's node: the operator's management of teams kept in etcd.

On a single host ``/teams`` is served by the API from ``<data>/teams.json``
(``hangar.api.teams``). On a node the gateway answers these routes itself,
with the same paths, bodies and answers, on the records in etcd
(``hangar.cluster.teams``), so ``hangar team create|set|rm|ls`` (the SDK on any
node) changes the teams of every node:

=======================  ====================================================
``GET /teams``           every team, its limits and its use
``POST /teams``          a new team (409 if the name is taken)
``GET /teams/{name}``    one team
``PATCH /teams/{name}``  change limits (null removes one)
``DELETE /teams/{name}`` refused (409) while it has keys or sandboxes in the
                         cluster, or anything on the node asked
=======================  ====================================================

Use is counted on the records of every node (sandboxes, vCPUs, memory, disk);
named volumes are a node's own, so ``volumes_mib`` is the answering node's.
Only an operator's key reaches them: a team's key, or an operator's acting
for a team, gets 403 as from the API (``hangar.api.team_gate``).
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

from pydantic import ValidationError

from hangar.cluster import records as R
from hangar.cluster.forwarding import Answer, json_answer
from hangar.cluster.node import ClusterNode
from hangar.cluster.teams import create_team, read_team, remove_team, update_team, usage
from hangar.core.service import acting
from hangar.errors import Forbidden, InvalidRequest, TooLarge
from hangar.schemas.teams import CreateTeam, TeamInfo, TeamUsage, UpdateTeam
from hangar.teams import Team

PATH = re.compile(r"^/teams(?:/(?P<name>[^/]+))?/?$")
SERVED = {False: ("GET", "POST"), True: ("GET", "PATCH", "DELETE")}
"""Methods answered here, for ``/teams`` (False) and ``/teams/{name}`` (True)."""
SETTLE_S = 2.0
"""How long a change waits for this node's cache to show it (so the next call here does)."""


class BadBody(InvalidRequest):
    """A body the schema refuses: 422, as the API answers it."""

    status = 422


def served(method: str, path: str) -> bool:
    """Whether the gateway answers ``method path`` itself (the module docstring)."""
    m = PATH.match(path)
    return m is not None and method in SERVED[m["name"] is not None]


def _parse(model: Any, body: bytes) -> Any:
    try:
        return model.model_validate_json(body or b"{}")
    except ValidationError as exc:
        e = exc.errors()[0]
        loc = ".".join(str(x) for x in ("body", *e.get("loc", ())))
        raise BadBody(f"{loc}: {str(e.get('msg', '')).removeprefix('Value error, ')}") \
            from None


class TeamRoutes:
    """The gateway's answers to ``/teams`` (the module docstring)."""

    def __init__(self, node: ClusterNode) -> None:
        self.node = node

    def view(self, t: Team) -> dict[str, Any]:
        """``TeamInfo`` of ``t``, its use counted on every node's records."""
        u = usage(t.name, list(self.node.directory.sandboxes.values()))
        m = self.node.manager
        vol = m.teams.volumes_mib(t.name) if m is not None else 0
        return TeamInfo(name=t.name, created_at=t.created, **t.limits(),
                        usage=TeamUsage(sandboxes=u.sandboxes, vcpus=u.vcpus,
                                        memory_mib=u.memory_mib, disk_mib=u.disk_mib,
                                        volumes_mib=vol)).model_dump(mode="json")

    async def _body(self, receive: Any) -> bytes:
        limit = self.node.settings.max_json_bytes
        body = bytearray()
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if len(body) > limit:
                raise TooLarge(f"request body over {limit} bytes", limit_bytes=limit)
            if not msg.get("more_body"):
                return bytes(body)

    async def _settle(self, name: str, gone: bool = False) -> None:
        d = self.node.directory
        for _ in range(int(SETTLE_S / 0.05)):
            if (name in d.teams) != gone:
                return
            await asyncio.sleep(0.05)

    async def answer(self, method: str, path: str, receive: Any) -> Answer:
        """The answer to ``method path`` (``served``). Raises Forbidden (a team acts),
        BadBody, InvalidRequest, NotFound, Conflict, TooLarge."""
        team = acting()
        if team is not None:
            raise Forbidden(f"a team's key cannot use {path}: it is the operator's (an "
                            "operator's key acting for a team with X-Hangar-Team is held to "
                            "the team's routes too)", route=path, team=team)
        etcd, d = self.node.etcd, self.node.directory
        name = PATH.match(path)["name"]  # type: ignore[index]
        if name is None:
            if method == "GET":
                return json_answer(200, {"teams": [self.view(t) for _, t in
                                                   sorted(d.teams.items())]})
            body = _parse(CreateTeam, await self._body(receive))
            t = await create_team(etcd, body.name, body.model_dump(exclude={"name"}))
            await self._settle(t.name)
            return json_answer(201, self.view(t))
        if not R.TEAM_NAME.fullmatch(name):
            raise BadBody(f"path.name: String should match pattern '{R.TEAM_NAME.pattern}'")
        if method == "GET":
            return json_answer(200, self.view((await read_team(etcd, name))[0]))
        if method == "PATCH":
            body = _parse(UpdateTeam, await self._body(receive))
            t = await update_team(etcd, name, body.model_dump(exclude_unset=True))
            return json_answer(200, self.view(t))
        m = self.node.manager
        await remove_team(etcd, name, m.teams.holdings(name) if m is not None else {})
        await self._settle(name, gone=True)
        return 204, [], b""
