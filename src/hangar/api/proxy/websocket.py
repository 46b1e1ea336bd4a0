"""A WebSocket forwarded to a guest's port: ``websockets``' sans-I/O client protocol on
the guest's leg (never compressed); the handshake's answer relayed (a refusal too),
then messages both ways, pings answered, closes passed on with their code."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from starlette.types import Message
from websockets.client import ClientProtocol
from websockets.frames import Close, Opcode
from websockets.http11 import Response as WsResponse
from websockets.protocol import State as WsState
from websockets.uri import WebSocketURI

from hangar.api.proxy.budget import MessageBudget, budget_of
from hangar.api.proxy.exchange import Exchange, Refused
from hangar.api.proxy.origin import filter_headers
from hangar.api.proxy.routing import HOP_BY_HOP, guest_headers, header
from hangar.core.service import Tunnel, race
from hangar.errors import HangarError

log = logging.getLogger("hangar.proxy")

WS_MAX_MESSAGE = 16 * 1024 * 1024
"""Largest WebSocket message taken from a guest, bytes (uvicorn's default for clients). The
bytes held for clients are bounded per sandbox and in all too (``budget``)."""
PARSE_SLICE = 8 << 10
"""Bytes of a guest's stream parsed at once: a tunnel chunk (64 KiB) of empty frames takes
``websockets`` about 0.12 s to parse here, an 8 KiB slice about 15 ms."""
YIELD_EVERY = 64
"""Frames relayed to the client between two turns of the event loop."""


class WebSocketExchange(Exchange):
    accepted = False
    """The client's WebSocket is open: refusals can no longer be HTTP answers."""

    async def run(self) -> None:
        msg = await self.receive()
        if msg["type"] != "websocket.connect":
            return
        try:
            await self.forward(self._relay)
        except Refused as r:
            await self._deny(*r.answer)

    async def _deny(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        if self.accepted:
            return
        if "websocket.http.response" in self.scope.get("extensions", {}):
            await self.send({"type": "websocket.http.response.start", "status": status,
                             "headers": headers})
            await self.send({"type": "websocket.http.response.body", "body": body})
        else:
            await self.send({"type": "websocket.close", "code": 1008})

    def _protocol(self) -> ClientProtocol:
        path, _, query = self.resource().decode("latin-1").partition("?")
        offered = [p.strip() for k, v in self.scope.get("headers", ())
                   if k == b"sec-websocket-protocol"
                   for p in bytes(v).decode("latin-1").split(",") if p.strip()]
        origin = header(self.scope, b"origin")
        proto = ClientProtocol(
            WebSocketURI(False, "localhost", 80, path, query),
            origin=origin.decode("latin-1") if origin else None,  # type: ignore[arg-type]
            subprotocols=offered or None,  # type: ignore[arg-type]
            max_size=WS_MAX_MESSAGE)
        return proto

    async def _relay(self, tunnel: Tunnel) -> None:
        t = self.target
        proto = self._protocol()
        request = proto.connect()
        del request.headers["Host"]
        if "Origin" in request.headers:
            del request.headers["Origin"]
        for k, v in guest_headers(self.scope, t, self.cookie, self.drop, self.host):
            request.headers[k.decode("latin-1")] = v.decode("latin-1")
        proto.send_request(request)
        await self._flush(proto, tunnel)
        response: WsResponse | None = None
        pending: list[Any] = []
        rest = b""  # read, not yet parsed: what follows the answer goes to the relay
        while response is None:
            data = rest or await tunnel.read()
            # a slice at a time: frames may follow the answer in the same read, and the
            # parser runs on through them (review 29h H-H2: 1 MiB of empty frames, 2 s)
            data, rest = data[:PARSE_SLICE], data[PARSE_SLICE:]
            if data:
                proto.receive_data(data)
            else:
                proto.receive_eof()
            for ev in proto.events_received():
                if response is None and isinstance(ev, WsResponse):
                    response = ev
                else:
                    pending.append(ev)
            if response is None and not data:
                raise Refused(502, "bad_gateway", f"port {t.port} of sandbox {t.sandbox_id} "
                              "closed the connection during the WebSocket handshake",
                              sandbox_id=t.sandbox_id, port=t.port)
        if proto.handshake_exc is not None:
            if response.status_code == 101:  # a 101 that breaks the protocol's rules
                raise Refused(502, "bad_gateway", f"port {t.port} of sandbox {t.sandbox_id} "
                              f"refused the WebSocket handshake: {proto.handshake_exc}",
                              sandbox_id=t.sandbox_id, port=t.port)
            headers = filter_headers([(k.lower().encode("latin-1"), v.encode("latin-1"))
                                      for k, v in response.headers.raw_items()
                                      if k.lower().encode("latin-1") not in HOP_BY_HOP],
                                     t, self.m.settings.port_path_sandbox)
            await self._deny(response.status_code, headers, bytes(response.body or b""))
            return
        accept: Message = {"type": "websocket.accept",
                           "subprotocol": response.headers.get("Sec-WebSocket-Protocol"),
                           "headers": [self.new_cookie] if self.new_cookie else []}
        await self.send(accept)
        self.accepted = True
        log.info("websocket opened", extra={"sandbox_id": t.sandbox_id, "port": t.port})
        close = {"code": 1000, "reason": ""}
        try:
            for task in await race([
                    asyncio.create_task(self._to_guest(proto, tunnel)),
                    asyncio.create_task(self._to_client(proto, tunnel, pending, close,
                                                        rest))]):
                exc = task.exception()
                if exc is not None and not isinstance(exc, (HangarError, ConnectionError)):
                    log.warning("websocket relay failed", extra={
                        "sandbox_id": t.sandbox_id, "port": t.port, "error": repr(exc)[:200]})
                    close.update(code=1011, reason="relay error")
        finally:
            try:
                await self.send({"type": "websocket.close", **close})
            except Exception:  # the client is gone already
                pass
            log.info("websocket closed", extra={"sandbox_id": t.sandbox_id, "port": t.port})

    async def _over_budget(self, proto: ClientProtocol, tunnel: Tunnel,
                           close: dict[str, Any]) -> None:
        """The sandbox's budget had no room in time: both legs closed with 1013."""
        close.update(code=1013, reason="the sandbox's WebSocket clients hold too much "
                     "unread data")
        if proto.state is WsState.OPEN:
            proto.send_close(1013)
            await self._flush(proto, tunnel)

    @staticmethod
    async def _flush(proto: ClientProtocol, tunnel: Tunnel) -> None:
        for chunk in proto.data_to_send():
            if chunk:  # b"" asks to end the TCP stream: the tunnel's close does that
                await tunnel.write(chunk)

    async def _to_guest(self, proto: ClientProtocol, tunnel: Tunnel) -> None:
        while True:
            msg = await self.receive()
            if msg["type"] == "websocket.disconnect":
                code = msg.get("code") or 1000
                if proto.state is WsState.OPEN:
                    proto.send_close(code if code in (1000, 1001) or 3000 <= code < 5000
                                     else 1000)
                    await self._flush(proto, tunnel)
                return
            if proto.state is not WsState.OPEN:
                return
            if msg.get("bytes") is not None:
                proto.send_binary(msg["bytes"])
            elif msg.get("text") is not None:
                proto.send_text(msg["text"].encode("utf-8", "surrogatepass"))
            await self._flush(proto, tunnel)

    async def _to_client(self, proto: ClientProtocol, tunnel: Tunnel, pending: list[Any],
                         close: dict[str, Any], backlog: bytes = b"") -> None:
        """Guest to client, message by message; every byte counted in the sandbox's
        ``budget`` from the moment it is parsed (a frame not yet whole too) until the next
        message has been handed on. ``pending``: frames parsed with the handshake's answer;
        ``backlog``: bytes read with it, not yet parsed."""
        budget = budget_of(self.state, self.m.settings)
        # bytes of the message being assembled, of the last one handed on, and of what the
        # parser holds (a frame not yet whole: up to WS_MAX_MESSAGE of it)
        held = [0, 0, 0]
        try:
            await self._relay_to_client(proto, tunnel, pending, close, budget, held,
                                        backlog)
        finally:
            budget.give(self.target.sandbox_id, sum(held))

    async def _relay_to_client(self, proto: ClientProtocol, tunnel: Tunnel,
                               pending: list[Any], close: dict[str, Any], budget: MessageBudget,
                               held: list[int], backlog: bytes = b"") -> None:
        sandbox_id = self.target.sandbox_id
        parts: list[bytes] = []
        kind: Opcode | None = None
        events = pending
        while True:
            for n, frame in enumerate(events, 1):
                if n % YIELD_EVERY == 0:
                    await asyncio.sleep(0)
                if frame.opcode in (Opcode.TEXT, Opcode.BINARY, Opcode.CONT) \
                        and not await budget.take(sandbox_id, len(frame.data)):
                    await self._over_budget(proto, tunnel, close)
                    return
                if frame.opcode in (Opcode.TEXT, Opcode.BINARY, Opcode.CONT):
                    held[0] += len(frame.data)
                if frame.opcode in (Opcode.TEXT, Opcode.BINARY):
                    kind, parts = frame.opcode, [frame.data]
                elif frame.opcode is Opcode.CONT:
                    parts.append(frame.data)
                elif frame.opcode is Opcode.CLOSE:
                    rcvd: Close | None = proto.close_rcvd
                    if rcvd is not None and rcvd.code not in (1005, 1006, 1015):
                        close.update(code=rcvd.code, reason=rcvd.reason)
                    await self._flush(proto, tunnel)
                    return
                else:
                    continue  # ping (answered by the protocol) or pong
                if frame.fin and kind is not None:
                    data = b"".join(parts)
                    if kind is Opcode.TEXT:
                        await self.send({"type": "websocket.send",
                                         "text": data.decode("utf-8", "replace")})
                    else:
                        await self.send({"type": "websocket.send", "bytes": data})
                    # the write buffer drained before this one was written: the last goes
                    budget.give(sandbox_id, held[1])
                    held[1], held[0] = held[0], 0
                    kind, parts = None, []
            await self._flush(proto, tunnel)
            if proto.state is WsState.CLOSED:
                if proto.close_exc is not None and close["code"] == 1000 \
                        and proto.close_code not in (None, 1000, 1005, 1006):
                    close.update(code=proto.close_code or 1011, reason=proto.close_reason or "")
                return
            if backlog:
                await asyncio.sleep(0)  # the rest of a tunnel chunk: let others run first
                data, backlog = backlog, b""
            else:
                data = await tunnel.read()
            if data:
                data, backlog = data[:PARSE_SLICE], data[PARSE_SLICE:]
                if not await budget.take(sandbox_id, len(data)):
                    await self._over_budget(proto, tunnel, close)
                    return
                held[2] += len(data)
                proto.receive_data(data)
            else:
                proto.receive_eof()
                if proto.state is not WsState.CLOSED:
                    close.update(code=1011, reason="the guest closed the connection")
            events = proto.events_received()
            # what the parser no longer holds went into these frames (counted as they are
            # taken above) or was a frame's header or a control frame
            buffered = len(proto.reader.buffer)
            budget.give(sandbox_id, held[2] - buffered)
            held[2] = buffered
