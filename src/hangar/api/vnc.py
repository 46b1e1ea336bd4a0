"""Live desktop: VNC tickets and the WebSocket that carries RFB to a sandbox.

Flow::

    browser ──POST /sandboxes/{id}/vnc/tickets (X-API-Key)──► {"ticket": ...}
    browser ══WebSocket /sandboxes/{id}/vnc?ticket=...═══════► this module
                 binary frames, subprotocol "binary"               │ Desktop.vnc (a tunnel to 5900)
                                                                   ▼
                                                 guest: x11vnc on 127.0.0.1:5900

Security model:

* The API key never appears in a URL: the browser trades it for a
  single-use ticket of scope ``vnc`` (``hangar.api.tickets``: tickets,
  the Origin check, 403 and 401 refusals), then 404/409/410 for a sandbox
  that is gone, not running or has no desktop.
* x11vnc in the guest has no password and listens on the guest's loopback
  only (see ``hangar.guest.desktop``); the ticket is the authentication.
  Every viewer gets its own tunnel and x11vnc connection (x11vnc runs
  ``-shared``), and the proxy forces the shared flag of ClientInit to 1 so
  no viewer can disconnect the others.
* **View-only** viewers (``view_only: true`` on the ticket) are enforced
  here, not trusted to the browser: the proxy parses every client→server
  RFB message and drops input (``RfbClientFilter``).
* **Bounds** for every viewer: a message is relayed as its bytes arrive, never held
  whole, and a ClientCutText over 1 MiB or a SetEncodings over 256 encodings closes
  the connection (1008) on its header (``RfbClientFilter``).
* Keepalive: uvicorn pings every WebSocket every ``ws_ping_interval``
  seconds (default 20) and closes it when no pong comes within
  ``ws_ping_timeout``; browsers answer pings by themselves, so idle viewers
  stay connected and dead ones are noticed.
"""

from __future__ import annotations

import logging
import struct
from contextlib import AsyncExitStack
from typing import Annotated, ClassVar

from fastapi import APIRouter, Depends, Request, WebSocket
from pydantic import ConfigDict, Field

from hangar.api.deps import manager
from hangar.api.models import RequestBody
from hangar.api.tickets import (  # noqa: F401  (re-exported: vnc.TicketBook, vnc.deny)
    ORIGINS_ENV, TICKET_TTL_S, Ticket, TicketBook, admit, allowed_origins, deny, deny_error,
    tickets,
)
from hangar.api.wspump import ByteStream, Refuse, pump_stream
from hangar.core.service import (  # noqa: F401  (VNC_PORT re-exported)
    VNC_PORT, NoListener, SandboxManager,
)
from hangar.errors import HangarError
from hangar.schemas import VncTicket as TicketResponse

log = logging.getLogger("hangar.vnc")

VNC_READY_TIMEOUT_S = 60.0
"""Seconds an upgrade waits for x11vnc in a freshly booted sandbox."""

router = APIRouter(prefix="/sandboxes", tags=["desktop"])
"""Routes that need the API key (the ticket issuer)."""
ws_router = APIRouter(prefix="/sandboxes", tags=["desktop"])
"""The WebSocket route, authenticated by ticket instead of key."""


class TicketRequest(RequestBody):
    model_config = ConfigDict(extra="forbid")

    view_only: bool = Field(False, description="The viewer sees the screen but cannot type, "
                                               "point or paste.")


@router.post("/{sandbox_id}/vnc/tickets", response_model=TicketResponse, status_code=201,
             summary="Get a single-use ticket (valid 30 s) for the live desktop WebSocket")
async def create_ticket(sandbox_id: str, request: Request,
                        m: Annotated[SandboxManager, Depends(manager)],
                        body: TicketRequest | None = None) -> TicketResponse:
    m.desktop.screen(sandbox_id)  # 404 / 409 now rather than at the upgrade
    body = body or TicketRequest()
    token, t = tickets(request.app).issue(sandbox_id, body.view_only)
    return TicketResponse(ticket=token, view_only=t.view_only, expires_at=t.expires_at,
                          expires_in_s=TICKET_TTL_S,
                          url=f"/sandboxes/{sandbox_id}/vnc?ticket={token}")


# ---------------------------------------------------------------------------------------------
# RFB parsing for view-only viewers


class RfbViolation(Exception):
    """The client sent something the proxy will not forward; the connection ends."""


class RfbClientFilter:
    """Follows the client→server half of an RFB session and filters it.

    Handshake (RFB 3.7/3.8, RFC 6143 §7.1-7.3), client side only::

        ProtocolVersion   12 bytes "RFB 003.00N\\n"; only 3.7 and 3.8 are accepted
                          (in 3.3 the server picks the security type, which
                          this half of the stream does not show)
        security type     1 byte: 1 (None) or 2 (VNC authentication); others refused
        VNC auth response 16 bytes, after type 2 only
        ClientInit        1 byte shared-flag: rewritten to 1 (shared) for everyone

    After the handshake every viewer's bytes are cut into messages by type (first
    byte); lengths per RFC 6143 §7.5 and the registered extensions noVNC may send.
    A message is forwarded (or, for a view-only viewer's input, dropped) as its bytes
    arrive once its header is read: the filter never holds more than one header
    (at most 12 bytes) beyond the WebSocket message it was given. Bounds, checked on
    the header, close the connection (``RfbViolation``) for everyone: ClientCutText
    longer than ``MAX_CUT_TEXT`` (1 MiB), SetEncodings with more than
    ``MAX_ENCODINGS`` (256) encodings.

        type  message                    length (bytes)            view-only
        0     SetPixelFormat             20                        pass
        2     SetEncodings               4 + 4 * u16 at [2:4]      pass
        3     FramebufferUpdateRequest   10                        pass
        4     KeyEvent                   8                         drop
        5     PointerEvent               6                         drop
        6     ClientCutText              8 + |s32 at [4:8]|        drop
        150   EnableContinuousUpdates    10                        pass
        248   ClientFence                9 + u8 at [8]             pass
        250   xvp (shutdown, reboot)     4                         drop
        251   SetDesktopSize             8 + 16 * u8 at [6]        drop
        255   QEMU, subtype 0 (key)      12                        drop

    Any other type (or QEMU subtype) cannot be measured, so a view-only
    connection that sends one is closed (``RfbViolation``): fail closed. An
    interactive viewer's stream passes unparsed from such a message on (what it
    sends is the guest's to judge; nothing of it is held here).
    """

    MAX_CUT_TEXT: ClassVar[int] = 1 << 20
    MAX_ENCODINGS: ClassVar[int] = 256

    PASS: ClassVar[dict[int, int]] = {0: 20, 3: 10, 150: 10}
    DROP_FIXED: ClassVar[dict[int, int]] = {4: 8, 5: 6, 250: 4}

    def __init__(self, view_only: bool) -> None:
        self.view_only = view_only
        self.stage = "version"
        self.buf = bytearray()
        self.dropped = 0
        """Messages dropped so far (input from a view-only viewer)."""
        self.left = 0
        """Bytes of the current message still to come (forwarded or dropped as they do)."""
        self.forwarding = True

    def _message_length(self) -> tuple[int, bool] | None:
        """(length, forward?) of the message at the head of ``buf``; None if more is needed."""
        b = self.buf
        t = b[0]
        keep = not self.view_only
        if t in self.PASS:
            return self.PASS[t], True
        if t in self.DROP_FIXED:
            return self.DROP_FIXED[t], keep
        if t == 2:
            if len(b) < 4:
                return None
            count = struct.unpack_from(">H", b, 2)[0]
            if count > self.MAX_ENCODINGS:
                raise RfbViolation(f"SetEncodings with {count} encodings (at most "
                                   f"{self.MAX_ENCODINGS})")
            return 4 + 4 * count, True
        if t == 6:
            if len(b) < 8:
                return None
            size = abs(struct.unpack_from(">i", b, 4)[0])
            if size > self.MAX_CUT_TEXT:
                raise RfbViolation(f"ClientCutText of {size} bytes (at most "
                                   f"{self.MAX_CUT_TEXT})")
            return 8 + size, keep
        if t == 248:
            return (9 + b[8], True) if len(b) >= 9 else None
        if t == 251:
            return (8 + 16 * b[6], keep) if len(b) >= 8 else None
        if t == 255:
            if len(b) < 2:
                return None
            if b[1] == 0:
                return 12, keep
        if keep:
            return -1, True  # an interactive viewer's unknown message: pass from here on
        raise RfbViolation(f"view-only viewer sent RFB message type {t}, which is not "
                           f"forwarded")

    def feed(self, data: bytes) -> bytes:
        """Bytes from the viewer → the bytes to forward to the server.

        Raises RfbViolation for a handshake the proxy does not support or
        (view-only) a message it cannot measure.
        """
        if self.stage == "pass":
            return data
        self.buf += data
        out = bytearray()
        while self.buf:
            if self.stage == "version":
                if len(self.buf) < 12:
                    break
                version = bytes(self.buf[:12])
                if version not in (b"RFB 003.008\n", b"RFB 003.007\n"):
                    raise RfbViolation(f"unsupported RFB version {version!r} (3.7 or 3.8 only)")
                out += version
                del self.buf[:12]
                self.stage = "security"
            elif self.stage == "security":
                kind = self.buf[0]
                if kind not in (1, 2):
                    raise RfbViolation(f"unsupported RFB security type {kind}")
                out.append(kind)
                del self.buf[:1]
                self.stage = "vncauth" if kind == 2 else "init"
            elif self.stage == "vncauth":
                if len(self.buf) < 16:
                    break
                out += self.buf[:16]
                del self.buf[:16]
                self.stage = "init"
            elif self.stage == "init":
                out.append(1)  # ClientInit: shared
                del self.buf[:1]
                self.stage = "messages"
            elif self.left:  # the rest of a message, as it comes
                n = min(self.left, len(self.buf))
                if self.forwarding:
                    out += self.buf[:n]
                del self.buf[:n]
                self.left -= n
            else:  # the next message's header
                found = self._message_length()
                if found is None:
                    break
                n, forward = found
                if n < 0:
                    self.stage = "pass"
                    out += self.buf
                    self.buf.clear()
                    break
                if not forward:
                    self.dropped += 1
                self.left, self.forwarding = n, forward
        return bytes(out)


# ---------------------------------------------------------------------------------------------
# the WebSocket


@ws_router.websocket("/{sandbox_id}/vnc")
async def vnc(ws: WebSocket, sandbox_id: str, ticket: str | None = None) -> None:
    """Proxy RFB between the viewer and the guest's x11vnc (see the module docstring)."""
    t = await admit(ws, sandbox_id, "vnc", ticket, "POST /sandboxes/{id}/vnc/tickets")
    if t is None:
        return
    m: SandboxManager = ws.app.state.manager
    stack = AsyncExitStack()
    try:
        # Held while the viewer is connected: the sandbox counts as busy, so it is
        # neither put to sleep nor snapshotted under a live viewer.
        tunnel = await stack.enter_async_context(m.desktop.vnc(sandbox_id,
                                                               VNC_READY_TIMEOUT_S))
    except NoListener:
        await deny(ws, 503, "unavailable", "the guest's VNC server is not listening; "
                                           "retry in a few seconds")
        return
    except HangarError as e:
        await deny_error(ws, e)
        return
    async with stack:
        subprotocol = "binary" if "binary" in ws.scope.get("subprotocols", []) else None
        await ws.accept(subprotocol=subprotocol)
        log.info("vnc viewer connected",
                 extra={"sandbox_id": sandbox_id, "view_only": t.view_only})
        await _proxy(ws, tunnel, RfbClientFilter(t.view_only), sandbox_id)


async def _proxy(ws: WebSocket, tunnel: ByteStream, filt: RfbClientFilter,
                 sandbox_id: str) -> None:
    def inbound(data: bytes) -> bytes:
        try:
            return filt.feed(data)
        except RfbViolation as e:
            raise Refuse(1008, str(e)[:120]) from e

    try:
        await pump_stream(ws, tunnel, log=log, failed="vnc proxy failed", reason="proxy error",
                          extra={"sandbox_id": sandbox_id},
                          binary_only="RFB travels in binary frames", inbound=inbound,
                          far_closed=(1011, "the guest's VNC server closed the connection"))
    finally:
        log.info("vnc viewer disconnected", extra={
            "sandbox_id": sandbox_id, "view_only": filt.view_only,
            "dropped_messages": filt.dropped})
