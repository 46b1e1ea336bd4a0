"""The stand-in internet of tests/egress_lab.py, run in its namespace.

``python egress_inet.py DNS_IP NAMES_JSON DIR``: a DNS server (dnspython
messages, UDP and TCP) on DNS_IP:53 answering the A record of each name in
NAMES_JSON (TTL 30 s) and NXDOMAIN for the rest; HTTP on ports 80 and 8080 of
every address and HTTPS (a self-signed certificate made here with openssl) on
443 and 8443, all answering ``hello <local address> <Host>``. Writes DIR/ready
when all listen; runs until killed.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import subprocess
import sys
from pathlib import Path

import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset


def answer(wire: bytes, names: dict[str, str]) -> bytes:
    q = dns.message.from_wire(wire)
    r = dns.message.make_response(q)
    question = q.question[0]
    name = question.name.to_text().rstrip(".").lower()
    if name in names and question.rdtype == dns.rdatatype.A:
        r.answer.append(dns.rrset.from_text(question.name, 30, "IN", "A", names[name]))
    elif name not in names:
        r.set_rcode(dns.rcode.NXDOMAIN)
    return r.to_wire()


class Udp(asyncio.DatagramProtocol):
    def __init__(self, names: dict[str, str]) -> None:
        self.names = names

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.transport.sendto(answer(data, self.names), addr)  # type: ignore[attr-defined]


async def main() -> None:
    dns_ip, names, folder = sys.argv[1], json.loads(sys.argv[2]), Path(sys.argv[3])
    loop = asyncio.get_running_loop()
    await loop.create_datagram_endpoint(lambda: Udp(names), local_addr=(dns_ip, 53))

    async def tcp_dns(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        n = int.from_bytes(await r.readexactly(2), "big")
        out = answer(await r.readexactly(n), names)
        w.write(len(out).to_bytes(2, "big") + out)
        await w.drain()
        w.close()

    async def http(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            head = (await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 10)).decode("latin-1")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
            w.close()
            return
        host = next((ln.split(":", 1)[1].strip() for ln in head.split("\r\n")
                     if ln.lower().startswith("host:")), "")
        body = f"hello {w.get_extra_info('sockname')[0]} {host}\n".encode()
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
                % (len(body), body))
        await w.drain()
        w.close()

    await asyncio.start_server(tcp_dns, dns_ip, 53)
    await asyncio.start_server(http, "0.0.0.0", 80)
    await asyncio.start_server(http, "0.0.0.0", 8080)  # a port no proxy sees
    key, cert = folder / "key.pem", folder / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                    "-subj", "/CN=a.example.test", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    await asyncio.start_server(http, "0.0.0.0", 443, ssl=ctx)
    await asyncio.start_server(http, "0.0.0.0", 8443, ssl=ctx)  # a port no proxy sees
    (folder / "ready").write_text("ok")
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main())
