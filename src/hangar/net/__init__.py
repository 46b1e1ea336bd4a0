"""Guest networking: a NIC per sandbox that reaches the internet, never the host.

Design (TAP mode, the default when the server runs as root)::

    guest eth0 (virtio-net, MAC 02:xx from the id, IP from the pool)
        │  QEMU -netdev tap
    hgt<12 hex of the id>   TAP, persistent, bridge port with ``isolated on``
        │
    hgbr0                   bridge; holds the pool's first address (the
        │                   guests' gateway), no IPv6
    host routing ── nftables ``inet hangar``: per-sandbox egress chain,
        │           host input closed to guests, masquerade
    the host's uplink (default route)

* Addresses come from one pool (default 172.30.0.0/16; ``.1`` is the
  gateway); the lowest free one is leased on ``attach`` and returned on
  ``release``. The kernel is the record: each TAP's ifalias reads
  ``hangar <sandbox id> <ip> <egress>``, and a (re)started manager rebuilds
  its leases from the TAPs that exist.
* Everything Hangar adds is named with a prefix: the bridge (``hgbr0``),
  the TAPs and their nft chains (``hgt…``), the tables (``inet hangar``,
  ``bridge hangar``). ``release`` removes one sandbox's share;
  ``sweep(live_ids)`` removes the share of every sandbox not in the list
  (start-up); ``teardown`` removes all.
* Egress policy (``Policy``): ``none`` (no NIC), ``internet`` (default;
  public addresses only), ``open`` (every address), with ``allow``/``deny``
  lists of CIDRs, domains (``*.github.com``) and ports where the most
  specific entry wins (deny on a tie). See ``hangar.net.policy``; changed
  live by ``NetworkManager.set_rules`` (``hangar.net.intercept``).
* Domain entries: the guest's DNS and its TCP 80/443 are redirected to a
  forwarder and a proxy in the server process (``hangar.net.egress``,
  ``dns``, ``sniproxy``), which decide with ``hangar.net.egress_match``.
* DNS otherwise: no forwarder runs on the host. A guest gets the configured resolver
  (``dns``) or else the host's first non-loopback IPv4 nameserver from
  /etc/resolv.conf, and a rule lets it reach that address on port 53 even
  when it is private (unless ``deny`` names it). A host whose only resolver
  is loopback (systemd-resolved's 127.0.0.53) must set ``dns``, or guests
  get none.
* Guests have IPv4 only: the bridge drops their IPv6 frames, and the bridge
  has no IPv6 address.

Security model: the guest is hostile. Whatever its policy, it cannot reach
any address of the host (the ``input`` hook drops every packet from the
bridge but replies to connections the host opened) nor another sandbox
(ports are isolated, bridged guest-to-guest frames and routed bridge-to-bridge
packets are dropped), and it cannot forge another source: a frame from a
TAP must carry that TAP's MAC and address (ARP and IPv4 only). No inbound
connection from outside reaches a guest (forwarded traffic to the bridge is
replies only). Forwarding is enabled host-wide (``net.ipv4.ip_forward``),
as Docker and libvirt do; Hangar's rules only govern traffic of its bridge.

Link-local addresses (169.254.0.0/16, with the cloud metadata service at
169.254.169.254) are out of reach under every policy, ``open`` included;
the IPv6 metadata address (fd00:ec2::254) too, as guests have no IPv6.

User mode (not root, or ``mode="user"``): QEMU's ``-netdev user`` stack,
no host devices or rules. It cannot filter: a guest reaches everything the
host can, including the host's own services (QEMU maps the guest's
10.0.2.2 to the host's loopback, where Hangar's API listens by default).
So ``internet`` and lists raise ``InvalidRequest`` there, and ``egress:
open`` is refused too unless the operator opted in (``user_open``,
``HANGAR_NET_USER_OPEN``); ``hangar doctor`` states which.
"""

from __future__ import annotations

from hangar.net.attachment import NetAttachment
from hangar.net.doctor import doctor_lines
from hangar.net.manager import NetworkManager, mac_for, read_resolver, tap_name
from hangar.net.policy import BLOCKED_INTERNET, Policy

__all__ = ["BLOCKED_INTERNET", "NetAttachment", "NetworkManager", "Policy", "doctor_lines",
           "mac_for", "read_resolver", "tap_name"]
