"""Online backups of Hangar's SQLite store (``<data>/hangar.db``).

``backup_database`` copies the database with SQLite's online backup API
(``sqlite3.Connection.backup``, https://www.sqlite.org/backup.html) while
the server runs: it reads one consistent snapshot of the database, WAL
included, without stopping writers (the store runs in WAL mode). The copy
is written to a temporary file, switched to rollback-journal mode so that it
is one self-contained file, checked with ``PRAGMA integrity_check``, synced
and only then linked into place (mode 0600).

Root runs it over a split server's data directory, whose names the server
may swap for symlinks or FIFOs at any moment, so root acts only on what it
opened itself (``hangar.privileged.beneath``), and SQLite never opens a name
there: the database and its WAL (``hangar.db-wal``) are opened without
following a symlink, checked to be regular files of the folder's owner with
no other link, and their bytes copied into a folder of root's own; SQLite
reads that copy (replaying the WAL's committed transactions, as it does
after a crash: a checkpoint that ran during the copy only wrote pages the
WAL still holds). A WAL whose header changed during the copy was begun
again by the server (its old frames reused), so the copy is made again, up
to ``COPY_TRIES`` times. The backup is made in memory and written through a
descriptor of the destination folder (a new file, never through a name the
server put there; the folder itself is opened without following a symlink
the server put on the way).

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
import sqlite3
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from hangar.errors import InvalidRequest, NotFound
from hangar.privileged import beneath

BACKUP_GLOB = "hangar-*.db"
COPY_TRIES = 5
"""Copies of the database and its WAL made before a backup gives up on a server that began
a new WAL during each (``_copy_live``)."""
WAL_HEADER = 32
"""Bytes of a WAL's header (https://www.sqlite.org/fileformat.html#the_write_ahead_log):
its salts change whenever the WAL is begun again."""
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
    try:
        db_fd = _open_database(database)
    except FileNotFoundError:
        raise NotFound(f"no database at {database}; is HANGAR_DATA_DIR right?") from None
    except OSError as exc:
        raise InvalidRequest(f"{database} is not the server's database: {exc}") from None
    try:
        if dest.is_dir():  # only decides the name: what is written is checked below
            dest = dest / default_name()
        dest.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            folder = beneath.open_trusted(dest.parent)
        except OSError as exc:
            raise InvalidRequest(f"cannot write into {dest.parent}: {exc}") from None
        try:
            return _backup(database, db_fd, folder, dest)
        finally:
            os.close(folder)
    finally:
        os.close(db_fd)


def _open_database(database: Path) -> int:
    """The database file, opened without following a symlink (its folder opened from
    ``/`` as ``beneath.open_trusted`` does), checked to be a regular file of the folder's
    owner with no other link. Raises OSError."""
    fd = _open_beside(database, database.name, None)
    assert fd is not None
    return fd


def _open_wal(database: Path, uid: int) -> int | None:
    """The database's WAL, opened as ``_open_database`` opens the database and checked
    the same way (a regular file of ``uid`` with no other link); None when there is none.
    Raises OSError."""
    try:
        return _open_beside(database, database.name + "-wal", uid)
    except FileNotFoundError:
        return None


def _open_beside(database: Path, name: str, uid: int | None) -> int:
    """``name`` in the database's folder, opened without following a symlink and checked:
    a regular file of ``uid`` (None: the folder's owner) with no other link. Raises
    OSError (FileNotFoundError when there is none)."""
    up = beneath.open_trusted(database.parent)
    try:
        fd = beneath.walk(up, name)
        try:
            beneath.expect(fd, uids=(os.fstat(up).st_uid if uid is None else uid,),
                           single=True)
        except OSError:
            os.close(fd)
            raise
        return fd
    finally:
        os.close(up)


def _copy(src: int, folder: int, name: str) -> None:
    """The bytes of the open file ``src`` into a new file ``name`` of ``folder``."""
    out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | beneath.FILE_FLAGS, 0o600,
                  dir_fd=folder)
    try:
        at = 0
        while chunk := os.pread(src, 1 << 20, at):
            view = memoryview(chunk)
            while view:
                view = view[os.write(out, view):]
            at += len(chunk)
    finally:
        os.close(out)


def _copy_live(database: Path, db_fd: int, into: Path) -> Path:
    """The database and its WAL, copied through their descriptors into the folder ``into``
    (root's own); returns the copy of the database, for SQLite to open. Raises OSError,
    InvalidRequest (the server began a new WAL during each of ``COPY_TRIES`` copies)."""
    owner = os.fstat(db_fd).st_uid
    folder = beneath.open_trusted(into)
    try:
        for _ in range(COPY_TRIES):
            for name in os.listdir(folder):
                os.unlink(name, dir_fd=folder)
            wal = _open_wal(database, owner)
            try:
                before = os.pread(wal, WAL_HEADER, 0) if wal is not None else b""
                _copy(db_fd, folder, "hangar.db")
                if wal is not None:
                    _copy(wal, folder, "hangar.db-wal")
                    if os.pread(wal, WAL_HEADER, 0) != before:
                        continue
            finally:
                if wal is not None:
                    os.close(wal)
            return into / "hangar.db"
    finally:
        os.close(folder)
    raise InvalidRequest(f"{database}'s WAL was begun again during each of {COPY_TRIES} "
                         "copies; try again")


def _backup(database: Path, db_fd: int, folder: int, dest: Path) -> BackupReport:
    try:
        os.stat(dest.name, dir_fd=folder, follow_symlinks=False)
    except FileNotFoundError:
        pass
    else:
        raise InvalidRequest(f"{dest} exists already; give a new name")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hangar-backup-") as private:
        return _backup_copy(database, db_fd, folder, dest, Path(private), t0)


def _backup_copy(database: Path, db_fd: int, folder: int, dest: Path, private: Path,
                 t0: float) -> BackupReport:
    try:
        copy = _copy_live(database, db_fd, private)
    except OSError as exc:
        raise InvalidRequest(f"cannot copy {database}: {exc}") from None
    try:
        src = sqlite3.connect(f"file:{copy}?mode=rw", uri=True, timeout=30)
        dst = sqlite3.connect(":memory:")
        try:
            with dst:
                src.backup(dst)
            _scrub(dst)
            check = dst.execute("PRAGMA integrity_check").fetchone()[0]
            if check != "ok":
                raise InvalidRequest(f"the copy of {database} fails SQLite's integrity check: "
                                     f"{check}")
            tables = [r[0] for r in dst.execute(
                "SELECT name FROM sqlite_master WHERE type='table' AND name NOT LIKE 'sqlite_%' "
                "ORDER BY name")]
            rows = {t: dst.execute(f'SELECT count(*) FROM "{t}"').fetchone()[0] for t in tables}
            image = bytearray(dst.serialize())
        finally:
            dst.close()
            src.close()
    except sqlite3.Error as exc:
        raise InvalidRequest(f"cannot back up {database}: {exc}") from None
    if len(image) >= 20:
        image[18:20] = b"\x01\x01"  # one self-contained file (rollback journal, not WAL)
    tmp = f".{dest.name}.{os.getpid()}.part"
    try:
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | beneath.FILE_FLAGS, 0o600,
                      dir_fd=folder)
        try:
            os.set_blocking(out, True)
            view = memoryview(image)
            while view:
                view = view[os.write(out, view):]
            os.fsync(out)
        finally:
            os.close(out)
        try:
            os.link(tmp, dest.name, src_dir_fd=folder, dst_dir_fd=folder,
                    follow_symlinks=False)
        except FileExistsError:
            raise InvalidRequest(f"{dest} exists already; give a new name") from None
        os.fsync(folder)
    finally:
        try:
            os.unlink(tmp, dir_fd=folder)
        except OSError:
            pass
    size = os.stat(dest.name, dir_fd=folder, follow_symlinks=False).st_size
    return BackupReport(dest, size, time.monotonic() - t0, rows)


def prune(folder: Path, keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest ``hangar-*.db`` in ``folder`` (and their volumes'
    ``.volumes`` folders); returns the deleted."""
    if keep < 1:
        raise InvalidRequest("keep at least one backup")
    fd = beneath.open_trusted(folder)  # root acts only on what it opened itself
    try:
        names = sorted((n for n in os.listdir(fd) if Path(n).match(BACKUP_GLOB)),
                       reverse=True)[keep:]
        for name in names:
            try:
                os.unlink(name, dir_fd=fd)
            except FileNotFoundError:
                pass
            volumes = Path(name).with_suffix(".volumes").name  # ops.volume_backup
            try:  # never opening a link, FIFO or device put in a folder's place
                beneath.remove_tree(fd, volumes)
            except OSError:
                pass
    finally:
        os.close(fd)
    return [folder / n for n in names]
