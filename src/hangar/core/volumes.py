"""Named volumes: ext4 images that outlive sandboxes, attached to them at create.

A volume (``VolumeRecord``; id ``vol-<12 hex>``, a unique name, a size in
MiB) is one sparse ext4 image, ``<data>/volumes/<id>/volume.ext4``
(``hangar.images.volfs`` makes, grows and reads it without the host
kernel ever mounting it). A create names volumes by guest path::

    {"/data": "vol-0123456789ab"}                            one writer
    {"/ref": {"volume": "models", "read_only": true}}        read-only, many readers

and the sandbox holds each (``VolumeAttachmentRecord``) from its record's
first write until it is deleted, expires or fails (``Store.volume_holders``).
The rules, checked in the same event-loop step that writes the record (no
await between, so two creates cannot both win):

- a writer needs the volume held by nobody; a reader needs it held by no
  writer; otherwise 409 (``Conflict``), naming the holder;
- at most ``MAX_PER_SANDBOX`` volumes per sandbox, each once; guest paths
  absolute, normalised, without ``..`` and outside the guest's system
  folders (``check_mount_path``); a volume being resized or deleted is busy.

The engine attaches each as an extra raw virtio-blk drive, last of the
VM's devices (``hangar.engines.base.VolumeDrive``; QEMU only). A sandbox
with volumes is booted, never restored from its image's template snapshot
or taken from the warm pool: a snapshot's devices hold no volume drive, and
microvm's virtio-mmio drives cannot be hot-plugged into a running guest. The
guest mounts them through an agent exec at boot (``mount_meta``), before a
template's start command.

Volumes are left out of snapshots: a sandbox holding volumes cannot be
snapshotted, put to sleep or restored in place (409; ``refuse_snapshot``).
When it ends, its guest first unmounts (or remounts read-only) each
writable volume so its data reaches the image (``unmount_meta``); after
its VMM is gone, a journal left to replay is replayed on the host
(``e2fsck -E journal_only``), so the files API reads what the guest wrote.

A guest may write anything to its drive, its filesystem's superblock
included. A volume it left damaged is the volume's fault, never the
server's: a create whose guest cannot mount it, a grow, and a read of its
files answer 409 ``volume_corrupt`` (``VolumeCorrupt``) naming the volume
and the repair, ``fsck`` (``e2fsck -f -y`` on the host, confined, while no
sandbox holds it: ``hangar volume fsck NAME``, ``POST /volumes/{id}/fsck``).

A volume made with a team's key is the team's (``hangar.core.teams``): stored
as ``TEAM/name`` (``scoped``), so names are unique per team; the team sees it
as ``name``, the operator as ``TEAM/name``. Another team's volume, by id or
by name, is ``NotFound`` worded as a missing one, left out of lists, and never
mounted. The sizes of a team's volumes together stay within its
``max_volumes_mib`` (``QuotaExceeded``, 429): a create or grow is checked and
its MiB held (``_reserve``) in one step of the event loop, so creates sent at
once cannot pass the quota together.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import time
from pathlib import PurePosixPath
from collections.abc import Awaitable, Callable
from typing import Any

from hangar.core.admission import new_id
from hangar.core.acting import acting
from hangar.core.context import Context
from hangar.core.store import SandboxRecord, VolumeAttachmentRecord, VolumeRecord
from hangar.core.teams import (
    SCOPE_SEP, Teams, name_visible, owner_of, scoped, unscoped,
)
from hangar.engines.agent_client import exec_meta
from hangar.engines.base import VolumeDrive, volume_serial
from hangar.guest import paths
from hangar.schemas.volumes import (MAX_SIZE_MIB, MAX_VOLUMES_PER_SANDBOX, MIN_SIZE_MIB,
                                    VOLUME_NAME)
from hangar.core.views import FsckView
from hangar.errors import (Busy, Conflict, GuestError, HangarError, InvalidRequest, NotFound,
                           QuotaExceeded, VolumeCorrupt)
from hangar.images import volfs
from hangar.teams import NAME as TEAM_NAME

log = logging.getLogger("hangar.volumes")

MAX_PER_SANDBOX = MAX_VOLUMES_PER_SANDBOX
MAX_VOLUMES = 1024
"""Volumes one server keeps at most."""
MAX_READ_BYTES = 16 << 20
"""The largest file ``GET /volumes/{id}/files`` returns, bytes."""
NAME = re.compile(VOLUME_NAME)
ID = re.compile(r"^vol-[0-9a-f]{12}$")
GUEST_PATH = re.compile(r"^(/[A-Za-z0-9._@+-]+)+$")
SYSTEM_DIRS = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib64", "/proc", "/run", "/sbin",
               "/sys", "/usr", "/var", "/tmp")
"""Guest folders a volume may not be mounted on (nor under, for /dev, /proc, /run, /sys
and /usr/lib/hangar, which the guest's own init and agent use)."""
NO_SUBPATHS = ("/dev", "/proc", "/run", "/sys", str(PurePosixPath(paths.PYTHON_DIR).parent))
MOUNT_WAIT_S = 10
"""Seconds the guest waits for a volume's drive to appear at boot."""
UNMOUNT_S = 15
"""Seconds a guest has to unmount its volumes when its sandbox ends."""

MOUNT_SCRIPT = r"""
while [ $# -ge 3 ]; do
  serial=$1; dir=$2; opts=$3; shift 3; dev=; n=0
  while [ -z "$dev" ] && [ $n -le $((WAIT * 10)) ]; do
    for b in /sys/block/vd*; do
      [ "$(cat "$b/serial" 2>/dev/null)" = "$serial" ] && dev=/dev/${b##*/}
    done
    [ -n "$dev" ] || { sleep 0.1; n=$((n + 1)); }
  done
  [ -n "$dev" ] || { echo "no drive with serial $serial" >&2; exit 3; }
  mkdir -p "$dir" && mount -t ext4 -o "$opts" "$dev" "$dir" || exit 4
done
"""
UNMOUNT_SCRIPT = r"""
for dir; do
  umount "$dir" 2>/dev/null || mount -o remount,ro "$dir" 2>/dev/null || sync
done
"""


def check_name(name: str) -> str:
    """A volume's name: 1-63 of ``a-z0-9._-``, starting with a letter or digit, and not
    shaped like an id. Raises InvalidRequest."""
    if not isinstance(name, str) or not NAME.match(name) or ID.match(name):
        raise InvalidRequest("a volume's name is 1-63 characters of A-Z, a-z, 0-9, '.', '_' and "
                             "'-', starting with a letter or digit, and not shaped like an id "
                             "(vol-<12 hex digits>)")
    return name


def check_size(size_mib: Any) -> int:
    """A volume's size in MiB, ``MIN_SIZE_MIB`` to ``MAX_SIZE_MIB``. Raises InvalidRequest."""
    if not isinstance(size_mib, int) or isinstance(size_mib, bool) \
            or not MIN_SIZE_MIB <= size_mib <= MAX_SIZE_MIB:
        raise InvalidRequest(f"a volume's size_mib is a whole number from {MIN_SIZE_MIB} to "
                             f"{MAX_SIZE_MIB}")
    return size_mib


def check_mount_path(path: Any) -> str:
    """A guest mount path: absolute, at most 256 bytes of ``A-Za-z0-9._@+-`` between slashes,
    no ``.`` or ``..`` component, not ``/`` nor a system folder (``SYSTEM_DIRS``, and
    nothing under ``NO_SUBPATHS``). Raises InvalidRequest."""
    if not isinstance(path, str) or len(path) > 256 or not GUEST_PATH.match(path):
        raise InvalidRequest(f"volume mount path {str(path)[:64]!r} must be absolute, at most "
                             "256 characters of A-Z a-z 0-9 . _ @ + - between single slashes")
    if any(part in (".", "..") for part in path.split("/")):
        raise InvalidRequest(f"volume mount path {path!r} must not hold '.' or '..'")
    if path in SYSTEM_DIRS or any(path.startswith(d + "/") for d in NO_SUBPATHS):
        raise InvalidRequest(f"volume mount path {path!r} is a system folder of the guest")
    return path


def parse_request(volumes: Any) -> list[tuple[str, str, bool]]:
    """A create's ``volumes`` as (guest path, volume id or name, read_only), by path.

    Each value is a volume's id or name (read-write) or ``{"volume": ..., "read_only":
    bool}``. Raises InvalidRequest (bad shape, path, too many, nested paths)."""
    if not volumes:
        return []
    if not isinstance(volumes, dict):
        raise InvalidRequest("volumes is an object of guest path -> volume")
    if len(volumes) > MAX_PER_SANDBOX:
        raise InvalidRequest(f"a sandbox attaches at most {MAX_PER_SANDBOX} volumes")
    out = []
    for path, spec in sorted(volumes.items()):
        path = check_mount_path(path)
        if isinstance(spec, str):
            ref, ro = spec, False
        elif isinstance(spec, dict) and set(spec) <= {"volume", "read_only"} \
                and isinstance(spec.get("volume"), str) \
                and isinstance(spec.get("read_only", False), bool):
            ref, ro = spec["volume"], bool(spec.get("read_only", False))
        else:
            raise InvalidRequest(f"volumes[{path!r}] is a volume id or name, or "
                                 '{"volume": ..., "read_only": true|false}')
        out.append((path, ref, ro))
    paths = [p for p, _, _ in out]
    for a in paths:
        if any(b != a and b.startswith(a + "/") for b in paths):
            raise InvalidRequest(f"volume mount paths must not nest ({a!r})")
    return out


def mount_meta(attached: list[VolumeAttachmentRecord]) -> dict[str, Any]:
    """The agent exec that mounts ``attached`` in the guest (each by its drive's serial)."""
    args: list[str] = []
    for a in attached:
        args += [volume_serial(a.index), a.path, "ro,noload" if a.read_only else "rw"]
    return exec_meta(argv=["/bin/sh", "-c", MOUNT_SCRIPT, "mount-volumes", *args],
                     env={"WAIT": str(MOUNT_WAIT_S)}, timeout=MOUNT_WAIT_S + 20)


def unmount_meta(paths: list[str]) -> dict[str, Any]:
    """The agent exec that unmounts (else remounts read-only, else syncs) ``paths``."""
    return exec_meta(argv=["/bin/sh", "-c", UNMOUNT_SCRIPT, "unmount-volumes", *paths],
                     timeout=UNMOUNT_S)


class Volumes:
    """Named volumes: records, images, attachments (see the module docstring)."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self._busy: set[str] = set()
        """Volumes being made, resized, deleted or having their journal replayed."""
        self._held: dict[str, tuple[str | None, int]] = {}
        """MiB a create or grow adds, by volume id, with the volume's team: held from its
        check (``_reserve``) until its record is written, and counted by the caps."""
        self.teams: Teams | None = None
        """Team quotas (``hangar.core.teams``), set by the manager."""

    # -- records -------------------------------------------------------------------

    def list(self) -> list[VolumeRecord]:
        """Every volume the acting team may see, oldest first."""
        return sorted((v for v in self.ctx.store.list(VolumeRecord) if name_visible(v.name)),
                      key=lambda v: v.created_at)

    @staticmethod
    def _stored(ref: str) -> str | None:
        """The stored name ``ref`` stands for: a name the acting team gives (``scoped``),
        or for the operator also a team's whole ``TEAM/name``; None: no volume's name."""
        if NAME.match(ref):
            return scoped(ref)
        team, sep, name = ref.partition(SCOPE_SEP)
        if acting() is None and sep and TEAM_NAME.match(team) and NAME.match(name):
            return ref
        return None

    def get(self, ref: str) -> VolumeRecord:
        """The volume with id or name ``ref`` that the acting team may see. Raises NotFound,
        for another team's volume in the very words of a missing one."""
        store = self.ctx.store
        vol = None
        if isinstance(ref, str) and ID.match(ref):
            vol = store.find(VolumeRecord, ref)
        elif isinstance(ref, str) and (stored := self._stored(ref)) is not None:
            vol = store.volume_by_name(stored)
        if vol is None or not name_visible(vol.name):
            raise NotFound(f"no volume {str(ref)[:64]!r}", volume=str(ref)[:64])
        return vol

    def holders(self, volume_id: str) -> list[VolumeAttachmentRecord]:
        """The attachments that hold ``volume_id`` now (their sandbox lives)."""
        return self.ctx.store.volume_holders(volume_id)

    def image(self, volume_id: str) -> Any:
        return self.ctx.layout.volume(volume_id).image

    async def create(self, name: str, size_mib: int) -> VolumeRecord:
        """Make an empty volume, the acting team's (stored as ``scoped(name)``). Raises
        InvalidRequest (bad name or size, too many volumes, a cluster node), Conflict (the
        name is taken, or past HANGAR_VOLUMES_MAX_TOTAL_MIB), QuotaExceeded (past the
        team's ``max_volumes_mib``), EngineError (mkfs failed)."""
        check_name(name)
        check_size(size_mib)
        if self.ctx.settings.etcd:
            raise InvalidRequest("volumes are kept by one host; a cluster's nodes (HANGAR_ETCD) "
                                 "do not share them yet")
        store = self.ctx.store
        stored = scoped(name)
        if store.volume_by_name(stored) is not None or stored in self._busy:
            raise Conflict(f"a volume named {name!r} exists already", volume=name)
        if len(store.list(VolumeRecord)) >= MAX_VOLUMES:
            raise InvalidRequest(f"this server keeps at most {MAX_VOLUMES} volumes")
        vid = new_id("vol-")
        paths = self.ctx.layout.volume(vid)
        self._reserve(vid, owner_of(stored), size_mib)  # then nothing awaits before try
        self._busy.update((stored, vid))
        try:
            paths.dir.mkdir(mode=0o700, parents=True)
            try:
                await volfs.make(paths.image, size_mib, name)
                os.chmod(paths.image, 0o600)
                now = time.time()
                rec = VolumeRecord(id=vid, name=stored, size_mib=size_mib, created_at=now,
                                   updated_at=now)
                store.add(rec)
            except BaseException:
                shutil.rmtree(paths.dir, ignore_errors=True)
                raise
        finally:
            self._busy.difference_update((stored, vid))
            self._held.pop(vid, None)
        log.info("volume created", extra={"volume_id": vid, "size_mib": size_mib})
        self.ctx.publish("volume.created", None, volume_id=vid, size_mib=size_mib,
                         team=owner_of(stored))
        return rec

    def _reserve(self, volume_id: str, team: str | None, more_mib: int) -> None:
        """Hold ``more_mib`` MiB for ``volume_id`` (of ``team``; None: the operator's) until
        the caller writes its record and drops the hold (``_held``). Checked in the same
        step of the event loop as it is held, so creates or grows sent at once cannot pass
        a cap together. Raises Conflict (past ``HANGAR_VOLUMES_MAX_TOTAL_MIB``),
        QuotaExceeded (past the team's ``max_volumes_mib``)."""
        self._within_cap(more_mib)
        refused = self._quota_refusal(team, more_mib)
        if refused is not None:
            raise refused
        self._held[volume_id] = (team, more_mib)

    def _within_cap(self, more_mib: int) -> None:
        """Raise Conflict when ``more_mib`` MiB more would take all volumes together (with
        what creates and grows under way hold) past ``HANGAR_VOLUMES_MAX_TOTAL_MIB``."""
        cap = self.ctx.settings.volumes_max_total_mib
        total = sum(v.size_mib for v in self.ctx.store.list(VolumeRecord)) \
            + sum(mib for _, mib in self._held.values())
        if total + more_mib > cap:
            raise Conflict(f"volumes would come to {total + more_mib} MiB, past this server's "
                           f"cap of {cap} MiB (HANGAR_VOLUMES_MAX_TOTAL_MIB); they hold "
                           f"{total} MiB now", total_mib=total, cap_mib=cap)

    def _quota_refusal(self, team: str | None, more_mib: int) -> QuotaExceeded | None:
        """The refusal of ``more_mib`` MiB more of ``team``'s volumes past its
        ``max_volumes_mib`` (what its creates and grows under way hold counts), or None."""
        if team is None or self.teams is None or not self.teams.store.exists(team):
            return None
        limit = self.teams.store.get(team).max_volumes_mib
        if limit is None:
            return None
        used = self.teams.volumes_mib(team) \
            + sum(mib for who, mib in self._held.values() if who == team)
        if used + more_mib <= limit:
            return None
        return QuotaExceeded(
            f"team {team} may hold {limit} MiB of volumes (max_volumes_mib) and holds "
            f"{used}; this volume needs {more_mib} more", quota="max_volumes_mib",
            limit=limit, used=used, needed=more_mib, team=team)

    def _not_busy(self, vol: VolumeRecord) -> None:
        """Raise Busy while ``vol`` is being made, resized, deleted or tidied."""
        if vol.id in self._busy:
            raise Busy(f"volume {vol.id} is being changed; try again", volume_id=vol.id)

    def _idle(self, vol: VolumeRecord, doing: str) -> None:
        """Raise Busy (being changed) or Conflict (a sandbox holds it)."""
        self._not_busy(vol)
        held = self.holders(vol.id)
        if held:
            raise Conflict(f"volume {vol.id} is attached to sandbox {held[0].sandbox_id}; "
                           f"{doing} it once no sandbox holds it", volume_id=vol.id,
                           sandbox_id=held[0].sandbox_id)

    async def resize(self, ref: str, size_mib: int) -> VolumeRecord:
        """Grow a volume that no sandbox holds to ``size_mib`` MiB (offline ``resize2fs``).

        Raises NotFound, InvalidRequest (bad size, or smaller than now: volumes only grow),
        Conflict (attached, or past HANGAR_VOLUMES_MAX_TOTAL_MIB), QuotaExceeded (past its
        team's ``max_volumes_mib``), Busy (being changed), EngineError."""
        vol = self.get(ref)
        check_size(size_mib)
        if size_mib < vol.size_mib:
            raise InvalidRequest(f"volumes only grow: {vol.id} is {vol.size_mib} MiB")
        if size_mib == vol.size_mib:
            return vol
        self._idle(vol, "resize")
        self._reserve(vol.id, owner_of(vol.name), size_mib - vol.size_mib)
        self._busy.add(vol.id)
        try:
            try:
                await volfs.grow(self.image(vol.id), size_mib)
            except VolumeCorrupt as exc:
                raise self.corrupt(vol, exc.message) from None
            out = self.ctx.store.change(VolumeRecord, vol.id, size_mib=size_mib,
                                        updated_at=time.time())
        finally:
            self._busy.discard(vol.id)
            self._held.pop(vol.id, None)
        log.info("volume resized", extra={"volume_id": vol.id, "size_mib": size_mib})
        return out  # type: ignore[return-value]

    def delete(self, ref: str) -> None:
        """Remove a volume that no sandbox holds, with its image. Raises NotFound, Conflict
        (attached), Busy (being changed)."""
        vol = self.get(ref)
        self._idle(vol, "delete")
        store = self.ctx.store
        store.remove(VolumeRecord, vol.id)
        shutil.rmtree(self.ctx.layout.volume(vol.id).dir, ignore_errors=True)
        log.info("volume deleted", extra={"volume_id": vol.id})
        self.ctx.publish("volume.deleted", None, volume_id=vol.id, team=owner_of(vol.name))

    # -- attachments -------------------------------------------------------------------

    def plan(self, sandbox_id: str, request: Any) -> list[VolumeAttachmentRecord]:
        """The attachments a create of ``sandbox_id`` asks for (``parse_request``), checked
        against who holds each volume now. Store them with the sandbox's record, with no
        await in between. Raises InvalidRequest, NotFound (no such volume), Conflict (a
        writer's volume is held, or a reader's is held by a writer; the same volume
        twice), Busy (a volume being changed)."""
        wanted = parse_request(request)
        if not wanted:
            return []
        if self.ctx.engine.name != "qemu":
            raise InvalidRequest(f"volumes need the QEMU engine (this server runs "
                                 f"{self.ctx.engine.name})")
        out: list[VolumeAttachmentRecord] = []
        seen: set[str] = set()
        for index, (path, ref, ro) in enumerate(wanted):
            vol = self.get(ref)
            if vol.id in seen:
                raise Conflict(f"volume {vol.id} is named twice", volume_id=vol.id)
            seen.add(vol.id)
            self._not_busy(vol)
            for h in self.holders(vol.id):
                if not ro or not h.read_only:
                    raise Conflict(
                        f"volume {vol.id} is attached to sandbox {h.sandbox_id} "
                        f"({'read-only' if h.read_only else 'read-write'}); a volume has one "
                        "writer, or any number of read-only readers", volume_id=vol.id,
                        sandbox_id=h.sandbox_id)
            out.append(VolumeAttachmentRecord(sandbox_id=sandbox_id, volume_id=vol.id,
                                              index=index, path=path, read_only=ro))
        return out

    def drives(self, sandbox_id: str) -> tuple[VolumeDrive, ...]:
        """The sandbox's volumes as the engine attaches them."""
        out = []
        for a in self.ctx.store.attachments(sandbox_id):
            vol = self.ctx.store.find(VolumeRecord, a.volume_id)
            if vol is None:
                raise NotFound(f"volume {a.volume_id} is gone", volume_id=a.volume_id)
            out.append(VolumeDrive(image=self.image(vol.id), index=a.index,
                                   read_only=a.read_only, size_mib=vol.size_mib))
        return tuple(out)

    def has(self, sandbox_id: str) -> bool:
        return bool(self.ctx.store.attachments(sandbox_id))

    def refuse_snapshot(self, sandbox_id: str, what: str) -> None:
        """Raise Conflict when the sandbox holds volumes: they are left out of snapshots, and
        a VM with volume drives is never restored (module docstring)."""
        if self.has(sandbox_id):
            raise Conflict(f"sandbox {sandbox_id} has volumes attached, which snapshots leave "
                           f"out: it cannot {what}", sandbox_id=sandbox_id)

    def view(self, sandbox_id: str) -> dict[str, Any] | None:
        """``{path: {"volume": id, "read_only": bool}}`` of the sandbox, or None."""
        got = self.ctx.store.attachments(sandbox_id)
        if not got:
            return None
        return {a.path: {"volume": a.volume_id, "read_only": a.read_only} for a in got}

    async def mount(self, agent: Any, sandbox_id: str) -> None:
        """Mount the sandbox's volumes in its guest (a boot's first step). Raises GuestError
        when a mount fails."""
        got = self.ctx.store.attachments(sandbox_id)
        if not got:
            return
        res = await agent.exec(mount_meta(got))
        if res.exit_code != 0:
            for a in got:  # a filesystem the guest damaged is the volume's fault: 409
                vol = self.ctx.store.find(VolumeRecord, a.volume_id)
                why = None if vol is None else await volfs.damage(self.image(vol.id))
                if vol is not None and why is not None:
                    raise self.corrupt(vol, f"its guest cannot mount it ({why})",
                                       sandbox_id=sandbox_id)
            raise GuestError(f"mounting the sandbox's volumes failed: "
                             f"{_text(res.stderr)[-300:]}", sandbox_id=sandbox_id)

    async def unmount(self, rt: Any, sandbox_id: str,
                      reconnect: Callable[[Any, float], Awaitable[Any]]) -> None:
        """Unmount the sandbox's writable volumes in its guest before its VM ends, so what
        it wrote reaches the images. ``rt``: its runtime; without an agent connection (an
        adopted VM nobody called since a restart) one is opened with ``reconnect(vm,
        timeout)`` for it. Best effort: never raises."""
        paths = [a.path for a in self.ctx.store.attachments(sandbox_id) if not a.read_only]
        if not paths:
            return
        opened = None
        try:
            agent = rt.agent
            if agent is None:
                agent = opened = await asyncio.wait_for(reconnect(rt.vm, UNMOUNT_S),
                                                        UNMOUNT_S + 1)
            await asyncio.wait_for(agent.exec(unmount_meta(paths)), UNMOUNT_S + 5)
        except (HangarError, asyncio.TimeoutError, OSError) as exc:
            log.warning("volumes not unmounted before the VM ended",
                        extra={"sandbox_id": sandbox_id, "error": repr(exc)[:200]})
        finally:
            if opened is not None:
                await opened.close()

    async def release(self, sandbox_id: str) -> None:
        """Forget a gone sandbox's attachments; each of its volumes that no other sandbox
        holds gets its journal replayed (a guest killed midway leaves one) and its image
        mode back to 0600. Never raises."""
        store = self.ctx.store
        got = store.attachments(sandbox_id)
        if not got:
            return
        store.detach_volumes(sandbox_id)
        for a in got:
            if self.holders(a.volume_id) or a.volume_id in self._busy:
                continue
            image = self.image(a.volume_id)
            self._busy.add(a.volume_id)
            try:
                os.chmod(image, 0o600)
                os.chown(image, -1, os.getgid())
                if not a.read_only:
                    await volfs.replay_journal(image)
            except (OSError, HangarError) as exc:
                log.warning("volume not tidied after its sandbox",
                            extra={"volume_id": a.volume_id, "error": repr(exc)[:200]})
            finally:
                self._busy.discard(a.volume_id)

    def sweep(self) -> int:
        """At start, after recovery: forget attachments whose sandbox record is gone (a create
        a restart interrupted) and give each volume no sandbox holds its 0600 mode back.
        Returns how many attachments went. Never raises."""
        store = self.ctx.store
        gone = 0
        try:
            for a in store.list(VolumeAttachmentRecord):
                if store.find(SandboxRecord, a.sandbox_id) is None:
                    gone += store.detach_volumes(a.sandbox_id)
            for vol in store.list(VolumeRecord):
                if not self.holders(vol.id):
                    image = self.image(vol.id)
                    if image.exists() and image.stat().st_mode & 0o777 != 0o600:
                        os.chmod(image, 0o600)
        except (OSError, HangarError) as exc:
            log.warning("volume sweep failed", extra={"error": repr(exc)[:200]})
        return gone

    # -- files ---------------------------------------------------------------------

    async def files(self, ref: str, path: str) -> tuple[str, Any]:
        """What ``path`` is in the volume, read from its image (``hangar.images.volfs``):
        ``("dir", (entries, total))`` or ``("file", bytes)``. A volume held by a writer is
        read as its image is now (what the guest has not yet written back is missing).
        Raises NotFound, InvalidRequest (bad path, a file over ``MAX_READ_BYTES``), Busy."""
        vol = self.get(ref)
        self._not_busy(vol)
        image = self.image(vol.id)
        try:
            kind, _size = await volfs.stat(image, path)
            if kind == "dir":
                return "dir", await volfs.listdir(image, path)
            return "file", await volfs.read(image, path, MAX_READ_BYTES)
        except VolumeCorrupt as exc:
            raise self.corrupt(vol, exc.message) from None

    def corrupt(self, vol: VolumeRecord, why: str, **context: Any) -> VolumeCorrupt:
        """The ``VolumeCorrupt`` (409 ``volume_corrupt``) of ``vol``: ``why``, then its name
        and the repair."""
        name = unscoped(vol.name)
        repair = f"hangar volume fsck {name}"
        return VolumeCorrupt(
            f"volume {name} ({vol.id}) has a damaged filesystem: {why}. Repair it while "
            f"no sandbox holds it: {repair} (POST /volumes/{vol.id}/fsck)",
            volume_id=vol.id, volume=name, repair=repair, **context)

    async def fsck(self, ref: str) -> FsckView:
        """Check and repair the filesystem of a volume that no sandbox holds (``e2fsck -f
        -y``, confined; from a backup superblock when a guest wrote over the first).

        Returns what e2fsck did (``FsckView``). Raises NotFound, Conflict (attached), Busy
        (being changed), VolumeCorrupt (e2fsck could not repair it), EngineError."""
        vol = self.get(ref)
        self._idle(vol, "check")
        self._busy.add(vol.id)
        try:
            rc, output = await volfs.repair(self.image(vol.id))
        finally:
            self._busy.discard(vol.id)
        log.info("volume checked", extra={"volume_id": vol.id, "exit_code": rc})
        if rc >= 4:
            raise VolumeCorrupt(
                f"e2fsck could not repair volume {unscoped(vol.name)} ({vol.id}) (exit {rc}): "
                f"{output[-300:]}; restore it from a backup (docs/operations.md)",
                volume_id=vol.id, volume=unscoped(vol.name))
        return FsckView(id=vol.id, name=unscoped(vol.name), exit_code=rc,
                        repaired=rc in (1, 2, 3), output=output)


def _text(cap: Any) -> str:
    data = getattr(cap, "head", b"") + getattr(cap, "tail", b"")
    return data.decode("utf-8", "replace")

