"""Limits of the HTTP server itself (uvicorn): header size, header read time, idle
keep-alive, concurrent connections.

``hangar serve`` runs uvicorn with ``uvicorn_options()``. The HTTP/1.1 parser
is h11 (not httptools, whose parser buffers a header of any size):

* a request head (request line and headers) larger than ``HEADER_MAX_BYTES``
  is answered **431** (Request Header Fields Too Large) and the connection
  closed: h11's ``max_incomplete_event_size`` stops buffering it, and
  ``BoundedH11Protocol`` gives h11's own status hint instead of uvicorn's
  generic 400;
* a connection that has not sent a whole request head within
  ``HEADER_TIMEOUT_S`` of opening (or of its previous answer) is closed
  (slow-header clients, "slowloris"); uvicorn has no such timer of its own;
* an idle keep-alive connection is closed after ``KEEP_ALIVE_S``;
* past ``MAX_CONCURRENCY`` open connections or running requests, requests
  get 503 (uvicorn's ``limit_concurrency``);
* one client address holds at most ``PER_CLIENT_MAX`` connections at once
  (a WebSocket's included); one more is closed as it opens, so a single
  anonymous client cannot take the ``MAX_CONCURRENCY`` all share. The
  addresses of ``forwarded_allow_ips`` (a trusted reverse proxy, which must
  cap its own clients) and Unix-socket clients are not capped.

WebSockets: ``RefusingWebSockets`` is uvicorn's sans-I/O WebSocket protocol,
except that a handshake the app refuses with an HTTP answer (the ASGI
"websocket denial response", as every Hangar WebSocket route refuses) is
not logged as an ERROR ("ASGI callable returned without completing
handshake"): uvicorn logs the refusal at INFO already.

Figures are chosen for an API whose requests are small: browsers send
request heads of 1-8 KiB, nginx's default limit is 4 x 8 KiB.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import struct
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.utils import ClientDisconnected
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

HEADER_MAX_BYTES = 64 << 10
"""Largest request head (request line and headers) accepted, bytes."""
TRANSPORT = "hangar.transport"
"""Key of a request scope's ``extensions`` that holds the connection that carried it
(``BoundedH11Protocol``, for ``reset_connection``)."""
HEADER_TIMEOUT_S = 15.0
"""Seconds a connection may take to send a whole request head."""
KEEP_ALIVE_S = 5
"""Seconds an idle keep-alive connection is kept (uvicorn's ``timeout_keep_alive``)."""
MAX_CONCURRENCY = 2048
"""Open connections or running requests past which requests get 503."""
PER_CLIENT_MAX = 256
"""Connections one client address may hold open at once (see the module docstring)."""

_open_by_ip: dict[str, int] = {}
"""Open connections by client address (this process's; the event loop's thread only)."""


def _trusted(config: Any, ip: str) -> bool:
    allowed = getattr(config, "forwarded_allow_ips", None) or ()
    items = [a.strip() for a in allowed.split(",")] if isinstance(allowed, str) else \
        [str(a).strip() for a in allowed]
    return "*" in items or ip in items


def _release_ip(ip: str) -> None:
    left = _open_by_ip.get(ip, 1) - 1
    if left > 0:
        _open_by_ip[ip] = left
    else:
        _open_by_ip.pop(ip, None)


def _release(protocol: Any) -> None:
    """Give back the place ``protocol``'s connection held, once."""
    ip = getattr(protocol, "_counted_ip", None)
    if ip is not None:
        protocol._counted_ip = None
        _release_ip(ip)

log = logging.getLogger("hangar.api.http")

__all__ = ["HEADER_MAX_BYTES", "HEADER_TIMEOUT_S", "KEEP_ALIVE_S", "MAX_CONCURRENCY",
           "PER_CLIENT_MAX",
           "BoundedH11Protocol", "RefusingWebSockets", "uvicorn_options"]


def client_key(ip: str) -> str:
    """What ``PER_CLIENT_MAX`` counts a client by: its IPv4 address (an IPv4-mapped IPv6
    one too), or the /64 of an IPv6 address (a single host holds a whole /64)."""
    try:
        addr = ipaddress.ip_address(ip.split("%", 1)[0])
    except ValueError:
        return ip
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is not None:
            return str(addr.ipv4_mapped)
        return str(ipaddress.IPv6Network((addr, 64), strict=False))
    return str(addr)


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a request-head deadline and 431 for an oversized head."""

    _head_timer: asyncio.TimerHandle | None = None
    _armed_scope: Any = None
    _counted_ip: str | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        addr = self.client[0] if self.client else None
        if addr is not None and not _trusted(self.config, addr):
            ip = client_key(addr)
            if _open_by_ip.get(ip, 0) >= PER_CLIENT_MAX:
                transport.close()  # over its cap: closed as it opens, nothing read
                return
            _open_by_ip[ip] = _open_by_ip.get(ip, 0) + 1
            self._counted_ip = ip
        self._arm()

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        counted, self._counted_ip = self._counted_ip, None
        super().handle_websocket_upgrade(event)
        # the WebSocket's protocol holds the connection's place from now on
        ws = self.transport.get_protocol()
        if counted is not None and isinstance(ws, RefusingWebSockets):
            ws._counted_ip = counted
        elif counted is not None:
            _release_ip(counted)

    def _arm(self) -> None:
        self._disarm()
        self._armed_scope = self.scope
        self._head_timer = self.loop.call_later(HEADER_TIMEOUT_S, self._head_timeout)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def handle_events(self) -> None:
        before = getattr(self, "scope", None)
        super().handle_events()
        scope = getattr(self, "scope", None)
        if scope is not None and scope is not before and scope.get("type") == "http":
            # a new request: its own connection, for ``reset_connection`` (its task has
            # not run yet, so the app sees it)
            scope.setdefault("extensions", {})[TRANSPORT] = self.transport

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._head_timer is not None and self.scope is not self._armed_scope:
            self._disarm()  # a whole request head arrived (a WebSocket upgrade too)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()  # the next request's head: keep-alive closes idle ones sooner

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        _release(self)
        super().connection_lost(exc)

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.scope is self._armed_scope and not self.transport.is_closing():
            log.info("connection closed: no whole request head within the deadline",
                     extra={"client": self.client[0] if self.client else None,
                            "timeout_s": HEADER_TIMEOUT_S})
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        buffered, _closed = self.conn.trailing_data
        if len(buffered) <= HEADER_MAX_BYTES or self.conn.their_state is not h11.ERROR:
            super().send_400_response(msg)
            return
        body = (f"the request head is larger than {HEADER_MAX_BYTES} bytes, the server's "
                f"limit").encode()
        head = (b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                b"content-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
                b"content-length: " + str(len(body)).encode() + b"\r\n\r\n")
        self.transport.write(head + body)
        self.transport.close()


class RefusingWebSockets(WebSocketsSansIOProtocol):
    """uvicorn's sans-I/O WebSocket protocol; a denial response is no error (see above).
    It holds its connection's place in ``PER_CLIENT_MAX`` until the connection ends."""

    _counted_ip: str | None = None

    def connection_lost(self, exc: Exception | None) -> None:
        _release(self)
        super().connection_lost(exc)

    async def run_asgi(self) -> None:
        # uvicorn 0.54's run_asgi, but a handshake answered by a denial response
        # (``initial_response``) counts as completed.
        try:
            result = await self.app(self.scope, self.receive, self.send)
        except ClientDisconnected:
            pass
        except BaseException:
            self.logger.exception("Exception in ASGI application\n")
            self.send_500_response()
        else:
            if not self.handshake_complete and self.initial_response is None:
                self.logger.error("ASGI callable returned without completing handshake.")
                self.send_500_response()
            elif result is not None:
                self.logger.error("ASGI callable should return None, but returned '%s'.",
                                  result)
        if self.close_timer is None:
            self.transport.close()


def uvicorn_options() -> dict[str, Any]:
    """Keyword arguments for ``uvicorn.Config`` that set the limits above."""
    return {
        "http": BoundedH11Protocol,
        "ws": RefusingWebSockets,
        "h11_max_incomplete_event_size": HEADER_MAX_BYTES,
        "timeout_keep_alive": KEEP_ALIVE_S,
        "limit_concurrency": MAX_CONCURRENCY,
    }


def reset_connection(scope: Any) -> bool:
    """End the TCP connection that carried the request ``scope`` with a reset (RST), not a
    close: what a client sees when the server behind a proxy dies mid-response (an HTTP
    client's read error, not an incomplete message). The connection is the one
    ``BoundedH11Protocol`` put in that very request's scope (``TRANSPORT``), never one
    looked up by the client's address (behind a proxy that is ``X-Forwarded-For``'s,
    which names no connection of this server, or another client's); a Unix socket's is
    closed. Returns False when the scope has none (another ASGI server) or it is closing
    already."""
    transport = (scope.get("extensions") or {}).get(TRANSPORT)
    if transport is None or transport.is_closing():
        return False
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()
    return True
