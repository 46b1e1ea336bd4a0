"""What root prepares before a server drops to its user: the Firecracker probe boot whose
answer the unprivileged server reads (``probe_as_root``), and the jailer the root helper
runs for it (``host_jail``). Used by ``hangar serve``'s split (``hangar.cli.serve``) and by
a root build's template-snapshot step beside a split server (``hangar.cli.snapshot_step``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hangar.errors import HangarError

if TYPE_CHECKING:
    from collections.abc import Callable

    from hangar.config import Settings
    from hangar.engines.firecracker.hostjail import HostJail
    from hangar.layout import Layout


def probe_as_root(settings: "Settings", layout: "Layout") -> None:
    """Run (or read) the Firecracker probe boot while still root, so its cached answer
    (``firecracker_usable``) is there for the split server, which cannot open /dev/kvm
    itself (its VMMs get a KVM node from the jailer)."""
    from hangar.engines.doctor import firecracker_usable
    from hangar.images import resolve_image

    try:
        firecracker_usable(layout, resolve_image(layout, settings.default_image))
    except HangarError:
        pass  # no default image yet: the server's own choice says so


def host_jail(settings: "Settings") -> "Callable[[int], HostJail] | None":
    """What makes the helper's Firecracker jailer (``HostJail``) from the server's group,
    or None: the engine is QEMU, the jailer is turned off, or firecracker or the jailer
    is not installed (the engine's choice then says why, as for a root server)."""
    if settings.engine == "qemu" or settings.firecracker_jailer == "off":
        return None
    from hangar.engines.confine import config_from
    from hangar.engines.firecracker import find_firecracker, find_jailer

    fc, jb = find_firecracker(), find_jailer()
    if fc is None or jb is None:
        return None

    def make(gid: int) -> "HostJail":
        from hangar.engines.firecracker.hostjail import HostJail
        from hangar.engines.firecracker.jailer import JailerConfig

        c = config_from(settings)
        return HostJail(JailerConfig(jb, cgroups=c.cgroups if c.enabled else "off"),  # type: ignore[arg-type]
                        fc, gid, console_log_bytes=c.console_log_bytes)

    return make
