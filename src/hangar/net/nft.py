"""Hangar's nftables rules: rendered here as text, applied with ``nft -f -``.

Two tables of Hangar's own, touched by nothing else and by no other table's
rules (``BR`` is the bridge, ``POOL`` the guests' subnet, ``hgt*`` the TAPs)::

    table inet hangar
      map egress         guest address -> goto its chain   (one element per sandbox)
      set control        address . TCP port of the cluster's control endpoints (etcd
                                       client and peer ports, every node's API; filled
                                       by a cluster node, ``control_script``)
      chain input        hook input:   from BR only replies (ct established,related);
                                       a guest's redirected flows (@inports) to the gateway;
                                       a control endpoint is refused (TCP reset);
                                       every other packet from a guest to any host
                                       address is dropped
      chain forward      hook forward: BR -> BR dropped (guest to guest via the host);
                                       from BR to link-local (169.254/16, cloud
                                       metadata) dropped, whatever the policy
                                       (a link-local resolver passes to its chain);
                                       from BR to a control endpoint: refused (TCP
                                       reset), whatever the policy, ``open`` too;
                                       from BR: ip saddr vmap @egress, else drop;
                                       to BR: replies only
      chain postrouting  hook postrouting (nat): POOL leaving by any other
                                       interface is masqueraded
      chain hgt<id>      one per sandbox: DNS exception, then (domain rules) the
                                       addresses its allowed names resolved to
                                       (sets hgt<id>_r, hgt<id>_rp, with timeouts),
                                       then per-port CIDR rules, then
                                       ``ip daddr {denied} drop``, then accept
      map nat            guest address -> goto its nat chain (intercepted sandboxes)
      set inports        guest address . protocol . port it may open on the gateway
                                       (what its nat chain redirects there)
      chain prerouting   hook prerouting (dstnat): from BR: ip saddr vmap @nat
      chain hgt<id>_nat  TCP to dports -> DNAT gateway:proxy port (``intercept``);
                                       UDP/TCP 53 -> DNAT gateway:DNS port

    table bridge hangar
      set ports          ifname . MAC . IPv4 of each TAP (anti-spoofing)
      chain prerouting   a frame from an hgt* port must be ARP or IPv4 with that
                         port's MAC and address; everything else (IPv6,
                         other ethertypes, spoofed sources) is dropped
      chain forward      hgt* -> hgt* dropped (guests never reach each other at L2;
                         the ports are also ``isolated``)

Per-sandbox rules live in a chain named like its TAP plus one element in
``egress`` and one in ``ports``, so ``attach`` and ``release`` are each one
atomic nft transaction, and what exists is read back with ``nft -j list``
(sweeps and restarts trust the kernel, not memory). The base chains are
flushed and re-filled at start-up without touching per-sandbox state, so a
restarted server keeps the rules of the sandboxes it adopts.

A drop in any base chain is final whatever other tables say, so other
firewalls cannot open what Hangar closes; but another table's drop (say a
FORWARD policy of drop) can still block guest traffic Hangar accepts.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from hangar.errors import EngineError

TABLE = "hangar"
NFT_TIMEOUT_S = 10.0
RESOLVED_MAX = 16384
"""Most elements of one sandbox's set of resolved addresses (an add past it fails)."""


def owner(name: str) -> str:
    """The TAP a per-sandbox chain or set belongs to (``hgt…`` before any ``_``)."""
    return name.split("_", 1)[0]


@dataclass
class Found:
    """Hangar's per-sandbox nftables objects, as read from the kernel."""

    chains: set[str] = field(default_factory=set)
    sets: set[str] = field(default_factory=set)
    egress: dict[str, str] = field(default_factory=dict)  # guest ip -> chain
    nat: dict[str, str] = field(default_factory=dict)  # guest ip -> nat chain
    inports: list[tuple[str, str, str]] = field(default_factory=list)  # (ip, proto, port)
    ports: list[tuple[str, str, str]] = field(default_factory=list)  # (tap, mac, ip)
    tables: set[str] = field(default_factory=set)  # families that have a hangar table


class Nft:
    """Runs ``nft``, inside the network namespace ``netns`` when one is named."""

    def __init__(self, netns: str | None = None) -> None:
        self.netns = netns

    def argv(self, *args: str) -> list[str]:
        exe = shutil.which("nft")
        if exe is None:
            raise EngineError("nft not found; install the nftables package")
        prefix = ["nsenter", f"--net=/run/netns/{self.netns}"] if self.netns else []
        return [*prefix, exe, *args]

    def apply(self, script: str) -> None:
        """Run ``script`` as one atomic transaction; EngineError with nft's message on failure."""
        proc = subprocess.run(self.argv("-f", "-"), input=script, text=True, capture_output=True,
                              timeout=NFT_TIMEOUT_S, check=False)
        if proc.returncode != 0:
            raise EngineError(f"nft failed: {proc.stderr.strip()[-800:]}", step="nftables")

    def list_table(self, family: str) -> list[dict[str, Any]]:
        """``nft -j list table FAMILY hangar`` as a list of objects; [] when it does not exist."""
        proc = subprocess.run(self.argv("-j", "list", "table", family, TABLE), text=True,
                              capture_output=True, timeout=NFT_TIMEOUT_S, check=False)
        if proc.returncode != 0:
            if "No such file" in proc.stderr:
                return []
            raise EngineError(f"nft list failed: {proc.stderr.strip()[-800:]}", step="nftables")
        return list(json.loads(proc.stdout).get("nftables", []))

    def find(self, tap_prefix: str) -> Found:
        """Every per-sandbox object in Hangar's tables (chains named ``tap_prefix*``)."""
        found = Found()
        for family in ("inet", "bridge"):
            for obj in self.list_table(family):
                if "table" in obj:
                    found.tables.add(family)
                elif "chain" in obj and obj["chain"]["name"].startswith(tap_prefix):
                    found.chains.add(obj["chain"]["name"])
                elif "map" in obj and obj["map"]["name"] in ("egress", "nat"):
                    into = found.egress if obj["map"]["name"] == "egress" else found.nat
                    for key, verdict in obj["map"].get("elem", []):
                        target = next(iter(verdict.values()), {}).get("target", "")
                        into[str(key)] = target
                elif "set" in obj and obj["set"]["name"].startswith(tap_prefix):
                    found.sets.add(obj["set"]["name"])
                elif "set" in obj and obj["set"]["name"] == "inports":
                    for elem in obj["set"].get("elem", []):
                        ip, proto, port = (elem.get("elem", elem) if isinstance(elem, dict)
                                           else elem)["concat"]
                        found.inports.append((str(ip), str(proto), str(port)))
                elif "set" in obj and obj["set"]["name"] == "ports":
                    for elem in obj["set"].get("elem", []):
                        tap, mac, ip = (elem.get("elem", elem) if isinstance(elem, dict)
                                        else elem)["concat"]
                        found.ports.append((str(tap), str(mac), str(ip)))
        return found


def q(name: str) -> str:
    """An nft quoted string (names here are ``[a-z0-9-]`` already; this guards anyway)."""
    if not name or any(c in name for c in '"\\\n;{}'):
        raise EngineError(f"unsafe name for nft: {name!r}")
    return f'"{name}"'


def base_script(bridge: str, pool: str, tap_prefix: str, dns: str | None = None) -> str:
    """The tables, sets and base chains; idempotent, keeps per-sandbox chains and elements.

    ``dns`` is the guests' resolver: when it is link-local itself, the base
    chain lets packets to it through to the sandbox's chain (which allows
    only port 53 there).
    """
    import ipaddress

    from hangar.net.policy import ALWAYS_BLOCKED

    br, taps = q(bridge), q(tap_prefix + "*")
    gateway = ipaddress.IPv4Network(pool).network_address + 1
    t = f"inet {TABLE}"
    b = f"bridge {TABLE}"
    blocked = ", ".join(ALWAYS_BLOCKED)
    spare = ""
    if dns and any(ipaddress.IPv4Address(dns) in ipaddress.IPv4Network(n) for n in ALWAYS_BLOCKED):
        spare = f" ip daddr != {ipaddress.IPv4Address(dns)}"
    return "\n".join([
        f"add table {t}",
        f"add map {t} egress {{ type ipv4_addr : verdict; }}",
        f"add set {t} control {{ type ipv4_addr . inet_service; }}",
        f"add map {t} nat {{ type ipv4_addr : verdict; }}",
        f"add set {t} inports {{ type ipv4_addr . inet_proto . inet_service; }}",
        f"add chain {t} input {{ type filter hook input priority filter; policy accept; }}",
        f"flush chain {t} input",
        f"add rule {t} input iifname {br} ct state established,related accept",
        f"add rule {t} input iifname {br} ip daddr {gateway} ct status dnat"
        f" ip saddr . meta l4proto . th dport @inports accept",
        f"add rule {t} input iifname {br} meta l4proto tcp ip daddr . tcp dport @control"
        f" counter reject with tcp reset",
        f"add rule {t} input iifname {br} counter drop",
        f"add chain {t} forward {{ type filter hook forward priority filter; policy accept; }}",
        f"flush chain {t} forward",
        f"add rule {t} forward iifname {br} oifname {br} counter drop",
        f"add rule {t} forward iifname {br} ip daddr {{ {blocked} }}{spare} counter drop",
        f"add rule {t} forward iifname {br} meta l4proto tcp ip daddr . tcp dport @control"
        f" counter reject with tcp reset",
        f"add rule {t} forward iifname {br} ip saddr vmap @egress",
        f"add rule {t} forward iifname {br} counter drop",
        f"add rule {t} forward oifname {br} ct state established,related accept",
        f"add rule {t} forward oifname {br} counter drop",
        f"add chain {t} postrouting {{ type nat hook postrouting priority srcnat; policy accept; }}",
        f"flush chain {t} postrouting",
        f"add rule {t} postrouting ip saddr {pool} oifname != {br} masquerade",
        f"add chain {t} prerouting {{ type nat hook prerouting priority dstnat; policy accept; }}",
        f"flush chain {t} prerouting",
        f"add rule {t} prerouting iifname {br} ip saddr vmap @nat",
        f"add table {b}",
        f"add set {b} ports {{ type ifname . ether_addr . ipv4_addr; }}",
        f"add chain {b} prerouting {{ type filter hook prerouting priority filter; policy accept; }}",
        f"flush chain {b} prerouting",
        f"add rule {b} prerouting iifname != {taps} accept",
        f"add rule {b} prerouting ether type arp iifname . ether saddr . arp saddr ip @ports"
        f" iifname . arp saddr ether . arp saddr ip @ports accept",
        f"add rule {b} prerouting ether type ip iifname . ether saddr . ip saddr @ports accept",
        f"add rule {b} prerouting counter drop",
        f"add chain {b} forward {{ type filter hook forward priority filter; policy accept; }}",
        f"flush chain {b} forward",
        f"add rule {b} forward iifname {taps} oifname {taps} counter drop",
        "",
    ])


def control_script(endpoints: Iterable[tuple[str, int]]) -> str:
    """Replace the ``control`` set with ``endpoints`` ((IPv4 address, TCP port) pairs: the
    cluster's etcd client and peer ports, every node's API), in one transaction."""
    import ipaddress

    t = f"inet {TABLE}"
    elems = sorted({f"{ipaddress.IPv4Address(ip)} . {int(port)}" for ip, port in endpoints
                    if 0 < int(port) < 65536})
    lines = [f"add set {t} control {{ type ipv4_addr . inet_service; }}",
             f"flush set {t} control"]
    if elems:
        lines.append(f"add element {t} control {{ {', '.join(elems)} }}")
    return "\n".join(lines) + "\n"


def attach_script(tap: str, mac: str, ip: str, denied: list[str], dns: str | None,
                  ports: dict[int, list[str]] | None = None, resolved: bool = False) -> str:
    """One sandbox's chain, its ``egress`` element and its ``ports`` element.

    ``ports`` maps a port to the ranges denied on it (CIDR entries with a
    port); ``resolved`` adds the sets of addresses its allowed names
    resolved to (``<tap>_r``: any port, ``<tap>_rp``: address . port), kept
    (with their elements) when they exist, and accepted before any deny.
    """
    t = f"inet {TABLE}"
    lines = [f"add chain {t} {tap}", f"flush chain {t} {tap}"]
    if dns:
        lines.append(f"add rule {t} {tap} ip daddr {dns} meta l4proto {{ tcp, udp }} "
                     f"th dport 53 accept")
    if resolved:
        lines += [f"add set {t} {tap}_r {{ type ipv4_addr; flags timeout; size {RESOLVED_MAX}; }}",
                  f"add set {t} {tap}_rp {{ type ipv4_addr . inet_service; flags timeout; "
                  f"size {RESOLVED_MAX}; }}",
                  f"add rule {t} {tap} ip daddr @{tap}_r accept",
                  f"add rule {t} {tap} meta l4proto {{ tcp, udp }} ip daddr . th dport "
                  f"@{tap}_rp accept"]
    for port, ranges in sorted((ports or {}).items()):
        if ranges:
            lines.append(f"add rule {t} {tap} meta l4proto {{ tcp, udp }} th dport {int(port)} "
                         f"ip daddr {{ {', '.join(ranges)} }} counter drop")
        lines.append(f"add rule {t} {tap} meta l4proto {{ tcp, udp }} th dport {int(port)} "
                     f"accept")
    if denied:
        lines.append(f"add rule {t} {tap} ip daddr {{ {', '.join(denied)} }} counter drop")
    lines += [
        f"add rule {t} {tap} accept",
        f"add element {t} egress {{ {ip} : goto {tap} }}",
        f"add element bridge {TABLE} ports {{ {q(tap)} . {mac} . {ip} }}",
        "",
    ]
    return "\n".join(lines)


def unresolved_script(found: Found, tap: str) -> str:
    """Delete ``tap``'s sets of resolved addresses (after its chain stops using them)."""
    t = f"inet {TABLE}"
    return "".join(f"delete set {t} {name}\n" for name in sorted(found.sets)
                   if name in (f"{tap}_r", f"{tap}_rp"))


def nat_script(found: Found, tap: str, ip: str, gateway: str,
               redirects: list[tuple[str, tuple[int, ...], int]]) -> str:
    """Replace ``tap``'s redirections: each (protocol ``tcp``/``udp``, destination ports,
    gateway port) DNATs the guest's new flows of that protocol to those ports, any
    address, to ``gateway``:port, and lets them into the host (``inports``). No
    redirects: the nat chain and its elements go."""
    t = f"inet {TABLE}"
    chain = f"{tap}_nat"
    lines = [f"delete element {t} inports {{ {e[0]} . {e[1]} . {e[2]} }}"
             for e in found.inports if e[0] == ip]
    if ip in found.nat:
        lines.append(f"delete element {t} nat {{ {ip} }}")
    if not redirects:
        if chain in found.chains:
            lines.append(f"delete chain {t} {chain}")
        return "\n".join(lines) + "\n" if lines else ""
    lines += [f"add chain {t} {chain}", f"flush chain {t} {chain}"]
    elems = []
    for proto, dports, port in redirects:
        if proto not in ("tcp", "udp") or not 0 < int(port) < 65536:
            raise EngineError(f"bad redirect {proto}/{port}")
        listed = ", ".join(str(int(p)) for p in dports)
        lines.append(f"add rule {t} {chain} meta l4proto {proto} th dport {{ {listed} }} "
                     f"dnat ip to {gateway}:{int(port)}")
        elems.append(f"{ip} . {proto} . {int(port)}")
    lines += [f"add element {t} inports {{ {', '.join(elems)} }}",
              f"add element {t} nat {{ {ip} : goto {chain} }}", ""]
    return "\n".join(lines)


def admit_script(tap: str, entries: Iterable[tuple[str, int | None, int]]) -> str:
    """Add (address, port or None for any, seconds) to ``tap``'s resolved sets; an
    element already there gets the new timeout."""
    t = f"inet {TABLE}"
    lines = []
    import ipaddress

    for addr, port, seconds in entries:
        a = ipaddress.IPv4Address(addr)
        key = str(a) if port is None else f"{a} . {int(port)}"
        name = f"{tap}_r" if port is None else f"{tap}_rp"
        # delete-after-add: an element that exists gets its timeout renewed
        lines += [f"add element {t} {name} {{ {key} }}", f"delete element {t} {name} {{ {key} }}",
                  f"add element {t} {name} {{ {key} timeout {max(1, int(seconds))}s }}"]
    return "\n".join(lines) + "\n" if lines else ""


def detach_script(found: Found, taps: set[str], ips: set[str] | None = None) -> str:
    """Delete every object of the TAPs ``taps`` (and map elements of ``ips``) in ``found``.

    Built from what exists, so it never fails on something already gone.
    """
    t = f"inet {TABLE}"
    ips = set(ips or ())
    lines = []
    for ip, chain in sorted(found.egress.items()):
        if chain in taps or ip in ips:
            lines.append(f"delete element {t} egress {{ {ip} }}")
    for ip, chain in sorted(found.nat.items()):
        if owner(chain) in taps or ip in ips:
            ips.add(ip)
            lines.append(f"delete element {t} nat {{ {ip} }}")
    for ip, proto, port in found.inports:
        if ip in ips:
            lines.append(f"delete element {t} inports {{ {ip} . {proto} . {port} }}")
    for tap, mac, ip in found.ports:
        if tap in taps:
            lines.append(f"delete element bridge {TABLE} ports {{ {q(tap)} . {mac} . {ip} }}")
    for chain in sorted(c for c in found.chains if owner(c) in taps):
        lines.append(f"delete chain {t} {chain}")
    for name in sorted(n for n in found.sets if owner(n) in taps):
        lines.append(f"delete set {t} {name}")
    return "\n".join(lines) + "\n" if lines else ""


def teardown_script(found: Found) -> str:
    """Delete both of Hangar's tables (whatever exists of them)."""
    return "".join(f"delete table {fam} {TABLE}\n" for fam in sorted(found.tables))
