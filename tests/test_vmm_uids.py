"""VMM uids: never one uid for two live VMMs (``hangar.engines.uids``), no VM needed.

The ids are chosen to collide under the old rule (``base + crc32(id) % count``), which
gave two sandboxes one uid with chance 1/65,536 each pair and certainly for these ids.
"""

from __future__ import annotations

import random
import time
import zlib
from collections import defaultdict
from pathlib import Path

from hangar.engines.uids import UidAllocator

BASE, COUNT = 400_000, 65_536


def colliding_ids(n: int) -> list[str]:
    """``n`` sandbox ids in groups of at least 3 that share ``crc32(id) % COUNT``."""
    buckets: dict[int, list[str]] = defaultdict(list)
    i = 0
    while True:
        for _ in range(50_000):
            sid = f"sb-{i:012x}"
            buckets[zlib.crc32(sid.encode()) % COUNT].append(sid)
            i += 1
        groups = [b for b in buckets.values() if len(b) >= 3]
        if sum(len(g) for g in groups) >= n:
            return [sid for g in groups for sid in g][:n]


def test_colliding_ids_never_share_a_uid_while_held(tmp_path: Path) -> None:
    ids = colliding_ids(1000)
    assert len({zlib.crc32(s.encode()) % COUNT for s in ids}) <= 400  # the old rule collides
    registry = tmp_path / "uids"
    alloc = UidAllocator(BASE, COUNT, registry)
    folders = {sid: tmp_path / "sandboxes" / sid for sid in ids}
    for f in folders.values():
        f.mkdir(parents=True)
    held: dict[str, int] = {}
    for sid in ids:
        held[sid] = alloc.allocate(sid, folders[sid])
    assert len(set(held.values())) == 1000
    assert all(BASE <= u < BASE + COUNT for u in held.values())
    # Asking again for a folder that holds a claim gives its uid, not a new one.
    assert all(alloc.allocate(sid, folders[sid]) == held[sid] for sid in ids[:50])

    # A restarted server (a new allocator on the same registry) never reuses a held uid.
    again = UidAllocator(BASE, COUNT, registry)
    assert again.lookup(folders[ids[0]]) == held[ids[0]]
    extra = tmp_path / "sandboxes" / "sb-new"
    extra.mkdir()
    assert again.allocate(ids[0], extra) not in held.values()

    # Churn: release and take again in random order; what is held stays distinct.
    rng = random.Random(20)
    for _ in range(1000):
        sid = rng.choice(ids)
        if sid in held and rng.random() < 0.5:
            again.release(folders[sid])
            del held[sid]
        elif sid not in held:
            held[sid] = again.allocate(sid, folders[sid])
        assert len(set(held.values())) == len(held)
    assert not set(held.values()) & {again.lookup(extra)}


def test_a_stale_claim_is_taken_over(tmp_path: Path) -> None:
    """A claim whose folder is gone and whose uid runs no process is free again."""
    alloc = UidAllocator(BASE, COUNT, tmp_path / "uids")
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    uid = alloc.allocate("sb-same", a)
    assert alloc.allocate("sb-same", b) != uid  # a's folder exists: held
    a.rmdir()  # a server killed before it released the claim
    c = tmp_path / "c"
    c.mkdir()
    assert alloc.allocate("sb-same", c) == uid
    assert alloc.lookup(a) is None


def test_sweep_drops_only_stale_claims(tmp_path: Path) -> None:
    """A test run's servers killed before they released leave claims behind: ``sweep``
    drops those (folder gone, uid running nothing) and their index files, and keeps
    every claim whose folder is there, and other ranges' claims."""
    registry = tmp_path / "uids"
    alloc = UidAllocator(BASE, COUNT, registry)
    other = UidAllocator(BASE + COUNT, COUNT, registry)
    kept, gone, theirs = tmp_path / "kept", tmp_path / "gone", tmp_path / "theirs"
    for d in (kept, gone, theirs):
        d.mkdir()
    held = alloc.allocate("sb-kept", kept)
    alloc.allocate("sb-gone", gone)
    their_uid = other.allocate("sb-theirs", theirs)
    gone.rmdir()
    theirs.rmdir()
    assert alloc.sweep() == 1
    assert alloc.lookup(kept) == held and alloc.lookup(gone) is None
    assert other.lookup(theirs) == their_uid  # not this range's to sweep
    names = sorted(p.name for p in registry.iterdir() if not p.name.startswith("."))
    assert len(names) == 4, names  # two claims and their two index files
    assert alloc.sweep() == 0


def test_a_uid_a_process_runs_as_is_never_given_even_without_a_claim(tmp_path: Path) -> None:
    """A uid whose claim is gone while its VMM still runs (a compromised server released
    it) is not handed to the next VMM, also when it is the first candidate tried."""
    import subprocess

    alloc = UidAllocator(BASE, COUNT, tmp_path / "uids")
    sid = "sb-unclaimed"
    first = BASE + zlib.crc32(sid.encode()) % COUNT
    runner = subprocess.Popen(["setpriv", f"--reuid={first}", f"--regid={first}",
                               "--clear-groups", "sleep", "60"])
    try:
        folder = tmp_path / sid
        folder.mkdir()
        status = Path(f"/proc/{runner.pid}/status")
        until = time.monotonic() + 30
        while f"Uid:\t{first}\t" not in status.read_text():  # setpriv has switched
            assert time.monotonic() < until, status.read_text()
            time.sleep(0.01)
        assert alloc.allocate(sid, folder) != first
    finally:
        runner.kill()
        runner.wait()
