"""``/sandboxes/{id}/tunnel/{port}``: a WebSocket that carries raw TCP bytes to a guest port.

Flow::

    client ══WebSocket /sandboxes/{id}/tunnel/{port} (X-API-Key)══► this module
               binary frames both ways                                 │ SandboxManager.tunnel
                                                                       ▼
                                                  guest: 127.0.0.1:{port}

Used by ``hangar.tools`` to reach Chromium's DevTools port in a browser
sandbox (``hangar.tools.tunnel`` turns it into a local TCP port), and
usable for any other TCP service in a guest.

Rules:

* The key travels in the ``X-API-Key`` header, as on every other keyed
  path; never in the URL. Browsers cannot set that header on a WebSocket,
  so a web page cannot open a tunnel on a user's behalf.
* Refusals are HTTP responses before the upgrade (the ASGI WebSocket
  denial extension) with Hangar's JSON error body: 401 without the key,
  400 for a port outside 1..65535, 404/409/410 for a sandbox that is
  unknown, not running or gone, 503 (retryable) when nothing listens on
  that port in the guest.
* Each WebSocket is one TCP connection in the guest. A close from either
  side ends both; text frames are refused (close 1003).
* While a tunnel is open the sandbox counts as busy: it is neither put to
  sleep nor snapshotted under a live connection.
"""

from __future__ import annotations

import logging
from contextlib import AsyncExitStack

from fastapi import APIRouter, WebSocket

from hangar.api.auth import authenticate
from hangar.api.team_gate import ACT_FOR_HEADER, check_route, team_for
from hangar.api.tickets import deny, deny_error
from hangar.api.wspump import Traffic, pump_stream
from hangar.core.service import NoListener, SandboxManager, act_as
from hangar.errors import HangarError
from hangar.schemas.bounds import PORT_MAX, PORT_MIN

log = logging.getLogger("hangar.tunnel")

router = APIRouter(prefix="/sandboxes", tags=["sandboxes"])


@router.websocket("/{sandbox_id}/tunnel/{port}")
async def tunnel(ws: WebSocket, sandbox_id: str, port: int) -> None:
    """Carry bytes between the WebSocket and ``127.0.0.1:port`` in the guest."""
    try:
        name = authenticate(ws.app.state, ws.headers.get("x-api-key"),
                            ws.client.host if ws.client else "unknown")
        team = team_for(ws.app.state, name, ws.headers.get(ACT_FOR_HEADER))
        act_as(team)  # this connection's task: core scopes what it reaches
        check_route(ws.scope, team)
    except HangarError as e:
        await deny_error(ws, e)
        return
    if not PORT_MIN <= port <= PORT_MAX:
        await deny(ws, 400, "invalid_request", f"port {port} is outside {PORT_MIN}..{PORT_MAX}")
        return
    m: SandboxManager = ws.app.state.manager
    stack = AsyncExitStack()
    try:
        conn = await stack.enter_async_context(m.tunnel(sandbox_id, port))
    except NoListener:
        await deny(ws, 503, "unavailable", f"nothing listens on port {port} in sandbox "
                                           f"{sandbox_id}; retry when it does")
        return
    except HangarError as e:
        await deny_error(ws, e)
        return
    async with stack:
        await ws.accept()
        log.info("tunnel opened", extra={"sandbox_id": sandbox_id, "port": port})
        traffic = Traffic()
        try:
            await pump_stream(ws, conn, log=log, failed="tunnel failed", reason="tunnel error",
                              extra={"sandbox_id": sandbox_id},
                              binary_only="a tunnel carries binary frames only",
                              traffic=traffic)
        finally:
            log.info("tunnel closed", extra={"sandbox_id": sandbox_id, "port": port,
                                             "bytes_in": traffic.bytes_in,
                                             "bytes_out": traffic.bytes_out})
