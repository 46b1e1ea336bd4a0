"""A cluster node: one Hangar server that is also a member of a cluster (docs/cluster.md).

``ClusterNode`` wires the parts: the etcd client, the directory cache,
membership (lease, fencing, election), failover, shared storage, and the
core's hooks (``NodeHooks``). It keeps the directory true to this node's
local records:

* every committed state change of a sandbox this node owns is pushed to
  its record (a compare-and-set that holds only while ``nodeName`` is this
  node and the epoch is the one this node knows), one at a time per
  sandbox, retried while etcd is away; leaving the VMM states frees the
  VM slot; ``deleted`` and ``expired`` remove the record;
* when a record moves to another node (an adoption, a failover), the local
  records of that sandbox are discarded, and a VMM it still had is killed;
* at start and after a fencing (``rejoin``), a local sandbox whose record
  names another node or another epoch is stale: its VMM is killed and its
  records dropped, so a partition never leaves two copies of one machine.

It acts on the core only through its public surface: ``SandboxManager``'s
``adopt``, ``forget``, ``fence`` and ``handover.receive`` (``hangar.core.handover``),
and the store's reads and transition listener. Every state it writes into a
record is a move of ``hangar.core.lifecycle``'s table (``SandboxObject.move``,
``follow``, ``want``).

Each node remembers the epoch of every sandbox it owns in
``cluster-epochs.json`` (``Layout.cluster_epochs``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import platform
import socket
import time
from typing import Any

from hangar import __version__
from hangar.durable import atomic_write
from hangar.cluster import records as R
from hangar.cluster.directory import Directory
from hangar.cluster.etcd import Etcd, EtcdUnavailable, op_delete
from hangar.cluster.failover import Failover, hand_on
from hangar.cluster.guard import Guard
from hangar.cluster.membership import Membership
from hangar.cluster.pki import tls_from
from hangar.cluster.records import (
    BadRecord, ClusterConfig, NodeInfo, SandboxObject, parse_template, template_json,
)
from hangar.cluster.sharing import Sharing, shared_snapshot, template_meta
from hangar.cluster.storage import SharedStore, open_store
from hangar.cluster.teams import SharedTeamStore, shape, within_quota
from hangar.config import Settings
from hangar.core.service import (
    GONE, LIVE, Adoptee, Hooks, IllegalTransition, SandboxManager, SandboxView, SnapshotView, State,
    Tasks, Usage, describe, every, sandbox_view,
)
from hangar.errors import ConfigError, Conflict, HangarError, NotFound
from hangar.images import image_id
from hangar.layout import Layout

log = logging.getLogger("hangar.cluster.node")

AUDIT_S = 10.0
"""Seconds between audits of this node's records in etcd (stale creates, lost pushes)."""
CREATE_GRACE_S = 120.0
"""A ``creating`` record of this node that it has no local record of after this long was
placed by a gateway whose forward never arrived: removed."""


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def memory_free_mib() -> int:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) // 1024
    except (OSError, ValueError):
        pass
    return 0


class NodeHooks(Hooks):
    """The core's hooks on a cluster node (``hangar.core.hooks``)."""

    def __init__(self, node: "ClusterNode") -> None:
        self.node = node

    async def claim(self, rec: SandboxView) -> None:
        await self.node.claim_slot(rec.id)

    async def release(self, sandbox_id: str) -> None:
        try:
            await self.node.release_slot(sandbox_id)
        except HangarError as exc:
            log.warning("slot release failed", extra={"sandbox_id": sandbox_id,
                                                      "error": exc.message})

    async def saved(self, rec: SandboxView, snap: SnapshotView) -> None:
        assert self.node.sharing is not None
        await self.node.sharing.share(rec, snap)

    async def fetch_snapshot(self, snapshot_id: str) -> None:
        assert self.node.sharing is not None and self.node.manager is not None
        await self.node.sharing.fetch_user(self.node.manager, snapshot_id)


class ClusterNode:
    """This server's part in the cluster."""

    def __init__(self, settings: Settings, layout: Layout) -> None:
        if not settings.etcd:
            raise ConfigError("a cluster node needs HANGAR_ETCD")
        self.settings = settings
        self.layout = layout
        self.name = settings.node_name or socket.gethostname()
        self.address = settings.advertise or f"{settings.host}:{settings.port}"
        if not R.NODE_NAME.fullmatch(self.name):
            raise ConfigError(f"bad node name {self.name!r} (HANGAR_NODE_NAME: letters, "
                              "digits, '.', '_', '-'; at most 63)")
        try:
            R.check_address(self.address)
        except ValueError as exc:
            raise ConfigError(f"bad advertised address (HANGAR_ADVERTISE): {exc}") from None
        urls = Etcd.parse_urls(settings.etcd)
        plain = [u for u in urls if not u.startswith("https://")]
        if plain:
            raise ConfigError(f"etcd must be reached over TLS with a client certificate: "
                              f"{plain[0]} is not https:// (docs/cluster.md, `hangar cluster "
                              "certs`)")
        self.tls = tls_from(settings.etcd_pki or settings.data_dir / "etcd-pki")
        host = self.address.rsplit(":", 1)[0]
        urls.sort(key=lambda u: f"//{host}:" not in u)  # this host's member first
        self.etcd = Etcd(urls, tls=self.tls.context())
        logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per etcd call otherwise
        self.directory = Directory(self.etcd)
        self.hooks = NodeHooks(self)
        self.config: ClusterConfig | None = None
        self.store: SharedStore | None = None
        self.sharing: Sharing | None = None
        self.manager: SandboxManager | None = None
        self.membership: Membership | None = None
        self.failover: Failover | None = None
        self.guard: Guard | None = None
        self.epochs: dict[str, int] = self._read_epochs()
        self._dirty: set[str] = set()
        self._wake = asyncio.Event()
        self._tasks = Tasks("cluster node")
        self._discarding: set[str] = set()
        self._adopting: set[str] = set()
        self._orphans: dict[str, int] = {}

    # -- start and stop ------------------------------------------------------------------

    async def load_config(self, wait_s: float = 30.0) -> ClusterConfig:
        """Read ``/hangar/config``, waiting up to ``wait_s`` for etcd. Raises ConfigError."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                kv = await self.etcd.get(R.CONFIG)
                break
            except EtcdUnavailable as exc:
                if time.monotonic() > deadline:
                    raise ConfigError(f"etcd at {self.settings.etcd} cannot be reached: "
                                      f"{exc.context.get('detail', exc.message)}") from None
                await asyncio.sleep(0.5)
        if kv is None:
            raise ConfigError("this etcd holds no Hangar cluster; run `hangar cluster init "
                              "--etcd URLS --store URL` once first")
        try:
            self.config = ClusterConfig.parse(R.load_json(kv.value))
        except BadRecord as exc:
            raise ConfigError(f"{R.CONFIG} is unreadable ({exc}); rewrite it with `hangar "
                              "cluster init --force`") from None
        self.store = open_store(self.config.store)
        self.sharing = Sharing(self.store, self.layout, self.etcd, self.directory, self.name,
                               self.owns)
        return self.config

    async def start(self, manager: SandboxManager) -> None:
        """Register, load the directory, drop stale local sandboxes, then start the loops."""
        assert self.config is not None
        self.manager = manager
        manager.teams.use_store(SharedTeamStore(self.directory))  # teams live in etcd
        manager.on_transition(lambda rec, frm, to: self.mark(rec.id))
        self.directory.on_change(self._changed)
        self.membership = Membership(self.etcd, self.directory, self.name,
                                     self.config.lease_ttl_s, self.info, self.fence, self.rejoin,
                                     token=lambda: self.config.node_token if self.config else "")
        await self.directory.load()
        await self.membership.register()
        await self.rejoin()
        self.directory.start()
        self.membership.start()
        self.failover = Failover(self.directory, self.membership, self.config.failover_after_s,
                                 self.config.restart_grace_s)
        self.failover.start()
        self.guard = Guard(self.etcd, self.directory, manager.net)
        try:
            await self.guard.step()  # before the first guest of this run gets its NIC
        except HangarError as exc:
            log.error("guests' access to the control endpoints not closed yet; retrying",
                      extra={"error": exc.message})
        self.guard.start()
        self._tasks.start("push", self._pusher())
        self._tasks.start("audit", every(AUDIT_S, self._audit_pass, log, "cluster audit failed"))

    async def close(self) -> None:
        """A graceful stop: leave a restart mark (the VMMs run on), then stop every loop."""
        if self.membership is not None and self.config is not None:
            await self.membership.mark_restart(self.config.restart_grace_s)
        await self._tasks.stop()
        for part in (self.guard, self.failover, self.membership):
            if part is not None:
                await part.close()
        await self.directory.close()
        await self.etcd.close()

    def info(self) -> NodeInfo:
        m = self.manager
        cap = self.settings.max_sandboxes
        used = m.vmm_count() if m else 0
        images = []
        try:
            images = sorted(p.name for p in self.layout.images.iterdir()
                            if p.is_dir() and not p.name.startswith(".") and not p.is_symlink())
        except OSError:
            pass
        return NodeInfo(
            name=self.name, address=self.address, capacity=cap, free=max(0, cap - used),
            engine=m.engine_name if m else "", accel=m.engine_accel if m else "",
            cpu_model=cpu_model(), images=images, memory_free_mib=memory_free_mib(),
            pool=len(m.in_states({State.POOLED})) if m else 0,
            draining=self.name in self.directory.draining, version=__version__)

    def writable(self) -> bool:
        return self.membership is not None and self.membership.writable()

    # -- epochs --------------------------------------------------------------------------

    def _read_epochs(self) -> dict[str, int]:
        try:
            raw = json.loads(self.layout.cluster_epochs.read_text())
            return {str(k): int(v) for k, v in raw.items()}
        except (OSError, ValueError, AttributeError):
            return {}

    def _save_epochs(self) -> None:
        atomic_write(self.layout.cluster_epochs, json.dumps(self.epochs).encode(), 0o600)

    def set_epoch(self, sid: str, epoch: int | None) -> None:
        if epoch is None:
            if self.epochs.pop(sid, None) is not None:
                self._save_epochs()
        elif self.epochs.get(sid) != epoch:
            self.epochs[sid] = epoch
            self._save_epochs()

    def owns(self, rec: SandboxObject | None) -> bool:
        """True when ``rec`` names this node and the epoch this node knows (or learns now)."""
        if rec is None or rec.node != self.name:
            return False
        known = self.epochs.get(rec.name)
        return known is None or known == rec.epoch

    # -- pushing local changes -----------------------------------------------------------

    def mark(self, sid: str) -> None:
        """A local record changed: push it (never blocks; called from the store)."""
        self._dirty.add(sid)
        self._wake.set()

    async def _pusher(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._dirty:
                sid = self._dirty.pop()
                try:
                    await self.push(sid)
                except EtcdUnavailable:
                    self._dirty.add(sid)
                    await asyncio.sleep(0.5)
                    break
                except Exception:
                    log.exception("push to the cluster failed", extra={"sandbox_id": sid})
            if self._dirty:
                self._wake.set()

    async def push(self, sid: str) -> None:
        """Write this node's view of ``sid`` into its record (see the module docstring)."""
        m = self.manager
        assert m is not None
        rec = m.find(sid)
        if rec is None or rec.state == State.POOLED:
            return
        cur = await self.directory.fresh(sid)
        if not self.owns(cur):
            return
        assert cur is not None
        if rec.state in GONE:
            await self.directory.remove(cur)
            if cur.snapshot:
                await self.drop_shared(cur.snapshot["id"])
            self.set_epoch(sid, None)
            return
        self.set_epoch(sid, cur.epoch)
        holding = rec.state in R.VMM_HOLDING
        slot = cur.slot
        extra = [] if holding or slot is None else [op_delete(R.slot_key(self.name, slot))]

        def change(d: SandboxObject) -> bool:
            if not self.owns(d):
                return False
            d.status["view"] = sandbox_view(rec).model_dump(mode="json")
            d.follow(rec.state)
            try:
                d.want(rec.desired_state)
            except IllegalTransition:
                log.warning("desired state not mirrored", extra={
                    "sandbox_id": sid, "state": rec.state.value,
                    "desired": rec.desired_state.value})
            if not holding and d.slot == slot:
                d.status["slot"] = None
            d.spec.update(shutdownTime=R.iso(rec.expires_at),
                          template=template_json(describe(rec)))
            return True

        await self.directory.update(sid, change, extra)

    async def _audit_pass(self) -> None:
        if self.writable():
            await self.audit()

    async def audit(self) -> None:
        """Records naming this node that it has no local sandbox for, seen so at two audits
        in a row with no change (an unfinished placement, a lost local database): a create is
        removed, anything else handed on like a lost node's (``failover``). Local records
        whose state the directory does not show yet are pushed again."""
        m = self.manager
        assert m is not None
        seen: dict[str, int] = {}
        for sid, d in list(self.directory.sandboxes.items()):
            if d.node != self.name or sid in self._adopting:
                continue
            local = m.find(sid)
            if local is not None and local.state not in GONE:
                if d.state != local.state:
                    self.mark(sid)
                continue
            if d.state == State.CREATING and time.time() - d.created_at < CREATE_GRACE_S:
                continue
            seen[sid] = d.mod_revision
            if self._orphans.get(sid) != d.mod_revision:
                continue
            fresh = await self.directory.fresh(sid)
            if fresh is None or fresh.node != self.name or fresh.mod_revision != d.mod_revision:
                continue
            if fresh.state == State.CREATING:
                await self.directory.remove(fresh)
            else:
                await self.directory.update(sid, lambda r: hand_on(r, self.name))
            log.warning("record without a local sandbox handed on", extra={"sandbox_id": sid})
        self._orphans = seen

    # -- the directory moved a sandbox ------------------------------------------------------

    def _changed(self, sid: str, rec: SandboxObject | None) -> None:
        m = self.manager
        if m is None or sid in self._discarding:
            return
        local = m.find(sid)
        if local is None or local.state in GONE or local.state == State.CREATING:
            return
        if rec is None or rec.node != self.name:
            if rec is None and local.state not in (State.FAILED,):
                return  # our own delete in flight; the removal finishes locally
            self._discarding.add(sid)
            self._tasks.start(f"discard {sid}", self._discard_task(sid))

    async def _discard_task(self, sid: str) -> None:
        try:
            await self.discard_local(sid)
        finally:
            self._discarding.discard(sid)

    async def discard_local(self, sid: str, why: str = "owned by another node") -> None:
        """Forget a sandbox this node no longer owns (``SandboxManager.forget``: its VMM
        ended, its records and sleep snapshots dropped). Never touches etcd or shared
        storage."""
        m = self.manager
        assert m is not None
        if await m.forget(sid, why):
            self.set_epoch(sid, None)

    # -- fencing and rejoining ------------------------------------------------------------

    async def fence(self, why: str) -> None:
        """Kill every VMM of this node at once (SIGKILL), then let the core notice."""
        m = self.manager
        assert m is not None
        killed = m.fence()
        log.error("fenced", extra={"node": self.name, "vmms": killed, "reason": why})

    async def rejoin(self) -> None:
        """Drop every local sandbox the directory no longer gives this node (its VMM too)."""
        m = self.manager
        assert m is not None
        await self.directory.load()
        for rec in m.in_states(LIVE | {State.FAILED}):
            if rec.state == State.CREATING and m.create_in_flight(rec.id):
                continue
            d = self.directory.sandboxes.get(rec.id)
            if not self.owns(d):
                await self.discard_local(rec.id, "stale after a rejoin")
            else:
                self.mark(rec.id)
        if self.membership is not None:
            try:
                await self.membership.refresh_now()  # free slots as they are now
            except EtcdUnavailable:
                pass

    # -- slots, adoption ----------------------------------------------------------------

    async def claim_slot(self, sid: str) -> None:
        """Before a wake: this node must own ``sid``; take a VM slot (compare-and-set),
        within its team's quotas counted on every node (``hangar.cluster.teams``). Raises
        Conflict, QuotaExceeded (429: the sandbox sleeps on)."""
        for _ in range(4):
            d = await self.directory.fresh(sid)
            if d is None:
                raise Conflict(f"sandbox {sid} is not in the cluster's directory", sandbox_id=sid)
            if not self.owns(d):
                raise Conflict(f"sandbox {sid} belongs to node {d.node}", sandbox_id=sid,
                               node=d.node or "")
            if d.slot is not None and self.directory.slots.get(self.name, {}).get(d.slot) == sid:
                return

            def mark(node: NodeInfo, k: int, d: SandboxObject = d) -> SandboxObject:
                d.follow(State.SLEEPING)  # the local record sleeps; the push may lag
                d.move(State.WAKING)
                d.status["slot"] = k
                return d

            vcpus, memory_mib, _ = shape(d)
            try:  # a team's wake within its quotas, counted on every node (its disk is)
                await within_quota(
                    self.etcd, d.team, Usage(1, vcpus, memory_mib, 0),
                    lambda c, o, d=d, mark=mark: self.directory.claim(  # type: ignore[misc]
                        sid, [self.info()], mark, c, lambda n: o,
                        expect_revision=d.mod_revision))
                return
            except Conflict:
                await asyncio.sleep(0.05)
        raise Conflict(f"sandbox {sid}'s record keeps changing; retry", sandbox_id=sid)

    async def release_slot(self, sid: str) -> None:
        d = await self.directory.fresh(sid)
        if d is None or d.node != self.name or d.slot is None:
            return
        slot = d.slot

        def clear(r: SandboxObject) -> bool:
            if r.node != self.name or r.slot != slot:
                return False
            r.status["slot"] = None
            r.follow(State.SLEEPING)  # the wake failed: the local record sleeps again
            return True

        await self.directory.update(sid, clear, [op_delete(R.slot_key(self.name, slot))])

    async def adopt(self, sid: str) -> bool:
        """Take a sleeping sandbox whose owner is lost or drained, download its last
        snapshot and recreate its local records, so the core can wake it here.

        Returns False when another node took it first. Raises NotFound, Conflict
        (not sleeping, no snapshot), StorageError, EtcdUnavailable.
        """
        self._adopting.add(sid)
        try:
            return await self._adopt(sid)
        finally:
            self._adopting.discard(sid)

    async def _adopt(self, sid: str) -> bool:
        m = self.manager
        assert m is not None
        d = await self.directory.fresh(sid)
        if d is None:
            raise NotFound(f"no sandbox {sid}", sandbox_id=sid)
        local = m.find(sid)
        if self.owns(d) and local is not None and local.state not in GONE:
            return True
        if d.state != State.SLEEPING or not d.snapshot:
            raise Conflict(f"sandbox {sid} is {d.state.value} on a lost or drained node and "
                           "has no snapshot to wake from", sandbox_id=sid, state=d.state.value)
        try:
            template = parse_template(d.spec.get("template"))
            snap = shared_snapshot({**template_meta(template), **d.snapshot}, "sleep",
                                   sandbox_id=sid, team=d.team)
        except BadRecord as exc:
            raise Conflict(f"sandbox {sid}'s cluster record cannot be adopted: {exc}",
                           sandbox_id=sid) from None
        prev = d.node

        def take(r: SandboxObject) -> bool:
            if r.state != State.SLEEPING or r.node != prev:
                return False
            r.status.update(nodeName=self.name, epoch=r.epoch + 1, slot=None, podIPs=[])
            return True

        new = await self.directory.update(sid, take)
        if new is None:
            return False
        if local is not None:  # a stale copy (its files would shadow the download)
            await m.forget(sid, "replaced by an adoption")
        self.set_epoch(sid, new.epoch)
        assert self.sharing is not None
        await self.sharing.fetch(snap.id)
        mm = self.directory.machines.get(new.user or "") or {}
        await m.adopt(Adoptee(
            sandbox_id=sid, template=template, snapshot=snap, created_at=new.created_at,
            user=new.user, idle_timeout_s=_float(mm.get("idleTimeoutSeconds")),
            machine_created_at=_float(mm.get("createdAt")), team=new.team))
        log.info("sandbox adopted from the cluster", extra={
            "sandbox_id": sid, "from_node": prev or "", "epoch": new.epoch,
            "image": image_id(template.image, template.image_digest)})
        return True

    async def drop_shared(self, snap_id: str) -> None:
        """Delete a snapshot's files from shared storage (``Sharing.drop``)."""
        assert self.sharing is not None
        await self.sharing.drop(snap_id)


def _float(v: Any) -> float | None:
    try:
        return float(v) if v else None
    except (TypeError, ValueError):
        return None
