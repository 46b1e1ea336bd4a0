"""The jailer's root half, for a server split from root (``hangar.roothelper``).

The jailer needs root, and the split server is not. So the privileged helper
holds a ``HostJail`` and does the three things that need root, each checked
against the host, never taking a path, uid or argv from the server:

``prepare``  claims the VMM's uid (``hangar.engines.uids``, host-wide) and makes
             its root ``<base>/firecracker/<vm id>/root``: every folder above it
             root's (0711), ``root`` itself root's with the server's group
             (0770), so the server can link the kernel and drives in;
``link``     hard-links files of the data directory (an image's kernel and
             rootfs, a snapshot's state and memory) into that root under the
             names the VMM expects: root may link files the server may only
             read (the kernel's ``protected_hardlinks``), which spares a copy;
``spawn``    gives the VMM its log and writable drive (through descriptors:
             ``hangar.engines.safefs``), starts the jailer (argv built here from
             the helper's own settings) with umask 007 and the server's group as
             the VMM's gid, so the server reaches the VMM's sockets and reads the
             snapshot files it writes; then opens ``root`` (the jailer leaves it
             0700) to that group; the console logger runs as the VMM's uid;
``release``  removes the VMM's cgroups and jail and drops its uid claim.

The jails live under ``JailerConfig.chroot_base`` (``SPLIT_CHROOT_BASE``,
``/srv/jailer``, by default), not in the server's sandbox folder: the jailer
is root and follows the path it is given, and the server could rename any
folder of its own. ``check_base`` refuses a base that a non-root user could
rename or write.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from hangar.engines import safefs
from hangar.engines.confine import ConfineConfig, Confinement
from hangar.engines.firecracker.files import vm_id_for, vmm_args
from hangar.engines.firecracker.jailer import (
    SPLIT_CHROOT_BASE,
    JailerConfig,
    cgroup_version,
    jailed_argv,
    remove_cgroups_now,
)
from hangar.engines.process import VMMHandle, VMMProcesses
from hangar.layout import FirecrackerPaths, Layout, SandboxPaths
from hangar.privileged import beneath

LINK_NAMES = frozenset({"vmlinux", "initrd.img", "rootfs.ext4", "snapshot.vmstate",
                        "snapshot.memory"})
"""The names ``link`` may make in a VMM's root (``FirecrackerPaths``' read-only files)."""


def _seal_root(files: FirecrackerPaths) -> None:
    """Make a VMM's root the jailer's alone before it starts: its group's write taken off
    (``0o711``, through a descriptor: the server can add nothing more), then every entry
    but the linked files (``LINK_NAMES``), the log and the disk removed through that
    descriptor (``beneath.remove_tree``: nothing followed or opened). The jailer copies
    its binary to ``root/firecracker`` and makes ``dev/`` there as root, and Firecracker
    1.12's jailer opens that copy without ``O_NOFOLLOW``: a link the server's group
    planted at that name would have had root overwrite its target. ``spawn`` gives the
    folder back to the group once the VMM runs. Raises OSError."""
    keep = LINK_NAMES | {files.log.name, files.disk.name}
    fd = safefs.open_dir(files.root)
    try:
        os.fchmod(fd, 0o711)
        for name in os.listdir(fd):
            if name not in keep:
                beneath.remove_tree(fd, name)
        left = set(os.listdir(fd)) - keep
        if left:
            raise OSError(f"the VMM's root {files.root} still holds {sorted(left)}")
    finally:
        os.close(fd)


def check_base(base: Path) -> None:
    """Raise OSError unless ``base`` and every folder above it are root's and writable by
    no one else (a sticky folder such as /tmp aside), and are no symlinks."""
    p = Path("/")
    for part in base.absolute().parts[1:]:
        p = p / part
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            return  # made by ``prepare``, root's
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0:
            raise OSError(f"the jails' folder {p} is not a folder of root's")
        sticky = bool(st.st_mode & stat.S_ISVTX)
        if st.st_mode & 0o022 and not (sticky and p != base):
            raise OSError(f"the jails' folder {p} is writable by others than root")


def _root_dir(path: Path, mode: int, gid: int = 0) -> None:
    """Make ``path`` a folder of root's with ``mode`` (and group ``gid``), or check it is one."""
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0:
        raise OSError(f"{path} is not a folder of root's")
    os.chown(path, 0, gid, follow_symlinks=False)
    os.chmod(path, mode)


def _remove_jail(base: Path, vm_id: str) -> None:
    """Remove the jail ``<base>/firecracker/<vm_id>`` (if any) through descriptors: its
    ``root/`` is writable by the server's group, so each folder is opened with
    ``O_DIRECTORY | O_NOFOLLOW | O_NONBLOCK`` relative to its parent and a link, FIFO or
    device swapped in for one is unlinked, never opened (``beneath.remove_tree``; review
    29c, M3). Raises OSError."""
    try:
        fd = safefs.open_dir(base / "firecracker")
    except FileNotFoundError:
        return
    try:
        beneath.remove_tree(fd, vm_id)
    finally:
        os.close(fd)


@dataclass
class HostJail:
    """The jailer for an unprivileged server; ``group`` is the server's gid (the VMMs'
    group). Raises OSError from ``check_base`` when built over an unsafe base."""

    config: JailerConfig
    firecracker: Path
    group: int
    console_log_bytes: int = ConfineConfig.console_log_bytes

    def __post_init__(self) -> None:
        self.base = self.config.chroot_base or SPLIT_CHROOT_BASE
        check_base(self.base)
        self.version = cgroup_version(self.config.cgroups)
        self._console = Confinement(ConfineConfig(enabled=False,
                                                  console_log_bytes=self.console_log_bytes))

    def files(self, paths: SandboxPaths, sandbox_id: str) -> FirecrackerPaths:
        return paths.firecracker(vm_id_for(sandbox_id), True, self.base)

    def prepare(self, paths: SandboxPaths, sandbox_id: str) -> int:
        """Claim the VMM's uid and make its root (empty); returns the uid."""
        files = self.files(paths, sandbox_id)
        uid = self.config.uid_for(files.vm_id, paths.dir)
        _root_dir(self.base, 0o711)
        _root_dir(self.base / "firecracker", 0o711)
        jail = self.base / "firecracker" / files.vm_id
        _remove_jail(self.base, files.vm_id)  # left by a VMM of this id never released
        _root_dir(jail, 0o711)
        _root_dir(files.root, 0o770, self.group)
        return uid

    def link(self, layout: Layout, paths: SandboxPaths, sandbox_id: str,
             links: list[tuple[str, str]], data_fd: int | None = None) -> None:
        """Hard-link each ``(source, name)``: ``source`` a regular file under the data
        directory (walked without following a symlink from ``data_fd``, the data
        directory as the helper opened it, or from its trusted path), ``name`` one of
        ``LINK_NAMES`` in the VMM's root. Raises OSError."""
        files = self.files(paths, sandbox_id)
        root = layout.root.absolute()
        if data_fd is None:
            data_fd = own_fd = safefs.open_dir(root)
        else:
            own_fd = -1
        try:
            self._link(files, root, data_fd, links)
        finally:
            if own_fd >= 0:
                os.close(own_fd)

    def _link(self, files: FirecrackerPaths, root: Path, data_fd: int,
              links: list[tuple[str, str]]) -> None:
        for source, name in links:
            if name not in LINK_NAMES:
                raise OSError(f"{name!r} is not a file a VMM's root holds")
            rel = Path(os.path.normpath(source))
            if not rel.is_absolute() or not rel.is_relative_to(root):
                raise OSError(f"{source} is not in the data directory")
            with beneath.walked(data_fd, rel.relative_to(root)) as fd:
                dst = safefs.open_dir(files.root)
                try:
                    os.link(f"/proc/self/fd/{fd}", name, dst_dir_fd=dst, follow_symlinks=True)
                finally:
                    os.close(dst)

    def spawn(self, procs: VMMProcesses, paths: SandboxPaths, sandbox_id: str, vcpus: int,
              memory_mib: int, at: SandboxPaths | None = None) -> VMMHandle:
        """Start the prepared VMM; returns its handle (its host pid). ``at``: the sandbox
        folder as the helper opened it (``hangar.privileged.beneath.fd_path``), where the
        VMM's log, pid file and console are made. Raises OSError."""
        files = self.files(paths, sandbox_id)
        act = at or paths
        uid = self.config.allocator().lookup(paths.dir)
        if uid is None:
            raise OSError(f"sandbox {sandbox_id} has no VMM uid: prepare it first")
        _seal_root(files)  # before the jailer copies its binary in (REVIEW29d D-H1)
        for name in (files.log.name, files.disk.name):
            with safefs.opened(files.root, name) as fd:  # the server's own new file only
                if os.fstat(fd).st_nlink != 1:
                    raise OSError(f"{name} of {sandbox_id} has other links")
            safefs.own(files.root, name, uid, self.group, 0o660)
        console = self._console.console_argv(paths, at)
        if console is not None:  # the logger writes in the server's folder: as the VMM's uid
            safefs.own(act.dir, paths.console_dir.name, uid, self.group, 0o770,
                       directory=True)
            console = ["setpriv", f"--reuid={uid}", f"--regid={self.group}", "--clear-groups",
                       "--", *console]
        argv = jailed_argv(self.config, self.firecracker, files.vm_id, uid, self.group,
                           self.base, self.version, vcpus, memory_mib, vmm_args(files))
        old = os.umask(0o007)
        try:
            handle = procs.spawn(argv, cwd=files.root, pid_file=act.pid_file,
                                 stdout=act.serial_log, stderr=act.vmm_log,
                                 console=console, pid_from=files.root / "firecracker.pid")
        finally:
            os.umask(old)
        if handle.poll() is None:  # the jailer leaves the root 0700: open it to the group
            safefs.own_folder(files.root, uid, self.group, 0o770)
        return handle

    def release(self, paths: SandboxPaths, sandbox_id: str) -> None:
        """Remove the VMM's cgroups and jail and drop its uid claim (its VMM is gone)."""
        files = self.files(paths, sandbox_id)
        remove_cgroups_now(self.config.parent_cgroup, files.vm_id)
        try:
            _remove_jail(self.base, files.vm_id)
        except OSError:
            pass
        self.config.allocator().release(paths.dir)
