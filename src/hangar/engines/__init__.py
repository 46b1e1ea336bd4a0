"""VMM backends behind one interface (``hangar.engines.base.Engine``)."""

from __future__ import annotations

from hangar.engines.base import VM, Engine, SnapshotFiles, VMSpec

__all__ = ["VM", "Engine", "SnapshotFiles", "VMSpec", "make_engine"]


def make_engine(kind: str, layout: "Layout", image: "GuestImage", accel: str = "auto") -> Engine:
    """Build the engine named ``kind`` (``auto`` or ``qemu``).

    For QEMU, ``accel`` ``auto`` runs (or reads the cached result of) a KVM
    probe boot of ``image``'s kernel. Raises EngineError if no VMM is found.
    """
    from hangar.engines.qemu import QemuEngine, choose_accel

    chosen, reason = choose_accel(layout, image.kernel, image.initrd, accel)
    return QemuEngine(chosen, reason)


if False:  # typing only
    from hangar.images import GuestImage
    from hangar.layout import Layout
