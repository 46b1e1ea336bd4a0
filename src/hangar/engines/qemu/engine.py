"""``QemuEngine``: one QEMU ``microvm`` process per sandbox, driven over QMP.

Boot: the sandbox's disk (``disk.make_disk``), then QEMU with the argv of
``argv.QemuCommand``, started confined (``hangar.engines.confine``: its own
user, cgroup and mount namespace, seccomp, a capped console log) in a
session of its own (``start_new_session``), so a restarted server finds
and adopts it by its pid file and its ``-name hangar-<id>`` tag. The agent
channel is the virtio-serial port on ``agent.sock`` (``agent_channel``).

Snapshots (``snapshot``, ``restore``) go through QEMU's migration stream
(``migration``) plus a copy of the qcow2 overlay, which the finished
migration has flushed and released; the snapshot's files and manifest are
``hangar.engines.snapshot_io``'s. A restore starts QEMU with the same argv
plus ``-incoming defer``, loads the state and runs ``cont``; the agent's
virtio-serial port needs care then (see ``agent_channel``).

Templates (``template``): a VM booted with ``VMSpec.template_source`` has
its RAM in a shared file; ``snapshot(..., template=True)`` saves its device
state without RAM plus that memory once, and ``restore`` of such a
snapshot maps the memory privately (copy-on-write) in every clone.

Files: ``hangar.layout.SandboxPaths`` (disk.qcow2, qmp.sock, agent.sock,
serial.log, vmm.log, vmm.pid) and ``SnapshotPaths`` (state.mig, disk.qcow2,
snapshot.json). The process is started, reaped and killed by
``hangar.engines.process``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
from pathlib import Path

from hangar import durable
from hangar.engines import process, safefs, snapshot_io
from hangar.engines.agent_client import AgentChannel, Streams, unix_channel
from hangar.engines.base import VM, Engine, SnapshotFiles, VMSpec
from hangar.engines.confine import Confinement, release_folder
from hangar.engines.memory import MemoryUsage
from hangar.engines.process import VMMProcesses
from hangar.engines.qemu import disk as qdisk
from hangar.engines.qemu import migration, qmp, stall
from hangar.engines.qemu import template as tmpl
from hangar.engines.qemu.argv import BALLOON_ID, MemoryTuning, QemuCommand, RamFile, has_balloon
from hangar.engines.qemu.probe import QEMU, host_tsc_khz, qemu_version
from hangar.errors import EngineError
from hangar.guest import protocol as P
from hangar.layout import SandboxPaths, SnapshotPaths

log = logging.getLogger("hangar.engine.qemu")

STOP_GRACE_S = 3.0
"""Seconds QEMU gets to quit (QMP ``quit``) and then to be gone, before it is killed."""
START_S = 10.0
"""Seconds QEMU gets to create its QMP and agent sockets at start."""
FILE_LIMIT_SLACK_MIB = 512
"""``RLIMIT_FSIZE`` of QEMU is its disk plus its memory plus this, MiB: no file it
writes (its disk, a snapshot's stream) may grow past that."""
HELLO_PROBE_S = 0.5
"""Seconds between ``hello`` requests to a restored guest that owes no HELLO."""


class QemuEngine(Engine):
    """Boots sandboxes as QEMU microvm guests. See the module docstring.

    ``accel``: ``kvm`` or ``tcg`` (``probe.choose_accel`` picks), with the
    reason it was picked; ``confine``: how each VMM is confined (default:
    ``Confinement()``; its ``helper``, a split server's root helper, becomes the
    engine's); ``tuning``: how guests hold host memory. Raises
    ``EngineError`` when QEMU is not installed.
    """

    name = "qemu"

    def __init__(self, accel: str = "tcg", accel_reason: str = "",
                 confine: Confinement | None = None,
                 tuning: MemoryTuning | None = None) -> None:
        self.accel = accel
        self.accel_reason = accel_reason
        self.tuning = tuning or MemoryTuning()
        self.version = qemu_version()
        self.binary = shutil.which(QEMU) or QEMU
        self.confine = confine if confine is not None else Confinement()
        self.helper = self.confine.helper
        self.network_namespace: Path | None = None
        """Start VMMs in this network namespace (e.g. ``/run/netns/NAME``; where their
        TAPs are) instead of the server's."""
        self._procs = VMMProcesses(self.helper)
        # Agent connections that ``restore`` opened before ``cont``, by QEMU pid.
        self._held: dict[int, Streams] = {}
        self._tsc_khz = host_tsc_khz()
        self._templates = tmpl.TemplateMemories()

    def describe(self) -> dict[str, str]:
        """The engine's settings for ``hangar status`` and the health page: accelerator,
        QEMU's version, memory tuning and each confinement measure (``on``/``off``)."""
        t = self.tuning
        d = {"engine": self.name, "accel": self.accel, "version": self.version,
             "accel_reason": self.accel_reason,
             "tb_mib": str(t.tb_mib) if self.accel != "kvm" else "",
             "balloon": str(t.balloon).lower(), "ksm": str(t.ksm).lower(),
             "guest_aslr": "off" if self.guest_kernel_args() else "on"}
        for m in self.confine.measures():
            d[m.name.replace(" ", "_")] = "on" if m.on else "off"
        return d

    @property
    def cmdline(self) -> QemuCommand:
        """QEMU's command line under this engine's current settings."""
        return QemuCommand(self.binary, self.accel, self.tuning, self.confine.seccomp,
                           self._tsc_khz)

    def guest_kernel_args(self) -> tuple[str, ...]:
        """Kernel options every guest of this engine gets (``QemuCommand.guest_kernel_args``):
        part of a template snapshot's key, since a snapshot holds a booted kernel."""
        return self.cmdline.guest_kernel_args()

    def machine_args(self, spec: VMSpec) -> list[str]:
        """The QEMU arguments that fix the machine's shape (``QemuCommand.machine_args``):
        a snapshot records them and a restore compares."""
        return self.cmdline.machine_args(spec)

    def tuned_machine_args(self, spec: VMSpec) -> list[str]:
        """``machine_args`` with the memory tuning (``QemuCommand.tuned_machine_args``)."""
        return self.cmdline.tuned_machine_args(spec)

    def command(self, spec: VMSpec, tap_fd: int | None = None, *,
                balloon: bool | None = None, ram: RamFile | None = None,
                reporting: bool | None = None) -> list[str]:
        """The full QEMU argv for ``spec`` (``QemuCommand.command``)."""
        return self.cmdline.command(spec, tap_fd, balloon=balloon, ram=ram, reporting=reporting)

    async def boot(self, spec: VMSpec) -> VM:
        """Make the sandbox's directory and disk (a new overlay, or a copy of
        ``spec.disk_from``'s repointed at the image's rootfs) and start its QEMU; returns
        once QEMU has made its sockets. Raises ``EngineError`` (also NotFound: no snapshot
        in ``disk_from``); on failure the directory is removed."""
        p = spec.paths
        p.dir.mkdir(parents=True, exist_ok=False)
        try:
            if spec.disk_from is not None:  # a disk-only snapshot's disk, booted cold
                await snapshot_io.copy_file(snapshot_io.disk_source(
                    spec.disk_from, self.name, spec.image.digest, spec.sandbox_id), p.disk)
                await qdisk.rebase(p.disk, spec.image.rootfs)
            else:
                await qdisk.make_disk(spec)
            writable = self._link_volumes(spec)
            if not spec.template_source:
                return await self._start(spec, owned=writable)
            ram = tmpl.make_source_ram(p.dir, spec.memory_mib)
            return await self._start(spec, ram=RamFile(str(ram), shared=True), owned=(ram,))
        except BaseException:
            await self._cleanup(p, None)
            raise

    @staticmethod
    def _link_volumes(spec: VMSpec) -> tuple[Path, ...]:
        """Hard-link each attached volume's image into the sandbox folder
        (``SandboxPaths.volume``); returns the links the VMM writes (they become its own
        with its disk: ``Confinement.prepare``'s ``owned``). A read-only volume's image is
        made readable (0644: only VMMs whose folder holds a link reach it) and stays the
        server's. Raises EngineError (volumes/ and sandboxes/ must be one filesystem)."""
        writable = []
        for v in spec.volumes:
            link = spec.paths.volume(v.index)
            try:
                os.link(v.image, link)
            except OSError as exc:  # e.g. EXDEV: volumes/ and sandboxes/ on two filesystems
                raise EngineError(f"cannot link volume image {v.image.parent.name} into the "
                                  f"sandbox's folder: {exc.strerror}",
                                  sandbox_id=spec.sandbox_id) from None
            if v.read_only:
                os.chmod(link, 0o644)
            else:
                writable.append(link)
        return tuple(writable)

    async def _start(self, spec: VMSpec, extra: tuple[str, ...] = (), *,
                     balloon: bool | None = None, ram: RamFile | None = None,
                     reporting: bool | None = None, owned: tuple[Path, ...] = (),
                     ram_fd: int | None = None) -> VM:
        """Start QEMU for ``spec`` (its argv, with ``balloon``, ``ram`` and ``reporting``
        as ``command`` takes them, plus ``extra``) in the sandbox directory.

        ``owned``: files of the folder that become the VMM's besides its disk;
        ``ram_fd``: a template's sealed memfd, passed open and used as its
        RAM (``ram`` is then made here: ``template.VIEW_FDS/N`` in a private
        view, ``/proc/self/fd/N`` otherwise).

        Confined as ``self.confine`` says (``hangar.engines.confine``): its
        cgroup, user, view and console logger are set up here. Returns once
        QEMU has created its QMP and agent sockets (so that a bad argument
        fails here with QEMU's own message); raises ``EngineError``. The
        caller cleans up on failure.
        """
        p = spec.paths
        tap = spec.net.tap if spec.net is not None and spec.net.kind == "tap" else None
        try:
            image_dirs = sorted({f.parent for f in (spec.image.kernel, spec.image.vmlinux,
                                                    spec.image.initrd, spec.image.rootfs)
                                 if f is not None})
            plan = self.confine.prepare(
                spec.sandbox_id, p, vcpus=spec.vcpus, memory_mib=spec.memory_mib,
                accel=self.accel, tcg_cache_mib=self.tuning.tb_mib, reads=image_dirs,
                owned=[p.disk, *owned],
                file_limit=(max([spec.disk_mib, *(v.size_mib for v in spec.volumes)])
                            + spec.memory_mib + FILE_LIMIT_SLACK_MIB) << 20,
                host_network=spec.net is not None and spec.net.kind == "user", tap=tap,
                netns=self.network_namespace,
                view_fds=tmpl.VIEW_FDS if ram_fd is not None else None)
            if ram_fd is not None:  # in a view, the VMM's own fds are bound at VIEW_FDS
                fd_path = (f"{tmpl.VIEW_FDS}/{ram_fd}" if plan.root is not None
                           else f"/proc/self/fd/{ram_fd}")
                ram = RamFile(fd_path, shared=False)
            console = self.confine.console_argv(p)
            argv = [*self.command(spec, self.confine.tap_fd() if tap else None, balloon=balloon,
                                  ram=ram, reporting=reporting), *extra]
            proc = self._procs.spawn(argv, cwd=p.dir, pid_file=p.pid_file, stdout=p.serial_log,
                                     stderr=p.vmm_log, plan=plan, console=console,
                                     pass_fds=() if ram_fd is None else (ram_fd,))
        except OSError as exc:
            raise EngineError(f"cannot start {QEMU}: {exc}", sandbox_id=spec.sandbox_id) from None
        vm = VM(spec.sandbox_id, self.name, proc.pid, p, self.accel)
        try:
            deadline = time.monotonic() + START_S
            while not (p.qmp.exists() and p.agent.exists()):
                code = proc.poll()
                if code is not None:
                    raise EngineError(f"QEMU exited at start ({process.describe_exit(code)}): "
                                      f"{self._log_tail(p)}", sandbox_id=spec.sandbox_id)
                if time.monotonic() > deadline:
                    raise EngineError(f"QEMU did not create its sockets in {START_S:g} s",
                                      sandbox_id=spec.sandbox_id)
                await asyncio.sleep(0.02)
        except BaseException:
            await self._procs.kill(proc.pid)
            raise
        return vm

    @staticmethod
    def _log_tail(p: SandboxPaths) -> str:
        return process.tail(p.vmm_log, 1) or "no output"

    def agent_channel(self, vm: VM) -> AgentChannel:
        """The agent's virtio-serial port on ``agent.sock``; for a restored VM, with probing.

        The snapshot recorded whether a host was connected to the agent
        port. ``restore`` connects to the new QEMU's agent socket before
        ``cont``, so the port's state does not change under the guest: if a
        host was connected, the agent keeps the session it had and sends no
        HELLO (it answers requests, so the handshake asks it ``hello``); if
        not, the HELLO it had queued flows now. That held connection is the
        channel's first stream.

        Later connections (the first was closed) go through QEMU telling
        the guest that the host left and came back; if both notices reach
        the guest before the agent reads the port, the agent never sees the
        EOF and again sends no HELLO. So a restored VM's channel always asks
        ``hello`` every ``HELLO_PROBE_S`` seconds until one greeting comes
        (bytes written while the agent reopens its port are dropped).
        """
        if not vm.extra.get("restored_from"):
            return unix_channel(vm.paths.agent)
        plain = unix_channel(vm.paths.agent)

        async def open_() -> Streams:
            held = self._held.pop(vm.pid, None)
            return held if held is not None else await plain.open()

        return AgentChannel(open_, probe_interval=HELLO_PROBE_S)

    def vmm_error(self, vm: VM) -> str:
        """The last line QEMU wrote to its log (``vmm.log``), or "no output"."""
        return self._log_tail(vm.paths)

    def _drop_held(self, pid: int | None) -> None:
        held = self._held.pop(pid, None) if pid else None
        if held is not None:
            held[1].close()

    async def boot_stalled(self, vm: VM) -> str | None:
        """``stall.REASON`` when QEMU shows the guest's APIC timer left in Linux's
        calibration state (``hangar.engines.qemu.stall``), else None (also when QMP
        does not answer: the handshake's own deadline covers that)."""
        try:
            text = await self._qmp(vm, "human-monitor-command", **{"command-line": "info lapic"})
        except EngineError:
            return None
        return stall.REASON if isinstance(text, str) and stall.timer_stalled(text) else None

    async def _qmp(self, vm: VM, command: str, **args: object) -> object:
        """One QMP command to ``vm``'s QEMU (``qmp.execute``); raises EngineError."""
        return await qmp.execute(vm, command, **args)

    async def memory(self, vm: VM) -> MemoryUsage | None:
        """What ``vm`` costs the host and what its guest uses (``MemoryUsage``).

        Host figures from /proc; guest figures from the balloon's statistics
        (QMP ``qom-get guest-stats``), None without a balloon or before the
        guest's first report. Returns None when the VMM is gone.
        """
        usage = await super().memory(vm)
        if usage is None:
            return None
        argv = process.argv_of(vm.pid) or []
        if not has_balloon(argv):
            return usage
        try:
            got = await self._qmp(vm, "qom-get", path=f"/machine/peripheral/{BALLOON_ID}",
                                  property="guest-stats")
        except EngineError:
            return usage
        stats = got.get("stats", {}) if isinstance(got, dict) else {}
        total, free = stats.get("stat-total-memory", -1), stats.get("stat-free-memory", -1)
        updated = got.get("last-update", 0) if isinstance(got, dict) else 0
        if total <= 0 or free < 0 or not updated:
            return usage
        mib = 1 << 20
        cache = stats.get("stat-disk-caches", -1)
        return MemoryUsage(
            host_mib=usage.host_mib, host_rss_mib=usage.host_rss_mib,
            guest_total_mib=round(total / mib, 1), guest_used_mib=round((total - free) / mib, 1),
            guest_cache_mib=round(cache / mib, 1) if cache >= 0 else None,
            guest_stats_age_s=round(max(0.0, time.time() - updated), 1))

    async def pause(self, vm: VM) -> None:
        """Stop the guest's vCPUs (QMP ``stop``); raises EngineError."""
        await self._qmp(vm, "stop")

    async def resume(self, vm: VM) -> None:
        """Run the guest's vCPUs again (QMP ``cont``); raises EngineError."""
        await self._qmp(vm, "cont")

    async def stop(self, vm: VM) -> None:
        """Ask QEMU to quit, kill it after ``STOP_GRACE_S``, and remove the sandbox's files."""
        if vm.alive():
            try:
                await asyncio.wait_for(self._qmp(vm, "quit"), STOP_GRACE_S)
            except (TimeoutError, EngineError):
                pass
            await self._procs.wait_gone(vm.pid, STOP_GRACE_S)
        await self._cleanup(vm.paths, vm.pid)

    async def _cleanup(self, p: SandboxPaths, pid: int | None) -> None:
        """Kill the VMM if it still runs, reap it, and remove the sandbox's files.

        Without a ``pid`` (or with -1) the pid file names it, trusted only if
        that process is this server's child or this sandbox's QEMU (``adopt``).
        """
        if pid is None or pid <= 1:
            pid = process.read_pid(p.pid_file)
            if pid is not None and self._procs.child(pid) is None \
                    and self.adopt(p.dir.name, p, pid) is None:
                pid = None
        self._drop_held(pid)
        await self._procs.kill(pid)
        await self.confine.release(p)
        shutil.rmtree(p.dir, ignore_errors=True)

    async def snapshot(self, vm: VM, dest: Path, *, template: bool = False,
                       memory: bool = True) -> SnapshotFiles:
        """Save the VM's device state, RAM and disk into the new directory ``dest``.

        ``memory`` False: the disk alone (QMP ``stop``, which flushes QEMU's
        block layer, then the overlay's copy and a manifest with
        ``memory`` false and no ``state.mig``); the VM ends paused, its disk
        still its own.

        ``template``: ``vm`` was booted with ``VMSpec.template_source`` (else
        EngineError); its state is saved without RAM (``x-ignore-shared``)
        and its RAM file copied once into ``memory.ram`` (``template``), which
        every clone then maps copy-on-write.

        Pauses the VM (QMP ``stop``), streams its state with QMP ``migrate``
        into ``dest/state.mig`` (opened here; QEMU gets a pipe to a zstd that
        writes it, or for a template the file itself, as a file descriptor),
        waits for ``query-migrate`` to report completion,
        copies the qcow2 overlay (the migration has flushed and released
        it) and writes the manifest; see ``hangar.engines.snapshot_io``.
        The VM ends paused (QEMU's ``postmigrate`` state); ``resume`` runs
        it on, with its disk taken back. ``dest`` must not exist or be
        empty; on failure it is removed again and the VM is left paused.
        Returns the files and their allocated size in bytes (state file plus
        disk copy). Raises ``EngineError`` or ``Timeout``.
        """
        if not vm.alive():
            raise EngineError("cannot snapshot a VM that is not running", sandbox_id=vm.sandbox_id)
        machine, image = migration.shape_of(vm)
        source_ram = vm.paths.dir / tmpl.SOURCE_RAM
        if template and not (source_ram.is_file()
                             and "share=on" in " ".join(migration.argv_of(vm))):
            raise EngineError("only a VM booted as a template source (VMSpec.template_source) "
                              "can be saved as a template", sandbox_id=vm.sandbox_id)
        try:
            dest.mkdir(parents=True, exist_ok=True)
            if any(dest.iterdir()):
                raise EngineError(f"snapshot directory {dest} is not empty",
                                  sandbox_id=vm.sandbox_id)
        except OSError as exc:
            raise EngineError(f"cannot make snapshot directory {dest}: {exc}") from None
        memory_mib = int(migration.arg(machine, "-m").rstrip("M"))
        argv = " ".join(migration.argv_of(vm))
        files = SnapshotPaths(dest)
        state, partial = files.state, files.state_partial
        started = time.monotonic()
        created_at = time.time()
        if template and not memory:
            raise EngineError("a template snapshot keeps memory", sandbox_id=vm.sandbox_id)
        # A template's stream is device state only, read by every create: as QEMU wrote it.
        compression = snapshot_io.ZSTD if memory and not template else snapshot_io.NONE
        try:
            if memory:
                info = await migration.save_state(vm, partial, memory_mib,
                                                  ignore_shared=template,
                                                  compression=compression)
                await asyncio.to_thread(snapshot_io.fsync_file, partial)
                durable.replace(partial, state)  # the folder is synced too
            else:
                await self.pause(vm)  # vm_stop flushes the block layer to the overlay
                info = {"total-time": 0}
            memory_bytes, memory_sha256 = 0, ""
            if template:
                memory_bytes, memory_sha256 = await tmpl.save_memory(
                    source_ram, snapshot_io.template_memory(dest))
            disk = files.disk
            # The VMM owns its folder's disk and may have swapped it for a link.
            await asyncio.to_thread(safefs.copy_out, vm.paths.dir, vm.paths.disk.name, disk)
            await asyncio.to_thread(snapshot_io.fsync_file, disk)
            manifest = snapshot_io.SnapshotManifest(
                engine=self.name, vmm_version=self.version, accel=self.accel,
                image_name=str(image.get("name", "")), image_digest=str(image.get("digest", "")),
                kernel_version=str(image.get("kernel", {}).get("version", "")),
                vcpus=int(migration.arg(machine, "-smp")), memory_mib=memory_mib,
                disk_virtual_bytes=await qdisk.virtual_size(disk), machine=machine,
                created_at=created_at, state_bytes=snapshot_io.allocated_bytes(state),
                disk_bytes=snapshot_io.allocated_bytes(disk),
                save_seconds=round(time.monotonic() - started, 3),
                source_sandbox=vm.sandbox_id,
                extra={"migration_ms": info.get("total-time"),
                       "ram_transferred": info.get("ram", {}).get("transferred"),
                       "balloon": has_balloon(migration.argv_of(vm)),
                       "free_page_reporting": "free-page-reporting=on" in argv},
                template=template, memory_bytes=memory_bytes, memory_sha256=memory_sha256,
                memory=memory, state_compression=compression,
            )
            snapshot_io.write_manifest(dest, manifest)
        except BaseException:
            shutil.rmtree(dest, ignore_errors=True)
            raise
        log.info("snapshot of %s: %d bytes in %.2f s", vm.sandbox_id, manifest.total_bytes,
                 manifest.save_seconds)
        return SnapshotFiles(dest, manifest.total_bytes)

    async def restore(self, spec: VMSpec, source: Path) -> VM:
        """Start a new VM for ``spec`` from the snapshot in ``source``; it ends running.

        The snapshot's disk is copied into the new sandbox (and its backing
        file repointed at ``spec.image.rootfs``), QEMU starts with the same
        argv as ``boot`` plus ``-incoming defer``, loads the state with QMP
        ``migrate-incoming`` from ``state.mig`` passed as a file descriptor
        (or a pipe from a ``zstd -d`` reading it, per ``state_compression``),
        and is resumed with ``cont``.
        ``spec`` must have the snapshot's image digest, vCPUs and memory
        (``snapshot_io.read_manifest`` tells them). A template's clone
        (``SnapshotManifest.template``) also needs the QEMU version that made
        it; its RAM is a private mapping of the template's memory (a sealed
        memfd, ``template.TemplateMemories``) and the stream holds no RAM. The guest's clock and
        entropy are the snapshot's until ``snapshot_io.refresh_guest`` runs.
        Raises ``NotFound`` (no snapshot there), ``EngineError`` (mismatch,
        QEMU failure) or ``Timeout``; on failure the sandbox directory is removed.
        """
        if spec.volumes:
            raise EngineError("a VM with volumes is booted, never restored (its snapshot's "
                              "devices hold no volume drive)", sandbox_id=spec.sandbox_id)
        manifest = snapshot_io.read_manifest(source, self.name)
        snapshot_io.check_restorable(manifest, source, spec.sandbox_id)
        if manifest.image_digest != spec.image.digest:
            raise EngineError(
                f"snapshot needs image {manifest.image_name}-{manifest.image_digest}, "
                f"the sandbox has {spec.image.name}-{spec.image.digest}",
                sandbox_id=spec.sandbox_id)
        machine = self.machine_args(spec)
        if machine != manifest.machine:
            raise EngineError(
                f"snapshot was made on machine {' '.join(manifest.machine)}; restoring on "
                f"{' '.join(machine)} is not possible (vCPUs, memory and accelerator must match)",
                sandbox_id=spec.sandbox_id)
        if manifest.template and manifest.vmm_version != self.version:
            raise EngineError(
                f"template snapshot {source} was made by QEMU {manifest.vmm_version}; this "
                f"host runs {self.version}: rebuild the template", sandbox_id=spec.sandbox_id)
        if manifest.vmm_version != self.version:
            log.warning("restoring a snapshot made by %s with %s",
                        manifest.vmm_version, self.version)
        ram_fd = None
        if manifest.template:
            ram_fd = await self._templates.open(source, manifest.memory_mib << 20,
                                                manifest.memory_sha256)
        try:
            return await self._restore(spec, source, manifest, ram_fd)
        finally:
            if ram_fd is not None:
                os.close(ram_fd)

    async def _restore(self, spec: VMSpec, source: Path, manifest: snapshot_io.SnapshotManifest,
                       ram_fd: int | None) -> VM:
        """``restore`` once the snapshot is checked: ``ram_fd`` is a template's memory."""
        p = spec.paths
        p.dir.mkdir(parents=True, exist_ok=False)
        vm: VM | None = None
        try:
            snap = SnapshotPaths(source)
            await snapshot_io.copy_file(snap.disk, p.disk)
            await qdisk.rebase(p.disk, spec.image.rootfs)
            # The snapshot's devices, whatever the tuning says now.
            balloon = bool(manifest.extra.get("balloon", False))
            reporting = manifest.extra.get("free_page_reporting", not manifest.template)
            vm = await self._start(spec, ("-incoming", "defer"), balloon=balloon, ram_fd=ram_fd,
                                   reporting=bool(reporting))
            async with qmp.session(vm) as client:
                await migration.load_state(client, vm, snap.state, manifest.memory_mib,
                                           ignore_shared=manifest.template,
                                           compression=manifest.state_compression)
                # Connect before the guest runs: see agent_channel.
                self._held[vm.pid] = await asyncio.open_unix_connection(
                    str(p.agent), limit=P.MAX_DATA * 2)
                await qmp.run(client, vm, "cont")
                status = await qmp.run(client, vm, "query-status")
                if status.get("status") != "running":
                    raise EngineError(f"restored VM is {status.get('status')}, not running",
                                      sandbox_id=spec.sandbox_id)
            vm.extra["restored_from"] = str(source)
            return vm
        except BaseException:
            await self._cleanup(p, vm.pid if vm is not None else None)
            raise

    def vmm_groups(self) -> set[str]:
        """The ids with a VMM group in this engine's hierarchy, anyone's
        (``Confinement.groups``)."""
        return self.confine.groups()

    def release_orphan(self, paths: SandboxPaths, wait: float = 1.0) -> None:
        """``Engine.release_orphan``: as root, also the group of the folder's name in the
        hierarchy (the root helper, under a split, computes it the same way), which is
        what a folder removed before its release leaves."""
        release_folder(paths, wait, helper=self.helper, hierarchy=self.confine.hierarchy)

    def release_snapshot(self, source: Path) -> None:
        """Close a template snapshot's sealed memory copy (``template.TemplateMemories``),
        if this engine holds one; clones keep their mapping. Never raises."""
        self._templates.release(source)

    def template_memory_bytes(self) -> int:
        """Host memory held by the sealed copies of templates' memory, bytes: shared by
        their clones, counted in no VMM's Pss (``template.TemplateMemories``)."""
        return self._templates.resident_bytes()

    def adopt(self, sandbox_id: str, paths: SandboxPaths, pid: int) -> VM | None:
        """Return the VM if ``pid`` is still this sandbox's QEMU (checked by its argv)."""
        argv = process.argv_of(pid)
        if argv is None or f"hangar-{sandbox_id}" not in argv:
            return None
        vm = VM(sandbox_id, self.name, pid, paths, self.accel, extra={"restored_from": "adopted"})
        return vm if vm.alive() else None
