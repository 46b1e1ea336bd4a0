"""The engine interface: what every VMM backend (QEMU, Firecracker) provides.

An engine turns a ``VMSpec`` into a running microVM and back. It owns the
VMM process, its control socket, the sandbox's copy-on-write disk and the
byte channel to the guest agent; the orchestrator (``hangar.core``) owns
records, limits and policy and never touches a VMM directly.

Every engine method raises ``hangar.errors.EngineError`` (or ``Timeout``)
with the VMM's own message when the VMM fails.

What engines share lives beside this module: the VMM process helper
(``hangar.engines.process``), the agent handshake
(``hangar.engines.agent_client.AgentClient.handshake``: an engine only says
how to open its channel, ``agent_channel``), and the snapshot manifest
(``hangar.engines.snapshot_io``).
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from hangar.engines import process, safefs
from hangar.engines.agent_client import AgentChannel, AgentClient
from hangar.engines.confine import release_folder
from hangar.engines.memory import MemoryUsage, host_usage
from hangar.engines.process import kill_process
from hangar.errors import BootStalled, GuestError, Timeout
from hangar.layout import SandboxPaths

if TYPE_CHECKING:
    from hangar.images import GuestImage
    from hangar.privileged import Client
    from hangar.net.attachment import NetAttachment

STALL_FIRST_S = 5.0
"""Seconds after a cold boot's VMM start before ``boot_stalled`` is first asked; a healthy
guest under emulation is past its timer's calibration (0.2 s of its own time) by then
unless its host starves it, and a reading during the calibration itself is not enough."""
STALL_EVERY_S = 2.0
"""Seconds between two ``boot_stalled`` readings: far longer than the 100 ms a calibration
takes, so two readings in a row never both fall inside one."""
STALL_READINGS = 2
"""Readings in a row that must say a boot can never finish before it is given up."""
BOOT_ATTEMPTS = 3
"""Cold boots made for one sandbox (or template) when each ends in ``BootStalled``
(``again_if_stalled``, used by ``hangar.core.launch`` and ``hangar.core.templates``)."""

__all__ = ["BOOT_ATTEMPTS", "VM", "Engine", "SnapshotFiles", "VMSpec", "VolumeDrive",
           "again_if_stalled", "kill_process", "volume_serial"]

log = logging.getLogger("hangar.engines")
T = TypeVar("T")


async def again_if_stalled(boot: Callable[[], Awaitable[T]], what: dict[str, Any],
                           stalled: Callable[[], object] = lambda: None) -> T:
    """``boot()``'s result, made again while it raises ``BootStalled`` (a cold boot whose
    guest can never answer: ``Engine.connect_agent``), ``BOOT_ATTEMPTS`` times in all; the
    last one's error reaches the caller. ``boot`` leaves nothing behind when it raises.
    Each stall calls ``stalled()`` and, when another boot follows, logs a warning
    (``boot stalled: booting again``) with ``what`` (ids: never secrets)."""
    for attempt in range(1, BOOT_ATTEMPTS + 1):
        try:
            return await boot()
        except BootStalled as exc:
            stalled()
            if attempt == BOOT_ATTEMPTS:
                raise
            log.warning("boot stalled: booting again",
                        extra={**what, "attempt": attempt, "error": exc.message})
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class VolumeDrive:
    """A named volume attached to a VM as an extra virtio-blk drive (``hangar.core.volumes``).

    ``image``: the volume's ext4 image, which the engine hard-links into the sandbox's
    folder as ``SandboxPaths.volume(index)`` (so a confined VMM reaches it where it
    reaches its own disk); ``read_only``: the drive is read-only (many readers) or
    read-write (one writer); ``size_mib``: its size, MiB. The guest finds the drive by
    its ``serial``.
    """

    image: Path
    index: int
    read_only: bool
    size_mib: int

    @property
    def serial(self) -> str:
        """The drive's virtio-blk serial (``volume_serial``)."""
        return volume_serial(self.index)


def volume_serial(index: int) -> str:
    """The virtio-blk serial of a VM's ``index``-th volume drive, which its guest reads in
    ``/sys/block/vd*/serial`` to find it."""
    return f"hangar-vol{index}"


@dataclass(frozen=True)
class VMSpec:
    """What to boot. Sizes: ``memory_mib`` and ``disk_mib`` in MiB.

    ``net`` is the guest's NIC (``hangar.net.NetworkManager.attach``); None
    boots the guest without one. ``template_source``: the VM will be saved
    with ``Engine.snapshot(vm, dest, template=True)``; QEMU then holds its
    RAM in a file of its folder, mapped shared (``hangar.engines.qemu.template``);
    Firecracker needs nothing and ignores it. Only ``boot`` reads it.
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
    template_source: bool = False
    volumes: tuple[VolumeDrive, ...] = ()
    """Named volumes attached as extra drives, after every other device (``boot`` only:
    QEMU; a restore with volumes is refused)."""
    disk_from: Path | None = None
    """``boot`` only: the folder of a snapshot of this image build whose disk the VM boots
    from (a copy of it; a disk-only snapshot, ``Engine.snapshot(..., memory=False)``),
    instead of a new disk."""


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
        return process.alive(self.pid)


@dataclass(frozen=True)
class SnapshotFiles:
    """Files of one snapshot; ``size_bytes`` is their total size on disk."""

    dir: Path
    size_bytes: int


class Engine(abc.ABC):
    """A VMM backend. Implementations: ``QemuEngine``, ``FirecrackerEngine``."""

    name: str
    accel: str
    helper: "Client | None" = None
    """The root helper's client of a server split from root (``hangar.roothelper``),
    given to the engine when it is built; None when this process is root or unsplit.
    Whoever kills or releases a VMM outside the engine (recovery's sweep) passes it on."""

    @abc.abstractmethod
    async def boot(self, spec: VMSpec) -> VM:
        """Create the sandbox's disk (a copy of ``spec.disk_from``'s when given) and start
        its VM; returns once the VMM runs.

        The guest may still be booting: ``connect_agent`` waits for it.
        On failure everything made so far is removed before raising.
        """

    @abc.abstractmethod
    def agent_channel(self, vm: VM) -> AgentChannel:
        """How to open the byte channel to ``vm``'s guest agent (see ``AgentChannel``)."""

    async def boot_stalled(self, vm: VM) -> str | None:
        """Why ``vm``'s guest, booting cold, can never answer (one line), or None when it
        may still (or the engine cannot tell). One reading; ``connect_agent`` decides on
        ``STALL_READINGS`` in a row. This default never tells."""
        return None

    async def connect_agent(self, vm: VM, timeout: float, *, cold: bool = False) -> AgentClient:
        """Open ``vm``'s agent channel and complete the handshake (``AgentClient.handshake``).

        Waits at most ``timeout`` seconds for the guest. Raises ``Timeout``,
        or ``GuestError`` when the VMM exits first; both carry the last lines
        of the guest's console, and the GuestError the VMM's own last words.
        ``cold``: the guest boots from its kernel; from ``STALL_FIRST_S`` on,
        every ``STALL_EVERY_S``, the engine is asked whether the boot can still
        finish (``boot_stalled``), and ``BootStalled`` is raised at once after
        ``STALL_READINGS`` readings in a row that say it cannot.
        """
        try:
            handshake = AgentClient.handshake(self.agent_channel(vm), timeout, alive=vm.alive)
            if not cold:
                return await handshake
            return await self._watched(vm, asyncio.ensure_future(handshake))
        except Timeout as exc:
            raise Timeout(f"{exc.message}; console: {self.console_tail(vm.paths)}",
                          sandbox_id=vm.sandbox_id, **exc.context) from None
        except GuestError as exc:
            if not vm.alive():
                raise GuestError(f"{exc.message}; console: {self.console_tail(vm.paths)}",
                                 sandbox_id=vm.sandbox_id, vmm=self.vmm_error(vm)) from None
            raise

    async def _watched(self, vm: VM, handshake: "asyncio.Future[AgentClient]") -> AgentClient:
        """``handshake``'s result, unless ``boot_stalled`` says ``STALL_READINGS`` times in a
        row, ``STALL_EVERY_S`` apart, that the guest can never answer: then BootStalled."""
        try:
            await asyncio.wait({handshake}, timeout=STALL_FIRST_S)
            seen = 0
            while not handshake.done():
                reason = await self.boot_stalled(vm)
                seen = seen + 1 if reason is not None else 0
                if reason is not None and seen >= STALL_READINGS:
                    raise BootStalled(f"{reason}; console: {self.console_tail(vm.paths)}",
                                      sandbox_id=vm.sandbox_id)
                await asyncio.wait({handshake}, timeout=STALL_EVERY_S)
            return handshake.result()
        finally:
            if not handshake.done():
                handshake.cancel()
                await asyncio.wait({handshake})  # a cancel of this task still reaches it
                if not handshake.cancelled() and handshake.exception() is None:
                    await handshake.result().close()  # it answered as it was given up

    @staticmethod
    def console_tail(paths: SandboxPaths, lines: int = 3) -> str:
        """The guest console's last lines, for error messages (read without following a
        link the VMM may have put in its folder: ``hangar.engines.safefs``)."""
        name = safefs.console_file(paths.dir)
        return process.tail(paths.dir / name, lines, within=paths.dir) or "no console output"

    def vmm_error(self, vm: VM) -> str:
        """The VMM's last words (its log's tail), for error messages."""
        return process.tail(vm.paths.vmm_log, 2) or "no output"

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
    async def snapshot(self, vm: VM, dest: Path, *, template: bool = False,
                       memory: bool = True) -> SnapshotFiles:
        """Save memory, device state and disk into ``dest``; the VM ends paused.

        ``memory`` False: the disk alone, with a manifest that says so
        (``SnapshotManifest.memory``); its guest should have flushed its file
        systems first (the VMM's block layer is flushed as the VM pauses).
        ``restore`` refuses it; ``boot`` starts from it (``VMSpec.disk_from``).

        ``template``: the snapshot is a template's, restored many times;
        its clones share the memory it saved copy-on-write on the host
        (``SnapshotManifest.template``). QEMU needs ``vm`` booted with
        ``VMSpec.template_source`` (else EngineError); Firecracker's
        snapshots always map their memory file privately, so it only
        records the flag.
        """

    @abc.abstractmethod
    async def restore(self, spec: VMSpec, source: Path) -> VM:
        """Start a new VM for ``spec`` from the snapshot in ``source``.

        A template snapshot's clone maps its memory privately (copy-on-write);
        a template made by another VMM version or on another machine shape
        is refused with EngineError before any VMM starts.
        """

    def release_snapshot(self, source: Path) -> None:
        """Forget what the engine keeps in memory for the snapshot in ``source`` (QEMU:
        a template's sealed memory copy); call it when the snapshot is deleted.
        Running clones are not affected. Never raises."""

    @abc.abstractmethod
    def adopt(self, sandbox_id: str, paths: SandboxPaths, pid: int) -> VM | None:
        """Recognise a VMM left running by an earlier server process, or None."""

    def vmm_groups(self) -> set[str]:
        """The sandbox ids that have a VMM cgroup where this engine makes them, whoever
        made them (every server of the host may share the parent), for the start-up
        sweep; it releases (``release_orphan``) those of its own sandboxes that no VMM
        holds. Empty by default: an engine whose VMMs make their own."""
        return set()

    def release_orphan(self, paths: SandboxPaths, wait: float = 1.0) -> None:
        """Remove the cgroup and drop the VMM uid claim of the sandbox whose folder is
        ``paths`` (still there or already removed), whose VMM is gone or was just
        killed: its tasks get up to ``wait`` seconds to leave the group. Through the root
        helper under a split. For the start-up sweep, which cannot await; never raises."""
        release_folder(paths, wait, helper=self.helper)

    def guest_kernel_args(self) -> tuple[str, ...]:
        """Kernel options this engine adds to every guest it boots (none by default)."""
        return ()

    def describe(self) -> dict[str, str]:
        """Engine name, accelerator and version for /health and /metrics."""
        return {"engine": self.name, "accel": self.accel}

    async def memory(self, vm: VM) -> MemoryUsage | None:
        """What ``vm`` costs the host (its VMM's Pss and Rss, MiB); None once it is gone.

        Engines that can ask the guest (QEMU's balloon statistics) add its own use.
        The read runs in a worker thread: the kernel walks every mapping of the VMM
        for ``smaps_rollup`` (milliseconds for a guest of 512 MiB).
        """
        return await asyncio.to_thread(host_usage, vm.pid, self.helper)

