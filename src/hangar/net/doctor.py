"""What ``hangar doctor`` says about guest networking: the mode a server would use and
what a guest can reach under it.

``doctor_lines(network, ...)`` builds a ``NetworkManager`` from the settings
(it changes nothing on the host) and returns ``describe(manager)``'s lines:
TAP (every policy enforced) or QEMU user mode (it filters nothing; whether
``egress: open`` is refused or allowed by ``HANGAR_NET_USER_OPEN``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hangar.errors import InvalidRequest

if TYPE_CHECKING:
    from hangar.net.manager import NetworkManager


def describe(m: "NetworkManager") -> list[str]:
    """Lines for ``hangar doctor``: ``m``'s mode and what a guest can reach under it."""
    if m.mode == "tap":
        ok, reason = m.available()
        state = reason if ok else f"wanted but unavailable: {reason}"
        return [f"guest network: TAP ({state})",
                "guest network: every policy enforced; the host, other sandboxes and "
                "link-local/metadata addresses are never reachable"]
    why = ("HANGAR_NETWORK=user" if m.mode_wanted == "user"
           else f"TAP unavailable: {m.available()[1]}")
    lines = [f"guest network: QEMU user mode ({why}); it filters nothing"]
    if m.user_open:
        lines.append("guest network: egress 'open' ALLOWED by HANGAR_NET_USER_OPEN: such "
                     "guests reach every address this host can, its loopback services "
                     "(the API too) through 10.0.2.2")
    else:
        lines.append("guest network: egress 'open' refused (guests would reach this "
                     "host's loopback through 10.0.2.2); HANGAR_NET_USER_OPEN=1 allows "
                     "it; only 'none' is offered")
    return lines


def doctor_lines(network: str, *, user_open: bool = False, bridge: str = "hgbr0",
                 pool: str = "172.30.0.0/16") -> list[str]:
    """``hangar doctor``'s lines on guest networking for the settings ``HANGAR_NETWORK``
    (``network``: auto, tap, user or off) and ``HANGAR_NET_USER_OPEN`` (``user_open``)."""
    from hangar.net.manager import NetworkManager

    if network == "off":
        return ["guest network: off (HANGAR_NETWORK=off): guests get no NIC"]
    try:
        m = NetworkManager(bridge=bridge, pool=pool, dns="", user_open=user_open,
                           mode=network)  # type: ignore[arg-type]
    except InvalidRequest as exc:
        return [f"guest network: misconfigured: {exc.message}"]
    return describe(m)
