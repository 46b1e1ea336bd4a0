"""What an engine needs to give one guest its NIC: ``NetAttachment``.

Made by ``NetworkManager.attach``; read by the engines (QEMU's ``-netdev``,
Firecracker's ``network-interfaces``) and, through ``kernel_arg``, by the
guest (``hangar.guest.net``). Plain data, no dependencies, so the engines'
module can import it without pulling in netlink.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

KERNEL_ARG = "hangar.net"
"""Kernel command-line key read by ``hangar.guest.net.configure``."""


@dataclass(frozen=True)
class NetAttachment:
    """One sandbox's network: its host device and the guest's addresses.

    ``kind`` is ``tap`` (a TAP device ``tap`` on Hangar's bridge, filtered by
    nftables) or ``user`` (QEMU's user-mode stack; ``tap`` is None). ``ip``
    is the guest's IPv4 address with prefix length ``prefix``, ``gateway``
    its default route, ``dns`` its resolver (None: none), ``mac`` the
    guest NIC's address (locally administered, derived from the sandbox id).
    """

    sandbox_id: str
    kind: Literal["tap", "user"]
    tap: str | None
    mac: str
    ip: str
    prefix: int
    gateway: str
    dns: str | None
    egress: str

    def kernel_arg(self) -> str:
        """``hangar.net=IP/PREFIX,GATEWAY,DNS`` (DNS empty when there is none)."""
        return f"{KERNEL_ARG}={self.ip}/{self.prefix},{self.gateway},{self.dns or ''}"
