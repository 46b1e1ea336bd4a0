"""Egress rules by domain and CIDR (issue 22, part 1) on real namespaces, nftables, microVMs.

The namespaces, the stand-in internet (DNS, HTTP, HTTPS) and the guest probe are
``egress_lab``'s (shared with bench/egress_bench.py); its ``topology`` removes
everything made inside, pass or fail, and every process a test starts is killed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from egress_lab import (
    DNS, GUEST, HERE, NAMES, NS_HOST, Topology, UdsRelay, ruleset, sandbox_names,
    start_server, stop_server,
)
from egress_lab import topology as make_topology
from netns import can_netns

from hangar.errors import InvalidRequest, NotFound
from hangar.net import NetworkManager, Policy
from hangar.net.egress_match import decide

needs_netns = pytest.mark.skipif(can_netns() is not None, reason=str(can_netns()))

# -- rules (no root) ----------------------------------------------------------------


def test_entries_parse_normalise_and_refuse_junk() -> None:
    p = Policy.parse({"allow": ["*.Example.TEST", "bücher.de:443", "10.0.0.0/8:22", "1.2.3.4"],
                      "deny": ["0.0.0.0/0", "Bad.example.test."]})
    assert p.allow == ("*.example.test", "xn--bcher-kva.de:443", "10.0.0.0/8:22", "1.2.3.4/32")
    assert p.deny == ("0.0.0.0/0", "bad.example.test") and p.has_domains
    assert p.match_rules()["unlisted"] == "refuse"  # an allowlist: other names get no answer
    assert Policy.parse({"deny": ["*.bad.test"]}).match_rules()["unlisted"] == "resolve"
    assert not Policy.parse({"allow": ["10.0.0.0/8"]}).has_domains
    for bad, words in [(["exa mple.com"], "nor a domain"), (["*"], "nor a domain"),
                       (["a.*.com"], "nor a domain"), (["1.2.3.999"], "not a valid CIDR"),
                       (["host:0"], "1-65535"), (["host:70000"], "1-65535"),
                       (["fd00::/8"], "IPv6"), (["x" * 400], "300"),
                       ([f"h{i}.test" for i in range(300)], "at most 256"),
                       ([f"10.0.0.0/8:{p}" for p in range(1, 20)], "distinct ports")]:
        with pytest.raises(InvalidRequest) as info:
            Policy.parse({"deny": bad})
        assert words in info.value.message and info.value.status == 400, info.value.message


def test_decide_matches_names_addresses_and_never() -> None:
    p = Policy.parse({"allow": ["*.example.test", "api.test:443", "10.0.0.0/8:22"],
                      "deny": ["0.0.0.0/0", "bad.example.test"]})
    rules = p.match_rules(never=["172.30.0.0/16", "203.0.113.2/32"])
    rules["resolved"] = {"203.0.113.10": ["a.example.test"], "203.0.113.20": ["api.test"]}
    json.dumps(rules)  # plain data, for a proxy in another process
    cases = [
        (("203.0.113.10", 443, "a.example.test"), (True, "allowed_domain")),
        (("203.0.113.10", 80, "A.Example.Test."), (True, "allowed_domain")),
        (("203.0.113.11", 443, "a.example.test"), (False, "unresolved_address")),
        (("203.0.113.10", 443, "other.test"), (False, "denied_address")),
        (("203.0.113.10", 443, None), (False, "denied_address")),
        (("203.0.113.10", 443, "bad.example.test"), (False, "denied_domain")),
        (("203.0.113.20", 443, "api.test"), (True, "allowed_domain")),
        (("203.0.113.20", 80, "api.test"), (False, "denied_address")),  # port entry
        (("10.1.2.3", 22, None), (True, "allowed_address")),
        (("10.1.2.3", 23, None), (False, "denied_address")),
        (("172.30.0.1", 443, "a.example.test"), (False, "denied_host")),  # the gateway
        (("203.0.113.2", 80, None), (False, "denied_host")),  # the host
        (("169.254.169.254", 80, "a.example.test"), (False, "denied_host")),
        (("127.0.0.1", 80, None), (False, "denied_host")),
        (("nonsense", 80, None), (False, "bad_address")),
        (("203.0.113.10", 80, "a b"), (False, "bad_name")),
    ]
    for (ip, port, name), want in cases:
        assert decide(rules, ip=ip, port=port, name=name) == want, (ip, port, name)
    opened = decide(Policy.parse("open").match_rules(), ip="10.9.9.9", port=5)
    assert opened == (True, "allowed_address")


def test_egress_match_loads_by_path_with_the_standard_library_only() -> None:
    """The secret proxy's venv loads the module by path: no import of Hangar's may run."""
    src = HERE.parent / "src" / "hangar" / "net" / "egress_match.py"
    code = ("import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('em', {str(src)!r})\n"
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
            "assert not [n for n in sys.modules if n.startswith(('hangar', 'pydantic'))]\n"
            "print(m.decide({'v': 1, 'never': [], 'denied': [], 'domains': []},"
            " ip='1.2.3.4', port=80))\n")
    out = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and "allowed_address" in out.stdout, out.stderr


def test_denials_are_coalesced_so_a_loop_cannot_flood_the_bus() -> None:
    from hangar.net.egress import Coalescer

    c = Coalescer(window=60, per_window=5)
    key = ("sb-1", "x.test", 443, "denied_domain", "proxy")
    assert [c.admit("sb-1", key) for _ in range(1000)] == [0] + [None] * 999
    others = [c.admit("sb-1", ("sb-1", f"h{i}.test", 443, "denied_domain", "proxy"))
              for i in range(100)]
    assert others == [0] * 4 + [None] * 96  # at most 5 events per sandbox and window
    assert c.admit("sb-2", ("sb-2", "x.test", 443, "denied_domain", "proxy")) == 0
    c.window = 0  # the window passed: the next one says how many were held back
    assert c.admit("sb-1", key) == 999


def test_the_proxy_never_reaches_the_pool_the_host_or_cluster_control_endpoints() -> None:
    import types

    from hangar.net.egress import EgressGuard

    net = types.SimpleNamespace(pool="172.30.0.0/16", dns=None,
                                control=[("10.9.9.9", 2379), ("10.9.9.9", 443)])
    never = EgressGuard(net).never()
    assert never[0] == "172.30.0.0/16" and "10.9.9.9/32" in never and "127.0.0.1/32" in never
    rules = Policy.parse("open").match_rules(never)
    assert decide(rules, ip="10.9.9.9", port=443, name="x.test") == (False, "denied_host")
    assert decide(rules, ip="10.9.9.8", port=443, name="x.test") == (True, "allowed_address")


# -- namespaces ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def topology() -> Iterator[Topology]:
    reason = can_netns()
    if reason:
        pytest.skip(reason)
    with make_topology() as topo:
        yield topo


@pytest.fixture
def manager(topology: Topology) -> Iterator[NetworkManager]:
    m = NetworkManager(netns=NS_HOST, dns=DNS, mode="tap")  # its own namespace: the defaults
    try:
        yield m
    finally:
        m.sweep([])
        assert not sandbox_names(ruleset())


@needs_netns
def test_intercept_redirect_admit_and_rules_are_nft_state_released_with_the_sandbox(
        manager: NetworkManager) -> None:
    a, b = "sb-e00000000001", "sb-e00000000002"
    na = manager.attach(a, {"allow": ["*.example.test"], "deny": ["0.0.0.0/0"]})
    nb = manager.attach(b, "internet")
    assert na and nb and manager.gateway == "172.30.0.1"
    with pytest.raises(NotFound):
        manager.intercept("sb-e0000000000f", 18443)
    with pytest.raises(InvalidRequest):
        manager.intercept(a, 80)  # a privileged port is never a proxy's
    for _ in range(2):  # idempotent
        manager.intercept(a, 18443)
        manager.redirect_dns(a, 18053)
    manager.admit(a, [("203.0.113.10", None, 30), ("203.0.113.11", 443, 5)])
    rules = ruleset()
    chain = f"{na.tap}_nat"
    assert f"{na.ip} : goto {chain}" in rules
    assert "tcp dport { 80, 443 } dnat ip to 172.30.0.1:18443" in rules
    assert "udp dport 53 dnat ip to 172.30.0.1:18053" in rules
    assert "tcp dport 53 dnat ip to 172.30.0.1:18053" in rules
    assert f"{na.ip} . tcp . 18443" in rules and f"{na.ip} . udp . 18053" in rules
    assert re.search(r"203\.0\.113\.10 timeout 30s expires", rules), rules
    assert "203.0.113.11 . 443 timeout 5s" in rules
    assert nb.ip not in re.sub(rf"{nb.ip} : goto {nb.tap}\b|\"{nb.tap}\" . [0-9a-f:]+ . "
                               rf"{re.escape(nb.ip)}", "", rules)  # b: no redirect
    manager.intercept(a, None)
    rules = ruleset()
    assert "18443" not in rules and "18053" in rules
    # A live rule change: b gets domain rules (and sets), a loses them (and its sets)
    manager.set_rules(b, {"egress": "open", "allow": ["x.test"], "deny": ["10.0.0.0/8"]})
    manager.set_rules(a, {"egress": "open", "deny": ["10.0.0.0/8:22"]})
    rules = ruleset()
    assert f"set {nb.tap}_r " in rules and f"set {na.tap}_r " not in rules
    assert "th dport 22 ip daddr { 10.0.0.0/8, 169.254.0.0/16 } counter" in rules
    with pytest.raises(InvalidRequest, match="none"):
        manager.set_rules(a, "none")
    manager.release(a)
    assert na.tap not in ruleset() and na.ip not in ruleset()
    manager.release(b)
    assert not sandbox_names(ruleset())


# -- the whole server and a real guest -------------------------------------------------


@needs_netns
@pytest.mark.vm
def test_domain_rules_on_a_real_guest_through_the_api(topology: Topology,
                                                       base_image: Path) -> None:
    """One sandbox allowed only ``*.example.test`` (and denied ``bad.example.test``),
    behind a server running in hg-eg-host: by name it reaches a.example.test over HTTP,
    TLS (SNI) and a port no proxy sees; other names, raw addresses and addresses the
    guest resolved itself are refused; a denied name is REFUSED by DNS whatever resolver
    the guest asks; a rule added by PATCH opens a name at once; denials are counted and
    published. Nothing is left behind."""
    import httpx
    from conftest import SRC, make_data_dir, server_python, vmm_pids

    d = make_data_dir(base_image)
    sock = d / "api.sock"  # the test talks to it from outside the namespace
    env = {**os.environ, "HANGAR_DATA_DIR": str(d), "HANGAR_UDS": str(sock),
           "HANGAR_POOL_SIZE": "0", "HANGAR_NETWORK": "tap", "HANGAR_NET_DNS": DNS,
           "PYTHONPATH": str(SRC)}
    python = server_python(env)
    server = start_server(env, python, d)
    relay = UdsRelay(sock)
    a, b, other = NAMES["a.example.test"], NAMES["b.example.test"], NAMES["other.test"]
    try:
        key = (d / "api-key").read_text().strip()

        def cli(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "hangar.cli", *args], text=True,
                                  capture_output=True, timeout=60, env={
                                      **os.environ, "HANGAR_URL": relay.url,
                                      "HANGAR_API_KEY": key, "PYTHONPATH": str(SRC)})

        with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://hangar",
                          headers={"X-API-Key": key}, timeout=300) as c:
            def guest(*steps: list) -> list:
                r = c.post(f"/sandboxes/{sid}/exec", json={
                    "command": "python3", "args": ["-c", GUEST, json.dumps(steps)],
                    "timeout": 120})
                assert r.status_code == 200 and r.json()["exit_code"] == 0, r.text
                return json.loads(r.json()["stdout"])

            bad = c.post("/sandboxes", json={"network": {"allow": ["exa mple.test"]}})
            assert bad.status_code == 400 and "nor a domain" in bad.text, bad.text
            r = cli("create", "--allow", "exa mple.test", "--deny", "0.0.0.0/0")
            assert r.returncode == 1 and "nor a domain" in r.stderr, r
            assert c.get("/sandboxes").json()["sandboxes"] == []
            policy = {"egress": "internet", "allow": ["*.Example.test"],
                      "deny": ["0.0.0.0/0", "bad.example.test"]}
            r = c.post("/sandboxes", json={"network": policy})
            assert r.status_code == 201, r.text
            sid = r.json()["id"]
            shown = c.get(f"/sandboxes/{sid}").json()["network"]
            assert shown == {"egress": "internet", "allow": ["*.example.test"],
                             "deny": ["0.0.0.0/0", "bad.example.test"]}, shown

            got = guest(["resolve", "a.example.test"], ["http_get", a, "a.example.test"],
                        ["tls_get", a, "a.example.test"], ["tcp", a, 8080],
                        ["resolve", "other.test"], ["http_get", other, "other.test"],
                        ["http_get", other, other], ["tcp", other, 8080],
                        ["http_get", b, "a.example.test"],  # an allowed name, not resolved
                        ["http_get", a, "other.test"],  # an address another name opened
                        ["tls_get", a, "other.test"],
                        ["rcode", "203.0.113.1", "bad.example.test"],  # its own resolver
                        ["rcode", DNS, "a.example.test"],
                        ["http_get", "172.30.0.1", "a.example.test"],  # the host
                        ["http_get", "169.254.169.254", "a.example.test"],
                        ["rcode_tcp", "203.0.113.1", "bad.example.test"],  # DNS over TCP
                        ["rcode_tcp", "203.0.113.1", "a.example.test"])
            assert got[0] == a, got
            assert got[1] == f"200 hello {a} a.example.test", got
            assert got[2] == f"hello {a} a.example.test", got  # TLS, SNI checked, not opened
            assert got[3] == "open", got  # the DNS answer opened the address itself
            assert got[4] == "gaierror", got  # REFUSED: no rule names it, deny 0.0.0.0/0
            assert got[5] == "403 hangar egress: denied_address other.test:80", got  # ... refused
            assert got[6] == f"403 hangar egress: denied_address {other}:80", got  # raw address
            assert got[7] == "timeout", got
            assert got[8] == "403 hangar egress: unresolved_address a.example.test:80", got
            assert got[9] == "403 hangar egress: denied_address other.test:80", got
            assert got[10] in ("SSLEOFError", "ConnectionResetError", "SSLZeroReturnError"), got
            assert got[11] == 5 and got[12] == 0, got  # REFUSED, even asked of another server
            assert got[13].startswith("403 hangar egress: denied_host"), got
            assert got[14].startswith("403 hangar egress: denied_host"), got
            assert got[15] == [5, True] and got[16] == [0, True], got

            # A rule added at run time opens a name at once, without a restart.
            from hangar.client import Hangar, Sandbox

            with Hangar("http://hangar", key, http_client=httpx.Client(
                    transport=httpx.HTTPTransport(uds=str(sock)))) as h:
                box = Sandbox.connect(sid, client=h)
                started = time.monotonic()
                rules = box.update_network(allow=["*.example.test", "other.test"])  # the SDK
                took = time.monotonic() - started
            assert rules.model_dump() == {"egress": "internet",
                                          "allow": ["*.example.test", "other.test"],
                                          "deny": ["0.0.0.0/0", "bad.example.test"]}
            assert c.get(f"/sandboxes/{sid}").json()["network"] == rules.model_dump()
            assert took < 1.0, took
            got = guest(["resolve", "other.test"], ["http_get", other, "other.test"],
                        ["tcp", other, 8080],
                        ["bench", a, "a.example.test", 80, 15],
                        ["bench", a, "a.example.test", 8080, 15])
            assert got[:3] == [other, f"200 hello {other} other.test", "open"], got
            print(f"PATCH applied in {took * 1000:.0f} ms; HTTP GET p50 through the proxy "
                  f"{got[3] * 1000:.1f} ms, direct {got[4] * 1000:.1f} ms "
                  f"(ratio {got[3] / got[4]:.2f})")
            for body, status, words in [({"egress": "none"}, 409, "remove the sandbox's NIC"),
                                        ({"allow": ["*"]}, 400, "nor a domain"),
                                        ({"allow": "x.test"}, 422, "list"),
                                        ({"other": 1}, 422, "other"),
                                        ({"deny": ["x" * 300]}, 422, "over 256 bytes")]:
                r = c.patch(f"/sandboxes/{sid}/network", json=body)
                assert r.status_code == status and words in r.text, (body, r.text)
            assert c.patch("/sandboxes/sb-000000000000/network",
                           json={"allow": []}).status_code == 404

            # E2B's PUT replaces both lists (an allowed entry beats a denied one there:
            # the denied /32 inside the allowed /24 is left out).
            r = c.put(f"/e2b/sandboxes/{sid}/network", json={
                "allowOut": ["*.example.test", "203.0.113.0/24"],
                "denyOut": ["203.0.113.12/32"], "allow_internet_access": False})
            assert r.status_code == 204, r.text
            assert c.get(f"/sandboxes/{sid}").json()["network"] == {
                "egress": "internet", "allow": ["*.example.test", "203.0.113.0/24"],
                "deny": ["0.0.0.0/0"]}
            e2b = c.get(f"/e2b/sandboxes/{sid}").json()
            assert e2b["network"] == {"allowOut": ["*.example.test", "203.0.113.0/24"],
                                      "denyOut": ["0.0.0.0/0"]}, e2b
            got = guest(["http_get", other, other], ["tcp", other, 8080],
                        ["rcode", DNS, "bad.example.test"])
            assert got == [f"200 hello {other} {other}", "open", 3], got  # upstream: NXDOMAIN
            r = c.put(f"/e2b/sandboxes/{sid}/network", json={"rules": {"x.test": []}})
            assert r.status_code == 400 and "not supported" in r.text, r.text

            # The CLI shows and changes them.
            r = cli("network", sid, "--clear", "--allow", "*.example.test", "--deny",
                    "0.0.0.0/0", "--deny", "bad.example.test:443")
            assert r.returncode == 0, r
            assert r.stdout.split("\n")[:3] == [
                "egress internet", "allow: *.example.test",
                "deny: 0.0.0.0/0, bad.example.test:443"], r.stdout
            # Entries are added, never replacing a list unasked, and removed by name.
            r = cli("network", sid, "--deny", "x.example.test")
            assert "deny: 0.0.0.0/0, bad.example.test:443, x.example.test" in r.stdout, r
            r = cli("network", sid, "--remove", "x.example.test", "--remove", "absent.test")
            assert r.returncode == 0 and "absent.test: in neither list" in r.stderr, r
            r = cli("network", sid)
            assert r.returncode == 0 and r.stdout.split("\n")[1:3] == [
                "allow: *.example.test", "deny: 0.0.0.0/0, bad.example.test:443"], r.stdout


            metrics = c.get("/metrics").text
            assert re.search(r'hangar_egress_denied_total\{reason="denied_address",via="proxy"\}'
                             r' [1-9]', metrics), metrics[-3000:]
            assert re.search(r'hangar_egress_denied_total\{reason="denied_domain",via="dns"\}'
                             r' [1-9]', metrics)
            events: list[dict] = []
            want = {("dns", "denied_domain", "bad.example.test"),
                    ("dns", "unlisted_domain", "other.test"),
                    ("proxy", "denied_address", "other.test"),
                    ("proxy", "unresolved_address", "a.example.test"),
                    ("proxy", "denied_host", "a.example.test")}
            kinds: set[tuple] = set()
            with c.stream("GET", "/events", params={"kind": "egress", "sandbox_id": sid},
                          headers={"Last-Event-ID": "none:0"}, timeout=5) as s:
                try:
                    for line in s.iter_lines():
                        if line.startswith("data: "):
                            e = json.loads(line[6:])
                            events.append(e)
                            kinds.add((e["data"]["via"], e["data"]["reason"],
                                       e["data"].get("domain")))
                        if want <= kinds:
                            break
                except httpx.ReadTimeout:
                    pass
            assert want <= kinds, events
            assert all(e["kind"] == "egress.denied" and e["sandbox_id"] == sid
                       and set(e["data"]) <= {"port", "reason", "via", "domain", "address",
                                              "repeats"} for e in events), events
            # A restarted server guards the sandbox it adopts: DNS and the proxy answer
            # again (on new ports) and the rules hold. What the host resolved for the guest
            # was in the old server's memory: the guest resolves again (as it does for
            # every connection without a cache).
            stop_server(server)
            server = start_server(env, python, d)
            got = guest(["http_get", a, "a.example.test"], ["resolve", "a.example.test"],
                        ["http_get", a, "a.example.test"], ["http_get", other, "other.test"],
                        ["rcode", "203.0.113.1", "bad.example.test"])
            assert got[0] == "403 hangar egress: unresolved_address a.example.test:80", (
                got, "\n".join(line for line in (d / "server.log").read_text().splitlines()
                               if "egress" in line or "network" in line)[-3000:])
            assert got[1] == a and got[2] == f"200 hello {a} a.example.test", got
            assert got[3] == "403 hangar egress: denied_address other.test:80", got
            assert got[4] == 3, got  # bad.example.test is denied on 443 only: answered
            dashboard_changes_rules(relay.url, key, sid, c)
            assert c.delete(f"/sandboxes/{sid}").status_code == 204
        rules = ruleset()
        assert not re.findall(r"hgt[0-9a-f]{12}", rules), rules
        assert "172.30.0.2" not in rules
    finally:
        relay.close()
        stop_server(server)
        for pid in vmm_pids(str(d)):
            os.kill(pid, signal.SIGKILL)
        subprocess.run(["ip", "-n", NS_HOST, "link", "del", "hgbr0"], capture_output=True)
        shutil.rmtree(d, ignore_errors=True)


def dashboard_changes_rules(url: str, key: str, sid: str, c: Any) -> None:
    """The dashboard shows a sandbox's rules and adds a deny entry (real Chromium)."""
    chromium = "/usr/bin/chromium"
    if not os.path.exists(chromium):
        return
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium,
                                    args=["--headless", "--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page()
            page.goto(url + "/ui/")
            page.fill("#api-key", key)
            page.click("#key-form button[type=submit]")
            page.click(f'tr[data-id="{sid}"] button[data-action="egress"]', timeout=30_000)
            rules = page.wait_for_selector("#network [data-role=rules]", timeout=30_000)
            net = c.get(f"/sandboxes/{sid}").json()["network"]
            want = f"allow {', '.join(net['allow'])}; deny {', '.join(net['deny'])}"
            assert want in rules.inner_text(), (want, rules.inner_text())
            page.fill("#network-entry", "b.example.test")
            page.click('#network button[data-action="network-deny"]')
            page.wait_for_selector("#network [data-role=rules] >> text=b.example.test",
                                   timeout=30_000)
            # An entry with a space is one entry, which the server refuses, with its reason.
            page.fill("#network-entry", "exa mple.test")
            page.click('#network button[data-action="network-deny"]')
            page.wait_for_selector('#network-status[data-state="error"]', timeout=30_000)
            assert "nor a domain" in page.inner_text("#network-status")
        finally:
            browser.close()
    deny = c.get(f"/sandboxes/{sid}").json()["network"]["deny"]
    assert deny[-1] == "b.example.test", deny


def test_the_hosts_own_addresses_are_never_opened_also_read_inside_the_event_loop() -> None:
    """pyroute2's sync API fails inside a running loop: the guard reads the host's
    addresses off it, so a server (whose guard first reads them on its loop) has them."""
    import asyncio
    import types

    from hangar.net.egress import EgressGuard
    from hangar.net.offloop import host_ipv4

    outside = host_ipv4()
    assert "127.0.0.1" in outside

    async def inside() -> list[str]:
        return EgressGuard(types.SimpleNamespace(pool="172.30.0.0/16", dns=None)).never()

    never = asyncio.run(inside())
    assert [f"{ip}/32" for ip in outside] == never[1:len(outside) + 1]
    assert len(outside) >= 2  # loopback and this host's own address(es)
