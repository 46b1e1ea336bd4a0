"""Guests never reach the cluster's control plane: the node keeps its host's rules told.

Whatever a sandbox's egress policy (``open`` too), no guest may open a
TCP connection to a control endpoint of the cluster: any etcd member's
client and peer ports, and any node's API (forwarded calls, the peer probe,
merged lists). Every ``GUARD_S`` seconds, and at start, this node gathers
them and hands them to its network manager, which keeps them in the
``control`` set of its guest-facing filter (``hangar.net.nft``): a guest's
SYN to one of them is answered by a TCP reset (connection refused), before
any policy is looked at.

Where they come from: the etcd URLs this node was given, etcd's member
list (client and peer URLs of every member), and the address of every node
in the directory. A host name is resolved here; only IPv4 is kept (guests
have no IPv6). A node's own host addresses are closed to guests anyway
(the filter's ``input`` chain drops everything from the guests' bridge).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Iterable
from urllib.parse import urlsplit

from hangar.cluster.directory import Directory
from hangar.cluster.etcd import Etcd, EtcdUnavailable
from hangar.core.service import Tasks, every

log = logging.getLogger("hangar.cluster.guard")

GUARD_S = 5.0
"""Seconds between two looks at the cluster's endpoints (a new node is covered within it)."""


def host_port(text: str, default: int) -> tuple[str, int] | None:
    """(host, port) of ``https://host:port``, ``host:port`` or ``[v6]:port``; None if bad."""
    try:
        u = urlsplit(text if "//" in text else f"//{text}")
        return (u.hostname, u.port or default) if u.hostname else None
    except ValueError:
        return None


def ipv4s(host: str) -> list[str]:
    """The IPv4 addresses of ``host`` (a literal, or a name resolved now)."""
    try:
        ip = ipaddress.ip_address(host)
        return [str(ip)] if ip.version == 4 else []
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except OSError:
        return []
    return sorted({str(i[4][0]) for i in infos})


def endpoints(urls: Iterable[str], addresses: Iterable[str]) -> set[tuple[str, int]]:
    """(IPv4, port) pairs of etcd ``urls`` and node ``addresses`` (``host:port``)."""
    out: set[tuple[str, int]] = set()
    for text, default in [(u, 2379) for u in urls] + [(a, 8080) for a in addresses]:
        hp = host_port(text, default)
        if hp is not None:
            out |= {(ip, hp[1]) for ip in ipv4s(hp[0])}
    return out


class Guard:
    """Keeps the host's ``control`` set equal to the cluster's control endpoints."""

    def __init__(self, etcd: Etcd, directory: Directory, net: object) -> None:
        self.etcd = etcd
        self.directory = directory
        self.net = net
        """The network manager (``hangar.net.NetworkManager``) of this node, or None."""
        self.applied: set[tuple[str, int]] | None = None
        self._tasks = Tasks("control guard")

    def start(self) -> None:
        self._tasks.start("run", every(GUARD_S, self.step, log, "control guard failed"))

    async def close(self) -> None:
        await self._tasks.stop()

    async def step(self) -> None:
        """Gather the endpoints; apply them when there are new ones (an endpoint once seen
        stays in the set while this server runs). Raises EngineError when nft fails."""
        if self.net is None:
            return
        urls = list(self.etcd.endpoints)
        try:
            urls += await self.etcd.member_urls()
        except EtcdUnavailable:
            pass
        addresses = [n.address for n in self.directory.nodes.values()]
        found = await asyncio.to_thread(endpoints, urls, addresses)
        found |= self.applied or set()  # a node lost now may come back: it stays closed
        if found == self.applied:
            return
        await asyncio.to_thread(self.net.guard_control, found)  # type: ignore[attr-defined]
        log.info("guests refused the cluster's control endpoints",
                 extra={"endpoints": len(found)})
        self.applied = found
