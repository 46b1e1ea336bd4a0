"""Guest networking (``hangar.net``) on real namespaces, nftables and microVMs.

Nothing here touches the machine's own network namespace. The ``topology``
fixture builds two namespaces joined by one veth pair:

    hg-inet  203.0.113.1/24, stands in for the internet; it also holds
             10.0.0.1, 10.0.0.53 and 169.254.169.254 (on lo) so that a
             private or metadata address *would* answer if Hangar let a
             packet through (the ``open`` guest shows they do). HTTP
             servers: port 80 on every address, port 53 (TCP) on 10.0.0.53.
    hg-host  203.0.113.2/24, default route via 203.0.113.1: Hangar's side.
             The bridge, the TAPs, the nftables tables and the QEMU
             processes (started in it: ``QemuEngine.network_namespace``) all live
             here, plus a TCP listener on every address standing in for
             the host's API.

A fifth guest uses QEMU's user-mode stack (its QEMU also runs in hg-host,
so its sockets are hg-host's) to show what that mode cannot filter.
hg-inet has no route out, so no packet leaves the two namespaces. Deleting
them at the end removes every device and rule made inside; the fixture also
stops each VM it started and kills any QEMU process whose command line
names its data directory, pass or fail. The policy tests need no root.
"""

from __future__ import annotations

import asyncio
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
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import boot_cold, engine_dir, vmm_pids
from netns import can_netns, delete_namespaces, kill_groups, remove_namespaces, run

from hangar.errors import InvalidRequest
from hangar.net import NetworkManager, Policy, mac_for, read_resolver, tap_name
from hangar.net.policy import range_text

NS_INET = "hg-inet"
NS_HOST = "hg-host"
API_PORT = 18080  # the stand-in for the host's API, in hg-host
GUEST_PORT = 8000  # a listener inside guests, for guest-to-guest probes
LISTENING = (f"i=0; until grep -q ':{GUEST_PORT:04X} [0-9A-F]*:0000 0A' /proc/net/tcp "
             "/proc/net/tcp6 2>/dev/null; do i=$((i+1)); [ $i -le 1200 ] || exit 1; "
             "sleep 0.05; done")
"""Shell that waits (at most about a minute) until a socket in the guest listens on
``GUEST_PORT`` (state 0A in /proc/net/tcp or tcp6)."""
BODY = "hello from the stand-in internet\n"
DNS = "10.0.0.53"
META6 = "fd00:ec2::254"
SHARED = Path(os.environ.get("HANGAR_DATA_DIR", "/var/lib/hangar"))


needs_netns = pytest.mark.skipif(can_netns() is not None, reason=str(can_netns()))


def host_links() -> str:
    return run(f"ip -n {NS_HOST} -o link show")


def host_ruleset() -> str:
    return run(f"ip netns exec {NS_HOST} nft list ruleset")


def sandbox_names(text: str) -> list[str]:
    """TAP and per-sandbox chain names (``hgt`` + 12 hex digits) found in ``text``."""
    return re.findall(r"hgt[0-9a-f]{12}", text)


# -- policy (no root) ----------------------------------------------------------------


def test_policy_rejects_bad_input_with_invalid_request() -> None:
    for bad, words in [
        ({"allow": ["10.0.0.0/33"]}, "not a valid CIDR"),
        ({"deny": ["exa mple.com"]}, "nor a domain"),  # a domain is an entry since issue 22
        ({"deny": ["fd00::/8"]}, "IPv6"),
        ({"allow": "10.0.0.0/8"}, "list"),
        ({"egress": "everything"}, "egress"),
        ({"egress": "none", "deny": ["1.2.3.4"]}, "no network"),
        ({"egress": "internet", "extra": 1}, "extra"),
    ]:
        with pytest.raises(InvalidRequest) as info:
            Policy.parse(bad)
        assert words in info.value.message, (bad, info.value.message)
        assert info.value.status == 400


def test_policy_most_specific_entry_wins() -> None:
    p = Policy.parse({"egress": "internet", "allow": ["10.1.2.0/24"]})
    assert p.permits("10.1.2.7") and not p.permits("10.1.3.1") and p.permits("8.8.8.8")
    for blocked in ("169.254.169.254", "127.0.0.1", "192.168.1.1", "172.16.0.1", "100.64.0.1"):
        assert not p.permits(blocked), blocked
    only = Policy.parse({"deny": ["0.0.0.0/0"], "allow": ["1.2.3.4/32"]})  # an allowlist
    assert only.permits("1.2.3.4") and not only.permits("1.2.3.5")
    hole = Policy.parse({"egress": "open", "deny": ["10.0.0.0/8"], "allow": ["10.9.0.0/16"]})
    assert hole.permits("10.9.1.1") and not hole.permits("10.8.1.1") and hole.permits("192.168.0.1")
    tie = Policy.parse({"egress": "open", "allow": ["10.1.0.0/16"], "deny": ["10.1.0.0/16"]})
    assert not tie.permits("10.1.0.1")
    link_local = [(0xA9FE0000, 0xA9FEFFFF)]  # 169.254.0.0/16: metadata, never reachable
    assert Policy.parse("open").denied_ranges() == link_local
    lifted = Policy.parse({"egress": "open", "allow": ["169.254.169.254/32", "0.0.0.0/0"]})
    assert not lifted.permits("169.254.169.254") and lifted.permits("10.0.0.1")
    assert Policy.parse({"allow": ["10.0.0.1"]}).allow == ("10.0.0.1/32",)
    assert range_text(0x0A000000, 0x0AFFFFFF) == "10.0.0.0/8"
    assert range_text(0x0A000000, 0x0A010100) == "10.0.0.0-10.1.1.0"


def test_names_and_resolver(tmp_path: Path) -> None:
    assert tap_name("sb-0123456789ab") == "hgt0123456789ab"
    assert len(tap_name("some-other-id-format")) == 15
    mac = mac_for("sb-0123456789ab")
    first = int(mac.split(":")[0], 16)
    assert first & 2 and not first & 1, mac  # locally administered, unicast
    assert mac == mac_for("sb-0123456789ab") != mac_for("sb-0123456789ac")
    conf = tmp_path / "resolv.conf"
    conf.write_text("# x\nnameserver 127.0.0.53\nnameserver ::1\nnameserver 9.9.9.9\n")
    assert read_resolver([conf]) == "9.9.9.9"
    conf.write_text("nameserver 127.0.0.53\n")
    assert read_resolver([conf]) is None


def test_user_mode_refuses_what_it_cannot_enforce() -> None:
    from hangar.engines.base import VMSpec
    from hangar.engines.qemu import QemuCommand

    closed = NetworkManager(mode="user")  # no opt-in: 'open' would reach the host's loopback
    with pytest.raises(InvalidRequest, match="HANGAR_NET_USER_OPEN") as info:
        closed.attach("sb-0123456789ab", "open")
    assert "10.0.2.2" in info.value.message and info.value.status == 400
    assert closed.attach("sb-0123456789ab", "none") is None
    assert any("refused" in line for line in closed.describe())
    m = NetworkManager(mode="user", user_open=True)
    assert any("ALLOWED" in line for line in m.describe())
    with pytest.raises(InvalidRequest, match="needs TAP networking"):
        m.attach("sb-0123456789ab", "internet")
    with pytest.raises(InvalidRequest):
        m.attach("sb-0123456789ab", {"egress": "open", "deny": ["10.0.0.0/8"]})
    assert m.attach("sb-0123456789ab", "none") is None
    net = m.attach("sb-0123456789ab", "open")
    assert net is not None and net.kind == "user" and net.tap is None
    assert net.kernel_arg() == "hangar.net=10.0.2.15/24,10.0.2.2,10.0.2.3"
    spec = VMSpec("sb-0123456789ab", None, None, net=net)  # type: ignore[arg-type]
    args = QemuCommand.nic_args(spec)
    assert args[:2] == ["-netdev", "user,id=net0,net=10.0.2.0/24,host=10.0.2.2,ipv6=off,dns=10.0.2.3"]
    assert args[3] == f"virtio-net-device,netdev=net0,mac={net.mac}"
    assert QemuCommand.nic_args(VMSpec("x", None, None)) == []  # type: ignore[arg-type]


def test_guest_side_parses_its_kernel_argument() -> None:
    from hangar.guest import net as guest_net

    assert guest_net.parse("quiet hangar.net=172.30.0.9/16,172.30.0.1,10.0.0.53 x=1") == (
        "172.30.0.9", 16, "172.30.0.1", "10.0.0.53")
    assert guest_net.parse("hangar.net=172.30.0.9/16,172.30.0.1,")[3] == ""
    assert guest_net.parse("console=ttyS0") is None
    for bad in ("hangar.net=172.30.0.9,172.30.0.1,", "hangar.net=1.2.3/16,1.2.3.4,",
                "hangar.net=1.2.3.4/40,1.2.3.5,"):
        with pytest.raises(ValueError):
            guest_net.parse(bad)
    assert guest_net.configure("console=ttyS0") is False  # no NIC wanted: nothing done


# -- namespaces ----------------------------------------------------------------------


@dataclass
class Topology:
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    www: Path | None = None


def _listen(ns: str, port: int, bind: str, directory: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        ["ip", "netns", "exec", ns, sys.executable, "-m", "http.server", str(port),
         "--bind", bind, "--directory", str(directory)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def _wait_port(ns: str, host: str, port: int, timeout: float = 10.0) -> None:
    code = (f"import socket,sys,time\nd=time.time()+{timeout}\n"
            f"while True:\n try:\n  socket.create_connection(('{host}',{port}),1).close(); break\n"
            f" except OSError:\n  time.sleep(0.05)\n  if time.time()>d: sys.exit(1)\n")
    subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code], check=True)


@pytest.fixture(scope="module")
def topology() -> Iterator[Topology]:
    reason = can_netns()
    if reason:
        pytest.skip(reason)
    delete_namespaces(NS_HOST, NS_INET)  # left over by a killed run
    topo = Topology(www=Path(tempfile.mkdtemp(prefix="hg-www-")))
    try:
        (topo.www / "index.html").write_text(BODY)
        run(f"ip netns add {NS_INET} && ip netns add {NS_HOST}")
        run(f"ip link add hgv-host netns {NS_HOST} type veth peer name hgv-inet netns {NS_INET}")
        run(f"ip -n {NS_INET} addr add 203.0.113.1/24 dev hgv-inet && "
            f"ip -n {NS_INET} link set hgv-inet up && ip -n {NS_INET} link set lo up && "
            f"ip -n {NS_INET} addr add 10.0.0.1/32 dev lo && "
            f"ip -n {NS_INET} addr add {DNS}/32 dev lo && "
            f"ip -n {NS_INET} addr add 169.254.169.254/32 dev lo")
        run(f"ip -n {NS_HOST} addr add 203.0.113.2/24 dev hgv-host && "
            f"ip -n {NS_HOST} link set hgv-host up && ip -n {NS_HOST} link set lo up && "
            f"ip -n {NS_HOST} route add default via 203.0.113.1")
        topo.procs.append(_listen(NS_INET, 80, "0.0.0.0", topo.www))
        topo.procs.append(_listen(NS_INET, 53, DNS, topo.www))
        topo.procs.append(_listen(NS_HOST, API_PORT, "0.0.0.0", topo.www))
        _wait_port(NS_INET, "203.0.113.1", 80)
        _wait_port(NS_INET, DNS, 53)
        _wait_port(NS_HOST, "127.0.0.1", API_PORT)
        yield topo
    finally:
        kill_groups(topo.procs)
        remove_namespaces(NS_HOST, NS_INET)
        shutil.rmtree(topo.www, ignore_errors=True)


@pytest.fixture
def manager(topology: Topology) -> Iterator[NetworkManager]:
    m = NetworkManager(netns=NS_HOST, dns=DNS, mode="tap")
    try:
        yield m
    finally:
        m.sweep([])
        assert not sandbox_names(host_links())
        assert not sandbox_names(host_ruleset())


@needs_netns
def test_four_attachments_then_nothing_left(manager: NetworkManager) -> None:
    ids = [f"sb-00000000000{i}" for i in range(4)]

    async def attach_all() -> list:
        return list(await asyncio.gather(*(manager.attach_async(s) for s in ids)))

    nets = asyncio.run(attach_all())
    assert len({n.tap for n in nets}) == len({n.ip for n in nets}) == len({n.mac for n in nets}) == 4
    assert all(n.gateway == "172.30.0.1" and n.prefix == 16 and n.dns == DNS for n in nets)
    assert sorted(n.ip for n in nets) == [f"172.30.0.{i}" for i in range(2, 6)]
    links = run(f"ip -n {NS_HOST} -d -o link show")
    ruleset = host_ruleset()
    for n in nets:
        line = next(ln for ln in links.splitlines() if f" {n.tap}:" in ln)
        assert "master hgbr0" in line and "isolated on" in line and "tun type tap" in line
        assert f"chain {n.tap} " in ruleset and f"{n.ip} : goto {n.tap}" in ruleset
        assert f'"{n.tap}" . {n.mac} . {n.ip}' in ruleset
    started = time.monotonic()
    asyncio.run(_release_all(manager, ids))
    took = time.monotonic() - started
    assert not sandbox_names(host_links())
    ruleset = host_ruleset()
    assert not sandbox_names(ruleset) and not re.search(r"172\.30\.0\.[2-9]", ruleset), ruleset
    assert "chain forward" in ruleset  # the base rules stay for the next sandbox
    assert manager.leases() == {}
    print(f"released 4 in {took:.3f} s")


async def _release_all(manager: NetworkManager, ids: list[str]) -> None:
    await asyncio.gather(*(manager.release_async(s) for s in ids))


@needs_netns
def test_restart_recovers_leases_and_sweep_removes_the_dead(manager: NetworkManager) -> None:
    nets = [manager.attach(f"sb-aaaaaaaaaaa{i}", "internet") for i in range(3)]
    again = NetworkManager(netns=NS_HOST, dns=DNS, mode="tap")  # a restarted server
    again.start()
    assert again.leases() == {n.sandbox_id: n.ip for n in nets if n}
    swept = again.sweep([nets[1].sandbox_id])
    assert swept == sorted([nets[0].tap, nets[2].tap])
    links, ruleset = host_links(), host_ruleset()
    assert nets[1].tap in links and nets[0].tap not in links and nets[2].tap not in links
    assert nets[1].tap in ruleset and nets[0].tap not in ruleset and nets[2].tap not in ruleset
    fresh = again.attach("sb-bbbbbbbbbbbb")
    assert fresh is not None and fresh.ip == nets[0].ip  # the lowest free address is reused
    again.release("sb-bbbbbbbbbbbb")
    again.release(nets[1].sandbox_id)
    again.release(nets[1].sandbox_id)  # twice is harmless


@needs_netns
def test_bad_cidr_is_a_clear_error_and_leaves_nothing(manager: NetworkManager) -> None:
    with pytest.raises(InvalidRequest, match="10.0.0.300/8"):
        manager.attach("sb-cccccccccccc", {"egress": "internet", "deny": ["10.0.0.300/8"]})
    assert manager.attach("sb-cccccccccccc", "none") is None
    assert not sandbox_names(host_links())


INSIDE = r"""
import json, subprocess
from hangar.net import NetworkManager
m = NetworkManager(dns="10.0.0.53", mode="tap")  # no netns: this process is already inside
net = m.attach("sb-dddddddddddd", "internet")
links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
rules = subprocess.run(["nft", "list", "ruleset"], capture_output=True, text=True).stdout
forward = open("/proc/sys/net/ipv4/ip_forward").read().strip()
m.release("sb-dddddddddddd")
after = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
after += subprocess.run(["nft", "list", "ruleset"], capture_output=True, text=True).stdout
print(json.dumps({"available": m.available(), "tap": net.tap, "ip": net.ip, "links": links,
                  "rules": rules, "forward": forward, "after": after}))
"""


@needs_netns
def test_manager_inside_the_namespace_without_naming_it(manager: NetworkManager) -> None:
    """The code path of a server that runs in the namespace it manages (netns=None)."""
    src = Path(__file__).resolve().parents[1] / "src"
    out = subprocess.run(["ip", "netns", "exec", NS_HOST, sys.executable, "-c", INSIDE],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(src)})
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["available"][0], r["available"]
    assert r["tap"] == "hgtdddddddddddd" and r["ip"] == "172.30.0.2"
    assert r["tap"] in r["links"] and "hgbr0" in r["links"] and r["forward"] == "1"
    assert f"{r['ip']} : goto {r['tap']}" in r["rules"]
    assert not sandbox_names(r["after"]) and not sandbox_names(host_links())


# -- microVMs ------------------------------------------------------------------------

PROBE = r"""
import json, socket, sys, threading, urllib.request
res = {}
def one(target):
    host, port = target.rsplit(":", 1)
    s = socket.socket()
    s.settimeout(2)
    try:
        s.connect((host, int(port)))
        res[target] = "open"
    except socket.timeout:
        res[target] = "timeout"
    except OSError as e:
        res[target] = e.strerror or repr(e)
    finally:
        s.close()
ts = [threading.Thread(target=one, args=(t,)) for t in sys.argv[1:]]
[t.start() for t in ts]
[t.join() for t in ts]
try:
    res["body"] = urllib.request.urlopen("http://203.0.113.1/", timeout=3).read().decode()
except Exception as e:
    res["body"] = repr(e)
print(json.dumps(res))
"""


PROBE6 = ("import socket, sys\n"
          "s = socket.socket(socket.AF_INET6); s.settimeout(2)\n"
          "try:\n    s.connect((sys.argv[1], int(sys.argv[2]))); print('open')\n"
          "except OSError as e:\n    print(e.strerror or 'timeout')\n")


class Guests:
    """Booted VMs, their agents and attachments, in ``hg-host``; stops all on ``close``."""

    def __init__(self, root: Path, manager: NetworkManager) -> None:
        from hangar.config import Settings
        from hangar.engines.qemu import QemuEngine, choose_accel
        from hangar.images import resolve_image
        from hangar.layout import Layout

        self.root = root
        self.layout = Layout(root)
        self.layout.ensure()
        self.image = resolve_image(self.layout, "base")
        accel, _ = choose_accel(self.layout, self.image.kernel, self.image.initrd)
        self.engine = QemuEngine(accel)
        # as long as a server waits for a booting guest (180 s under TCG: five cold boots
        # at once beside the suite's other work and stress-ng took over 120)
        self.boot_deadline_s = Settings().boot_deadline_s(accel)
        self.engine.network_namespace = Path("/run/netns") / NS_HOST
        self.manager = manager
        self.vms: dict[str, object] = {}
        self.agents: dict[str, object] = {}
        self.nets: dict[str, object] = {}
        self.topology_procs: list[subprocess.Popen[bytes]] = []  # listeners a test adds

    async def boot(self, sid: str, policy: object, manager: NetworkManager | None = None) -> None:
        from hangar.engines.base import VMSpec

        net = await (manager or self.manager).attach_async(sid, policy)  # type: ignore[arg-type]
        self.nets[sid] = net
        spec = VMSpec(sid, self.image, self.layout.sandbox(sid), memory_mib=256, net=net)
        self.vms[sid], self.agents[sid] = await boot_cold(
            self.engine, spec, self.boot_deadline_s)  # type: ignore[arg-type]

    async def sh(self, sid: str, command: str, timeout: float = 60) -> tuple[int, str]:
        r = await self.agents[sid].exec(  # type: ignore[attr-defined]
            {"op": "exec", "shell": command, "timeout": timeout})
        return r.exit_code, (r.stdout.head + r.stderr.head).decode()

    async def probe(self, sid: str, *targets: str) -> dict[str, str]:
        r = await self.agents[sid].exec(  # type: ignore[attr-defined]
            {"op": "exec", "argv": ["python3", "-c", PROBE, *targets], "timeout": 60})
        assert r.exit_code == 0, r.stderr.head
        return json.loads(r.stdout.head)

    async def close(self) -> None:
        kill_groups(self.topology_procs)
        for agent in self.agents.values():
            await agent.close()  # type: ignore[attr-defined]
        for sid, vm in self.vms.items():
            try:
                await self.engine.stop(vm)  # type: ignore[arg-type]
            except Exception:
                pass
        for sid in list(self.nets):
            await self.manager.release_async(sid)


@pytest.fixture
def guests(manager: NetworkManager, base_image: Path) -> Iterator[Guests]:
    with engine_dir(base_image, "hn-") as root:
        g = Guests(root, manager)
        try:
            yield g
        finally:
            asyncio.run(g.close())


@pytest.mark.vm
@needs_netns
def test_guest_policies_and_release_after_a_crash(guests: Guests) -> None:
    a, b, c, d = "sb-a00000000001", "sb-b00000000002", "sb-c00000000003", "sb-d00000000004"
    u = "sb-f00000000006"  # QEMU user-mode networking, with the operator's opt-in
    user_mode = NetworkManager(mode="user", user_open=True)

    async def body() -> None:
        await asyncio.gather(
            guests.boot(a, "internet"),
            guests.boot(b, {"egress": "internet", "allow": ["10.0.0.1/32"]}),
            guests.boot(c, "open"),
            guests.boot(d, "none"),
            guests.boot(u, "open", user_mode))
        ip = {s: n.ip for s, n in guests.nets.items() if n and s != u}  # type: ignore[attr-defined]
        assert guests.nets[d] is None
        for s in (a, c):  # listeners for guest-to-guest probes, waited for until they
            # listen (a fixed half second was too short for Python under load)
            rc, out = await guests.sh(s, f"setsid python3 -m http.server {GUEST_PORT} "
                                         f">/dev/null 2>&1 </dev/null & {LISTENING}")
            assert rc == 0, out
        rc, out = await guests.sh(a, "ip -br addr show eth0; ip route; cat /etc/resolv.conf")
        assert rc == 0 and ip[a] in out and "default via 172.30.0.1" in out, out
        assert f"nameserver {DNS}" in out, out

        host_api = [f"172.30.0.1:{API_PORT}", f"203.0.113.2:{API_PORT}"]
        private = ["10.0.0.1:80", "169.254.169.254:80"]
        ra, rb, rc_, rd, self_a, ru = await asyncio.gather(
            guests.probe(a, *host_api, *private, f"{ip[c]}:{GUEST_PORT}", f"{DNS}:53"),
            guests.probe(b, *private, f"{ip[a]}:{GUEST_PORT}"),
            guests.probe(c, *host_api, *private, f"{ip[a]}:{GUEST_PORT}"),
            guests.probe(d, "203.0.113.1:80"),
            guests.probe(a, f"{ip[a]}:{GUEST_PORT}"),
            guests.probe(u, "10.0.0.1:80", f"10.0.2.2:{API_PORT}"))
        assert self_a[f"{ip[a]}:{GUEST_PORT}"] == "open"  # the guest listener works

        assert ra["body"] == BODY, ra
        for t in (*host_api, *private, f"{ip[c]}:{GUEST_PORT}"):
            assert ra[t] == "timeout", (t, ra)
        assert ra[f"{DNS}:53"] == "open", ra  # the resolver, though private

        assert rb["body"] == BODY and rb["10.0.0.1:80"] == "open", rb  # allow pierces
        assert rb["169.254.169.254:80"] == "timeout" and rb[f"{ip[a]}:{GUEST_PORT}"] == "timeout"

        assert rc_["body"] == BODY and rc_["10.0.0.1:80"] == "open", rc_  # open reaches private
        assert rc_["169.254.169.254:80"] == "timeout", rc_  # ... never the metadata service
        for t in (*host_api, f"{ip[a]}:{GUEST_PORT}"):
            assert rc_[t] == "timeout", (t, rc_)  # never the host or another guest

        # User mode works, but filters nothing: private addresses, and even the
        # host's loopback (10.0.2.2), are reached; hence it is refused for 'internet'.
        assert ru["body"] == BODY and ru["10.0.0.1:80"] == ru[f"10.0.2.2:{API_PORT}"] == "open", ru

        assert rd["203.0.113.1:80"] == "Network is unreachable", rd  # no NIC at all

        # No IPv6 either, so no fd00:ec2::254 (the IPv6 metadata address): give the
        # bridge that address and a listener, let the guests configure IPv6 by
        # hand (a hostile guest is root), and nothing gets through.
        run(f"ip netns exec {NS_HOST} sysctl -qw net.ipv6.conf.hgbr0.disable_ipv6=0 && "
            f"ip -n {NS_HOST} addr add {META6}/64 dev hgbr0 nodad")
        guests.topology_procs.append(_listen(NS_HOST, API_PORT + 1, "::", guests.root))
        _wait_port(NS_HOST, META6, API_PORT + 1)
        for n, s in enumerate((a, c), 2):
            await guests.sh(s, f"ip -6 addr add fd00:ec2::{n}/64 dev eth0 nodad")
            r = await guests.agents[s].exec(  # type: ignore[attr-defined]
                {"op": "exec", "argv": ["python3", "-c", PROBE6, META6, str(API_PORT + 1)],
                 "timeout": 30})
            assert r.exit_code == 0 and r.stdout.head.strip() != b"open", (s, r)
        run(f"ip -n {NS_HOST} addr del {META6}/64 dev hgbr0 && "
            f"ip netns exec {NS_HOST} sysctl -qw net.ipv6.conf.hgbr0.disable_ipv6=1")
        rc, out = await guests.sh(d, "ls /sys/class/net")
        assert out.split() == ["lo"], out


        # A VMM killed outright: releasing its sandbox (what the orchestrator's
        # watcher does) removes its TAP and rules at once, and the next
        # sandbox gets its address and a working network.
        tap, old_ip = guests.nets[b].tap, ip[b]  # type: ignore[attr-defined]
        os.kill(guests.vms[b].pid, signal.SIGKILL)  # type: ignore[attr-defined]
        started = time.monotonic()
        while guests.vms[b].alive():  # type: ignore[attr-defined]
            assert time.monotonic() - started < 5
            await asyncio.sleep(0.05)
        await guests.manager.release_async(b)
        took = time.monotonic() - started
        assert tap not in host_links() and tap not in host_ruleset()
        assert took < 3, took
        new = "sb-e00000000005"
        await guests.boot(new, "internet")
        assert guests.nets[new].ip == old_ip  # type: ignore[attr-defined]
        rn = await guests.probe(new, f"172.30.0.1:{API_PORT}", "10.0.0.1:80")
        assert rn["body"] == BODY, rn
        assert rn[f"172.30.0.1:{API_PORT}"] == rn["10.0.0.1:80"] == "timeout", rn

    asyncio.run(body())


# -- the whole server, inside the namespace --------------------------------------------


FETCH = ("import sys, urllib.request\n"
         "try:\n"
         "    print(urllib.request.urlopen(sys.argv[1], timeout=2).read().decode(), end='')\n"
         "except Exception as e:\n"
         "    print('blocked', type(e).__name__)\n")


@needs_netns
@pytest.mark.vm
def test_api_sandboxes_get_networking_and_give_it_back(topology: Topology, base_image: Path) -> None:
    """A Hangar server running in hg-host (API on a Unix socket): create with a policy,
    fetch, fork keeps a working NIC of its own, delete leaves no device or rule."""
    import httpx
    from conftest import SRC, make_data_dir, server_python

    d = make_data_dir(base_image)
    sock = d / "api.sock"
    env = {**os.environ, "HANGAR_DATA_DIR": str(d), "HANGAR_UDS": str(sock),
           "HANGAR_POOL_SIZE": "0", "HANGAR_NETWORK": "tap", "HANGAR_NET_DNS": DNS,
           "PYTHONPATH": str(SRC)}
    python = server_python(env)
    server = subprocess.Popen(["ip", "netns", "exec", NS_HOST, python, "-m", "hangar.cli",
                               "serve"], env=env, stdout=open(d / "server.log", "wb"),
                              stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not sock.exists() and time.monotonic() < deadline:
            assert server.poll() is None, (d / "server.log").read_text()[-2000:]
            time.sleep(0.2)
        key = (d / "api-key").read_text().strip()
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://hangar",
                          headers={"X-API-Key": key}, timeout=300) as c:
            def fetch(sid: str, url: str) -> str:
                r = c.post(f"/sandboxes/{sid}/exec", json={
                    "command": "python3", "args": ["-c", FETCH, url], "timeout": 30})
                assert r.status_code == 200, r.text
                return r.json()["stdout"]

            r = c.post("/sandboxes", json={"network": {"egress": "internet"}})
            assert r.status_code == 201, r.text
            sid = r.json()["id"]
            assert r.json()["network"]["egress"] == "internet"
            assert fetch(sid, "http://203.0.113.1/") == BODY
            assert fetch(sid, "http://10.0.0.1/").startswith("blocked")
            assert tap_name(sid) in host_links()
            bad = c.post("/sandboxes", json={"network": {"egress": "internet", "allow": ["10.0.0.0/33"]}})
            assert bad.status_code == 400, bad.text
            snap = c.post(f"/sandboxes/{sid}/snapshot").json()["id"]
            fork = c.post(f"/snapshots/{snap}/sandboxes").json()["id"]
            assert fetch(fork, "http://203.0.113.1/") == BODY
            ip = lambda s: c.post(f"/sandboxes/{s}/exec", json={  # noqa: E731
                "command": "ip -4 -o addr show scope global | awk '{print $4}'"}).json()["stdout"]
            assert ip(fork) != ip(sid)
            # A wake keeps a working NIC: on another address when its own was taken while
            # it slept, on the same one (left as it was in the guest) when not.
            first = ip(sid)
            assert c.post(f"/e2b/sandboxes/{sid}/pause").status_code == 204
            other = c.post("/sandboxes", json={"network": {"egress": "internet"}}).json()["id"]
            assert ip(other) == first
            r = c.post(f"/e2b/sandboxes/{sid}/connect", json={"timeout": 300})
            assert r.status_code == 201, r.text
            moved = ip(sid)
            assert moved not in (first, ip(fork))
            assert fetch(sid, "http://203.0.113.1/") == BODY
            assert c.post(f"/e2b/sandboxes/{sid}/pause").status_code == 204
            r = c.post(f"/e2b/sandboxes/{sid}/connect", json={"timeout": 300})
            assert r.status_code == 201, r.text
            assert ip(sid) == moved
            assert fetch(sid, "http://203.0.113.1/") == BODY
            for s in (sid, fork, other):
                assert c.delete(f"/sandboxes/{s}").status_code == 204
            c.delete(f"/snapshots/{snap}")
            none = c.post("/sandboxes", json={"network": "none"}).json()["id"]
            assert fetch(none, "http://203.0.113.1/").startswith("blocked")
            c.delete(f"/sandboxes/{none}")
        assert not sandbox_names(host_links())
        assert not sandbox_names(host_ruleset())
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        for pid in vmm_pids(str(d)):
            os.kill(pid, signal.SIGKILL)
        subprocess.run(["ip", "-n", NS_HOST, "link", "del", "hgbr0"], capture_output=True)
        shutil.rmtree(d, ignore_errors=True)


def test_user_mode_server_needs_the_opt_in_for_open(base_image: Path) -> None:
    """A server on QEMU's user-mode stack refuses 'open' (its guests would reach the
    host's loopback, the API included, through 10.0.2.2) until the operator opts in,
    and ``hangar doctor`` says which it is. Nothing boots: the refusal comes first."""
    from conftest import SRC, Server, cleanup, free_port, make_data_dir

    def doctor(extra: dict[str, str]) -> str:
        env = {**os.environ, "PYTHONPATH": str(SRC), "HANGAR_NETWORK": "user", **extra}
        out = subprocess.run([sys.executable, "-m", "hangar.cli", "doctor", "--data-dir",
                              str(SHARED)], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout

    assert "egress 'open' refused" in doctor({}) and "HANGAR_NET_USER_OPEN" in doctor({})
    assert "egress 'open' ALLOWED" in doctor({"HANGAR_NET_USER_OPEN": "1"})

    for opt_in in ("", "1"):
        d = make_data_dir(base_image)
        srv = Server(d, free_port(), {"HANGAR_NETWORK": "user",
                                      **({"HANGAR_NET_USER_OPEN": opt_in} if opt_in else {})})
        try:
            srv.start()
            with srv.client() as c:
                r = c.post("/sandboxes", json={"network": "internet"})
                assert r.status_code == 400 and "TAP" in r.json()["error"]["message"], r.text
                if not opt_in:
                    r = c.post("/sandboxes", json={"network": "open"})
                    assert r.status_code == 400, r.text
                    msg = r.json()["error"]["message"]
                    assert "HANGAR_NET_USER_OPEN" in msg and "10.0.2.2" in msg, msg
                    r = c.post("/sandboxes", json={"network": {"egress": "open"}})
                    assert r.status_code == 400, r.text
                assert c.get("/sandboxes").json()["sandboxes"] == []
        finally:
            leaked = cleanup(srv)
            shutil.rmtree(d, ignore_errors=True)
        assert not leaked
