"""Shared snapshots: a node's snapshots in shared storage, for the other nodes.

A sleep snapshot is uploaded before its VMM ends (``Hooks.saved``) and
becomes its record's last snapshot (``status.snapshot``; the one before is
deleted), the one a lost or drained node's sandbox wakes from elsewhere. A
user snapshot is listed under ``/hangar/snapshots/<id>`` so that any node
can fork it: that node downloads it first (``fetch_user``) and records it
through the core (``SandboxManager.handover.receive``). Metadata read from
etcd is untrusted (``shared_snapshot``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hangar.cluster import records as R
from hangar.cluster.directory import Directory
from hangar.cluster.etcd import Etcd
from hangar.cluster.records import BadRecord, SandboxObject
from hangar.cluster.storage import SharedStore
from hangar.core.service import SandboxManager, SandboxView, SharedSnapshot, SnapshotView
from hangar.errors import Conflict, HangarError, NotFound
from hangar.layout import Layout, SnapshotPaths

log = logging.getLogger("hangar.cluster.sharing")

MANIFEST = SnapshotPaths(Path("/")).manifest.name


def shared_snapshot(meta: Any, kind: str, **known: Any) -> SharedSnapshot:
    """A snapshot's metadata in etcd (``status.snapshot``, ``/hangar/snapshots/<id>``) as
    the core's ``SharedSnapshot``; ``known`` fields (``snap_id``, ``sandbox_id``) take
    precedence. Raises ``BadRecord`` when a field is missing or bad."""
    try:
        if not isinstance(meta, dict):
            raise ValueError("not an object")
        meta = {**meta, **{k: v for k, v in (("id", known.get("snap_id")),
                                              ("sandboxId", known.get("sandbox_id"))) if v}}
        R.snapshot_meta(meta)  # ids, names and sizes as patterns and bounds allow
        if meta.get("image") is None or None in (meta.get("vcpus"), meta.get("memoryMiB"),
                                                 meta.get("diskMiB")):
            raise ValueError("image, vcpus, memoryMiB or diskMiB missing")
        return SharedSnapshot(
            id=str(meta["id"]), sandbox_id=str(meta.get("sandboxId") or ""), kind=kind,
            size_bytes=int(meta.get("sizeBytes", 0)),
            created_at=float(meta.get("createdAt") or time.time()), image=str(meta["image"]),
            image_digest=str(meta.get("imageDigest") or ""), vcpus=int(meta["vcpus"]),
            memory_mib=int(meta["memoryMiB"]), disk_mib=int(meta["diskMiB"]),
            desktop=meta.get("desktop"), network=meta.get("network"),
            memory=False if meta.get("memory") is False else None,
            team=meta.get("team") or known.get("team"))
    except BadRecord:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise BadRecord(f"unreadable snapshot metadata: {exc}") from None


def template_meta(t: Any) -> dict[str, Any]:
    """The shape fields of a sleep snapshot, from its sandbox's template (the record's
    ``status.snapshot`` holds only id, size and time)."""
    return {"image": t.image, "imageDigest": t.image_digest, "vcpus": t.vcpus,
            "memoryMiB": t.memory_mib, "diskMiB": t.disk_mib, "desktop": t.desktop,
            "network": t.network}


class Sharing:
    """Uploads, lists, downloads and deletes one node's shared snapshots."""

    def __init__(self, store: SharedStore, layout: Layout, etcd: Etcd, directory: Directory,
                 name: str, owns: Callable[[SandboxObject | None], bool]) -> None:
        self.store = store
        self.layout = layout
        self.etcd = etcd
        self.directory = directory
        self.name = name
        self.owns = owns

    async def share(self, rec: SandboxView, snap: SnapshotView) -> None:
        """Upload a finished snapshot; a sleep snapshot becomes the record's last snapshot
        (the one before is deleted), a user snapshot is listed for forks on any node."""
        started = time.monotonic()
        size = await self.store.upload_dir(f"snapshots/{snap.id}",
                                           self.layout.snapshot(snap.id), MANIFEST)
        meta = {"id": snap.id, "sizeBytes": size, "createdAt": snap.created_at,
                "kind": snap.kind, "node": self.name, "sandboxId": rec.id,
                "image": snap.image, "imageDigest": snap.image_digest, "vcpus": snap.vcpus,
                "memoryMiB": snap.memory_mib, "diskMiB": snap.disk_mib,
                "desktop": snap.desktop, "network": snap.network,
                "engine": rec.engine, "accel": rec.accel,
                **({"memory": False} if snap.memory is False else {}),
                **({"team": snap.team} if snap.team else {})}
        if snap.kind == "user":
            await self.etcd.put(R.snapshot_key(snap.id), meta)
        else:
            old: dict[str, Any] = {}

            def point(d: SandboxObject) -> bool:
                if not self.owns(d):
                    return False
                old.update(d.snapshot or {})
                d.status["snapshot"] = meta
                return True

            if await self.directory.update(rec.id, point) is None:
                await self.drop(snap.id)
                raise Conflict(f"sandbox {rec.id} is no longer this node's", sandbox_id=rec.id)
            if old.get("id") and old["id"] != snap.id:
                await self.drop(old["id"])
        log.info("snapshot shared", extra={"snapshot_id": snap.id, "size_bytes": size,
                                           "duration_s": round(time.monotonic() - started, 3)})

    async def drop(self, snap_id: str) -> None:
        """Delete a snapshot's files from shared storage; a failure is logged, not raised."""
        try:
            await self.store.delete_prefix(f"snapshots/{snap_id}")
        except HangarError as exc:
            log.warning("shared snapshot not deleted", extra={"snapshot_id": snap_id,
                                                              "error": exc.message})

    async def fetch(self, snap_id: str) -> int:
        dest = self.layout.snapshot(snap_id)
        if SnapshotPaths(dest).manifest.exists():
            return 0
        started = time.monotonic()
        size = await self.store.download_dir(f"snapshots/{snap_id}", dest, MANIFEST)
        log.info("snapshot downloaded", extra={"snapshot_id": snap_id, "size_bytes": size,
                                               "duration_s": round(time.monotonic() - started, 3)})
        return size

    async def fetch_user(self, manager: SandboxManager, snap_id: str) -> None:
        """Download a user snapshot made on another node and record it here (a fork).
        Raises NotFound, Conflict (its metadata is unreadable), StorageError."""
        m = manager
        if m.has_snapshot(snap_id):
            return
        meta = self.directory.snapshots.get(snap_id)
        if meta is None:
            if not R.SNAPSHOT_ID.fullmatch(snap_id):
                raise NotFound(f"no snapshot {snap_id}", snapshot_id=snap_id)
            kv = await self.etcd.get(R.snapshot_key(snap_id))
            if kv is None:
                raise NotFound(f"no snapshot {snap_id}", snapshot_id=snap_id)
            meta = kv.value
        try:
            if isinstance(meta, bytes):
                meta = R.snapshot_meta(R.load_json(meta), snap_id)
            snap = shared_snapshot(meta, "user", snap_id=snap_id)
        except BadRecord as exc:
            raise Conflict(f"snapshot {snap_id}'s cluster record is unreadable: {exc}",
                           snapshot_id=snap_id) from None
        await self.fetch(snap_id)
        m.receive_snapshot(snap)
