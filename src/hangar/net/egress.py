"""``EgressGuard``: domain rules enforced for running sandboxes, in the server process.

A sandbox whose policy has a domain entry (``Policy.has_domains``) gets,
on ``enable``:

* its DNS (UDP and TCP 53, whatever address the guest asks) redirected to
  the host's forwarder (``hangar.net.dns``), which answers only names the
  rules do not deny and opens, for the answer's TTL (at least
  ``ADMIT_FLOOR_S``), the addresses of allowed names in the sandbox's
  nftables sets (``NetworkManager.admit``);
* its TCP to ports 80 and 443 redirected to the host's transparent proxy
  (``hangar.net.sniproxy``), which reads the HTTP Host or the TLS SNI and
  lets the connection through only when ``egress_match.decide`` says so.

Both listen on the bridge's gateway address, on ports the kernel picks,
as the server's own (unprivileged) user, and know a sandbox by the source
address of its packets (the bridge drops spoofed ones). Both read the live
rules here, so ``update`` changes what they decide at once, and
``NetworkManager.set_rules`` changes the kernel's part in one transaction.

Another proxy (the secret-injecting one) can take a sandbox's HTTP(S)
instead: its id in ``external`` makes ``enable`` redirect only the DNS, and
``listeners`` hear every change of a guarded sandbox's live rules (the rule
dict with ``resolved``), which that proxy hands to ``egress_match.decide``.

Denials are counted (``on_denied``: the metric) and published as
``egress.denied`` events (``publish``) carrying the sandbox, the domain or
address, the port, the reason and ``via`` (dns or proxy), never a payload.
Repeats are coalesced (``Coalescer``) so a guest in a loop cannot flood the
event bus: one event per (sandbox, target, port, reason) per
``COALESCE_S`` seconds with a count of those held back, and at most
``EVENTS_PER_WINDOW`` events per sandbox in that window.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hangar.net.egress_match import admits, match_domain, normalize_name
from hangar.net.offloop import host_ipv4
from hangar.net.policy import Policy

log = logging.getLogger("hangar.net.egress")

ADMIT_FLOOR_S = 60
"""Least time an allowed name's address stays open after an answer, seconds (a TTL of 0
or 5 would close it before a guest's slow first connection)."""
ADMIT_CEIL_S = 3600
"""Most time an address stays open after one answer, seconds."""
COALESCE_S = 10.0
"""Window of event coalescing, seconds."""
EVENTS_PER_WINDOW = 20
"""Most ``egress.denied`` events of one sandbox per window; the rest are counted only."""
MAX_RESOLVED = 4096
"""Most (address, name) pairs remembered per sandbox; those closest to expiry go first."""
PER_SANDBOX = 64
"""Most DNS queries, DNS TCP connections and proxied connections one sandbox has in flight
at once by default (the rest are dropped or closed), so one guest cannot starve the others
(``Settings.egress_max_flows_per_sandbox``)."""


@dataclass
class Guarded:
    """One sandbox under domain rules: its guest address, policy and live rule dict."""

    sandbox_id: str
    ip: str
    policy: Policy
    rules: dict[str, Any]
    resolved: dict[str, dict[str, float]] = field(default_factory=dict)
    """address -> name -> monotonic expiry: what the forwarder resolved for the guest."""
    busy: int = 0
    """Its DNS queries and connections in flight (``cap`` at most)."""
    cap: int = PER_SANDBOX
    warned: bool = False
    """Whether a failed admission was logged already (once per sandbox)."""

    def enter(self) -> bool:
        """Count one more query or connection in flight; False (not counted) past the cap."""
        if self.busy >= self.cap:
            return False
        self.busy += 1
        return True

    def leave(self) -> None:
        self.busy -= 1

    def live_rules(self) -> dict[str, Any]:
        """``rules`` with ``resolved`` (unexpired) added, for ``egress_match.decide``."""
        now = time.monotonic()
        return {**self.rules, "resolved": {
            a: [n for n, t in names.items() if t > now] for a, names in self.resolved.items()}}


class Coalescer:
    """Decides which denials become events (see the module docstring)."""

    def __init__(self, window: float = COALESCE_S, per_window: int = EVENTS_PER_WINDOW) -> None:
        self.window = window
        self.per_window = per_window
        self._last: dict[tuple[Any, ...], list[float | int]] = {}  # key -> [time, held back]
        self._sent: dict[str, list[float | int]] = {}  # sandbox -> [window start, sent]

    def admit(self, sandbox_id: str, key: tuple[Any, ...]) -> int | None:
        """None: hold this one back; else publish it, with this many repeats held back."""
        now = time.monotonic()
        got = self._last.get(key)
        if got is not None and now - got[0] < self.window:
            got[1] += 1
            return None
        sent = self._sent.setdefault(sandbox_id, [now, 0])
        if now - sent[0] >= self.window:
            sent[:] = [now, 0]
        if sent[1] >= self.per_window:
            if got is not None:
                got[1] += 1
            return None
        sent[1] += 1
        held = int(got[1]) if got is not None else 0
        self._last[key] = [now, 0]
        if len(self._last) > 4096:  # forget the oldest half
            for k in sorted(self._last, key=lambda k: self._last[k][0])[:2048]:
                del self._last[k]
        return held

    def forget(self, sandbox_id: str) -> None:
        self._sent.pop(sandbox_id, None)
        for k in [k for k in self._last if k[0] == sandbox_id]:
            del self._last[k]


class EgressGuard:
    """The DNS forwarder and the HTTP(S) proxy of sandboxes with domain rules.

    ``net`` is the ``NetworkManager``; ``upstream`` the resolver the forwarder asks
    (None: ``net.dns``); ``publish(kind, sandbox_id, **data)`` publishes an event;
    ``on_denied(via, reason)`` counts a denial.
    """

    def __init__(self, net: Any, *, upstream: str | None = None,
                 publish: Callable[..., None] | None = None,
                 on_denied: Callable[[str, str], None] | None = None,
                 per_sandbox: int = PER_SANDBOX) -> None:
        self.net = net
        self.per_sandbox = per_sandbox
        """Each guest's cap on flows in flight (``Guarded.cap``)."""
        self.upstream = upstream or net.dns
        self._publish = publish or (lambda *a, **k: None)
        self._on_denied = on_denied or (lambda via, reason: None)
        self.coalescer = Coalescer()
        self.external: set[str] = set()
        """Sandboxes whose HTTP(S) another proxy takes (the secret-injecting proxy, which
        calls ``egress_match.decide`` itself): ``enable`` redirects only their DNS."""
        self.listeners: list[Callable[[str, dict[str, Any] | None], None]] = []
        """Called with (sandbox id, its live rules, None when unguarded) after every change
        of a guarded sandbox's rules or resolutions: how another proxy follows them."""
        self.by_ip: dict[str, Guarded] = {}
        self.by_id: dict[str, Guarded] = {}
        self._dns: Any = None
        self._proxy: Any = None
        self._start_lock = asyncio.Lock()
        self._never: list[str] | None = None

    # -- the rules ---------------------------------------------------------------------

    def never(self) -> list[str]:
        """CIDRs no rule opens beyond ``policy.NEVER``: the guests' pool, the host's own
        IPv4 addresses (read once from the kernel) and the addresses of the cluster's
        control endpoints (``NetworkManager.guard_control``: the kernel refuses a guest
        those ports, and the proxy's connections leave from the host)."""
        if self._never is None:
            out = [str(self.net.pool)]
            try:  # off the event loop: pyroute2's sync API fails inside a running one
                out += [f"{ip}/32" for ip in host_ipv4()]
            except Exception as exc:  # the pool and NEVER still hold
                log.warning("cannot read the host's addresses", extra={"error": str(exc)})
            self._never = out
        return self._never + sorted({f"{ip}/32" for ip, _ in getattr(self.net, "control", [])})

    def flow_limit(self, floor: int) -> int:
        """The host-wide cap on a proxy's flows in flight: every guarded guest's own cap
        together (at least ``floor``), so that guests filling their caps (one tenant's
        several sandboxes) never leave another guest without its share (REVIEW29 F12)."""
        return max(floor, self.per_sandbox * len(self.by_ip))

    def lookup(self, ip: str) -> Guarded | None:
        """The guarded sandbox whose guest has address ``ip``, or None."""
        return self.by_ip.get(ip)

    def rules(self, sandbox_id: str) -> dict[str, Any] | None:
        """The live rule dict of a guarded sandbox (``egress_match``), or None."""
        g = self.by_id.get(sandbox_id)
        return None if g is None else g.live_rules()

    def name_verdict(self, g: Guarded, name: str) -> tuple[str, list[int | None]]:
        """For a DNS question: ("deny" | "unlisted" | "allow" | "none", ports to open:
        None = any). "unlisted": no entry matches and the rules refuse such names."""
        norm = normalize_name(name)
        if norm is None:
            return "deny", []
        domains = g.rules["domains"]
        ports: list[int | None] = []
        denied = False
        for port in [None, *sorted({d[1] for d in domains if d[1] is not None})]:
            found = match_domain(domains, norm, port)
            if found is None:
                continue
            if found[0]:
                denied = denied or port is None
            elif port is None or None not in ports:
                ports.append(port)
        if ports:
            return "allow", ports
        if denied:
            return "deny", []
        return ("unlisted" if g.rules.get("unlisted") == "refuse" else "none"), []

    def record(self, g: Guarded, name: str, addrs: list[tuple[str, int]],
               ports: list[int | None]) -> list[tuple[str, int | None, int]]:
        """Remember that ``name`` resolved to ``addrs`` ((address, TTL)), whatever the
        verdict (a rule added later opens what the guest already resolved); the entries
        to admit into the kernel's sets for ``ports`` (None: any; [] admits nothing).
        Addresses ``egress_match.admits`` refuses (the rebinding guard, ``never``, the
        host's own) are left out."""
        norm = normalize_name(name) or name
        now = time.monotonic()
        out = []
        for addr, ttl in addrs:
            if not admits(g.rules, addr):  # rebinding, never, the host's own (egress_match)
                continue
            keep = min(max(int(ttl), ADMIT_FLOOR_S), ADMIT_CEIL_S)
            g.resolved.setdefault(addr, {})[norm] = now + keep
            out += [(addr, p, keep) for p in ports]
        if sum(len(v) for v in g.resolved.values()) > MAX_RESOLVED:
            pairs = sorted(((t, a, n) for a, v in g.resolved.items() for n, t in v.items()
                            if t > now), reverse=True)[:MAX_RESOLVED]
            g.resolved = {}
            for t, a, n in pairs:
                g.resolved.setdefault(a, {})[n] = t
        return out

    def denied(self, g: Guarded | None, via: str, reason: str, *, port: int,
               domain: str | None = None, address: str | None = None) -> None:
        """Count one denial and publish it (coalesced); never raises."""
        try:
            self._on_denied(via, reason)
            if g is None:
                return
            target = domain or address or ""
            held = self.coalescer.admit(g.sandbox_id, (g.sandbox_id, target, port, reason, via))
            if held is None:
                return
            data: dict[str, Any] = {"port": port, "reason": reason, "via": via}
            if domain:
                data["domain"] = domain[:253]
            if address:
                data["address"] = address
            if held:
                data["repeats"] = held
            self._publish("egress.denied", g.sandbox_id, **data)
        except Exception:  # best effort, like every event
            log.debug("denial not published", exc_info=True)

    # -- sandboxes ----------------------------------------------------------------------

    async def _ensure_servers(self) -> None:
        async with self._start_lock:
            if self._dns is not None:
                return
            from hangar.net.dns import DnsForwarder
            from hangar.net.sniproxy import SniProxy

            dns = DnsForwarder(self, self.net.gateway)
            await dns.start()
            proxy = SniProxy(self, self.net.gateway)
            try:
                await proxy.start()
            except BaseException:
                await dns.close()
                raise
            self._dns, self._proxy = dns, proxy
            log.info("egress guard listening", extra={"dns_port": dns.port,
                                                      "proxy_port": proxy.port})

    async def enable(self, sandbox_id: str, ip: str, policy: Policy) -> None:
        """Guard ``sandbox_id`` (guest address ``ip``) under ``policy``, which has domain
        entries: start the forwarder and proxy (once), redirect its DNS and 80/443."""
        await self._ensure_servers()
        g = self.by_id.get(sandbox_id)
        if g is None or g.ip != ip:
            if g is not None:
                self.by_ip.pop(g.ip, None)
            g = Guarded(sandbox_id, ip, policy, policy.match_rules(self.never()),
                        cap=self.per_sandbox)
            self.by_id[sandbox_id] = self.by_ip[ip] = g
        else:
            self._set(g, policy)
        await self.net.redirect_dns_async(sandbox_id, self._dns.port)
        if sandbox_id not in self.external:
            await self.net.intercept_async(sandbox_id, self._proxy.port, (80, 443))
        self.changed(g)

    def changed(self, g: Guarded | None, sandbox_id: str | None = None) -> None:
        """Tell the ``listeners`` a sandbox's live rules (None: no longer guarded)."""
        for listener in list(self.listeners):
            try:
                listener(g.sandbox_id if g else str(sandbox_id), g.live_rules() if g else None)
            except Exception:  # a listener's failure is its own
                log.exception("egress rules listener failed")

    def _set(self, g: Guarded, policy: Policy) -> None:
        g.policy = policy
        g.rules = policy.match_rules(self.never())

    async def update(self, sandbox_id: str, ip: str | None, policy: Policy) -> None:
        """New rules for a running sandbox, after ``NetworkManager.set_rules``: guarded
        when ``policy`` has domain entries (addresses still allowed are opened again in
        the kernel's fresh sets), unguarded (redirects removed) when it has none."""
        g = self.by_id.get(sandbox_id)
        if not policy.has_domains:
            if g is not None:
                await self.disable(sandbox_id, redirects=True)
            return
        if ip is None:
            return
        old = dict(g.resolved) if g is not None else {}
        if g is None:
            await self.enable(sandbox_id, ip, policy)
            g = self.by_id[sandbox_id]
        else:
            self._set(g, policy)
        now = time.monotonic()
        again: list[tuple[str, int | None, int]] = []
        g.resolved = {}
        for addr, names in old.items():
            for name, expiry in names.items():
                verdict, ports = self.name_verdict(g, name)
                if verdict in ("allow", "none") and expiry > now:
                    again += self.record(g, name, [(addr, int(expiry - now) + 1)], ports)
        if again:
            await self.net.admit_async(sandbox_id, again[:256])
        self.changed(g)

    async def disable(self, sandbox_id: str, redirects: bool = False) -> None:
        """Stop guarding ``sandbox_id`` (its release removes its rules; ``redirects``
        removes them now, for a sandbox that keeps running without domain rules)."""
        g = self.by_id.pop(sandbox_id, None)
        if g is not None:
            self.by_ip.pop(g.ip, None)
        self.coalescer.forget(sandbox_id)
        if g is not None:
            self.changed(None, sandbox_id)
        if redirects:
            await self.net.redirect_dns_async(sandbox_id, None)
            if sandbox_id not in self.external:
                await self.net.intercept_async(sandbox_id, None)

    async def close(self) -> None:
        """Stop the forwarder and the proxy."""
        for server in (self._dns, self._proxy):
            if server is not None:
                await server.close()
        self._dns = self._proxy = None
