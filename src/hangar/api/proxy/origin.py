"""What a path-routed guest answer may not do on Hangar's own origin.

A port reached by path (``/sandboxes/{id}/ports/{port}/...``) is served on the
API's origin: the dashboard (``/ui/``), the API and every other path-routed port
share it. A hostile guest page there could register a service worker over the
whole origin, set cookies for other paths, clear the origin's storage or script
the dashboard. So its answer's headers are filtered (``filter_headers``):

=============================  =====================================================
``Service-Worker-Allowed``     dropped: a worker's scope stays under the script's own
                               path (inside the port's prefix)
``Clear-Site-Data``            dropped: it would clear the dashboard's storage too
``Set-Cookie``                 kept only inside the prefix: an absolute ``Path`` gets
                               the prefix in front (as ``Location`` does), a missing
                               one becomes the prefix; a ``Domain`` attribute, a
                               relative or ``..`` path drop the cookie
=============================  =====================================================

and, unless the operator opts out (``HANGAR_PORT_PATH_SANDBOX=0``,
``Settings.port_path_sandbox``), the answer gets ``SANDBOX_CSP``: a
``Content-Security-Policy`` ``sandbox`` without ``allow-same-origin``, so the
browser runs the page in an opaque origin. Its scripts run, but read no cookie
or storage of Hangar's origin, register no service worker and cannot script
the dashboard or other ports' pages. Apps that need their own origin (their
own cookies from script, service workers, same-origin fetches with cookies)
are served on host-routed URLs (``HANGAR_DOMAIN``): each port an origin of its
own, where none of this applies but one rule: every ``{port}-{id}.<domain>`` is
one *site*, so a ``Set-Cookie`` with a ``Domain`` attribute (it would reach other
sandboxes' ports: cookie tossing) is dropped (``host_cookie``). Under both
routings a guest never sets Hangar's port-token cookie under either name
(``hangar_port_token``, ``__Host-hangar_port_token``; compared without regard to
case). A page's script can still toss a ``hangar_port_token`` cookie for the
whole domain, so over HTTPS a host-routed port's token lives in the
``__Host-`` one, which browsers let no other host set, and the unprefixed one
is not read there (``hangar.api.proxy.routing.cookie_name``). docs/security.md,
class 5.
"""

from __future__ import annotations

import re

from hangar.api.proxy.routing import TOKEN_COOKIES, Target

__all__ = ["DROP_FROM_GUEST", "SANDBOX_CSP", "filter_headers", "host_cookie", "scoped_cookie"]

DROP_FROM_GUEST = frozenset({b"service-worker-allowed", b"clear-site-data"})
"""Response headers of a path-routed guest answer never passed to the client."""
SANDBOX_CSP = (b"sandbox allow-scripts allow-forms allow-popups "
               b"allow-popups-to-escape-sandbox allow-modals allow-downloads")
"""The ``Content-Security-Policy`` path-routed guest pages get: every sandbox freedom a
web app commonly needs but ``allow-same-origin`` (and top navigation)."""
_ATTR = re.compile(r"^\s*([A-Za-z-]+)\s*(?:=(.*))?$")
_OURS = frozenset(n.lower() for n in TOKEN_COOKIES)


def _ours(value: bytes) -> bool:
    """Whether a ``Set-Cookie`` value sets one of Hangar's token cookies (either name, any
    case: browsers match the ``__Host-`` prefix without regard to case)."""
    return value.decode("latin-1").partition("=")[0].strip().lower() in _OURS


def scoped_cookie(value: bytes, prefix: str) -> bytes | None:
    """A guest's ``Set-Cookie`` value kept inside ``prefix`` (see the module docstring), or
    None when it cannot be (it is then dropped)."""
    text = value.decode("latin-1")
    first, *attrs = text.split(";")
    kept: list[str] = [first]
    path: str | None = None
    for attr in attrs:
        m = _ATTR.match(attr)
        name = m.group(1).lower() if m else ""
        if name == "domain":
            return None
        if name == "path":
            path = (m.group(2) or "").strip() if m else ""
            continue
        kept.append(attr)
    if path is None or path == "":
        scoped = prefix + "/"
    elif not path.startswith("/") or ".." in path.split("/") or "%" in path or "\\" in path:
        return None
    elif path == prefix or path.startswith(prefix + "/"):
        scoped = path  # the app knows its prefix (X-Forwarded-Prefix)
    else:
        scoped = prefix + path
    kept.append(f" Path={scoped}")
    return ";".join(kept).encode("latin-1")


def host_cookie(value: bytes) -> bool:
    """Whether a host-routed guest's ``Set-Cookie`` value may pass: not one with a
    ``Domain`` attribute (every ``{port}-{id}.<domain>`` is one site: such a cookie would
    reach other sandboxes' ports) and not one of Hangar's token cookie names."""
    if _ours(value):
        return False
    _, *attrs = value.decode("latin-1").split(";")
    return not any((m := _ATTR.match(a)) is not None and m.group(1).lower() == "domain"
                   for a in attrs)


def filter_headers(headers: list[tuple[bytes, bytes]], target: Target,
                   sandbox: bool) -> list[tuple[bytes, bytes]]:
    """``headers`` (lower-case names) of a guest's answer as the client gets them: for a
    host-routed ``target`` (its own origin, one site with every other port) only cookies
    that stay on its host (``host_cookie``); for a path-routed one, filtered and, when
    ``sandbox``, with ``SANDBOX_CSP`` added. Under both, no cookie of Hangar's token
    cookie names (``TOKEN_COOKIES``). A target on no origin of its own
    (``Target.own_origin`` false: E2B's ``E2b-Sandbox-Port``) is filtered as a path-routed
    one, with ``SANDBOX_CSP`` and no cookie at all (review 29e L3)."""
    prefix = target.prefix
    if prefix is None and target.own_origin:
        return [(k, v) for k, v in headers if k != b"set-cookie" or host_cookie(v)]
    out: list[tuple[bytes, bytes]] = []
    for k, v in headers:
        if k in DROP_FROM_GUEST:
            continue
        if k == b"set-cookie":
            scoped = None if prefix is None or _ours(v) else scoped_cookie(v, prefix)
            if scoped is None:
                continue
            v = scoped
        out.append((k, v))
    if sandbox or not target.own_origin:
        out.append((b"content-security-policy", SANDBOX_CSP))
    return out
