"""The cluster's certificates: a CA, a server certificate per etcd member, a client one per node.

etcd runs with TLS on both of its ports and with ``--client-cert-auth``:
only a holder of a certificate signed by the cluster's CA reads or writes a
record, and members talk to each other only with theirs
(``--peer-client-cert-auth``). ``hangar cluster certs`` writes them
(``make``) with the ``cryptography`` library (ECDSA P-256, SHA-256)::

    OUT/ca.crt, OUT/ca.key          the cluster CA (10 years); keep ca.key off the nodes
    OUT/<node>/ca.crt               the CA's certificate (to check the other side)
    OUT/<node>/etcd.crt, etcd.key   the etcd member on this node: server and peer
                                    certificate for its address, 127.0.0.1 and
                                    localhost (serverAuth and clientAuth: etcd's JSON
                                    gateway dials its own gRPC port with it)
    OUT/<node>/node.crt, node.key   the Hangar node's client certificate (CN
                                    ``hangar-node-<node>``, clientAuth only)

Every file is written 0600 (the folder 0700) by an atomic rename; the
installer gives the ``etcd.*`` files to the etcd user and the rest to the
user the server runs as. A node reads its folder from ``HANGAR_ETCD_PKI``
(``tls_from``) and refuses an etcd URL that is not ``https://``.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import ssl
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from hangar.errors import ConfigError

CA_DAYS = 3650
CERT_DAYS = 1825
FILES = ("ca.crt", "node.crt", "node.key")
"""What a node needs in its folder (``tls_from``)."""


@dataclass(frozen=True)
class Tls:
    """A node's (or operator's) client side of etcd's TLS: CA, certificate, key (paths)."""

    ca: Path
    cert: Path
    key: Path

    def context(self) -> ssl.SSLContext:
        """A client context that checks etcd's certificate against ``ca`` and presents
        ``cert``. Raises ConfigError when a file is missing or unreadable."""
        try:
            ctx = ssl.create_default_context(cafile=str(self.ca))
            ctx.load_cert_chain(str(self.cert), str(self.key))
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"etcd's TLS files cannot be read ({self.ca}, {self.cert}, "
                              f"{self.key}): {exc}") from None
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        return ctx


def tls_from(folder: Path) -> Tls:
    """The client files of a node's folder (``ca.crt``, ``node.crt``, ``node.key``).
    Raises ConfigError naming what is missing."""
    missing = [f for f in FILES if not (folder / f).is_file()]
    if missing:
        raise ConfigError(f"etcd's TLS folder {folder} lacks {', '.join(missing)}; make it "
                          "with `hangar cluster certs` and copy the node's folder here "
                          "(HANGAR_ETCD_PKI)")
    return Tls(folder / "ca.crt", folder / "node.crt", folder / "node.key")


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def make(out: Path, members: Iterable[tuple[str, str]]) -> list[Path]:
    """Write the CA (once: an existing ``ca.crt``/``ca.key`` is reused) and each member's
    folder under ``out``. ``members``: (node name, IP address of its etcd member).
    Returns the node folders. Raises ConfigError for a bad name or address."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    from hangar.cluster.records import NODE_NAME

    members = list(members)
    for name, ip in members:
        if not NODE_NAME.fullmatch(name):
            raise ConfigError(f"bad node name {name!r} (letters, digits, '.', '_', '-')")
        try:
            ipaddress.ip_address(ip)
        except ValueError:
            raise ConfigError(f"bad address {ip!r} for node {name} (an IP address)") from None
    out.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(out, 0o700)
    now = dt.datetime.now(dt.timezone.utc)
    pem = serialization.Encoding.PEM

    def key_pem(k: ec.EllipticCurvePrivateKey) -> bytes:
        return k.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                               serialization.NoEncryption())

    if (out / "ca.crt").is_file() and (out / "ca.key").is_file():
        ca_cert = x509.load_pem_x509_certificate((out / "ca.crt").read_bytes())
        ca_key = serialization.load_pem_private_key((out / "ca.key").read_bytes(), None)
        assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    else:
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "hangar cluster CA")])
        ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
                   .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - dt.timedelta(minutes=5))
                   .not_valid_after(now + dt.timedelta(days=CA_DAYS))
                   .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                   .add_extension(x509.KeyUsage(
                       digital_signature=False, content_commitment=False,
                       key_encipherment=False, data_encipherment=False, key_agreement=False,
                       key_cert_sign=True, crl_sign=True, encipher_only=False,
                       decipher_only=False), critical=True)
                   .sign(ca_key, hashes.SHA256()))
        _write(out / "ca.key", key_pem(ca_key))
        _write(out / "ca.crt", ca_cert.public_bytes(pem))

    def issue(cn: str, usages: list[x509.ObjectIdentifier],
              ips: list[str], dns: list[str]) -> tuple[bytes, bytes]:
        key = ec.generate_private_key(ec.SECP256R1())
        b = (x509.CertificateBuilder()
             .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
             .issuer_name(ca_cert.subject).public_key(key.public_key())
             .serial_number(x509.random_serial_number())
             .not_valid_before(now - dt.timedelta(minutes=5))
             .not_valid_after(now + dt.timedelta(days=CERT_DAYS))
             .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
             .add_extension(x509.ExtendedKeyUsage(usages), critical=False))
        if ips or dns:
            b = b.add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
                + [x509.DNSName(d) for d in dns]), critical=False)
        cert = b.sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
        return cert.public_bytes(pem), key_pem(key)

    server = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    folders = []
    for name, ip in members:
        d = out / name
        d.mkdir(exist_ok=True, mode=0o700)
        os.chmod(d, 0o700)
        _write(d / "ca.crt", ca_cert.public_bytes(pem))
        crt, key = issue(f"etcd-{name}", server, sorted({ip, "127.0.0.1"}), ["localhost"])
        _write(d / "etcd.crt", crt)
        _write(d / "etcd.key", key)
        crt, key = issue(f"hangar-node-{name}", [ExtendedKeyUsageOID.CLIENT_AUTH], [], [])
        _write(d / "node.crt", crt)
        _write(d / "node.key", key)
        folders.append(d)
    return folders


def etcd_flags(folder: Path) -> list[str]:
    """etcd's command-line flags for a member: TLS on both ports with client certificates,
    from a member's folder (``make``), and Raft's pre-vote (``--pre-vote``).

    Pre-vote is off by default in etcd 3.4 (Debian 12's). Without it a member that was cut
    off keeps raising its term and, when it comes back, deposes the leader: the whole
    cluster then takes no write, and renews no lease, for an election (measured: 2 s here),
    which a node that renewed last before it may read as being cut off itself."""
    ca, crt, key = (str(folder / f) for f in ("ca.crt", "etcd.crt", "etcd.key"))
    return ["--client-cert-auth", "--trusted-ca-file", ca, "--cert-file", crt,
            "--key-file", key, "--peer-client-cert-auth", "--peer-trusted-ca-file", ca,
            "--peer-cert-file", crt, "--peer-key-file", key, "--pre-vote"]
