"""Forwarding: serve one request on another node (or here), and the gateway's own answers.

``Forwarder.forward`` streams an HTTP request's body to the owner node and
its answer back, or relays a WebSocket frame by frame (``wsproxy``); served
here (``local``), it calls the app with a ``Placement`` in the scope when the
request is a placed create (``hangar.core.handover.PLACEMENT_SCOPE``).

What travels between nodes: the client's own headers (hop-by-hop ones and
any ``X-Hangar-*`` but ``X-Hangar-Team`` dropped), ``X-Forwarded-For`` with the client's address
appended, ``X-Hangar-Node-Token`` (from the cluster config) that only nodes
know, on every call, and for placements and adoptions ``X-Hangar-Sandbox-Id``
(the claimed id) or ``X-Hangar-Adopt``. ``X-Hangar-Local`` asks a node to answer from its own
records (the parts of a merged list).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote

import httpx

from hangar.cluster.records import NodeInfo
from hangar.cluster.wsproxy import relay
from hangar.core.service import PLACEMENT_SCOPE, Placement
from hangar.error_body import render_error
from hangar.errors import HangarError, Unavailable

H_LOCAL = "x-hangar-local"
H_TOKEN = "x-hangar-node-token"
H_PLACED = "x-hangar-sandbox-id"
H_ADOPT = "x-hangar-adopt"
HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
       "proxy-authorization", "proxy-authenticate", "host", "content-length"}
"""Headers never passed on as they came (``host`` and ``content-length`` are set anew)."""

INTERNAL = "x-hangar-"
"""Headers only nodes set (token, placement, adoption, local lists): a client's own are
dropped before a request is forwarded, so none can ride on the node token."""
H_TEAM = "x-hangar-team"
"""The one client header of that prefix passed on: an operator's key acting for a team
(``hangar.api.team_gate``), which the owner checks again with the key."""


def passed(name: str) -> bool:
    """Whether a client's header ``name`` (lower case) travels with a forwarded request."""
    return name not in HOP and (not name.startswith(INTERNAL) or name == H_TEAM)

Answer = tuple[int, list[tuple[bytes, bytes]], bytes]
"""An answer the gateway makes itself: (status, headers, body)."""


def error_answer(exc: HangarError) -> Answer:
    """The error answer of ``exc`` exactly as the API renders it (``hangar.error_body``:
    JSON body, ``Retry-After`` in whole seconds rounded up, at least 1)."""
    return render_error(exc)


def json_answer(status: int, body: Any) -> Answer:
    return status, [(b"content-type", b"application/json")], json.dumps(body).encode()


async def respond(send: Any, answer: Answer) -> None:
    """Send an HTTP answer."""
    status, headers, body = answer
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def deny_ws(receive: Any, send: Any, answer: Answer) -> None:
    """Refuse a WebSocket upgrade with an HTTP answer (the ASGI denial response)."""
    msg = await receive()
    if msg["type"] != "websocket.connect":
        return
    status, headers, body = answer
    await send({"type": "websocket.http.response.start", "status": status, "headers": headers})
    await send({"type": "websocket.http.response.body", "body": body})


def with_placement(scope: dict[str, Any], sandbox_id: str) -> dict[str, Any]:
    """``scope`` carrying the placement of a create under ``sandbox_id``."""
    return {**scope, PLACEMENT_SCOPE: Placement(sandbox_id)}


def replay(body: bytes) -> Any:
    """An ASGI ``receive`` that gives ``body`` (already read) once, then waits."""
    sent = {"done": False}

    async def receive() -> dict[str, Any]:
        if sent["done"]:
            await asyncio.Event().wait()
        sent["done"] = True
        return {"type": "http.request", "body": body, "more_body": False}

    return receive


def quote_path(path: str) -> str:
    return quote(path, safe="/:@!$&'()*+,;=-._~")


class Forwarder:
    """Sends requests to other nodes (one pooled HTTP client) or into this node's app."""

    def __init__(self, app: Any, name: str, token: Any) -> None:
        self.app = app
        self.name = name
        self.token = token
        """A callable returning the node token (the cluster config is read after start)."""
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=2.0),
                                      limits=httpx.Limits(max_keepalive_connections=64))

    async def forward(self, scope: dict[str, Any], receive: Any, send: Any,
                      headers: dict[str, str], node: NodeInfo | None,
                      extra: dict[str, str] | None = None, local: bool = False) -> int:
        """Serve the request on ``node`` (or here, ``local``); returns the answer's status.
        Raises Unavailable (503, retryable) when the node does not answer."""
        extra = extra or {}
        if local or node is None or node.name == self.name:
            return await self._here(scope, receive, send, extra)
        hdrs = [(k, v) for k, v in headers.items()
                if passed(k)]
        client = scope.get("client")
        if client:
            prior = headers.get("x-forwarded-for")
            hdrs = [(k, v) for k, v in hdrs if k != "x-forwarded-for"]
            hdrs.append(("x-forwarded-for", f"{prior}, {client[0]}" if prior else client[0]))
        hdrs += list(extra.items())
        if self.token():  # every call between nodes carries the token (gateway.node_token)
            hdrs.append((H_TOKEN, self.token()))
        if "host" in headers:
            hdrs.append(("host", headers["host"]))
        qs = scope.get("query_string", b"").decode()
        target = f"{node.url}{quote_path(scope['path'])}" + (f"?{qs}" if qs else "")
        if scope["type"] == "websocket":
            await relay(scope, receive, send, target.replace("http://", "ws://", 1), hdrs)
            return 101
        if "content-length" in headers:
            hdrs.append(("content-length", headers["content-length"]))
        return await self._http(scope, receive, send, hdrs, target, node)

    async def _here(self, scope: dict[str, Any], receive: Any, send: Any,
                    extra: dict[str, str]) -> int:
        status = {"code": 0}

        async def send_status(msg: dict[str, Any]) -> None:
            if msg["type"] == "http.response.start":
                status["code"] = msg["status"]
            await send(msg)

        if H_PLACED in extra:
            scope = with_placement(scope, extra[H_PLACED])
        await self.app(scope, receive, send_status)
        return status["code"]

    async def _http(self, scope: dict[str, Any], receive: Any, send: Any,
                    hdrs: list[tuple[str, str]], target: str, node: NodeInfo) -> int:
        async def body() -> AsyncIterator[bytes]:
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    return
                chunk = msg.get("body", b"")
                if chunk:
                    yield chunk
                if not msg.get("more_body"):
                    return

        method = scope["method"]
        has_body = method in ("POST", "PUT", "PATCH", "DELETE")
        req = self.http.build_request(method, target, headers=hdrs,
                                      content=body() if has_body else None)
        try:
            resp = await self.http.send(req, stream=True)
        except httpx.HTTPError as exc:
            raise Unavailable(f"node {node.name} ({node.address}) did not answer: "
                              f"{type(exc).__name__}; retry", node=node.name,
                              retry_after=2) from None
        try:
            out = [(k.encode(), v.encode("latin-1")) for k, v in resp.headers.multi_items()
                   if k.lower() not in HOP or k.lower() == "content-length"]
            await send({"type": "http.response.start", "status": resp.status_code,
                        "headers": out})
            async for chunk in resp.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await resp.aclose()
        return resp.status_code

    async def close(self) -> None:
        await self.http.aclose()
