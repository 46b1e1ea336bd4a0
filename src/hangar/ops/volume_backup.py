"""``hangar backup``'s copy of named volumes (``hangar.core.volumes``), beside the database's.

After ``backup_database`` wrote ``hangar-<time>.db``, ``backup_volumes`` copies
each volume's image into ``hangar-<time>.volumes/<id>.ext4`` (folder 0700,
files 0600; ``cp --reflink=auto --sparse=always``: shared blocks where the
filesystem can, holes kept). Which volumes exist comes from that database copy,
so the two agree.

A volume that a live sandbox holds read-write is skipped and named in the
report: its guest writes while the file is copied, so no copy of it would be
consistent. Delete (or stop using) that sandbox and back up again; a volume
held only read-only is copied. After each copy the live database is read again,
and a copy made while a writer attached is removed and reported as skipped.
The copies hold what guests wrote: keep the backup folder as private as the
data directory.
"""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from hangar.core.lifecycle import State
from hangar.core.store import Store
from hangar.errors import InvalidRequest
from hangar.layout import Layout
from hangar.privileged import beneath

VOLUME_ID = re.compile(r"vol-[0-9a-f]{12}")
"""A volume id (``hangar.core.volumes.ID``): what names a folder under ``<data>/volumes``."""
NOT_HOLDING = tuple(sorted(s.value for s in set(State) - Store.HOLDING))
"""Sandbox states that hold no volume (deleted, expired, failed: all but ``Store.HOLDING``)."""


@dataclass(frozen=True)
class VolumesReport:
    """``folder``: where the copies are (None: no volumes); ``copied``: volume ids;
    ``skipped``: volume id -> why; ``size_bytes``: bytes the copies hold on disk."""

    folder: Path | None
    copied: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    size_bytes: int = 0


def volumes_folder(db_backup: Path) -> Path:
    """``hangar-<time>.volumes`` beside ``hangar-<time>.db``."""
    return db_backup.with_suffix(".volumes")


def _rows(database: Path) -> tuple[list[str], set[str]]:
    """(volume ids, ids held read-write by a live sandbox) in ``database``."""
    db = sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=30)
    try:
        present = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if "volumes" not in present:
            return [], set()
        ids = [r[0] for r in db.execute("SELECT id FROM volumes ORDER BY created_at")]
        marks = ",".join("?" for _ in NOT_HOLDING)
        writers = {r[0] for r in db.execute(
            "SELECT a.volume_id FROM volume_attachments a JOIN sandboxes s ON s.id = a.sandbox_id "
            f"WHERE NOT a.read_only AND s.state NOT IN ({marks})", NOT_HOLDING)}
        return ids, writers
    finally:
        db.close()


def backup_volumes(layout: Layout, db_backup: Path) -> VolumesReport:
    """Copy the volumes ``db_backup`` (a ``backup_database`` copy) names into
    ``volumes_folder(db_backup)``. Safe while the server runs. Raises InvalidRequest when
    the folder exists or a copy fails."""
    ids, writers = _rows(db_backup)
    if not ids:
        return VolumesReport(None)
    folder = volumes_folder(db_backup)
    # Root acts only on what it opened itself (hangar.privileged.beneath): the folders are
    # opened without following a symlink the server put on the way, each volume's image
    # and each copy through descriptors, cp reading and writing those descriptors.
    up = beneath.open_trusted(folder.parent)
    try:
        try:
            os.mkdir(folder.name, 0o700, dir_fd=up)
        except FileExistsError:
            raise InvalidRequest(f"{folder} exists already; give a new name") from None
        into = beneath.walk(up, folder.name, directory=True)
    finally:
        os.close(up)
    data = beneath.open_trusted(layout.root)
    copied: list[str] = []
    skipped: dict[str, str] = {}
    size = 0
    try:
        for vid in ids:
            if not VOLUME_ID.fullmatch(vid):  # read from the database: checked again
                skipped[str(vid)[:64]] = "not a volume id"
                continue
            if vid in writers:
                skipped[vid] = "a sandbox holds it read-write"
                continue
            try:
                src = beneath.walk(data, f"volumes/{vid}/volume.ext4")
            except FileNotFoundError:
                skipped[vid] = "its image is missing"
                continue
            except OSError as exc:
                skipped[vid] = f"its image is not a regular file ({exc.strerror or exc})"
                continue
            try:
                size += _copy(vid, src, into, layout)
                copied.append(vid)
            except _Skipped as why:
                skipped[vid] = str(why)
            finally:
                os.close(src)
    finally:
        os.close(data)
        os.close(into)
    return VolumesReport(folder, copied, skipped, size)


class _Skipped(Exception):
    """A volume left out of the backup; the message says why."""


def _copy(vid: str, src: int, into: int, layout: Layout) -> int:
    """Copy the open image ``src`` to a new ``<vid>.ext4`` in the folder ``into``; returns
    its bytes on disk. Raises _Skipped, InvalidRequest (cp failed)."""
    name = f"{vid}.ext4"
    dst = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | beneath.FILE_FLAGS, 0o600,
                  dir_fd=into)
    try:
        os.set_blocking(dst, True)
        out = subprocess.run(["cp", "--reflink=auto", "--sparse=always", "--", "/dev/stdin",
                              "/dev/stdout"], stdin=src, stdout=dst, stderr=subprocess.PIPE,
                             text=True)
        if out.returncode != 0:
            raise InvalidRequest(f"copying volume {vid} failed: {out.stderr.strip()[-200:]}")
        if vid in _rows(layout.database)[1]:  # a writer attached while it was copied
            os.unlink(name, dir_fd=into)
            raise _Skipped("a sandbox attached it read-write while it was copied")
        os.fsync(dst)
        return os.fstat(dst).st_blocks * 512
    finally:
        os.close(dst)
