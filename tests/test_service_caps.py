"""Per-guest caps on the host-side services (issue 29, class 6; docs/security.md).

Each test fills one sandbox's cap and shows that the one more is refused while another
sandbox is still served, and that slots come back when their holders end (on error too):

* the DNS forwarder, UDP and TCP, and the egress proxy, on real sockets (the forwarder,
  proxy and guard the server runs, two "guests" at 127.0.0.2 and 127.0.0.3, an upstream
  that never answers so that forwarded queries hold their slots);
* the server's own connections: one client address holds at most ``PER_CLIENT_MAX``;
* E2B's data plane on a real server and VMs: requests in flight per sandbox
  (``HANGAR_ENVD_MAX_REQUESTS_PER_SANDBOX``) and polled watchers, made in a burst so that
  the cap is checked atomically (``HANGAR_ENVD_MAX_WATCHERS_PER_SANDBOX``).
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import struct
import threading
import types
from collections.abc import Iterator
from pathlib import Path

import dns.message
import dns.rcode
import httpx
import pytest

from conftest import Server, cleanup, free_port, make_data_dir, wait_for
from hangar.net.dns import DnsForwarder
from hangar.net.egress import EgressGuard, Guarded
from hangar.net.policy import Policy

CAP = 4
A, B = "127.0.0.2", "127.0.0.3"
BLACKHOLE = "192.0.2.1"
"""TEST-NET-1: an upstream resolver that never answers (each forwarded query waits its
``UPSTREAM_TIMEOUT_S``)."""


def _guard() -> EgressGuard:
    net = types.SimpleNamespace(pool="172.30.0.0/16", dns=BLACKHOLE, control=[])
    guard = EgressGuard(net, per_sandbox=CAP)
    pol = Policy.parse({"allow": ["*.allowed.test"], "deny": ["*.denied.test"]})
    for sid, ip in (("sb-a", A), ("sb-b", B)):
        guard.by_id[sid] = guard.by_ip[ip] = Guarded(sid, ip, pol,
                                                      pol.match_rules(guard.never()), cap=CAP)
    return guard


def _query(name: str) -> bytes:
    return dns.message.make_query(name, "A").to_wire()


def test_dns_forwarder_caps_each_guest_on_udp_and_tcp(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the host-wide floor at one guest's cap, B is still answered while A fills its
    own: the host-wide cap is every guarded guest's cap together (REVIEW29 F12)."""
    import hangar.net.dns as dns_fwd

    monkeypatch.setattr(dns_fwd, "MAX_INFLIGHT", CAP)

    async def run() -> None:
        guard = _guard()
        fwd = DnsForwarder(guard, "127.0.0.1")
        await fwd.start()
        loop = asyncio.get_running_loop()
        socks: list[socket.socket] = []

        def udp_from(ip: str) -> socket.socket:
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.bind((ip, 0))
            s.setblocking(False)
            socks.append(s)
            return s

        async def answer(s: socket.socket, timeout: float = 2.0) -> bytes | None:
            try:
                return await asyncio.wait_for(loop.sock_recv(s, 4096), timeout)
            except TimeoutError:
                return None

        try:
            # UDP: guest A fills its cap with queries the upstream never answers ...
            a = udp_from(A)
            for i in range(CAP * 4):
                a.sendto(_query(f"q{i}.allowed.test"), ("127.0.0.1", fwd.port))
            await asyncio.sleep(0.2)
            assert guard.by_ip[A].busy == CAP, "A holds exactly its cap"
            # ... and B is answered at once meanwhile (a name its rules refuse: no upstream)
            b = udp_from(B)
            b.sendto(_query("x.denied.test"), ("127.0.0.1", fwd.port))
            got = await answer(b)
            assert got is not None and dns.message.from_wire(got).rcode() == dns.rcode.REFUSED
            # A's own local answer is refused while it is full: its query is dropped
            a2 = udp_from(A)
            a2.sendto(_query("y.denied.test"), ("127.0.0.1", fwd.port))
            assert await answer(a2, 0.5) is None
            # its slots come back once the upstream gives up (SERVFAIL, an error path)
            await wait_for_async(lambda: guard.by_ip[A].busy == 0, 10)
            a2.sendto(_query("y.denied.test"), ("127.0.0.1", fwd.port))
            assert await answer(a2) is not None

            # TCP: A holds CAP idle connections; one more is closed at once, B is served
            held = []
            for _ in range(CAP):
                r, w = await asyncio.open_connection("127.0.0.1", fwd.port, local_addr=(A, 0))
                held.append(w)
            await asyncio.sleep(0.2)
            assert guard.by_ip[A].busy == CAP
            r, w = await asyncio.open_connection("127.0.0.1", fwd.port, local_addr=(A, 0))
            wire = _query("z.denied.test")
            w.write(struct.pack("!H", len(wire)) + wire)
            try:
                rest = await asyncio.wait_for(r.read(), 5)
            except ConnectionResetError:  # closed before it read the query
                rest = b""
            assert rest == b"", "closed, unanswered"
            w.close()
            r, w = await asyncio.open_connection("127.0.0.1", fwd.port, local_addr=(B, 0))
            w.write(struct.pack("!H", len(wire)) + wire)
            (n,) = struct.unpack("!H", await asyncio.wait_for(r.readexactly(2), 5))
            got = await r.readexactly(n)
            assert dns.message.from_wire(got).rcode() == dns.rcode.REFUSED
            w.close()
            for h in held:  # closing them gives the slots back
                h.close()
            await wait_for_async(lambda: guard.by_ip[A].busy == 0, 5)
        finally:
            for s in socks:
                s.close()
            await fwd.close()

    asyncio.run(run())


def test_dns_queries_of_many_records_are_refused_before_they_are_parsed() -> None:
    """A query is parsed only when its header says it is one question and at most one
    (EDNS) record, up to 1232 bytes: a guest's 4 KiB queries of 340 records cost the loop
    29 ms each to parse and refuse (review 29h H-H4). They get FORMERR, fast; a real query
    with EDNS is answered as before."""
    import time

    import dns.edns
    import dns.rrset

    guard = _guard()
    fwd = DnsForwarder(guard, "127.0.0.1")
    g = guard.by_ip[A]
    junk = dns.message.make_query("x.denied.test", "A")
    junk.question.append(dns.rrset.RRset(dns.name.from_text("y.denied.test."),
                                         dns.rdataclass.IN, dns.rdatatype.A))
    for i in range(300):
        junk.additional.append(dns.rrset.from_text(f"r{i}.test.", 60, "IN", "A", "10.0.0.1"))
    wire = junk.to_wire()
    from hangar.net.dns import MAX_QUERY, _one_question

    small = dns.message.make_query("x.denied.test", "A")
    small.question.append(junk.question[1])
    assert len(small.to_wire()) < MAX_QUERY and not _one_question(small.to_wire())
    assert len(wire) > MAX_QUERY and not _one_question(wire)
    t = time.monotonic()
    for _ in range(50):
        out = asyncio.run(fwd._answer(g, wire, tcp=False))
        assert out is not None and dns.message.from_wire(out).rcode() == dns.rcode.FORMERR
    assert time.monotonic() - t < 0.5  # no parse: about 29 ms each before
    padded = dns.message.make_query("x.denied.test", "A", use_edns=0, options=[
        dns.edns.GenericOption(dns.edns.OptionType.PADDING, b"\0" * 400)]).to_wire()
    out = asyncio.run(fwd._answer(g, padded, tcp=False))
    assert out is not None and dns.message.from_wire(out).rcode() == dns.rcode.REFUSED


def test_egress_proxy_caps_each_guest(monkeypatch: pytest.MonkeyPatch) -> None:
    """The egress proxy takes a guest's connections under the same cap: A holds its cap of
    connections (idle, while the proxy waits for their first bytes), its next one is
    closed at once, and B's request is answered meanwhile (refused by its rules: 403)."""
    import hangar.net.sniproxy as sniproxy

    monkeypatch.setattr(sniproxy, "original_dst", lambda sock: ("203.0.113.9", 80))
    monkeypatch.setattr(sniproxy, "MAX_CONNECTIONS", CAP)  # B served beyond it (F12)

    async def run() -> None:
        guard = _guard()
        proxy = sniproxy.SniProxy(guard, "127.0.0.1")
        await proxy.start()
        held = []
        try:
            for _ in range(CAP):
                _, w = await asyncio.open_connection("127.0.0.1", proxy.port,
                                                     local_addr=(A, 0))
                held.append(w)
            await wait_for_async(lambda: guard.by_ip[A].busy == CAP, 5)
            r, w = await asyncio.open_connection("127.0.0.1", proxy.port, local_addr=(A, 0))
            try:
                rest = await asyncio.wait_for(r.read(), 5)
            except ConnectionResetError:
                rest = b""
            assert rest == b"", "A's connection over its cap is closed at once"
            w.close()
            r, w = await asyncio.open_connection("127.0.0.1", proxy.port, local_addr=(B, 0))
            w.write(b"GET / HTTP/1.1\r\nHost: x.denied.test\r\n\r\n")
            answer = await asyncio.wait_for(r.read(), 10)
            assert answer.startswith(b"HTTP/1.1 403") and b"denied_domain" in answer, answer
            w.close()
            for h in held:
                h.close()
            await wait_for_async(lambda: guard.by_ip[A].busy == 0, 10)
        finally:
            await proxy.close()

    asyncio.run(run())


async def wait_for_async(check: object, timeout: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not check():  # type: ignore[operator]
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.05)


# -- E2B's data plane, on a real server ---------------------------------------------------

ENVD_CAP = 3
WATCHER_CAP = 2


class Env:
    def __init__(self, srv: Server, api: httpx.Client, a: str, b: str) -> None:
        self.srv, self.api, self.a, self.b = srv, api, a, b
        self.url = f"{srv.url}/e2b/envd"

    def headers(self, sid: str, **extra: str) -> dict[str, str]:
        return {"E2b-Sandbox-Id": sid, "X-API-Key": self.srv.key, **extra}


@pytest.fixture(scope="module")
def env(base_image: Path) -> Iterator[Env]:
    d = make_data_dir(base_image)
    srv = Server(d, free_port(), {"HANGAR_ENVD_MAX_REQUESTS_PER_SANDBOX": str(ENVD_CAP),
                                  "HANGAR_ENVD_MAX_WATCHERS_PER_SANDBOX": str(WATCHER_CAP)})
    try:
        srv.start()
        with srv.client() as api:
            ids = []
            for _ in range(2):
                r = api.post("/sandboxes", json={})
                assert r.status_code == 201, r.text
                ids.append(r.json()["id"])
            yield Env(srv, api, *ids)
    finally:
        leaked = cleanup(srv)
        shutil.rmtree(d, ignore_errors=True)
        assert not leaked, f"VMM processes outlived the module: {leaked}"


def _stat(c: httpx.Client, env: Env, sid: str, path: str = "/etc/hostname") -> httpx.Response:
    return c.post("/filesystem.Filesystem/Stat", json={"path": path},
                  headers=env.headers(sid, **{"Content-Type": "application/json"}))


@pytest.mark.vm
def test_envd_requests_in_flight_are_capped_per_sandbox(env: Env) -> None:
    with httpx.Client(base_url=env.url, timeout=60) as c:
        for _ in range(ENVD_CAP * 2):  # failed calls give their slot back
            r = _stat(c, env, env.a, "/no/such/file")
            assert (r.status_code, r.json()["code"]) == (404, "not_found")
        # A holds ENVD_CAP streams open: downloads of an endless file, read by nobody
        stop = threading.Event()
        opened = threading.Barrier(ENVD_CAP + 1)

        def hold() -> None:
            with httpx.Client(base_url=env.url, timeout=120) as hc, \
                    hc.stream("GET", "/files", params={"path": "/dev/zero"},
                              headers=env.headers(env.a)) as r:
                assert r.status_code == 200
                opened.wait(60)
                stop.wait(120)

        threads = [threading.Thread(target=hold, daemon=True) for _ in range(ENVD_CAP)]
        for t in threads:
            t.start()
        try:
            opened.wait(60)
            r = _stat(c, env, env.a)
            assert (r.status_code, r.json()["code"]) == (429, "resource_exhausted")
            assert f"{ENVD_CAP} envd requests in flight" in r.json()["message"]
            r = c.get("/files", params={"path": "/etc/hostname"}, headers=env.headers(env.a))
            assert r.status_code == 429 and "HANGAR_ENVD_MAX_REQUESTS_PER_SANDBOX" in r.text
            r = _stat(c, env, env.b)  # the other sandbox is served meanwhile
            assert r.status_code == 200 and r.json()["entry"]["name"] == "hostname"
        finally:
            stop.set()
            for t in threads:
                t.join(60)
        wait_for(lambda: _stat(c, env, env.a).status_code == 200, 30, "A's slots come back")


@pytest.mark.vm
def test_envd_watchers_take_their_slot_atomically(env: Env) -> None:
    async def burst(sid: str, n: int, path: str = "/tmp") -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=env.url, timeout=60) as c:
            return await asyncio.gather(*[
                c.post("/filesystem.Filesystem/CreateWatcher", json={"path": path},
                       headers=env.headers(sid, **{"Content-Type": "application/json"}))
                for _ in range(n)])

    with httpx.Client(base_url=env.url, timeout=60) as c:
        # a create that fails (no such folder) gives its slot back
        for _ in range(WATCHER_CAP + 1):
            r = asyncio.run(burst(env.a, 1, "/no/such/dir"))[0]
            assert r.status_code == 404, r.text
        got = asyncio.run(burst(env.a, 6))  # six at once: exactly the cap are made
        made = [r.json()["watcherId"] for r in got if r.status_code == 200]
        refused = [r for r in got if r.status_code != 200]
        assert len(made) == WATCHER_CAP, [r.text for r in got]
        assert all(r.json()["code"] == "resource_exhausted" for r in refused)
        r = asyncio.run(burst(env.b, 1))[0]  # the other sandbox still gets one
        assert r.status_code == 200, r.text
        for wid in made:  # removing them gives the slots back
            r = c.post("/filesystem.Filesystem/RemoveWatcher", json={"watcherId": wid},
                       headers=env.headers(env.a, **{"Content-Type": "application/json"}))
            assert r.status_code == 200, r.text
        again = asyncio.run(burst(env.a, WATCHER_CAP))
        assert [r.status_code for r in again] == [200] * WATCHER_CAP


@pytest.mark.vm
def test_one_client_address_cannot_take_every_connection(env: Env) -> None:
    """One address holds at most ``PER_CLIENT_MAX`` connections; one more is closed as it
    opens, another address is served meanwhile, and the places come back."""
    from hangar.api.http_limits import PER_CLIENT_MAX

    port = env.srv.port

    def conn(src: str) -> socket.socket:
        s = socket.socket()
        s.bind((src, 0))
        s.connect(("127.0.0.1", port))
        return s

    def served(src: str) -> bool:
        s = conn(src)
        try:
            s.settimeout(10)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            return s.recv(64).startswith(b"HTTP/1.1 200")
        except OSError:
            return False
        finally:
            s.close()

    held = [conn(A) for _ in range(PER_CLIENT_MAX)]  # idle: under the head deadline (15 s)
    try:
        assert not served(A), "one over the cap is closed"
        assert served(B), "another address is served meanwhile"
    finally:
        for s in held:
            s.close()
    wait_for(lambda: served(A), 10, "the places come back")


def test_the_per_client_cap_counts_an_ipv6_host_by_its_64() -> None:
    """One IPv6 host holds a whole /64: its addresses share one ``PER_CLIENT_MAX`` count
    (review round 3, F8); an IPv4-mapped address counts as its IPv4 address."""
    from hangar.api.http_limits import client_key

    assert client_key("2001:db8:1:2::1") == client_key("2001:db8:1:2:ffff::9") \
        == "2001:db8:1:2::/64"
    assert client_key("2001:db8:1:3::1") != client_key("2001:db8:1:2::1")
    assert client_key("::ffff:192.0.2.7") == client_key("192.0.2.7") == "192.0.2.7"
    assert client_key("fe80::1%eth0") == "fe80::/64"
    assert client_key("not-an-address") == "not-an-address"
