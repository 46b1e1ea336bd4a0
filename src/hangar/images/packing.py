"""Packing a build's tree into ``rootfs.ext4``, and hashing a build's bytes.

``pack`` runs ``mkfs.ext4 -d`` over the tree into a file sized to the content plus
25 % (sandbox disks are larger qcow2 overlays; the guest init grows the filesystem
at boot), retrying larger when mkfs runs out of room. ``content_digest`` hashes
what a build's id covers: rootfs.ext4, vmlinuz and the modules tree.
"""

from __future__ import annotations

import hashlib
import math
import os
import stat
from pathlib import Path

from hangar.errors import ImageError
from hangar.images.commands import Progress, run
from hangar.layout import ImagePaths

HEADROOM = 1.25
"""rootfs.ext4 is the content's size times this, plus room for the journal and inodes."""


def content_digest(d: Path) -> str:
    """SHA-256 (hex) of a build's bytes: rootfs.ext4, vmlinuz and the modules tree.

    Each file adds its path relative to ``d``, its size and its SHA-256, in
    sorted order; symlinks add their target. ``vmlinux`` (a function of
    vmlinuz), the initramfs and the manifest are left out. About a second
    per GB. Raises OSError.
    """
    paths = ImagePaths(d)
    files = [paths.rootfs, paths.kernel]
    for dirpath, dirnames, filenames in os.walk(paths.modules):
        dirnames.sort()
        files += [Path(dirpath) / n for n in sorted(filenames)]
    h = hashlib.sha256()
    for f in files:
        rel = f.relative_to(d).as_posix()
        if f.is_symlink():
            h.update(f"L {rel} {os.readlink(f)}\0".encode())
            continue
        fh = hashlib.sha256()
        with open(f, "rb") as src:
            for block in iter(lambda: src.read(1 << 20), b""):
                fh.update(block)
        h.update(f"F {rel} {f.stat().st_size} {fh.hexdigest()}\0".encode())
    return h.hexdigest()


def tree_size(root: Path) -> tuple[int, int]:
    """(bytes the tree needs in 4 KiB blocks, number of inodes)."""
    total = 0
    inodes = 0
    seen: set[tuple[int, int]] = set()
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, n))
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            inodes += 1
            if stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode):
                total += max(4096, -(-st.st_size // 4096) * 4096)
            elif stat.S_ISLNK(st.st_mode) and st.st_size > 59:
                total += 4096  # longer targets than fit in the inode
    return total, inodes + 1


def pack(rootdir: Path, image: Path, content: int, inodes: int, say: Progress) -> int:
    """mkfs.ext4 -d the tree into ``image``; return its size in bytes."""
    n_inodes = max(16384, int(inodes * 1.5))
    size = content * HEADROOM + n_inodes * 256 + 24 * 2**20  # + journal and metadata
    for attempt in range(3):
        size_mib = math.ceil(size / 2**20)
        say(f"packing rootfs.ext4 ({size_mib} MiB)")
        image.unlink(missing_ok=True)
        with open(image, "wb") as f:
            f.truncate(size_mib * 2**20)
        try:
            # -b 4096: for a file this small mke2fs would pick 1 KiB blocks
            # (its "small" type), slower and worse for the online growth at boot.
            run("mkfs.ext4", ["mkfs.ext4", "-q", "-F", "-L", "hangar-root", "-b", "4096",
                              "-m", "0", "-N", str(n_inodes), "-d", rootdir, image], timeout=900)
            return image.stat().st_size
        except ImageError as e:
            if attempt == 2 or "space" not in e.message.lower() and "allocate" not in e.message:
                raise
            size *= 1.3
    raise AssertionError("unreachable")
