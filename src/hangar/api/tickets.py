"""Single-use tickets for WebSocket routes a browser opens, and the checks every upgrade makes.

A browser cannot set headers on a WebSocket, so it first trades its key
(the ``X-API-Key`` header on a POST) for a **ticket**: 32 random bytes,
valid for ``TICKET_TTL_S`` seconds, for one sandbox and one *scope* (``vnc``
for the live desktop, ``pty:<session>`` for one terminal session), and
**single use** (redeemed, i.e. deleted, by the first upgrade that shows it,
whatever happens next). Tickets live in this process's memory only, stored
under their SHA-256; the API key never appears in a URL.

Before the ticket, an upgrade is refused with **403** when an ``Origin``
header is present and is not the server's own (``http(s)://`` + the Host
header) or one of ``HANGAR_VNC_ORIGINS`` (comma-separated, e.g. a TLS
proxy's ``https://hangar.example.com``); ``Origin: null`` is refused.
Clients that send no Origin (not browsers) are judged by their ticket
alone. Then **401** for a missing, unknown, expired, reused, other-sandbox
or other-scope ticket. Refusals are real HTTP responses (the ASGI WebSocket
denial response extension) with Hangar's JSON error body.

Used by ``hangar.api.vnc`` and ``hangar.api.pty``.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import time
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, WebSocket

from hangar.api.errors import context_of, error_response
from hangar.errors import HangarError

TICKET_TTL_S = 30.0
"""Seconds a ticket stays valid."""
ORIGINS_ENV = "HANGAR_VNC_ORIGINS"
"""Extra origins allowed to open ticketed WebSockets (the name predates the terminal)."""


@dataclass(frozen=True)
class Ticket:
    sandbox_id: str
    view_only: bool
    expires_at: float
    """Unix time, seconds."""
    scope: str = "vnc"
    """What it opens: ``vnc`` or ``pty:<session id>``."""


class TicketBook:
    """Single-use, short-lived tickets, kept in memory by their SHA-256."""

    def __init__(self, ttl_s: float = TICKET_TTL_S) -> None:
        self.ttl_s = ttl_s
        self._tickets: dict[bytes, Ticket] = {}

    @staticmethod
    def _key(token: str) -> bytes:
        return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()

    def issue(self, sandbox_id: str, view_only: bool, scope: str = "vnc") -> tuple[str, Ticket]:
        """A new ticket (urlsafe text) for one upgrade to ``scope`` of ``sandbox_id``."""
        now = time.time()
        for k in [k for k, t in self._tickets.items() if t.expires_at <= now]:
            del self._tickets[k]
        token = secrets.token_urlsafe(32)
        ticket = Ticket(sandbox_id, view_only, now + self.ttl_s, scope)
        self._tickets[self._key(token)] = ticket
        return token, ticket

    def redeem(self, token: str, sandbox_id: str, scope: str = "vnc") -> Ticket | None:
        """Use up ``token``: its ticket if valid for ``sandbox_id`` and ``scope`` and not
        expired, else None. The ticket is gone afterwards either way."""
        ticket = self._tickets.pop(self._key(token), None)
        if ticket is None or ticket.expires_at <= time.time() \
                or ticket.sandbox_id != sandbox_id or ticket.scope != scope:
            return None
        return ticket


def tickets(app: FastAPI) -> TicketBook:
    """The app's one ticket book."""
    book: TicketBook | None = getattr(app.state, "vnc_tickets", None)
    if book is None:
        book = app.state.vnc_tickets = TicketBook()
    return book


def allowed_origins(ws: WebSocket) -> set[str]:
    """The server's own origins (from the Host header) plus ``HANGAR_VNC_ORIGINS``."""
    host = ws.headers.get("host", "")
    own = {f"http://{host}", f"https://{host}"} if host else set()
    extra = {o.strip().rstrip("/") for o in os.environ.get(ORIGINS_ENV, "").split(",")}
    return {o.lower() for o in own | extra if o}


async def deny(ws: WebSocket, status: int, code: str, message: str, **context: Any) -> None:
    """Refuse an upgrade with an HTTP status and Hangar's JSON error body (``context``
    in it; ``Retry-After`` when it has ``retry_after`` seconds)."""
    if "websocket.http.response" in ws.scope.get("extensions", {}):
        await ws.send_denial_response(error_response(status, code, message, **context))
    else:  # the server cannot send a body: a close before accept is a 403
        await ws.close(code=1008, reason=message[:120])


async def deny_error(ws: WebSocket, exc: HangarError) -> None:
    """Refuse an upgrade with a ``HangarError``'s answer, as a route would give it."""
    await deny(ws, exc.status, exc.code, exc.message, **context_of(exc))


async def admit(ws: WebSocket, sandbox_id: str, scope: str, token: str | None,
                how: str) -> Ticket | None:
    """Check the upgrade's Origin and redeem its ticket; None (refused, answered) or the ticket.

    ``how`` names the route that issues tickets, for the 401 message.
    """
    origin = ws.headers.get("origin")
    if origin is not None and origin.lower().rstrip("/") not in allowed_origins(ws):
        await deny(ws, 403, "forbidden", f"origin {origin[:200]} may not open this WebSocket")
        return None
    if not token:
        await deny(ws, 401, "unauthorized", f"a ticket is needed: {how} with X-API-Key")
        return None
    t = tickets(ws.app).redeem(token, sandbox_id, scope)
    if t is None:
        await deny(ws, 401, "unauthorized", "the ticket is unknown, expired, used or for "
                                            "another sandbox; get a new one")
    return t
