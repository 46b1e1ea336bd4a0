"""The guests' bridge and address pool: what ``NetworkManager.start`` sets up once, and
the leases every attachment takes from the pool.

The bridge (``hgbr0`` by default) holds the pool's first address, the guests'
gateway; its MAC is derived from its name, so it is the same after every
restart. Host sysctls are written here (forwarding on, redirects off, IPv6
off on the bridge), inside a network namespace through ``nsenter`` when the
manager runs in one. A lease (sandbox, TAP, address, egress mode) lives in
the kernel: each TAP's ifalias reads ``hangar <sandbox id> <guest ip>
<egress>``, so a restarted server reads its leases back (``read_leases``).
Per-sandbox work (TAPs, rules) is ``hangar.net.manager``'s; every function
here takes what it needs (a pyroute2 ``IPRoute``, the bridge's name, the
pool) and keeps no state. Raises ``EngineError`` where the host refuses.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import subprocess
from dataclasses import dataclass
from typing import Any

from hangar.errors import EngineError

ALIAS_TAG = "hangar"
"""First word of a TAP's ifalias: ``hangar <sandbox id> <guest ip> <egress>``."""


@dataclass
class Lease:
    """A sandbox's address on the bridge: its TAP, guest IPv4 address and egress mode."""

    sandbox_id: str
    tap: str
    ip: str
    egress: str


def bridge_mac(bridge: str) -> str:
    """The bridge's MAC: ``02:`` (locally administered) + 5 bytes of SHA-256 of its name."""
    h = hashlib.sha256(b"hangar-bridge:" + bridge.encode()).digest()
    return ":".join(f"{b:02x}" for b in (0x02, *h[:5]))


def ensure_bridge(ipr: Any, bridge: str, gateway: str, pool: ipaddress.IPv4Network) -> None:
    """Make ``bridge`` (no STP, no forward delay) holding ``gateway``/pool prefix, up;
    idempotent. Raises EngineError when another interface routes part of ``pool``."""
    check_overlap(ipr, bridge, pool)
    idx = ipr.link_lookup(ifname=bridge)
    if not idx:
        ipr.link("add", ifname=bridge, kind="bridge", br_forward_delay=0, br_stp_state=0)
        idx = ipr.link_lookup(ifname=bridge)
        ipr.link("set", index=idx[0], address=bridge_mac(bridge),
                 ifalias=f"{ALIAS_TAG} bridge")
    index = idx[0]
    have = {(a.get("address"), a["prefixlen"]) for a in ipr.get_addr(index=index, family=2)}
    if (gateway, pool.prefixlen) not in have:
        ipr.addr("add", index=index, address=gateway, prefixlen=pool.prefixlen)
    ipr.link("set", index=index, state="up")


def check_overlap(ipr: Any, bridge: str, pool: ipaddress.IPv4Network) -> None:
    """EngineError when another interface than ``bridge`` routes part of ``pool``."""
    mine = set(ipr.link_lookup(ifname=bridge))
    for route in ipr.get_routes(family=2, table=254):
        dst = route.get("dst")
        if not dst or route.get("oif") in mine:
            continue
        net = ipaddress.IPv4Network(f"{dst}/{route['dst_len']}", strict=False)
        if net.prefixlen and net.overlaps(pool):
            raise EngineError(f"the guest pool {pool} overlaps the host's route to "
                              f"{net}; configure another pool", pool=str(pool))


def set_sysctl(key: str, value: str, netns: str | None = None, optional: bool = False) -> None:
    """Write ``value`` to the sysctl ``key`` (in the network namespace ``netns``, a name
    under /run/netns); ``optional``: a key that does not exist is no error. Raises
    EngineError."""
    path = "/proc/sys/" + key.replace(".", "/")
    if netns:
        argv = ["nsenter", f"--net=/run/netns/{netns}", "sh", "-c",
                '[ -e "$1" ] || exit 3; echo "$2" > "$1"', "sh", path, value]
        rc = subprocess.run(argv, capture_output=True, timeout=10, check=False).returncode
        ok = rc == 0 or (optional and rc == 3)
    else:
        try:
            with open(path, "w") as f:
                f.write(value)
            ok = True
        except FileNotFoundError:
            ok = optional
        except OSError:
            ok = False
    if not ok:
        raise EngineError(f"cannot set sysctl {key}={value}")


def read_leases(ipr: Any, tap_prefix: str) -> dict[str, Lease]:
    """Leases from the TAPs that exist (``tap_prefix``): their ifalias names the sandbox
    and address. Sandbox id -> lease."""
    leases: dict[str, Lease] = {}
    for link in ipr.get_links():
        name = link.get("ifname") or ""
        alias = (link.get("ifalias") or "").split()
        if not name.startswith(tap_prefix) or len(alias) < 4 or alias[0] != ALIAS_TAG:
            continue
        leases[alias[1]] = Lease(alias[1], name, alias[2], alias[3])
    return leases


def free_ip(pool: ipaddress.IPv4Network, gateway: str, leases: dict[str, Lease]) -> str:
    """The lowest address of ``pool`` that is neither the gateway nor leased; raises
    EngineError when the pool is exhausted."""
    used = {ipaddress.IPv4Address(x.ip) for x in leases.values()}
    for addr in pool.hosts():
        if addr == ipaddress.IPv4Address(gateway):
            continue
        if addr not in used:
            return str(addr)
    raise EngineError(f"the guest address pool {pool} is exhausted", pool=str(pool))


def has_net_admin() -> bool:
    """True when this process has CAP_NET_ADMIN in its effective set."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) & (1 << 12))
    except (OSError, ValueError):
        pass
    return os.geteuid() == 0
