"""``FirecrackerEngine``: one ``firecracker`` process per sandbox, driven over its API.

Machine: the image's ELF ``vmlinux`` (unpacked at image build time,
``hangar.images.vmlinux``) with the image's initramfs; two virtio-blk
drives, the image's ``rootfs.ext4`` read-only as ``/dev/vda`` and the
sandbox's own writable ``disk.ext4`` as ``/dev/vdb``; a vsock device whose
host side is the Unix socket ``agent.sock`` (the agent channel); the serial
console on Firecracker's stdout, written to ``serial.log``. Firecracker
needs no vhost-vsock.

Writable disk: raw drives have no copy-on-write backing file, so each
sandbox gets a sparse ext4 file of ``disk_mib`` MiB (``files.make_disk``),
and the guest is told ``hangar.overlay=/dev/vdb``: the initramfs mounts the
read-only ``/dev/vda`` as the lower layer and ``/dev/vdb`` as the upper
layer of an overlayfs root. The agent is told ``hangar.channel=vsock`` and
listens on vsock port ``AGENT_PORT``; the host's channel
(``agent_channel``) connects to ``agent.sock`` and sends ``CONNECT 52``,
Firecracker answers ``OK <n>``, and ``AgentClient.handshake`` does the rest.
After a restore the guest's vsock connections are reset; its agent keeps
listening and the channel connects anew.

Files: ``hangar.layout.FirecrackerPaths`` (``files``); jailer and cgroups:
``jailer``; snapshot files: ``snapshots``; the process: ``hangar.engines.process``.
Each VMM runs in its own session, with ``--id hangar-<sandbox id>``, so a
restarted server adopts it by pid and id. Any failure while starting kills
the process and removes every file made so far.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from hangar.engines import process, safefs, snapshot_io
from hangar.engines.agent_client import AgentChannel, Streams
from hangar.engines.base import VM, Engine, SnapshotFiles, VMSpec
from hangar.engines.firecracker.api import FirecrackerAPI
from hangar.engines.firecracker.binaries import binary_version, find_firecracker
from hangar.engines.firecracker.files import (
    FirecrackerFiles,
    check_socket_paths,
    link_or_copy,
    make_disk,
    read_vm_json,
    vm_id_for,
    vmm_args,
    write_vm_json,
)
from hangar.engines.confine import ConfineConfig, Confinement
from hangar.engines.firecracker.jailer import (
    SPLIT_CHROOT_BASE,
    JailerConfig,
    cgroup_version,
    jailed_argv,
    remove_cgroups,
)
from hangar.engines.firecracker.probe import BOOT_ARGS
from hangar.engines.firecracker.snapshots import (
    dig_holes,
    manifest_of,
    merge_diff,
    read_snapshot,
    reports_holes,
)
from hangar.engines.process import VMMHandle, VMMProcesses
from hangar.engines.snapshot_io import (
    allocated_bytes,
    copy_file,
    write_manifest,
)
from hangar.errors import EngineError, HangarError, InvalidRequest
from hangar.guest.protocol import MAX_DATA
from hangar.images.vmlinux import ensure_vmlinux
from hangar.layout import SandboxPaths, SnapshotPaths

if TYPE_CHECKING:
    from hangar.privileged import Client

log = logging.getLogger("hangar.engine.firecracker")
_T = TypeVar("_T")

GUEST_CID = 3
AGENT_PORT = 52
"""The vsock port the guest agent listens on (``hangar.guest.agent``)."""
CONNECT_TIMEOUT_S = 2.0
"""Seconds to wait for Firecracker's ``OK`` to a ``CONNECT``."""
START_TIMEOUT_S = 10.0
UNJAILED_REFUSED = (
    "Firecracker would run as root without its jailer; install the jailer "
    "(scripts/fetch-firecracker.sh) or allow unjailed VMMs explicitly with "
    "HANGAR_FIRECRACKER_JAILER=off")
"""The refusal of a root server to run Firecracker without its jailer unasked."""
FIRECRACKER_NAME = "firecracker"
"""The jailer names the chroot after the binary; ``FirecrackerPaths`` expects this name."""


class FirecrackerEngine(Engine):
    """Boots sandboxes as Firecracker microVMs. See the module docstring.

    ``binary``: the firecracker executable (default: ``find_firecracker()``).
    ``jailer``: run each VMM under the jailer. ``unjailed``: as root, allow
    VMMs without the jailer (they would run as root: only by this explicit
    choice, ``HANGAR_FIRECRACKER_JAILER=off``). ``track_dirty_pages``: allow
    Diff snapshots (costs a little at every guest write fault). ``helper``: the root
    helper's client of a server split from root (``hangar.roothelper``), which then
    runs the jailer. Raises EngineError when the binary or /dev/kvm is missing, or
    when root would run VMMs without the jailer and ``unjailed`` is not given.
    """

    name = "firecracker"
    accel = "kvm"

    def __init__(self, binary: Path | None = None, *, jailer: JailerConfig | None = None,
                 track_dirty_pages: bool = True, start_timeout: float = START_TIMEOUT_S,
                 console_log_bytes: int = ConfineConfig.console_log_bytes,
                 unjailed: bool = False, helper: "Client | None" = None) -> None:
        if jailer is None and os.geteuid() == 0 and not unjailed:
            raise EngineError(UNJAILED_REFUSED)
        found = binary or find_firecracker()
        if found is None:
            raise EngineError("firecracker not found; run scripts/fetch-firecracker.sh "
                              "or set HANGAR_FIRECRACKER")
        split = jailer is not None and os.geteuid() != 0  # the helper's jailer opens KVM
        if not (os.access("/dev/kvm", os.R_OK | os.W_OK)
                or split and os.path.exists("/dev/kvm")):
            raise EngineError("/dev/kvm is missing or not accessible; Firecracker needs KVM")
        self.binary = found
        self.version = binary_version(found)
        self.jailer = jailer
        self.helper = helper
        # A server split from root (hangar.roothelper) has its helper run the jailer.
        self._helper = helper if jailer is not None and os.geteuid() != 0 else None
        self._jail_base = (jailer.chroot_base or SPLIT_CHROOT_BASE) if self._helper \
            else jailer.chroot_base if jailer else None
        self._helper_ids: dict[str, tuple[int, int]] = {}
        if jailer is not None:
            if os.geteuid() != 0 and self._helper is None:
                raise EngineError("the jailer needs root, or the privileged helper of a "
                                  "server split from root (hangar serve started as root)")
            if not (jailer.binary.is_file() and os.access(jailer.binary, os.X_OK)):
                raise EngineError(f"jailer not found at {jailer.binary}")
            if self.binary.name != FIRECRACKER_NAME:
                raise EngineError(f"the jailer runs a binary named {FIRECRACKER_NAME!r} "
                                  f"(it names the chroot after it), not {self.binary.name!r}")
        self.cgroup_version = cgroup_version(jailer.cgroups) if jailer else None
        self.track_dirty_pages = track_dirty_pages
        self.start_timeout = start_timeout
        self._procs = VMMProcesses(helper)
        # The console cap only: the jailer confines the VMM itself.
        self._console = Confinement(ConfineConfig(enabled=False,
                                                  console_log_bytes=console_log_bytes))

    def describe(self) -> dict[str, str]:
        d = {"engine": self.name, "accel": self.accel, "version": self.version,
             "binary": str(self.binary), "jailer": "on" if self.jailer else "off"}
        if self.jailer:
            d["cgroups"] = f"v{self.cgroup_version}" if self.cgroup_version else "none"
            if self._helper is not None:
                d["jailer"] = "on, through the privileged helper"
        return d

    def _call(self, request: "Callable[[Client], _T]", sandbox_id: str) -> _T:
        """``request`` of the root helper's client for ``sandbox_id``; its refusal raises
        EngineError."""
        assert self._helper is not None
        try:
            return request(self._helper)
        except HangarError as exc:
            raise EngineError(exc.message, sandbox_id=sandbox_id) from None

    # -- files and processes ------------------------------------------------------

    def files_for(self, sandbox_id: str, paths: SandboxPaths) -> FirecrackerFiles:
        """The file layout a new VM of ``sandbox_id`` gets from this engine."""
        return paths.firecracker(vm_id_for(sandbox_id), self.jailer is not None,
                                 self._jail_base)

    @staticmethod
    def files_of(vm: VM) -> FirecrackerFiles:
        """The file layout of a running VM."""
        base = vm.extra.get("jail_base")
        return vm.paths.firecracker(vm.extra["vm_id"], vm.extra.get("jailed") == "1",
                                    Path(base) if base else None)

    @staticmethod
    def boot_args(spec: VMSpec) -> str:
        """The guest kernel command line for ``spec``."""
        net = [spec.net.kernel_arg()] if spec.net is not None and spec.net.tap else []
        return " ".join([*BOOT_ARGS, "root=/dev/vda", "ro", "rootfstype=ext4",
                         "hangar.overlay=/dev/vdb", "hangar.channel=vsock",
                         f"hangar.hostname={spec.hostname}", *net, *spec.kernel_args])

    def _ids(self, files: FirecrackerFiles) -> tuple[int, int]:
        if self.jailer is None:
            return os.geteuid(), os.getegid()
        if self._helper is not None:
            try:
                return self._helper_ids[files.vm_id]
            except KeyError:
                raise EngineError(f"VMM {files.vm_id} was not prepared") from None
        uid = self.jailer.uid_for(files.vm_id, files.paths.dir)
        return uid, uid

    def command(self, spec: VMSpec, files: FirecrackerFiles) -> list[str]:
        """The argv that starts ``spec``'s VMM (the jailer's, when jailed)."""
        fc_args = vmm_args(files)
        if self.jailer is None:
            return [str(self.binary), "--id", files.vm_id, *fc_args]
        uid, gid = self._ids(files)
        return jailed_argv(self.jailer, self.binary, files.vm_id, uid, gid, files.jail_base,
                           self.cgroup_version, spec.vcpus, spec.memory_mib, fc_args)

    @staticmethod
    def _make_dir(spec: VMSpec, files: FirecrackerFiles) -> None:
        """Check socket path lengths, then create the sandbox directory (must not exist)."""
        try:
            check_socket_paths(files)
        except EngineError as exc:
            raise EngineError(exc.message, sandbox_id=spec.sandbox_id) from None
        spec.paths.dir.mkdir(parents=True, exist_ok=False)

    def _prepare(self, spec: VMSpec, files: FirecrackerFiles) -> None:
        """Make the VMM's root (the helper's, when split), its log file and ``vm.json``."""
        if self._helper is not None:
            ids = self._call(lambda h: h.jail_prepare(spec.sandbox_id), spec.sandbox_id)
            self._helper_ids[files.vm_id] = (ids["uid"], ids["gid"])
        else:
            files.root.mkdir(parents=True, exist_ok=True)
        uid, gid = self._ids(files)
        files.log.touch()
        if self.jailer is not None and self._helper is None:
            os.chown(files.log, uid, gid)
        write_vm_json(files, {
            "sandbox_id": spec.sandbox_id, "vm_id": files.vm_id, "jailed": files.jailed,
            "jail_base": str(files.jail_base) if files.jailed else None,
            "uid": uid, "gid": gid, "cgroup_version": self.cgroup_version,
            "image": spec.image.name, "image_digest": spec.image.digest,
            "kernel_version": spec.image.kernel_version, "vcpus": spec.vcpus,
            "memory_mib": spec.memory_mib, "disk_mib": spec.disk_mib,
            "firecracker_version": self.version})

    async def _link(self, spec: VMSpec, files: FirecrackerFiles,
                    links: list[tuple[Path, Path]]) -> None:
        """Hard-link each (source, destination in the VMM's root); the helper links when
        split (root may link what the server only reads), else ``link_or_copy``."""
        if self._helper is not None:
            try:
                named = [(str(src.resolve()), dst.name) for src, dst in links]
                self._call(lambda h: h.jail_link(spec.sandbox_id, named), spec.sandbox_id)
                return
            except EngineError as exc:  # e.g. a linked images folder: copied instead
                log.warning("copying into %s: %s", files.vm_id, exc.message)
        for src, dst in links:
            await asyncio.to_thread(link_or_copy, src, dst)

    async def _start(self, spec: VMSpec, files: FirecrackerFiles) -> VM:
        """Start the VMM process and wait until its API answers."""
        p = spec.paths
        if self._helper is not None:
            got = self._call(lambda h: h.jail_spawn(spec.sandbox_id, spec.vcpus,
                                                    spec.memory_mib), spec.sandbox_id)
            proc = VMMHandle(got["pid"])
            if got["exit"] is not None:
                proc.returncode = got["exit"]
            return await self._started(spec, files, proc)
        try:
            # Jailed: the jailer forks Firecracker into a pid namespace of its own
            # (``--new-pid-ns``), writes its host pid into the chroot and exits.
            proc = self._procs.spawn(self.command(spec, files), cwd=files.root,
                                     pid_file=p.pid_file, stdout=p.serial_log,
                                     stderr=p.vmm_log, console=self._console.console_argv(p),
                                     pid_from=(files.root / f"{FIRECRACKER_NAME}.pid"
                                               if self.jailer is not None else None))
        except OSError as exc:
            raise EngineError(f"cannot start firecracker: {exc}",
                              sandbox_id=spec.sandbox_id) from None
        return await self._started(spec, files, proc)

    async def _started(self, spec: VMSpec, files: FirecrackerFiles, proc: VMMHandle) -> VM:
        """The VM of the started VMM ``proc``, once its API answers."""
        p = spec.paths
        uid, gid = self._ids(files)
        vm = VM(spec.sandbox_id, self.name, proc.pid, p, self.accel, extra={
            "vm_id": files.vm_id, "jailed": "1" if files.jailed else "0", "root": str(files.root),
            **({"jail_base": str(files.jail_base)} if files.jailed else {}),
            "uid": str(uid), "gid": str(gid), "version": self.version,
            "image": spec.image.name, "image_digest": spec.image.digest,
            "kernel_version": spec.image.kernel_version, "vcpus": str(spec.vcpus),
            "memory_mib": str(spec.memory_mib), "disk_mib": str(spec.disk_mib)})
        async with FirecrackerAPI(files.api) as api:
            try:
                await api.wait_ready(self.start_timeout, alive=lambda: proc.poll() is None)
            except EngineError as exc:
                why = process.tail(files.vmm_log) or process.tail(files.log) or "no output"
                raise EngineError(f"{exc.message}: {why}", sandbox_id=spec.sandbox_id) from None
        return vm

    async def _cleanup(self, files: FirecrackerFiles, pid: int | None = None) -> None:
        """Kill the VMM if it runs, reap it, drop its cgroups and remove the sandbox's files."""
        p = files.paths
        if pid is None:
            pid = process.read_pid(p.pid_file)
        await self._procs.kill(pid)
        self._helper_ids.pop(files.vm_id, None)
        if files.jailed and self._helper is not None:
            try:
                self._call(lambda h: h.jail_release(p.dir.name), p.dir.name)
            except EngineError as exc:
                log.warning("%s", exc.message)
            shutil.rmtree(p.dir, ignore_errors=True)
            return
        if files.jailed:
            await remove_cgroups(self.jailer.parent_cgroup if self.jailer
                                 else JailerConfig.parent_cgroup, files.vm_id)
        shutil.rmtree(p.dir, ignore_errors=True)
        if files.jailed:
            (self.jailer or JailerConfig(Path("jailer"))).allocator().release(p.dir)

    def vmm_error(self, vm: VM) -> str:
        files = self.files_of(vm)
        return process.tail(files.log) or process.tail(files.vmm_log) or "no output"

    # -- Engine -----------------------------------------------------------------

    async def boot(self, spec: VMSpec) -> VM:
        """Create the sandbox's files and start its VM (``InstanceStart``).

        Raises EngineError (``FirecrackerAPIError`` with Firecracker's own
        fault message when it refuses a setting), ImageError (no kernel);
        nothing is left behind.
        """
        if spec.volumes:
            raise EngineError("named volumes are attached by the QEMU engine only",
                              sandbox_id=spec.sandbox_id)
        files = self.files_for(spec.sandbox_id, spec.paths)
        self._make_dir(spec, files)
        vm: VM | None = None
        try:
            self._prepare(spec, files)
            kernel = await asyncio.to_thread(ensure_vmlinux, spec.image)
            await self._link(spec, files, [(kernel, files.kernel),
                                           (spec.image.initrd, files.initrd),
                                           (spec.image.rootfs, files.rootfs)])
            if spec.disk_from is not None:  # a disk-only snapshot's drive, booted cold
                await copy_file(snapshot_io.disk_source(
                    spec.disk_from, self.name, spec.image.digest, spec.sandbox_id), files.disk)
                if self.jailer is not None and self._helper is None:
                    uid, gid = self._ids(files)
                    safefs.own(files.root, files.disk.name, uid, gid, 0o600)
            else:
                await make_disk(files, spec.disk_mib, self._ids(files)
                                if self.jailer is not None and self._helper is None else None)
            vm = await self._start(spec, files)
            async with FirecrackerAPI(files.api) as api:
                await api.put_machine_config(
                    spec.vcpus, spec.memory_mib,
                    track_dirty_pages=True if self.track_dirty_pages else None)
                await api.put_boot_source(files.kernel.name, self.boot_args(spec),
                                          files.initrd.name)
                await api.put_drive("rootfs", files.rootfs.name, is_read_only=True)
                await api.put_drive("overlay", files.disk.name, is_read_only=False)
                await api.put_vsock(GUEST_CID, files.vsock.name)
                if spec.net is not None and spec.net.tap:
                    await api.put_network_interface("eth0", spec.net.tap, spec.net.mac)
                await api.instance_start()
            return vm
        except BaseException:
            await self._cleanup(files, vm.pid if vm else None)
            raise

    def agent_channel(self, vm: VM) -> AgentChannel:
        """The agent over vsock: connect to ``agent.sock``, send ``CONNECT 52``, expect ``OK``.

        Firecracker closes the connection (or answers otherwise) while
        nothing listens on the port in the guest; that is an ``OSError``, so
        the handshake tries again.
        """
        path = str(self.files_of(vm).vsock)

        async def open_() -> Streams:
            reader, writer = await asyncio.open_unix_connection(path, limit=MAX_DATA * 2)
            try:
                writer.write(f"CONNECT {AGENT_PORT}\n".encode())
                await writer.drain()
                line = await asyncio.wait_for(reader.readline(), CONNECT_TIMEOUT_S)
            except BaseException:
                writer.close()
                raise
            if not line.startswith(b"OK "):
                writer.close()
                raise ConnectionRefusedError(f"vsock answered {line!r} to CONNECT {AGENT_PORT}")
            return reader, writer

        return AgentChannel(open_)

    async def pause(self, vm: VM) -> None:
        """``PATCH /vm Paused``. Raises EngineError."""
        async with FirecrackerAPI(self.files_of(vm).api) as api:
            await api.patch_vm("Paused")

    async def resume(self, vm: VM) -> None:
        """``PATCH /vm Resumed``. Raises EngineError."""
        async with FirecrackerAPI(self.files_of(vm).api) as api:
            await api.patch_vm("Resumed")

    async def stop(self, vm: VM) -> None:
        """Kill the VMM (a sandbox's disk is discarded, so no shutdown) and remove its files."""
        await self._cleanup(self.files_of(vm), vm.pid)

    async def snapshot(self, vm: VM, dest: Path, diff: bool = False, *,
                       template: bool = False, memory: bool = True) -> SnapshotFiles:
        """Pause ``vm`` and save it into ``dest`` (created; must be empty); the VM stays paused.

        Writes ``vmstate``, ``memory`` (guest RAM), ``disk.ext4`` (sparse
        copy of the writable drive) and ``snapshot.json`` (see ``snapshots``).
        With ``diff`` (and dirty page tracking on) only the pages dirtied
        since this VM's previous snapshot or restore are saved, then merged
        onto a copy of that snapshot's memory; without such a snapshot (or on
        a filesystem that does not report holes) a full one is made.
        ``template``: recorded in the manifest only; every restore already
        maps ``memory`` privately, so clones share its pages (``snapshots``).
        ``size_bytes`` is the allocated size of the files. ``memory`` False: the
        writable drive and the manifest alone (``_save_disk``). Raises EngineError.
        """
        if not memory:
            return await self._save_disk(vm, dest)
        files = self.files_of(vm)
        out = SnapshotPaths(dest)
        started = time.monotonic()
        made_dest = not dest.exists()
        dest.mkdir(parents=True, exist_ok=True)
        if any(dest.iterdir()):
            raise EngineError(f"snapshot directory {dest} is not empty", sandbox_id=vm.sandbox_id)
        base: Path | None = None
        if diff and self.track_dirty_pages and vm.extra.get("last_snapshot") \
                and reports_holes(files.disk):
            candidate = SnapshotPaths(Path(vm.extra["last_snapshot"])).fc_memory
            base = candidate if candidate.is_file() else None
        tmp_state, tmp_mem = files.snapshot_state, files.snapshot_memory
        try:
            async with FirecrackerAPI(files.api) as api:
                await api.patch_vm("Paused")
                created_at = time.time()
                try:
                    await api.put_snapshot_create(tmp_state.name, tmp_mem.name,
                                                  "Diff" if base else "Full")
                finally:
                    # A failed or unrecorded snapshot may have reset the dirty
                    # log: the next diff must start from a full snapshot.
                    vm.extra.pop("last_snapshot", None)
            await asyncio.to_thread(self._take, files, tmp_state, out.fc_state)
            if base is not None:
                await copy_file(base, out.fc_memory)
                await asyncio.to_thread(merge_diff, tmp_mem, out.fc_memory)
                tmp_mem.unlink()
            else:
                await asyncio.to_thread(self._take, files, tmp_mem, out.fc_memory)
                await dig_holes(out.fc_memory)
            # The jailed VMM owns its root and may have swapped any name in it for a link:
            # copied and re-owned through descriptors only (hangar.engines.safefs).
            await asyncio.to_thread(safefs.copy_out, files.root, files.disk.name, out.fc_disk)
            for f in (out.fc_state, out.fc_memory, out.fc_disk):
                safefs.own(dest, f.name, os.geteuid(), os.getegid(), 0o644)
            state_bytes = allocated_bytes(out.fc_state) + allocated_bytes(out.fc_memory)
            disk_bytes = allocated_bytes(out.fc_disk)
            write_manifest(dest, manifest_of(
                self, vm, out.fc_disk, created_at, started, state_bytes, disk_bytes,
                template=template,
                extra={"type": "Diff" if base else "Full",
                       "base": str(base.parent) if base else None,
                       "memory_apparent_bytes": out.fc_memory.stat().st_size,
                       "files": {"state": out.fc_state.name, "memory": out.fc_memory.name,
                                 "disk": out.fc_disk.name}}))
        except BaseException:
            tmp_state.unlink(missing_ok=True)
            tmp_mem.unlink(missing_ok=True)
            if made_dest:
                shutil.rmtree(dest, ignore_errors=True)
            else:
                for child in dest.iterdir():
                    child.unlink(missing_ok=True)
            raise
        vm.extra["last_snapshot"] = str(dest)
        return SnapshotFiles(dest, state_bytes + disk_bytes)

    async def _save_disk(self, vm: VM, dest: Path) -> SnapshotFiles:
        """A disk-only snapshot in the new folder ``dest``: the VM paused, its writable
        drive copied (``disk.ext4``) and a manifest with ``memory`` false; a VM boots from
        it (``VMSpec.disk_from``). The VM stays paused. Raises EngineError."""
        files = self.files_of(vm)
        out = SnapshotPaths(dest)
        started = time.monotonic()
        dest.mkdir(parents=True, exist_ok=False)
        try:
            async with FirecrackerAPI(files.api) as api:
                await api.patch_vm("Paused")
            created_at = time.time()
            await asyncio.to_thread(safefs.copy_out, files.root, files.disk.name, out.fc_disk)
            safefs.own(dest, out.fc_disk.name, os.geteuid(), os.getegid(), 0o644)
            disk_bytes = allocated_bytes(out.fc_disk)
            write_manifest(dest, manifest_of(
                self, vm, out.fc_disk, created_at, started, 0, disk_bytes,
                memory=False, extra={"files": {"disk": out.fc_disk.name}}))
        except BaseException:
            shutil.rmtree(dest, ignore_errors=True)
            raise
        return SnapshotFiles(dest, disk_bytes)

    def _take(self, files: FirecrackerFiles, src: Path, dst: Path) -> None:
        """Move a file the VMM wrote in its root to ``dst``. Split from root, the server
        cannot re-own the VMM's file: it copies it through a descriptor instead
        (``safefs.copy_out``: no link followed) and removes the VMM's."""
        if self._helper is None:
            shutil.move(src, dst)
            return
        safefs.copy_out(files.root, src.name, dst)
        src.unlink()

    async def restore(self, spec: VMSpec, source: Path) -> VM:
        """Start a new VMM for ``spec`` from the snapshot in ``source``, running.

        ``spec`` must match the snapshot's image digest, vCPUs and memory
        (else InvalidRequest); the snapshot is not changed and may be
        restored any number of times. Raises NotFound, EngineError.
        """
        m = read_snapshot(source)
        snapshot_io.check_restorable(m, source, spec.sandbox_id)
        snap = SnapshotPaths(source)
        if m.image_digest != spec.image.digest:
            raise InvalidRequest(f"snapshot {source} is of image {m.image_name}@{m.image_digest}, "
                                 f"not {spec.image.name}@{spec.image.digest}")
        if (m.vcpus, m.memory_mib) != (spec.vcpus, spec.memory_mib):
            raise InvalidRequest(f"snapshot {source} has {m.vcpus} vCPUs and {m.memory_mib} MiB; "
                                 f"the spec asks {spec.vcpus} and {spec.memory_mib}")
        files = self.files_for(spec.sandbox_id, spec.paths)
        self._make_dir(spec, files)
        vm: VM | None = None
        try:
            self._prepare(spec, files)
            await self._link(spec, files, [(spec.image.rootfs, files.rootfs),
                                           (snap.fc_state, files.restore_state),
                                           (snap.fc_memory, files.restore_memory)])
            await copy_file(snap.fc_disk, files.disk)
            if self.jailer is not None and self._helper is None:
                uid, gid = self._ids(files)
                safefs.own(files.root, files.disk.name, uid, gid, 0o600)
            vm = await self._start(spec, files)
            async with FirecrackerAPI(files.api) as api:
                # A snapshot's NIC is re-pointed at this sandbox's own TAP.
                overrides = ([{"iface_id": "eth0", "host_dev_name": spec.net.tap}]
                             if spec.net is not None and spec.net.tap else None)
                await api.put_snapshot_load(
                    files.restore_state.name, files.restore_memory.name, resume_vm=True,
                    enable_diff_snapshots=True if self.track_dirty_pages else None,
                    network_overrides=overrides)
            vm.extra["last_snapshot"] = str(source)
            return vm
        except BaseException:
            await self._cleanup(files, vm.pid if vm else None)
            raise

    def adopt(self, sandbox_id: str, paths: SandboxPaths, pid: int) -> VM | None:
        """Return the VM if ``pid`` is still this sandbox's Firecracker (by its ``--id``)."""
        argv = process.argv_of(pid)
        try:
            vm_id = vm_id_for(sandbox_id)
        except EngineError:
            return None
        if not argv or "firecracker" not in os.path.basename(argv[0]):
            return None
        if not any(a == "--id" and b == vm_id for a, b in zip(argv, argv[1:])):
            return None
        meta = read_vm_json(paths.firecracker(vm_id, False))
        base = meta.get("jail_base")
        files = paths.firecracker(vm_id, bool(meta.get("jailed")),
                                  Path(base) if isinstance(base, str) and base else None)
        extra = {"vm_id": vm_id, "jailed": "1" if files.jailed else "0",
                 **({"jail_base": str(files.jail_base)} if files.jailed else {}),
                 "root": str(files.root), "version": str(meta.get("firecracker_version", "")),
                 "image": str(meta.get("image", "")),
                 "image_digest": str(meta.get("image_digest", "")),
                 "kernel_version": str(meta.get("kernel_version", ""))}
        for key in ("uid", "gid", "vcpus", "memory_mib", "disk_mib"):
            if key in meta:
                extra[key] = str(meta[key])
        vm = VM(sandbox_id, self.name, pid, paths, self.accel, extra=extra)
        return vm if vm.alive() else None
