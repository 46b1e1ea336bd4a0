"""E2B's host names under ``HANGAR_DOMAIN``: what an SDK configured with ``E2B_DOMAIN`` calls.

E2B's SDKs, given only ``E2B_DOMAIN=<domain>`` and a key, build their URLs from
the domain (no ``E2B_API_URL``, no ``E2B_SANDBOX_URL``)::

    https://api.<domain>/<path>               the control plane   → /e2b/<path>
    https://49983-<id>.<domain>/<path>        the sandbox's envd  → /e2b/envd/<path>
                                              (E2b-Sandbox-Id: <id>, E2b-Sandbox-Port: 49983)
    https://<port>-<id>.<domain>/<path>       any other guest port: the port proxy
                                              (hangar.api.proxy), unchanged here

``E2bHosts`` is the outermost ASGI layer: it rewrites the first two into the
paths Hangar serves them on (and the sandbox headers envd's gateway reads,
the host's id winning over any header), before the front door decides who
checks the request. The client's ``Host`` is kept. Host names are matched
without a port when the domain has none (nginx in front passes
``api.<domain>:443`` as is), case-insensitively. Without a domain, or for any
other host, the request passes untouched. TLS is not served here: nginx with
a wildcard certificate (``*.<domain>``) is (docs/operations.md).
"""

from __future__ import annotations

import re

from starlette.types import ASGIApp, Receive, Scope, Send

from hangar.api.envd.versions import ENVD_PORT, PREFIX as ENVD_PREFIX
from hangar.api.proxy.routing import header

__all__ = ["API_LABEL", "E2B_PREFIX", "REWRITTEN", "E2bHosts", "client_path", "rewrite"]

API_LABEL = "api"
"""The control plane's host is ``api.<domain>``, as E2B's SDKs build it."""
E2B_PREFIX = "/e2b"
"""Where E2B's control plane is served on Hangar's own host."""
REWRITTEN = "hangar.e2b_host_prefix"
"""Key of a rewritten request's scope: the prefix its path got (``client_path`` takes it
off again)."""
_ENVD_HOST = re.compile(rf"^{ENVD_PORT}-([a-z0-9_-]{{1,64}})\.")


def _host(scope: Scope, domain: str) -> str:
    """The request's host, lower-case, without a port unless ``domain`` has one."""
    host = (header(scope, b"host") or b"").decode("latin-1").strip().lower()
    if ":" not in domain and not host.endswith("]"):
        host = host.rsplit(":", 1)[0]
    return host


def rewrite(scope: Scope, domain: str | None) -> Scope | None:
    """A copy of ``scope`` aimed at the path Hangar serves an E2B host name on (see the
    module docstring), or None when ``scope`` is not for one of them."""
    if not domain or scope["type"] not in ("http", "websocket"):
        return None
    host = _host(scope, domain)
    suffix = "." + domain.lower()
    if not host.endswith(suffix):
        return None
    label = host[:-len(suffix)]
    extra: list[tuple[bytes, bytes]] = []
    if label == API_LABEL:
        prefix = E2B_PREFIX
    else:
        m = _ENVD_HOST.match(label + ".")
        if m is None or m.end() != len(label) + 1:
            return None
        prefix = ENVD_PREFIX
        extra = [(b"e2b-sandbox-id", m.group(1).encode()),
                 (b"e2b-sandbox-port", str(ENVD_PORT).encode())]
    path = str(scope.get("path") or "/")
    raw = scope.get("raw_path") or path.encode("utf-8", "surrogateescape")
    out = dict(scope)
    out[REWRITTEN] = prefix
    out["path"] = prefix + ("" if path == "/" else path)
    out["raw_path"] = prefix.encode() + (b"" if raw == b"/" else bytes(raw))
    if extra:
        names = {k for k, _ in extra}
        out["headers"] = [(k, v) for k, v in scope.get("headers", ()) if k not in names] + extra
    return out


def client_path(scope: Scope, path: str) -> str:
    """``path`` (one of Hangar's, e.g. a route's ``url_for``) as the client of ``scope``
    names it: without the prefix ``rewrite`` added when it came through an E2B host name."""
    prefix = scope.get(REWRITTEN)
    if prefix and path.startswith(prefix + "/"):
        return path[len(prefix):]
    return path


class E2bHosts:
    """ASGI middleware, outermost: E2B's host names become Hangar's paths (module
    docstring). Finds the domain in ``scope["app"].state.manager.settings``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            manager = getattr(scope["app"].state, "manager", None)
            rewritten = rewrite(scope, manager.settings.domain if manager is not None else None)
            if rewritten is not None:
                scope = rewritten
        await self.app(scope, receive, send)
