"""Exposed ports: HTTP and WebSocket requests forwarded to a guest's TCP port.

Flow::

    client ──HTTP /sandboxes/{id}/ports/{port}/<path>──────┐  path-routed
    client ──HTTP Host: {port}-{id}.<HANGAR_DOMAIN> /<path>─┤  host-routed (E2B's form)
                                                           ▼
                      PortProxy (outermost ASGI middleware of the app)
                          │ exposure? (hangar.core.ports) → 404
                          │ private: X-API-Key, or a token (?hangar_token= or cookie) → 401
                          │ SandboxManager.tunnel(id, port) (a sleeping sandbox is woken)
                          ▼
                      guest: 127.0.0.1:{port}, one TCP connection per request

The request is re-serialized for the guest with h11 (HTTP/1.1, one request
per connection, ``Connection: close``) and the answer parsed with h11 and
streamed back as it arrives (server-sent events and long downloads pass
through; so does a request body, streamed while the answer may already
come). WebSocket upgrades are carried by ``websockets``' sans-I/O client
protocol on the guest side: the handshake's answer is relayed (a refusal
too, with its status and body), then messages both ways, pings answered,
closes passed on with their code. The guest's leg is never compressed.

What the app in the guest sees:

* the path after the prefix (path-routed) or the whole path (host-routed),
  and ``X-Forwarded-Prefix: /sandboxes/{id}/ports/{port}`` (path-routed),
  so it can build links; a ``Location`` that is an absolute path is given
  the prefix back on the way out;
* the client's ``Host`` (apps that check it may need to allow Hangar's
  name), ``X-Forwarded-For``, ``-Proto`` and ``-Host``;
* never Hangar's credentials: ``X-API-Key``, the ``hangar_token`` query
  parameter and the ``hangar_port_token`` cookie are removed, as are
  hop-by-hop headers.

A request that brings a valid token in its query gets the token back as
a cookie (``HttpOnly; SameSite=Lax``; path-scoped to the port's prefix, or
host-only for host-routed ports), so a browser's later requests (assets,
links, WebSockets) carry it. Answers of Hangar itself (404 not exposed,
401, 409/410 sandbox not running, 502 nothing listens or the answer was
not HTTP) use the JSON error shape; the guest's own answers pass as they are.

Path-routed ports share Hangar's origin: a page served there is
same-origin with ``/ui/`` and with every other path-routed port. Serve
untrusted web content on host-routed URLs (``HANGAR_DOMAIN``), where each
port is an origin of its own. See docs/security.md.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import h11
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from websockets.client import ClientProtocol
from websockets.frames import Close, Opcode
from websockets.http11 import Response as WsResponse
from websockets.protocol import State as WsState
from websockets.uri import WebSocketURI

from hangar.api.auth import authenticate
from hangar.core.ports import Exposure
from hangar.api.errors import render, render_error
from hangar.core.commands import Tunnel
from hangar.core.guestcalls import NoListener
from hangar.core.sandboxes import SandboxManager
from hangar.errors import HangarError, Unauthorized

log = logging.getLogger("hangar.proxy")

TOKEN_PARAM = "hangar_token"
"""Query parameter that carries a private port's URL token."""
COOKIE = "hangar_port_token"
"""Cookie a browser keeps a private port's token in after a visit with ``TOKEN_PARAM``."""
MAX_HEADER_BYTES = 64 * 1024
"""Largest response head (status line and headers) taken from a guest, bytes."""
WS_MAX_MESSAGE = 16 * 1024 * 1024
"""Largest WebSocket message taken from a guest, bytes (uvicorn's default for clients)."""

PATH_RE = re.compile(rb"^/sandboxes/([^/]{1,256})/ports/([0-9]{1,5})(/[^?#]*)$")
"""Path-routed requests; an id that names no sandbox gets its 404 from the proxy."""
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate",
                        b"proxy-authorization", b"proxy-connection", b"te", b"trailer",
                        b"transfer-encoding", b"upgrade"})
DROP_FROM_CLIENT = HOP_BY_HOP | {
    b"x-api-key", b"expect", b"host", b"cookie", b"content-length", b"forwarded",
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


def _header(scope: Scope, name: bytes) -> bytes | None:
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
        host = (_header(scope, b"host") or b"").decode("latin-1").strip().lower()
        if ":" not in domain:
            host = host.rsplit(":", 1)[0] if not host.endswith("]") else host
        m = _host_pattern(domain).match(host)
        if m is not None:
            return Target(m.group(2), int(m.group(1)), raw or b"/", None)
    m2 = PATH_RE.match(raw)
    if m2 is None:
        return None
    sid, port = m2.group(1).decode("latin-1"), int(m2.group(2))
    return Target(sid, port, m2.group(3), path_prefix(sid, port))


def _query(scope: Scope) -> tuple[bytes, str | None]:
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


def _cookies(scope: Scope) -> tuple[bytes | None, str | None]:
    """(the Cookie header without ``COOKIE``, or None when empty; the token it carried)."""
    token = None
    kept: list[str] = []
    for k, v in scope.get("headers", ()):
        if k != b"cookie":
            continue
        for part in bytes(v).decode("latin-1").split(";"):
            name, _, value = part.strip().partition("=")
            if name == COOKIE:
                token = value
            elif part.strip():
                kept.append(part.strip())
    return ("; ".join(kept).encode("latin-1") if kept else None), token


def _connection_tokens(headers: Any) -> set[bytes]:
    """Header names a ``Connection`` header lists (also hop-by-hop)."""
    out: set[bytes] = set()
    for k, v in headers:
        if bytes(k).lower() == b"connection":
            out |= {t.strip().lower() for t in bytes(v).split(b",") if t.strip()}
    return out


def guest_headers(scope: Scope, target: Target, cookie: bytes | None) -> list[tuple[bytes, bytes]]:
    """The client's headers as the guest gets them (see the module docstring); no framing."""
    drop = DROP_FROM_CLIENT | _connection_tokens(scope.get("headers", ()))
    out = [(bytes(k), bytes(v)) for k, v in scope.get("headers", ()) if k not in drop]
    host = _header(scope, b"host") or b"localhost"
    client = scope.get("client")
    given = str(scope.get("scheme") or "http")
    scheme = {"ws": "http", "wss": "https"}.get(given, given)
    out.insert(0, (b"host", host))
    if cookie:
        out.append((b"cookie", cookie))
    if client:
        out.append((b"x-forwarded-for", str(client[0]).encode()))
    out += [(b"x-forwarded-proto", scheme.encode()), (b"x-forwarded-host", host)]
    if target.prefix is not None:
        out.append((b"x-forwarded-prefix", target.prefix.encode()))
    return out


def _token_cookie(token: str, expires: int, target: Target, scheme: str) -> tuple[bytes, bytes]:
    """``Set-Cookie`` that keeps ``token`` for the rest of a browser's visit."""
    path = f"{target.prefix}/" if target.prefix is not None else "/"
    max_age = max(0, math.floor(expires - time.time()))
    secure = "; Secure" if scheme in ("https", "wss") else ""
    return (b"set-cookie", f"{COOKIE}={token}; Path={path}; Max-Age={max_age}; HttpOnly; "
                           f"SameSite=Lax{secure}".encode())


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


class PortProxy:
    """ASGI middleware: requests for exposed ports go to the guest; others to ``app``.

    Placed outermost, so the API's body cap and idempotency middleware never
    see proxied requests. Finds the manager and key ring in
    ``scope["app"].state``.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        state = scope["app"].state
        manager: SandboxManager | None = getattr(state, "manager", None)
        target = route(scope, manager.settings.domain if manager is not None else None)
        if target is None or manager is None:
            await self.app(scope, receive, send)
            return
        if scope["type"] == "http":
            await _Http(scope, receive, send, target, manager, state).run()
        else:
            await _WebSocket(scope, receive, send, target, manager, state).run()


class _Exchange:
    """What both kinds of forwarded request share: checks, credentials, the tunnel."""

    def __init__(self, scope: Scope, receive: Receive, send: Send, target: Target,
                 manager: SandboxManager, state: Any) -> None:
        self.scope = scope
        self.receive = receive
        self.send = send
        self.target = target
        self.m = manager
        self.state = state
        self.query, self.query_token = _query(scope)
        self.cookie, self.cookie_token = _cookies(scope)
        self.new_cookie: tuple[bytes, bytes] | None = None

    def admit(self) -> Exposure:
        """The exposure, once the request may use it. Raises ``Refused``."""
        t = self.target
        query_token, cookie_token = self.query_token, self.cookie_token
        try:
            exposure = self.m.ports.get(t.sandbox_id, t.port)
        except HangarError as exc:
            raise Refused.of(exc) from None
        if exposure.public:
            return exposure
        key = _header(self.scope, b"x-api-key")
        if key:
            client = self.scope.get("client")
            try:
                authenticate(self.state, key.decode("latin-1"), client[0] if client else "unknown")
            except HangarError as exc:
                raise Refused.of(exc) from None
            return exposure
        if query_token and self.m.ports.allows(exposure, query_token):
            expires = int(query_token.partition(".")[0])
            self.new_cookie = _token_cookie(query_token, expires, t, self.scope.get("scheme", ""))
            return exposure
        if cookie_token and self.m.ports.allows(exposure, cookie_token):
            return exposure
        why = "is expired or not valid for it" if (query_token or cookie_token) else "is missing"
        raise Refused.of(Unauthorized(
            f"port {t.port} of sandbox {t.sandbox_id} is private and the token {why}: send "
            f"X-API-Key, or open its signed URL (GET /sandboxes/{t.sandbox_id}/ports/{t.port} "
            "gives one)", sandbox_id=t.sandbox_id, port=t.port))

    def resource(self) -> bytes:
        """Path and query the guest gets."""
        return self.target.path + (b"?" + self.query if self.query else b"")

    async def forward(self, use: Callable[[Tunnel], Awaitable[None]]) -> None:
        """Admit the request, open a tunnel to the port and run ``use`` on it.

        Raises ``Refused``."""
        t = self.target
        self.admit()
        try:
            async with self.m.tunnel(t.sandbox_id, t.port) as tunnel:
                await use(tunnel)
        except NoListener:
            raise Refused(502, "bad_gateway", f"nothing listens on port {t.port} in sandbox "
                          f"{t.sandbox_id}", sandbox_id=t.sandbox_id, port=t.port) from None
        except HangarError as exc:
            raise Refused.of(exc) from None


class BrokenAnswer(ConnectionError):
    """The guest's answer broke off after it had started: the client's connection is
    dropped (the ASGI way: an exception once headers are out), so a cut answer never
    looks complete."""


class _Http(_Exchange):
    started = False
    """The guest's answer has begun: Hangar can no longer answer with an error."""

    async def run(self) -> None:
        try:
            await self.forward(self._exchange)
        except Refused as r:
            await self._answer(*r.answer)

    async def _answer(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        if self.started:
            return
        await self.send({"type": "http.response.start", "status": status, "headers": headers})
        await self.send({"type": "http.response.body", "body": body})

    async def _exchange(self, tunnel: Tunnel) -> None:
        conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEADER_BYTES)
        headers = guest_headers(self.scope, self.target, self.cookie)
        length = _header(self.scope, b"content-length")
        chunked = b"chunked" in (_header(self.scope, b"transfer-encoding") or b"").lower()
        if chunked:
            headers.append((b"transfer-encoding", b"chunked"))
        elif length is not None:
            headers.append((b"content-length", length))
        headers.append((b"connection", b"close"))
        try:
            request = h11.Request(method=self.scope["method"], target=self.resource(),
                                  headers=headers)
            await tunnel.write(conn.send(request))
        except h11.LocalProtocolError as exc:
            raise Refused(400, "invalid_request", f"the request cannot be forwarded: {exc}")
        gone = asyncio.Event()
        upload = asyncio.create_task(self._upload(tunnel, conn, gone))
        download = asyncio.create_task(self._download(tunnel, conn))
        watch = asyncio.create_task(gone.wait())
        try:
            await asyncio.wait({download, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not download.done():  # the client went away: drop the guest's connection
                return
            download.result()  # a Refused before the answer started, or a broken answer
        finally:
            for task in (upload, download, watch):
                task.cancel()
            await asyncio.gather(upload, download, watch, return_exceptions=True)

    async def _upload(self, tunnel: Tunnel, conn: h11.Connection, gone: asyncio.Event) -> None:
        """Stream the request body to the guest, then wait for the client to leave."""
        try:
            while True:
                msg = await self.receive()
                if msg["type"] == "http.disconnect":
                    gone.set()
                    return
                body = msg.get("body", b"")
                if body and conn.our_state is h11.SEND_BODY:
                    await tunnel.write(conn.send(h11.Data(data=body)))
                if not msg.get("more_body", False):
                    break
            if conn.our_state is h11.SEND_BODY:
                await tunnel.write(conn.send(h11.EndOfMessage()))
        except (h11.LocalProtocolError, HangarError, ConnectionError) as exc:
            log.info("request body not forwarded", extra={
                "sandbox_id": self.target.sandbox_id, "port": self.target.port,
                "error": str(exc)[:200]})
        while True:
            msg = await self.receive()
            if msg["type"] == "http.disconnect":
                gone.set()
                return

    async def _download(self, tunnel: Tunnel, conn: h11.Connection) -> None:
        """Parse the guest's answer and stream it to the client."""
        t = self.target
        while True:
            try:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(await tunnel.read())
                    continue
            except h11.RemoteProtocolError as exc:
                if not self.started:
                    raise Refused(502, "bad_gateway", f"port {t.port} of sandbox "
                                  f"{t.sandbox_id} answered with something other than "
                                  f"HTTP/1.x: {exc}", sandbox_id=t.sandbox_id,
                                  port=t.port) from None
                raise self._broken(str(exc)) from None
            if isinstance(event, h11.InformationalResponse):
                continue  # 100 Continue, 103 Early Hints: the client's server spoke for us
            if isinstance(event, h11.Response):
                self.started = True
                await self.send({"type": "http.response.start", "status": event.status_code,
                                 "headers": self._response_headers(event.headers)})
            elif isinstance(event, h11.Data):
                await self.send({"type": "http.response.body", "body": bytes(event.data),
                                 "more_body": True})
            elif isinstance(event, h11.EndOfMessage):
                await self.send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            elif isinstance(event, h11.ConnectionClosed):
                if not self.started:
                    raise Refused(502, "bad_gateway", f"port {t.port} of sandbox "
                                  f"{t.sandbox_id} closed the connection without answering",
                                  sandbox_id=t.sandbox_id, port=t.port)
                raise self._broken("the guest closed the connection mid-answer")

    def _broken(self, why: str) -> BrokenAnswer:
        log.warning("guest answer broke off; client connection dropped", extra={
            "sandbox_id": self.target.sandbox_id, "port": self.target.port, "error": why[:200]})
        return BrokenAnswer(why)

    def _response_headers(self, headers: Any) -> list[tuple[bytes, bytes]]:
        drop = HOP_BY_HOP | _connection_tokens(headers)
        out: list[tuple[bytes, bytes]] = []
        prefix = self.target.prefix
        for k, v in headers:
            k, v = bytes(k), bytes(v)
            if k in drop:
                continue
            if k == b"location" and prefix is not None and v.startswith(b"/") \
                    and not v.startswith(b"//"):
                v = prefix.encode() + v
            out.append((k, v))
        if self.new_cookie is not None:
            out.append(self.new_cookie)
        return out


class _WebSocket(_Exchange):
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
        origin = _header(self.scope, b"origin")
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
        for k, v in guest_headers(self.scope, t, self.cookie):
            request.headers[k.decode("latin-1")] = v.decode("latin-1")
        proto.send_request(request)
        await self._flush(proto, tunnel)
        response: WsResponse | None = None
        pending: list[Any] = []
        while response is None:
            data = await tunnel.read()
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
            headers = [(k.lower().encode("latin-1"), v.encode("latin-1"))
                       for k, v in response.headers.raw_items()
                       if k.lower().encode("latin-1") not in HOP_BY_HOP]
            await self._deny(response.status_code, headers, bytes(response.body or b""))
            return
        accept: Message = {"type": "websocket.accept",
                           "subprotocol": response.headers.get("Sec-WebSocket-Protocol"),
                           "headers": [self.new_cookie] if self.new_cookie else []}
        await self.send(accept)
        self.accepted = True
        log.info("websocket opened", extra={"sandbox_id": t.sandbox_id, "port": t.port})
        close = {"code": 1000, "reason": ""}
        to_guest = asyncio.create_task(self._to_guest(proto, tunnel))
        to_client = asyncio.create_task(self._to_client(proto, tunnel, pending, close))
        try:
            done, _ = await asyncio.wait({to_guest, to_client},
                                         return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                exc = task.exception()
                if exc is not None and not isinstance(exc, (HangarError, ConnectionError)):
                    log.warning("websocket relay failed", extra={
                        "sandbox_id": t.sandbox_id, "port": t.port, "error": repr(exc)[:200]})
                    close.update(code=1011, reason="relay error")
        finally:
            for task in (to_guest, to_client):
                task.cancel()
            await asyncio.gather(to_guest, to_client, return_exceptions=True)
            try:
                await self.send({"type": "websocket.close", **close})
            except Exception:  # the client is gone already
                pass
            log.info("websocket closed", extra={"sandbox_id": t.sandbox_id, "port": t.port})

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
                         close: dict[str, Any]) -> None:
        parts: list[bytes] = []
        kind: Opcode | None = None
        events = pending
        while True:
            for frame in events:
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
                    kind, parts = None, []
            await self._flush(proto, tunnel)
            if proto.state is WsState.CLOSED:
                if proto.close_exc is not None and close["code"] == 1000 \
                        and proto.close_code not in (None, 1000, 1005, 1006):
                    close.update(code=proto.close_code or 1011, reason=proto.close_reason or "")
                return
            data = await tunnel.read()
            if data:
                proto.receive_data(data)
            else:
                proto.receive_eof()
                if proto.state is not WsState.CLOSED:
                    close.update(code=1011, reason="the guest closed the connection")
            events = proto.events_received()


async def forward_admitted(scope: Scope, receive: Receive, send: Send, target: Target,
                           manager: SandboxManager, state: Any) -> None:
    """Forward one request (HTTP or WebSocket) to ``target``, its caller having admitted it
    already (E2B's data plane, by the sandbox's access token): no exposure is needed."""
    cls = _Http if scope["type"] == "http" else _WebSocket
    exchange = cls(scope, receive, send, target, manager, state)
    exchange.admit = lambda: None  # type: ignore[assignment, method-assign, return-value]
    await exchange.run()
