"""VMM backends behind one interface (``hangar.engines.base.Engine``).

    base          ``Engine``, ``VMSpec``, ``VM``, ``SnapshotFiles``
    agent_client  the host's side of the agent protocol: ``AgentClient`` and its
                  one handshake; an engine only opens its channel (``AgentChannel``)
    process       VMM processes: spawn, pid file, log tail, kill and reap
    confine       VMM confinement: own user, cgroup, private view, capped console;
                  ``cgroups`` (v2 and v1 limits), ``vmm_exec`` (applies it, then execs)
    snapshot_io   the snapshot manifest, copying files, refreshing a restored guest
    qemu          ``QemuEngine`` (QEMU microvm over QMP)
    firecracker   ``FirecrackerEngine`` and its API client, jailer, files, probe
    doctor        what this host can run; ``choose_engine`` picks and builds one
"""

from __future__ import annotations

from hangar.engines.base import VM, Engine, SnapshotFiles, VMSpec

__all__ = ["VM", "Engine", "SnapshotFiles", "VMSpec"]
