"""API-key authentication over HTTP: the ``X-API-Key`` header and the routes' dependency.

The keys, their files, the throttling of guessers and the one check of a
presented key (``authenticate``) live in ``hangar.keys``, which a cluster's
gateway uses too; their names are kept here for the routes that import them.

Keys (see ``hangar.keys`` for the files):

- the default key: ``HANGAR_API_KEY`` when set, else the file ``<data>/api-key``
  (generated on first start);
- any number of named keys in ``<data>/api-keys``, kept as SHA-256 hashes.

Addresses are the TCP peer's; behind a reverse proxy every client shares the
proxy's address. Keys are never logged, never accepted in a URL and never
passed into a guest.
"""

from __future__ import annotations

from fastapi import Request, Security
from fastapi.security import APIKeyHeader

from hangar.api.team_gate import ACT_FOR_HEADER, check_route, team_for
from hangar.core.service import act_as
from hangar.keys import (
    BURST, MAX_ADDRESSES, REFILL_S, KeyRing, Throttle, authenticate, client_identity,
)

__all__ = ["BURST", "HEADER", "MAX_ADDRESSES", "REFILL_S", "KeyRing", "Throttle",
           "authenticate", "client_identity", "require_key"]

HEADER = APIKeyHeader(name="X-API-Key", auto_error=False,
                      description="An API key: the server's default key (<data>/api-key) or a "
                                  "named key made by `hangar key add`.")


async def require_key(request: Request, given: str | None = Security(HEADER)) -> None:
    """FastAPI dependency: 401 unless the request carries a key the server accepts
    (see ``authenticate``). Sets ``request.state.key_name`` to the key's name and
    ``request.state.team`` to its team; a team's key then reaches only the routes
    ``hangar.api.team_gate`` lets it (403) and its own sandboxes (404).

    The front door (``hangar.api.frontdoor``) has checked the key already, before the
    body was read, and left its name in the request's state: then nothing is checked
    twice. Without the front door (an app assembled otherwise) the key is checked here.
    Runs on the event loop (two ``stat`` calls and a hash), not in a worker thread."""
    if getattr(request.state, "key_name", None) is None:
        request.state.key_name = authenticate(request.app.state, given,
                                              client_identity(request.scope))
        request.state.team = team_for(request.app.state, request.state.key_name,
                                      request.headers.get(ACT_FOR_HEADER))
        act_as(request.state.team)  # this request's task only
    check_route(request.scope, getattr(request.state, "team", None))
