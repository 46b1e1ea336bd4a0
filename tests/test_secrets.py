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

import base64
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
from netns import can_netns, delete_namespaces, kill_groups, remove_namespaces, run

NS_INET = "hg-sc-inet"
NS_HOST = "hg-sc-host"
INET = "203.0.113.1"
ROOT = Path(__file__).resolve().parent.parent
MITMDUMP = ROOT / ".venv-proxy" / "bin" / "mitmdump"
REAL = "ghp_" + "Zq8" * 12  # the real value: it must appear nowhere but the vault's ciphertext

CLIENT = r"""
import base64, http.client, os, socket, ssl, sys
host, port, var = sys.argv[1], int(sys.argv[2]), sys.argv[3]
path = sys.argv[4] if len(sys.argv) > 4 else "/"
ip = sys.argv[5] if len(sys.argv) > 5 else "203.0.113.1"
ctx = ssl.create_default_context()
class C(http.client.HTTPSConnection):
    def connect(self):
        self.sock = ctx.wrap_socket(socket.create_connection((ip, port), 30),
                                    server_hostname=host)
class P(http.client.HTTPConnection):
    def connect(self):
        self.sock = socket.create_connection((ip, port), 30)
c = (P if port == 80 else C)(host, port, timeout=30)
token = os.environ.get(var, "")
basic = path.startswith("/basic")  # /basic: to /, /basic-echo: to /echo
auth = ("Basic " + base64.b64encode(("x-access-token:" + token).encode()).decode()
        if basic else "Bearer " + token)
c.request("GET", {"/basic": "/", "/basic-echo": "/echo"}.get(path, path),
          headers={"Authorization": auth})
r = c.getresponse()
print(r.status, r.read().decode().strip())
"""


def _can_netns() -> str | None:
    if (why := can_netns()) is not None:
        return why
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
    delete_namespaces(NS_HOST, NS_INET)  # left over by a killed run
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
        kill_groups(topo.procs)
        remove_namespaces(NS_HOST, NS_INET)
        shutil.rmtree(folder, ignore_errors=True)


@dataclass
class Hangar:
    data: Path
    proc: subprocess.Popen[bytes]
    client: object
    key_file: Path
    env: dict[str, str]


def start_server(inet: Inet, base_image: Path, extra: dict[str, str] | None = None) -> Hangar:
    """A Hangar server in hg-sc-host on a Unix socket, its proxies trusting the test CA
    (``extra``: more of its environment)."""
    from conftest import SRC, make_data_dir, server_python

    d = make_data_dir(base_image)
    upstream = d / "upstream-ca.pem"
    shutil.copy(inet.ca, upstream)
    env = {**os.environ, "HANGAR_DATA_DIR": str(d), "HANGAR_UDS": str(d / "api.sock"),
           "HANGAR_POOL_SIZE": "0", "HANGAR_NETWORK": "tap", "HANGAR_NET_DNS": INET,
           "HANGAR_SECRET_PROXY_MITMDUMP": str(MITMDUMP),
           "HANGAR_SECRET_PROXY_UPSTREAM_CA": str(upstream), "PYTHONPATH": str(SRC),
           "HANGAR_SECRETS_KEY_FILE": str(d.parent / f"{d.name}.secrets-key"), **(extra or {})}
    env["HANGAR_TEST_PYTHON"] = server_python(env)
    h = Hangar(d, None, None, d.parent / f"{d.name}.secrets-key", env)  # type: ignore[arg-type]
    serve(h)
    return h


def serve(h: Hangar) -> None:
    """Start (or start again) ``h``'s server and its client."""
    import httpx

    sock = h.data / "api.sock"
    sock.unlink(missing_ok=True)
    h.proc = subprocess.Popen(["ip", "netns", "exec", NS_HOST, h.env["HANGAR_TEST_PYTHON"],
                               "-m", "hangar.cli", "serve"], env=h.env,
                              stdout=open(h.data.parent / f"{h.data.name}.log", "ab"),
                              stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 90
    while not sock.exists() and time.monotonic() < deadline:
        assert h.proc.poll() is None, server_log(h)[-2000:]
        time.sleep(0.2)
    key = (h.data / "api-key").read_text().strip()
    h.client = httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)),
                            base_url="http://hangar", headers={"X-API-Key": key}, timeout=300)


def server_log(h: Hangar) -> str:
    return (h.data.parent / f"{h.data.name}.log").read_text(errors="replace")


def proxy_pids(h: Hangar, sandbox_id: str = "") -> list[str]:
    """Pids of ``h``'s secret proxies (of one sandbox when given)."""
    return subprocess.run(["pgrep", "-f", f"confdir={h.data}/secret-proxies/{sandbox_id}"],
                          capture_output=True, text=True).stdout.split()


def halt(h: Hangar) -> None:
    """Stop ``h``'s server (SIGTERM: sandboxes keep running)."""
    h.client.close()  # type: ignore[attr-defined]
    try:
        os.killpg(h.proc.pid, signal.SIGTERM)
        h.proc.wait(30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(h.proc.pid, signal.SIGKILL)


def stop_server(h: Hangar) -> list[str]:
    """Stop the server, end what it left, remove its files; what was left over."""
    from conftest import vmm_pids

    halt(h)
    leaked = [f"vmm {p}" for p in vmm_pids(str(h.data))]
    for pid in vmm_pids(str(h.data)):
        os.kill(pid, signal.SIGKILL)
    proxies = proxy_pids(h)
    for pid in proxies:
        os.kill(int(pid), signal.SIGKILL)
    leaked += [f"proxy {p}" for p in proxies]
    subprocess.run(["ip", "-n", NS_HOST, "link", "del", "hgbr0"], capture_output=True)
    shutil.rmtree(h.data, ignore_errors=True)
    h.key_file.unlink(missing_ok=True)
    (h.data.parent / f"{h.data.name}.log").unlink(missing_ok=True)
    return leaked


def test_vault_hosts_are_checked() -> None:
    assert check_hosts(["API.example.test.", "*.Example.test"]) == [
        "api.example.test", "*.example.test"]
    for bad in (["http://x.test"], ["*"], ["a..b"], [], ["x"] * 17):
        with pytest.raises(ValueError):
            check_hosts(bad)


def sse(c: object, kind: str, count: int, within: float = 10.0) -> list[dict]:
    """The first ``count`` events of ``kind`` in the server's ring (and after), as JSON."""
    got: list[dict] = []
    with c.stream("GET", "/events", params={"kind": kind},  # type: ignore[attr-defined]
                  headers={"Last-Event-ID": "0"}, timeout=within) as s:
        for line in s.iter_lines():
            if line.startswith("data: "):
                got.append(json.loads(line[6:]))
                if len(got) >= count:
                    break
    return got


ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def grep_files(files: list[Path], *needles: bytes) -> set[bytes]:
    """Which of ``needles`` occur in ``files`` (read in 16 MiB chunks, overlapping).

    A zstd file (a snapshot's compressed memory stream) is read through ``zstd -dc``,
    so what is searched is what a restore would load."""
    found: set[bytes] = set()
    for f in files:
        with open(f, "rb") as raw:
            packed = raw.read(4) == ZSTD_MAGIC
        with contextlib.ExitStack() as stack:
            if packed:
                proc = stack.enter_context(subprocess.Popen(
                    ["zstd", "-dcq", "--", str(f)], stdout=subprocess.PIPE))
                assert proc.stdout is not None
                fh = proc.stdout
            else:
                fh = stack.enter_context(open(f, "rb"))
            tail = b""
            while chunk := fh.read(16 << 20):
                buf = tail + chunk
                found |= {n for n in needles if n in buf}
                tail = buf[-128:]
            if packed:
                assert proc.wait() == 0, f"zstd could not read {f}"
    return found


def test_vault_seals_under_a_key_outside_the_store(tmp_path: Path) -> None:
    """The key file is made 0600 and refused when others can read it; values are sealed
    (the database holds no value), bound to their name, and open only under their key."""
    from hangar.core.secrets import Vault, load_key
    from hangar.core.store import Store
    from hangar.errors import ConfigError, Conflict, InvalidRequest, NotFound

    key_file = tmp_path / "conf" / "secrets.key"
    assert load_key(key_file, create=False) is None and not key_file.exists()
    key = load_key(key_file)
    assert key is not None and len(key) == 32 and (key_file.stat().st_mode & 0o777) == 0o600
    assert load_key(key_file) == key
    store = Store(tmp_path / "hangar.db")
    vault = Vault(store, key_file)
    vault.add("gh", REAL, ["api.example.test"])
    with pytest.raises(Conflict):
        vault.add("gh", REAL, ["api.example.test"])
    with pytest.raises(InvalidRequest):
        vault.add("bad", "x\ny", ["api.example.test"])
    with pytest.raises(NotFound):
        vault.check_request({"T": "nope"})
    sealed = vault.get("gh").sealed
    assert vault.open("gh", sealed) == REAL.encode()
    with pytest.raises(ConfigError):
        vault.open("other", sealed)  # bound to its name
    with pytest.raises(ConfigError):
        Vault(store, tmp_path / "another.key").open("gh", sealed)  # and to its key
    assert all(REAL.encode() not in f.read_bytes() for f in tmp_path.glob("hangar.db*"))
    os.chmod(key_file, 0o644)
    with pytest.raises(ConfigError, match="readable by others"):
        load_key(key_file)


@pytest.mark.vm
def test_secret_reaches_its_host_only_and_never_the_guest(inet: Inet, base_image: Path) -> None:
    """The vault's routes; a sandbox's placeholder replaced for its secret's host and
    refused elsewhere (another host, plain HTTP), with events; the egress rules on the
    proxy's upstream; rotation; a snapshot's memory, a fork and a server restart; and the
    value nowhere: guest environment and /proc, snapshot files, server log, events,
    a backup."""
    h = start_server(inet, base_image)
    made: list[str] = []
    snap = None
    try:
        c = h.client
        # the vault: bad input is refused with a message, a second POST is a 409
        r = c.post("/secrets", json={"name": "gh", "value": REAL, "hosts": ["ftp://x"]})
        assert r.status_code == 422 and "host" in r.text, r.text
        r = c.post("/secrets", json={"name": "gh", "value": "a\nb", "hosts": ["x.test"]})
        assert r.status_code == 422 and "control" in r.text, r.text
        r = c.post("/secrets", json={"name": "gh", "value": REAL,
                                     "hosts": ["api.example.test"]})
        assert r.status_code == 201 and REAL not in r.text, r.text
        r = c.post("/secrets", json={"name": "gh", "value": REAL, "hosts": ["x.test"]})
        assert r.status_code == 409, r.text
        listed = c.get("/secrets").json()
        assert [x["name"] for x in listed["secrets"]] == ["gh"]
        assert REAL not in json.dumps(listed)
        r = c.post("/sandboxes", json={"secrets": {"T": "nope"}})
        assert r.status_code == 404 and "nope" in r.text, r.text
        r = c.post("/sandboxes", json={"secrets": {"T": "gh"}, "network": "none"})
        assert r.status_code == 400 and "network" in r.text, r.text

        r = c.post("/sandboxes", json={"secrets": {"GITHUB_TOKEN": "gh"}})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        made.append(sid)
        # The sandbox shows its secrets by name only: no value, no placeholder.
        assert r.json()["secrets"] == {"GITHUB_TOKEN": "gh"}
        assert c.get(f"/sandboxes/{sid}").json()["secrets"] == {"GITHUB_TOKEN": "gh"}

        def guest(on: str, args: list[str]) -> str:
            r = h.client.post(f"/sandboxes/{on}/exec",  # type: ignore[attr-defined]
                              json={"command": args[0], "args": args[1:], "timeout": 60})
            assert r.status_code == 200, r.text
            return r.json()["stdout"].strip()

        def get(on: str, host: str, port: int = 443, path: str = "/",
                ip: str = INET) -> str:
            return guest(on, ["python3", "-c", CLIENT, host, str(port), "GITHUB_TOKEN",
                              path, ip])

        placeholder = guest(sid, ["/bin/sh", "-c", "echo $GITHUB_TOKEN"])
        assert placeholder.startswith("hangar-secret-") and len(placeholder) == 46
        # the secret's host gets the value in the placeholder's place
        assert get(sid, "api.example.test") == "200 ok"
        assert get(sid, "api.example.test", path="/basic") == "200 ok"  # git's Basic auth
        # a host that reflects it sends back the placeholder, not the value
        assert get(sid, "api.example.test", path="/echo") == f"200 Bearer {placeholder}"
        # so does one that reflects Basic credentials, which the proxy base64-encoded anew
        # with the value inside (review 29e M2: the guest would decode the value)
        given = base64.b64encode(f"x-access-token:{placeholder}".encode()).decode()
        assert get(sid, "api.example.test", path="/basic-echo") == f"200 Basic {given}"
        # anywhere else the proxy refuses it (nothing goes upstream) and says so
        assert get(sid, "other.example.test").startswith(
            "403 hangar: secret gh refused: other.example.test is not one of")
        assert get(sid, "api.example.test", port=80).startswith(
            "403 hangar: secret gh refused: secrets are sent only over HTTPS")
        # the proxy's upstream obeys the egress rules: never the host's own addresses
        assert get(sid, "api.example.test", ip="203.0.113.2").startswith("502 ")
        refused = sse(c, "secret.refused", 2)
        assert [(e["sandbox_id"], e["data"]["secret"], e["data"]["host"]) for e in refused] \
            == [(sid, "gh", "other.example.test"), (sid, "gh", "api.example.test")]
        denied = sse(c, "egress.denied", 1)
        assert denied[0]["sandbox_id"] == sid and denied[0]["data"]["address"] == "203.0.113.2"
        assert denied[0]["data"]["reason"] == "denied_host"
        assert REAL not in json.dumps(refused + denied)
        # rotation holds from the next request
        assert c.put("/secrets/gh", json={"value": "wrong"}).status_code == 200
        assert get(sid, "api.example.test") == "401 no"
        assert c.put("/secrets/gh", json={"value": REAL}).status_code == 200
        assert get(sid, "api.example.test") == "200 ok"
        # a rule changed at run time holds in the proxy from the next connection
        r = c.patch(f"/sandboxes/{sid}/network", json={"deny": [f"{INET}/32"]})
        assert r.status_code == 200, r.text
        assert get(sid, "api.example.test").startswith("502 ")
        assert c.patch(f"/sandboxes/{sid}/network", json={"deny": []}).status_code == 200
        assert get(sid, "api.example.test") == "200 ok"

        # the value is in no process's environment of the guest
        r = c.post(f"/sandboxes/{sid}/processes", json={"command": "sleep", "args": ["600"]})
        assert r.status_code == 201, r.text
        assert guest(sid, ["/bin/sh", "-c", "cat /proc/[0-9]*/environ | tr '\\0' '\\n' | "
                                            f"grep -c {REAL[:20]} || true"]) == "0"
        # a snapshot's files hold the placeholder (the sleep above keeps it in memory),
        # never the value
        r = c.post(f"/sandboxes/{sid}/snapshot")
        assert r.status_code == 201, r.text
        snap = r.json()["id"]
        files = [p for p in (h.data / "snapshots" / snap).rglob("*") if p.is_file()]
        found = grep_files(files, REAL.encode(), placeholder.encode())
        assert found == {placeholder.encode()}, "the grep found not even the placeholder"
        # a fork holds the same placeholder, and its own proxy resolves it
        r = c.post(f"/snapshots/{snap}/sandboxes")
        assert r.status_code == 201, r.text
        fork = r.json()["id"]
        made.append(fork)
        assert guest(fork, ["/bin/sh", "-c", "echo $GITHUB_TOKEN"]) == placeholder
        assert get(fork, "api.example.test") == "200 ok"
        assert len(proxy_pids(h)) == 2
        # asleep, no proxy; awake, its proxy again (the guest has the CA already)
        assert c.post(f"/e2b/sandboxes/{fork}/pause").status_code == 204
        assert len(proxy_pids(h)) == 1
        r = c.post(f"/e2b/sandboxes/{fork}/connect", json={"timeout": 300})
        assert r.status_code == 201, r.text
        assert get(fork, "api.example.test") == "200 ok"
        assert guest(fork, ["/bin/sh", "-c", "grep -cF \"$(sed -n 2p /usr/local/share/"
                            "ca-certificates/hangar-sandbox.crt)\" /etc/ssl/certs/"
                            "ca-certificates.crt"]) == "1"  # once, however often woken

        # a proxy that dies is started again (meanwhile the guest's web traffic is refused)
        old = proxy_pids(h, sid)
        assert len(old) == 1
        os.kill(int(old[0]), signal.SIGKILL)
        deadline = time.monotonic() + 60
        while proxy_pids(h, sid) in ([], old) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(proxy_pids(h, sid)) == 1 and proxy_pids(h, sid) != old
        assert get(sid, "api.example.test") == "200 ok"

        # a restarted server: the old proxies end with it, recovery starts new ones
        halt(h)
        time.sleep(1)
        assert proxy_pids(h) == []
        serve(h)
        c = h.client
        assert len(proxy_pids(h)) == 2
        assert get(sid, "api.example.test") == "200 ok"

        # a backup holds no value (the vault's key is not in the data directory)
        backup = h.data.parent / f"{h.data.name}-backup.db"
        out = subprocess.run([sys.executable, "-m", "hangar.cli", "backup", str(backup),
                              "--data-dir", str(h.data)], capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, timeout=120)
        try:
            assert out.returncode == 0, out.stderr
            assert REAL.encode() not in backup.read_bytes()
        finally:
            backup.unlink(missing_ok=True)
            shutil.rmtree(backup.with_suffix(".volumes"), ignore_errors=True)
        assert not list(h.data.rglob("*.secrets-key"))

        for s_ in made:
            assert c.delete(f"/sandboxes/{s_}").status_code == 204
        made.clear()
        assert c.delete(f"/snapshots/{snap}").status_code == 204
        snap = None
        assert proxy_pids(h) == [] and not list((h.data / "secret-proxies").iterdir())
        assert c.delete("/secrets/gh").status_code == 204
        assert c.get("/secrets").json()["secrets"] == []
    finally:
        for s_ in made:
            h.client.delete(f"/sandboxes/{s_}")  # type: ignore[attr-defined]
        if snap:
            h.client.delete(f"/snapshots/{snap}")  # type: ignore[attr-defined]
        log = server_log(h)
        leaked = stop_server(h)
    assert REAL not in log
    assert not leaked, leaked


BIG_CLIENT = r"""
import http.client, os, socket, ssl, sys
n, ip = int(sys.argv[1]), "203.0.113.1"
ctx = ssl.create_default_context()
class C(http.client.HTTPSConnection):
    def connect(self):
        self.sock = ctx.wrap_socket(socket.create_connection((ip, 443), 30),
                                    server_hostname="api.example.test")
auth = {"Authorization": "Bearer " + os.environ["GITHUB_TOKEN"]}
def body():
    block = bytes(1 << 16)
    for _ in range(n >> 16):
        yield block
c = C("api.example.test", 443, timeout=120)
c.request("POST", "/sink", body=body(), headers={**auth, "Content-Length": str(n)})
r = c.getresponse()
up = r.read().decode()
c.request("GET", f"/zeros?n={n}", headers=auth)
r = c.getresponse()
got, tail = 0, b""
while chunk := r.read(1 << 16):
    got += len(chunk)
    tail = (tail + chunk)[-100:]
print(up, got, tail.lstrip(b"\0").decode())
"""
"""Uploads ``n`` bytes with the secret to the stand-in's /sink, then downloads ``n`` zeros
and the header it got (the value, which the proxy must turn back into the placeholder)."""
BIG = 128 << 20
CONNS = 4
HOLD_CLIENT = r"""
import socket, ssl, sys
n = int(sys.argv[1])
held = [socket.create_connection(("203.0.113.1", 443), 10) for _ in range(n)]
ctx = ssl.create_default_context()
one = socket.create_connection(("203.0.113.1", 443), 10)
try:
    ctx.wrap_socket(one, server_hostname="api.example.test").close()
    print("over the cap: served")
except (OSError, ssl.SSLError):
    print("over the cap: closed")
for s in held:
    s.close()
"""
"""Holds ``n`` connections to the proxy, then tries one more TLS handshake."""


def test_the_proxy_streams_large_bodies_both_ways(inet: Inet, base_image: Path) -> None:
    """A guest with a secret uploads and downloads 128 MiB through its proxy: the upload
    reaches the host with the value in its header, the download's echo of the value comes
    back as the placeholder, and the proxy's memory stays flat (it streams, holding at
    most a value's length of an answer it rewrites). Its connections are capped
    (``HANGAR_SECRET_PROXY_MAX_CONNECTIONS``); it has no onboarding app; it runs in a
    memory cgroup of its own where the server may make one."""
    import threading

    h = start_server(inet, base_image, {"HANGAR_SECRET_PROXY_MAX_CONNECTIONS": str(CONNS)})
    made: list[str] = []
    try:
        c = h.client
        r = c.post("/secrets", json={"name": "gh", "value": REAL,
                                     "hosts": ["api.example.test"]})
        assert r.status_code == 201, r.text
        r = c.post("/sandboxes", json={"secrets": {"GITHUB_TOKEN": "gh"}})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        made.append(sid)
        pids = proxy_pids(h, sid)
        assert len(pids) == 1
        status = Path(f"/proc/{pids[0]}/status")

        def rss() -> int:
            text = status.read_text()
            return int(text.split("VmRSS:")[1].split()[0]) << 10

        base = peak = rss()
        done = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not done.wait(0.1):
                peak = max(peak, rss())

        t = threading.Thread(target=sample, daemon=True)
        t.start()
        try:
            r = c.post(f"/sandboxes/{sid}/exec", json={
                "command": "python3", "args": ["-c", BIG_CLIENT, str(BIG)], "timeout": 900})
        finally:
            done.set()
            t.join()
        assert r.status_code == 200, r.text
        out = r.json()
        placeholder = c.post(f"/sandboxes/{sid}/exec", json={
            "command": "/bin/sh", "args": ["-c", "echo $GITHUB_TOKEN"]}).json()["stdout"].strip()
        # (the echo is the placeholder, longer than the value: its length is not declared)
        assert out["stdout"].split() == [str(BIG), "True",
                                         str(BIG + len(f"Bearer {placeholder}")),
                                         "Bearer", placeholder], out
        grew = peak - base
        print(f"proxy RSS {base >> 20} MiB, peak +{grew / (1 << 20):.1f} MiB")
        assert grew < 32 << 20, f"the proxy's RSS grew {grew >> 20} MiB for {BIG >> 20} MiB"
        # its connections are capped: one over is closed at once, and once they end the
        # guest is served again
        r = c.post(f"/sandboxes/{sid}/exec", json={
            "command": "python3", "args": ["-c", HOLD_CLIENT, str(CONNS)], "timeout": 120})
        assert r.json()["stdout"].strip() == "over the cap: closed", r.text
        r = c.post(f"/sandboxes/{sid}/exec", json={
            "command": "python3", "args": ["-c", HOLD_CLIENT, str(CONNS - 1)], "timeout": 120})
        assert r.json()["stdout"].strip() == "over the cap: served", r.text
        # no onboarding app: mitm.it is not answered by the proxy itself
        cmdline = Path(f"/proc/{pids[0]}/cmdline").read_bytes().split(b"\0")
        assert b"onboarding=false" in cmdline
        # its memory is bounded with or without a cgroup: RLIMIT_DATA (review 29k K-L1)
        data = [x for x in Path(f"/proc/{pids[0]}/limits").read_text().splitlines()
                if x.startswith("Max data size")]
        assert data and data[0].split()[3:5] == [str(512 << 20)] * 2, data
        # its own memory cgroup where the server may make cgroups (a server that runs as
        # root on a host with a cgroup hierarchy); a split server's HTTP process (the
        # hangar user, no delegation here) runs it without one, and says so once
        from conftest import PRIVSEP, SRC

        probe = subprocess.run(  # the hierarchy as the server sees it, in its namespace
            ["ip", "netns", "exec", NS_HOST, sys.executable, "-c",
             "from hangar.engines.cgroups import Hierarchy\n"
             "print(Hierarchy.detect('auto')[0] is not None)"],
            env={**os.environ, "PYTHONPATH": str(SRC)}, capture_output=True, text=True,
            timeout=60)
        groups = Path(f"/proc/{pids[0]}/cgroup").read_text()
        if not PRIVSEP and probe.stdout.strip() == "True":
            assert f"/hangar/secret-proxy-{sid}\n" in groups, groups
        else:
            assert "secret-proxy-" not in groups, groups
            assert "secret proxies run without a memory cgroup" in server_log(h)
    finally:
        for s_ in made:
            h.client.delete(f"/sandboxes/{s_}")  # type: ignore[attr-defined]
        log = server_log(h)
        leaked = stop_server(h)
    assert REAL not in log
    assert not leaked, leaked
