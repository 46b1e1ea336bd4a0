"""Core's lifecycle verbs without VMs: settled waits on the store's change notice, connect
extends a running sandbox's clock, extend never shortens, the clock across a pause, the one
table of public names, and E2B's auto-pause of an older data directory migrated in place.

A real SQLite store in a temporary folder; the ``Sleeper`` gets only what these verbs
read (the store and ``record``). Waking and sleeping real VMs: tests/test_e2b_api.py.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from hangar.core.lifecycle import (
    PUBLIC, Face, OnExpiry, State, from_public, public_name, restarted_clock, stopped_clock,
)
from hangar.core.sleep import Connect, Sleeper
from hangar.core.store import SandboxRecord, Store
from hangar.errors import Busy, Conflict, NotFound
from test_lifecycle import record  # the one record maker of the lifecycle tests


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "hangar.db")


def sleeper(store: Store) -> Sleeper:
    def get(sid: str) -> SandboxRecord:
        rec = store.get(sid)
        if rec is None:
            raise NotFound(f"no sandbox {sid}", sandbox_id=sid)
        return rec

    ctx = SimpleNamespace(store=store, record=get)
    return Sleeper(ctx, None, None, None, None)  # type: ignore[arg-type]


# -- settled ------------------------------------------------------------------------------

def test_settled_returns_on_the_move_it_waited_for_not_on_a_poll(store: Store) -> None:
    store.add(record("sb-000000000001", State.SNAPSHOTTING, desired_state=State.SLEEPING))
    s = sleeper(store)

    async def main() -> tuple[SandboxRecord, float]:
        waiting = asyncio.create_task(s.settled("sb-000000000001", timeout_s=60))
        await asyncio.sleep(0.2)
        assert not waiting.done()  # snapshotting: between two states
        moved = time.monotonic()
        # the move comes from another thread, as a store write in a worker would
        await asyncio.to_thread(store.transition, "sb-000000000001", State.SNAPSHOTTING,
                                State.SLEEPING)
        rec = await asyncio.wait_for(waiting, 5)
        return rec, time.monotonic() - moved

    rec, took = asyncio.run(main())
    assert rec.state == State.SLEEPING
    assert took < 2.0  # woken by the move, far inside its 60 s


def test_settled_answers_at_once_for_a_stable_state_and_says_busy_after_its_time(
        store: Store) -> None:
    store.add(record("sb-000000000002", State.RUNNING),
              record("sb-000000000003", State.WAKING))
    s = sleeper(store)
    assert asyncio.run(s.settled("sb-000000000002", timeout_s=0)).state == State.RUNNING
    with pytest.raises(Busy, match=r"^sandbox sb-000000000003 is still waking$"):
        asyncio.run(s.settled("sb-000000000003", timeout_s=0.3))
    assert s._waiters == {}  # nothing left behind


def test_settled_hears_a_discarded_create(store: Store) -> None:
    store.add(record("sb-000000000004", State.CREATING))
    s = sleeper(store)

    async def main() -> None:
        waiting = asyncio.create_task(s.settled("sb-000000000004", timeout_s=60))
        await asyncio.sleep(0.2)
        assert store.discard("sb-000000000004", State.CREATING)
        await asyncio.wait_for(waiting, 5)

    with pytest.raises(NotFound, match=r"^no sandbox sb-000000000004$"):
        asyncio.run(main())


# -- connect on a running sandbox, extend -------------------------------------------------

def test_connect_on_a_running_sandbox_extends_its_clock_and_never_shortens_it(
        store: Store) -> None:
    now = time.time()
    store.add(record("sb-000000000005", State.RUNNING, expires_at=now + 100),
              record("sb-000000000006", State.RUNNING, expires_at=None))
    s = sleeper(store)
    done = asyncio.run(s.connect("sb-000000000005", 600))
    assert done.did == Connect.EXTENDED
    assert done.record.expires_at == pytest.approx(time.time() + 600, abs=5)
    again = asyncio.run(s.connect("sb-000000000005", 30))
    assert (again.did, again.record.expires_at) == (Connect.EXTENDED, done.record.expires_at)
    unlimited = asyncio.run(s.connect("sb-000000000006", 600))
    assert (unlimited.did, unlimited.record.expires_at) == (Connect.EXTENDED, None)


def test_connect_to_a_failed_sandbox_is_a_conflict(store: Store) -> None:
    store.add(record("sb-000000000007", State.FAILED))
    with pytest.raises(Conflict, match=r"^sandbox sb-000000000007 is failed$"):
        asyncio.run(sleeper(store).connect("sb-000000000007", 60))


def test_extend_is_a_compare_and_set_on_the_state(store: Store) -> None:
    store.add(record("sb-000000000008", State.SLEEPING, expires_at=time.time() + 10))
    with pytest.raises(Conflict, match=r"^sandbox sb-000000000008 is sleeping$"):
        store.extend("sb-000000000008", time.time() + 600, {State.RUNNING})
    assert store.get("sb-000000000008").expires_at < time.time() + 11
    with pytest.raises(NotFound):
        store.extend("sb-000000000009", time.time() + 600)


# -- the clock across a pause ---------------------------------------------------------------

def test_a_pause_stops_the_clock_and_a_wake_restarts_it() -> None:
    armed = record("sb-00000000000a", State.SNAPSHOTTING, expires_at=5.0, wake_ttl_s=300.0)
    plain = record("sb-00000000000b", State.SNAPSHOTTING, expires_at=5.0)
    assert (stopped_clock(armed), stopped_clock(plain)) == ({"expires_at": None}, {})
    asleep = record("sb-00000000000a", State.WAKING, expires_at=None, wake_ttl_s=300.0)
    assert restarted_clock(asleep, None, 1000.0) == {"expires_at": 1300.0, "wake_ttl_s": None}
    assert restarted_clock(asleep, 60, 1000.0) == {"expires_at": 1060.0, "wake_ttl_s": None}
    assert restarted_clock(asleep, 0, 1000.0) == {"expires_at": None, "wake_ttl_s": None}
    limited = record("sb-00000000000a", State.WAKING, expires_at=2000.0, wake_ttl_s=300.0)
    assert restarted_clock(limited, None, 1000.0) == {"wake_ttl_s": None}
    assert restarted_clock(plain, None, 1000.0) == {}


# -- public names -----------------------------------------------------------------------------

def test_one_table_names_every_state_for_every_face() -> None:
    assert set(PUBLIC) == set(State)
    assert all(public_name(s, Face.NATIVE) == s.value for s in State)
    assert public_name(State.RUNNING, Face.MACHINE) == "active"
    assert {public_name(s, Face.E2B) for s in State} == {"running", "paused", None}
    assert public_name(State.SNAPSHOTTING, Face.E2B, State.SLEEPING) == "paused"
    assert public_name(State.SNAPSHOTTING, Face.E2B, State.RUNNING) == "running"
    assert public_name(State.FAILED, Face.E2B) is None
    assert [from_public(n, Face.CLUSTER) for n in ("Running", "Suspended")] == [
        State.RUNNING, State.SLEEPING]
    with pytest.raises(ValueError, match="'Paused' is no cluster state name"):
        from_public("Paused", Face.CLUSTER)


# -- E2B's auto-pause of an older data directory ----------------------------------------------

def test_e2bs_lifecycle_in_an_older_database_moves_to_the_generic_columns(
        tmp_path: Path) -> None:
    db = tmp_path / "hangar.db"
    Store(db).engine.dispose()
    con = sqlite3.connect(db)
    rows = (
        ("sb-00000000000c", "sleeping", None, {"template": "base", "on_timeout": "pause",
                                               "auto_resume": True, "timeout_s": 300,
                                               "wake_ttl_s": 300, "envs": {"A": "1"}}),
        ("sb-00000000000d", "running", None, {"template": "base", "on_timeout": "pause",
                                              "timeout_s": 300, "wake_ttl_s": 120}),
        ("sb-00000000000e", "running", 99.0, {"template": "base", "on_timeout": "kill",
                                              "timeout_s": 60, "wake_ttl_s": 0}),
    )
    for sid, state, expires, e2b in rows:
        con.execute("INSERT INTO sandboxes (id, state, desired_state, image, image_digest, "
                    "engine, accel, vcpus, memory_mib, disk_mib, created_at, updated_at, "
                    "last_active_at, expires_at, metadata, e2b) VALUES (?, ?, 'running', "
                    "'base', '', 'qemu', '', 1, 256, 2048, 1, 1, 1, ?, '{}', ?)",
                    (sid, state, expires, json.dumps(e2b)))
    con.commit()
    con.close()
    store = Store(db)
    paused, woken, killed = (store.get(r[0]) for r in rows)
    assert (paused.on_expiry, paused.auto_resume, paused.ttl_s, paused.wake_ttl_s,
            paused.expires_at, paused.e2b) == (
        OnExpiry.SLEEP, True, 300.0, 300.0, None, {"template": "base", "envs": {"A": "1"}})
    # woken before an older server restarted its clock: it runs again now
    assert (woken.on_expiry, woken.wake_ttl_s) == (OnExpiry.SLEEP, None)
    assert woken.expires_at == pytest.approx(time.time() + 120, abs=10)
    assert (killed.on_expiry, killed.ttl_s, killed.wake_ttl_s, killed.expires_at,
            killed.e2b) == (OnExpiry.DELETE, 60.0, None, 99.0, {"template": "base"})
    Store(db)  # once: a second start changes nothing
    assert store.get("sb-00000000000c").e2b == {"template": "base", "envs": {"A": "1"}}


def test_views_carry_every_column_of_their_records() -> None:
    """A view is the record as read (``SandboxView.of`` copies the fields it names): a
    column the view lacks is silently lost outside core (the lifecycle columns once were)."""
    import dataclasses

    from hangar.core.store import SnapshotRecord
    from hangar.core.views import SandboxView, SnapshotView

    for view, row in ((SandboxView, SandboxRecord), (SnapshotView, SnapshotRecord)):
        columns = {c.key for c in row.__mapper__.column_attrs}
        assert {f.name for f in dataclasses.fields(view)} == columns, view.__name__
