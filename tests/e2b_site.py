"""A one-host E2B_DOMAIN site for tests: a local CA, a wildcard DNS server and nginx.

E2B's SDKs, configured with ``E2B_DOMAIN`` and ``E2B_API_KEY`` alone, call
``https://api.<domain>`` and ``https://<port>-<id>.<domain>`` on port 443. ``site``
sets up, for a Hangar server already listening on ``upstream`` with
``HANGAR_DOMAIN=<domain>``, what a user's host has (docs/e2b.md, "E2B_DOMAIN: one host"):

* a local CA and a wildcard certificate for ``*.<domain>`` and ``<domain>``
  (``cryptography``), in ``folder/pki``;
* a loopback address of its own (``127.x.y.z``, unique to the run: ports 53, 80 and 443
  there collide with nothing else on the host);
* a wildcard DNS server (dnspython) on that address, port 53, answering that address for
  ``<domain>`` and every name under it, and a ``resolv.conf`` naming it;
* nginx, with the site ``hangar deploy nginx --e2b-domain`` renders, on that address.

Programs run in a mount namespace of their own (``wrap``: ``unshare --mount``) whose
``/etc/resolv.conf`` is that file, with ``SSL_CERT_FILE`` and ``NODE_EXTRA_CA_CERTS``
naming the CA (``env``): nothing of the host's changes. Used by tests/test_e2b_domain.py
and, as ``python tests/e2b_site.py``, by scripts/e2b-conformance.sh, which keeps the site
up until it is sent SIGTERM. Everything made is removed when the site ends, pass or fail:
nginx is ended by its pid, the DNS server stopped and ``folder`` deleted.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import ipaddress
import json
import os
import random
import shutil
import signal
import socket
import socketserver
import sys
import threading
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import dns.flags
import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from ops_support import Nginx, hangar_cli


def make_pki(folder: Path, domain: str) -> tuple[Path, Path, Path]:
    """(CA certificate, wildcard certificate for ``*.<domain>`` and ``<domain>``, its key),
    PEM files in ``folder``, valid for a day."""
    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "Hangar E2B_DOMAIN test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()),
                         critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"*.{domain}")]))
            .issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.DNSName(f"*.{domain}"), x509.DNSName(domain)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    ca_pem, cert_pem, key_pem = folder / "ca.pem", folder / "wildcard.pem", folder / "wildcard.key"
    ca_pem.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    cert_pem.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_pem.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                          serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    key_pem.chmod(0o600)
    return ca_pem, cert_pem, key_pem


class WildcardDNS(socketserver.ThreadingUDPServer):
    """A DNS server for one zone: ``<domain>`` and every name under it have one A record
    (``address``), no AAAA; any other name is REFUSED (nothing is forwarded)."""

    daemon_threads = True

    def __init__(self, address: str, domain: str) -> None:
        self.answer = address
        self.zone = domain.lower().rstrip(".")
        super().__init__((address, 53), _DNSHandler)


class _DNSHandler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        data, sock = self.request
        server: WildcardDNS = self.server  # type: ignore[assignment]
        try:
            query = dns.message.from_wire(data)
        except Exception:
            return
        reply = dns.message.make_response(query)
        reply.flags |= dns.flags.AA
        for q in query.question:
            name = q.name.to_text().lower().rstrip(".")
            if name != server.zone and not name.endswith("." + server.zone):
                reply.set_rcode(dns.rcode.REFUSED)
            elif q.rdtype == dns.rdatatype.A:
                reply.answer.append(dns.rrset.from_text(q.name, 5, "IN", "A", server.answer))
        sock.sendto(reply.to_wire(), self.client_address)


class NoLoopbackAddress(RuntimeError):
    """Ports 53, 80 or 443 are taken on every loopback address tried."""


def own_loopback() -> str:
    """A loopback address no other run uses now: ports 53 (UDP), 80 and 443 free there.

    Raises ``NoLoopbackAddress`` when every address tried has one of them taken (a server
    listening on 0.0.0.0 holds them)."""
    rng = random.Random(f"{os.getpid()}-{uuid.uuid4()}")
    for _ in range(50):
        addr = str(ipaddress.IPv4Address(f"127.{rng.randrange(16, 250)}."
                                         f"{rng.randrange(1, 250)}.{rng.randrange(2, 250)}"))
        try:
            for kind, port in ((socket.SOCK_DGRAM, 53), (socket.SOCK_STREAM, 80),
                               (socket.SOCK_STREAM, 443)):
                with socket.socket(socket.AF_INET, kind) as s:
                    s.bind((addr, port))
        except OSError:
            continue
        return addr
    raise NoLoopbackAddress("ports 53, 80 or 443 are taken on every loopback address tried "
                            "(a server listening on 0.0.0.0 holds them)")


@dataclass(frozen=True)
class SiteFiles:
    """A running site: its ``domain``, the loopback ``address`` nginx and the DNS server
    listen on, the ``ca`` (PEM) that signed its certificate, and the ``resolv`` file that
    names its DNS server."""

    domain: str
    address: str
    ca: Path
    resolv: Path

    def env(self, base: Mapping[str, str], api_key: str) -> dict[str, str]:
        """``base`` with every ``E2B_*`` variable, proxy and ``PYTHONPATH`` taken out, and
        ``E2B_DOMAIN``, ``E2B_API_KEY`` and the CA for Python and Node put in."""
        env = {k: v for k, v in base.items()
               if not k.startswith("E2B_") and k.lower() not in (
                   "http_proxy", "https_proxy", "all_proxy", "no_proxy")}
        env.pop("PYTHONPATH", None)
        env.update({"E2B_DOMAIN": self.domain, "E2B_API_KEY": api_key,
                    "SSL_CERT_FILE": str(self.ca), "NODE_EXTRA_CA_CERTS": str(self.ca)})
        return env

    def wrap(self, argv: list[str]) -> list[str]:
        """``argv`` run in a mount namespace whose /etc/resolv.conf is ``resolv``."""
        return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
                'mount --bind "$0" /etc/resolv.conf && exec "$@"', str(self.resolv), *argv]


@contextlib.contextmanager
def site(folder: Path, domain: str, upstream: str) -> Iterator[SiteFiles]:
    """The site for ``domain`` in front of the Hangar server at ``upstream`` (host:port,
    started with ``HANGAR_DOMAIN=<domain>``), its files in ``folder`` (made here, deleted
    afterwards). Needs root (ports 53 and 443, ``unshare``) and Debian's nginx.

    Raises ``NoLoopbackAddress``; ``RuntimeError`` when nginx does not start."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        address = own_loopback()
        ca, cert, key = make_pki(folder / "pki", domain)
        resolv = folder / "resolv.conf"
        resolv.write_text(f"nameserver {address}\noptions timeout:2 attempts:2\n")
        dns_server = WildcardDNS(address, domain)
        threading.Thread(target=dns_server.serve_forever, daemon=True).start()
        try:
            conf = folder / "hangar-site.conf"
            hangar_cli("deploy", "nginx", "--domain", domain, "--e2b-domain", domain,
                       "--address", address, "--output", str(conf), "--upstream", upstream,
                       "--cert", str(cert), "--key", str(key), "--e2b-cert", str(cert),
                       "--e2b-key", str(key), "--acme-root", str(folder),
                       "--https-port", "443", "--http-port", "80")
            nginx = Nginx(folder / "nginx", conf)
            t = nginx.test_config()
            if t.returncode != 0:
                raise RuntimeError(f"nginx refuses the site: {t.stderr}")
            nginx.start(443, host=address)
            try:
                yield SiteFiles(domain, address, ca, resolv)
            finally:
                nginx.stop()
        finally:
            dns_server.shutdown()
            dns_server.server_close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """Keep a site up until SIGTERM or SIGINT; print its files as one JSON line
    (``{"domain", "address", "ca", "resolv"}``) to ``--ready`` once it serves."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--domain", required=True)
    p.add_argument("--upstream", required=True, help="the Hangar server, host:port")
    p.add_argument("--folder", required=True, type=Path, help="made here, deleted at the end")
    p.add_argument("--ready", required=True, type=Path, help="file the JSON line is written to")
    args = p.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    with site(args.folder, args.domain, args.upstream) as s:
        tmp = args.ready.with_suffix(".tmp")
        tmp.write_text(json.dumps({"domain": s.domain, "address": s.address,
                                   "ca": str(s.ca), "resolv": str(s.resolv)}) + "\n")
        tmp.rename(args.ready)
        stop.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
