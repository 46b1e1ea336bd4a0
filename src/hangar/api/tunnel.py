"""``/sandboxes/{id}/tunnel/{port}``: a WebSocket that carries raw TCP bytes to a guest port.

Flow::

    client ══WebSocket /sandboxes/{id}/tunnel/{port} (X-API-Key)══► this module
               binary frames both ways                                 │ AgentClient.open_tunnel
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

import asyncio
import logging
from contextlib import AsyncExitStack

from fastapi import APIRouter, WebSocket
from starlette.websockets import WebSocketDisconnect, WebSocketState

from hangar.api.auth import authenticate
from hangar.api.vnc import deny
from hangar.core.sandboxes import SandboxManager
from hangar.errors import HangarError, NotFound

log = logging.getLogger("hangar.tunnel")

router = APIRouter(prefix="/sandboxes", tags=["sandboxes"])


@router.websocket("/{sandbox_id}/tunnel/{port}")
async def tunnel(ws: WebSocket, sandbox_id: str, port: int) -> None:
    """Carry bytes between the WebSocket and ``127.0.0.1:port`` in the guest."""
    try:
        authenticate(ws.app.state, ws.headers.get("x-api-key"),
                     ws.client.host if ws.client else "unknown")
    except HangarError as e:
        await deny(ws, e.status, e.code, e.message)
        return
    if not 0 < port < 65536:
        await deny(ws, 400, "invalid_request", f"port {port} is outside 1..65535")
        return
    m: SandboxManager = ws.app.state.manager
    stack = AsyncExitStack()
    try:
        agent = await stack.enter_async_context(m.using(sandbox_id))
        conn = await agent.open_tunnel(port)
    except HangarError as e:
        await stack.aclose()
        if isinstance(e, NotFound) and e.context.get("guest_code") == "not_found":
            await deny(ws, 503, "unavailable", f"nothing listens on port {port} in sandbox "
                                               f"{sandbox_id}; retry when it does")
        else:
            await deny(ws, e.status, e.code, e.message, e.context.get("retry_after"))
        return
    async with stack:
        try:
            await ws.accept()
        except BaseException:
            await conn.close()
            raise
        log.info("tunnel opened", extra={"sandbox_id": sandbox_id, "port": port})
        counts = {"in": 0, "out": 0}
        close = {"code": 1000, "reason": ""}

        async def client_to_guest() -> None:
            while True:
                msg = await ws.receive()
                if msg["type"] == "websocket.disconnect":
                    return
                data = msg.get("bytes")
                if data is None:
                    close.update(code=1003, reason="a tunnel carries binary frames only")
                    return
                counts["in"] += len(data)
                await conn.write(data)

        async def guest_to_client() -> None:
            while True:
                data = await conn.read()
                if not data:
                    return
                counts["out"] += len(data)
                await ws.send_bytes(data)

        tasks = [asyncio.create_task(client_to_guest()), asyncio.create_task(guest_to_client())]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                exc = task.exception()
                if exc is not None and not isinstance(exc, (WebSocketDisconnect, HangarError,
                                                            ConnectionError, RuntimeError)):
                    log.error("tunnel failed", extra={"sandbox_id": sandbox_id,
                                                      "error": repr(exc)})
                    close.update(code=1011, reason="tunnel error")
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await conn.close()
            if ws.application_state == WebSocketState.CONNECTED \
                    and ws.client_state == WebSocketState.CONNECTED:
                try:
                    await ws.close(**close)  # type: ignore[arg-type]
                except (RuntimeError, ConnectionError):
                    pass
            log.info("tunnel closed", extra={"sandbox_id": sandbox_id, "port": port,
                                             "bytes_in": counts["in"],
                                             "bytes_out": counts["out"]})
