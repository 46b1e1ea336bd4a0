"""Confinement of VMM processes: own user, cgroup limits, private view, capped console.

A guest must be assumed hostile, and a VMM is the code it attacks first. So
each QEMU runs (``QemuEngine``; Firecracker gets the same from its jailer):

- **as its own unprivileged user**: uid = gid from ``uid_base`` +
  ``[0, uid_count)``, claimed for its folder from a host-wide registry
  (``hangar.engines.uids.UidAllocator``: never two live VMMs on one uid,
  kept across a server restart), no supplementary groups, ``no_new_privs``;
- **in its own pid namespace**, as its pid 1 (``vmm_exec`` forks into it): it
  sees and can signal no process of the host; the server knows it by its
  host pid, and reaps it as a child subreaper (``hangar.engines.process``);
- **in its own cgroup** (``hangar.engines.cgroups``): memory = the guest's
  plus ``overhead_mib`` (plus the TCG translation cache under TCG), CPU =
  its vCPUs, pids = ``PIDS_MAX``;
- **in no network but what it needs**: its own (empty) network namespace
  unless its NIC is QEMU's user-mode stack; a TAP is handed to it open;
- **seeing only its own files**: a mount namespace whose root holds
  ``/usr`` (read-only: QEMU, its libraries and firmware), its image's
  directory (read-only), its sandbox folder and a ``/dev`` with only
  ``null``, ``zero``, ``random``, ``urandom`` and, under KVM, ``kvm`` (a
  node made for its user); the data directory, the API keys and other
  sandboxes are not in it;
- **with seccomp** (QEMU's ``-sandbox``, set by the engine, which also
  passes migration streams and TAP devices as file descriptors, since
  the VMM may neither spawn ``cat`` nor open ``/dev/net/tun``);
- **with a capped console**: the VMM's stdout (the guest's serial console)
  goes through ``multilog`` (daemontools), which rotates it at
  ``console_log_bytes`` / 4 into at most 3 old files.

Each measure needs something from the host; ``Confinement.measures``
says which are on and why not (``hangar doctor`` prints it). Being root
is the main one: without it the VMM already runs as the server's own
(unprivileged) user, and cgroups and the view are off.

The sandbox folder is ``<owner>:<vmm gid>`` mode 1770 (sticky; the owner is
root, or the server's user under a privileged helper: ``owner_uid``): the
VMM may create its sockets there but may neither change nor remove the
server's ``vmm.pid`` and ``vmm.log``; its disk (and a template's RAM file)
is ``<owner>:<vmm gid>`` 0660 and its console folder ``<owner>:<vmm gid>``
1770: it writes them through its group, and can neither remove nor swap
them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import stat
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from typing import TYPE_CHECKING

from hangar.engines import safefs
from hangar.engines.cgroups import Hierarchy, Limits, remove_dirs
from hangar.engines.uids import DEFAULT_REGISTRY, UidAllocator
from hangar.errors import HangarError
from hangar.layout import SandboxPaths
from hangar.privileged import beneath

if TYPE_CHECKING:
    from hangar.config import Settings
    from hangar.privileged import Client

log = logging.getLogger("hangar.engine.confine")

VMM_EXEC = Path(__file__).with_name("vmm_exec.py")
"""The script that applies a ``Plan`` and execs the VMM."""
PIDS_MAX = 512
"""Tasks (processes and threads) one VMM group may hold: QEMU runs a thread per vCPU,
a few of its own and a pool of up to 64 I/O workers per AioContext; it forks nothing."""
OVERHEAD_MIB = 192
"""Memory a VMM may use beyond its guest's, MiB: QEMU's own heap, device
buffers and mapped libraries, plus page cache of the disk it reads (which
the kernel reclaims at the limit rather than kill). Measured on this
project's CI host: a 512 MiB, 2-vCPU guest under TCG running a mixed load
(filling its memory, reading 20,000 files, Python imports, 200 MB of
writes) peaked at 868 MiB in its group, RSS 743 MiB: 356 MiB over the guest
with page cache and the translation cache, which is allowed for on its own
under TCG (``TCG_CACHE_MIB``); ``tests/test_confinement.py`` prints the peak
of its own guest."""
TCG_CACHE_MIB = 1024
"""QEMU's default TCG translation cache for system emulation (``tb-size``), MiB;
it is touched as guest code is translated, so it counts against the group.
``QemuEngine`` passes its own (``MemoryTuning.tb_mib``) to ``prepare``."""
TAP_FD = 3
"""The file descriptor under which a confined VMM gets its TAP device."""
DEVICES = (("null", 1, 3), ("zero", 1, 5), ("random", 1, 8), ("urandom", 1, 9))
KVM_DEVICE = ("kvm", 10, 232)
ANY_UID = (1 << 31) - 1
"""A range that holds every uid: releasing a folder's claim, whatever its VMM's range."""
MERGED_USR = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
GROUP_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")
"""A VMM group's name: its sandbox id, as the root helper checks one (never empty, ``.``
or ``..``, which would name a base or its parent)."""


@dataclass(frozen=True)
class Measure:
    """One confinement measure as ``hangar doctor`` reports it."""

    name: str
    on: bool
    reason: str

    def line(self) -> str:
        return f"{self.name}: {'on' if self.on else 'off'} ({self.reason})"


@dataclass(frozen=True)
class ConfineConfig:
    """What to apply. ``cgroups``: ``auto``, ``v2``, ``v1`` or ``off``;
    ``overhead_mib``: memory allowed beyond the guest's (MiB); ``console_log_bytes``:
    the most a sandbox's console logs hold on disk (bytes; 0: no cap); ``uid_registry``:
    the host-wide folder of VMM uid claims (``hangar.engines.uids``)."""

    enabled: bool = True
    uid_base: int = 400_000
    uid_count: int = 65_536
    uid_registry: Path = DEFAULT_REGISTRY
    cgroups: str = "auto"
    view: bool = True
    seccomp: bool = True
    overhead_mib: int = OVERHEAD_MIB
    console_log_bytes: int = 4 << 20


def config_from(settings: "Settings") -> ConfineConfig:
    """The ``ConfineConfig`` of a server's settings (``HANGAR_VMM_*``, ``HANGAR_CONSOLE_*``)."""
    return ConfineConfig(enabled=settings.vmm_confine, cgroups=settings.vmm_cgroups,
                         overhead_mib=settings.vmm_memory_overhead_mib,
                         console_log_bytes=settings.console_log_bytes)


@dataclass
class Plan:
    """How ``vmm_exec`` starts one VMM (see its module docstring for each key)."""

    cgroups: list[str] = field(default_factory=list)
    rlimits: dict[str, int] = field(default_factory=dict)
    root: str | None = None
    binds: list[tuple[str, str, bool]] = field(default_factory=list)
    symlinks: list[tuple[str, str]] = field(default_factory=list)
    devices: list[tuple[str, int, int]] = field(default_factory=list)
    uid: int | None = None
    gid: int | None = None
    groups: list[int] = field(default_factory=list)
    cwd: str | None = None
    own_network: bool = False
    netns: str | None = None
    tap: tuple[str, int] | None = None
    pid_ns: bool = False
    report_fd: int | None = None
    umask: int | None = None
    remote: str | None = None
    """Made by the root helper for this sandbox id (``hangar.roothelper``): the
    helper starts the VMM with its own copy, this one only informs the caller."""
    same: dict[str, str] = field(default_factory=dict)
    """``{bind target: path}``: after binding, ``vmm_exec`` checks that the target is the
    very folder ``path`` names (same device and inode), or fails. The root helper gives
    ``/proc/<its pid>/fd/<n>`` of a folder it opened (``hangar.privileged.beneath``): a
    bind source whose name the server swapped for a symlink is refused, not shown to the
    VMM. (A bind cannot take such a path as its source: the folder's mount belongs to the
    helper's mount namespace, not the view's.)"""
    console_source: str | None = None
    """The console folder as the root helper opened it (as in ``same``), for
    ``for_logger``."""

    def to_json(self) -> str:
        return json.dumps(self.__dict__, separators=(",", ":"))

    def wrap(self, argv: list[str]) -> list[str]:
        """The argv that applies this plan, then runs ``argv`` (its first item absolute)."""
        return [sys.executable, "-S", "-E", str(VMM_EXEC), self.to_json(), "--", *argv]

    def for_logger(self, console_dir: Path) -> "Plan":
        """The same user and cgroups for the console logger, which sees only ``/usr`` and
        ``console_dir`` (the whole host without a view, when not confined)."""
        plan = Plan(cgroups=self.cgroups, uid=self.uid, gid=self.gid, groups=[],
                    cwd=str(console_dir.absolute()), root=self.root,
                    symlinks=self.symlinks, devices=list(DEVICES[:1]) if self.root else [],
                    own_network=self.root is not None)
        if self.root:
            plan.binds = [b for b in self.binds if b[0] in ("/usr", "/etc/ld.so.cache")]
            plan.binds.append((str(console_dir), str(console_dir.absolute()), True))
            if self.console_source:
                plan.same = {str(console_dir.absolute()): self.console_source}
        return plan


class Confinement:
    """Decides and prepares each VMM's confinement; one per engine. ``helper``: the root
    helper's client of a server split from root (``hangar.roothelper``), which then
    prepares, starts and releases every VMM; None: this process does it."""

    def __init__(self, config: ConfineConfig | None = None,
                 helper: "Client | None" = None) -> None:
        self.config = config or ConfineConfig()
        c = self.config
        self.root = os.geteuid() == 0
        self.hierarchy: Hierarchy | None = None
        self._detected: Hierarchy | None = None
        self._cg_reason = "confinement is off (HANGAR_VMM_CONFINE=0)"
        if c.enabled:
            hierarchy, why = Hierarchy.detect(c.cgroups)
            self._detected = hierarchy
            if hierarchy is not None:
                ok, note = hierarchy.usable()
                if ok:
                    self.hierarchy = hierarchy
                else:
                    why = f"{why}, but {note}"
            self._cg_reason = why
        self.multilog = shutil.which("multilog")
        self.uids = UidAllocator(c.uid_base, c.uid_count, c.uid_registry)
        self.owner_uid = 0
        """Who owns sandbox folders (and the VMM's disk and console folder, with the
        VMM's group): root, or the unprivileged server's user under a privileged helper."""
        self.helper = helper
        if self.helper is not None:
            self.root = True  # the helper is, and confines every VMM
        self._held: dict[str, list[int]] = {}
        """The read folders each sandbox's VMM is bound to, opened by root (``prepare``)."""

    # -- what is on ---------------------------------------------------------------

    @property
    def user(self) -> bool:
        return self.config.enabled and self.root

    @property
    def view(self) -> bool:
        return self.config.enabled and self.config.view and self.root

    @property
    def seccomp(self) -> bool:
        return self.config.enabled and self.config.seccomp

    @property
    def console_cap(self) -> bool:
        return self.config.console_log_bytes > 0 and self.multilog is not None

    def measures(self) -> list[Measure]:
        """Each measure, on or off, with the reason."""
        c = self.config
        off = "confinement is off (HANGAR_VMM_CONFINE=0)"
        if not c.enabled:
            user = Measure("vmm user", False, off)
        elif self.root:
            user = Measure("vmm user", True, f"uid and gid {c.uid_base}+ (one per sandbox)")
        else:
            user = Measure("vmm user", False, f"Hangar is not root, so VMMs run as its own "
                                              f"uid {os.geteuid()}")
        seccomp = Measure("vmm seccomp", self.seccomp,
                          "QEMU -sandbox on,obsolete=deny,elevateprivileges=deny,spawn=deny,"
                          "resourcecontrol=deny" if self.seccomp else
                          (off if not c.enabled else "turned off (HANGAR_VMM_SECCOMP=0)"))
        if self.hierarchy is not None:
            cg = Measure("vmm cgroup", True, f"memory, cpu and pids limits on {self._cg_reason}")
        else:
            cg = Measure("vmm cgroup", False, self._cg_reason)
        if self.view:
            view = Measure("vmm view", True, "own mount, IPC, pid and network namespaces; sees "
                                             "/usr, its image and its sandbox folder only")
        elif not c.enabled:
            view = Measure("vmm view", False, off)
        elif not c.view:
            view = Measure("vmm view", False, "turned off (HANGAR_VMM_VIEW=0)")
        else:
            view = Measure("vmm view", False, "needs root")
        if self.console_cap:
            console = Measure("console log cap", True,
                              f"{c.console_log_bytes} bytes per sandbox, rotated by multilog")
        elif c.console_log_bytes <= 0:
            console = Measure("console log cap", False, "turned off (HANGAR_CONSOLE_LOG_BYTES=0)")
        else:
            console = Measure("console log cap", False, "multilog not found; install the "
                                                        "daemontools package")
        return [user, seccomp, cg, view, console]

    def groups(self) -> set[str]:
        """The names (sandbox ids) of the VMM groups on this host where this process, or
        its root helper, makes them, whoever made them: a v2 host's ``/hangar`` and a v1
        host's ``hangar`` under a shared group hold every server's. Under a split the
        helper, forked from this process before it dropped root, detected the same
        hierarchy; none when no group is made. Reads only; never raises."""
        at = self.hierarchy or (self._detected if self.helper is not None else None)
        return at.names() if at is not None else set()

    # -- per sandbox --------------------------------------------------------------

    def uid_for(self, sandbox_id: str, folder: Path) -> int:
        """The VMM's uid (= gid) of ``sandbox_id`` in ``folder``: the one the folder
        holds, or a new claim (``UidAllocator.allocate``; raises OSError)."""
        return self.uids.allocate(sandbox_id, folder)

    def limits(self, vcpus: int, memory_mib: int, accel: str,
               tcg_cache_mib: int = TCG_CACHE_MIB, template_clone: bool = False) -> Limits:
        """The cgroup limits of a VMM with ``vcpus`` and ``memory_mib`` MiB of guest;
        ``tcg_cache_mib``: its TCG translation cache (``tb-size``), MiB.

        ``template_clone``: its RAM is a template's sealed memfd mapped privately
        (``hangar.engines.qemu.template``). A page it faults on one of the memfd's holes
        is a shmem page charged to this cgroup (once per template, then shared by every
        clone) besides the private copy the guest writes, so a guest that fills its
        memory is charged up to twice its size: the limit allows that, or such a clone's
        VMM is OOM-killed while its guest is inside its own memory."""
        extra = self.config.overhead_mib + (tcg_cache_mib if accel != "kvm" else 0)
        if template_clone:
            extra += memory_mib
        return Limits(memory_bytes=(memory_mib + extra) << 20, cpus=float(vcpus),
                      pids=PIDS_MAX)

    def prepare(self, sandbox_id: str, paths: SandboxPaths, *, vcpus: int, memory_mib: int,
                accel: str, reads: list[Path], owned: list[Path],
                tcg_cache_mib: int = TCG_CACHE_MIB,
                file_limit: int | None = None, host_network: bool = False,
                tap: str | None = None, netns: Path | None = None,
                view_fds: str | None = None, at: SandboxPaths | None = None,
                read_sources: list[tuple[str, str]] | None = None) -> Plan:
        """Make ``sandbox_id``'s cgroup and folder ready, and return its ``Plan``.

        ``reads``: folders the VMM reads (its image), bound read-only at their
        own paths; ``owned``: files in its folder that become its own (its
        disk); ``file_limit``: ``RLIMIT_FSIZE`` in bytes; ``host_network``: the
        VMM needs the host's network namespace (QEMU's user-mode stack),
        otherwise it gets one of its own with nothing in it; ``tap``: its TAP
        device, handed to it open as ``TAP_FD`` when it runs as its own user
        (``tap_fd`` tells); ``netns``: a network namespace to start it in
        (where its TAP is); ``view_fds``: bind the VMM's own ``/proc/self/fd`` there in
        its view (a descriptor passed to it is then opened by that path). Under a
        privileged helper (``helper``) the helper does all of it and keeps
        the plan; the one returned only tells ``uid`` and ``root``. The helper itself
        passes ``at``: the same folder named through a descriptor it opened
        (``hangar.privileged.beneath.fd_path``), where every file operation here acts
        (``paths`` then only gives the names the VMM sees), and ``read_sources``: for each
        of ``reads``, its real path and such a name of it, which the bind must match
        (``Plan.same``).
        Raises OSError (a cgroup or a file could not be set up, a symlink where none may
        be; EngineError from the helper).
        """
        if self.helper is not None:
            if netns:
                raise OSError("a VMM network namespace is not routed through the privileged "
                              "helper")
            got = self.helper.prepare_vmm(
                sandbox_id, vcpus=vcpus, memory_mib=memory_mib, accel=accel,
                tcg_cache_mib=tcg_cache_mib, reads=[str(d) for d in reads],
                owned=[str(f.relative_to(paths.dir)) for f in owned], file_limit=file_limit,
                host_network=host_network, view_fds=view_fds, tap=tap)
            return Plan(uid=got["uid"], gid=got["uid"], root=got["root"], remote=sandbox_id)
        act = at or paths  # where root acts: never through a name the server may swap
        plan = Plan(cwd=str(paths.dir), netns=str(netns) if netns else None)
        if file_limit:
            plan.rlimits["FSIZE"] = file_limit
        if self.hierarchy is not None:
            group = self.hierarchy.create(sandbox_id, self.limits(
                vcpus, memory_mib, accel, tcg_cache_mib, template_clone=view_fds is not None))
            plan.cgroups = [str(d) for d in group.dirs]
            safefs.replace_file(act.dir, paths.cgroup_file.name,
                                "".join(f"{d}\n" for d in group.dirs).encode())
        if not self.user:
            return plan
        uid = self.uid_for(sandbox_id, paths.dir)
        plan.uid = plan.gid = uid
        plan.pid_ns = True
        if tap:
            plan.tap = (tap, TAP_FD)
        safefs.own_folder(act.dir, self.owner_uid, uid, 0o1770)
        for f in owned:  # through descriptors: a link put in a file's place is refused
            safefs.own(act.dir, f.relative_to(paths.dir), self.owner_uid, uid, 0o660)
        if self.view:
            root = paths.view_root
            fd = safefs.open_dir(act.dir)
            try:
                os.close(beneath.mkdir_at(fd, root.name, 0o755))
            finally:
                os.close(fd)
            plan.root = str(root)  # vmm_exec checks that it mounted its tmpfs there
            plan.own_network = not host_network
            plan.binds = [("/usr", "/usr", False)]
            if Path("/etc/ld.so.cache").exists():
                plan.binds.append(("/etc/ld.so.cache", "/etc/ld.so.cache", False))
            sources = read_sources or self._open_reads(sandbox_id, reads)
            for d, (src, opened) in zip(reads, sources):
                _readable_by_all(Path(opened), (0, self.owner_uid))
                plan.binds.append((src, str(d.absolute()), False))
                plan.same[str(d.absolute())] = opened
            plan.binds.append((str(paths.dir), str(paths.dir.absolute()), True))
            if at is not None:
                plan.same[str(paths.dir.absolute())] = str(at.dir)
            plan.symlinks = [(p, os.readlink(p)) for p in MERGED_USR if os.path.islink(p)]
            plan.devices = [*DEVICES, *([KVM_DEVICE] if accel == "kvm" else [])]
            if view_fds:
                plan.binds.append(("/proc/self/fd", view_fds, False))
        elif accel == "kvm":
            plan.groups = _kvm_group()
        return plan

    def _open_reads(self, sandbox_id: str, reads: list[Path]) -> list[tuple[str, str]]:
        """Each folder of ``reads`` opened by this (root) process itself, never resolved by
        path (``safefs.open_dir``: from ``/``, following only a link root put, the folder
        itself never a link): ``(its real path, fd_path of the descriptor)`` as the helper's
        ``read_sources``, the descriptors held until ``release``. So a name swapped for a
        link to another folder (``images/<build>`` of a split server) is refused before
        any mode changes, and the VMM is bound to the very folder opened (``Plan.same``).
        Raises OSError."""
        for fd in self._held.pop(sandbox_id, []):
            os.close(fd)
        held = self._held.setdefault(sandbox_id, [])
        out = []
        for d in reads:
            fd = safefs.open_dir(d.absolute())
            held.append(fd)
            opened = beneath.fd_path(fd)
            out.append((os.readlink(opened), opened))
        return out

    def tap_fd(self) -> int | None:
        """The file descriptor a VMM gets its TAP as, or None (it opens the TAP itself)."""
        return TAP_FD if self.user else None

    def console_argv(self, paths: SandboxPaths,
                     at: SandboxPaths | None = None) -> list[str] | None:
        """The logger that takes the VMM's stdout, or None (stdout goes to ``serial.log``).

        Makes ``console/`` (the VMM's own when confined) and points
        ``serial.log`` at ``console/current``; ``at``: the folder as the root helper
        opened it (see ``prepare``), where it acts.
        """
        if not self.console_cap or self.helper is not None:  # the helper makes its own
            return None
        assert self.multilog is not None
        total = self.config.console_log_bytes
        size = min(max(total // 4, 4096), 16_777_215)
        act = at or paths
        fd = safefs.open_dir(act.dir)
        try:
            os.close(beneath.mkdir_at(fd, paths.console_dir.name, 0o750))
            if self.user:
                uid = self.uid_for(paths.dir.name, paths.dir)
                with beneath.walked(fd, paths.console_dir.name, directory=True) as cfd:
                    os.fchown(cfd, self.owner_uid, uid)
                    os.fchmod(cfd, 0o1770)
            try:
                os.symlink(str(paths.console_current.relative_to(paths.dir)),
                           paths.serial_log.name, dir_fd=fd)
            except FileExistsError:
                pass
        finally:
            os.close(fd)
        return [self.multilog, f"s{size}", "n3", str(paths.console_dir)]

    async def release(self, paths: SandboxPaths) -> None:
        """Remove the sandbox's cgroup and drop its uid claim once its VMM is gone
        (never raises)."""
        if self.helper is not None:
            try:
                await asyncio.to_thread(self.helper.release_vmm, paths.dir.name)
            except HangarError as exc:
                log.warning("%s", exc.message)
            return
        for fd in self._held.pop(paths.dir.name, []):
            os.close(fd)
        try:
            dirs = [Path(line) for line in paths.cgroup_file.read_text().split()]
        except OSError:
            dirs = []
        await remove_dirs(dirs)
        if self.user:
            self.uids.release(paths.dir)


def release_folder(paths: SandboxPaths, wait: float = 1.0,
                   helper: "Client | None" = None, cgroups: bool = True,
                   hierarchy: Hierarchy | None = None) -> None:
    """Remove the cgroup that ``paths``' ``vmm.cgroup`` names, waiting up to ``wait``
    seconds for a just-killed VMM to leave it; for callers that cannot await (the
    start-up sweep), and drop the folder's VMM uid claim. ``hierarchy``: also the
    group of the folder's name there (``Hierarchy.group``, as the root helper computes
    it), which a folder removed before its release no longer names. ``helper``: a split
    server's root helper, which then does it. ``cgroups`` False: the uid claim only (the
    root helper removes the cgroups itself, believing only what it wrote). Never
    raises."""
    if helper is not None:
        try:
            helper.release_vmm(paths.dir.name)
        except HangarError as exc:
            log.warning("%s", exc.message)
        return
    if os.geteuid() == 0:
        UidAllocator(1, ANY_UID).release(paths.dir)  # QEMU's or a jailed Firecracker's
    if not cgroups:
        return
    try:
        dirs = [Path(line) for line in paths.cgroup_file.read_text().split()]
    except OSError:
        dirs = []
    if hierarchy is not None and GROUP_NAME.fullmatch(paths.dir.name):
        dirs += [d for d in hierarchy.group(paths.dir.name).dirs if d not in dirs]
    deadline = time.monotonic() + wait
    for d in dirs:
        remove_cgroup(d, deadline)


def remove_cgroup(d: Path, deadline: float) -> None:
    """Remove the cgroup folder ``d``, retrying until ``deadline`` (``time.monotonic``)
    while its processes leave it; a warning if it stays. Never raises."""
    while True:
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                log.warning("could not remove cgroup %s", d)
                return
            time.sleep(0.02)


def _readable_by_all(folder: Path, owners: tuple[int, ...] = (0,)) -> None:
    """Let any user read ``folder`` and its files (a build made under umask 0077 is
    root's only; images are shared and hold nothing secret): each opened without
    following a symlink and changed through its descriptor, and only what ``owners``
    own (``hangar.privileged.beneath.chmod_entries``). Never raises."""
    try:
        fd = safefs.open_dir(folder)
    except OSError:
        return
    try:
        beneath.chmod_entries(fd, 0o444, uids=owners)
    finally:
        os.close(fd)


def _kvm_group() -> list[int]:
    """The group of ``/dev/kvm`` when it grants read and write, else none."""
    try:
        st = os.stat("/dev/kvm")
    except OSError:
        return []
    return [st.st_gid] if st.st_mode & stat.S_IRGRP and st.st_mode & stat.S_IWGRP else []
