"""The secret proxy's WebSocket and raw TCP relays (review 29k K-H2, K-L1): the real mitmdump,
started with the server's own command line (``mitmdump_argv``) and addon, in transparent
mode, between a real client and a real server (the ``websockets`` library); no VM.

Topology (network namespaces of its own: hg-ss-*)::

    hg-ss-inet  203.0.113.1/24: the stand-in server; a WebSocket server on port 80 (it
                echoes a text message with the extensions it agreed to, and answers
                ``send N`` with N bytes in 1 MiB binary messages), a raw TCP sink on 443
                (it reads to the end, then answers the count)
    hg-ss-host  203.0.113.2/24: the proxy, on 10.77.0.1; the client's connections from
                10.77.0.2 to ports 80 and 443 are sent to it (nft ``dnat``), as the host
                sends a guest's (``NetworkManager.intercept``)

The proxy's RSS (``/proc/<pid>/status``) is sampled while 256 MiB go through each relay:
mitmproxy's WebSocket layer kept every message (and inflated each whole), its TCP layer
every chunk, for a connection's life, and queued what it read while a per-chunk hook ran.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from hangar.core.secret_proxy import (SecretProxies, egress_match_path, match_rules,
                                      mitmdump_argv)
from netns import can_netns, delete_namespaces, kill_groups, remove_namespaces, run

NS_INET, NS_HOST = "hg-ss-inet", "hg-ss-host"
INET, PROXY, CLIENT_IP, PORT = "203.0.113.1", "10.77.0.1", "10.77.0.2", 18080
MITMDUMP = Path(__file__).resolve().parent.parent / ".venv-proxy" / "bin" / "mitmdump"
BIG = 256 << 20
GREW_MAX = 32 << 20
"""Most the proxy's RSS may grow while ``BIG`` bytes pass: its buffers (a few 64 KiB
reads, the kernel's socket buffers are not counted) and the allocator's slack; the old
relays grew by about ``BIG`` (measured: +257 MiB for 256 MiB, either relay)."""

SERVER = r"""
import asyncio, sys
from websockets.asyncio.server import serve

async def ws(conn):
    async for msg in conn:
        if msg.startswith("send "):
            block = bytes(1 << 20)
            for _ in range(int(msg.split()[1]) >> 20):
                await conn.send(block)
            await conn.send("sent")
        else:
            await conn.send(f"{msg}|{conn.response.headers.get('Sec-WebSocket-Extensions')}")

async def sink(reader, writer):
    total = 0
    while chunk := await reader.read(1 << 16):
        total += len(chunk)
    writer.write(f"{total}\n".encode())
    await writer.drain()
    writer.close()

async def main():
    async with serve(ws, sys.argv[1], 80, max_size=None):
        await asyncio.start_server(sink, sys.argv[1], 443)
        print("ready", flush=True)
        await asyncio.Future()

asyncio.run(main())
"""

CLIENT = r"""
import asyncio, socket, sys
from websockets.asyncio.client import connect
mode, n, src, url = sys.argv[1], int(sys.argv[2]), (sys.argv[3], 0), f"ws://{sys.argv[4]}/"

async def main():
    if mode == "echo":  # the library's defaults: permessage-deflate offered
        async with connect(url, local_addr=src) as c:
            await c.send("hello")
            print(await c.recv(), c.response.headers.get("Sec-WebSocket-Extensions"), sep="|")
    elif mode == "ws":  # n bytes from the server, uncompressed: all of them on the wire
        async with connect(url, local_addr=src, compression=None, max_size=None) as c:
            await c.send(f"send {n}")
            got = 0
            while isinstance(msg := await c.recv(), bytes):
                got += len(msg)
            print(got, msg)
    else:  # raw TCP to port 443: n zero bytes (neither TLS nor HTTP), then the count
        s = socket.socket()
        s.bind(src)
        s.connect((sys.argv[4], 443))
        block = bytes(1 << 20)
        for _ in range(n >> 20):
            s.sendall(block)
        s.shutdown(socket.SHUT_WR)
        print(s.makefile().readline().strip())

asyncio.run(main())
"""


def client(*args: object) -> str:
    """Run ``CLIENT`` in the host namespace from ``CLIENT_IP``; its output."""
    r = subprocess.run(["ip", "netns", "exec", NS_HOST, sys.executable, "-c", CLIENT,
                        *map(str, args), CLIENT_IP, INET],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.strip()


@pytest.fixture(scope="module")
def proxy() -> Iterator[SimpleNamespace]:
    """The two namespaces, the stand-in server and a proxy as the server starts one (its
    command line, environment and control pipe; rules: ``open``, no secrets); its pid."""
    if (why := can_netns()) is not None:
        pytest.skip(why)
    if not os.access(MITMDUMP, os.X_OK):
        pytest.skip(f"no {MITMDUMP}: scripts/install.sh makes the proxy's environment")
    delete_namespaces(NS_HOST, NS_INET)  # left over by a killed run
    confdir = Path(tempfile.mkdtemp(prefix="hg-ss-"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        run(f"ip netns add {NS_INET} && ip netns add {NS_HOST}")
        run(f"ip link add hgss-host netns {NS_HOST} type veth peer name hgss-inet "
            f"netns {NS_INET}")
        run(f"ip -n {NS_INET} addr add {INET}/24 dev hgss-inet && "
            f"ip -n {NS_INET} link set hgss-inet up && ip -n {NS_INET} link set lo up")
        run(f"ip -n {NS_HOST} addr add 203.0.113.2/24 dev hgss-host && "
            f"ip -n {NS_HOST} link set hgss-host up && ip -n {NS_HOST} link set lo up && "
            f"ip -n {NS_HOST} addr add {PROXY}/32 dev lo && "
            f"ip -n {NS_HOST} addr add {CLIENT_IP}/32 dev lo")
        nft = f"ip netns exec {NS_HOST} nft"
        run(f"{nft} add table ip hgss && "
            f"{nft} 'add chain ip hgss out {{ type nat hook output priority -100; }}' && "
            f"{nft} add rule ip hgss out ip saddr {CLIENT_IP} tcp dport '{{ 80, 443 }}' "
            f"dnat to {PROXY}:{PORT}")
        srv = subprocess.Popen(["ip", "netns", "exec", NS_INET, sys.executable, "-c", SERVER,
                                INET], stdout=subprocess.PIPE, start_new_session=True)
        procs.append(srv)
        assert srv.stdout is not None and srv.stdout.readline().strip() == b"ready"
        ctl_r, ctl_w = os.pipe()
        ev_r, ev_w = os.pipe()
        env = {"PATH": "/usr/bin:/bin", "HOME": str(confdir), "LANG": "C.UTF-8",
               "HANGAR_PROXY_CONTROL_FD": str(ctl_r), "HANGAR_PROXY_EVENTS_FD": str(ev_w)}
        argv = mitmdump_argv(MITMDUMP, PROXY, PORT, confdir, 4 << 30)
        p = subprocess.Popen(["ip", "netns", "exec", NS_HOST, *argv], env=env, cwd=confdir,
                             stdout=subprocess.DEVNULL, stderr=open(confdir / "err", "wb"),
                             pass_fds=(ctl_r, ev_w), start_new_session=True)
        procs.append(p)
        os.close(ctl_r)
        os.close(ev_w)
        first = {"secrets": {}, "rules": match_rules("open", []),  # type: ignore[arg-type]
                 "egress_match": egress_match_path(), "max_connections": 16}
        os.write(ctl_w, (json.dumps(first) + "\n").encode())
        assert select.select([ev_r], [], [], 60)[0], (confdir / "err").read_text()[-2000:]
        assert json.loads(os.read(ev_r, 4096).splitlines()[0]) == {"event": "ready"}
        yield SimpleNamespace(pid=p.pid, argv=argv, err=confdir / "err")
        os.close(ctl_w)
        os.close(ev_r)
    finally:
        kill_groups(procs)
        remove_namespaces(NS_HOST, NS_INET)
        shutil.rmtree(confdir, ignore_errors=True)


def test_a_websocket_passes_through_the_proxy_unmodified(proxy: SimpleNamespace) -> None:
    """A WebSocket through the proxy works end to end, its extensions (permessage-deflate)
    agreed between the client and the server themselves: the proxy relays its bytes."""
    assert "websocket=false" in proxy.argv
    text, server_saw, client_saw = client("echo", 0).split("|")
    assert text == "hello"
    assert server_saw == client_saw  # the one answer to the client's offer, as sent
    assert server_saw.startswith("permessage-deflate"), server_saw


def rss(pid: int) -> int:
    """``pid``'s resident memory, bytes (``VmRSS`` of ``/proc/<pid>/status``)."""
    text = Path(f"/proc/{pid}/status").read_text()
    return int(text.split("VmRSS:")[1].split()[0]) << 10


@pytest.mark.parametrize("mode, answer", [("ws", f"{BIG} sent"), ("tcp", f"{BIG}")])
def test_a_large_stream_keeps_the_proxys_memory_flat(proxy: SimpleNamespace, mode: str,
                                                     answer: str) -> None:
    """256 MiB through one WebSocket (server to client, in 1 MiB messages) and one raw TCP
    connection (client to server) pass whole, and the proxy's RSS grows by less than
    ``GREW_MAX`` while they do."""
    base = peak = rss(proxy.pid)
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.wait(0.05):
            peak = max(peak, rss(proxy.pid))

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    started = time.monotonic()
    try:
        out = client(mode, BIG)
    finally:
        done.set()
        t.join()
    grew = peak - base
    print(f"{mode}: {BIG >> 20} MiB in {time.monotonic() - started:.1f} s, proxy RSS "
          f"{base >> 20} MiB, peak +{grew / (1 << 20):.1f} MiB")
    assert out == answer
    assert grew < GREW_MAX, f"the proxy's RSS grew {grew >> 20} MiB for {BIG >> 20} MiB"


def test_a_proxy_without_a_cgroup_has_a_data_limit(tmp_path: Path) -> None:
    """K-L1: a proxy gets ``RLIMIT_DATA`` of ``HANGAR_SECRET_PROXY_MEMORY_MIB`` whether or
    not a memory cgroup can be made (here: none, ``vmm_cgroups=off``)."""
    settings = SimpleNamespace(secret_proxy_memory_mib=96, vmm_cgroups="off")
    ctx = SimpleNamespace(settings=settings, layout=SimpleNamespace(secret_proxies=tmp_path))
    proxies = SecretProxies(ctx, vault=None, net=None)  # type: ignore[arg-type]
    proc = subprocess.Popen(["sleep", "30"])
    try:
        one = SimpleNamespace(proc=proc, sandbox_id="sb", cgroup=None)
        proxies._confine(one)  # type: ignore[arg-type]
        limits = Path(f"/proc/{proc.pid}/limits").read_text()
        line = next(x for x in limits.splitlines() if x.startswith("Max data size"))
        assert line.split()[3:5] == [str(96 << 20), str(96 << 20)], line
    finally:
        proc.kill()
        proc.wait()
