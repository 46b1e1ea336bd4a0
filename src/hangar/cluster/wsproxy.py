"""Relay one WebSocket to another node, frame by frame (the gateway's WebSocket half).

The upgrade is first tried on the owner node with the client's headers
(API key, Origin, Host, subprotocols); a refusal there (401, 404, 409,
503...) is passed back to the client as the same HTTP answer before any
upgrade (the ASGI WebSocket denial response), so a client sees exactly
what the owner said. Once the owner accepts, the client's upgrade is
accepted with the subprotocol the owner chose, and binary and text
frames flow both ways until either side closes; the close code is passed
on. PTY, VNC, tunnels and any WebSocket route added later go through
this one path.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException

from hangar.core.service import race
from hangar.error_body import render

log = logging.getLogger("hangar.cluster.ws")

WS_MAX_MESSAGE = 16 << 20
"""Largest message relayed from the owner node, bytes: the nodes' own limit for a guest's
messages (``hangar.api.proxy.websocket.WS_MAX_MESSAGE``; the cluster imports no api)."""
RELAY_QUEUE = 1
"""Frames from the owner node held here before its connection stops being read: each may
be a whole message of up to ``WS_MAX_MESSAGE``, counted by no node's budget (the owner's
is freed once a message leaves it), so a client that reads nothing holds at most about
two here (review 29j J-H5: with the library's 16, about 270 MiB a connection)."""
SKIP = {"sec-websocket-key", "sec-websocket-version", "sec-websocket-extensions",
        "sec-websocket-protocol", "origin", "host"}


async def relay(scope: dict[str, Any], receive: Any, send: Any, url: str,
                headers: list[tuple[str, str]]) -> None:
    """Relay the client's WebSocket (``scope``) to ``url`` (``ws://node/path?query``)."""
    msg = await receive()
    if msg["type"] != "websocket.connect":
        return
    protocols = [p for p in scope.get("subprotocols") or []]
    hdrs = {k: v for k, v in headers if k not in SKIP}
    origin = next((v for k, v in headers if k == "origin"), None)
    try:
        upstream = await connect(url, additional_headers=hdrs, subprotocols=protocols or None,
                                 origin=origin, open_timeout=10, max_size=WS_MAX_MESSAGE,
                                 max_queue=RELAY_QUEUE, ping_interval=None,
                                 compression=None)  # type: ignore[arg-type]
    except InvalidStatus as exc:
        resp = exc.response
        await send({"type": "websocket.http.response.start", "status": resp.status_code,
                    "headers": [(k.lower().encode(), v.encode("latin-1"))
                                for k, v in resp.headers.raw_items()
                                if k.lower() in ("content-type", "retry-after")]})
        await send({"type": "websocket.http.response.body", "body": resp.body or b""})
        return
    except (OSError, WebSocketException, asyncio.TimeoutError) as exc:
        log.warning("WebSocket relay could not connect", extra={"url": url.split("?")[0],
                                                                "error": repr(exc)})
        status, headers, body = render(503, "unavailable", "the owner node did not answer; "
                                       "retry", retry_after=2)
        await send({"type": "websocket.http.response.start", "status": status,
                    "headers": headers})
        await send({"type": "websocket.http.response.body", "body": body})
        return
    await send({"type": "websocket.accept", "subprotocol": upstream.subprotocol})
    close = {"code": 1000, "reason": ""}

    async def client_to_node() -> None:
        while True:
            m = await receive()
            if m["type"] == "websocket.disconnect":
                close["code"] = m.get("code", 1000)
                return
            data = m.get("bytes")
            await upstream.send(data if data is not None else m.get("text", ""))

    async def node_to_client() -> None:
        try:
            async for frame in upstream:
                if isinstance(frame, bytes):
                    await send({"type": "websocket.send", "bytes": frame})
                else:
                    await send({"type": "websocket.send", "text": frame})
        except ConnectionClosed:
            pass
        rcvd = upstream.close_code
        if rcvd is not None:
            close.update(code=rcvd, reason=upstream.close_reason or "")

    from_node = asyncio.create_task(node_to_client())
    try:
        if from_node in await race([asyncio.create_task(client_to_node()), from_node]):
            try:
                await send({"type": "websocket.close", "code": close["code"] if close["code"]
                            not in (1005, 1006) else 1000, "reason": close["reason"]})
            except (RuntimeError, OSError):
                pass
    finally:
        await upstream.close()
