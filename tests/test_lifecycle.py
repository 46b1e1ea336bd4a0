"""The lifecycle table, the store's compare-and-set moves and the events they publish.

No VMs: a real SQLite store in a temporary folder, a real event bus.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from pathlib import Path

import pytest

from hangar.core import lifecycle
from hangar.core.events import EventBus
from hangar.core.lifecycle import GONE, INITIAL, MOVES, NEXT, State
from hangar.core.publish import announce
from hangar.core.registry import Registry
from hangar.core.store import SandboxRecord, Store
from hangar.errors import Conflict, NotFound

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def record(sid: str, state: State = State.CREATING, **extra: object) -> SandboxRecord:
    now = time.time()
    fields: dict = dict(id=sid, state=state, desired_state=State.RUNNING, image="base",
                        image_digest="d", engine="qemu", accel="tcg", vcpus=1, memory_mib=256,
                        disk_mib=2048, created_at=now, updated_at=now, last_active_at=now,
                        metadata_={})
    fields.update(extra)
    return SandboxRecord(**fields)


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "hangar.db")


def test_the_diagram_in_the_docs_is_generated_from_the_table() -> None:
    doc = DOC.read_text()
    assert lifecycle.diagram_in(doc) == lifecycle.render_diagram(), (
        "docs/architecture.md is stale: run python -m hangar.core.lifecycle docs/architecture.md")
    for m in MOVES:
        assert f"{m.frm.value} --> {m.to.value}" in doc


def test_the_table_has_no_dead_ends() -> None:
    # Every state is reachable from where records start, and every state but
    # the tombstones can still end (reach deleted), so nothing gets stuck.
    reach = set(INITIAL)
    while True:
        more = {t for s in reach for t in NEXT[s]} - reach
        if not more:
            break
        reach |= more
    assert reach == set(State)
    for s in State:
        if s in GONE:
            assert not NEXT[s]
            continue
        seen, todo = {s}, [s]
        while todo:
            for t in NEXT[todo.pop()]:
                if t not in seen:
                    seen.add(t)
                    todo.append(t)
        assert State.DELETED in seen, f"{s} cannot be deleted"
    assert {State.RUNNING, State.STOPPING} <= NEXT[State.UNRESPONSIVE]
    assert State.UNRESPONSIVE in NEXT[State.RUNNING]


def test_transition_is_a_compare_and_set(store: Store) -> None:
    store.add(record("sb-000000000001", State.RUNNING))
    rec = store.transition("sb-000000000001", State.RUNNING, State.SNAPSHOTTING, pid=42)
    assert rec.state == State.SNAPSHOTTING and rec.pid == 42
    with pytest.raises(Conflict) as err:
        store.transition("sb-000000000001", State.RUNNING, State.STOPPING)
    assert err.value.context["state"] == "snapshotting"
    assert store.get("sb-000000000001").state == State.SNAPSHOTTING, "a lost race changes nothing"
    with pytest.raises(lifecycle.IllegalTransition):
        store.transition("sb-000000000001", State.SNAPSHOTTING, State.WAKING)
    with pytest.raises(lifecycle.IllegalTransition):
        store.transition("sb-000000000001", {State.SNAPSHOTTING, State.DELETED}, State.RUNNING)
    with pytest.raises(ValueError):
        store.update("sb-000000000001", state=State.RUNNING)
    with pytest.raises(NotFound):
        store.transition("sb-nonexistent", State.RUNNING, State.STOPPING)
    assert not store.discard("sb-000000000001", State.CREATING)
    assert store.discard("sb-000000000001", {State.SNAPSHOTTING})
    assert store.get("sb-000000000001") is None


def test_racing_threads_exactly_one_wins(store: Store) -> None:
    for i in range(10):
        store.add(record(f"sb-race{i:07d}", State.POOLED))
    for i in range(10):
        sid = f"sb-race{i:07d}"
        wins: list[State] = []
        barrier = threading.Barrier(8)

        def go(to: State) -> None:
            barrier.wait()
            try:
                store.transition(sid, State.POOLED, to)  # noqa: B023
                wins.append(to)  # noqa: B023
            except Conflict:
                pass

        threads = [threading.Thread(target=go, args=(State.CREATING if n % 2 else State.STOPPING,))
                   for n in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(wins) == 1, wins
        assert store.get(sid).state == wins[0]


def test_a_database_from_before_keeps_working(tmp_path: Path) -> None:
    db = tmp_path / "hangar.db"
    con = sqlite3.connect(db)
    con.execute(
        "create table sandboxes (id varchar(32) primary key, state varchar(16), desired_state "
        "varchar(16), image varchar(64), image_digest varchar(64), engine varchar(16), accel "
        "varchar(8), vcpus int, memory_mib int, disk_mib int, pid int, created_at float, "
        "updated_at float, last_active_at float, expires_at float, error varchar(1024), desktop "
        "varchar(32), sleep_snapshot varchar(32), network json, metadata json)")
    con.execute("insert into sandboxes values ('sb-0123456789ab', 'sleeping', 'running', 'base', "
                "'d', 'qemu', 'tcg', 1, 256, 2048, null, 1, 1, 1, null, null, null, 'snap-1', "
                "null, '{}')")
    con.commit()
    con.close()
    store = Store(db)
    rec = store.get("sb-0123456789ab")
    assert rec.state is State.SLEEPING and rec.restore_from is None
    store.transition(rec.id, State.SLEEPING, State.WAKING)
    assert sqlite3.connect(db).execute("select state from sandboxes").fetchone() == ("waking",)


def test_moves_publish_their_events(store: Store) -> None:
    bus = EventBus()

    class Ctx:  # what announce uses of hangar.core.context.Context
        def publish(self, kind: str, sandbox_id: str | None = None, **data: object) -> None:
            bus.publish(kind, sandbox_id, **data)

    store.on_transition(lambda rec, frm, to: announce(Ctx(), rec, frm, to))  # type: ignore[arg-type]
    store.add(record("sb-00000000000a", State.RUNNING, user_id="ann"),
              record("sb-00000000000b", State.POOLED, pooled=True))
    a = "sb-00000000000a"
    store.transition(a, State.RUNNING, State.SNAPSHOTTING, desired_state=State.SLEEPING)
    store.transition(a, State.SNAPSHOTTING, State.SLEEPING)
    store.transition(a, State.SLEEPING, State.WAKING, desired_state=State.RUNNING)
    store.transition(a, State.WAKING, State.RUNNING)
    store.transition(a, State.RUNNING, State.STOPPING, desired_state=State.FAILED, error="boom")
    store.transition(a, State.STOPPING, State.FAILED)
    store.transition("sb-00000000000b", State.POOLED, State.STOPPING)
    store.transition("sb-00000000000b", State.STOPPING, State.DELETED)
    got = [(e.kind, e.sandbox_id, e.data) for e in bus.since(None)]
    assert got == [
        ("machine.sleeping", a, {"user_id": "ann"}),
        ("machine.asleep", a, {"user_id": "ann"}),
        ("machine.waking", a, {"user_id": "ann"}),
        ("machine.awake", a, {"user_id": "ann"}),
        ("sandbox.crashed", a, {"error": "boom"}),
    ], "pool VMs publish no sandbox events"


def test_lock_entries_go_away() -> None:
    async def main() -> None:
        reg = Registry()
        order: list[str] = []

        async def hold(tag: str, delay: float) -> None:
            async with reg.lock("sb-1"):
                order.append(f"{tag}+")
                await asyncio.sleep(delay)
                order.append(f"{tag}-")

        await asyncio.gather(hold("a", 0.05), hold("b", 0.0), hold("c", 0.01))
        assert order == ["a+", "a-", "b+", "b-", "c+", "c-"], "one holder at a time, in order"
        assert reg.lock_count() == 0 and not reg.locked("sb-1")
        with pytest.raises(RuntimeError):
            async with reg.lock("sb-2"):
                raise RuntimeError("boom")
        assert reg.lock_count() == 0

    asyncio.run(main())


def test_pool_templates_setting() -> None:
    from hangar.config import Settings
    from hangar.core.pool import templates

    assert templates(Settings(pool_size=2)) == {"base": 2}
    assert templates(Settings(pool_size=0)) == {}
    assert templates(Settings(pool_templates="dev=2, base=1,x=0")) == {"dev": 2, "base": 1}
    for bad in ("dev", "dev=two", "=2"):
        with pytest.raises(ValueError):
            templates(Settings(pool_templates=bad))


def test_guarded_moves_need_their_guard_and_the_store_never_makes_them(store: Store) -> None:
    guarded = [m for m in MOVES if m.guard is not None]
    assert guarded, "the failover's moves are edges of the table"
    for m in guarded:
        assert m.guard in lifecycle.GUARDS
        with pytest.raises(lifecycle.IllegalTransition):
            lifecycle.check({m.frm}, m.to)  # no guard named: refused
        lifecycle.check({m.frm}, m.to, m.guard)
        others = [g for g in lifecycle.Guard if g != m.guard]
        for g in others:
            if not lifecycle.allowed(m.frm, m.to, g):
                with pytest.raises(lifecycle.IllegalTransition):
                    lifecycle.check({m.frm}, m.to, g)
    store.add(record("a", State.RUNNING))
    with pytest.raises(lifecycle.IllegalTransition):
        store.transition("a", State.RUNNING, State.SLEEPING)
    assert store.get("a").state == State.RUNNING  # type: ignore[union-attr]
    assert "[guard back_to_snapshot]" in lifecycle.render_diagram()


def test_walk_follows_unguarded_edges_only() -> None:
    assert lifecycle.walk(State.SLEEPING, State.RUNNING) == [
        State.SLEEPING, State.WAKING, State.RUNNING]
    # The failover's one guarded edge running -> failed is not a step of a walk.
    assert len(lifecycle.walk(State.RUNNING, State.FAILED)) == 3
    assert lifecycle.walk(State.RUNNING, State.RUNNING) == [State.RUNNING]
    for frm in State:
        for to in State:
            try:
                chain = lifecycle.walk(frm, to)
            except lifecycle.IllegalTransition:
                # Out of a tombstone nothing goes; only a pool VM becomes a create.
                assert frm in GONE or to in (State.POOLED, State.CREATING), (frm, to)
                continue
            for a, b in zip(chain, chain[1:]):
                assert lifecycle.allowed(a, b)


def test_desired_state_writes_are_checked(store: Store) -> None:
    store.add(record("a", State.RUNNING))
    rec = store.update("a", desired_state=State.SLEEPING)
    assert rec is not None and rec.desired_state == State.SLEEPING
    with pytest.raises(Conflict):
        store.update("a", desired_state=State.DELETED)
    with pytest.raises(lifecycle.IllegalTransition):
        store.transition("a", State.RUNNING, State.STOPPING, desired_state=State.RUNNING)
    assert store.get("a").state == State.RUNNING  # type: ignore[union-attr]
    store.transition("a", State.RUNNING, State.STOPPING, desired_state=State.EXPIRED)
    with pytest.raises(Conflict) as info:  # a want that lost the race with a delete
        store.update("a", desired_state=State.RUNNING)
    assert info.value.context["state"] == "stopping"
    assert store.get("a").desired_state == State.EXPIRED  # type: ignore[union-attr]
    for s in State:
        assert lifecycle.DESIRED[s], f"{s} may want nothing"


def test_the_machines_pass_reads_every_machine_in_two_queries(store: Store) -> None:
    """``MachineManager.reconcile`` reads every second: one query for all machines' sandbox
    states (a query per machine took 17 % of a core with 300 asleep), and one that returns
    only a user's sandboxes that no machine record names (normally none)."""
    from hangar.core.store import MachineRecord

    store.add(record("sb-000000000001", State.SLEEPING, user_id="ann"),
              record("sb-000000000002", State.DELETED, user_id="bob"),
              record("sb-000000000003", State.RUNNING, user_id="cy"),
              record("sb-000000000004", State.RUNNING),
              record("sb-000000000005", State.CREATING, user_id="dee"))
    store.add(*(MachineRecord(user_id=u, sandbox_id=s, idle_timeout_s=60.0, created_at=1.0)
                for u, s in (("ann", "sb-000000000001"), ("bob", "sb-000000000002"),
                             ("eve", "sb-00000000000f"))))
    assert store.machine_sandboxes() == {"ann": ("sb-000000000001", State.SLEEPING),
                                         "bob": ("sb-000000000002", State.DELETED),
                                         "eve": ("sb-00000000000f", None)}
    live = lifecycle.LIVE - {State.CREATING}
    assert [r.id for r in store.unowned_user_sandboxes(live)] == ["sb-000000000003"]
    # A damaged state leaves its machine out, the others are still read.
    con = sqlite3.connect(store.engine.url.database or "")
    con.execute("UPDATE sandboxes SET state = 'dancing' WHERE id = 'sb-000000000001'")
    con.commit()
    con.close()
    assert store.machine_sandboxes() == {"bob": ("sb-000000000002", State.DELETED),
                                         "eve": ("sb-00000000000f", None)}
