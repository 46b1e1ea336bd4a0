"""A sandbox's egress policy and how it becomes a set of denied addresses.

A policy is an egress mode plus two optional lists of IPv4 CIDRs::

    egress   none       no NIC at all (the guest has only ``lo``)
             internet   (default) everything except ``BLOCKED_INTERNET``:
                        private, shared (CGNAT), loopback, link-local (incl.
                        169.254.169.254, cloud metadata), "this network",
                        IETF-reserved, benchmarking, multicast and class E
             open       every address but ``ALWAYS_BLOCKED``
    allow    CIDRs to reach although the mode blocks them
    deny     CIDRs not to reach although the mode allows them

**The most specific entry wins**, as in a routing table: for a destination,
the matching CIDR with the longest prefix decides, whether it came from
``allow``, ``deny`` or the mode. At the same prefix length ``deny`` beats
``allow``, and both beat the mode. So::

    internet + allow 10.1.2.0/24              10.1.2.x reachable, rest of 10/8 not
    internet + deny 0.0.0.0/0, allow 1.2.3.4/32   only 1.2.3.4 (an allowlist)
    open + deny 10.0.0.0/8, allow 10.9.0.0/16      10.9.x reachable, rest of 10/8 not
    allow 10.1.0.0/16 + deny 10.1.0.0/16      denied (tie: deny wins)

Whatever the policy, a guest never reaches the host itself (any of its
addresses) or another sandbox: ``hangar.net.manager`` enforces that before a
policy is looked at, and no ``allow`` entry can lift it. Nor does it reach
``ALWAYS_BLOCKED``, link-local space with the cloud metadata service
(169.254.169.254), under any mode or ``allow`` entry: it is denied in every
sandbox's chain and again in the base ``forward`` chain (``hangar.net.nft``).
The IPv6 metadata address (fd00:ec2::254) is out of reach because guests
have no IPv6 at all. A DNS exception
lets an ``internet`` guest reach the configured resolver on port 53 even
when it sits in a blocked range, unless ``deny`` names it.

**Domains and ports.** An entry of ``allow``/``deny`` is one of::

    10.1.2.0/24   1.2.3.4          an IPv4 CIDR or address (any port)
    10.0.0.0/8:22                  the same, for one TCP/UDP port only
    example.com                    that name only
    *.example.com                  every name below example.com (not itself)
    example.com:443  *.x.org:80    a name, for one port only

Names are stored lower-case as IDNA ASCII (``bücher.de`` becomes
``xn--bcher-kva.de``). A port entry is more specific than any entry without
a port, so ``deny 0.0.0.0/0, allow 10.0.0.0/8:22`` opens only SSH to 10/8.
Domain entries are matched on what the guest asks for, never on an address
it chose (``hangar.net.egress_match`` has the rules of matching): a
sandbox with any domain entry gets its DNS answered by the host
(``hangar.net.dns``), which refuses (REFUSED) the names a ``deny`` entry
matches and opens, for the answer's TTL, the addresses of the names an
``allow`` entry matches; its HTTP and HTTPS go through a proxy that
checks the Host header or the TLS SNI (``hangar.net.sniproxy``). An
allowed name's addresses open even when a CIDR entry denies them, but
never an address ``internet`` blocks (a public name pointing at a private
address opens nothing; allow the CIDR for that) nor the host, the bridge
network or link-local space.

Guests get no IPv6, so IPv6 entries are refused rather than ignored.
Validation errors raise ``pydantic.ValidationError`` when the model is
built directly (the REST API maps that to 400) and
``hangar.errors.InvalidRequest`` through ``Policy.parse``.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from hangar.errors import InvalidRequest

Egress = Literal["none", "internet", "open"]

MAX_ENTRIES = 256
"""Most entries in ``allow`` plus ``deny``."""
MAX_PORTS = 16
"""Most distinct ports among the CIDR entries that name one (each is a rule of its own)."""

BLOCKED_INTERNET: tuple[str, ...] = (
    "0.0.0.0/8",        # "this network"
    "10.0.0.0/8",       # private
    "100.64.0.0/10",    # shared address space (carrier-grade NAT)
    "127.0.0.0/8",      # loopback
    "169.254.0.0/16",   # link-local, incl. 169.254.169.254 (cloud metadata)
    "172.16.0.0/12",    # private
    "192.0.0.0/24",     # IETF protocol assignments
    "192.168.0.0/16",   # private
    "198.18.0.0/15",    # benchmarking
    "224.0.0.0/4",      # multicast
    "240.0.0.0/4",      # reserved, incl. 255.255.255.255
)
"""What ``egress: internet`` never reaches (unless ``allow`` names it). The
documentation ranges (192.0.2/24, 198.51.100/24, 203.0.113/24) are not
here: nothing routes them on the internet, and tests use them."""

ALWAYS_BLOCKED: tuple[str, ...] = (
    "169.254.0.0/16",   # link-local, incl. 169.254.169.254 (cloud metadata, AWS/GCP/Azure)
)
"""What no policy reaches: ``open`` and ``allow`` entries do not lift it."""

IPV4_END = 1 << 32


class Policy(BaseModel):
    """A sandbox's egress policy; see the module docstring for the rules."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    egress: Egress = Field("internet", description="none: no NIC; internet: public addresses "
                           "only; open: every address. The host, other sandboxes and "
                           "link-local addresses (cloud metadata) are never reachable.")
    allow: tuple[str, ...] = Field((), description="Entries reachable although the mode "
                                   "blocks them: IPv4 CIDRs, domains (example.com, "
                                   "*.example.com), each optionally with a port (host:443, "
                                   "10.0.0.0/8:22); the most specific entry wins.")
    deny: tuple[str, ...] = Field((), description="Entries unreachable although the mode "
                                  "allows them (same forms as allow); the most specific "
                                  "entry wins, deny on a tie.")

    @field_validator("allow", "deny", mode="before")
    @classmethod
    def _entries(cls, value: Any) -> tuple[str, ...]:
        if value is None:
            return ()
        if isinstance(value, str) or not isinstance(value, Iterable):
            raise ValueError("must be a list of entries such as 10.1.2.0/24, example.com, "
                             "*.example.com or host:443")
        out = []
        for n, item in enumerate(value):
            if n >= MAX_ENTRIES:
                raise ValueError(f"at most {MAX_ENTRIES} entries")
            out.append(str(parse_entry(item)))
        return tuple(out)

    @model_validator(mode="after")
    def _consistent(self) -> "Policy":
        if self.egress == "none" and (self.allow or self.deny):
            raise ValueError("egress 'none' gives the sandbox no network; allow/deny do not apply")
        if len(self.allow) + len(self.deny) > MAX_ENTRIES:
            raise ValueError(f"at most {MAX_ENTRIES} entries in allow and deny together")
        if len({e.port for e in self.entries() if e.port is not None and e.net}) > MAX_PORTS:
            raise ValueError(f"at most {MAX_PORTS} distinct ports among CIDR entries")
        return self

    @classmethod
    def parse(cls, value: "Policy | dict[str, Any] | str | None") -> "Policy":
        """A Policy from a Policy, a dict of its fields, an egress name or None (default).

        Raises ``InvalidRequest`` naming the bad field and value.
        """
        if isinstance(value, Policy):
            return value
        if value is None:
            return cls()
        try:
            if isinstance(value, str):
                return cls(egress=value)  # type: ignore[arg-type]
            return cls.model_validate(value)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or 'policy'}: "
                f"{e['msg'].removeprefix('Value error, ')}"
                for e in exc.errors())
            raise InvalidRequest(f"invalid network policy: {problems}") from None

    def entries(self) -> list["Entry"]:
        """Every entry of ``allow`` then ``deny``, parsed."""
        return [parse_entry(e, deny=False) for e in self.allow] + \
            [parse_entry(e, deny=True) for e in self.deny]

    @property
    def has_domains(self) -> bool:
        """Whether any entry names a domain (then DNS and HTTP(S) go through the host)."""
        return any(e.domain for e in self.entries())

    def _cidrs(self, deny: bool, port: int | None) -> list[str]:
        return [str(e.net) for e in self.entries() if e.net and e.deny == deny and e.port == port]

    def denied_ranges(self) -> list[tuple[int, int]]:
        """The destinations this policy denies on any port, as merged [first, last]
        integer ranges, from the CIDR entries without a port and the mode.

        Most specific entry wins; see the module docstring. ``egress: none``
        denies everything (it has no NIC anyway).
        """
        return self._denied(None)

    def port_ranges(self) -> dict[int, list[tuple[int, int]]]:
        """Port -> the ranges denied on that port, for each port a CIDR entry names."""
        ports = sorted({e.port for e in self.entries() if e.net and e.port is not None})
        return {p: self._denied(p) for p in ports}

    def _denied(self, port: int | None) -> list[tuple[int, int]]:
        if self.egress == "none":
            return [(0, IPV4_END - 1)]
        base = BLOCKED_INTERNET if self.egress == "internet" else ()
        # ALWAYS_BLOCKED as the most specific deny there is: nothing lifts it.
        always = [(int(n.network_address), int(n.broadcast_address))
                  for n in map(ipaddress.IPv4Network, ALWAYS_BLOCKED)]
        extra = ((self._cidrs(False, port), self._cidrs(True, port)) if port is not None
                 else ((), ()))
        return merge(resolve(self._cidrs(False, None), self._cidrs(True, None), base, *extra)
                     + always)

    def permits(self, address: str, port: int | None = None) -> bool:
        """True when the CIDR entries and the mode let a guest reach ``address`` (on
        ``port``: None means any port without an entry of its own); the host and other
        sandboxes aside, domain entries aside."""
        a = int(ipaddress.IPv4Address(address))
        ranges = self.port_ranges().get(port) if port is not None else None
        return not any(lo <= a <= hi for lo, hi in
                       (self.denied_ranges() if ranges is None else ranges))

    def admits(self, address: str) -> bool:
        """Whether an allowed name's DNS answer may open ``address``: not link-local, and
        not a range ``internet`` blocks when that is the mode (DNS rebinding)."""
        return Policy(egress=self.egress).permits(address)

    def domain_entries(self) -> list[list[Any]]:
        """The domain entries as ``[pattern, port or None, deny?]`` (``egress_match``)."""
        return [[e.domain, e.port, e.deny] for e in self.entries() if e.domain]

    def match_rules(self, never: Iterable[str] = ()) -> dict[str, Any]:
        """This policy as the JSON-able dict ``hangar.net.egress_match.decide`` reads;
        ``never`` are CIDRs no entry opens (the host's addresses, the bridge network),
        added to ``NEVER``. The dict has no ``resolved`` key: a proxy adds the addresses
        the host resolved for the guest."""
        from hangar.net.egress_match import VERSION

        nets = [ipaddress.IPv4Network(n, strict=False) for n in (*NEVER, *never)]
        return {
            "v": VERSION, "egress": self.egress,
            "never": [list(r) for r in merge((int(n.network_address), int(n.broadcast_address))
                                             for n in nets)],
            "denied": [list(r) for r in self.denied_ranges()],
            "ports": {str(p): [list(r) for r in rs] for p, rs in self.port_ranges().items()},
            "domains": self.domain_entries(),
            # what an allowed name's DNS answer may never open (``admits``: rebinding)
            "unsafe": [list(r) for r in Policy(egress=self.egress).denied_ranges()],
            "unlisted": "refuse" if any(e.deny and e.net is not None and e.port is None
                                        and e.net.prefixlen == 0 for e in self.entries())
            else "resolve",
        }


NEVER: tuple[str, ...] = ("0.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16", "224.0.0.0/3")
"""What an egress proxy never connects to, whatever the rules (``match_rules``): "this
network", loopback, link-local (cloud metadata), multicast and class E; the host's own
addresses and the bridge network are added by the caller."""


@dataclass(frozen=True)
class Entry:
    """One parsed ``allow``/``deny`` entry: a CIDR (``net``) or a domain pattern
    (``domain``), with an optional ``port``; ``str()`` is its normal form."""

    net: ipaddress.IPv4Network | None = None
    domain: str | None = None
    port: int | None = None
    deny: bool = False

    def __str__(self) -> str:
        body = str(self.net) if self.net is not None else str(self.domain)
        return body if self.port is None else f"{body}:{self.port}"


def parse_entry(item: Any, deny: bool = False) -> Entry:
    """One entry (see the module docstring) parsed; ValueError saying what is wrong."""
    if not isinstance(item, str):
        raise ValueError(f"{item!r} is not a string (a CIDR or a domain)")
    if len(item) > 300:
        raise ValueError("an entry is at most 300 characters")
    text = item.strip()
    port: int | None = None
    head, sep, tail = text.rpartition(":")
    if sep and tail.isascii() and tail.isdigit():
        if not 0 < int(tail) < 65536 or len(tail) > 5:
            raise ValueError(f"{item!r}: port {tail} is not in 1-65535")
        port, text = int(tail), head
    elif ":" in text:
        if _is_ipv6(text):
            raise ValueError(f"{item!r} is IPv6; guests have IPv4 only")
        raise ValueError(f"{item!r}: write a port as host:443 or 10.0.0.0/8:22")
    if text and (text[0].isdigit() or "/" in text):
        try:
            net = ipaddress.ip_network(text, strict=False)
        except ValueError:
            if not all(part.isdigit() for part in text.replace("/", ".").split(".")):
                net = None
            else:
                raise ValueError(f"{item!r} is not a valid CIDR (e.g. 10.1.2.0/24 or "
                                 "1.2.3.4)") from None
        if net is not None:
            if net.version != 4:
                raise ValueError(f"{item!r} is IPv6; guests have IPv4 only")
            return Entry(net=net, port=port, deny=deny)  # type: ignore[arg-type]
    wild = text.startswith("*.")
    from hangar.net.egress_match import normalize_name

    name = normalize_name(text[2:] if wild else text)
    if name is None or "*" in text[2 if wild else 0:] or name.split(".")[-1].isdigit():
        raise ValueError(f"{item!r} is neither a valid CIDR (e.g. 10.1.2.0/24) nor a domain "
                         "(e.g. example.com or *.example.com)")
    return Entry(domain=("*." if wild else "") + name, port=port, deny=deny)


def _is_ipv6(text: str) -> bool:
    try:
        return ipaddress.ip_network(text, strict=False).version == 6
    except ValueError:
        return False


def resolve(allow: Sequence[str], deny: Sequence[str], base_deny: Sequence[str],
            port_allow: Sequence[str] = (), port_deny: Sequence[str] = ()
            ) -> list[tuple[int, int]]:
    """Merged [first, last] ranges that end up denied; most specific entry wins.

    Entries rank by (port entry, prefix length, source), source being
    ``deny`` > ``allow`` > base; the base allows 0.0.0.0/0 and denies
    ``base_deny``; ``port_allow``/``port_deny`` (the entries for one port)
    beat every entry without a port.
    """
    # (first, last, (port?, prefix, rank), denied)
    entries: list[tuple[int, int, tuple[int, int, int], bool]] = [
        (0, IPV4_END - 1, (0, 0, 0), False)]
    for cidrs, special, rank, denied in ((base_deny, 0, 0, True), (allow, 0, 1, False),
                                         (deny, 0, 2, True), (port_allow, 1, 1, False),
                                         (port_deny, 1, 2, True)):
        for c in cidrs:
            n = ipaddress.IPv4Network(c, strict=False)
            entries.append((int(n.network_address), int(n.broadcast_address),
                            (special, n.prefixlen, rank), denied))
    cuts = sorted({e[0] for e in entries} | {e[1] + 1 for e in entries})
    out: list[tuple[int, int]] = []
    for start, end in zip(cuts, cuts[1:]):
        # CIDRs nest or are disjoint and every edge is a cut, so whatever
        # contains ``start`` covers the whole segment.
        best = max((e for e in entries if e[0] <= start <= e[1]), key=lambda e: e[2])
        if not best[3]:
            continue
        if out and out[-1][1] == start - 1:
            out[-1] = (out[-1][0], end - 1)
        else:
            out.append((start, end - 1))
    return out


def merge(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, merged [first, last] ranges (touching or overlapping ones joined)."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def range_text(first: int, last: int) -> str:
    """One nftables set element for [first, last]: a CIDR when it is one, else ``a-b``."""
    nets = list(ipaddress.summarize_address_range(ipaddress.IPv4Address(first),
                                                  ipaddress.IPv4Address(last)))
    if len(nets) == 1:
        return str(nets[0])
    return f"{ipaddress.IPv4Address(first)}-{ipaddress.IPv4Address(last)}"
