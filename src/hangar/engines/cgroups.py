"""cgroup limits for one VMM: memory, CPU and pids, on cgroup v2 or v1.

One small interface over both versions (``Hierarchy.detect``), because
production hosts run cgroup v2 while some hosts (this project's CI among
them) still mount v1 controllers:

=========  ==================================  ====================================
limit      cgroup v2 file                      cgroup v1 file (hierarchy)
=========  ==================================  ====================================
memory     ``memory.max``                      ``memory.limit_in_bytes`` (memory)
CPU        ``cpu.max`` = ``QUOTA PERIOD``      ``cpu.cfs_quota_us``,
                                               ``cpu.cfs_period_us`` (cpu)
pids       ``pids.max``                        ``pids.max`` (pids)
=========  ==================================  ====================================

v2 is used when a cgroup2 mount offers the ``memory``, ``cpu`` and ``pids``
controllers; otherwise v1 when the three hierarchies are mounted; otherwise
none (``Hierarchy.detect`` says why). A VMM's group is
``<parent>/<name>``: on v2 the parent is ``/hangar`` under the cgroup2 root
(a cgroup with processes may not delegate controllers, and the server's
own group has one: itself); on v1, where that rule does not exist, the
parent is ``hangar`` under the server's own group in each hierarchy, so
that whoever accounts for the server keeps accounting for its VMMs.

A process joins its group by writing its pid to ``cgroup.procs`` of each
directory (``Group.dirs``), which ``hangar.engines.vmm_exec`` does before it
runs the VMM, so that every page and thread of the VMM is counted.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("hangar.engine.cgroups")

CPU_PERIOD_US = 100_000
"""CFS period of the CPU quota, microseconds (the kernel's default)."""
CONTROLLERS = ("memory", "cpu", "pids")
PARENT = "hangar"


@dataclass(frozen=True)
class Limits:
    """What one group may use: ``memory_bytes`` (bytes), ``cpus`` (CPUs of quota per
    ``CPU_PERIOD_US``; 1.0 is one full CPU), ``pids`` (tasks: processes and threads)."""

    memory_bytes: int
    cpus: float
    pids: int

    @property
    def cpu_quota_us(self) -> int:
        return int(self.cpus * CPU_PERIOD_US)


@dataclass(frozen=True)
class Group:
    """One VMM's cgroup: the directories to join (one on v2, one per controller on v1)."""

    version: str
    dirs: tuple[Path, ...]

    def read(self) -> Limits:
        """The limits as the kernel reports them (for checks and tests). Raises OSError."""
        if self.version == "2":
            d = self.dirs[0]
            quota, period = (d / "cpu.max").read_text().split()
            return Limits(int((d / "memory.max").read_text()), int(quota) / int(period),
                          int((d / "pids.max").read_text()))
        mem_dir, cpu_dir, pids_dir = self.dirs
        return Limits(int((mem_dir / "memory.limit_in_bytes").read_text()),
                      int((cpu_dir / "cpu.cfs_quota_us").read_text())
                      / int((cpu_dir / "cpu.cfs_period_us").read_text()),
                      int((pids_dir / "pids.max").read_text()))


def _mounts() -> list[tuple[str, Path, set[str]]]:
    """(fstype, mountpoint, options) of every cgroup mount, from /proc/self/mounts."""
    found = []
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 4 and parts[2] in ("cgroup", "cgroup2"):
                    found.append((parts[2], Path(parts[1]), set(parts[3].split(","))))
    except OSError:
        pass
    return found


def _own_path(controller: str) -> str:
    """This process's group in the v1 hierarchy of ``controller`` ("/" when unknown)."""
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, names, path = line.rstrip("\n").split(":", 2)
                if controller in names.split(","):
                    return path or "/"
    except (OSError, ValueError):
        pass
    return "/"


@dataclass(frozen=True)
class Hierarchy:
    """Where VMM groups are made. ``version`` is ``"2"`` or ``"1"``; ``bases`` the
    parent directory per controller (one shared directory on v2)."""

    version: str
    bases: tuple[Path, ...]

    @classmethod
    def detect(cls, wanted: str = "auto") -> tuple["Hierarchy | None", str]:
        """The hierarchy to use and why; (None, reason) when limits cannot be set.

        ``wanted``: ``auto``, ``v2``, ``v1`` or ``off``. Needs root to create groups
        (checked by ``Hierarchy.usable``).
        """
        if wanted == "off":
            return None, "turned off by configuration (HANGAR_VMM_CGROUPS=off)"
        mounts = _mounts()
        v2_note = "no cgroup2 mount"
        if wanted in ("auto", "v2"):
            for fstype, mnt, _ in mounts:
                if fstype != "cgroup2":
                    continue
                try:
                    ctrl = set((mnt / "cgroup.controllers").read_text().split())
                except OSError:
                    continue
                missing = [c for c in CONTROLLERS if c not in ctrl]
                if not missing:
                    return cls("2", (mnt / PARENT,)), f"cgroup v2 at {mnt}"
                v2_note = f"the cgroup2 mount at {mnt} lacks {', '.join(missing)}"
        if wanted in ("auto", "v1"):
            by_ctrl = {}
            for fstype, mnt, opts in mounts:
                if fstype == "cgroup":
                    for c in CONTROLLERS:
                        if c in opts and c not in by_ctrl:
                            by_ctrl[c] = mnt
            missing = [c for c in CONTROLLERS if c not in by_ctrl]
            if not missing:
                bases = tuple(by_ctrl[c] / _own_path(c).lstrip("/") / PARENT
                              for c in CONTROLLERS)
                return cls("1", bases), (f"cgroup v1 ({v2_note}; memory, cpu and pids "
                                         "hierarchies mounted)")
            if wanted == "v1":
                return None, f"no cgroup v1 hierarchy for {', '.join(missing)}"
        return None, f"no cgroup hierarchy with memory, cpu and pids ({v2_note})"

    def usable(self) -> tuple[bool, str]:
        """Whether this process may make groups here: (ok, reason)."""
        if os.geteuid() != 0:
            return False, "needs root"
        for base in self.bases:
            probe = base.parent if not base.exists() else base
            if not os.access(probe, os.W_OK):
                return False, f"{probe} is not writable"
        return True, "writable"

    def group(self, name: str) -> Group:
        """The group ``name`` (made or not)."""
        return Group(self.version, tuple(b / name for b in self.bases))

    def names(self) -> set[str]:
        """The names of the groups under any of ``bases``, whoever made them (another
        server's too: a base may be shared by every server of the host). Reads only; none
        where a base is missing or unreadable. Never raises."""
        found: set[str] = set()
        for base in self.bases:
            try:
                with os.scandir(base) as entries:
                    found.update(e.name for e in entries if e.is_dir(follow_symlinks=False))
            except OSError:
                continue
        return found

    def create(self, name: str, limits: Limits) -> Group:
        """Make (or reuse) group ``name`` with ``limits``; raises OSError naming the file."""
        if self.version == "2":
            base = self.bases[0]
            root = base.parent
            self._enable(root)
            base.mkdir(exist_ok=True)
            self._enable(base)
        g = self.group(name)
        for d in g.dirs:
            d.parent.mkdir(parents=True, exist_ok=True)
            d.mkdir(exist_ok=True)
        if self.version == "2":
            d = g.dirs[0]
            _write(d / "memory.max", str(limits.memory_bytes))
            _write(d / "cpu.max", f"{limits.cpu_quota_us} {CPU_PERIOD_US}")
            _write(d / "pids.max", str(limits.pids))
            _write(d / "memory.swap.max", "0", optional=True)
        else:
            mem, cpu, pids = g.dirs
            _write(mem / "memory.limit_in_bytes", str(limits.memory_bytes))
            _write(cpu / "cpu.cfs_period_us", str(CPU_PERIOD_US))
            _write(cpu / "cpu.cfs_quota_us", str(limits.cpu_quota_us))
            _write(pids / "pids.max", str(limits.pids))
        return g

    @staticmethod
    def _enable(d: Path) -> None:
        """Delegate memory, cpu and pids to ``d``'s children (v2 ``cgroup.subtree_control``)."""
        try:
            have = set((d / "cgroup.subtree_control").read_text().split())
        except OSError as exc:
            raise OSError(f"cannot read {d / 'cgroup.subtree_control'}: {exc.strerror}") from None
        need = [c for c in CONTROLLERS if c not in have]
        if need:
            _write(d / "cgroup.subtree_control", " ".join(f"+{c}" for c in need))

    async def remove(self, name: str) -> bool:
        """Remove group ``name`` once its tasks are gone; True when none is left."""
        return await remove_dirs(list(self.group(name).dirs))


async def remove_dirs(dirs: list[Path], tries: int = 50) -> bool:
    """Remove the group directories ``dirs``; True when none is left.

    Retries every 20 ms (``tries`` times) while a killed VMM's tasks leave (EBUSY).
    """
    ok = True
    for d in dirs:
        for _ in range(tries):
            try:
                d.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                await asyncio.sleep(0.02)
        else:
            log.warning("could not remove cgroup %s", d)
            ok = False
    return ok


def _write(path: Path, value: str, optional: bool = False) -> None:
    try:
        path.write_text(value)
    except FileNotFoundError:
        if not optional:
            raise OSError(f"cannot write {path}: no such file (controller not enabled?)") from None
    except OSError as exc:
        if not optional:
            raise OSError(f"cannot write {value!r} to {path}: {exc.strerror}") from None
