"""Security round 3, class 7: egress rules hold on every path (docs/security.md).

The secret-injecting proxy re-resolves a name the host did not resolve for the guest;
that fallback must apply the domain guard's DNS rebinding guard (``egress_match.admits``,
the one the guard's forwarder uses), and the never-lists must follow the host's address
changes (``egress_match.host_owns``, asked at each decision). The addon's own fallback
runs here on the real matcher, loaded by path as the proxy's interpreter loads it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from hangar.net import Policy
from hangar.net.egress_match import admits, decide, host_owns

SRC = Path(__file__).resolve().parent.parent / "src" / "hangar"


def host_address() -> str:
    """One non-loopback IPv4 address this host owns (``ip -j -4 addr``)."""
    out = json.loads(subprocess.run(["ip", "-j", "-4", "addr"], capture_output=True,
                                    check=True).stdout)
    found = [a["local"] for link in out for a in link.get("addr_info", ())
             if a.get("local") and not a["local"].startswith("127.")]
    assert found, out
    return found[0]


def test_the_rebinding_guard_is_the_domain_guards() -> None:
    for egress in ("internet", "open"):
        policy = Policy.parse({"egress": egress, "allow": ["rebind.test"]})
        rules = policy.match_rules(never=["172.30.0.0/16"])
        json.dumps(rules)  # plain data, for the proxy's own interpreter
        for ip in ("10.1.2.3", "192.168.1.1", "100.64.0.1", "93.184.216.34", "169.254.169.254",
                   "172.30.0.5"):
            assert admits(rules, ip) == (policy.admits(ip) and ip != "172.30.0.5"), (egress, ip)
    assert admits({"never": []}, "93.184.216.34") is False  # no guard in the rules: closed


def test_the_host_is_never_reached_even_at_an_address_it_gained_later() -> None:
    mine = host_address()
    assert host_owns(mine) and not host_owns("192.0.2.1")
    rules = Policy.parse("open").match_rules(never=[])  # a never-list made without it
    assert decide(rules, ip=mine, port=443, name="x.test") == (False, "denied_host")
    assert not admits(rules, mine)
    assert decide(rules, ip="192.0.2.1", port=443, name="x.test") == (True, "allowed_address")


DRIVER = r"""
import asyncio, importlib.util, json, os, socket, sys, types

addon_path, match_path, rules, answer = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
fake = types.ModuleType("mitmproxy")
fake.http = types.SimpleNamespace(HTTPFlow=object)
sys.modules["mitmproxy"] = fake
control_r, control_w = os.pipe()  # the server's side of the real wiring; never closed here
events_r, events_w = os.pipe()
os.write(control_w, (json.dumps({"rules": rules, "egress_match": match_path, "secrets": {}})
                     + "\n").encode())
os.environ["HANGAR_PROXY_EVENTS_FD"] = str(events_w)
os.environ["HANGAR_PROXY_CONTROL_FD"] = str(control_r)
spec = importlib.util.spec_from_file_location("addon", addon_path)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
proxy = mod.addons[0]


async def main():
    loop = asyncio.get_running_loop()

    async def resolve(name, port, **_):
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (answer, port))]

    loop.getaddrinfo = resolve
    server = types.SimpleNamespace(address=(answer, 443), sni="rebind.test", error=None)
    await proxy.server_connect(types.SimpleNamespace(server=server,
                                                     client=types.SimpleNamespace(id="c1")))
    print(json.dumps({"error": server.error}), flush=True)

asyncio.run(main())
os._exit(0)
"""


def addon_verdict(rules: dict[str, Any], answer: str) -> str | None:
    """Run the addon's ``server_connect`` for a guest's TLS connection to ``answer`` with
    SNI ``rebind.test``, whose DNS (the name's owner's) also answers ``answer``; the
    refusal it sets, or None. In a process of its own, wired as the server wires it."""
    r = subprocess.run([sys.executable, "-c", DRIVER, str(SRC / "core" / "secret_addon.py"),
                        str(SRC / "net" / "egress_match.py"), json.dumps(rules), answer],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])["error"]


def test_the_secret_proxys_re_resolution_applies_the_rebinding_guard() -> None:
    """A guest asks for an allowed name at a private address that the name's DNS (which
    its owner controls) also gives: the domain guard would never open it; nor may the
    secret proxy's fallback. A public address the name leads to passes."""
    rules = Policy.parse({"egress": "internet", "allow": ["rebind.test"]}).match_rules(
        never=[])
    assert "unresolved_address" in (addon_verdict(rules, "10.1.2.3") or "")
    assert "unresolved_address" in (addon_verdict(rules, "100.64.0.1") or "")
    assert addon_verdict(rules, "93.184.216.34") is None


REFUSE_DRIVER = r"""
import importlib.util, json, os, sys, types

fake = types.ModuleType("mitmproxy")
fake.http = types.SimpleNamespace(HTTPFlow=object, Response=types.SimpleNamespace(
    make=lambda status, body, headers: ("answered", status)))
sys.modules["mitmproxy"] = fake
control_r, control_w = os.pipe()
events_r, events_w = os.pipe()
os.write(control_w, (json.dumps({"rules": {}, "egress_match": sys.argv[2], "secrets": {}})
                     + "\n").encode())
os.environ["HANGAR_PROXY_EVENTS_FD"] = str(events_w)
os.environ["HANGAR_PROXY_CONTROL_FD"] = str(control_r)
spec = importlib.util.spec_from_file_location("addon", sys.argv[1])
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
proxy = mod.addons[0]
out = []
for version, headers in json.loads(sys.argv[3]):
    flow = types.SimpleNamespace(metadata={}, response=None, killed=False,
                                 request=types.SimpleNamespace(http_version=version,
                                                               headers=headers))
    flow.kill = lambda flow=flow: setattr(flow, "killed", True)
    proxy._refuse(flow, "gh", "api.example.test", "not one of its hosts")
    out.append("killed" if flow.killed else flow.response[0])
swap = mod._Swap([(b"tok-123", b"PH-SHORT"), (b"tok-123-extended", b"PH-LONG")])
out.append((b"".join(swap(b"a tok-123-extended b tok-123 c") + swap(b""))).decode())
print(json.dumps(out), flush=True)
os._exit(0)
"""


def test_a_refused_request_of_unknown_length_is_never_read() -> None:
    """mitmproxy reads a request's body before it sends an answer the addon made: a refusal
    of a request whose body may be large, or of unknown size (chunked, or an HTTP/2 stream
    that declares no length, which it would read up to 4 GiB: review 29j J-H4), closes the
    connection or stream instead; a small declared body, or none, gets the 403."""
    cases = [["HTTP/1.1", {}], ["HTTP/1.1", {"content-length": "10"}],
             ["HTTP/1.1", {"transfer-encoding": "chunked"}],
             ["HTTP/1.1", {"content-length": str(1 << 30)}],
             ["HTTP/2.0", {}], ["HTTP/2.0", {"content-length": "10"}]]
    r = subprocess.run([sys.executable, "-c", REFUSE_DRIVER,
                        str(SRC / "core" / "secret_addon.py"),
                        str(SRC / "net" / "egress_match.py"), json.dumps(cases)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == [
        "answered", "answered", "killed", "killed", "killed", "answered",
        "a PH-LONG b PH-SHORT c"]  # longest value first (review 29j L1)
