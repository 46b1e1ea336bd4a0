"""VMM backends behind one interface (``hangar.engines.base.Engine``).

``hangar.engines.doctor.choose_engine`` picks and builds one.
"""

from __future__ import annotations

from hangar.engines.base import VM, Engine, SnapshotFiles, VMSpec

__all__ = ["VM", "Engine", "SnapshotFiles", "VMSpec"]
