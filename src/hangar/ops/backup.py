"""Online backups of Hangar's SQLite store (``<data>/hangar.db``).

``backup_database`` copies the database with SQLite's online backup API
(``sqlite3.Connection.backup``, https://www.sqlite.org/backup.html) while
the server runs: it reads one consistent snapshot of the database, WAL
included, without stopping writers (the store runs in WAL mode). The copy
is written to a temporary file, switched to rollback-journal mode so that it
is one self-contained file, checked with ``PRAGMA integrity_check``, synced
and only then renamed into place (mode 0600).

The store holds the records of sandboxes, snapshots and machines: what
a restarted server reads to adopt running VMs. The copy leaves out the
stored answers of idempotent POSTs (``NOT_BACKED_UP``): they may hold
secrets (a port's signed URL, a sandbox's access token) and are worth
nothing after a restore. It does not hold the API
key, snapshot files or images; named volumes are copied beside it by
``hangar.ops.volume_backup``. docs/operations.md says what else to keep
and how to restore.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path

from hangar import durable
from hangar.errors import InvalidRequest, NotFound

BACKUP_GLOB = "hangar-*.db"
NOT_BACKED_UP = ("idempotency_keys",)
"""Tables emptied in the copy: stored answers of idempotent POSTs (24 h; they may hold a
port's signed URL or a sandbox's access token, sealed with the caller's key, and a
restored server has no use for them)."""


def _scrub(db: sqlite3.Connection) -> None:
    """Empty ``NOT_BACKED_UP`` in a copy, leaving none of their bytes in free pages
    (``secure_delete`` overwrites them, ``VACUUM`` drops the pages)."""
    present = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    db.execute("PRAGMA secure_delete=ON")
    with db:
        for table in NOT_BACKED_UP:
            if table in present:
                db.execute(f'DELETE FROM "{table}"')
    db.execute("VACUUM")


@dataclass(frozen=True)
class BackupReport:
    """One backup: ``path``, ``size_bytes``, ``duration_s``, rows per table."""

    path: Path
    size_bytes: int
    duration_s: float
    rows: dict[str, int] = field(default_factory=dict)


def default_name(now: float | None = None) -> str:
    """``hangar-YYYYmmddTHHMMSSZ.db`` (UTC), which sorts by time."""
    return time.strftime("hangar-%Y%m%dT%H%M%SZ.db", time.gmtime(now))


def backup_database(database: Path, dest: Path) -> BackupReport:
    """Copy ``database`` into ``dest`` (a file, or a directory for ``default_name``).

    Safe while the server runs. Raises NotFound when ``database`` does not
    exist, InvalidRequest when ``dest`` exists already or the copy fails its
    integrity check. Never leaves a partial file at ``dest``.
    """
    if not database.is_file():
        raise NotFound(f"no database at {database}; is HANGAR_DATA_DIR right?")
    if dest.is_dir():
        dest = dest / default_name()
    if dest.exists():
        raise InvalidRequest(f"{dest} exists already; give a new name")
    dest.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.part")
    tmp.unlink(missing_ok=True)
    t0 = time.monotonic()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.close(fd)
    try:
        src = sqlite3.connect(f"file:{database}?mode=rw", uri=True, timeout=30)
        dst = sqlite3.connect(tmp)
        try:
            with dst:
                src.backup(dst)
            dst.execute("PRAGMA journal_mode=DELETE")
            _scrub(dst)
            check = dst.execute("PRAGMA integrity_check").fetchone()[0]
            if check != "ok":
                raise InvalidRequest(f"the copy of {database} fails SQLite's integrity check: "
                                     f"{check}")
            tables = [r[0] for r in dst.execute(
                "SELECT name FROM sqlite_master WHERE type='table' AND name NOT LIKE 'sqlite_%' "
                "ORDER BY name")]
            rows = {t: dst.execute(f'SELECT count(*) FROM "{t}"').fetchone()[0] for t in tables}
        finally:
            dst.close()
            src.close()
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        durable.replace(tmp, dest)
    except sqlite3.Error as exc:
        raise InvalidRequest(f"cannot back up {database}: {exc}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return BackupReport(dest, dest.stat().st_size, time.monotonic() - t0, rows)


def prune(folder: Path, keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest ``hangar-*.db`` in ``folder`` (and their volumes'
    ``.volumes`` folders); returns the deleted."""
    if keep < 1:
        raise InvalidRequest("keep at least one backup")
    olds = sorted(folder.glob(BACKUP_GLOB), reverse=True)[keep:]
    for p in olds:
        p.unlink(missing_ok=True)
        shutil.rmtree(p.with_suffix(".volumes"), ignore_errors=True)  # ops.volume_backup
    return olds
