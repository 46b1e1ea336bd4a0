"""``NetworkManager``: the host side of guest networking (bridge, TAPs, rules).

See ``hangar.net`` for the design and the security model. This module
does the per-sandbox work: a sandbox's TAP, address lease and rules
(``attach``, ``release``, ``sweep``, ``teardown``), through netlink
(pyroute2; the kernel is the record of what exists) and nftables
(``hangar.net.nft``). The bridge, its sysctls and the address pool are
``hangar.net.bridge``'s, the egress operations ``hangar.net.intercept``'s
(a mix-in), ``hangar doctor``'s lines ``hangar.net.doctor``'s. Every
method is synchronous and serialised by one lock (each takes tens of
milliseconds, see ``attach``); the ``*_async`` twins run them in a worker
thread for the orchestrator's event loop, and a sync call made from an
event loop's thread moves itself to a worker thread (pyroute2's sync API
cannot run inside a running loop).
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import ipaddress
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from hangar.errors import EngineError, InvalidRequest
from hangar.net import nft as N
from hangar.net.attachment import NetAttachment
from hangar.net.bridge import (
    ALIAS_TAG,
    Lease,
    ensure_bridge,
    free_ip,
    has_net_admin,
    read_leases,
    set_sysctl,
)
from hangar.net.doctor import describe
from hangar.net.intercept import EgressOps, rules_script
from hangar.net.offloop import off_loop
from hangar.net.policy import Policy

if TYPE_CHECKING:
    from hangar.privileged import Client

log = logging.getLogger("hangar.net")

USER_NET = ("10.0.2.15", 24, "10.0.2.2", "10.0.2.3")
"""Guest address, prefix, gateway and DNS under QEMU's user-mode stack (its defaults)."""

_ID_HEX = re.compile(r"^sb-([0-9a-f]{12})$")
_SANDBOX_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
_IFNAME_MAX = 15


_off_loop = off_loop
"""Sync methods that call pyroute2 run off the event loop (``hangar.net.offloop``)."""


def tap_name(sandbox_id: str, prefix: str = "hgt") -> str:
    """The TAP of a sandbox: ``prefix`` + the 12 hex digits of an ``sb-<hex>`` id.

    Other ids get the first hex digits of their SHA-256 instead. Always at
    most 15 characters (the kernel's limit) and the same for the same id.
    """
    m = _ID_HEX.match(sandbox_id)
    tail = m.group(1) if m else hashlib.sha256(sandbox_id.encode()).hexdigest()
    return (prefix + tail)[:_IFNAME_MAX]


def mac_for(sandbox_id: str) -> str:
    """The guest NIC's MAC: ``02:`` (locally administered, unicast) + 5 bytes of SHA-256(id)."""
    h = hashlib.sha256(b"hangar-mac:" + sandbox_id.encode()).digest()
    return ":".join(f"{b:02x}" for b in (0x02, *h[:5]))


def read_resolver(paths: Iterable[Path] = (Path("/etc/resolv.conf"),)) -> str | None:
    """The first IPv4 ``nameserver`` of the first readable file that is not loopback, or None."""
    for path in paths:
        try:
            text = path.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0] == "nameserver":
                try:
                    addr = ipaddress.ip_address(parts[1])
                except ValueError:
                    continue
                if addr.version == 4 and not addr.is_loopback and not addr.is_unspecified:
                    return str(addr)
        return None
    return None


class NetworkManager(EgressOps):
    """Bridge, TAPs, addresses and rules of Hangar's guests on this host.

    ``bridge`` names the bridge (the guests' gateway, holding the pool's
    first address); ``pool`` is the guests' IPv4 subnet (default
    172.30.0.0/16: 65,533 guests); ``tap_prefix`` starts every TAP's and
    per-sandbox chain's name; ``dns`` is the guests' resolver (None: the
    first non-loopback IPv4 nameserver of ``resolv_conf``; ``""``: none);
    ``netns`` runs all of it inside that network namespace (a name under
    /run/netns), for tests or a host that gives Hangar a namespace of its
    own; ``mode`` is ``tap``, ``user`` (QEMU user-mode networking: see
    ``attach``) or ``auto`` (``tap`` when ``available()``, else ``user``);
    ``user_open`` is the operator's opt-in to ``egress: open`` in user mode
    (``HANGAR_NET_USER_OPEN``), where a guest reaches the host's loopback;
    ``helper`` is the root helper's client of a server split from root
    (``hangar.roothelper``), which then holds the real manager: this one checks
    policies and forwards the rest.
    """

    def __init__(self, *, bridge: str = "hgbr0", pool: str = "172.30.0.0/16",
                 tap_prefix: str = "hgt", dns: str | None = None,
                 resolv_conf: Path = Path("/etc/resolv.conf"), netns: str | None = None,
                 mode: Literal["auto", "tap", "user"] = "auto", user_open: bool = False,
                 helper: "Client | None" = None) -> None:
        try:
            net = ipaddress.IPv4Network(pool)
        except ValueError as exc:
            raise InvalidRequest(f"bad network pool {pool!r}: {exc}") from None
        if net.prefixlen > 29:
            raise InvalidRequest(f"network pool {pool} is too small (at most /29)")
        if not re.fullmatch(r"[a-z][a-z0-9-]{0,10}", bridge):
            raise InvalidRequest(f"bad bridge name {bridge!r} (a-z, 0-9, -; at most 11 chars)")
        if not re.fullmatch(r"[a-z][a-z0-9]{0,2}", tap_prefix):
            raise InvalidRequest(f"bad TAP prefix {tap_prefix!r} (1-3 of a-z, 0-9)")
        if bridge.startswith(tap_prefix):
            raise InvalidRequest("the bridge name must not start with the TAP prefix")
        if dns:
            try:
                ipaddress.IPv4Address(dns)
            except ValueError:
                raise InvalidRequest(f"bad DNS server {dns!r} (an IPv4 address)") from None
        self.bridge = bridge
        self.pool = net
        self.gateway = str(net.network_address + 1)
        self.tap_prefix = tap_prefix
        self.dns = read_resolver([resolv_conf]) if dns is None else (dns or None)
        self.netns = netns
        self.nft = N.Nft(netns)
        self._mode_wanted = mode
        self.user_open = user_open
        self._mode: str | None = None
        self._leases: dict[str, Lease] = {}
        self._redirects: dict[str, dict[str, tuple[tuple[int, ...], int]]] = {}
        self.control: list[tuple[str, int]] = []
        """The cluster's control endpoints (``guard_control``)."""
        self._lock = threading.RLock()
        self._started = False
        self._helper = helper if os.geteuid() != 0 else None

    # -- capability ----------------------------------------------------------

    def available(self) -> tuple[bool, str]:
        """Whether TAP networking can work here: (ok, reason). Changes nothing.

        Needs CAP_NET_ADMIN (root), /dev/net/tun, the ``nft`` command,
        pyroute2, and, when one is named, the network namespace and ``nsenter``.
        """
        if self._helper is not None:
            got = self._helper.net_info()
            return got["ok"], got["reason"]
        if not has_net_admin():
            return False, "TAP networking needs root (CAP_NET_ADMIN)"
        try:
            fd = os.open("/dev/net/tun", os.O_RDWR)
            os.close(fd)
        except OSError as exc:
            return False, f"/dev/net/tun cannot be opened: {exc.strerror}"
        if shutil.which("nft") is None:
            return False, "the nft command is missing (install the nftables package)"
        if importlib.util.find_spec("pyroute2") is None:
            return False, "the pyroute2 package is missing"
        if self.netns and not Path(f"/run/netns/{self.netns}").exists():
            return False, f"network namespace {self.netns} does not exist"
        if self.netns and shutil.which("nsenter") is None:
            return False, "the nsenter command is missing (util-linux)"
        where = f" in netns {self.netns}" if self.netns else ""
        return True, f"TAP networking on bridge {self.bridge} ({self.pool}){where}"

    @property
    def mode(self) -> str:
        """``tap`` or ``user``, decided on first use (``auto`` probes ``available``)."""
        if self._mode is None:
            if self._mode_wanted == "auto":
                ok, reason = self.available()
                self._mode = "tap" if ok else "user"
                if not ok:
                    log.warning("guest networking falls back to QEMU user mode: %s", reason)
            else:
                self._mode = self._mode_wanted
        return self._mode

    def check(self, policy: Policy | dict[str, Any] | str | None) -> Policy:
        """``policy`` parsed, when this host can enforce it; else ``InvalidRequest`` saying why.

        TAP mode enforces every policy. User mode filters nothing, so it
        takes ``none``, and ``open`` without lists only when the operator
        opted in (``user_open``): there a guest reaches every address the
        host can, the host's own loopback services included (10.0.2.2).
        """
        pol = Policy.parse(policy)
        if pol.egress == "none" or self.mode != "user":
            return pol
        why = ("this server uses QEMU user-mode networking" if self._mode_wanted == "user"
               else f"TAP networking is not available here: {self.available()[1]}")
        if pol.egress != "open" or pol.allow or pol.deny:
            raise InvalidRequest(
                f"egress {pol.egress!r}{' with allow/deny' if pol.allow or pol.deny else ''} "
                f"needs TAP networking ({why}); QEMU's user-mode stack filters nothing. Use "
                f"egress 'none'" + (" or 'open'" if self.user_open else ""))
        if not self.user_open:
            raise InvalidRequest(
                f"egress 'open' is refused: {why}, and under it a guest reaches this host's "
                "own loopback services through 10.0.2.2 (the API included). The operator can "
                "allow it with HANGAR_NET_USER_OPEN=1 (see `hangar doctor`); else use "
                "egress 'none'")
        return pol

    @property
    def mode_wanted(self) -> str:
        """The mode asked for: ``auto``, ``tap`` or ``user`` (``mode`` is the one used)."""
        return self._mode_wanted

    def describe(self) -> list[str]:
        """Lines for ``hangar doctor``: the mode and what a guest can reach under it
        (``hangar.net.doctor.describe``)."""
        return describe(self)

    # -- start-up -------------------------------------------------------------

    @_off_loop
    def start(self) -> None:
        """Make the bridge, sysctls and base rules, and re-read existing TAPs' leases.

        Idempotent; ``attach`` and ``sweep`` call it when needed. Raises
        ``EngineError`` when TAP networking is unavailable or the pool
        overlaps a network the host already routes elsewhere.
        """
        with self._lock:
            if self._started or self.mode != "tap":
                return
            if self._helper is not None:
                self._helper.net_start()
                self._started = True
                return
            ok, reason = self.available()
            if not ok:
                raise EngineError(f"TAP networking is unavailable: {reason}")
            with self._ipr() as ipr:
                ensure_bridge(ipr, self.bridge, self.gateway, self.pool)
            set_sysctl("net.ipv4.ip_forward", "1", self.netns)
            set_sysctl(f"net.ipv4.conf.{self.bridge}.send_redirects", "0", self.netns)
            set_sysctl(f"net.ipv6.conf.{self.bridge}.disable_ipv6", "1", self.netns,
                       optional=True)
            self.nft.apply(N.base_script(self.bridge, str(self.pool), self.tap_prefix, self.dns))
            self._leases = self._read_leases()
            self._started = True
            log.info("guest network ready", extra={"bridge": self.bridge, "pool": str(self.pool),
                                                   "leases": len(self._leases)})

    @_off_loop
    def guard_control(self, endpoints: Iterable[tuple[str, int]]) -> None:
        """Refuse every guest's TCP to ``endpoints`` ((IPv4, port) pairs: a cluster's etcd
        and node APIs) under any policy: the ``control`` set (``hangar.net.nft``), replaced
        in one transaction. Nothing to do unless guests use TAP networking."""
        endpoints = list(endpoints)
        self.control = endpoints  # the egress proxy refuses them too (hangar.net.egress)
        if self._helper is not None:
            self._helper.net_guard(endpoints)
            return
        with self._lock:
            if self.mode != "tap":
                return
            self.start()
            self.nft.apply(N.control_script(endpoints))

    def _ipr(self) -> Any:
        from pyroute2 import IPRoute

        return IPRoute(netns=self.netns) if self.netns else IPRoute()

    def _read_leases(self) -> dict[str, Lease]:
        """Leases from the TAPs that exist (``hangar.net.bridge.read_leases``)."""
        with self._ipr() as ipr:
            return read_leases(ipr, self.tap_prefix)

    # -- attach / release ---------------------------------------------------------

    @_off_loop
    def attach(self, sandbox_id: str, policy: Policy | dict[str, Any] | str | None = None
               ) -> NetAttachment | None:
        """Give ``sandbox_id`` a NIC under ``policy``; None for ``egress: none``.

        TAP mode: creates TAP ``tap_name(sandbox_id)`` on the bridge (port
        isolated), leases the lowest free address of the pool, and installs
        the sandbox's rules in one nft transaction; about 35 ms. User mode
        (no root): only ``egress: open`` without lists, and only with the
        operator's opt-in (``user_open``), since QEMU's user-mode stack
        reaches every address the host can, the host's own services
        included (its 10.0.2.2 is the host's loopback); anything else
        raises ``InvalidRequest`` (see ``check``).

        Attaching an attached sandbox again replaces its rules and keeps its
        address. Raises ``InvalidRequest`` (bad policy, or one user mode
        cannot enforce) and ``EngineError`` (the kernel refused: nothing of
        the sandbox is left then; or the pool is exhausted).
        """
        pol = self.check(policy)
        if not _SANDBOX_ID.fullmatch(sandbox_id):
            raise InvalidRequest(f"bad sandbox id {sandbox_id!r}")
        if pol.egress == "none":
            return None
        mac = mac_for(sandbox_id)
        if self.mode == "user":
            ip, prefix, gw, dns = USER_NET
            return NetAttachment(sandbox_id, "user", None, mac, ip, prefix, gw, dns, pol.egress)
        if self._helper is not None:
            got = self._helper.net_attach(sandbox_id, pol.model_dump(mode="json"))
            return None if got is None else NetAttachment(**got)
        started = time.monotonic()
        with self._lock:
            self.start()
            tap = tap_name(sandbox_id, self.tap_prefix)
            lease = self._leases.get(sandbox_id)
            ip = lease.ip if lease else free_ip(self.pool, self.gateway, self._leases)
            self._leases[sandbox_id] = Lease(sandbox_id, tap, ip, pol.egress)
            try:
                self._make_tap(tap, f"{ALIAS_TAG} {sandbox_id} {ip} {pol.egress}")
                self.nft.apply(rules_script(tap, mac, ip, pol, self.dns))
            except BaseException:
                try:
                    self._remove(sandbox_id, tap)
                except Exception:  # report the first failure, not the clean-up's
                    log.exception("clean-up after a failed attach failed",
                                  extra={"sandbox_id": sandbox_id})
                raise
        log.info("sandbox network attached", extra={
            "sandbox_id": sandbox_id, "tap": tap, "ip": ip, "egress": pol.egress,
            "duration_s": round(time.monotonic() - started, 3)})
        return NetAttachment(sandbox_id, "tap", tap, mac, ip, self.pool.prefixlen, self.gateway,
                             self.dns, pol.egress)

    def tap_of(self, sandbox_id: str) -> str | None:
        """The TAP of ``sandbox_id``'s current lease, or None."""
        with self._lock:
            lease = self._leases.get(sandbox_id)
            return lease.tap if lease else None

    def _make_tap(self, tap: str, alias: str) -> None:
        from pyroute2.netlink.exceptions import NetlinkError

        try:
            with self._ipr() as ipr:
                if not ipr.link_lookup(ifname=tap):
                    ipr.link("add", ifname=tap, kind="tuntap", mode="tap",
                             ifr={"no_pi": 1, "vnet_hdr": 1})
                idx = ipr.link_lookup(ifname=tap)
                if not idx:
                    raise EngineError(f"TAP {tap} did not appear")
                br = ipr.link_lookup(ifname=self.bridge)[0]
                ipr.link("set", index=idx[0], master=br, ifalias=alias)
                ipr.brport("set", index=idx[0], isolated=1, learning=1)
                ipr.link("set", index=idx[0], state="up")
        except NetlinkError as exc:
            raise EngineError(f"cannot create TAP {tap}: {exc}", tap=tap) from None

    @_off_loop
    def release(self, sandbox_id: str) -> None:
        """Remove the sandbox's TAP, rules and address lease; no error if none is left.

        Call it after the VMM has ended (delete, expiry, crash); a TAP still
        held by a running VMM is removed too, cutting its network.
        """
        if self.mode != "tap":
            return
        if self._helper is not None:
            self._helper.net_release(sandbox_id)
            return
        started = time.monotonic()
        with self._lock:
            self.start()
            tap = tap_name(sandbox_id, self.tap_prefix)
            self._remove(sandbox_id, tap)
        log.info("sandbox network released", extra={
            "sandbox_id": sandbox_id, "tap": tap,
            "duration_s": round(time.monotonic() - started, 3)})

    def _remove(self, sandbox_id: str, tap: str) -> None:
        lease = self._leases.pop(sandbox_id, None)
        self._redirects.pop(sandbox_id, None)
        errors = []
        try:
            self._delete_links({tap})
        except Exception as exc:  # keep going: the rules must go too
            errors.append(str(exc))
        try:
            found = self.nft.find(self.tap_prefix)
            script = N.detach_script(found, {tap}, {lease.ip} if lease else set())
            if script:
                self.nft.apply(script)
        except Exception as exc:
            errors.append(str(exc))
        if errors:
            raise EngineError(f"releasing the network of {sandbox_id} failed: "
                              f"{'; '.join(errors)}", sandbox_id=sandbox_id)

    def _delete_links(self, names: set[str]) -> None:
        from pyroute2.netlink.exceptions import NetlinkError

        with self._ipr() as ipr:
            for name in sorted(names):
                for idx in ipr.link_lookup(ifname=name):
                    try:
                        ipr.link("del", index=idx)
                    except NetlinkError as exc:
                        if exc.code != 19:  # ENODEV: gone meanwhile
                            raise

    @_off_loop
    def sweep(self, live_ids: Iterable[str]) -> list[str]:
        """Remove every TAP and rule of a sandbox not in ``live_ids``; returns their TAPs.

        Call once at start-up, after the orchestrator has decided which
        sandboxes it adopts; leases of the live ones are kept (re-read from
        their TAPs), so their addresses stay theirs.
        """
        if self.mode != "tap":
            return []
        if self._helper is not None:
            return self._helper.net_sweep(live_ids)
        with self._lock:
            self.start()
            live = {tap_name(s, self.tap_prefix) for s in live_ids}
            with self._ipr() as ipr:
                taps = {link.get("ifname") for link in ipr.get_links()}
            taps = {t for t in taps if t and t.startswith(self.tap_prefix)}
            found = self.nft.find(self.tap_prefix)
            stale = (taps | {N.owner(c) for c in found.chains | found.sets}
                     | {p[0] for p in found.ports} | set(found.egress.values())) - live
            self._delete_links(stale & taps)
            script = N.detach_script(found, stale)
            if script:
                self.nft.apply(script)
            self._leases = {sid: lease for sid, lease in self._read_leases().items()
                            if lease.tap in live}
            self._redirects = {s: r for s, r in self._redirects.items() if s in self._leases}
        if stale:
            log.info("stale sandbox networks swept", extra={"taps": sorted(stale)})
        return sorted(stale)

    @_off_loop
    def teardown(self) -> None:
        """Remove everything Hangar made: every TAP, both tables and the bridge."""
        if self.mode != "tap":
            return
        if self._helper is not None:
            self._helper.net_teardown()
            return
        with self._lock:
            with self._ipr() as ipr:
                names = {link.get("ifname") for link in ipr.get_links()}
            self._delete_links({n for n in names if n and n.startswith(self.tap_prefix)}
                               | ({self.bridge} & names))
            script = N.teardown_script(self.nft.find(self.tap_prefix))
            if script:
                self.nft.apply(script)
            self._leases.clear()
            self._redirects.clear()
            self._started = False

    def leases(self) -> dict[str, str]:
        """Sandbox id -> guest address of every current lease (TAP mode)."""
        if self._helper is not None and self.mode == "tap":
            return self._helper.net_leases()
        with self._lock:
            return {sid: lease.ip for sid, lease in self._leases.items()}

    # -- async twins ------------------------------------------------------------

    async def attach_async(self, sandbox_id: str, policy: Policy | dict[str, Any] | str | None = None
                           ) -> NetAttachment | None:
        """``attach`` in a worker thread."""
        return await asyncio.to_thread(self.attach, sandbox_id, policy)

    async def release_async(self, sandbox_id: str) -> None:
        """``release`` in a worker thread."""
        await asyncio.to_thread(self.release, sandbox_id)

    async def sweep_async(self, live_ids: Iterable[str]) -> list[str]:
        """``sweep`` in a worker thread."""
        return await asyncio.to_thread(self.sweep, list(live_ids))
