"""What both kinds of forwarded request share: the admission check (exposure,
key or token), the tunnel to the guest's port, and Hangar's own answers (``Refused``).

A token comes from the query (``hangar_token``) or the request's token cookie, whose name
``hangar.api.proxy.routing.cookie_name`` gives: ``__Host-hangar_port_token`` on a
host-routed port over HTTPS (no sibling host can toss one), ``hangar_port_token``
elsewhere."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.types import Receive, Scope, Send

from hangar.api.auth import authenticate
from hangar.api.errors import render, render_error
from hangar.api.proxy.routing import (
    Target, header, split_cookies, split_query, token_cookie, well_formed,
)
from hangar.core.service import Exposure, NoListener, SandboxManager, Tunnel, e2b
from hangar.errors import HangarError, NotFound, Unauthorized


class Refused(Exception):
    """An answer of Hangar itself instead of the guest's (status, headers, body)."""

    def __init__(self, status: int, code: str, message: str, **context: Any) -> None:
        super().__init__(message)
        self.answer = render(status, code, message, **context)

    @classmethod
    def of(cls, exc: HangarError) -> "Refused":
        r = cls(exc.status, exc.code, exc.message)
        r.answer = render_error(exc)
        return r


class Exchange:
    """What both kinds of forwarded request share: checks, credentials, the tunnel."""

    def __init__(self, scope: Scope, receive: Receive, send: Send, target: Target,
                 manager: SandboxManager, state: Any) -> None:
        self.scope = scope
        self.receive = receive
        self.send = send
        self.target = target
        self.m = manager
        self.state = state
        self.query, self.query_token = split_query(scope)
        self.cookie, self.cookie_tokens = split_cookies(scope, target)
        self.new_cookie: tuple[bytes, bytes] | None = None
        self.host: bytes | None = None
        """The ``Host`` the guest gets instead of the client's (E2B's
        ``network.maskRequestHost``: ``hangar.core.e2b.request_host``), once admitted."""
        self._drop: frozenset[bytes] | None = None

    @property
    def drop(self) -> frozenset[bytes]:
        """Headers of this request never passed to the guest beyond ``DROP_FROM_CLIENT``:
        ``Authorization`` (and ``Proxy-Authorization``, hop-by-hop anyway) when it carries
        a credential of Hangar's (``hangar_credential``)."""
        if self._drop is None:  # every Authorization header, not the first alone (29g L1)
            ours = any(self.hangar_credential(bytes(v)) for k, v in self.scope.get("headers", ())
                       if k == b"authorization")
            self._drop = frozenset({b"authorization"}) if ours else frozenset()
        return self._drop

    def hangar_credential(self, value: bytes) -> bool:
        """Whether an ``Authorization`` value carries a credential of Hangar's: an API key
        its key ring accepts, the target sandbox's E2B access or traffic token, or the
        port token of this request, as a ``Bearer`` token, a ``Basic`` user or password,
        or the bare value."""
        text = value.decode("latin-1").strip()
        scheme, _, rest = text.partition(" ")
        candidates = {text, rest.strip()}
        if scheme.lower() == "basic":
            try:
                user, _, password = base64.b64decode(rest.strip(), validate=True) \
                    .decode("latin-1").partition(":")
                candidates |= {user, password}
            except (binascii.Error, ValueError):
                pass
        candidates.discard("")
        t = self.target
        known = {self.query_token, *self.cookie_tokens,
                 e2b.access_token(self.m, t.sandbox_id), e2b.traffic_token(self.m, t.sandbox_id)}
        if candidates & {k for k in known if k}:
            return True
        ring = getattr(self.state, "keys", None)
        return ring is not None and any(ring.match(c) is not None for c in candidates)

    def admit(self) -> Exposure:
        """The exposure, once the request may use it. Raises ``Refused``."""
        t = self.target
        given = bool(self.query_token or self.cookie_tokens)
        query_token = well_formed(self.query_token)
        try:
            exposure = self.m.ports.get(t.sandbox_id, t.port)
        except NotFound as exc:
            exposure = self._e2b_url(exc)
        except HangarError as exc:
            raise Refused.of(exc) from None
        if exposure.public:
            return exposure
        key = header(self.scope, b"x-api-key")
        if key:
            client = self.scope.get("client")
            try:
                authenticate(self.state, key.decode("latin-1"), client[0] if client else "unknown")
            except HangarError as exc:
                raise Refused.of(exc) from None
            return exposure
        if query_token and self.m.ports.allows(exposure, query_token):
            expires = int(query_token.partition(".")[0])
            self.new_cookie = token_cookie(query_token, expires, t, self.scope.get("scheme", ""))
            return exposure
        for cookie_token in self.cookie_tokens:  # each sent under the name, not only the last
            ok = well_formed(cookie_token)
            if ok and self.m.ports.allows(exposure, ok):
                self._cookie_from_its_own()
                return exposure
        why = "is expired or not valid for it" if given else "is missing"
        raise Refused.of(Unauthorized(
            f"port {t.port} of sandbox {t.sandbox_id} is private and the token {why}: send "
            f"X-API-Key, or open its signed URL (GET /sandboxes/{t.sandbox_id}/ports/{t.port} "
            "gives one)", sandbox_id=t.sandbox_id, port=t.port))

    def _cookie_from_its_own(self) -> None:
        """A host-routed port's token cookie is taken only from the port's own pages and
        from top-level GET navigations. Every ``{port}-{id}.<domain>`` is one site, so a
        browser sends the cookie (``SameSite=Lax``) on requests a page of another sandbox's
        port makes (fetches, form posts, frames, WebSockets): with it, that page would read
        and drive this private port (REVIEW29c H5). Browsers mark the request's origin
        (``Origin``, ``Sec-Fetch-*``); a client that sends neither is no browser page.
        Path-routed ports are left as they are: their pages are opaque origins (a
        sandboxing CSP), so their own requests are cross-site. Raises ``Refused`` (403)."""
        if self.target.prefix is not None:
            return
        host = _hostname((header(self.scope, b"host") or b"").decode("latin-1"))
        origin = header(self.scope, b"origin")
        if origin is not None:  # by name: a proxy in front may drop the port from Host
            if _hostname(origin.decode("latin-1").partition("://")[2]) != host:
                raise self._not_own(f"a page of {origin.decode('latin-1')[:200]}")
        site = header(self.scope, b"sec-fetch-site")
        if site is None or site in (b"same-origin", b"none"):
            return
        navigation = header(self.scope, b"sec-fetch-mode") == b"navigate" and \
            header(self.scope, b"sec-fetch-dest") == b"document" and \
            self.scope.get("method", "GET") in ("GET", "HEAD")
        if not navigation:
            raise self._not_own(f"a {site.decode('latin-1')[:40]} page")

    def _not_own(self, who: str) -> Refused:
        t = self.target
        return Refused(403, "forbidden",
                       f"port {t.port} of sandbox {t.sandbox_id} is private: its token cookie "
                       f"is taken only from its own pages and top-level navigations, and this "
                       f"request comes from {who}; send X-API-Key or its signed URL instead",
                       sandbox_id=t.sandbox_id, port=t.port)

    def _e2b_url(self, not_exposed: NotFound) -> Exposure:
        """A port nobody exposed, reached by its host name: open when the sandbox was made
        through E2B's API (``hangar.core.e2b.url_exposure``). Raises ``Refused``."""
        t = self.target
        traffic = header(self.scope, b"e2b-traffic-access-token")
        access = header(self.scope, b"x-access-token")
        try:
            found = (e2b.url_exposure(
                self.m, t.sandbox_id, t.port,
                traffic.decode("latin-1") if traffic else None,
                access.decode("latin-1") if access else None,
                str(self.scope.get("method", "GET")), t.path.decode("latin-1"))
                if t.prefix is None else None)
        except HangarError as exc:
            raise Refused.of(exc) from None
        if found is None:
            raise Refused.of(not_exposed) from None
        self.host = e2b.request_host(self.m, t.sandbox_id, t.port)
        return found

    def resource(self) -> bytes:
        """Path and query the guest gets."""
        return self.target.path + (b"?" + self.query if self.query else b"")

    async def forward(self, use: Callable[[Tunnel], Awaitable[None]]) -> None:
        """Admit the request, open a tunnel to the port and run ``use`` on it.

        Raises ``Refused``."""
        t = self.target
        self.admit()
        try:
            # Capped per port and per sandbox (429), and never busy: a connection holds no
            # snapshot or sleep off (``hangar.core.ports``).
            with self.m.ports.connection(t.sandbox_id, t.port):
                async with self.m.tunnel(t.sandbox_id, t.port, busy=False) as tunnel:
                    await use(tunnel)
        except NoListener:
            raise Refused(502, "bad_gateway", f"nothing listens on port {t.port} in sandbox "
                          f"{t.sandbox_id}", sandbox_id=t.sandbox_id, port=t.port) from None
        except HangarError as exc:
            raise Refused.of(exc) from None


def _hostname(netloc: str) -> str:
    """``netloc``'s host name, lowercased, without a port (``[v6]`` kept whole)."""
    netloc = netloc.strip().lower()
    if netloc.startswith("["):
        return netloc.partition("]")[0] + "]"
    return netloc.partition(":")[0]
