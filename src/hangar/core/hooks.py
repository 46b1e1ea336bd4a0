"""Hooks through which a cluster layer (``hangar.cluster``) takes part in the core's steps.

A single-host server uses ``Hooks`` as is: every method does nothing. A
cluster node passes its own subclass to ``SandboxManager``; the core
calls it at the few points where a step must be agreed with the other
nodes or its files shared with them:

==========================  ===================================================
``claim(rec)``              before a sleeping sandbox gets a VMM again (wake):
                            ownership and a VM slot, by compare-and-set; raises
                            LimitExceeded, Conflict or Unavailable (503) to refuse
``release(sandbox_id)``     that wake failed: give the slot back
``saved(rec, snap)``        a snapshot's files are complete (sleep: before the
                            VMM ends, so a failure resumes it); upload them
``fetch_snapshot(snap_id)`` a fork of a snapshot this host lacks: download it
                            and record it locally; raises NotFound
==========================  ===================================================

Records reach the hooks as frozen views (``hangar.core.views``). Arrows run one
way: the core never imports the cluster layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hangar.core.views import SandboxView, SnapshotView


class Hooks:
    """No-op hooks: one host, nothing to agree on."""

    async def claim(self, rec: "SandboxView") -> None:
        """Take ownership and a VM slot before ``rec`` wakes."""

    async def release(self, sandbox_id: str) -> None:
        """Give back what ``claim`` took (the wake failed)."""

    async def saved(self, rec: "SandboxView", snap: "SnapshotView") -> None:
        """``snap``'s files are complete in the local snapshot folder."""

    async def fetch_snapshot(self, snapshot_id: str) -> None:
        """Make ``snapshot_id`` available locally if it is not (forks)."""
