"""Firecracker engine: one ``firecracker`` process per sandbox, driven over its API.

Machine: the image's kernel as an uncompressed ELF ``vmlinux`` (Firecracker
on x86_64 boots nothing else; ``ensure_vmlinux`` unpacks it once from the
image's bzImage ``vmlinuz`` and caches it as ``vmlinux`` beside it) with the
image's initramfs; two virtio-blk drives, the image's ``rootfs.ext4``
read-only as ``/dev/vda`` and the sandbox's own writable ``disk.ext4`` as
``/dev/vdb``; a vsock device whose host side is the Unix socket
``agent.sock`` (the agent channel); the serial console on Firecracker's
stdout, written to ``serial.log``. Firecracker needs no vhost-vsock.

Writable disk: raw drives have no copy-on-write backing file, so each
sandbox gets a sparse ext4 file of ``disk_mib`` MiB (``mkfs.ext4`` with lazy
init: about 1 MB allocated, 20 ms), and the guest is told
``hangar.overlay=/dev/vdb``: it is to mount the read-only ``/dev/vda`` as the
lower layer and ``/dev/vdb`` as the upper layer of an overlayfs root (the
guest side of that is the initramfs's job). The agent is told
``hangar.channel=vsock`` and listens on vsock port 52; the host connects
to ``agent.sock`` and sends ``CONNECT 52``, Firecracker answers ``OK <n>``.

Files of one sandbox (``<sandbox>`` is ``SandboxPaths.dir``)::

    <sandbox>/
      vm.json              what was booted (ids, image, shape); read by adopt()
      vmm.pid              the VMM's pid
      serial.log           guest console (Firecracker's stdout)
      vmm.log              stderr of firecracker (or of the jailer: start failures)
      <root>/              Firecracker's working directory (its chroot when jailed):
        vmlinux            hard link of the image's cached vmlinux (copy across filesystems)
        initrd.img         hard link of the image's initramfs
        rootfs.ext4        hard link of the image's rootfs; attached read-only
        disk.ext4          the sandbox's writable drive (sparse ext4)
        firecracker.sock   API socket
        agent.sock         vsock host socket
        firecracker.log    Firecracker's own log (level Warning)
        snapshot.vmstate,  hard links of the snapshot being restored, if any
        snapshot.memory

``<root>`` is ``<sandbox>`` itself without the jailer, and
``<sandbox>/firecracker/hangar-<id>/root`` with it (the jailer builds
that tree, copies the binary into it and adds ``dev/kvm``, ``dev/net/tun``,
``dev/urandom``, ``dev/userfaultfd`` and ``firecracker.pid``). Every path
given to the API is relative, so Firecracker resolves it in ``<root>``
either way, and a snapshot (which records drive and socket paths) restores
into any sandbox, jailed or not.

Snapshots (``snapshot``): pause, ``PUT /snapshot/create``, then move the
files into the destination, punch holes into the memory file's zero
blocks (a 256 MiB guest's file then takes about 30 MB), and add a sparse
copy of ``disk.ext4``; the manifest (``hangar.engines.snapshot_io``) last::

    <dest>/ vmstate  memory  disk.ext4  snapshot.json

A restore hard-links ``vmstate`` and ``memory`` into the new VMM's root
(Firecracker maps the memory file privately: the snapshot never changes)
and copies ``disk.ext4``. After a restore the guest's vsock connections
are reset; its agent keeps listening and ``connect_agent`` connects anew.

``snapshot(vm, dest, diff=True)`` writes a Diff snapshot (only the pages
dirtied since this VM's previous snapshot or restore, tracked with
``track_dirty_pages``) and merges it onto a copy of the previous
snapshot's memory, so every snapshot directory stands alone.

Jailer (``JailerConfig``): each VMM gets its own uid/gid, derived from the
sandbox id in ``[uid_base, uid_base + uid_count)``; cgroup limits (memory:
guest memory plus ``vmm_overhead_mib``; CPU: ``vcpus`` CPUs of quota) go
into ``<controller>/hangar/hangar-<id>`` with cgroup v2 when its cpu and
memory controllers are enabled, else with cgroup v1, else none (``cgroups``
chooses; "off" skips them). Without the jailer the VMM runs as Hangar's
user but still with a private working directory holding only its own files.

Each VMM runs in its own session, with ``--id hangar-<sandbox id>``, so a
restarted server adopts it by pid and id. Any failure while starting
kills the process and removes every file made so far.
"""

from __future__ import annotations

import asyncio
import bz2
import json
import logging
import lzma
import os
import re
import shutil
import struct
import subprocess
import tempfile
import threading
import time
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from hangar.engines.base import VM, Engine, SnapshotFiles, VMSpec, kill_process
from hangar.engines.firecracker_api import FirecrackerAPI
from hangar.engines.firecracker_bin import binary_version, find_firecracker
from hangar.engines.snapshot_io import (
    FORMAT,
    MANIFEST_FILE,
    SnapshotManifest,
    allocated_bytes,
    copy_file,
    write_manifest,
)
from hangar.errors import EngineError, GuestError, InvalidRequest, NotFound, Timeout
from hangar.guest.client import AgentClient
from hangar.guest.protocol import MAX_DATA
from hangar.layout import SandboxPaths

if TYPE_CHECKING:
    from hangar.images import GuestImage

log = logging.getLogger("hangar.engine.firecracker")

KERNEL = "vmlinux"
INITRD = "initrd.img"
ROOTFS = "rootfs.ext4"
DISK = "disk.ext4"
API_SOCK = "firecracker.sock"
VSOCK_SOCK = "agent.sock"
FC_LOG = "firecracker.log"
VMM_LOG = "vmm.log"
VM_JSON = "vm.json"
RESTORE_STATE = "snapshot.vmstate"
RESTORE_MEMORY = "snapshot.memory"
SNAP_STATE = "vmstate"
SNAP_MEMORY = "memory"
SNAP_DISK = "disk.ext4"

GUEST_CID = 3
AGENT_PORT = 52
START_TIMEOUT_S = 10.0
STOP_WAIT_S = 5.0
PROBE_TIMEOUT_S = 10.0
PROBE_MARKER = b"HANGAR-PROBE-OK"
UNIX_PATH_MAX = 107
VM_ID = re.compile(r"^[A-Za-z0-9-]{1,64}$")
BOOT_ARGS = ("console=ttyS0", "reboot=k", "panic=-1", "pci=off", "i8042.noaux", "i8042.nomux",
             "i8042.nopnp", "i8042.dumbkbd")
"""Kernel arguments of every Firecracker guest; a reboot or panic ends the VMM."""

T = TypeVar("T")


# -- the kernel: bzImage -> ELF vmlinux ------------------------------------------

_MAGICS: tuple[tuple[bytes, str], ...] = (
    (b"\x1f\x8b", "gzip"),
    (b"\xfd7zXZ\x00", "xz"),
    (b"\x28\xb5\x2f\xfd", "zstd"),
    (b"\x02\x21\x4c\x18", "lz4"),
    (b"BZh", "bzip2"),
    (b"\x89LZO", "lzo"),
    (b"\x5d\x00\x00", "lzma"),
)
_TOOLS = {"zstd": ["zstd", "-dcq"], "lz4": ["lz4", "-dcq"], "lzo": ["lzop", "-dcq"]}


def _is_x86_64_elf(data: bytes) -> bool:
    return (len(data) > 20 and data[:4] == b"\x7fELF" and data[4] == 2
            and struct.unpack_from("<H", data, 18)[0] == 0x3E)


def _decompress(fmt: str, payload: bytes) -> bytes:
    """Decompress one kernel payload; trailing bytes after the stream are ignored."""
    if fmt == "gzip":
        return zlib.decompressobj(wbits=31).decompress(payload)
    if fmt == "xz":
        return lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(payload)
    if fmt == "lzma":
        return lzma.LZMADecompressor(format=lzma.FORMAT_ALONE).decompress(payload)
    if fmt == "bzip2":
        return bz2.BZ2Decompressor().decompress(payload)
    tool = _TOOLS[fmt]
    if shutil.which(tool[0]) is None:
        raise EngineError(f"the kernel is {fmt}-compressed and {tool[0]} is not installed "
                          f"(Debian package {'lzop' if fmt == 'lzo' else tool[0]})")
    out = subprocess.run(tool, input=payload, capture_output=True, check=False)
    if out.returncode != 0 and not out.stdout:
        raise EngineError(f"{tool[0]} failed: {out.stderr.decode(errors='replace').strip()}")
    return out.stdout


def extract_vmlinux(bzimage: bytes) -> tuple[bytes, str]:
    """The ELF kernel inside a bzImage, and the compression it was found in.

    Reads the payload's offset and length from the x86 boot header (boot
    protocol 2.08+); the kernel build appends the decompressed size to
    every payload except gzip's, which is checked. Without a usable header
    it scans for compressed streams until one decompresses to an ELF.
    Raises EngineError when no x86_64 ELF comes out.
    """
    if _is_x86_64_elf(bzimage):
        return bzimage, "none"
    if len(bzimage) > 0x250 and bzimage[0x202:0x206] == b"HdrS" \
            and struct.unpack_from("<H", bzimage, 0x206)[0] >= 0x208:
        setup = ((bzimage[0x1F1] or 4) + 1) * 512
        offset, length = struct.unpack_from("<II", bzimage, 0x248)
        payload = bzimage[setup + offset:setup + offset + length]
        for magic, fmt in _MAGICS:
            if payload.startswith(magic):
                if fmt == "gzip":
                    data = _decompress(fmt, payload)
                else:
                    (size,) = struct.unpack("<I", payload[-4:])
                    data = _decompress(fmt, payload[:-4])
                    if len(data) != size:
                        raise EngineError(f"{fmt} kernel payload gave {len(data)} bytes, "
                                          f"its trailer says {size}")
                if _is_x86_64_elf(data):
                    return data, fmt
                raise EngineError(f"the {fmt} payload of the bzImage is not an x86_64 ELF")
    for magic, fmt in _MAGICS:
        start = 0
        for _ in range(16):
            i = bzimage.find(magic, start)
            if i < 0:
                break
            start = i + 1
            try:
                data = _decompress(fmt, bzimage[i:])
            except (EngineError, OSError, EOFError, ValueError, zlib.error, lzma.LZMAError):
                continue
            if _is_x86_64_elf(data):
                return data, fmt
    raise EngineError("no compressed x86_64 ELF kernel found in the bzImage")


_vmlinux_lock = threading.Lock()


def ensure_vmlinux(image: "GuestImage") -> Path:
    """``<image dir>/vmlinux``, unpacked from ``vmlinuz`` on first use (about 0.3 s).

    Written atomically (temporary file, rename), so concurrent callers at
    worst unpack twice. Raises EngineError (see ``extract_vmlinux``).
    """
    out = image.dir / KERNEL
    with _vmlinux_lock:
        try:
            if out.stat().st_mtime >= image.kernel.stat().st_mtime:
                with open(out, "rb") as f:
                    if _is_x86_64_elf(f.read(64)):
                        return out
        except OSError:
            pass
        data, fmt = extract_vmlinux(image.kernel.read_bytes())
        fd, tmp = tempfile.mkstemp(prefix=".vmlinux-", dir=image.dir)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(tmp, 0o644)
            os.replace(tmp, out)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        log.info("unpacked %s (%s, %d bytes) into %s", image.kernel, fmt, len(data), out)
        return out


# -- helpers ----------------------------------------------------------------------


def _link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link ``src`` at ``dst``; copy (keeping holes) across filesystems.

    Raises EngineError when ``src`` cannot be read.
    """
    try:
        os.link(src, dst)
        return
    except OSError:
        pass
    out = subprocess.run(["cp", "--sparse=always", "--", str(src), str(dst)],
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise EngineError(f"cannot link or copy {src}: {out.stderr.strip()}")
    os.chmod(dst, 0o644)


def _tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(text[-lines:])


def _run_sync(factory: Callable[[], Awaitable[T]]) -> T:
    """Run a coroutine from synchronous code, also when an event loop already runs here."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(factory())  # type: ignore[arg-type]
    result: list[Any] = []

    def runner() -> None:
        try:
            result.append(asyncio.run(factory()))  # type: ignore[arg-type]
        except BaseException as exc:
            result.append(exc)

    t = threading.Thread(target=runner, name="hangar-fc-sync")
    t.start()
    t.join()
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


def cgroup_mounts() -> dict[str, list[Path]]:
    """Mounted cgroup hierarchies: ``{"v1": [...], "v2": [...]}`` from /proc/mounts."""
    found: dict[str, list[Path]] = {"v1": [], "v2": []}
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and parts[2] in ("cgroup", "cgroup2"):
                    found["v2" if parts[2] == "cgroup2" else "v1"].append(Path(parts[1]))
    except OSError:
        pass
    return found


def cgroup_version(wanted: str = "auto") -> str | None:
    """``"2"`` or ``"1"`` for the jailer's ``--cgroup-version``, or None (no limits).

    v2 needs a cgroup2 mount whose root offers the cpu and memory
    controllers; v1 needs mounted ``cpu`` and ``memory`` hierarchies.
    """
    if wanted == "off":
        return None
    mounts = cgroup_mounts()
    if wanted in ("auto", "v2"):
        for m in mounts["v2"]:
            try:
                ctrl = (m / "cgroup.controllers").read_text().split()
            except OSError:
                continue
            if "cpu" in ctrl and "memory" in ctrl:
                return "2"
    if wanted in ("auto", "v1"):
        names = {n for m in mounts["v1"] for n in m.name.split(",")}
        if {"cpu", "memory"} <= names:
            return "1"
    return None


@dataclass(frozen=True)
class JailerConfig:
    """Run each VMM under Firecracker's ``jailer`` (needs root).

    ``uid_base``/``uid_count``: the range each VMM's uid (= gid) is drawn
    from, by a hash of its id; two live sandboxes share one with chance
    1/``uid_count``. ``cgroups``: ``auto``, ``v1``, ``v2`` or ``off``.
    ``vmm_overhead_mib``: memory allowed beyond the guest's, in MiB.
    """

    binary: Path
    uid_base: int = 300_000
    uid_count: int = 65_536
    cgroups: Literal["auto", "v1", "v2", "off"] = "auto"
    parent_cgroup: str = "hangar"
    vmm_overhead_mib: int = 128

    def uid_for(self, vm_id: str) -> int:
        return self.uid_base + zlib.crc32(vm_id.encode()) % self.uid_count


@dataclass(frozen=True)
class FirecrackerFiles:
    """Where one sandbox's Firecracker files live (see the module docstring)."""

    paths: SandboxPaths
    vm_id: str
    jailed: bool

    @property
    def root(self) -> Path:
        """Firecracker's working directory; its chroot when jailed."""
        if self.jailed:
            return self.paths.dir / "firecracker" / self.vm_id / "root"
        return self.paths.dir

    @property
    def api(self) -> Path:
        return self.root / API_SOCK

    @property
    def vsock(self) -> Path:
        return self.root / VSOCK_SOCK

    @property
    def disk(self) -> Path:
        return self.root / DISK

    @property
    def fc_log(self) -> Path:
        return self.root / FC_LOG

    @property
    def vmm_log(self) -> Path:
        return self.paths.dir / VMM_LOG

    @property
    def vm_json(self) -> Path:
        return self.paths.dir / VM_JSON


def vm_id_for(sandbox_id: str) -> str:
    """Firecracker's (and the jailer's) ``--id`` for a sandbox: ``hangar-<id>``."""
    vm_id = f"hangar-{sandbox_id}"
    if not VM_ID.match(vm_id):
        raise EngineError(f"sandbox id {sandbox_id!r} cannot be a Firecracker id "
                          "(letters, digits and '-', at most 57 characters)")
    return vm_id


# -- the engine -------------------------------------------------------------------


class FirecrackerEngine(Engine):
    """Boots sandboxes as Firecracker microVMs. See the module docstring.

    ``binary``: the firecracker executable (default: ``find_firecracker()``).
    ``jailer``: run each VMM under the jailer. ``track_dirty_pages``: allow
    Diff snapshots (costs a little at every guest write fault).
    Raises EngineError when the binary or /dev/kvm is missing.
    """

    name = "firecracker"
    accel = "kvm"

    def __init__(self, binary: Path | None = None, *, jailer: JailerConfig | None = None,
                 track_dirty_pages: bool = True, start_timeout: float = START_TIMEOUT_S) -> None:
        found = binary or find_firecracker()
        if found is None:
            raise EngineError("firecracker not found; run scripts/fetch-firecracker.sh "
                              "or set HANGAR_FIRECRACKER")
        if not os.access("/dev/kvm", os.R_OK | os.W_OK):
            raise EngineError("/dev/kvm is missing or not accessible; Firecracker needs KVM")
        self.binary = found
        self.version = binary_version(found)
        self.jailer = jailer
        if jailer is not None:
            if os.geteuid() != 0:
                raise EngineError("the jailer needs root")
            if not (jailer.binary.is_file() and os.access(jailer.binary, os.X_OK)):
                raise EngineError(f"jailer not found at {jailer.binary}")
            if "firecracker" not in self.binary.name:
                raise EngineError("the jailer only runs a binary whose name contains "
                                  f"'firecracker', not {self.binary.name}")
        self.cgroup_version = cgroup_version(jailer.cgroups) if jailer else None
        self.track_dirty_pages = track_dirty_pages
        self.start_timeout = start_timeout
        self._procs: dict[int, subprocess.Popen[bytes]] = {}

    def describe(self) -> dict[str, str]:
        d = {"engine": self.name, "accel": self.accel, "version": self.version,
             "binary": str(self.binary), "jailer": "on" if self.jailer else "off"}
        if self.jailer:
            d["cgroups"] = f"v{self.cgroup_version}" if self.cgroup_version else "none"
        return d

    # -- files and processes ------------------------------------------------------

    def files_for(self, sandbox_id: str, paths: SandboxPaths) -> FirecrackerFiles:
        """The file layout a new VM of ``sandbox_id`` gets from this engine."""
        return FirecrackerFiles(paths, vm_id_for(sandbox_id), self.jailer is not None)

    @staticmethod
    def files_of(vm: VM) -> FirecrackerFiles:
        """The file layout of a running VM."""
        return FirecrackerFiles(vm.paths, vm.extra["vm_id"], vm.extra.get("jailed") == "1")

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
        uid = self.jailer.uid_for(files.vm_id)
        return uid, uid

    def _cgroup_args(self, spec: VMSpec) -> list[str]:
        if self.jailer is None or self.cgroup_version is None:
            return []
        mem = (spec.memory_mib + self.jailer.vmm_overhead_mib) << 20
        quota, period = spec.vcpus * 100_000, 100_000
        if self.cgroup_version == "2":
            limits = [f"memory.max={mem}", f"cpu.max={quota} {period}"]
        else:
            limits = [f"memory.limit_in_bytes={mem}", f"cpu.cfs_period_us={period}",
                      f"cpu.cfs_quota_us={quota}"]
        args = ["--cgroup-version", self.cgroup_version, "--parent-cgroup",
                self.jailer.parent_cgroup]
        for limit in limits:
            args += ["--cgroup", limit]
        return args

    def command(self, spec: VMSpec, files: FirecrackerFiles) -> list[str]:
        """The argv that starts ``spec``'s VMM (the jailer's, when jailed)."""
        fc_args = ["--api-sock", API_SOCK, "--log-path", FC_LOG, "--level", "Warning"]
        if self.jailer is None:
            return [str(self.binary), "--id", files.vm_id, *fc_args]
        uid, gid = self._ids(files)
        return [str(self.jailer.binary), "--id", files.vm_id, "--exec-file", str(self.binary),
                "--uid", str(uid), "--gid", str(gid),
                "--chroot-base-dir", str(spec.paths.dir.absolute()),
                *self._cgroup_args(spec), "--", *fc_args]

    @staticmethod
    def _make_dir(spec: VMSpec, files: FirecrackerFiles) -> None:
        """Check socket path lengths, then create the sandbox directory (must not exist)."""
        for sock in (files.api, files.vsock):
            if len(str(sock.absolute()).encode()) > UNIX_PATH_MAX:
                raise EngineError(f"socket path longer than {UNIX_PATH_MAX} bytes: {sock}; "
                                  "use a shorter data directory", sandbox_id=spec.sandbox_id)
        spec.paths.dir.mkdir(parents=True, exist_ok=False)

    def _prepare(self, spec: VMSpec, files: FirecrackerFiles) -> None:
        """Make the VMM's root, its log file and ``vm.json``."""
        files.root.mkdir(parents=True, exist_ok=True)
        uid, gid = self._ids(files)
        files.fc_log.touch()
        if self.jailer is not None:
            os.chown(files.fc_log, uid, gid)
        files.vm_json.write_text(json.dumps({
            "sandbox_id": spec.sandbox_id, "vm_id": files.vm_id, "jailed": files.jailed,
            "uid": uid, "gid": gid, "cgroup_version": self.cgroup_version,
            "image": spec.image.name, "image_digest": spec.image.digest,
            "kernel_version": spec.image.kernel_version, "vcpus": spec.vcpus,
            "memory_mib": spec.memory_mib, "disk_mib": spec.disk_mib,
            "firecracker_version": self.version}, indent=2))

    async def _make_disk(self, files: FirecrackerFiles, size_mib: int) -> None:
        """Create the sparse writable ext4 drive of ``size_mib`` MiB."""
        with open(files.disk, "wb") as f:
            f.truncate(size_mib << 20)
        proc = await asyncio.create_subprocess_exec(
            "mkfs.ext4", "-q", "-F", "-m", "0", "-L", "hangar-rw",
            "-E", "lazy_itable_init=1,lazy_journal_init=1,root_owner=0:0", str(files.disk),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        _, err = await proc.communicate()
        if proc.returncode != 0:
            raise EngineError(f"mkfs.ext4 failed: {err.decode(errors='replace').strip()}")
        if self.jailer is not None:
            os.chown(files.disk, *self._ids(files))

    async def _start(self, spec: VMSpec, files: FirecrackerFiles) -> VM:
        """Start the VMM process and wait until its API answers."""
        p = spec.paths
        with open(p.serial_log, "ab") as out, open(files.vmm_log, "ab") as err:
            proc = subprocess.Popen(self.command(spec, files), stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=err, start_new_session=True,
                                    cwd=files.root)
        self._procs[proc.pid] = proc
        p.pid_file.write_text(f"{proc.pid}\n")
        uid, gid = self._ids(files)
        vm = VM(spec.sandbox_id, self.name, proc.pid, p, self.accel, extra={
            "vm_id": files.vm_id, "jailed": "1" if files.jailed else "0", "root": str(files.root),
            "uid": str(uid), "gid": str(gid), "version": self.version,
            "image": spec.image.name, "image_digest": spec.image.digest,
            "kernel_version": spec.image.kernel_version, "vcpus": str(spec.vcpus),
            "memory_mib": str(spec.memory_mib), "disk_mib": str(spec.disk_mib)})
        async with FirecrackerAPI(files.api) as api:
            try:
                await api.wait_ready(self.start_timeout, alive=lambda: proc.poll() is None)
            except EngineError as exc:
                why = _tail(files.vmm_log) or _tail(files.fc_log) or "no output"
                raise EngineError(f"{exc.message}: {why}", sandbox_id=spec.sandbox_id) from None
        return vm

    async def _cleanup(self, files: FirecrackerFiles, pid: int | None = None) -> None:
        """Kill the VMM if it runs, reap it, drop its cgroups and remove the sandbox's files."""
        p = files.paths
        if pid is None:
            try:
                pid = int(p.pid_file.read_text().strip())
            except (OSError, ValueError):
                pid = None
        if pid:
            kill_process(pid)
            proc = self._procs.pop(pid, None)
            if proc is not None:
                try:
                    await asyncio.to_thread(proc.wait, STOP_WAIT_S)
                except subprocess.TimeoutExpired:
                    log.warning("firecracker %d did not exit after SIGKILL", pid)
            else:
                deadline = time.monotonic() + STOP_WAIT_S
                while VM("", "", pid, p, "").alive() and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
        if files.jailed:
            await self._remove_cgroups(files.vm_id)
        shutil.rmtree(p.dir, ignore_errors=True)

    async def _remove_cgroups(self, vm_id: str) -> None:
        parent = self.jailer.parent_cgroup if self.jailer else JailerConfig.parent_cgroup
        mounts = cgroup_mounts()
        for base in [*mounts["v1"], *mounts["v2"]]:
            d = base / parent / vm_id
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # EBUSY while the killed tasks leave
                    await asyncio.sleep(0.02)
            else:
                log.warning("could not remove cgroup %s", d)

    def _process_error(self, vm: VM) -> str:
        files = self.files_of(vm)
        return _tail(files.fc_log) or _tail(files.vmm_log) or "no output"

    # -- Engine -----------------------------------------------------------------

    async def boot(self, spec: VMSpec) -> VM:
        """Create the sandbox's files and start its VM (``InstanceStart``).

        Raises EngineError (``FirecrackerAPIError`` with Firecracker's own
        fault message when it refuses a setting); nothing is left behind.
        """
        files = self.files_for(spec.sandbox_id, spec.paths)
        self._make_dir(spec, files)
        vm: VM | None = None
        try:
            self._prepare(spec, files)
            kernel = await asyncio.to_thread(ensure_vmlinux, spec.image)
            for src, name in ((kernel, KERNEL), (spec.image.initrd, INITRD),
                              (spec.image.rootfs, ROOTFS)):
                await asyncio.to_thread(_link_or_copy, src, files.root / name)
            await self._make_disk(files, spec.disk_mib)
            vm = await self._start(spec, files)
            async with FirecrackerAPI(files.api) as api:
                await api.put_machine_config(
                    spec.vcpus, spec.memory_mib,
                    track_dirty_pages=True if self.track_dirty_pages else None)
                await api.put_boot_source(KERNEL, self.boot_args(spec), INITRD)
                await api.put_drive("rootfs", ROOTFS, is_read_only=True)
                await api.put_drive("overlay", DISK, is_read_only=False)
                await api.put_vsock(GUEST_CID, VSOCK_SOCK)
                if spec.net is not None and spec.net.tap:
                    await api.put_network_interface("eth0", spec.net.tap, spec.net.mac)
                await api.instance_start()
            return vm
        except BaseException:
            await self._cleanup(files, vm.pid if vm else None)
            raise

    async def connect_agent(self, vm: VM, timeout: float) -> AgentClient:
        """Connect to the agent through the vsock socket (``CONNECT 52``), wait for HELLO.

        Retries while the guest boots (Firecracker closes the connection
        while nothing listens on the port). Raises ``Timeout`` with the
        console's last lines, or ``GuestError`` when the VMM exits.
        """
        path = str(self.files_of(vm).vsock)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        last = "no connection"
        while loop.time() < deadline:
            if not vm.alive():
                self._procs.pop(vm.pid, None)
                raise GuestError("Firecracker exited before the guest agent answered; "
                                 f"console: {self._console_tail(vm.paths)}",
                                 sandbox_id=vm.sandbox_id, vmm=self._process_error(vm))
            try:
                reader, writer = await asyncio.open_unix_connection(path, limit=MAX_DATA * 2)
            except OSError as exc:  # not created yet, or refused
                last = repr(exc)
                await asyncio.sleep(0.05)
                continue
            try:
                writer.write(f"CONNECT {AGENT_PORT}\n".encode())
                await writer.drain()
                line = await asyncio.wait_for(reader.readline(),
                                              max(0.01, deadline - loop.time()))
                if line.startswith(b"OK "):
                    return await AgentClient.from_streams(reader, writer,
                                                          max(0.01, deadline - loop.time()))
                last = f"vsock answered {line!r}"
            except (asyncio.TimeoutError, OSError, GuestError, Timeout) as exc:
                last = exc.message if isinstance(exc, (GuestError, Timeout)) else repr(exc)
            writer.close()
            await asyncio.sleep(0.1)
        raise Timeout(f"guest agent did not answer within {timeout:.0f} s; "
                      f"console: {self._console_tail(vm.paths)}",
                      sandbox_id=vm.sandbox_id, last_error=last)

    @staticmethod
    def _console_tail(p: SandboxPaths, lines: int = 3) -> str:
        return _tail(p.serial_log, lines) or "no console output"

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

    async def snapshot(self, vm: VM, dest: Path, diff: bool = False) -> SnapshotFiles:
        """Pause ``vm`` and save it into ``dest`` (created; must be empty); the VM stays paused.

        Writes ``vmstate``, ``memory`` (guest RAM), ``disk.ext4`` (sparse
        copy of the writable drive) and ``snapshot.json``. With ``diff``
        (and dirty page tracking on) only the pages dirtied since this VM's
        previous snapshot or restore are saved, then merged onto a copy of
        that snapshot's memory; without such a snapshot (or on a filesystem
        that does not report holes) a full one is made.
        ``size_bytes`` is the allocated size of the files. Raises EngineError.
        """
        files = self.files_of(vm)
        started = time.monotonic()
        made_dest = not dest.exists()
        dest.mkdir(parents=True, exist_ok=True)
        if any(dest.iterdir()):
            raise EngineError(f"snapshot directory {dest} is not empty", sandbox_id=vm.sandbox_id)
        base: Path | None = None
        if diff and self.track_dirty_pages and vm.extra.get("last_snapshot") \
                and reports_holes(files.disk):
            candidate = Path(vm.extra["last_snapshot"]) / SNAP_MEMORY
            base = candidate if candidate.is_file() else None
        tmp_state, tmp_mem = files.root / ".snap-vmstate", files.root / ".snap-memory"
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
            await asyncio.to_thread(shutil.move, tmp_state, dest / SNAP_STATE)
            if base is not None:
                await copy_file(base, dest / SNAP_MEMORY)
                await asyncio.to_thread(merge_diff, tmp_mem, dest / SNAP_MEMORY)
                tmp_mem.unlink()
            else:
                await asyncio.to_thread(shutil.move, tmp_mem, dest / SNAP_MEMORY)
                await dig_holes(dest / SNAP_MEMORY)
            await copy_file(files.disk, dest / SNAP_DISK)
            for name in (SNAP_STATE, SNAP_MEMORY, SNAP_DISK):
                if os.geteuid() == 0:  # the jailed VMM's uid wrote them
                    os.chown(dest / name, 0, 0)
                os.chmod(dest / name, 0o644)
            state_bytes = allocated_bytes(dest / SNAP_STATE) + allocated_bytes(dest / SNAP_MEMORY)
            disk_bytes = allocated_bytes(dest / SNAP_DISK)
            x = vm.extra
            write_manifest(dest, SnapshotManifest(
                engine=self.name, vmm_version=self.version, accel=self.accel,
                image_name=x.get("image", ""), image_digest=x.get("image_digest", ""),
                kernel_version=x.get("kernel_version", ""), vcpus=int(x.get("vcpus", 0)),
                memory_mib=int(x.get("memory_mib", 0)),
                disk_virtual_bytes=(dest / SNAP_DISK).stat().st_size,
                machine=[f"vcpus={x.get('vcpus')}", f"memory_mib={x.get('memory_mib')}"],
                created_at=created_at, state_bytes=state_bytes, disk_bytes=disk_bytes,
                save_seconds=round(time.monotonic() - started, 6), source_sandbox=vm.sandbox_id,
                extra={"type": "Diff" if base else "Full",
                       "base": str(base.parent) if base else None,
                       "memory_apparent_bytes": (dest / SNAP_MEMORY).stat().st_size,
                       "files": {"state": SNAP_STATE, "memory": SNAP_MEMORY,
                                 "disk": SNAP_DISK}}))
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

    async def restore(self, spec: VMSpec, source: Path) -> VM:
        """Start a new VMM for ``spec`` from the snapshot in ``source``, running.

        ``spec`` must match the snapshot's image digest, vCPUs and memory
        (else InvalidRequest); the snapshot is not changed and may be
        restored any number of times. Raises NotFound, EngineError.
        """
        m = read_snapshot(source)
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
            await asyncio.to_thread(_link_or_copy, spec.image.rootfs, files.root / ROOTFS)
            await asyncio.to_thread(_link_or_copy, source / SNAP_STATE, files.root / RESTORE_STATE)
            await asyncio.to_thread(_link_or_copy, source / SNAP_MEMORY,
                                    files.root / RESTORE_MEMORY)
            await copy_file(source / SNAP_DISK, files.disk)
            if self.jailer is not None:
                os.chown(files.disk, *self._ids(files))
            vm = await self._start(spec, files)
            async with FirecrackerAPI(files.api) as api:
                # A snapshot's NIC is re-pointed at this sandbox's own TAP.
                overrides = ([{"iface_id": "eth0", "host_dev_name": spec.net.tap}]
                             if spec.net is not None and spec.net.tap else None)
                await api.put_snapshot_load(
                    RESTORE_STATE, RESTORE_MEMORY, resume_vm=True,
                    enable_diff_snapshots=True if self.track_dirty_pages else None,
                    network_overrides=overrides)
            vm.extra["last_snapshot"] = str(source)
            return vm
        except BaseException:
            await self._cleanup(files, vm.pid if vm else None)
            raise

    def adopt(self, sandbox_id: str, paths: SandboxPaths, pid: int) -> VM | None:
        """Return the VM if ``pid`` is still this sandbox's Firecracker (by its ``--id``)."""
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            vm_id = vm_id_for(sandbox_id)
        except (OSError, EngineError):
            return None
        if "firecracker" not in os.path.basename(argv[0].decode(errors="replace")):
            return None
        if not any(a == b"--id" and b == vm_id.encode() for a, b in zip(argv, argv[1:])):
            return None
        try:
            meta = json.loads((paths.dir / VM_JSON).read_text())
        except (OSError, ValueError):
            meta = {}
        files = FirecrackerFiles(paths, vm_id, bool(meta.get("jailed")))
        extra = {"vm_id": vm_id, "jailed": "1" if files.jailed else "0",
                 "root": str(files.root), "version": str(meta.get("firecracker_version", "")),
                 "image": str(meta.get("image", "")),
                 "image_digest": str(meta.get("image_digest", "")),
                 "kernel_version": str(meta.get("kernel_version", ""))}
        for key in ("uid", "gid", "vcpus", "memory_mib", "disk_mib"):
            if key in meta:
                extra[key] = str(meta[key])
        vm = VM(sandbox_id, self.name, pid, paths, self.accel, extra=extra)
        return vm if vm.alive() else None


async def dig_holes(path: Path) -> None:
    """Deallocate the all-zero blocks of ``path`` in place (``fallocate --dig-holes``).

    Firecracker writes every page of a full snapshot's memory file; most of
    a young guest's memory is zeros, so this shrinks the file on disk
    (256 MiB guest: 256 MiB to about 30 MB, in 0.2 s). Contents are unchanged;
    skipped when ``fallocate`` is missing or the filesystem cannot punch holes.
    """
    if shutil.which("fallocate") is None:
        return
    proc = await asyncio.create_subprocess_exec(
        "fallocate", "--dig-holes", str(path),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    _, err = await proc.communicate()
    if proc.returncode != 0:
        log.info("fallocate --dig-holes %s: %s", path, err.decode(errors="replace").strip())


def reports_holes(sparse_file: Path) -> bool:
    """Whether the filesystem of ``sparse_file`` (a file known to have holes) reports them.

    ``merge_diff`` relies on ``SEEK_HOLE``; a filesystem that does not
    implement it reports the whole file as data, and a merge would then
    overwrite the base memory with the diff's zeros.
    """
    try:
        fd = os.open(sparse_file, os.O_RDONLY)
    except OSError:
        return False
    try:
        return os.lseek(fd, 0, os.SEEK_HOLE) < os.fstat(fd).st_size
    except OSError:
        return False
    finally:
        os.close(fd)


def merge_diff(diff: Path, target: Path) -> int:
    """Copy the data extents of sparse ``diff`` over ``target`` at the same offsets.

    A Diff snapshot's memory file holds only dirtied pages (the rest are
    holes), so this turns a copy of the previous full memory file into the
    current one. Returns the bytes copied. Raises OSError.
    """
    copied = 0
    src = os.open(diff, os.O_RDONLY)
    try:
        dst = os.open(target, os.O_WRONLY)
        try:
            size = os.fstat(src).st_size
            pos = 0
            while pos < size:
                try:
                    start = os.lseek(src, pos, os.SEEK_DATA)
                except OSError:  # ENXIO: no data after pos
                    break
                end = os.lseek(src, start, os.SEEK_HOLE)
                off = start
                while off < end:
                    n = os.copy_file_range(src, dst, end - off, off, off)
                    if n <= 0:
                        raise OSError(f"copy_file_range stopped at {off} of {diff}")
                    off += n
                copied += end - start
                pos = end
        finally:
            os.close(dst)
    finally:
        os.close(src)
    return copied


def read_snapshot(source: Path) -> SnapshotManifest:
    """The manifest of a Firecracker snapshot directory.

    Raises NotFound when ``source`` holds no finished snapshot, EngineError
    when it is another engine's, of another format, or lacks a file.
    """
    try:
        raw = json.loads((source / MANIFEST_FILE).read_text())
    except FileNotFoundError:
        raise NotFound(f"no snapshot in {source}", snapshot=str(source)) from None
    except (OSError, ValueError) as exc:
        raise EngineError(f"unreadable snapshot manifest in {source}: {exc}") from None
    if raw.get("format") != FORMAT or raw.get("engine") != "firecracker":
        raise EngineError(f"snapshot {source} is not a Firecracker snapshot of format {FORMAT}")
    try:
        m = SnapshotManifest.from_dict(raw)
    except TypeError as exc:
        raise EngineError(f"snapshot manifest in {source} lacks fields: {exc}") from None
    for name in (SNAP_STATE, SNAP_MEMORY, SNAP_DISK):
        if not (source / name).is_file():
            raise EngineError(f"snapshot {source} lacks {name}")
    return m


# -- probe boot ---------------------------------------------------------------------


async def probe_boot_async(image: "GuestImage", binary: Path | None = None,
                           timeout: float = PROBE_TIMEOUT_S) -> tuple[bool, str]:
    """Boot ``image``'s kernel and initramfs with ``hangar.probe=1`` under Firecracker.

    Returns (usable, reason): usable when the console shows the initramfs's
    ``HANGAR-PROBE-OK`` within ``timeout`` seconds. Takes up to ``timeout``
    s; leaves no process or file behind. Never raises for a failed boot.
    """
    binary = binary or find_firecracker()
    if binary is None:
        return False, "firecracker not found"
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return False, "/dev/kvm is missing or not accessible"
    try:
        kernel = await asyncio.to_thread(ensure_vmlinux, image)
    except EngineError as exc:
        return False, f"no vmlinux: {exc.message}"
    work = Path(tempfile.mkdtemp(prefix="hangar-fcprobe-"))
    proc: subprocess.Popen[bytes] | None = None
    try:
        _link_or_copy(kernel, work / KERNEL)
        _link_or_copy(image.initrd, work / INITRD)
        (work / FC_LOG).touch()
        with open(work / "serial.log", "wb") as out:
            proc = subprocess.Popen(
                [str(binary), "--id", "hangar-probe", "--api-sock", API_SOCK,
                 "--log-path", FC_LOG, "--level", "Warning"],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, cwd=work)
        started = time.monotonic()
        async with FirecrackerAPI(work / API_SOCK) as api:
            await api.wait_ready(5, alive=lambda: proc is not None and proc.poll() is None)
            await api.put_machine_config(1, 128)
            await api.put_boot_source(KERNEL, " ".join([*BOOT_ARGS, "hangar.probe=1"]), INITRD)
            await api.instance_start()
        while time.monotonic() - started < timeout:
            if PROBE_MARKER in (work / "serial.log").read_bytes():
                return True, (f"a Firecracker probe boot reached the initramfs in "
                              f"{time.monotonic() - started:.1f} s")
            if proc.poll() is not None:
                break
            await asyncio.sleep(0.05)
        if PROBE_MARKER in (work / "serial.log").read_bytes():
            return True, "a Firecracker probe boot reached the initramfs"
        if proc.poll() is not None:
            why = _tail(work / FC_LOG, 1) or _tail(work / "serial.log", 1) or "no output"
            return False, f"the Firecracker probe guest died: {why}"
        console = _tail(work / "serial.log", 1) or "no console output"
        return False, (f"a Firecracker probe boot did not reach the initramfs in "
                       f"{timeout:.0f} s (console: {console})")
    except EngineError as exc:
        return False, f"the Firecracker probe boot failed: {exc.message}"
    finally:
        if proc is not None:
            proc.kill()
            await asyncio.to_thread(proc.wait)
        shutil.rmtree(work, ignore_errors=True)


def probe_boot(image: "GuestImage", binary: Path | None = None,
               timeout: float = PROBE_TIMEOUT_S) -> tuple[bool, str]:
    """Synchronous ``probe_boot_async`` (safe to call while an event loop runs)."""
    return _run_sync(lambda: probe_boot_async(image, binary, timeout))
