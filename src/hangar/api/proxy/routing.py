"""Where a request for an exposed port goes, and what the guest's app sees of it.

``route`` finds the port (path-routed ``/sandboxes/{id}/ports/{port}/...`` or
host-routed ``{port}-{id}.<HANGAR_DOMAIN>``, but for port 49983, E2B's envd, which
``hangar.api.e2b_hosts`` serves); ``guest_headers`` gives the
client's headers as the guest gets them (Hangar's credentials and hop-by-hop
headers removed, ``X-Forwarded-*`` added); ``split_query`` and ``split_cookies``
take a port token out of the query and the ``Cookie`` header, and
``token_cookie`` hands it back to a browser as a cookie.

The cookie's name depends on the request (``cookie_name``). Every
``{port}-{id}.<domain>`` is one *site*, so a page of one sandbox's port can
set (toss) cookies for the whole domain that browsers send to every other
port, before the browser's own when their path is longer (review 29d D-M3).
A host-routed port reached over HTTPS (the scope's scheme ``https`` or
``wss``: behind the trusted reverse proxy, its ``X-Forwarded-Proto``) therefore
keeps its token in ``HOST_COOKIE``, ``__Host-hangar_port_token``: browsers
store a ``__Host-`` cookie only when it is ``Secure``, has ``Path=/`` and no
``Domain``, so it is host-only and no sibling host can set one. There the
unprefixed ``COOKIE`` is never read. Path-routed ports (pages in an opaque
origin, ``hangar.api.proxy.origin``) and host-routed ports over plain HTTP
(which has no ``__Host-`` cookies) use ``COOKIE``. Both names are always
removed from what the guest gets.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from starlette.types import Scope

from hangar.core.service import e2b

TOKEN_PARAM = "hangar_token"
"""Query parameter that carries a private port's URL token."""
COOKIE = "hangar_port_token"
"""Cookie a browser keeps a private port's token in after a visit with ``TOKEN_PARAM``:
path-routed ports, and host-routed ones over plain HTTP (see the module docstring)."""
HOST_COOKIE = "__Host-" + COOKIE
"""The token cookie of a host-routed port reached over HTTPS: ``Secure``, ``Path=/``, no
``Domain``, which browsers enforce for the ``__Host-`` prefix (no other host sets it)."""
TOKEN_COOKIES = frozenset({COOKIE, HOST_COOKIE})
"""Both names: never passed to a guest, never set by one (``hangar.api.proxy.origin``)."""
TOKEN_RE = re.compile(r"^[0-9]{1,12}\.[A-Za-z0-9_-]{1,64}$")
"""What a port token looks like (``hangar.core.ports.PortKey.issue``: expiry in Unix
seconds, a dot, an HMAC in URL-safe base64). Anything else is refused (401) unchecked."""


def well_formed(token: str | None) -> str | None:
    """``token`` when it has a port token's shape (``TOKEN_RE``), else None."""
    return token if token is not None and TOKEN_RE.match(token) else None

PATH_RE = re.compile(rb"^/sandboxes/([^/]{1,256})/ports/([0-9]{1,5})(/[^?#]*)$")
"""Path-routed requests; an id that names no sandbox gets its 404 from the proxy."""
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate",
                        b"proxy-authorization", b"proxy-connection", b"te", b"trailer",
                        b"transfer-encoding", b"upgrade"})
CREDENTIAL_HEADERS = frozenset({b"x-api-key", b"x-access-token", b"e2b-traffic-access-token"})
"""Headers that carry Hangar's credentials (its key; E2B's envd access and traffic tokens):
never passed to a guest. ``Authorization`` is dropped too when it carries one of them
(``hangar.api.proxy.exchange.Exchange.drop``)."""
DROP_FROM_CLIENT = HOP_BY_HOP | CREDENTIAL_HEADERS | {
    b"expect", b"host", b"cookie", b"content-length", b"forwarded",
    b"x-forwarded-for", b"x-forwarded-proto", b"x-forwarded-host", b"x-forwarded-port",
    b"x-forwarded-prefix",
    # the WebSocket handshake's own headers are made anew for the guest's leg
    b"sec-websocket-key", b"sec-websocket-version", b"sec-websocket-extensions",
    b"sec-websocket-protocol", b"sec-websocket-accept",
}


def path_prefix(sandbox_id: str, port: int) -> str:
    """The path under which a port is reached: ``/sandboxes/<id>/ports/<port>``."""
    return f"/sandboxes/{sandbox_id}/ports/{port}"


def host_url(scheme: str, domain: str | None, sandbox_id: str, port: int) -> str | None:
    """``<scheme>://<port>-<id>.<domain>/``, or None without a domain."""
    return f"{scheme}://{port}-{sandbox_id}.{domain}/" if domain else None


@dataclass(frozen=True)
class Target:
    """Where a request goes: a port of a sandbox, and the path the guest's app sees."""

    sandbox_id: str
    port: int
    path: bytes
    """Raw (still percent-encoded) path for the guest, from ``/``."""
    prefix: str | None
    """``X-Forwarded-Prefix`` for path-routed requests; None when host-routed."""
    own_origin: bool = True
    """Whether the answer is served on an origin of the port's own (host-routed) or under
    Hangar's path (path-routed, ``prefix``). False for E2B's ``E2b-Sandbox-Port``, whose
    answers come back on whatever host the client named (Hangar's API host too): they
    are filtered as path-routed ones are, and carry no cookie (``origin.filter_headers``)."""


def header(scope: Scope, name: bytes) -> bytes | None:
    for k, v in scope.get("headers", ()):
        if k == name:
            return bytes(v)
    return None


def _host_pattern(domain: str) -> re.Pattern[str]:
    return re.compile(r"^([0-9]{1,5})-([a-z0-9_-]{1,64})\." + re.escape(domain.lower()) + "$")


def route(scope: Scope, domain: str | None) -> Target | None:
    """The exposed port a request is for, or None when it is one of the API's own."""
    raw = scope.get("raw_path") or scope.get("path", "").encode("utf-8", "surrogateescape")
    if domain:
        host = (header(scope, b"host") or b"").decode("latin-1").strip().lower()
        if ":" not in domain:
            host = host.rsplit(":", 1)[0] if not host.endswith("]") else host
        m = _host_pattern(domain).match(host)
        # 49983 is E2B's envd, which Hangar serves itself (hangar.api.e2b_hosts)
        if m is not None and int(m.group(1)) != e2b.ENVD_PORT:
            return Target(m.group(2), int(m.group(1)), raw or b"/", None)
    m2 = PATH_RE.match(raw)
    if m2 is None:
        return None
    sid, port = m2.group(1).decode("latin-1"), int(m2.group(2))
    return Target(sid, port, m2.group(3), path_prefix(sid, port))


def split_query(scope: Scope) -> tuple[bytes, str | None]:
    """(query string without ``TOKEN_PARAM``, the token it carried)."""
    token = None
    kept: list[bytes] = []
    for part in bytes(scope.get("query_string", b"")).split(b"&"):
        if not part:
            continue
        name, _, value = part.partition(b"=")
        if unquote(name.decode("latin-1")) == TOKEN_PARAM:
            token = unquote(value.decode("latin-1"))
        else:
            kept.append(part)
    return b"&".join(kept), token


COOKIES_TRIED = 4
"""Most token cookie values of one request that are tried (under ``COOKIE``, a page of
another port of the same site may have tossed some in beside the browser's own)."""
_OWS = " \t"
"""Whitespace around a cookie pair, as browsers trim it (``str.strip()`` would also take
non-ASCII spaces of the latin-1 text: a name the browser saw as another one would be ours)."""


def cookie_name(target: Target, scheme: str) -> str:
    """The name a request's port token cookie has: ``HOST_COOKIE`` for a host-routed
    ``target`` over HTTPS (``scheme`` ``https`` or ``wss``), else ``COOKIE``."""
    return HOST_COOKIE if target.prefix is None and scheme in ("https", "wss") else COOKIE


def split_cookies(scope: Scope, target: Target) -> tuple[bytes | None, list[str]]:
    """(the Cookie header without either token cookie (``TOKEN_COOKIES``), or None when
    empty; the values of the one ``cookie_name`` gives for this request, at most
    ``COOKIES_TRIED``, in the order sent)."""
    wanted = cookie_name(target, str(scope.get("scheme") or "http"))
    tokens: list[str] = []
    kept: list[str] = []
    for k, v in scope.get("headers", ()):
        if k != b"cookie":
            continue
        for part in bytes(v).decode("latin-1").split(";"):
            part = part.strip(_OWS)
            name, _, value = part.partition("=")
            name = name.strip(_OWS)
            if name == wanted:
                if len(tokens) < COOKIES_TRIED:
                    tokens.append(value.strip(_OWS))
            elif name not in TOKEN_COOKIES and part:
                kept.append(part)
    return ("; ".join(kept).encode("latin-1") if kept else None), tokens


def connection_tokens(headers: Any) -> set[bytes]:
    """Header names a ``Connection`` header lists (also hop-by-hop)."""
    out: set[bytes] = set()
    for k, v in headers:
        if bytes(k).lower() == b"connection":
            out |= {t.strip().lower() for t in bytes(v).split(b",") if t.strip()}
    return out


def guest_headers(scope: Scope, target: Target, cookie: bytes | None,
                  also_drop: frozenset[bytes] = frozenset(),
                  host_as: bytes | None = None) -> list[tuple[bytes, bytes]]:
    """The client's headers as the guest gets them (see the module docstring), without
    ``also_drop`` (lower-case names), with ``Host`` ``host_as`` when given (E2B's
    ``maskRequestHost``; ``X-Forwarded-Host`` keeps the client's); no framing."""
    drop = DROP_FROM_CLIENT | also_drop | connection_tokens(scope.get("headers", ()))
    out = [(bytes(k), bytes(v)) for k, v in scope.get("headers", ()) if k not in drop]
    host = header(scope, b"host") or b"localhost"
    client = scope.get("client")
    given = str(scope.get("scheme") or "http")
    scheme = {"ws": "http", "wss": "https"}.get(given, given)
    out.insert(0, (b"host", host_as or host))
    if cookie:
        out.append((b"cookie", cookie))
    if client:
        out.append((b"x-forwarded-for", str(client[0]).encode()))
    out += [(b"x-forwarded-proto", scheme.encode()), (b"x-forwarded-host", host)]
    if target.prefix is not None:
        out.append((b"x-forwarded-prefix", target.prefix.encode()))
    return out


def token_cookie(token: str, expires: int, target: Target, scheme: str) -> tuple[bytes, bytes]:
    """``Set-Cookie`` that keeps ``token`` for the rest of a browser's visit, named by
    ``cookie_name``: path-scoped to the prefix (path-routed) or ``Path=/`` with no
    ``Domain`` (host-only); ``Secure`` over HTTPS (always so for ``HOST_COOKIE``)."""
    path = f"{target.prefix}/" if target.prefix is not None else "/"
    max_age = max(0, math.floor(expires - time.time()))
    secure = "; Secure" if scheme in ("https", "wss") else ""
    return (b"set-cookie", f"{cookie_name(target, scheme)}={token}; Path={path}; "
                           f"Max-Age={max_age}; HttpOnly; SameSite=Lax{secure}".encode())
