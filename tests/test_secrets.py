"""Secrets that never enter the guest (issue 22, part 2): the vault and the
secret-injecting egress proxy, with a real server, real VMs and a real mitmproxy.

Topology (network namespaces of its own, so nothing collides with
tests/test_network.py's hg-inet/hg-host or tests/test_egress.py's hg-eg-*)::

    hg-sc-inet  203.0.113.1/24: the stand-in internet; tests/secret_inet.py serves
                HTTPS on 443 and 8443 with a certificate of a test CA made here,
                answering 200 only to ``Authorization: Bearer <the real value>``
    hg-sc-host  203.0.113.2/24: Hangar's side (the server, its bridge and TAPs)

The server trusts the test CA upstream through the test-only setting
``HANGAR_SECRET_PROXY_UPSTREAM_CA``. Everything made is removed, pass or fail.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from hangar.schemas.secrets import check_hosts

NS_INET = "hg-sc-inet"
NS_HOST = "hg-sc-host"
INET = "203.0.113.1"
ROOT = Path(__file__).resolve().parent.parent
MITMDUMP = ROOT / ".venv-proxy" / "bin" / "mitmdump"
REAL = "ghp_" + "Zq8" * 12  # the real value: it must appear nowhere but the vault's ciphertext

CLIENT = r"""
import http.client, os, socket, ssl, sys
host, port, var = sys.argv[1], int(sys.argv[2]), sys.argv[3]
ctx = ssl.create_default_context(cafile=sys.argv[4] if len(sys.argv) > 4 else None)
class C(http.client.HTTPSConnection):
    def connect(self):
        self.sock = ctx.wrap_socket(socket.create_connection(("203.0.113.1", port), 30),
                                    server_hostname=host)
c = C(host, port, context=ctx, timeout=30)
c.request("GET", "/", headers={"Authorization": "Bearer " + os.environ.get(var, "")})
r = c.getresponse()
print(r.status, r.read().decode().strip())
"""


def run(cmd: str) -> str:
    return subprocess.run(cmd, shell=True, check=True, capture_output=True, text=True).stdout


def _can_netns() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if shutil.which("nft") is None or shutil.which("ip") is None:
        return "needs ip and nft"
    if not os.access(MITMDUMP, os.X_OK):
        return f"no {MITMDUMP}: scripts/install.sh makes the proxy's environment"
    return None


def make_test_ca(folder: Path) -> tuple[Path, Path, Path]:
    """A test CA and a certificate of it for api.example.test and other.example.test:
    (CA PEM, server certificate PEM, server key PEM)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "stand-in internet CA")])
    ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(days=1))
          .not_valid_after(now + datetime.timedelta(days=30))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(True, False, False, False, False, True, True, False,
                                       False), critical=True)
          .add_extension(ski, critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME,
                                                        "api.example.test")]))
            .issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.SubjectAlternativeName([
                x509.DNSName("api.example.test"), x509.DNSName("other.example.test")]),
                critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski),
                           critical=False)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    paths = folder / "ca.pem", folder / "server.pem", folder / "server.key"
    paths[0].write_bytes(ca.public_bytes(pem))
    paths[1].write_bytes(cert.public_bytes(pem))
    paths[2].write_bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return paths


@dataclass
class Inet:
    folder: Path
    ca: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)


def _delete_namespaces() -> None:
    for ns in (NS_HOST, NS_INET):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


@pytest.fixture(scope="module")
def inet() -> Iterator[Inet]:
    reason = _can_netns()
    if reason:
        pytest.skip(reason)
    with stand_in_internet() as topo:
        yield topo


@contextlib.contextmanager
def stand_in_internet() -> Iterator[Inet]:
    """The two namespaces and the HTTPS server (see the module docstring); all removed
    on the way out."""
    _delete_namespaces()  # left over by a killed run
    folder = Path(tempfile.mkdtemp(prefix="hg-sc-"))
    ca, cert, key = make_test_ca(folder)
    topo = Inet(folder, ca)
    try:
        run(f"ip netns add {NS_INET} && ip netns add {NS_HOST}")
        run(f"ip link add hgsc-host netns {NS_HOST} type veth peer name hgsc-inet "
            f"netns {NS_INET}")
        run(f"ip -n {NS_INET} addr add {INET}/24 dev hgsc-inet && "
            f"ip -n {NS_INET} link set hgsc-inet up && ip -n {NS_INET} link set lo up")
        run(f"ip -n {NS_HOST} addr add 203.0.113.2/24 dev hgsc-host && "
            f"ip -n {NS_HOST} link set hgsc-host up && ip -n {NS_HOST} link set lo up && "
            f"ip -n {NS_HOST} route add default via {INET}")
        srv = subprocess.Popen(
            ["ip", "netns", "exec", NS_INET, sys.executable,
             str(Path(__file__).with_name("secret_inet.py")), str(cert), str(key), REAL,
             "443", "8443"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            start_new_session=True)
        topo.procs.append(srv)
        assert srv.stdout is not None and srv.stdout.readline().strip() == b"ready"
        yield topo
    finally:
        for p in topo.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        _delete_namespaces()
        shutil.rmtree(folder, ignore_errors=True)
        left = run("ip netns list")
        assert NS_HOST not in left and NS_INET not in left, left


@dataclass
class Hangar:
    data: Path
    proc: subprocess.Popen[bytes]
    client: object
    key_file: Path


def start_server(inet: Inet, base_image: Path) -> Hangar:
    """A Hangar server in hg-sc-host on a Unix socket, its proxies trusting the test CA."""
    import httpx
    from conftest import SRC, make_data_dir, server_python

    d = make_data_dir(base_image)
    upstream = d / "upstream-ca.pem"
    shutil.copy(inet.ca, upstream)
    sock = d / "api.sock"
    env = {**os.environ, "HANGAR_DATA_DIR": str(d), "HANGAR_UDS": str(sock),
           "HANGAR_POOL_SIZE": "0", "HANGAR_NETWORK": "tap", "HANGAR_NET_DNS": INET,
           "HANGAR_SECRET_PROXY_MITMDUMP": str(MITMDUMP),
           "HANGAR_SECRET_PROXY_UPSTREAM_CA": str(upstream), "PYTHONPATH": str(SRC)}
    python = server_python(env)
    proc = subprocess.Popen(["ip", "netns", "exec", NS_HOST, python, "-m", "hangar.cli",
                             "serve"], env=env, stdout=open(d / "server.log", "wb"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 90
    while not sock.exists() and time.monotonic() < deadline:
        assert proc.poll() is None, (d / "server.log").read_text()[-2000:]
        time.sleep(0.2)
    key = (d / "api-key").read_text().strip()
    client = httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)),
                          base_url="http://hangar", headers={"X-API-Key": key}, timeout=300)
    return Hangar(d, proc, client, d.parent / f"{d.name}.secrets-key")


def stop_server(h: Hangar) -> list[str]:
    """Stop the server, end what it left, remove its files; what was left over."""
    from test_network import vmm_pids

    h.client.close()  # type: ignore[attr-defined]
    try:
        os.killpg(h.proc.pid, signal.SIGTERM)
        h.proc.wait(30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(h.proc.pid, signal.SIGKILL)
    leaked = [f"vmm {p}" for p in vmm_pids(str(h.data))]
    for pid in vmm_pids(str(h.data)):
        os.kill(pid, signal.SIGKILL)
    proxies = subprocess.run(["pgrep", "-f", f"confdir={h.data}/secret-proxies"],
                             capture_output=True, text=True).stdout.split()
    for pid in proxies:
        os.kill(int(pid), signal.SIGKILL)
    leaked += [f"proxy {p}" for p in proxies]
    subprocess.run(["ip", "-n", NS_HOST, "link", "del", "hgbr0"], capture_output=True)
    shutil.rmtree(h.data, ignore_errors=True)
    h.key_file.unlink(missing_ok=True)
    return leaked


def test_vault_hosts_are_checked() -> None:
    assert check_hosts(["API.example.test.", "*.Example.test"]) == [
        "api.example.test", "*.example.test"]
    for bad in (["http://x.test"], ["*"], ["a..b"], [], ["x"] * 17):
        with pytest.raises(ValueError):
            check_hosts(bad)


@pytest.mark.vm
def test_secret_reaches_its_host_only_and_never_the_guest(inet: Inet, base_image: Path) -> None:
    h = start_server(inet, base_image)
    c = h.client
    sid = snap = None
    try:
        # the vault: bad input is a 400 with a message, a second POST a 409, no value shown
        r = c.post("/secrets", json={"name": "gh", "value": REAL, "hosts": ["ftp://x"]})
        assert r.status_code == 422 and "host" in r.text, r.text
        r = c.post("/secrets", json={"name": "gh", "value": "a\nb", "hosts": ["x.test"]})
        assert r.status_code == 422 and "control" in r.text, r.text
        r = c.post("/secrets", json={"name": "gh", "value": REAL,
                                     "hosts": ["api.example.test"]})
        assert r.status_code == 201, r.text
        assert REAL not in r.text
        assert c.post("/secrets", json={"name": "gh", "value": REAL,
                                        "hosts": ["x.test"]}).status_code == 409
        listed = c.get("/secrets").json()
        assert [s["name"] for s in listed["secrets"]] == ["gh"] and REAL not in json.dumps(listed)
        assert c.post("/sandboxes", json={"secrets": {"T": "nope"}}).status_code == 404
        r = c.post("/sandboxes", json={"secrets": {"T": "gh"}, "network": "none"})
        assert r.status_code == 400 and "network" in r.text, r.text

        r = c.post("/sandboxes", json={"secrets": {"GITHUB_TOKEN": "gh"}})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]

        def guest(args: list[str], **extra: object) -> dict:
            r = c.post(f"/sandboxes/{sid}/exec", json={"command": args[0], "args": args[1:],
                                                       "timeout": 60, **extra})
            assert r.status_code == 200, r.text
            return r.json()

        env = guest(["/bin/sh", "-c", "echo $GITHUB_TOKEN"])["stdout"].strip()
        assert env.startswith("hangar-secret-") and len(env) == 46, env
        # the placeholder goes to the secret's host: the proxy puts the value in its place
        out = guest(["python3", "-c", CLIENT, "api.example.test", "443", "GITHUB_TOKEN"])
        assert out["stdout"].strip() == "200 ok", out
        # and anywhere else it is refused by the proxy, which says so in an event
        out = guest(["python3", "-c", CLIENT, "other.example.test", "443", "GITHUB_TOKEN"])
        assert out["stdout"].startswith("403 hangar: secret gh refused"), out
        # a background process keeps the placeholder in guest memory for the grep below
        r = c.post(f"/sandboxes/{sid}/processes", json={"command": "sleep", "args": ["600"]})
        assert r.status_code in (200, 201), r.text
        procs = guest(["/bin/sh", "-c", "cat /proc/[0-9]*/environ | tr '\\0' '\\n' | "
                                        f"grep -c {REAL[:20]} || true"])
        assert procs["stdout"].strip() == "0", procs
        events = []
        with c.stream("GET", "/events", params={"kind": "secret"},
                      headers={"Last-Event-ID": "0"}, timeout=10) as s:
            deadline = time.monotonic() + 10
            for line in s.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    break
                if time.monotonic() > deadline:
                    break
        assert events and events[0]["kind"] == "secret.refused", events
        assert events[0]["sandbox_id"] == sid and events[0]["data"]["secret"] == "gh"
        assert events[0]["data"]["host"] == "other.example.test"

        # a snapshot's memory holds the placeholder, never the value
        r = c.post(f"/sandboxes/{sid}/snapshot")
        assert r.status_code in (200, 201), r.text
        snap = r.json()["id"]
        files = [p for p in (h.data / "snapshots" / snap).rglob("*") if p.is_file()]
        assert files
        seen_placeholder = False
        for f in files:
            with open(f, "rb") as fh:
                tail = b""
                while chunk := fh.read(16 << 20):
                    buf = tail + chunk
                    assert REAL.encode() not in buf, f
                    seen_placeholder = seen_placeholder or env.encode() in buf
                    tail = buf[-64:]
        assert seen_placeholder, "the grep found not even the placeholder: it proves nothing"
        # still working after the snapshot; a rotated value is used at once
        out = guest(["python3", "-c", CLIENT, "api.example.test", "443", "GITHUB_TOKEN"])
        assert out["stdout"].strip() == "200 ok", out
        # a backup holds no value
        backup = h.data / "backup-test.db"
        out = subprocess.run([sys.executable, "-m", "hangar.cli", "backup", str(backup),
                              "--data-dir", str(h.data)], capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, timeout=120)
        assert out.returncode == 0, out.stderr
        assert REAL.encode() not in backup.read_bytes()
        assert c.delete(f"/sandboxes/{sid}").status_code == 204
        sid = None
        assert c.delete(f"/snapshots/{snap}").status_code == 204
        snap = None
        assert not list((h.data / "secret-proxies").glob("*"))
        assert c.delete("/secrets/gh").status_code == 204
        assert c.get("/secrets").json()["secrets"] == []
    finally:
        for s in (sid,):
            if s:
                c.delete(f"/sandboxes/{s}")
        if snap:
            c.delete(f"/snapshots/{snap}")
        log = (h.data / "server.log").read_bytes()
        leaked = stop_server(h)
    assert REAL.encode() not in log
    assert not leaked, leaked
