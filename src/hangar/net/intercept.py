"""``NetworkManager``'s egress operations: redirecting a guest's flows to the host,
opening the addresses its allowed names resolved to, and changing its rules live.

A mix-in of ``hangar.net.manager.NetworkManager`` (kept apart so each module
stays one job). Like the rest of the manager, each method is synchronous,
serialised by the manager's lock, and forwarded to the root helper under a
privilege split (``hangar.privileged.Client``: ``net_intercept``,
``net_admit``, ``net_rules``); the ``*_async`` twins run
in a worker thread.

* ``intercept(sandbox_id, port, dports=(80, 443))``: the guest's new TCP
  connections to any address on ``dports`` are DNAT'ed to
  (``gateway``, ``port``) and the host's ``input`` accepts them on that port
  from that guest only. ``port=None`` removes it. A proxy listening there
  reads the original destination with ``getsockopt(SOL_IP,
  SO_ORIGINAL_DST=80)``; its upstream connection leaves from the host, so it
  must apply ``hangar.net.egress_match.decide`` itself.
* ``redirect_dns(sandbox_id, port)``: the same for UDP and TCP port 53 (the
  host's DNS forwarder, ``hangar.net.dns``).
* ``admit(sandbox_id, entries)``: (address, port or None, seconds) into the
  sandbox's sets of resolved addresses, which its chain accepts before its
  CIDR denies; the kernel drops each when its timeout ends.
* ``set_rules(sandbox_id, policy)``: the sandbox's chain rebuilt for a new
  policy in one nft transaction (new connections see it at once; flows
  already established keep going). Resolved sets are emptied when the
  policy has no domain entries left.

Each is idempotent and ends with the sandbox's ``release``.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from hangar.errors import InvalidRequest, NotFound
from hangar.net import nft as N
from hangar.net.policy import Policy, range_text

if TYPE_CHECKING:
    from hangar.privileged import Client

MAX_ADMIT = 256
"""Most (address, port) pairs one ``admit`` takes."""
MAX_TIMEOUT_S = 86400
"""Longest time an admitted address stays open without a new answer, seconds."""


class EgressOps:
    """The egress half of ``NetworkManager`` (see the module docstring)."""

    # provided by NetworkManager
    _helper: "Client | None"
    _lock: Any
    _leases: dict[str, Any]
    _redirects: dict[str, dict[str, tuple[tuple[int, ...], int]]]
    gateway: str
    nft: N.Nft
    dns: str | None
    mode: str

    def _tap_lease(self, sandbox_id: str) -> Any:
        self.start()  # type: ignore[attr-defined]
        lease = self._leases.get(sandbox_id)
        if lease is None:
            raise NotFound(f"sandbox {sandbox_id} has no network here", sandbox_id=sandbox_id)
        return lease

    def intercept(self, sandbox_id: str, port: int | None,
                  dports: Sequence[int] = (80, 443)) -> None:
        """Redirect the guest's new TCP connections to ``dports`` (any address) to
        (``gateway``, ``port``) on the host; ``port=None`` stops it. Raises NotFound
        (no TAP network for the sandbox), InvalidRequest (bad port), EngineError."""
        self._redirect(sandbox_id, "tcp", port, tuple(dports))

    def redirect_dns(self, sandbox_id: str, port: int | None) -> None:
        """Redirect the guest's DNS (UDP and TCP 53, any address) to (``gateway``,
        ``port``); ``port=None`` stops it. Raises as ``intercept``."""
        self._redirect(sandbox_id, "dns", port, (53,))

    def _redirect(self, sandbox_id: str, kind: str, port: int | None,
                  dports: tuple[int, ...]) -> None:
        if port is not None and not 1024 <= int(port) < 65536:
            raise InvalidRequest(f"redirect port {port} is not in 1024-65535")
        if not 1 <= len(dports) <= 16 or any(not 0 < int(p) < 65536 for p in dports):
            raise InvalidRequest("1-16 destination ports in 1-65535")
        if self.mode != "tap":
            raise InvalidRequest("redirecting a guest's traffic needs TAP networking")
        if self._helper is not None:
            self._helper.net_intercept(sandbox_id, kind, port, [int(p) for p in dports])
            return
        with self._lock:
            lease = self._tap_lease(sandbox_id)
            mine = self._redirects.setdefault(sandbox_id, {})
            if port is None:
                mine.pop(kind, None)
            else:
                mine[kind] = (tuple(int(p) for p in dports), int(port))
            redirects: list[tuple[str, tuple[int, ...], int]] = []
            for k, (ports, to) in sorted(mine.items()):
                redirects += [("tcp", ports, to)] if k == "tcp" else [("udp", ports, to),
                                                                      ("tcp", ports, to)]
            if not mine:
                self._redirects.pop(sandbox_id, None)
            found = self.nft.find(lease.tap)
            script = N.nat_script(found, lease.tap, lease.ip, self.gateway,
                                  _merge(redirects))
            if script:
                self.nft.apply(script)

    def admit(self, sandbox_id: str, entries: Iterable[tuple[str, int | None, int]]) -> None:
        """Open (IPv4 address, port or None for any port, seconds) for the guest until
        the timeout ends (a new admit renews it). Only a sandbox whose policy has domain
        entries has the sets. Raises NotFound, InvalidRequest (bad entry), EngineError."""
        items = []
        for addr, port, seconds in entries:
            try:
                ipaddress.IPv4Address(addr)
            except ValueError:
                raise InvalidRequest(f"bad address {addr!r}") from None
            if port is not None and not 0 < int(port) < 65536:
                raise InvalidRequest(f"bad port {port}")
            items.append((str(addr), None if port is None else int(port),
                          min(max(1, int(seconds)), MAX_TIMEOUT_S)))
        if len(items) > MAX_ADMIT:
            raise InvalidRequest(f"at most {MAX_ADMIT} addresses at once")
        if not items:
            return
        if self._helper is not None:
            self._helper.net_admit(sandbox_id, items)
            return
        with self._lock:
            lease = self._tap_lease(sandbox_id)
            self.nft.apply(N.admit_script(lease.tap, items))

    def set_rules(self, sandbox_id: str, policy: Policy | dict[str, Any] | str) -> Policy:
        """Replace the sandbox's egress rules with ``policy`` (same egress mode, or
        between ``internet`` and ``open``: both have a NIC) in one nft transaction;
        returns the policy parsed. Raises InvalidRequest (bad policy, or ``none`` to or
        from a NIC), NotFound, EngineError."""
        pol = Policy.parse(policy)
        if pol.egress == "none":
            raise InvalidRequest("egress 'none' removes the NIC; it cannot be set on a "
                                 "running sandbox")
        if self.mode != "tap":
            raise InvalidRequest("changing a running sandbox's rules needs TAP networking")
        if self._helper is not None:
            self._helper.net_rules(sandbox_id, pol.model_dump(mode="json"))
            return pol
        with self._lock:
            lease = self._tap_lease(sandbox_id)
            from hangar.net.manager import mac_for

            self.nft.apply(rules_script(lease.tap, mac_for(sandbox_id), lease.ip, pol,
                                        self.dns))
            if not pol.has_domains:
                script = N.unresolved_script(self.nft.find(lease.tap), lease.tap)
                if script:
                    self.nft.apply(script)
            lease.egress = pol.egress
        return pol

    async def intercept_async(self, sandbox_id: str, port: int | None,
                              dports: Sequence[int] = (80, 443)) -> None:
        """``intercept`` in a worker thread."""
        await asyncio.to_thread(self.intercept, sandbox_id, port, tuple(dports))

    async def redirect_dns_async(self, sandbox_id: str, port: int | None) -> None:
        """``redirect_dns`` in a worker thread."""
        await asyncio.to_thread(self.redirect_dns, sandbox_id, port)

    async def admit_async(self, sandbox_id: str,
                          entries: Iterable[tuple[str, int | None, int]]) -> None:
        """``admit`` in a worker thread."""
        await asyncio.to_thread(self.admit, sandbox_id, list(entries))

    async def set_rules_async(self, sandbox_id: str, policy: Policy | dict[str, Any] | str
                              ) -> Policy:
        """``set_rules`` in a worker thread."""
        return await asyncio.to_thread(self.set_rules, sandbox_id, policy)


def rules_script(tap: str, mac: str, ip: str, pol: Policy, dns: str | None) -> str:
    """The nft script of a sandbox's filter chain and its elements under ``pol``:
    ``dns`` (the guests' resolver) stays reachable on port 53 unless an entry denies it."""
    dns_ok = dns if dns and Policy(egress="open", allow=pol.allow, deny=pol.deny).permits(
        dns, 53) else None
    denied = [range_text(a, b) for a, b in pol.denied_ranges()]
    ports = {p: [range_text(a, b) for a, b in rs] for p, rs in pol.port_ranges().items()}
    return N.attach_script(tap, mac, ip, denied, dns_ok, ports, pol.has_domains)


def _merge(redirects: list[tuple[str, tuple[int, ...], int]]
           ) -> list[tuple[str, tuple[int, ...], int]]:
    """Redirects with the destination ports of one protocol made disjoint (a later kind
    keeps a port an earlier one named: DNS's TCP 53 beats a TCP intercept of 53)."""
    seen: dict[str, set[int]] = {}
    out = []
    for proto, ports, to in reversed(redirects):
        left = tuple(p for p in ports if p not in seen.setdefault(proto, set()))
        seen[proto].update(left)
        if left:
            out.append((proto, left, to))
    return list(reversed(out))
