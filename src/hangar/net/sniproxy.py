"""``SniProxy``: the transparent HTTP/HTTPS proxy of sandboxes with domain rules.

Listens on (gateway, a port the kernel picks), as the server's own user;
``NetworkManager.intercept`` sends a guarded guest's new TCP connections to
ports 80 and 443 (any address) here. For each connection:

1. The guest is known by its source address (``EgressGuard.lookup``), the
   address and port it dialled by ``SO_ORIGINAL_DST``.
2. The first bytes are read, at most ``MAX_PEEK`` of them within
   ``PEEK_S`` seconds, until a name is found: the ``server_name`` of a TLS
   ClientHello, or an HTTP request's ``Host`` header. No TLS is
   terminated and nothing is changed.
3. ``egress_match.decide(rules, ip=original address, port, name)``; the
   rules are the sandbox's live ones, with the addresses the host resolved
   for it (an allowed name reached at an address the guest resolved itself
   is refused, and so are the host, the bridge network and link-local).
4. Refused: HTTP gets ``403`` with a one-line reason, TLS is closed;
   counted and published (``via: proxy``). Allowed: the host connects to
   the original destination (``CONNECT_S``), sends what it read, and
   copies bytes both ways until either side closes.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import struct
from typing import Any

from hangar.net.egress_match import decide

log = logging.getLogger("hangar.net.sniproxy")

SO_ORIGINAL_DST = 80
"""``getsockopt(SOL_IP, SO_ORIGINAL_DST)``: a redirected connection's destination."""
MAX_PEEK = 16 * 1024
"""Most bytes read before the name must be known."""
PEEK_S = 5.0
"""How long the guest has to send them, seconds."""
CONNECT_S = 10.0
"""How long the upstream connection may take, seconds."""
CHUNK = 64 * 1024
MAX_CONNECTIONS = 1024
"""Connections proxied at once, at least (more are refused by closing them); more with
many guarded guests: ``EgressGuard.flow_limit``."""


def original_dst(sock: socket.socket) -> tuple[str, int]:
    """(IPv4 address, port) a redirected connection was sent to (``SO_ORIGINAL_DST``)."""
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    port, = struct.unpack("!H", raw[2:4])
    return socket.inet_ntoa(raw[4:8]), port


def tls_sni(data: bytes) -> tuple[bool, str | None]:
    """(complete?, name) for the start of a TLS stream: complete when the ClientHello's
    first record is all there (its name, or None when it has none or is malformed)."""
    if len(data) < 5:
        return False, None
    length = struct.unpack("!H", data[3:5])[0]
    if len(data) < 5 + length:
        return 5 + length > MAX_PEEK, None
    body = data[5:5 + length]
    try:
        if body[0] != 1:  # ClientHello
            return True, None
        p = 4 + 2 + 32  # handshake header, version, random
        p += 1 + body[p]  # session id
        p += 2 + struct.unpack("!H", body[p:p + 2])[0]  # cipher suites
        p += 1 + body[p]  # compression methods
        end = p + 2 + struct.unpack("!H", body[p:p + 2])[0]
        p += 2
        while p + 4 <= end:
            kind, n = struct.unpack("!HH", body[p:p + 4])
            p += 4
            if kind == 0:  # server_name: list length, type, name length, name
                if body[p + 2] == 0:
                    size = struct.unpack("!H", body[p + 3:p + 5])[0]
                    return True, body[p + 5:p + 5 + size].decode("ascii")
                return True, None
            p += n
    except (IndexError, struct.error, UnicodeDecodeError):
        return True, None
    return True, None


def http_host(data: bytes) -> tuple[bool, str | None]:
    """(complete?, host) for the start of an HTTP/1 request: complete once its header
    block ended (host without port; None when absent)."""
    end = data.find(b"\r\n\r\n")
    if end < 0:
        return len(data) >= MAX_PEEK, None
    for line in data[:end].split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == b"host":
            host = value.strip().decode("latin-1")
            if host.startswith("["):
                return True, None
            return True, host.rsplit(":", 1)[0] if ":" in host else host
    return True, None


def _name_or_none(name: str | None) -> str | None:
    """A name that is an IP literal is no name (the CIDR rules decide)."""
    if name is None:
        return None
    try:
        ipaddress.ip_address(name)
        return None
    except ValueError:
        return name


class SniProxy:
    """See the module docstring. ``guard`` is the ``EgressGuard``; ``host`` the address to
    listen on; ``port`` is known after ``start``."""

    def __init__(self, guard: Any, host: str, port: int = 0) -> None:
        self.guard = guard
        self.host = host
        self.port = port
        self._server: asyncio.base_events.Server | None = None
        self._open = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, self.port,
                                                  backlog=256)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._open += 1
        try:
            if self._open <= self.guard.flow_limit(MAX_CONNECTIONS):
                await self._one(reader, writer)
        except Exception:  # a bug closes this connection, the proxy lives on
            log.exception("proxied connection failed")
        finally:
            self._open -= 1
            writer.close()

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        source = writer.get_extra_info("peername")[0]
        g = self.guard.lookup(source)
        if g is None or not g.enter():  # unknown, or this guest has too many open
            return
        try:
            await self._guarded(g, reader, writer)
        finally:
            g.leave()

    async def _guarded(self, g: Any, reader: asyncio.StreamReader,
                       writer: asyncio.StreamWriter) -> None:
        ip, port = original_dst(writer.get_extra_info("socket"))
        data, name, tls = await self._peek(reader)
        name = _name_or_none(name)
        allowed, reason = decide(g.live_rules(), ip=ip, port=port, name=name)
        if not allowed:
            self.guard.denied(g, "proxy", reason, port=port, domain=name, address=ip)
            if not tls and data:
                line = f"hangar egress: {reason} {name or ip}:{port}\n".encode()
                writer.write(b"HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain\r\n"
                             b"Connection: close\r\nContent-Length: %d\r\n\r\n%s"
                             % (len(line), line))
                try:
                    await asyncio.wait_for(writer.drain(), 2)
                except (TimeoutError, ConnectionError):
                    pass
            return
        try:
            up_r, up_w = await asyncio.wait_for(asyncio.open_connection(ip, port), CONNECT_S)
        except (OSError, TimeoutError):
            return
        try:
            up_w.write(data)
            await asyncio.gather(_pump(reader, up_w), _pump(up_r, writer))
        finally:
            up_w.close()

    async def _peek(self, reader: asyncio.StreamReader) -> tuple[bytes, str | None, bool]:
        """(bytes read, name found, TLS?) within ``PEEK_S`` and ``MAX_PEEK``."""
        data = b""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + PEEK_S
        while len(data) < MAX_PEEK:
            left = deadline - loop.time()
            if left <= 0:
                break
            try:
                more = await asyncio.wait_for(reader.read(MAX_PEEK - len(data)), left)
            except TimeoutError:
                break
            if not more:
                break
            data += more
            done, name = tls_sni(data) if data[0] == 0x16 else http_host(data)
            if done:
                return data, name, data[0] == 0x16
        return data, None, bool(data) and data[0] == 0x16


async def _pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    try:
        while True:
            chunk = await src.read(CHUNK)
            if not chunk:
                break
            dst.write(chunk)
            await dst.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        try:
            if dst.can_write_eof():
                dst.write_eof()
        except (OSError, RuntimeError):
            pass
