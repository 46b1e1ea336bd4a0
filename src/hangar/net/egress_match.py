"""Egress rules as plain data, and the one decision every egress proxy makes: ``decide``.

Standard library only, and no other import of Hangar's: a proxy that runs
in another interpreter (the secret-injecting proxy has a venv of its own)
loads this file by path (``importlib.util.spec_from_file_location``).

``rules`` is the JSON-able dict ``hangar.net.policy.Policy.match_rules``
makes (``VERSION`` 1)::

    {"v": 1,
     "egress": "internet" | "open",
     "never":   [[first, last], ...]   integer IPv4 ranges no rule opens: the host's own
                                       addresses, the bridge network (gateway and every
                                       sandbox), loopback, link-local (cloud metadata),
                                       "this network", multicast and class E
     "denied":  [[first, last], ...]   ranges the CIDR entries and the mode deny (any port)
     "ports":   {"22": [[first, last], ...]}   the same for one port, where an entry
                                       with that port exists (``10.0.0.0/8:22``)
     "domains": [["*.example.com", null, false], ["api.x.com", 443, true], ...]
                                       (pattern, port or null, deny?)
     "unlisted": "resolve" | "refuse"  what the DNS forwarder does with a name no domain
                                       entry matches: refused when ``deny`` holds 0.0.0.0/0
                                       (an allowlist: no address would open, and a
                                       resolver that answers any name is a way out)
     "unsafe":  [[first, last], ...]   ranges an allowed name's DNS answer never opens:
                                       those the mode itself denies (``internet``: private,
                                       shared, loopback, link-local...), the DNS rebinding
                                       guard (``Policy.admits``; ``admits`` here)
     "resolved": {"203.0.113.7": ["a.example.com"], ...}   optional: addresses the host
                                       resolved for the guest, by the names asked}

How a destination is decided (``decide``), in order:

1. An address in ``never``, or one the host owns now (``host_owns``: the
   kernel's answer at the time of the decision, so an address the host gains
   after the rules were made is refused too): refused, ``denied_host``. No
   entry lifts it.
2. With a ``name`` (TLS SNI, HTTP Host, a DNS question): the domain entry
   that matches best (``match_domain``). A deny: refused,
   ``denied_domain``. An allow: let through when the host resolved that
   name to this very address for the guest (``resolved``), since the guest
   must not choose the address an allowed name leads to; else the CIDR
   rules decide (``unresolved_address`` when they refuse).
3. Otherwise the CIDR rules decide on (address, port): ``denied_address``.

Matching a name: ``example.com`` matches that name only, ``*.example.com``
every name below it (not ``example.com`` itself). An exact entry beats a
wildcard, a longer wildcard a shorter one, an entry with a port one
without, and deny beats allow on a tie. Names compare lower-case, as IDNA
ASCII (``xn--...``), without a trailing dot.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Any

VERSION = 1
"""The ``v`` of the rules dict this module reads."""

REASONS = ("allowed_domain", "allowed_address", "denied_host", "denied_domain",
           "denied_address", "unresolved_address", "unlisted_domain", "bad_address", "bad_name")
"""Every reason ``decide`` gives (short words for events and metrics)."""

MAX_NAME = 253
"""Longest DNS name, characters (RFC 1035)."""


def normalize_name(name: str) -> str | None:
    """``name`` lower-case, IDNA ASCII, no trailing dot; None when it is no host name.

    Takes a name as a guest sends it (SNI, Host without port, DNS question).
    Labels are 1-63 of ``a-z 0-9 - _`` (``_`` as in service names), not
    starting or ending with ``-``; at most ``MAX_NAME`` characters in all.
    """
    if not isinstance(name, str) or not name or len(name) > 4 * MAX_NAME:
        return None
    name = name.strip().rstrip(".")
    try:
        ascii_name = name.encode("idna").decode("ascii").lower()
    except (UnicodeError, ValueError):
        return None
    if not ascii_name or len(ascii_name) > MAX_NAME:
        return None
    for label in ascii_name.split("."):
        if not 0 < len(label) <= 63 or label[0] == "-" or label[-1] == "-":
            return None
        if any(not (c.isascii() and (c.isalnum() or c in "-_")) for c in label):
            return None
    return ascii_name


def match_domain(domains: list[Any], name: str, port: int | None) -> tuple[bool, str] | None:
    """The best domain entry for ``name`` (normalised) and ``port`` (None: any entry
    with or without a port counts only when it has none), as (deny?, pattern); None
    when no entry matches. See the module docstring for the order."""
    best: tuple[tuple[int, int, int, int], bool, str] | None = None
    for entry in domains:
        pattern, eport, deny = entry[0], entry[1], bool(entry[2])
        if eport is not None and eport != port:
            continue
        if pattern.startswith("*."):
            suffix = pattern[1:]
            if not (name.endswith(suffix) and len(name) > len(suffix)):
                continue
            rank = (0, len(suffix), eport is not None, deny)
        elif pattern == name:
            rank = (1, len(pattern), eport is not None, deny)
        else:
            continue
        if best is None or rank > best[0]:
            best = (rank, deny, pattern)
    return None if best is None else (best[1], best[2])


def host_matches(host: str, patterns: list[str]) -> bool:
    """True when ``host`` (a request's host, any case, maybe with a trailing dot) is one of
    ``patterns`` or below a ``*.`` one of them (a secret's hosts: the secret proxy's)."""
    host = host.lower().rstrip(".")
    return any(host.endswith(p[1:]) and len(host) > len(p) - 1 if p.startswith("*.")
               else host == p for p in patterns)


def in_ranges(ranges: list[Any], address: int) -> bool:
    """Whether ``address`` (an int) lies in one of the [first, last] ``ranges``."""
    return any(lo <= address <= hi for lo, hi in ranges)


def cidr_allows(rules: dict[str, Any], address: int, port: int) -> bool:
    """Whether the CIDR entries and the mode let a guest reach ``address`` on ``port``."""
    ranges = rules.get("ports", {}).get(str(port))
    return not in_ranges(rules.get("denied", []) if ranges is None else ranges, address)


_NONLOCAL_BIND: list[bool] = []
"""Whether this host lets a socket bind to any address (``net.ipv4.ip_nonlocal_bind``),
which makes ``host_owns`` unable to tell; asked once."""


def _binds(ip: str) -> bool:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind((ip, 0))
        return True
    except OSError:
        return False


def host_owns(ip: str) -> bool:
    """Whether ``ip`` (IPv4 text) is one of this host's own addresses now: the kernel lets a
    socket bind to it. Asked at each decision, so the never-list follows the host's
    address changes (DHCP, an interface added later) without a refresh. False when the
    host binds any address (``ip_nonlocal_bind``): ``never`` alone holds then."""
    if not _NONLOCAL_BIND:
        _NONLOCAL_BIND.append(_binds("192.0.2.1"))  # TEST-NET-1: no host owns it
    if _NONLOCAL_BIND[0] or ip in ("0.0.0.0", "255.255.255.255"):
        return False
    return _binds(ip)


def admits(rules: dict[str, Any], ip: str) -> bool:
    """Whether a name's DNS answer may open ``ip`` (IPv4 text) for a guest: not in
    ``never`` nor in ``unsafe`` (the DNS rebinding guard: ``hangar.net.policy.Policy.
    admits``), nor the host's own (``host_owns``). The domain guard's DNS forwarder and
    the secret proxy's re-resolution both ask this. Rules without ``unsafe`` admit
    nothing."""
    try:
        address = int(ipaddress.IPv4Address(ip))
    except (ValueError, TypeError):
        return False
    unsafe = rules.get("unsafe")
    if unsafe is None:
        return False
    return not in_ranges(rules.get("never", []), address) and not in_ranges(unsafe, address) \
        and not host_owns(ip)


def decide(rules: dict[str, Any], *, ip: str, port: int, name: str | None = None
           ) -> tuple[bool, str]:
    """Whether a guest may reach ``ip`` (IPv4 text) on ``port`` (TCP/UDP), having asked
    for ``name`` (SNI, Host or DNS name; None: no name); (allowed, reason), reason one
    of ``REASONS``. Never raises on what a guest sends: a bad address or name refuses.
    """
    try:
        address = int(ipaddress.IPv4Address(ip))
    except (ValueError, TypeError):
        return False, "bad_address"
    if in_ranges(rules.get("never", []), address) or host_owns(ip):
        return False, "denied_host"
    if name is not None:
        norm = normalize_name(name)
        if norm is None:
            return False, "bad_name"
        found = match_domain(rules.get("domains", []), norm, port)
        if found is not None and found[0]:
            return False, "denied_domain"
        if found is not None:
            if norm in (rules.get("resolved") or {}).get(ip, ()):
                return True, "allowed_domain"
            if cidr_allows(rules, address, port):
                return True, "allowed_address"
            return False, "unresolved_address"
    if cidr_allows(rules, address, port):
        return True, "allowed_address"
    return False, "denied_address"
