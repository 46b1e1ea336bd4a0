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

Guests get no IPv6, so IPv6 entries are refused rather than ignored.
Validation errors raise ``pydantic.ValidationError`` when the model is
built directly (the REST API maps that to 400) and
``hangar.errors.InvalidRequest`` through ``Policy.parse``.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from hangar.errors import InvalidRequest

Egress = Literal["none", "internet", "open"]

MAX_ENTRIES = 256
"""Most CIDRs in ``allow`` plus ``deny``."""

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
    allow: tuple[str, ...] = Field((), description="IPv4 CIDRs reachable although the mode "
                                   "blocks them; the most specific entry wins.")
    deny: tuple[str, ...] = Field((), description="IPv4 CIDRs unreachable although the mode "
                                  "allows them; the most specific entry wins, deny on a tie.")

    @field_validator("allow", "deny", mode="before")
    @classmethod
    def _cidrs(cls, value: Any) -> tuple[str, ...]:
        if value is None:
            return ()
        if isinstance(value, str) or not isinstance(value, Iterable):
            raise ValueError("must be a list of IPv4 CIDRs such as 10.1.2.0/24")
        out = []
        for item in value:
            if not isinstance(item, str):
                raise ValueError(f"{item!r} is not a CIDR string")
            try:
                net = ipaddress.ip_network(item.strip(), strict=False)
            except ValueError:
                raise ValueError(f"{item!r} is not a valid CIDR (e.g. 10.1.2.0/24 or 1.2.3.4)") \
                    from None
            if net.version != 4:
                raise ValueError(f"{item!r} is IPv6; guests have IPv4 only")
            out.append(str(net))
        return tuple(out)

    @model_validator(mode="after")
    def _consistent(self) -> "Policy":
        if self.egress == "none" and (self.allow or self.deny):
            raise ValueError("egress 'none' gives the sandbox no network; allow/deny do not apply")
        if len(self.allow) + len(self.deny) > MAX_ENTRIES:
            raise ValueError(f"at most {MAX_ENTRIES} CIDRs in allow and deny together")
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

    def denied_ranges(self) -> list[tuple[int, int]]:
        """The destinations this policy denies, as merged [first, last] integer ranges.

        Most specific entry wins; see the module docstring. ``egress: none``
        denies everything (it has no NIC anyway).
        """
        if self.egress == "none":
            return [(0, IPV4_END - 1)]
        base = BLOCKED_INTERNET if self.egress == "internet" else ()
        # ALWAYS_BLOCKED as the most specific deny there is: nothing lifts it.
        always = [(int(n.network_address), int(n.broadcast_address))
                  for n in map(ipaddress.IPv4Network, ALWAYS_BLOCKED)]
        return merge(resolve(self.allow, self.deny, base) + always)

    def permits(self, address: str) -> bool:
        """True when the policy lets a guest reach ``address`` (host and sandboxes aside)."""
        a = int(ipaddress.IPv4Address(address))
        return not any(lo <= a <= hi for lo, hi in self.denied_ranges())


def resolve(allow: Sequence[str], deny: Sequence[str], base_deny: Sequence[str]) -> list[tuple[int, int]]:
    """Merged [first, last] ranges that end up denied; most specific entry wins.

    Entries rank by (prefix length, source), source being ``deny`` >
    ``allow`` > base; the base allows 0.0.0.0/0 and denies ``base_deny``.
    """
    # (first, last, prefix, rank, denied)
    entries: list[tuple[int, int, int, int, bool]] = [(0, IPV4_END - 1, 0, 0, False)]
    for cidrs, rank, denied in ((base_deny, 0, True), (allow, 1, False), (deny, 2, True)):
        for c in cidrs:
            n = ipaddress.IPv4Network(c, strict=False)
            entries.append((int(n.network_address), int(n.broadcast_address), n.prefixlen,
                            rank, denied))
    cuts = sorted({e[0] for e in entries} | {e[1] + 1 for e in entries})
    out: list[tuple[int, int]] = []
    for start, end in zip(cuts, cuts[1:]):
        # CIDRs nest or are disjoint and every edge is a cut, so whatever
        # contains ``start`` covers the whole segment.
        best = max((e for e in entries if e[0] <= start <= e[1]), key=lambda e: (e[2], e[3]))
        if not best[4]:
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
