"""The engine interface: what every VMM backend (QEMU, Firecracker) provides.

An engine turns a ``VMSpec`` into a running microVM and back. It owns the
VMM process, its control socket, the sandbox's copy-on-write disk and the
byte channel to the guest agent; the orchestrator (``hangar.core``) owns
records, limits and policy and never touches a VMM directly.

Every engine method raises ``hangar.errors.EngineError`` (or ``Timeout``)
with the VMM's own message when the VMM fails.
"""

from __future__ import annotations

import abc
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from hangar.layout import SandboxPaths

if TYPE_CHECKING:
    from hangar.guest.client import AgentClient
    from hangar.images import GuestImage
    from hangar.net.attachment import NetAttachment


@dataclass(frozen=True)
class VMSpec:
    """What to boot. Sizes: ``memory_mib`` and ``disk_mib`` in MiB.

    ``net`` is the guest's NIC (``hangar.net.NetworkManager.attach``); None
    boots the guest without one.
    """

    sandbox_id: str
    image: "GuestImage"
    paths: SandboxPaths
    vcpus: int = 1
    memory_mib: int = 512
    disk_mib: int = 2048
    hostname: str = "hangar"
    kernel_args: tuple[str, ...] = ()
    net: "NetAttachment | None" = None


@dataclass
class VM:
    """A running (or paused) microVM as the engine knows it."""

    sandbox_id: str
    engine: str
    pid: int
    paths: SandboxPaths
    accel: str
    extra: dict[str, str] = field(default_factory=dict)

    def alive(self) -> bool:
        """True while the VMM process exists and is not a zombie."""
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            return state not in ("Z", "X")
        except (OSError, IndexError):
            return False


@dataclass(frozen=True)
class SnapshotFiles:
    """Files of one snapshot; ``size_bytes`` is their total size on disk."""

    dir: Path
    size_bytes: int


class Engine(abc.ABC):
    """A VMM backend. Implementations: ``QemuEngine``; Firecracker later."""

    name: str
    accel: str

    @abc.abstractmethod
    async def boot(self, spec: VMSpec) -> VM:
        """Create the sandbox's disk and start its VM; returns once the VMM runs.

        The guest may still be booting: ``connect_agent`` waits for it.
        On failure everything made so far is removed before raising.
        """

    @abc.abstractmethod
    async def connect_agent(self, vm: VM, timeout: float) -> "AgentClient":
        """Open the byte channel to the guest agent and wait for its HELLO."""

    @abc.abstractmethod
    async def stop(self, vm: VM) -> None:
        """End the VM (gracefully, then by force) and remove its files."""

    @abc.abstractmethod
    async def pause(self, vm: VM) -> None:
        """Stop the vCPUs; memory stays resident."""

    @abc.abstractmethod
    async def resume(self, vm: VM) -> None:
        """Restart the vCPUs of a paused VM."""

    @abc.abstractmethod
    async def snapshot(self, vm: VM, dest: Path) -> SnapshotFiles:
        """Save memory, device state and disk into ``dest``; the VM ends paused."""

    @abc.abstractmethod
    async def restore(self, spec: VMSpec, source: Path) -> VM:
        """Start a new VM for ``spec`` from the snapshot in ``source``."""

    @abc.abstractmethod
    def adopt(self, sandbox_id: str, paths: SandboxPaths, pid: int) -> VM | None:
        """Recognise a VMM left running by an earlier server process, or None."""

    def describe(self) -> dict[str, str]:
        """Engine name, accelerator and version for /health and /metrics."""
        return {"engine": self.name, "accel": self.accel}


def kill_process(pid: int | None) -> None:
    """SIGKILL the single process ``pid``, ignoring one that is already gone.

    Only real process ids (> 1) are signalled: ``kill(-1)`` would end every
    process on the host and ``kill(0)`` our own process group.
    """
    if pid is None or pid <= 1:
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
