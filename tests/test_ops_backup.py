"""``hangar backup``: an online copy of the store that a restored server adopts from.

A server runs two sandboxes while its records change (TTL updates) and
``hangar backup`` copies the database. Then the disaster: the server stops
(its VMs keep running) and its database is lost. Restored as
docs/operations.md says, the next server lists both sandboxes and runs
commands in the very VMs that ran before.
"""

from __future__ import annotations

import shutil
import sqlite3
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from conftest import Server, cleanup, make_data_dir, vmm_pids
from ops_support import fixed_port, hangar_cli

vm = pytest.mark.vm


@pytest.fixture
def own_server(base_image: Path) -> Iterator[Server]:
    d = make_data_dir(base_image)
    srv = Server(d, fixed_port())  # restarted on the same port
    srv.start()
    try:
        yield srv
    finally:
        leaked = cleanup(srv)
        shutil.rmtree(d, ignore_errors=True)
        assert not leaked, f"VMM processes outlived the test: {leaked}"


def boot_id(c: httpx.Client, sid: str) -> str:
    r = c.post(f"/sandboxes/{sid}/exec", json={"command": "cat /proc/sys/kernel/random/boot_id"})
    assert r.status_code == 200, r.text
    return r.json()["stdout"]


@vm
def test_backup_while_running_restores_into_a_server_that_lists_them(
        own_server: Server, tmp_path: Path) -> None:
    srv = own_server
    with srv.client() as c, ThreadPoolExecutor(2) as pool:
        made = list(pool.map(lambda _: c.post("/sandboxes", json={}), range(2)))
        assert all(r.status_code == 201 for r in made), [r.text for r in made]
        ids = sorted(r.json()["id"] for r in made)
        boots = {sid: boot_id(c, sid) for sid in ids}

        # Back up while the server keeps writing records (each TTL change is an UPDATE).
        stop = threading.Event()

        def churn() -> None:
            with srv.client() as c2:
                while not stop.is_set():
                    for sid in ids:
                        c2.post(f"/sandboxes/{sid}/timeout", json={"timeout": 3600})

        writer = threading.Thread(target=churn)
        writer.start()
        try:
            out = hangar_cli("backup", str(tmp_path), "--data-dir", str(srv.data_dir)).stdout
        finally:
            stop.set()
            writer.join()
    backup = next(tmp_path.glob("hangar-*.db"))
    assert str(backup) in out and "2 sandboxes" in out, out
    assert backup.stat().st_mode & 0o777 == 0o600
    with sqlite3.connect(backup) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
        assert sorted(r[0] for r in db.execute("SELECT id FROM sandboxes")) == ids
    assert not list(tmp_path.glob(".*.part"))

    # The disaster: the server stops (VMs keep running) and the database is lost.
    vmms = {sid: vmm_pids(f"hangar-{sid}") for sid in ids}
    srv.kill()
    for suffix in ("", "-wal", "-shm"):
        (srv.data_dir / f"hangar.db{suffix}").unlink(missing_ok=True)
    # The restore of docs/operations.md: the copy back in place, before the server starts.
    shutil.copy(backup, srv.data_dir / "hangar.db")
    (srv.data_dir / "hangar.db").chmod(0o600)
    srv.start()
    with srv.client() as c:
        listed = {s["id"]: s["state"] for s in c.get("/sandboxes").json()["sandboxes"]}
        assert listed == {sid: "running" for sid in ids}
        for sid in ids:
            assert boot_id(c, sid) == boots[sid]  # the same VM, adopted
            assert vmm_pids(f"hangar-{sid}") == vmms[sid]


def test_backup_refuses_what_it_cannot_do(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    r = hangar_cli("backup", str(tmp_path / "x.db"), "--data-dir", str(empty), check=False)
    assert r.returncode == 1 and "no database" in r.stderr
    assert not (tmp_path / "x.db").exists()

    data = tmp_path / "data"
    data.mkdir()
    with sqlite3.connect(data / "hangar.db") as db:
        db.execute("CREATE TABLE sandboxes (id TEXT)")
        db.execute("INSERT INTO sandboxes VALUES ('sb-1')")
    dest = tmp_path / "b.db"
    hangar_cli("backup", str(dest), "--data-dir", str(data))
    r = hangar_cli("backup", str(dest), "--data-dir", str(data), check=False)
    assert r.returncode == 1 and "exists already" in r.stderr

    # Default folder <data>/backups (0700), pruned to --keep by name (= by time).
    backups = data / "backups"
    for old in ("hangar-20000101T000000Z.db", "hangar-20000102T000000Z.db"):
        hangar_cli("backup", str(backups / old), "--data-dir", str(data))
    out = hangar_cli("backup", "--data-dir", str(data), "--keep", "2").stdout
    assert "1 sandboxes" in out and "removed" in out
    kept = sorted(p.name for p in backups.glob("hangar-*.db"))
    assert len(kept) == 2 and kept[0] == "hangar-20000102T000000Z.db", kept
    assert backups.stat().st_mode & 0o777 == 0o700


def test_backup_holds_what_only_the_wal_holds(tmp_path: Path) -> None:
    """The backup reads a copy of the database and its WAL (SQLite never opens the server's
    own names): transactions committed to the WAL and not yet checkpointed into the
    database are in it, and the live database is left as it was."""
    from hangar.ops.backup import backup_database

    data = tmp_path / "data"
    data.mkdir()
    live = sqlite3.connect(data / "hangar.db")
    assert live.execute("PRAGMA journal_mode=WAL").fetchone()[0] == "wal"
    live.execute("PRAGMA wal_autocheckpoint=0")  # every later commit stays in the WAL
    live.execute("CREATE TABLE sandboxes (id TEXT)")
    live.commit()
    live.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    live.executemany("INSERT INTO sandboxes VALUES (?)", [(f"sb-{i}",) for i in range(50)])
    live.commit()
    assert (data / "hangar.db-wal").stat().st_size > 0
    try:
        report = backup_database(data / "hangar.db", tmp_path / "b.db")
        assert report.rows == {"sandboxes": 50}
        with sqlite3.connect(tmp_path / "b.db") as copy:
            assert copy.execute("SELECT count(*) FROM sandboxes").fetchone()[0] == 50
        assert live.execute("SELECT count(*) FROM sandboxes").fetchone()[0] == 50
    finally:
        live.close()
