"""The certificate authority of one sandbox's secret proxy (``hangar.core.secret_proxy``):
made on the host when the sandbox is made, its certificate written into the guest's trust
(``CA_FILE`` and the system bundle) through the agent, its key handed to the proxy only.
"""

from __future__ import annotations

import datetime
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID

from hangar.core.secrets import CA_FILE, SYSTEM_BUNDLE
from hangar.engines.agent_client import exec_meta


def make_ca(sandbox_id: str) -> tuple[str, bytes]:
    """A new certificate authority for one sandbox's proxy: (certificate PEM, key PEM).
    RSA 2048, valid from a day ago for ten years, may sign only end certificates."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Hangar"),
                      x509.NameAttribute(NameOID.COMMON_NAME, f"Hangar sandbox {sandbox_id}")])
    now = datetime.datetime.now(datetime.timezone.utc)
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=3650))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                         crl_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .add_extension(ski, critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski),
                           critical=False)
            .sign(key, hashes.SHA256()))
    key_pem = key.private_bytes(serialization.Encoding.PEM,
                                serialization.PrivateFormat.TraditionalOpenSSL,
                                serialization.NoEncryption())
    return cert.public_bytes(serialization.Encoding.PEM).decode(), key_pem


INSTALL_CA = r"""
set -e
mkdir -p "$(dirname "$CA_FILE")"
printf '%s' "$CERT" > "$CA_FILE.tmp" && mv "$CA_FILE.tmp" "$CA_FILE"
mkdir -p "$(dirname "$BUNDLE")"
if ! grep -qF "$MARK" "$BUNDLE" 2>/dev/null; then
  { cat "$BUNDLE" 2>/dev/null || true; printf '%s\n' "$CERT"; } > "$BUNDLE.tmp"
  mv "$BUNDLE.tmp" "$BUNDLE"
fi
"""


def install_ca_meta(cert_pem: str) -> dict[str, Any]:
    """The guest exec that writes ``cert_pem`` to ``CA_FILE`` and appends it to the system
    bundle once (a restored guest that has it already is left as it is)."""
    mark = cert_pem.strip().splitlines()[1]  # the certificate's first base64 line
    return exec_meta(argv=["/bin/sh", "-c", INSTALL_CA], timeout=30,
                     env={"CERT": cert_pem, "CA_FILE": CA_FILE, "BUNDLE": SYSTEM_BUNDLE,
                          "MARK": mark})
