"""A named volume's ext4 image, made, grown and read on the host without mounting it.

A volume (``hangar.core.volumes``) is a sparse file holding an ext4
filesystem that guests write. The host kernel never mounts it: a
filesystem a guest has written is hostile input, and the kernel's ext4
driver is not the place to parse it. Everything here runs e2fsprogs in
userspace instead:

- ``make``: ``truncate`` to the size, then ``mkfs.ext4 -E root_owner=0:0``
  (no reserved blocks, lazy inode tables: a 1 GiB volume takes about 4.5 MiB
  of host disk at first);
- ``grow``: ``e2fsck -fp`` (replays a journal a deleted writer left), a
  larger file, ``resize2fs`` (offline; the caller makes sure no VMM has it);
- ``stat``, ``listdir``, ``read``: ``debugfs -R`` (read-only), for
  ``GET /volumes/{id}/files``;
- ``damage``: ``e2fsck -n -f`` (read-only): whether a guest left the
  filesystem damaged (asked when a mount or a read failed), and ``repair``:
  ``e2fsck -f -y`` (``hangar volume fsck``, ``POST /volumes/{id}/fsck``).

A damaged filesystem is the volume's fault, not the server's: ``VolumeCorrupt``
(409 ``volume_corrupt``), whose message ``hangar.core.volumes`` completes with the
volume's name and the repair.

The tools that read or write a guest-written image run confined
(``confined_argv``): under ``bwrap`` in new user, mount, PID, network and
IPC namespaces, uid 65534, no capabilities, seeing only ``/usr`` and the
one image; each with a wall-clock limit (``TOOL_TIMEOUT_S``) and its
output capped. Without ``bwrap`` (not installed) they run unconfined and
a warning is logged once.
"""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from hangar.errors import EngineError, InvalidRequest, NotFound, VolumeCorrupt

log = logging.getLogger("hangar.volumes")

TOOL_TIMEOUT_S = 60.0
"""Wall-clock limit of one e2fsprogs run, seconds (resize2fs of a large image is the slow one)."""
MAX_LISTING = 4096
"""Entries a listing returns at most (the rest are counted, not returned)."""
MAX_RUNNING = 4
"""e2fsprogs runs at once, server-wide; more wait their turn (a flood of file reads
cannot fork without bound)."""
IMAGE_IN_VIEW = "/volume.ext4"
_warned = False
_slots: asyncio.Semaphore | None = None


@dataclass(frozen=True)
class Entry:
    """One file of a volume: ``name``, ``type`` (``file``, ``dir``, ``link`` or ``other``),
    ``size`` in bytes, ``mode`` (permission bits), ``uid``, ``gid``."""

    name: str
    type: str
    size: int
    mode: int
    uid: int
    gid: int


def confined_argv(image: Path, argv: list[str], *, writable: bool = False) -> tuple[list[str], str]:
    """``argv`` (its image argument spelled ``IMAGE_IN_VIEW``) run under ``bwrap`` seeing only
    ``/usr`` and ``image`` (read-only unless ``writable``); returns (argv, image path to
    give the tool)."""
    global _warned
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        if not _warned:
            log.warning("bwrap is not installed: e2fsprogs run unconfined on volume images")
            _warned = True
        return argv, str(image)
    links = []
    for name in ("bin", "sbin", "lib", "lib64"):
        if Path("/" + name).is_symlink():
            links += ["--symlink", f"usr/{name}", f"/{name}"]
    return [bwrap, "--unshare-all", "--unshare-user", "--uid", "65534", "--gid", "65534",
            "--die-with-parent", "--new-session", "--cap-drop", "ALL",
            "--ro-bind", "/usr", "/usr", *links, "--dev", "/dev", "--proc", "/proc",
            "--bind" if writable else "--ro-bind", str(image), IMAGE_IN_VIEW,
            *argv], IMAGE_IN_VIEW


async def _run(argv: list[str], *, limit: int = 1 << 20, timeout: float = TOOL_TIMEOUT_S,
               stop_past_limit: bool = False) -> tuple[int, bytes, str]:
    """Run ``argv`` (at most ``MAX_RUNNING`` at once); (exit code, stdout up to ``limit`` + 1
    bytes, stderr text). Raises EngineError when it cannot start or outlives ``timeout``."""
    global _slots
    if _slots is None:
        _slots = asyncio.Semaphore(MAX_RUNNING)
    async with _slots:
        return await _run_one(argv, limit=limit, timeout=timeout,
                              stop_past_limit=stop_past_limit)


async def _run_one(argv: list[str], *, limit: int, timeout: float,
                   stop_past_limit: bool = False) -> tuple[int, bytes, str]:
    """Run ``argv``, reading its stdout (to ``limit`` + 1 bytes kept; past that the rest is
    read and dropped, or with ``stop_past_limit`` the tool is killed at once and the
    caller gets what was read) and its stderr (its first 64 KiB kept, the
    rest read and dropped) side by side, so that a tool writing much to either never
    blocks on a full pipe (a listing of a folder a guest filled must not hold a slot)."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE)
    except OSError as exc:
        raise EngineError(f"cannot run {argv[0]}: {exc}") from None
    assert proc.stdout is not None and proc.stderr is not None
    out = bytearray()
    err = bytearray()

    async def take() -> None:
        while chunk := await proc.stdout.read(65536):  # type: ignore[union-attr]
            if len(out) <= limit:
                out.extend(chunk)
            elif stop_past_limit:
                proc.kill()  # enough: the caller reads no more of it
                return

    async def take_err() -> None:
        while chunk := await proc.stderr.read(65536):  # type: ignore[union-attr]
            if len(err) < 65536:
                err.extend(chunk[:65536 - len(err)])

    try:
        await asyncio.wait_for(asyncio.gather(take(), take_err()), timeout)
        rc = await asyncio.wait_for(proc.wait(), timeout)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        raise EngineError(f"{Path(argv[0]).name} did not finish in {timeout:g} s") from None
    return rc, bytes(out), err.decode("utf-8", "replace")


async def make(image: Path, size_mib: int, label: str) -> None:
    """Make ``image``: a sparse file of ``size_mib`` MiB holding an empty ext4 filesystem
    whose root belongs to root (0755). Raises EngineError (mkfs failed)."""
    with open(image, "xb") as f:
        f.truncate(size_mib << 20)
    rc, _, err = await _run(["mkfs.ext4", "-q", "-F", "-m", "0", "-L", label[:16],
                             "-E", "root_owner=0:0,lazy_itable_init=1", str(image)])
    if rc != 0:
        raise EngineError(f"mkfs.ext4 failed: {err.strip()[-300:]}")


async def grow(image: Path, size_mib: int) -> None:
    """Grow ``image`` to ``size_mib`` MiB and its filesystem with it, offline: ``e2fsck -fp``
    first (a writer that was ended leaves its journal to replay), then ``resize2fs``.

    Raises VolumeCorrupt when the filesystem needs more repair than ``-p`` makes, and
    EngineError when a tool fails.
    """
    argv, _ = confined_argv(image, ["e2fsck", "-f", "-p", IMAGE_IN_VIEW], writable=True)
    rc, _, err = await _run(argv)
    if rc >= 4:  # 1 and 2: errors corrected
        raise VolumeCorrupt(f"the volume's filesystem needs a repair e2fsck -p does not "
                            f"make (exit {rc}): {err.strip()[-200:]}")
    with open(image, "r+b") as f:
        f.truncate(size_mib << 20)
    argv, _ = confined_argv(image, ["resize2fs", IMAGE_IN_VIEW], writable=True)
    rc, _, err = await _run(argv)
    if rc != 0:
        raise EngineError(f"resize2fs failed: {err.strip()[-300:]}")


async def replay_journal(image: Path) -> None:
    """Replay the journal a guest ended midway left (``e2fsck -E journal_only -p``), so that
    ``debugfs`` reads what it wrote; nothing else is checked or changed. Raises EngineError."""
    argv, _ = confined_argv(image, ["e2fsck", "-p", "-E", "journal_only", IMAGE_IN_VIEW],
                            writable=True)
    rc, _, err = await _run(argv)
    if rc >= 4:
        raise EngineError(f"e2fsck could not replay the volume's journal (exit {rc}): "
                          f"{err.strip()[-200:]}")


async def damage(image: Path) -> str | None:
    """Why the filesystem of ``image`` is damaged (e2fsck's last words), or None when
    ``e2fsck -n -f`` (read-only: it changes nothing, and replays no journal) finds it
    sound. Raises EngineError (e2fsck could not run)."""
    argv, _ = confined_argv(image, ["e2fsck", "-n", "-f", IMAGE_IN_VIEW])
    rc, head, _tail = await _run_all(argv)
    if rc < 4:
        return None
    said = [ln.strip() for ln in head.splitlines()
            if ln.strip() and not ln.startswith("e2fsck 1.")]
    return f"e2fsck -n exit {rc}: " + ("; ".join(said[:3]) or "no output")[:300]


async def repair(image: Path) -> tuple[int, str]:
    """``e2fsck -f -y`` on ``image`` (nobody may have it open): every repair it can make,
    from a backup superblock if the first is gone. Returns (its exit code: 0 sound, 1 or
    2 repaired, 4 and up not repaired; its output's last 4 KiB). Raises EngineError."""
    argv, _ = confined_argv(image, ["e2fsck", "-f", "-y", IMAGE_IN_VIEW], writable=True)
    rc, _head, tail = await _run_all(argv)
    return rc, tail.strip()


async def _run_all(argv: list[str], keep: int = 4096,
                   timeout: float = TOOL_TIMEOUT_S) -> tuple[int, str, str]:
    """Run ``argv`` to its end (at most ``MAX_RUNNING`` at once), its stderr joined to its
    stdout, which is read whole but kept only in part: (exit code, the first ``keep``
    bytes, the last ``keep`` bytes). Never ended for talking too much (e2fsck repairing
    must finish); raises EngineError when it cannot start or outlives ``timeout``."""
    global _slots
    if _slots is None:
        _slots = asyncio.Semaphore(MAX_RUNNING)
    async with _slots:
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT)
        except OSError as exc:
            raise EngineError(f"cannot run {argv[0]}: {exc}") from None
        assert proc.stdout is not None
        head, tail = bytearray(), bytearray()

        async def take() -> None:
            while True:
                chunk = await proc.stdout.read(65536)  # type: ignore[union-attr]
                if not chunk:
                    return
                if len(head) < keep:
                    head.extend(chunk[:keep - len(head)])
                tail.extend(chunk)
                del tail[:-keep]

        try:
            await asyncio.wait_for(take(), timeout)
            rc = await asyncio.wait_for(proc.wait(), timeout)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
            raise EngineError(f"{Path(argv[0]).name} did not finish in {timeout:g} s") from None
    return rc, head.decode("utf-8", "replace"), tail.decode("utf-8", "replace")


_BAD_PATH = re.compile(r'[\x00-\x1f\x7f"\\]')


def check_path(path: str) -> str:
    """``path`` as debugfs takes it: absolute, normalised, at most 4096 bytes, without
    control characters, quotes or backslashes, and no ``..``. Raises InvalidRequest."""
    if not path.startswith("/") or len(path.encode()) > 4096 or _BAD_PATH.search(path):
        raise InvalidRequest("path must be absolute, at most 4096 bytes, without control "
                             "characters, quotes or backslashes")
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise InvalidRequest("path must not contain '..'")
    return "/" + "/".join(parts)


async def _debugfs(image: Path, command: str, *, limit: int = 1 << 20) -> tuple[bytes, str]:
    argv, _ = confined_argv(image, ["debugfs", "-R", command, IMAGE_IN_VIEW])
    rc, out, err = await _run(argv, limit=limit, stop_past_limit=True)
    if len(out) > limit:  # killed once it had written enough: what it wrote stands
        return out, err
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("debugfs ")]
    if rc != 0 or any("not found" in ln or "Bad magic" in ln for ln in lines):
        msg = lines[-1].strip() if lines else f"debugfs exited {rc}"
        if "not found" in msg:
            raise NotFound(f"no such file in the volume: {msg.split(':')[0]}")
        why = await damage(image)
        if why is not None:
            raise VolumeCorrupt(f"the volume cannot be read ({msg[:200]}): its filesystem is "
                                f"damaged ({why})")
        raise InvalidRequest(f"the volume cannot be read: {msg[:200]}")
    return out, err


_TYPE = re.compile(r"Type:\s+(\S+)")
_SIZE = re.compile(r"Size:\s+(\d+)")


async def stat(image: Path, path: str) -> tuple[str, int]:
    """(type, size in bytes) of ``path`` in the volume: ``file``, ``dir``, ``link`` or
    ``other``. Raises NotFound, InvalidRequest."""
    out, _ = await _debugfs(image, f'stat "{check_path(path)}"', limit=64 << 10)
    text = out.decode("utf-8", "replace")
    kind = _TYPE.search(text)
    size = _SIZE.search(text)
    if kind is None or size is None:
        raise InvalidRequest("the volume's entry cannot be read")
    names = {"regular": "file", "directory": "dir", "symlink": "link"}
    return names.get(kind.group(1), "other"), int(size.group(1))


_TYPES = {0o040000: "dir", 0o100000: "file", 0o120000: "link"}


async def listdir(image: Path, path: str) -> tuple[list[Entry], int]:
    """The entries of the folder ``path`` (without ``.`` and ``..``), sorted by name, at most
    ``MAX_LISTING``; and how many there are in all. Raises NotFound, InvalidRequest."""
    out, _ = await _debugfs(image, f'ls -p "{check_path(path)}"', limit=8 << 20)
    # up to 8 MiB of lines a guest may have made (280,000 short names held the loop 0.55 s,
    # review 29j J-H2): parsed in a worker thread, which a pure Python loop shares
    return await asyncio.to_thread(_listing, out)


def _listing(out: bytes) -> tuple[list[Entry], int]:
    """``listdir``'s answer from ``debugfs ls -p``'s output ``out``."""
    entries: list[Entry] = []
    total = 0
    for line in out.decode("utf-8", "replace").splitlines():
        # /inode/mode/uid/gid/name/size/ (a name may hold no '/', so split from both ends)
        if not line.startswith("/") or line.count("/") < 7:
            continue
        head = line[1:].split("/", 4)
        name, _, size = head[4][:-1].rpartition("/")
        if name in (".", "..") or not name:
            continue
        total += 1
        if len(entries) >= MAX_LISTING:
            continue
        try:
            mode = int(head[1], 8)
            entries.append(Entry(name=name, type=_TYPES.get(mode & 0o170000, "other"),
                                 size=int(size or 0), mode=mode & 0o7777, uid=int(head[2]),
                                 gid=int(head[3])))
        except ValueError:
            continue
    entries.sort(key=lambda e: e.name)
    return entries, total


async def read(image: Path, path: str, max_bytes: int) -> bytes:
    """The bytes of the regular file ``path``. Raises NotFound, InvalidRequest (a folder,
    or larger than ``max_bytes``)."""
    kind, size = await stat(image, path)
    if kind != "file":
        raise InvalidRequest(f"{path} is a {kind}, not a file")
    if size > max_bytes:
        raise InvalidRequest(f"{path} is {size} bytes; at most {max_bytes} are read here")
    out, _ = await _debugfs(image, f'cat "{check_path(path)}"', limit=max_bytes)
    return out[:max_bytes]
