"""The directory of owners: every sandbox's record in etcd, and a cache fed by a watch.

One watch on ``/hangar/`` keeps an in-memory copy of the nodes, drain
flags, restart marks, sandbox records, machines, slots, teams and teams'
keys, so the gateway routes a request with no etcd round trip. A record
that the cache does not know yet (a create placed by another node a moment
ago) is read once from etcd (``lookup``).

Every change of ownership is a compare-and-set on the record's
``mod_revision`` (nobody wrote it since it was read) together with the
VM slot it takes (``version == 0``: the slot is free), in one
transaction: two nodes that try to take the same sandbox, or the last
slot, cannot both win.

Records are read as untrusted input (``SandboxObject.parse``): the watch
leaves an unreadable one out of the cache, and ``lookup`` and ``fresh``
answer it with ``Conflict`` (409) naming the key, so a request about it gets
a clear refusal and every other record keeps working.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from hangar.cluster import records as R
from hangar.cluster.etcd import (
    Compacted, Etcd, Event, cmp_mod, cmp_value, cmp_version, op_delete, op_put,
)
from hangar.cluster import team_records as TR
from hangar.cluster.records import BadRecord, NodeInfo, SandboxObject
from hangar.cluster.team_records import KeyRecord
from hangar.core.service import Tasks
from hangar.teams import Team
from hangar.errors import Conflict, LimitExceeded

log = logging.getLogger("hangar.cluster.directory")


def read_record(sid: str, value: bytes, mod_revision: int) -> SandboxObject:
    """Parse ``sid``'s record from etcd. Raises ``Conflict`` (409) when it is unreadable."""
    try:
        return SandboxObject.parse(R.load_json(value), mod_revision, sid=sid)
    except BadRecord as exc:
        log.warning("unreadable cluster record refused", extra={
            "record": R.sandbox_key(sid), "error": str(exc)[:300]})
        raise Conflict(f"sandbox {sid}'s cluster record is unreadable ({exc}); an operator "
                       f"must fix or delete {R.sandbox_key(sid)}", sandbox_id=sid) from None

Listener = Callable[[str, "SandboxObject | None"], None]
"""Called with (sandbox id, its record or None when deleted) after the cache changed."""


class Directory:
    """Cache of ``/hangar/`` and the compare-and-set operations on it."""

    def __init__(self, etcd: Etcd) -> None:
        self.etcd = etcd
        self.nodes: dict[str, NodeInfo] = {}
        self.draining: set[str] = set()
        self.restarting: set[str] = set()
        """Nodes that left a restart mark at a graceful stop (``R.RESTARTS``)."""
        self.sandboxes: dict[str, SandboxObject] = {}
        self.machines: dict[str, dict[str, Any]] = {}
        self.snapshots: dict[str, dict[str, Any]] = {}
        self.slots: dict[str, dict[int, str]] = {}
        self.teams: dict[str, Team] = {}
        self.keys: dict[str, KeyRecord] = {}
        self.leader: str | None = None
        self.revision = 0
        self._listeners: list[Listener] = []
        self._key_listeners: list[Callable[[dict[str, KeyRecord]], None]] = []
        self._tasks = Tasks("directory")
        self.synced = asyncio.Event()

    def on_change(self, fn: Listener) -> None:
        self._listeners.append(fn)

    def on_keys(self, fn: Callable[[dict[str, KeyRecord]], None]) -> None:
        """Call ``fn(keys)`` (``{name: KeyRecord}``) now and whenever a team's key changes."""
        self._key_listeners.append(fn)
        fn(dict(self.keys))

    def _keys_changed(self) -> None:
        for fn in self._key_listeners:
            try:
                fn(dict(self.keys))
            except Exception:
                log.exception("directory key listener failed")

    # -- the cache ----------------------------------------------------------------------

    async def load(self) -> None:
        """Read everything under ``/hangar/`` (start, or after a compaction)."""
        kvs, rev = await self.etcd.get_prefix(R.ROOT)
        self.nodes.clear()
        self.draining.clear()
        self.restarting.clear()
        old = set(self.sandboxes)
        self.sandboxes.clear()
        self.machines.clear()
        self.snapshots.clear()
        self.slots.clear()
        self.teams.clear()
        self.keys.clear()
        self.leader = None
        for kv in kvs:
            self._apply(Event("PUT", kv), notify=False)
        self.revision = rev
        self._keys_changed()
        for sid in old | set(self.sandboxes):
            self._notify(sid)
        self.synced.set()

    def start(self) -> None:
        self._tasks.start("run", self._run())

    async def close(self) -> None:
        await self._tasks.stop()

    async def _run(self) -> None:
        while True:
            try:
                async for batch in self.etcd.watch_prefix(R.ROOT, self.revision + 1):
                    for ev in batch:
                        self._apply(ev)
                        self.revision = max(self.revision, ev.kv.mod_revision)
            except Compacted:
                log.info("directory watch compacted; reloading")
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("directory watch failed")
            while True:
                try:
                    await self.load()
                    break
                except asyncio.CancelledError:
                    raise
                except Exception:
                    await asyncio.sleep(1.0)

    def _apply(self, ev: Event, notify: bool = True) -> None:
        """Apply one event to the cache. Every key and value is checked like client input
        (``hangar.cluster.records``); a malformed one is left out with a log line, and
        nothing it holds can stop the watch or a load."""
        key, kv = ev.kv.key, ev.kv
        put = ev.type != "DELETE"
        try:
            if key.startswith(R.SANDBOXES):
                sid = R.key_id(key, R.SANDBOXES, R.SANDBOX_ID)
                cur = self.sandboxes.get(sid)
                if put and (cur is None or kv.mod_revision >= cur.mod_revision):
                    try:
                        self.sandboxes[sid] = SandboxObject.parse(
                            R.load_json(kv.value), kv.mod_revision, sid=sid)
                    except BadRecord:
                        self.sandboxes.pop(sid, None)
                        raise
                elif not put:
                    self.sandboxes.pop(sid, None)
                if notify:
                    self._notify(sid)
            elif key.startswith(R.NODES):
                name = R.key_id(key, R.NODES, R.NODE_NAME)
                if put:
                    info = NodeInfo.parse(R.load_json(kv.value))
                    if info.name != name:
                        raise BadRecord(f"node record names {info.name!r}")
                    self.nodes[name] = info
                else:
                    self.nodes.pop(name, None)
            elif key.startswith(R.DRAIN):
                name = R.key_id(key, R.DRAIN, R.NODE_NAME)
                (self.draining.add if put else self.draining.discard)(name)
            elif key.startswith(R.RESTARTS):
                name = R.key_id(key, R.RESTARTS, R.NODE_NAME)
                (self.restarting.add if put else self.restarting.discard)(name)
            elif key.startswith(R.MACHINES):
                user = R.key_id(key, R.MACHINES, R.STORED_USER)
                if put:
                    self.machines[user] = R.machine_meta(R.load_json(kv.value))
                else:
                    self.machines.pop(user, None)
            elif key.startswith(R.SNAPSHOTS):
                snap = R.key_id(key, R.SNAPSHOTS, R.SNAPSHOT_ID)
                if put:
                    self.snapshots[snap] = R.snapshot_meta(R.load_json(kv.value), snap)
                else:
                    self.snapshots.pop(snap, None)
            elif key.startswith(R.SLOTS):
                node, k = _slot(key)
                table = self.slots.setdefault(node, {})
                if put:
                    table[k] = _slot_value(kv.value)
                else:
                    table.pop(k, None)
            elif key.startswith(R.TEAMS):
                name = key[len(R.TEAMS):]
                self.teams.pop(name, None)
                if put:
                    self.teams[name] = TR.team_record(name, R.load_json(kv.value))
            elif key.startswith(R.KEYS):
                name = key[len(R.KEYS):]
                self.keys.pop(name, None)
                try:
                    if put:
                        self.keys[name] = TR.key_record(name, R.load_json(kv.value))
                finally:
                    if notify:
                        self._keys_changed()
            elif key == R.LEADER:
                self.leader = _name(kv.value) if put else None
        except Exception as exc:  # noqa: BLE001 (a forged record must never stop the watch)
            log.warning("unreadable cluster record ignored", extra={
                "record": key[:200], "error": str(exc)[:300] or type(exc).__name__})

    def _notify(self, sid: str) -> None:
        rec = self.sandboxes.get(sid)
        for fn in self._listeners:
            try:
                fn(sid, rec)
            except Exception:
                log.exception("directory listener failed")

    # -- reads --------------------------------------------------------------------------

    def alive(self, node: str | None) -> bool:
        """True while ``node`` holds its lease (its record exists)."""
        return node is not None and node in self.nodes

    def usable(self, node: str | None) -> bool:
        """Alive and not drained: it may take new sandboxes."""
        return self.alive(node) and node not in self.draining

    async def lookup(self, sid: str) -> SandboxObject | None:
        """The record of ``sid``: from the cache, else read once from etcd."""
        rec = self.sandboxes.get(sid)
        if rec is not None:
            return rec
        if not R.SANDBOX_ID.fullmatch(sid):
            return None
        kv = await self.etcd.get(R.sandbox_key(sid))
        if kv is None:
            return None
        rec = read_record(sid, kv.value, kv.mod_revision)
        cur = self.sandboxes.get(sid)
        if cur is None or cur.mod_revision < rec.mod_revision:
            self.sandboxes[sid] = rec
        return rec

    async def fresh(self, sid: str) -> SandboxObject | None:
        """The record of ``sid`` read from etcd now (before a compare-and-set). Raises
        ``Conflict`` when it is unreadable."""
        if not R.SANDBOX_ID.fullmatch(sid):
            return None
        kv = await self.etcd.get(R.sandbox_key(sid))
        if kv is None:
            self.sandboxes.pop(sid, None)
            return None
        rec = read_record(sid, kv.value, kv.mod_revision)
        self.sandboxes[sid] = rec
        return rec

    async def machine_sandbox(self, user: str) -> str | None:
        """The sandbox id of ``user``'s machine (``user`` as its node stores it: ``TEAM/id``
        for a team's), or None (no machine, or a user id that no machine can have). Raises
        Conflict when its record is unreadable."""
        if not R.STORED_USER.fullmatch(user):
            return None
        m = self.machines.get(user)
        if m is None:
            kv = await self.etcd.get(R.machine_key(user))
            if kv is None:
                return None
            try:
                m = self.machines[user] = R.machine_meta(R.load_json(kv.value))
            except BadRecord as exc:
                log.warning("unreadable cluster record refused", extra={
                    "record": R.machine_key(user), "error": str(exc)[:300]})
                raise Conflict(f"user {user}'s machine record is unreadable; an operator "
                               f"must fix or delete {R.machine_key(user)}",
                               user_id=user) from None
        return str(m["sandboxId"])

    # -- slots --------------------------------------------------------------------------

    async def _free_slots(self, node: NodeInfo, refresh: bool) -> list[int]:
        if refresh:
            kvs, _ = await self.etcd.get_prefix(f"{R.SLOTS}{node.name}/")
            table: dict[int, str] = {}
            for kv in kvs:
                try:
                    table[_slot(kv.key)[1]] = _slot_value(kv.value)
                except BadRecord:
                    table[_slot(kv.key)[1]] = "?"  # taken, by something unreadable
            self.slots[node.name] = table
        taken = self.slots.get(node.name, {})
        return [k for k in range(node.capacity) if k not in taken]

    async def claim(self, sid: str, candidates: list[NodeInfo],
                    record: Callable[[NodeInfo, int], SandboxObject],
                    compare: list[dict[str, Any]],
                    extra: Callable[[NodeInfo], list[dict[str, Any]]],
                    expect_revision: int = 0) -> tuple[NodeInfo, int]:
        """Take a free VM slot on the first candidate that has one and write ``sid``'s record
        (``record(node, slot)``), with ``compare`` and ``extra(node)`` puts, in one transaction.

        ``expect_revision`` 0 means the record must not exist yet (a create), else
        it must not have changed since that revision (an adoption or a wake).
        Raises LimitExceeded when no candidate has a free slot, Conflict when
        ``compare`` or the record's revision fails (someone else acted first).
        """
        key = R.sandbox_key(sid)
        guard = cmp_version(key, 0) if not expect_revision else cmp_mod(key, expect_revision)
        for refresh in (False, True):
            for node in candidates:
                for k in (await self._free_slots(node, refresh))[:3]:
                    rec = record(node, k)
                    ok, _ = await self.etcd.txn(
                        [guard, cmp_version(R.slot_key(node.name, k), 0), *compare],
                        [op_put(R.slot_key(node.name, k), sid),
                         op_put(key, rec.to_json()), *extra(node)])
                    if ok:
                        self.slots.setdefault(node.name, {})[k] = sid
                        return node, k
                    cur = await self.etcd.get(key)
                    if (cur is not None if not expect_revision
                            else cur is None or cur.mod_revision != expect_revision):
                        raise Conflict(f"sandbox {sid} was changed by another node; retry",
                                       sandbox_id=sid)
                    if compare:
                        ok2, _ = await self.etcd.txn(compare, [], [])
                        if not ok2:
                            raise Conflict("another node acted first; retry", sandbox_id=sid)
                    self.slots.setdefault(node.name, {})[k] = "?"  # taken meanwhile
        cap = sum(n.capacity for n in candidates)
        raise LimitExceeded(f"every VM slot of the cluster's usable nodes is taken ({cap})",
                            retry_after=5.0, limit=cap)

    async def release_slot(self, node: str, slot: int | None, sid: str) -> None:
        """Free ``node``'s slot ``slot`` if ``sid`` still holds it."""
        if slot is None:
            return
        key = R.slot_key(node, slot)
        await self.etcd.txn([cmp_value(key, sid)], [op_delete(key)])
        if self.slots.get(node, {}).get(slot) == sid:
            self.slots[node].pop(slot, None)

    # -- records ------------------------------------------------------------------------

    async def update(self, sid: str, change: Callable[[SandboxObject], bool],
                     extra: list[dict[str, Any]] | None = None,
                     tries: int = 4) -> SandboxObject | None:
        """Read ``sid``'s record, let ``change`` edit it (False: leave it), write it back by
        compare-and-set, again on a lost race. Returns the record written, or None."""
        for _ in range(tries):
            rec = await self.fresh(sid)
            if rec is None or not change(rec):
                return None
            ok, _ = await self.etcd.txn([cmp_mod(R.sandbox_key(sid), rec.mod_revision)],
                                        [op_put(R.sandbox_key(sid), rec.to_json()),
                                         *(extra or [])])
            if ok:
                return rec
        raise Conflict(f"sandbox {sid}'s record keeps changing; retry", sandbox_id=sid)

    async def remove(self, rec: SandboxObject) -> None:
        """Delete a sandbox's record, its slot and its machine key (if it is that user's)."""
        ops = [op_delete(R.sandbox_key(rec.name))]
        if rec.node is not None and rec.slot is not None:
            await self.release_slot(rec.node, rec.slot, rec.name)
        if rec.user:
            m = self.machines.get(rec.user)
            if m is None or m.get("sandboxId") == rec.name:
                ops.append(op_delete(R.machine_key(rec.user)))
        await self.etcd.txn([], ops)
        self.sandboxes.pop(rec.name, None)


MAX_SLOT = 100_000


def _slot(key: str) -> tuple[str, int]:
    """(node, k) of a slot key ``/hangar/slots/<node>/<k>``. Raises BadRecord."""
    node, _, k = key[len(R.SLOTS):].partition("/")
    if not R.NODE_NAME.fullmatch(node) or not k.isdigit() or len(k) > 6 or int(k) > MAX_SLOT:
        raise BadRecord(f"malformed slot key {key[:120]!r}")
    return node, int(k)


def _slot_value(value: bytes) -> str:
    sid = value.decode("ascii", "replace")
    if not R.SANDBOX_ID.fullmatch(sid):
        raise BadRecord("a slot holds no sandbox id")
    return sid


def _name(value: bytes) -> str:
    name = value.decode("ascii", "replace")
    if not R.NODE_NAME.fullmatch(name):
        raise BadRecord("malformed node name")
    return name
