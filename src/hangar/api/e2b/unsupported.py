"""E2B's routes that Hangar does not serve, and every other path under ``/e2b``.

A program written for E2B that calls one of these gets an answer that says
so, in E2B's error shape (so its SDK raises a ``SandboxException`` that
carries it), never a 404 that looks like a bug:

- a route E2B's API defines (``spec/openapi.yml``) or its SDK calls, that
  Hangar does not serve: **501** ``{"code": 501, "message": "Hangar does
  not serve E2B's GET /nodes: ..."}``, naming the route and why;
- a known path with another method: **405**, naming the methods it has;
- any other path: **404**, naming it and pointing at docs/e2b.md.

The catch-all never matches ``/e2b/envd`` or below (its path parameter's
convertor refuses a path starting ``envd/``): that prefix is envd's data
plane (``hangar.api.envd``), whatever order the routes are in.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.convertors import Convertor, register_url_convertor

from hangar.api.e2b import builds, sandboxes, snapshots, teams, templates
from hangar.api.e2b.errors import E2BRoute, e2b_error

ENVD_PREFIX = "/e2b/envd"
"""The data plane's prefix: never claimed here."""

_TEAMS = ("Hangar keeps no history of a team's figures: GET /teams/{teamID}/metrics "
          "answers the figures now, and /metrics' hangar_team_* gauges are for a scraper")
_LOGS = "Hangar does not serve sandbox logs through E2B's API"
_BUILDS = ("Hangar builds templates through E2B's v3 flow (POST /v3/templates, then "
           "/v2/templates/{templateID}/builds/{buildID}) or `hangar template build`")
_TAGS = "Hangar serves a template's tags as a list, assign and remove"
_ADMIN = "Hangar has no admin API (a cluster of servers is run with `hangar cluster`)"
_KEYS = "Hangar's API keys are made on the server with `hangar key add NAME --e2b`"
_SECRETS = "Hangar has no secrets store (pass values as envVars)"

NOT_SERVED: tuple[tuple[str, str, str], ...] = (
    ("GET", "/teams/{teamID}/metrics/max", _TEAMS),
    ("GET", "/sandboxes/{sandboxID}/logs", _LOGS),
    ("GET", "/v2/sandboxes/{sandboxID}/logs", _LOGS),
    ("POST", "/v2/templates", _BUILDS),
    ("POST", "/templates", _BUILDS),
    ("POST", "/templates/{templateID}", _BUILDS),
    ("PATCH", "/templates/{templateID}", _BUILDS),
    ("POST", "/templates/{templateID}/builds/{buildID}", _BUILDS),
    ("PATCH", "/v2/templates/{templateID}", _BUILDS),
    ("GET", "/templates/{templateID}/tags/count", _TAGS),
    ("GET", "/templates/{templateID}/tags/exists", _TAGS),
    ("GET", "/templates/{templateID}/tags/groups", _TAGS),
    ("GET", "/templates/{templateID}/tags/{tag}/assignments", _TAGS),
    ("GET", "/nodes", _ADMIN),
    ("GET", "/nodes/{nodeID}", _ADMIN),
    ("POST", "/nodes/{nodeID}", _ADMIN),
    ("POST", "/admin/teams/{teamID}/sandboxes/kill", _ADMIN),
    ("GET", "/admin/sandboxes/running-counts", _ADMIN),
    ("POST", "/admin/teams/{teamID}/builds/cancel", _ADMIN),
    ("POST", "/admin/teams/{teamID}/api-keys", _ADMIN),
    ("DELETE", "/admin/teams/{teamID}/api-keys/{apiKeyID}", _ADMIN),
    ("POST", "/access-tokens", _KEYS),
    ("DELETE", "/access-tokens/{accessTokenID}", _KEYS),
    ("GET", "/api-keys", _KEYS),
    ("POST", "/api-keys", _KEYS),
    ("PATCH", "/api-keys/{apiKeyID}", _KEYS),
    ("DELETE", "/api-keys/{apiKeyID}", _KEYS),
    ("GET", "/secrets", _SECRETS),
    ("POST", "/secrets", _SECRETS),
    ("GET", "/secrets/{secretID}", _SECRETS),
    ("POST", "/secrets/{secretID}", _SECRETS),
    ("DELETE", "/secrets/{secretID}", _SECRETS),
)
"""(method, path under ``/e2b``, why) of each E2B route Hangar does not serve."""


def _pattern(template: str) -> re.Pattern[str]:
    """A path template (``/teams/{teamID}``) as a regex of whole paths; a parameter is
    one segment."""
    parts = re.split(r"(\{[^}]+\})", template)
    body = "".join("[^/]+" if p.startswith("{") else re.escape(p) for p in parts)
    return re.compile(f"^{body}/?$")


_TABLE = [(method, template, _pattern(template), why) for method, template, why in NOT_SERVED]


class _NotEnvd(Convertor[str]):
    """A path under ``/e2b`` that is not envd's: any text not starting ``envd/``."""

    regex = r"(?!envd(?:/|$)).*"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("e2b_not_envd", _NotEnvd())

router = APIRouter(route_class=E2BRoute)

_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]

_SERVED = [route for module in (sandboxes, snapshots, templates, builds, teams)
           for route in module.router.routes if isinstance(route, APIRoute)]
"""The served routes, with paths relative to ``/e2b``."""


def _methods_served(sub: str) -> set[str]:
    """Methods the served routes have for ``sub`` (a path under ``/e2b``)."""
    out: set[str] = set()
    for route in _SERVED:
        if route.path_regex.match(sub):
            out |= set(route.methods or ())
    return out


def answer(request: Request, sub: str) -> JSONResponse:
    """The answer to ``request`` for ``/e2b`` + ``sub`` (see the module docstring)."""
    method = request.method.upper()
    for m, template, pattern, why in _TABLE:
        if m == method and pattern.match(sub):
            return e2b_error(501, f"Hangar does not serve E2B's {method} {template}: {why}. "
                                  "See docs/e2b.md for what it serves.")
    methods = _methods_served(sub)
    methods |= {m for m, _, pattern, _why in _TABLE if pattern.match(sub)}
    if methods:
        allowed = ", ".join(sorted(methods))
        response = e2b_error(405, f"E2B's API has no {method} {sub}; it has {allowed}")
        response.headers["Allow"] = allowed
        return response
    return e2b_error(404, f"E2B's API has no route {method} {sub}; see docs/e2b.md for the "
                          "routes Hangar serves under /e2b")


async def _fallback(request: Request, path: str) -> Any:
    return answer(request, "/" + path)


router.add_api_route("/{path:e2b_not_envd}", _fallback, methods=_METHODS,
                     include_in_schema=False)
