"""VMM uids: one per live VMM on the host, never two at once.

Each confined VMM runs as its own uid (= gid). The uid comes from
``UidAllocator``: a claim file ``<registry>/<uid>`` made with ``O_EXCL``
under a host-wide lock (``<registry>/.lock``, ``flock``), holding the
folder it was claimed for (the sandbox's folder) as JSON. Claims live in
``/run/hangar/vmm-uids`` by default: host-wide, so that two servers on one
host (a cluster's nodes in a test, or a restarted server) never hand out
the same uid, and on a tmpfs, so that a reboot, which ends every VMM, also
ends every claim.

A claim is held while its folder exists or a process runs as its uid; a
claim whose folder is gone and whose uid runs nothing is stale and taken
over (a server killed between a VMM's end and its folder's removal leaves
one). ``allocate`` of a folder that already holds a claim returns that
claim's uid, so a restarted server, a wake or a restore into the same
folder keeps its uid; ``release`` drops the claim once the VMM and its
folder are gone.

The search starts at ``base + crc32(sandbox id) % count`` (the old, pure
hash) and moves on past every held uid, so a sandbox usually keeps the uid
it always had, and two ids that collide under the hash get different uids.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import threading
import zlib
from pathlib import Path

log = logging.getLogger("hangar.engine.uids")

DEFAULT_REGISTRY = Path("/run") / "hangar" / "vmm-uids"  # on the host: not a guest path
"""Where claims are kept unless configured otherwise (a tmpfs on every systemd host)."""


class UidsExhausted(OSError):
    """Every uid of the range is held."""


def process_uids() -> set[int]:
    """The real uids of every process on the host (from ``/proc/<pid>/status``)."""
    out: set[int] = set()
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as f:
                for line in f:
                    if line.startswith(b"Uid:"):
                        out.add(int(line.split()[1]))
                        break
        except (OSError, ValueError, IndexError):
            continue
    return out


class UidAllocator:
    """Hands out uids in ``[base, base + count)``, each to one folder at a time.

    ``registry``: the folder of claims (made 0700 root's if missing). Safe
    across threads and, through the lock file, across processes of the host.
    """

    def __init__(self, base: int, count: int, registry: Path = DEFAULT_REGISTRY) -> None:
        if count <= 0 or base <= 0:
            raise ValueError("a uid range needs a positive base and count")
        self.base = base
        self.count = count
        self.registry = Path(registry)
        self._lock = threading.Lock()

    # -- claims -------------------------------------------------------------------

    def _claim_path(self, uid: int) -> Path:
        return self.registry / str(uid)

    def _read(self, uid: int) -> str | None:
        """The folder of ``uid``'s claim, "" for a garbled one, None for none."""
        try:
            fd = os.open(self._claim_path(uid), os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        except OSError:
            return ""
        try:
            raw = os.read(fd, 8192)
        finally:
            os.close(fd)
        try:
            folder = json.loads(raw).get("folder")
        except (ValueError, AttributeError):
            return ""
        return folder if isinstance(folder, str) else ""

    def _stale(self, uid: int, folder: str, running: set[int]) -> bool:
        return (not folder or not os.path.isdir(folder)) and uid not in running

    def _locked(self):  # noqa: ANN202
        self.registry.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self.registry / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        return fd

    def _index_path(self, folder: str) -> Path:
        return self.registry / ("f-" + hashlib.sha256(folder.encode()).hexdigest()[:40])

    def _held_by(self, folder: str) -> int | None:
        """The uid whose claim names ``folder`` (through its index file), or None."""
        try:
            uid = int(self._index_path(folder).read_text())
        except (OSError, ValueError):
            return None
        in_range = self.base <= uid < self.base + self.count
        return uid if in_range and self._read(uid) == folder else None

    # -- public -------------------------------------------------------------------

    def allocate(self, sandbox_id: str, folder: Path) -> int:
        """The uid held for ``folder`` (claimed now unless it already holds one).

        Raises ``UidsExhausted`` when every uid of the range is held, OSError
        when the registry cannot be written.
        """
        key = str(Path(folder).absolute())
        with self._lock:
            lock_fd = self._locked()
            try:
                held = self._held_by(key)
                if held is not None:
                    return held
                start = zlib.crc32(sandbox_id.encode()) % self.count
                running = process_uids()  # a uid a process runs as is never given
                for step in range(self.count):
                    uid = self.base + (start + step) % self.count
                    owner = self._read(uid)
                    if owner is not None:
                        if not self._stale(uid, owner, running):
                            continue
                        log.info("vmm uid %d: taking over a stale claim of %s", uid,
                                 owner or "(garbled)")
                        self._drop(uid, owner)
                    elif uid in running:
                        continue  # a process runs as it without a claim: not ours to give
                    self._write(uid, sandbox_id, key)
                    return uid
                raise UidsExhausted(errno.EUSERS, f"all {self.count} VMM uids from "
                                                  f"{self.base} are held")
            finally:
                os.close(lock_fd)

    def _drop(self, uid: int, folder: str) -> None:
        for path in ((self._index_path(folder),) if folder else ()) + (self._claim_path(uid),):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def _write(self, uid: int, sandbox_id: str, folder: str) -> None:
        fd = os.open(self._claim_path(uid), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                     0o600)
        try:
            os.write(fd, json.dumps({"sandbox": sandbox_id, "folder": folder}).encode())
        finally:
            os.close(fd)
        index = self._index_path(folder)
        tmp = index.with_name(index.name + ".tmp")
        tmp.write_text(str(uid))
        os.replace(tmp, index)

    def lookup(self, folder: Path) -> int | None:
        """The uid ``folder`` holds, or None."""
        return self._held_by(str(Path(folder).absolute()))

    def sweep(self) -> int:
        """Drop every stale claim of this range (its folder gone, its uid running no
        process): what a VMM whose folder was removed without a release left behind.
        ``allocate`` takes such claims over anyway; this keeps the registry to what is
        held. Returns how many went. Never raises."""
        dropped = 0
        try:
            with self._lock:
                lock_fd = self._locked()
                try:
                    running = process_uids()
                    for entry in os.listdir(self.registry):
                        if not entry.isdigit() or not (self.base <= int(entry)
                                                       < self.base + self.count):
                            continue
                        uid = int(entry)
                        owner = self._read(uid)
                        if owner is not None and self._stale(uid, owner, running):
                            self._drop(uid, owner)
                            dropped += 1
                    for entry in os.listdir(self.registry):  # index files of no claim
                        if entry.startswith("f-") and not entry.endswith(".tmp"):
                            try:
                                uid = int((self.registry / entry).read_text())
                            except (OSError, ValueError):
                                continue
                            if (self.base <= uid < self.base + self.count
                                    and self._read(uid) is None):
                                (self.registry / entry).unlink(missing_ok=True)
                finally:
                    os.close(lock_fd)
        except OSError as exc:
            log.warning("could not sweep the VMM uid claims: %s", exc)
        return dropped

    def release(self, folder: Path) -> None:
        """Drop ``folder``'s claim, if any (its VMM is gone). Never raises."""
        key = str(Path(folder).absolute())
        try:
            with self._lock:
                lock_fd = self._locked()
                try:
                    uid = self._held_by(key)
                    if uid is not None:
                        self._drop(uid, key)
                finally:
                    os.close(lock_fd)
        except OSError as exc:
            log.warning("could not release the VMM uid of %s: %s", folder, exc)
