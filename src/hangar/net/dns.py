"""``DnsForwarder``: the DNS of sandboxes with domain rules, answered by the host.

Listens on (gateway, a port the kernel picks), UDP and TCP, in the server
process (no privilege). ``NetworkManager.redirect_dns`` sends a guarded
guest's port-53 traffic here whatever resolver it asked, so a guest cannot
pick a resolver of its own. For each query (messages parsed by dnspython):

* the sender must be a guarded guest (``EgressGuard.lookup``; others get
  no answer), and the message one question of class IN, at most
  ``MAX_QUERY`` bytes (else FORMERR); each guest has at most its cap
  (``Guarded.cap``, ``Settings.egress_max_flows_per_sandbox``) of queries and
  TCP connections open here, together with its proxied connections (the rest
  are dropped or closed at once), so one guest cannot starve the others;
* a name a ``deny`` entry matches (and no ``allow`` does) is answered
  **REFUSED** (chosen over NXDOMAIN: it says "not here by policy" and is
  not cached as "does not exist"); counted and published (``via: dns``,
  reason ``denied_domain``); so is a name no entry matches when ``deny``
  holds 0.0.0.0/0 (an allowlist: reason ``unlisted_domain``), since no
  address would open for it and forwarding any name would leave DNS
  itself as a way out (tunnelling data in queries);
* any other name is forwarded to the upstream resolver (the server's
  ``HANGAR_NET_DNS`` or the host's) over UDP, then TCP when truncated,
  with ``UPSTREAM_TIMEOUT_S``; SERVFAIL when it does not answer;
* for a name an ``allow`` entry matches, the A records of the answer are
  opened in the sandbox's nftables sets (``NetworkManager.admit``) before
  the guest gets the answer, for the TTL (at least
  ``egress.ADMIT_FLOOR_S``); every answer's A records are remembered for
  the HTTP(S) proxy and for a later rule change (``EgressGuard.update``
  opens what the guest already resolved for a name it now allows).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from typing import Any

import dns.asyncquery
import dns.exception
import dns.flags
import dns.message
import dns.opcode
import dns.rcode
import dns.rdataclass
import dns.rdatatype

log = logging.getLogger("hangar.net.dns")

MAX_QUERY = 1232
"""Largest query taken, bytes (a real one is under 512; 1232 is DNS's usual EDNS payload
size, room for padding)."""
UPSTREAM_TIMEOUT_S = 3.0
"""How long the upstream resolver has to answer, seconds (per try)."""
TCP_IDLE_S = 10.0
"""How long a guest's TCP DNS connection may sit idle, seconds."""
MAX_INFLIGHT = 256
"""Queries being answered at once, at least (the rest are dropped, as a busy resolver
would); more with many guarded guests: ``EgressGuard.flow_limit``."""


class DnsForwarder:
    """See the module docstring. ``guard`` is the ``EgressGuard``; ``host`` the address
    to listen on; ``port`` is known after ``start``."""

    def __init__(self, guard: Any, host: str, port: int = 0) -> None:
        self.guard = guard
        self.host = host
        self.port = port
        self._udp: asyncio.DatagramTransport | None = None
        self._tcp: asyncio.base_events.Server | None = None
        self._inflight = 0
        self._tasks: set[asyncio.Task[Any]] = set()

    async def start(self) -> None:
        """Bind UDP and TCP on the same port (the kernel's choice for the first)."""
        loop = asyncio.get_running_loop()
        for _ in range(8):  # the UDP port may be taken for TCP: try another
            udp, _ = await loop.create_datagram_endpoint(lambda: _Udp(self),
                                                         local_addr=(self.host, self.port))
            port = udp.get_extra_info("sockname")[1]
            try:
                self._tcp = await asyncio.start_server(self._serve_tcp, self.host, port)
            except OSError:
                udp.close()
                continue
            self._udp, self.port = udp, port  # type: ignore[assignment]
            return
        raise OSError("no port free for the DNS forwarder on both UDP and TCP")

    async def close(self) -> None:
        if self._udp is not None:
            self._udp.close()
        if self._tcp is not None:
            self._tcp.close()
        for t in list(self._tasks):
            t.cancel()

    def _spawn(self, coro: Any) -> bool:
        """Run ``coro`` as a task unless the host-wide cap run already (then False)."""
        if self._inflight >= self.guard.flow_limit(MAX_INFLIGHT):
            coro.close()
            return False
        self._inflight += 1
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)

        def done(t: asyncio.Task[Any]) -> None:
            self._inflight -= 1
            self._tasks.discard(t)
        task.add_done_callback(done)
        return True

    def _datagram(self, transport: asyncio.DatagramTransport, data: bytes,
                  addr: tuple[str, int]) -> None:
        """One UDP query: its guest's slot is taken here, before a task is made, so one
        guest holds at most its cap of the ``MAX_INFLIGHT`` tasks."""
        g = self.guard.lookup(addr[0])
        if g is None or len(data) < 12 or not g.enter():
            return
        if not self._spawn(self._udp_query(transport, g, data, addr)):
            g.leave()

    async def answer(self, wire: bytes, source: str, tcp: bool) -> bytes | None:
        """The answer (wire format) to query ``wire`` from guest address ``source``; None:
        none (an unknown sender, or not even a header)."""
        g = self.guard.lookup(source)
        if g is None or len(wire) < 12:
            return None
        if not g.enter():  # this guest has too many queries in flight: dropped
            return None
        try:
            return await self._answer(g, wire, tcp)
        finally:
            g.leave()

    async def _answer(self, g: Any, wire: bytes, tcp: bool) -> bytes | None:
        try:
            q = dns.message.from_wire(wire) if _one_question(wire) else None
        except dns.exception.DNSException:
            q = None
        if q is None or len(q.question) != 1 or q.opcode() != dns.opcode.QUERY \
                or q.question[0].rdclass != dns.rdataclass.IN or q.flags & dns.flags.QR:
            return _formerr(wire)
        question = q.question[0]
        name = question.name.to_text(omit_final_dot=True)
        verdict, ports = self.guard.name_verdict(g, name)
        if verdict in ("deny", "unlisted"):
            reason = "denied_domain" if verdict == "deny" else "unlisted_domain"
            self.guard.denied(g, "dns", reason, port=53, domain=name.lower())
            r = dns.message.make_response(q)
            r.set_rcode(dns.rcode.REFUSED)
            return r.to_wire()
        try:
            resp = await dns.asyncquery.udp(q, self.guard.upstream, timeout=UPSTREAM_TIMEOUT_S,
                                            ignore_unexpected=True)
            if resp.flags & dns.flags.TC:
                resp = await dns.asyncquery.tcp(q, self.guard.upstream,
                                                timeout=UPSTREAM_TIMEOUT_S)
        except (dns.exception.DNSException, OSError, EOFError) as exc:
            log.info("upstream resolver failed", extra={"sandbox_id": g.sandbox_id,
                                                        "error": type(exc).__name__})
            r = dns.message.make_response(q)
            r.set_rcode(dns.rcode.SERVFAIL)
            return r.to_wire()
        addrs = [(rd.address, rrset.ttl) for rrset in resp.answer
                 if rrset.rdtype == dns.rdatatype.A for rd in rrset]
        if addrs:
            admit = self.guard.record(g, name, addrs, ports)
            if self.guard.listeners:
                self.guard.changed(g)
            if admit:
                try:
                    await self.guard.net.admit_async(g.sandbox_id, admit[:256])
                except Exception as exc:  # the answer still goes: the guest retries
                    if not g.warned:  # once per sandbox (e.g. its sets are full)
                        g.warned = True
                        log.warning("admitting resolved addresses failed", extra={
                            "sandbox_id": g.sandbox_id, "error": str(exc)})
        out = resp.to_wire()
        limit = 65535 if tcp else max(512, q.payload if q.edns >= 0 else 512)
        if len(out) > limit:
            r = dns.message.make_response(q)
            r.flags |= dns.flags.TC
            out = r.to_wire()
        return out

    async def _udp_query(self, transport: asyncio.DatagramTransport, g: Any, data: bytes,
                         addr: tuple[str, int]) -> None:
        try:
            out = await self._answer(g, data, tcp=False)
        except Exception:  # a bug answers nothing; the forwarder lives on
            log.exception("DNS query failed")
            return
        finally:
            g.leave()
        if out is not None and not transport.is_closing():
            transport.sendto(out, addr)

    async def _serve_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
                         ) -> None:
        source = writer.get_extra_info("peername")[0]
        g = None
        try:
            g = self.guard.lookup(source)
            if g is None or not g.enter():  # unknown, or this guest has too many open
                g = None
                return
            while True:
                head = await asyncio.wait_for(reader.readexactly(2), TCP_IDLE_S)
                (n,) = struct.unpack("!H", head)
                if not 12 <= n <= MAX_QUERY:
                    return
                wire = await asyncio.wait_for(reader.readexactly(n), TCP_IDLE_S)
                out = await self.answer(wire, source, tcp=True)
                if out is None:
                    return
                writer.write(struct.pack("!H", len(out)) + out)
                await writer.drain()
        except (asyncio.IncompleteReadError, TimeoutError, ConnectionError, OSError):
            pass
        finally:
            if g is not None:
                g.leave()
            writer.close()


class _Udp(asyncio.DatagramProtocol):
    def __init__(self, fwd: DnsForwarder) -> None:
        self.fwd = fwd
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        if self.transport is not None:
            self.fwd._datagram(self.transport, data, addr)


def _one_question(wire: bytes) -> bool:
    """Whether the header of ``wire`` (at most ``MAX_QUERY`` bytes) says what a query that
    is answered holds: a standard query (QR 0, opcode 0) of one question and no records
    but an EDNS one. Checked before the message is parsed: a guest's 4 KiB query of 340
    records cost the loop about 29 ms to parse and refuse (review 29h H-H4)."""
    if not 12 <= len(wire) <= MAX_QUERY:
        return False
    _, flags, qd, an, ns, ar = struct.unpack("!HHHHHH", wire[:12])
    return flags & 0xF800 == 0 and (qd, an, ns) == (1, 0, 0) and ar <= 1


def _formerr(wire: bytes) -> bytes:
    """A FORMERR answer echoing the query's id (the header is all that is trusted)."""
    (ident,) = struct.unpack("!H", wire[:2])
    return struct.pack("!HHHHHH", ident, 0x8000 | dns.rcode.FORMERR, 0, 0, 0, 0)
