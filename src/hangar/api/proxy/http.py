"""A plain HTTP request forwarded to a guest's port: re-serialized with h11 (one request
per connection, ``Connection: close``), the body streamed up while the answer streams
back; a ``Location`` that is an absolute path gets the port's prefix back."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11

from hangar.api.proxy.exchange import Exchange, Refused
from hangar.api.proxy.origin import filter_headers
from hangar.api.proxy.routing import HOP_BY_HOP, connection_tokens, guest_headers, header
from hangar.core.service import Tunnel, race
from hangar.errors import HangarError

log = logging.getLogger("hangar.proxy")

PARSE_SLICE = 8 << 10
"""Bytes of a guest's answer given to the HTTP parser at once (``HttpExchange._download``)."""
FLUSH_BYTES = 64 << 10
"""Bytes of a guest's answer body handed on to the client in one piece, at most."""
MAX_INFORMATIONAL = 8
"""Informational (1xx) answers a guest may send before its answer."""
MAX_HEADER_BYTES = 64 * 1024
"""Largest response head (status line and headers) taken from a guest, bytes."""


def canonical(name: bytes) -> bytes:
    """A header name as the guest gets it: each word capitalized (``x-forwarded-for`` →
    ``X-Forwarded-For``), the canonical form HTTP servers and E2B's edge send. The ASGI
    server hands the client's names lower-cased, and some guest apps read (or print)
    names as sent (E2B's ``test_mask_request_host`` looks for ``Host:``)."""
    return b"-".join(part[:1].upper() + part[1:] for part in name.split(b"-"))


class BrokenAnswer(ConnectionError):
    """The guest's answer broke off after it had started: the client's connection is
    dropped (the ASGI way: an exception once headers are out), so a cut answer never
    looks complete."""


class HttpExchange(Exchange):
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
        headers = guest_headers(self.scope, self.target, self.cookie, self.drop, self.host)
        length = header(self.scope, b"content-length")
        chunked = b"chunked" in (header(self.scope, b"transfer-encoding") or b"").lower()
        if chunked:
            headers.append((b"transfer-encoding", b"chunked"))
        elif length is not None:
            headers.append((b"content-length", length))
        headers.append((b"connection", b"close"))
        try:
            request = h11.Request(method=self.scope["method"], target=self.resource(),
                                  headers=[(canonical(k), v) for k, v in headers])
            await tunnel.write(conn.send(request))
        except h11.LocalProtocolError as exc:
            raise Refused(400, "invalid_request", f"the request cannot be forwarded: {exc}")
        gone = asyncio.Event()
        upload = asyncio.create_task(self._upload(tunnel, conn, gone))
        download = asyncio.create_task(self._download(tunnel, conn))
        try:
            if download in await race([download, asyncio.create_task(gone.wait())]):
                download.result()  # a Refused before the answer started, or a broken answer
            # else the client went away: the guest's connection is dropped
        finally:
            upload.cancel()
            await asyncio.gather(upload, return_exceptions=True)

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
        """Parse the guest's answer and stream it to the client: ``PARSE_SLICE`` bytes of
        it at a time, with a turn of the loop between two slices of one read, its body
        handed on in pieces of up to ``FLUSH_BYTES`` (a body of 1-byte chunks is one event
        per 6 bytes; parsed and sent event by event, 64 KiB of them held the loop 148 ms,
        review 29h H-H1); at most ``MAX_INFORMATIONAL`` 1xx answers before the answer."""
        t = self.target
        rest = memoryview(b"")  # read from the guest, not yet given to the parser
        body = bytearray()  # parsed, not yet sent
        informational = 0
        while True:
            try:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    if body:
                        await self._send_body(body)
                    if rest:
                        await asyncio.sleep(0)
                    else:
                        rest = memoryview(await tunnel.read())
                        if not rest and tunnel.lost is not None and self.started:
                            # the sandbox went away (deleted, its VM ended): an answer
                            # delimited by the close must not look whole (E2B's SDK then
                            # asks is_running() and says the sandbox was killed)
                            raise self._broken(f"the sandbox's tunnel was lost: "
                                               f"{tunnel.lost}")
                        if not rest:
                            conn.receive_data(b"")  # the guest closed its side
                            continue
                    conn.receive_data(bytes(rest[:PARSE_SLICE]))
                    rest = rest[PARSE_SLICE:]
                    continue
            except h11.RemoteProtocolError as exc:
                if not self.started:
                    raise Refused(502, "bad_gateway", f"port {t.port} of sandbox "
                                  f"{t.sandbox_id} answered with something other than "
                                  f"HTTP/1.x: {exc}", sandbox_id=t.sandbox_id,
                                  port=t.port) from None
                raise self._broken(str(exc)) from None
            if isinstance(event, h11.InformationalResponse):
                informational += 1  # 100 Continue, 103 Early Hints: not the client's
                if informational > MAX_INFORMATIONAL:
                    raise Refused(502, "bad_gateway", f"port {t.port} of sandbox "
                                  f"{t.sandbox_id} sent more than {MAX_INFORMATIONAL} "
                                  "informational (1xx) answers", sandbox_id=t.sandbox_id,
                                  port=t.port)
                continue
            if isinstance(event, h11.Response):
                self.started = True
                await self.send({"type": "http.response.start", "status": event.status_code,
                                 "headers": self._response_headers(event.headers)})
            elif isinstance(event, h11.Data):
                body += event.data
                if len(body) >= FLUSH_BYTES:
                    await self._send_body(body)
            elif isinstance(event, h11.EndOfMessage):
                await self.send({"type": "http.response.body", "body": bytes(body),
                                 "more_body": False})
                return
            elif isinstance(event, h11.ConnectionClosed):
                if not self.started:
                    raise Refused(502, "bad_gateway", f"port {t.port} of sandbox "
                                  f"{t.sandbox_id} closed the connection without answering",
                                  sandbox_id=t.sandbox_id, port=t.port)
                raise self._broken("the guest closed the connection mid-answer")

    async def _send_body(self, body: bytearray) -> None:
        """Hand ``body`` on to the client, and empty it."""
        await self.send({"type": "http.response.body", "body": bytes(body), "more_body": True})
        body.clear()

    def _broken(self, why: str) -> BrokenAnswer:
        log.warning("guest answer broke off; client connection dropped", extra={
            "sandbox_id": self.target.sandbox_id, "port": self.target.port, "error": why[:200]})
        return BrokenAnswer(why)

    def _response_headers(self, headers: Any) -> list[tuple[bytes, bytes]]:
        drop = HOP_BY_HOP | connection_tokens(headers)
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
        out = filter_headers(out, self.target, self.m.settings.port_path_sandbox)
        if self.new_cookie is not None:
            out.append(self.new_cookie)
        return out
