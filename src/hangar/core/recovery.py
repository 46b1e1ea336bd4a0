"""Start-up recovery: make every record agree with what runs on the host.

A server may die (SIGKILL, power cut) at any step. On start, before the
API answers, each live record is resolved by its state and whether its VMM
still runs (found by pid and checked by its command line, ``Engine.adopt``):

================  ===========================================================
``pooled``        VMM ended, record removed (pool VMs do not outlive a server)
``creating``      VMM ended, record removed (the create's caller got an error)
``running``       VMM adopted (agent reconnected on first use); none: ``failed``
``unresponsive``  as ``running``, back to ``running``
``snapshotting``  sleep snapshot complete: VMM ended, ``sleeping`` (on purpose; a
                  pause's clock stops, ``lifecycle.stopped_clock``); else VMM resumed,
                  ``running`` (a sleep is tried again by the reconcile loop, a
                  pause's clock still armed); no VMM and no snapshot: ``failed``
``waking``        VMM ended, back to ``sleeping``; the reconcile loop wakes it
``restoring``     VMM ended, left ``restoring``; the reconcile loop redoes it
``stopping``      removal finished: ``deleted``, ``expired`` or ``failed``
``sleeping``      nothing to do (a stray VMM is ended)
================  ===========================================================

Then the sweep removes what no record owns: sandbox folders, VMM processes
of this data directory that no adopted sandbox holds, the VMM cgroups
(``hangar/<sandbox id>``) of this data directory's sandboxes that no VMM
holds, snapshot folders without a record, snapshot records whose files are
incomplete, sleep snapshots no sandbox sleeps in, and (with TAP networking)
TAP devices and rules of sandboxes that no longer hold a VMM. So no VM is
left without a record and no record without its VM. A template build's VM
(``tpl-...``) that a live build holds (``hangar image build`` beside the
server; see ``templates.building``) is not this server's to sweep.

A cgroup is released apart from its folder because recovery may remove the
folder first: a sandbox whose VMM died while the server was down is
``failed`` and its removal finds no VM to stop, so the engine's own release
never runs (as for a create or restore whose VMM was not yet adopted). The
sweep waits for the VMMs it killed to exit (``KILL_WAIT_S``: a group with a
task cannot be removed), then lists the groups where the engine makes them
(``Engine.vmm_groups``) and releases each whose id this data directory knows
(a record of any state, one recovery resolved, a folder, a VMM it killed)
and no VMM holds (``Engine.release_orphan``, through the root helper under a
split). The parent is shared by every server of the host (``/hangar`` on
cgroup v2), so a group of an id this data directory never had is another
server's, and is left alone even when empty: that server may have made it for
a VMM about to join it.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Collection, Iterator
from pathlib import Path

from hangar.core import templates
from hangar.core.context import Context
from hangar.core.launch import Launcher
from hangar.core.lifecycle import State, stopped_clock
from hangar.core.registry import Runtime
from hangar.core.removal import Removal
from hangar.core.store import SandboxRecord, SnapshotRecord
from hangar.engines import process
from hangar.engines.process import KILL_WAIT_S, kill_process
from hangar.layout import SnapshotPaths

log = logging.getLogger("hangar.recovery")

VMM_NAMES = ("qemu-system", "firecracker", "jailer")
"""Process names (prefixes of argv[0]'s base name) that are VMMs."""


def vmm_processes(sandboxes_dir: Path) -> Iterator[tuple[int, str]]:
    """(pid, sandbox id) of every VMM process whose command line names a path in
    ``sandboxes_dir`` (so only this data directory's VMMs, never another server's)."""
    marker = str(sandboxes_dir).rstrip("/") + "/"
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = [a.decode(errors="replace")
                    for a in (d / "cmdline").read_bytes().split(b"\0") if a]
        except OSError:
            continue
        if not argv or not Path(argv[0]).name.startswith(VMM_NAMES):
            continue
        for arg in argv:
            at = arg.find(marker)
            if at >= 0:
                sid = arg[at + len(marker):].split("/", 1)[0].split(",", 1)[0]
                if sid:
                    yield int(d.name), sid
                    break


class Recovery:
    """Resolves what a stopped server left behind. Runs once, at start."""

    def __init__(self, ctx: Context, launcher: Launcher, removal: Removal) -> None:
        self.ctx = ctx
        self.launcher = launcher
        self.removal = removal

    async def run(self) -> None:
        """Resolve every live record, then sweep what no record owns."""
        found = self.ctx.store.live()
        for rec in found:
            try:
                await self.recover(rec)
            except Exception:  # one bad record must not keep the server down
                log.exception("recovery of a sandbox failed", extra={"sandbox_id": rec.id})
        self.sweep({r.id for r in found})
        await self.sweep_network()

    async def recover(self, rec: SandboxRecord) -> None:
        """Resolve one record (see the module docstring)."""
        ctx = self.ctx
        sid, state = rec.id, rec.state
        vm = self.launcher.find_vm(sid, rec.pid)
        if state in (State.POOLED, State.CREATING):
            await self.launcher.stop(sid, rec.pid)
            ctx.store.discard(sid, state)
            log.info("unfinished create removed", extra={"sandbox_id": sid, "state": state.value})
        elif state in (State.RUNNING, State.UNRESPONSIVE):
            if vm is None:
                await self._failed(rec, "the VMM was gone when the server started")
                return
            ctx.registry.put(sid, Runtime(vm))
            if state == State.UNRESPONSIVE:
                ctx.store.transition(sid, State.UNRESPONSIVE, State.RUNNING, pid=vm.pid)
            log.info("sandbox adopted", extra={"sandbox_id": sid, "pid": vm.pid})
        elif state == State.SNAPSHOTTING:
            if rec.sleep_snapshot and self._complete(rec.sleep_snapshot):
                await self.launcher.stop(sid, rec.pid)
                ctx.store.transition(sid, State.SNAPSHOTTING, State.SLEEPING, pid=None,
                                     **stopped_clock(rec))  # a pause's clock stops
                log.info("interrupted sleep finished", extra={"sandbox_id": sid})
            elif vm is not None:
                ctx.registry.put(sid, Runtime(vm))
                await ctx.engine.resume(vm)
                ctx.store.transition(sid, State.SNAPSHOTTING, State.RUNNING,
                                     sleep_snapshot=None)
                log.info("paused VM resumed", extra={"sandbox_id": sid})
            else:
                await self._failed(rec, "the VMM was gone when the server started "
                                        "(it was being snapshotted)")
        elif state == State.WAKING:
            await self.launcher.stop(sid, rec.pid)
            ctx.store.transition(sid, State.WAKING, State.SLEEPING, pid=None)
            log.info("interrupted wake undone", extra={"sandbox_id": sid})
        elif state == State.RESTORING:
            await self.launcher.stop(sid, rec.pid)
            ctx.store.update(sid, pid=None)
            log.info("interrupted restore will be redone", extra={"sandbox_id": sid})
        elif state == State.STOPPING:
            await self.removal.complete(sid)
        elif state == State.SLEEPING and vm is not None:
            await self.launcher.stop(sid, rec.pid)

    async def _failed(self, rec: SandboxRecord, why: str) -> None:
        self.ctx.store.transition(rec.id, rec.state, State.STOPPING,
                                  desired_state=State.FAILED, error=why)
        await self.removal.complete(rec.id)

    def _complete(self, snapshot_id: str) -> bool:
        snap = self.ctx.store.find(SnapshotRecord, snapshot_id)
        return snap is not None and SnapshotPaths(self.ctx.layout.snapshot(snapshot_id)).manifest.exists()

    def sweep(self, found: Collection[str] = ()) -> None:
        """Remove what no record owns (see the module docstring). ``found``: the ids of
        the records recovery resolved, some of them since discarded (a ``pooled`` or
        ``creating`` one): their VMMs' cgroups are this data directory's too."""
        ctx = self.ctx
        layout = ctx.layout
        live = {r.id: r for r in ctx.store.live()}
        # a template build running beside this server (hangar image build) owns its VM
        held = set(ctx.registry.ids()) | templates.building(layout)
        killed: dict[int, str] = {}
        for pid, sid in vmm_processes(layout.sandboxes):
            if sid not in held:
                kill_process(pid, ctx.engine.helper)
                killed[pid] = sid
                log.info("orphan VMM killed", extra={"sandbox_id": sid, "pid": pid})
        left = _wait_gone(killed, KILL_WAIT_S)  # each leaves its cgroup as it exits
        if left:
            log.warning("orphan VMMs still ran %.0f s after SIGKILL", KILL_WAIT_S,
                        extra={"pids": left})
        folders = set()
        for d in layout.sandboxes.iterdir():
            folders.add(d.name)
            if d.name not in held:
                ctx.engine.release_orphan(layout.sandbox(d.name))  # its VMM's cgroup
                shutil.rmtree(d, ignore_errors=True)
                log.info("orphan sandbox folder removed", extra={"sandbox_id": d.name})
        self.sweep_cgroups(held, {*found, *folders, *killed.values()})
        sleeping_in = {r.sleep_snapshot for r in live.values() if r.sleep_snapshot}
        restoring_from = {r.restore_from for r in live.values() if r.restore_from}
        snaps = {s.id: s for s in ctx.store.list(SnapshotRecord)}
        for snap in snaps.values():
            files = layout.snapshot(snap.id)
            if not SnapshotPaths(files).manifest.exists() or (
                    snap.kind == "sleep" and snap.id not in sleeping_in):
                if snap.id in restoring_from:
                    continue
                ctx.store.remove(SnapshotRecord, snap.id)
                shutil.rmtree(files, ignore_errors=True)
                log.info("stale snapshot removed", extra={"snapshot_id": snap.id,
                                                          "kind": snap.kind})
        for d in layout.snapshots.iterdir():
            if d.name not in snaps:
                shutil.rmtree(d, ignore_errors=True)
                log.info("orphan snapshot folder removed", extra={"snapshot_id": d.name})

    def sweep_cgroups(self, held: Collection[str], known: Collection[str]) -> None:
        """Release the VMM cgroup of each sandbox of this data directory that no VMM
        holds (``held``): an id in ``known`` (records recovery resolved, folders, VMMs the
        sweep killed) or with a record of any state. Groups of other ids are another
        server's and stay (see the module docstring)."""
        ctx = self.ctx
        for sid in sorted(ctx.engine.vmm_groups() - set(held)):
            if sid in known or ctx.store.get(sid) is not None:
                ctx.engine.release_orphan(ctx.layout.sandbox(sid))
                log.info("orphan VMM cgroup released", extra={"sandbox_id": sid})

    async def sweep_network(self) -> None:
        """Start TAP networking and remove the devices and rules of sandboxes without a VMM."""
        net = self.launcher.net
        if net is None:
            return
        ok, reason = net.available()
        if net.mode != "user" and not ok:
            log.warning("TAP networking unavailable", extra={"reason": reason})
        if net.mode == "tap":
            await asyncio.to_thread(net.start)
            removed = await net.sweep_async(sorted(self.ctx.registry.ids()))
            if removed:
                log.info("stale network devices removed", extra={"count": len(removed)})
            adopted = [r for r in self.ctx.store.live() if r.id in set(self.ctx.registry.ids())]
            for r in adopted:  # those with secrets: their HTTP(S) is their own proxy's
                self.launcher.secret_proxies.claim(r.id)
            await self.launcher.rules.adopt(adopted)


def _wait_gone(pids: Collection[int], timeout: float) -> list[int]:
    """Wait up to ``timeout`` seconds for the processes ``pids`` to exit; returns those
    still running then (a zombie has exited: it holds no cgroup)."""
    deadline = time.monotonic() + timeout
    while True:
        left = [pid for pid in pids if process.alive(pid)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.02)
