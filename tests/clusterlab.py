"""Three hosts on one machine: network namespaces, an etcd member and a Hangar node in each,
and one S3 server (moto's server mode) on the shared LAN. Used by tests/test_cluster.py and
bench/cluster_bench.py.

    hgc<tag>l   the LAN: bridge hgcbr with 10.231.<n>.254 (the S3 server listens there)
    hgc<tag>1   node n1: 10.231.<n>.1, etcd e1 on :2379, Hangar on :8080 (guests 172.31.1.0/24)
    hgc<tag>2   node n2: 10.231.<n>.2 ...
    hgc<tag>3   node n3: 10.231.<n>.3 ...

etcd runs as users run it (docs/cluster.md): TLS on both ports with client
certificates, from ``hangar cluster certs``; each node reads its own folder
(``HANGAR_ETCD_PKI``), and the test process writes records with node 1's.

The nodes' lease follows this machine: ``lease_s`` is 5 s (the default), or
three times what ``hangar cluster certs`` (a CLI start: Hangar's imports) took
when that is longer. A rolling restart (SIGTERM, start) need not fit in the
lease and the failover delay: the stopped node's restart mark makes the
failover wait the cluster's restart grace (``restart_grace_s``) for it.

Names carry a per-run tag, so runs never meet another's namespaces. The
test process reaches each node through a forwarder on 127.0.0.1 whose
outgoing sockets are made inside the LAN namespace (``setns`` in the
connecting thread): nothing is added to the machine's own network
namespace. ``cut(i)``/``heal(i)`` take node i's link down and up on the
bridge. ``close()`` kills every process started (servers, VMMs of the
nodes' data directories, etcd, S3), deletes the namespaces and the folders.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from conftest import PRIVSEP, link_images, server_python, vmm_pids

SRC = Path(__file__).resolve().parents[1] / "src"
CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL("libc.so.6", use_errno=True)


def run(cmd: list[str], check: bool = True, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, check=check, capture_output=True, text=True, **kw)


def can_run() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces, TAP devices)"
    for tool in ("ip", "nft", "etcd"):
        if shutil.which(tool) is None:
            return f"needs {tool} (apt-get install etcd-server nftables iproute2)"
    try:
        import moto  # noqa: F401
        import boto3  # noqa: F401
    except ImportError:
        return "needs moto[server] and boto3 (the test extra)"
    return None


class Forwarder:
    """127.0.0.1:port in this namespace -> host:port reached from inside namespace ``ns``."""

    def __init__(self, ns: str, host: str, port: int) -> None:
        self.ns_path = f"/var/run/netns/{ns}"
        self.target = (host, port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.closed = False
        self.conns: set[socket.socket] = set()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                c, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    def _serve(self, c: socket.socket) -> None:
        fd = os.open(self.ns_path, os.O_RDONLY)
        try:
            if _libc.setns(fd, CLONE_NEWNET) != 0:  # this thread only
                c.close()
                return
        finally:
            os.close(fd)
        try:
            u = socket.create_connection(self.target, timeout=5)
        except OSError:
            c.close()
            return
        u.settimeout(None)
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        u.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.conns |= {c, u}
        threading.Thread(target=_pipe, args=(u, c), daemon=True).start()
        _pipe(c, u)

    def close(self) -> None:
        self.closed = True
        self.listener.close()
        for s in list(self.conns):
            try:
                s.close()
            except OSError:
                pass


def _pipe(a: socket.socket, b: socket.socket) -> None:
    try:
        while True:
            data = a.recv(65536)
            if not data:
                break
            b.sendall(data)
    except OSError:
        pass
    finally:
        for s in (a, b):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class Node:
    def __init__(self, lab: "Lab", i: int) -> None:
        self.lab = lab
        self.i = i
        self.name = f"n{i}"
        self.ns = f"{lab.prefix}{i}"
        self.ip = f"{lab.net}.{i}"
        self.data_dir = lab.root / f"node{i}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.etcd: subprocess.Popen[bytes] | None = None
        self.fwd: Forwarder | None = None
        self.slots = 1

    @property
    def pki(self) -> Path:
        """This node's etcd TLS folder (``hangar cluster certs``)."""
        return self.lab.root / "pki" / self.name

    @property
    def url(self) -> str:
        assert self.fwd is not None
        return self.fwd.url

    def client(self, timeout: float = 300) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"X-API-Key": self.lab.key},
                            timeout=timeout)

    def start(self, slots: int | None = None, wait: bool = True) -> None:
        if slots is not None:
            self.slots = slots
        env = {**self.lab.env, "HANGAR_DATA_DIR": str(self.data_dir),
               "HANGAR_MAX_SANDBOXES": str(self.slots), "HANGAR_NETWORK": "tap",
               "HANGAR_NET_POOL": f"172.31.{self.i}.0/24", "HANGAR_NET_DNS": f"{self.lab.net}.254",
               "HANGAR_POOL_SIZE": "0", "HANGAR_DEFAULT_MEMORY_MIB": "256",
               "HANGAR_BOOT_TIMEOUT_S": "180", "HANGAR_ETCD_PKI": str(self.pki)}
        python = server_python(env)
        log = open(self.data_dir / "server.log", "ab")
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", self.ns, python, "-m", "hangar.cli", "node", "join",
             "--etcd", self.lab.etcd_urls, "--advertise", f"{self.ip}:8080", "--name", self.name,
             "--host", self.ip, "--port", "8080"],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"node {self.name} exited: {self.log_tail()}")
            try:
                if httpx.get(self.url + "/cluster/health", headers={"X-API-Key": self.lab.key},
                             timeout=2).json().get("writable"):
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.3)
        raise RuntimeError(f"node {self.name} did not start: {self.log_tail()}")

    def log_tail(self, n: int = 3000) -> str:
        try:
            return (self.data_dir / "server.log").read_text()[-n:]
        except OSError:
            return ""

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig) if sig == signal.SIGKILL else self.proc.send_signal(sig)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def vmm_ids(self) -> list[str]:
        """Sandbox ids of the VMM processes running from this node's data directory."""
        marker = str(self.data_dir / "sandboxes") + "/"
        out = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                argv = (d / "cmdline").read_bytes().split(b"\0")
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if not argv or b"qemu-system" not in argv[0] or ") Z" in stat:
                continue
            for a in argv:
                s = a.decode(errors="replace")
                if marker in s:
                    out.append(s.split(marker, 1)[1].split("/", 1)[0])
                    break
        return out


class Lab:
    """The three hosts (see the module docstring)."""

    def __init__(self, base_image: Path, tag: str | None = None) -> None:
        self.tag = tag or secrets.token_hex(2)
        self.prefix = f"hgc{self.tag}"
        self.lan = f"{self.prefix}l"
        octet = 100 + int(self.tag, 16) % 150
        self.net = f"10.231.{octet}"
        self.root = Path(tempfile.mkdtemp(prefix="hg-cluster-", dir="/tmp"))
        if PRIVSEP:  # split nodes (user hangar) reach their data directories inside
            self.root.chmod(0o711)
        self.base_image = base_image
        self.nodes = [Node(self, i) for i in (1, 2, 3)]
        self.etcd_urls = ",".join(f"https://{n.ip}:2379" for n in self.nodes)
        self.s3: subprocess.Popen[bytes] | None = None
        self.extra: list[subprocess.Popen[bytes]] = []
        self.key = ""
        self.lease_s = 5
        """The nodes' lease, seconds (the module docstring: it follows this machine)."""
        self.failover_s = 3
        """The cluster's ``--failover-after``, seconds."""
        self.restart_grace_s = 180
        """The cluster's ``--restart-grace``, seconds: past a node's slowest start here (its
        ``wait_ready``, 90 s on a loaded host) and the lease."""
        self.env = {**os.environ, "PYTHONPATH": str(SRC), "AWS_ACCESS_KEY_ID": "hangar-test",
                    "AWS_SECRET_ACCESS_KEY": "hangar-test-secret",
                    "AWS_DEFAULT_REGION": "us-east-1", "HANGAR_ETCD_PKI": str(self.root / "pki" / "n1")}

    # -- topology --------------------------------------------------------------------------

    def up(self, slots: int = 1) -> None:
        try:
            self._net()
            self._certs()
            self._etcd()
            self._s3()
            self._init()
            for n in self.nodes:
                n.data_dir.mkdir()
                link_images(self.base_image, n.data_dir)
                for f in ("engine-probe.json", "firecracker-probe.json"):
                    src = self.base_image.parent.parent / f
                    if src.exists():
                        shutil.copy(src, n.data_dir / f)
                n.fwd = Forwarder(self.lan, n.ip, 8080)
                n.start(slots, wait=False)
            for n in self.nodes:
                n.wait_ready()
        except BaseException:
            self.close()
            raise

    def _net(self) -> None:
        run(["ip", "netns", "add", self.lan])
        run(["ip", "-n", self.lan, "link", "add", "hgcbr", "type", "bridge"])
        run(["ip", "-n", self.lan, "addr", "add", f"{self.net}.254/24", "dev", "hgcbr"])
        run(["ip", "-n", self.lan, "link", "set", "hgcbr", "up"])
        run(["ip", "-n", self.lan, "link", "set", "lo", "up"])
        for n in self.nodes:
            run(["ip", "netns", "add", n.ns])
            inner, outer = f"hgcv{self.tag}", self.port_name(n.i)
            run(["ip", "link", "add", inner, "netns", n.ns, "type", "veth", "peer", "name",
                 outer, "netns", self.lan])
            run(["ip", "-n", n.ns, "addr", "add", f"{n.ip}/24", "dev", inner])
            run(["ip", "-n", n.ns, "link", "set", inner, "up"])
            run(["ip", "-n", n.ns, "link", "set", "lo", "up"])
            run(["ip", "-n", self.lan, "link", "set", outer, "master", "hgcbr"])
            run(["ip", "-n", self.lan, "link", "set", outer, "up"])

    def port_name(self, i: int) -> str:
        return f"hgcb{self.tag}{i}"

    def _certs(self) -> None:
        nodes = ",".join(f"{n.name}={n.ip}" for n in self.nodes)
        t0 = time.monotonic()
        r = run([sys.executable, "-m", "hangar.cli", "cluster", "certs", "--nodes", nodes,
                 "--out", str(self.root / "pki")], env=self.env, timeout=60)
        assert all(n.name in r.stdout for n in self.nodes), r.stdout
        self.lease_s = max(5, math.ceil(3 * (time.monotonic() - t0)))

    def _etcd(self) -> None:
        from hangar.cluster.pki import etcd_flags

        cluster = ",".join(f"e{n.i}=https://{n.ip}:2380" for n in self.nodes)
        for n in self.nodes:
            d = self.root / f"etcd{n.i}"
            n.etcd = subprocess.Popen(
                ["ip", "netns", "exec", n.ns, "etcd", "--name", f"e{n.i}", "--data-dir", str(d),
                 "--listen-client-urls", f"https://{n.ip}:2379",
                 "--advertise-client-urls", f"https://{n.ip}:2379",
                 "--listen-peer-urls", f"https://{n.ip}:2380",
                 "--initial-advertise-peer-urls", f"https://{n.ip}:2380",
                 "--initial-cluster", cluster, "--initial-cluster-state", "new",
                 "--initial-cluster-token", self.prefix,
                 "--heartbeat-interval", "100", "--election-timeout", "1000",
                 *etcd_flags(n.pki)],
                stdout=open(self.root / f"etcd{n.i}.log", "ab"), stderr=subprocess.STDOUT,
                start_new_session=True)
        self.wait_etcd()

    def wait_etcd(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = self.hangar("node", "ls", "--json", check=False)
            if r.returncode == 0:
                return
            time.sleep(0.5)
        raise RuntimeError(f"etcd did not form a cluster: {r.stderr}")

    def _s3(self) -> None:
        self.s3 = subprocess.Popen(
            ["ip", "netns", "exec", self.lan, sys.executable, "-m", "moto.server", "-H",
             f"{self.net}.254", "-p", "9000"],
            stdout=open(self.root / "s3.log", "ab"), stderr=subprocess.STDOUT,
            start_new_session=True, env=self.env)

    @property
    def store_url(self) -> str:
        return f"s3://hangar/lab?endpoint=http://{self.net}.254:9000"

    def _init(self) -> None:
        deadline = time.monotonic() + 30
        while True:
            r = self.hangar("cluster", "init", "--store", self.store_url, "--key-file",
                            str(self.root / "api-key"), "--lease-ttl", str(self.lease_s),
                            "--failover-after", str(self.failover_s),
                            "--restart-grace", str(self.restart_grace_s), check=False)
            if r.returncode == 0:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster init failed: {r.stdout} {r.stderr}")
            time.sleep(0.5)
        self.key = (self.root / "api-key").read_text().strip()

    def hangar(self, *args: str, check: bool = True, ns: str | None = None) -> subprocess.CompletedProcess[str]:
        """``hangar ARGS --etcd ...`` inside node 1's namespace (or ``ns``)."""
        etcd = ["--etcd", self.etcd_urls] if args[:1] in (("node",), ("cluster",)) else []
        return run(["ip", "netns", "exec", ns or self.nodes[0].ns, sys.executable, "-m",
                    "hangar.cli", *args, *etcd], check=check, env=self.env, timeout=60)

    def _etcd_run(self, body: str, *args: str) -> str:
        """Run ``body`` (Python, indented as a function's, with an ``Etcd`` client ``e``
        of node 1's certificate and ``sys.argv[2:]`` = ``args``) in node 1's namespace;
        its stdout."""
        code = ("import asyncio, os, sys\nfrom pathlib import Path\n"
                "from hangar.cluster.etcd import Etcd\nfrom hangar.cluster.pki import tls_from\n"
                "async def go():\n    e = Etcd(sys.argv[1].split(','), "
                "tls=tls_from(Path(os.environ['HANGAR_ETCD_PKI'])).context())\n"
                f"{body}    await e.close()\nasyncio.run(go())\n")
        return run(["ip", "netns", "exec", self.nodes[0].ns, sys.executable, "-c", code,
                    self.etcd_urls, *args], env=self.env, timeout=30).stdout

    def etcd_put(self, key: str, value: str) -> None:
        """Write ``value`` under ``key`` in the cluster's etcd as it is (an empty value deletes
        the key): how a test plants a record no node would write."""
        self._etcd_run("    if sys.argv[3]:\n        await e.put(sys.argv[2], sys.argv[3])\n"
                       "    else:\n        await e.delete(sys.argv[2])\n", key, value)

    def etcd_get(self, key: str) -> str | None:
        """The value under ``key`` in the cluster's etcd (None: no such key)."""
        out = self._etcd_run("    kv = await e.get(sys.argv[2])\n"
                             "    print('-' if kv is None else '+' + kv.value.decode())\n",
                             key).strip()
        return None if out == "-" else out[1:]

    def node_ls(self) -> dict[str, dict[str, Any]]:
        r = self.hangar("node", "ls", "--json", check=False)
        if r.returncode != 0:
            return {}
        return {row["name"]: row for row in json.loads(r.stdout)}

    def cut(self, i: int) -> None:
        run(["ip", "-n", self.lan, "link", "set", self.port_name(i), "down"])

    def heal(self, i: int) -> None:
        run(["ip", "-n", self.lan, "link", "set", self.port_name(i), "up"])

    def owner(self, sid: str) -> str | None:
        """The node whose data directory runs ``sid``'s VMM (None: no VMM anywhere)."""
        found = [n.name for n in self.nodes if sid in n.vmm_ids()]
        assert len(found) <= 1, f"{sid} runs on {found}"
        return found[0] if found else None

    def close(self) -> None:
        for n in self.nodes:
            n.stop(signal.SIGKILL)
        for p in self.extra:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        for n in self.nodes:
            for pid in vmm_pids(str(n.data_dir)):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in [n.etcd for n in self.nodes] + [self.s3]:
            if p is not None and p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGCONT)
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        for n in self.nodes:
            if n.fwd is not None:
                n.fwd.close()
        for ns in [n.ns for n in self.nodes] + [self.lan]:
            run(["ip", "netns", "del", ns], check=False)
        keep = os.environ.get("HANGAR_CLUSTER_LOGS")  # a folder for the nodes' and etcd's logs
        if keep:
            Path(keep).mkdir(parents=True, exist_ok=True)
            for n in self.nodes:
                for src, name in ((n.data_dir / "server.log", f"{n.name}.log"),
                                  (self.root / f"etcd{n.i}.log", f"etcd{n.i}.log")):
                    if src.exists():
                        shutil.copy(src, Path(keep) / name)
        shutil.rmtree(self.root, ignore_errors=True)

    def leaked(self) -> list[int]:
        return [p for n in self.nodes for p in vmm_pids(str(n.data_dir))]
