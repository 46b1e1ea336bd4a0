"""The egress lab: the namespaces, stand-in internet, server and guest probe that
tests/test_egress.py and bench/egress_bench.py share (plain code, no pytest).

Namespaces of their own (never those of test_network.py or the secrets tests)::

    hg-eg-inet  203.0.113.1/24 and 203.0.113.10-12 (on lo): the stand-in internet.
                A DNS server (dnspython, ``egress_inet.py``) on 198.51.100.53 answers
                a.example.test -> .10, b.example.test -> .11, other.test -> .12; HTTP
                on ports 80 and 8080 of every address; HTTPS (self-signed) on 443 and
                8443.
    hg-eg-host  203.0.113.2/24, default route via .1: Hangar's side (bridge, TAPs,
                nft, the server and its VMs).

Nothing leaves the two namespaces; ``topology()`` deletes them at the end, pass or
fail, with every device and rule made inside, and kills what it started.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from netns import delete_namespaces, kill_groups, remove_namespaces, run


NS_INET = "hg-eg-inet"
NS_HOST = "hg-eg-host"
DNS = "198.51.100.53"
NAMES = {"a.example.test": "203.0.113.10", "b.example.test": "203.0.113.11",
         "other.test": "203.0.113.12"}
HERE = Path(__file__).resolve().parent

def ruleset() -> str:
    return run(f"ip netns exec {NS_HOST} nft list ruleset")


class Topology:
    """The two namespaces and the processes started in them (killed on ``close``)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.dir = Path(tempfile.mkdtemp(prefix="hg-eg-"))

    def spawn(self, ns: str, *argv: str) -> subprocess.Popen[bytes]:
        p = subprocess.Popen(["ip", "netns", "exec", ns, *argv], stdout=subprocess.DEVNULL,
                             stderr=open(self.dir / f"p{len(self.procs)}.log", "wb"),
                             start_new_session=True)
        self.procs.append(p)
        return p

    def close(self) -> None:
        kill_groups(self.procs)
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def topology() -> Iterator["Topology"]:
    """The two namespaces and the stand-in internet; all removed on exit."""
    delete_namespaces(NS_HOST, NS_INET)  # left over by a killed run
    topo = Topology()
    try:
        run(f"ip netns add {NS_INET} && ip netns add {NS_HOST}")
        run(f"ip link add hgev-host netns {NS_HOST} type veth peer name hgev-inet netns {NS_INET}")
        run(f"ip -n {NS_INET} addr add 203.0.113.1/24 dev hgev-inet && "
            f"ip -n {NS_INET} link set hgev-inet up && ip -n {NS_INET} link set lo up && "
            f"ip -n {NS_INET} addr add {DNS}/32 dev lo")
        for addr in NAMES.values():
            run(f"ip -n {NS_INET} addr add {addr}/32 dev lo")
        run(f"ip -n {NS_HOST} addr add 203.0.113.2/24 dev hgev-host && "
            f"ip -n {NS_HOST} link set hgev-host up && ip -n {NS_HOST} link set lo up && "
            f"ip -n {NS_HOST} route add default via 203.0.113.1")
        topo.spawn(NS_INET, sys.executable, str(HERE / "egress_inet.py"), DNS,
                   json.dumps(NAMES), str(topo.dir))
        wait_ready(topo)
        yield topo
    finally:
        topo.close()
        remove_namespaces(NS_HOST, NS_INET)


def wait_ready(topo: Topology, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not (topo.dir / "ready").exists():
        if time.monotonic() > deadline or topo.procs[0].poll() is not None:
            raise AssertionError("the stand-in internet did not start: "
                                 + (topo.dir / "p0.log").read_text()[-2000:])
        time.sleep(0.1)


def sandbox_names(text: str) -> list[str]:
    return re.findall(r"hgt[0-9a-f]{12}", text)


class UdsRelay:
    """127.0.0.1:<port> in this namespace -> the server's Unix socket, for the CLI (which
    speaks TCP only). Threads; ``close`` ends them."""

    def __init__(self, path: Path) -> None:
        import socket
        import threading

        self.path = str(path)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self._socket = socket
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import threading

        while True:
            try:
                a, _ = self.sock.accept()
            except OSError:
                return
            b = self._socket.socket(self._socket.AF_UNIX)
            b.connect(self.path)
            for x, y in ((a, b), (b, a)):
                threading.Thread(target=self._pump, args=(x, y), daemon=True).start()

    @staticmethod
    def _pump(x: Any, y: Any) -> None:
        try:
            while chunk := x.recv(65536):
                y.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (x, y):
                try:
                    s.shutdown(2)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


def start_server(env: dict[str, str], python: str, d: Path) -> subprocess.Popen[bytes]:
    sock = d / "api.sock"
    sock.unlink(missing_ok=True)
    server = subprocess.Popen(["ip", "netns", "exec", NS_HOST, python, "-m", "hangar.cli",
                               "serve"], env=env, stdout=open(d / "server.log", "ab"),
                              stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 60
    while not sock.exists() and time.monotonic() < deadline:
        assert server.poll() is None, (d / "server.log").read_text()[-2000:]
        time.sleep(0.2)
    return server


def stop_server(server: subprocess.Popen[bytes]) -> None:
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(20)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()

GUEST = r"""
import http.client, json, socket, ssl, struct, sys, time
out = []
def http_get(ip, host, port=80, timeout=4):
    c = http.client.HTTPConnection(ip, port, timeout=timeout)
    try:
        c.request("GET", "/", headers={"Host": host})
        r = c.getresponse()
        return f"{r.status} {r.read().decode().strip()}"
    except socket.timeout:
        return "timeout"
    except OSError as e:
        return type(e).__name__
    finally:
        c.close()
def tls_get(ip, sni, port=443, timeout=4):
    ctx = ssl.create_default_context(); ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    try:
        with socket.create_connection((ip, port), timeout) as s:
            with ctx.wrap_socket(s, server_hostname=sni) as t:
                t.sendall(f"GET / HTTP/1.1\r\nHost: {sni}\r\n\r\n".encode())
                return t.recv(4096).decode().split("\r\n\r\n", 1)[-1].strip()
    except socket.timeout:
        return "timeout"
    except (OSError, ssl.SSLError) as e:
        return type(e).__name__
def resolve(name):
    try:
        return socket.gethostbyname(name)
    except OSError as e:
        return type(e).__name__
def rcode(server, name):
    q = struct.pack("!HHHHHH", 0x1234, 0x0100, 1, 0, 0, 0)
    q += b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0"
    q += struct.pack("!HH", 1, 1)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(3)
    try:
        s.sendto(q, (server, 53))
        a = s.recv(4096)
        return a[3] & 15
    except socket.timeout:
        return "timeout"
def rcode_tcp(server, name):
    q = struct.pack("!HHHHHH", 0x4321, 0x0100, 1, 0, 0, 0)
    q += b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0"
    q += struct.pack("!HH", 1, 1)
    try:
        with socket.create_connection((server, 53), 3) as s:
            s.sendall(struct.pack("!H", len(q)) + q)
            a = s.recv(4096)
            return [a[5] & 15, a[2:4] == b"\x43\x21"]
    except OSError as e:
        return type(e).__name__
def tcp(ip, port):
    try:
        socket.create_connection((ip, port), 2).close()
        return "open"
    except socket.timeout:
        return "timeout"
    except OSError as e:
        return type(e).__name__
def times(fn, n, *args):
    out = []
    for _ in range(n):
        t = time.perf_counter()
        globals()[fn](*args)
        out.append(time.perf_counter() - t)
    return out
def bench(ip, host, port, n):
    times = []
    for _ in range(n):
        t = time.perf_counter()
        got = http_get(ip, host, port)
        times.append(time.perf_counter() - t)
        assert got.startswith("200"), got
    return sorted(times)[n // 2]
for step in json.loads(sys.argv[1]):
    out.append(globals()[step[0]](*step[1:]))
print(json.dumps(out))
"""
