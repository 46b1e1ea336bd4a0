"""The sandbox's disk: a qcow2 overlay over the image's read-only rootfs (``qemu-img``).

``make_disk`` creates the overlay at boot; a snapshot copies it, and
``rebase`` points the copy of a restore at the image's rootfs on this
host; ``virtual_size`` tells a snapshot's manifest the disk's size. Each
raises ``EngineError`` with ``qemu-img``'s own message when it fails.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from hangar.engines.base import VMSpec
from hangar.engines.qemu.probe import QEMU_IMG
from hangar.errors import EngineError


async def _qemu_img(what: str, *args: str) -> bytes:
    """Run ``qemu-img`` with ``args``; returns its stdout. EngineError on failure."""
    proc = await asyncio.create_subprocess_exec(
        QEMU_IMG, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    if proc.returncode != 0:
        raise EngineError(f"qemu-img {what} failed: {err.decode(errors='replace').strip()}")
    return out


async def make_disk(spec: VMSpec) -> None:
    """Create ``spec.paths.disk``: a qcow2 overlay of ``spec.disk_mib`` MiB (at least the
    rootfs's size) backed by the image's raw rootfs."""
    base = spec.image.rootfs
    size = max(spec.disk_mib * 1024 * 1024, base.stat().st_size)
    await _qemu_img("create", "create", "-q", "-f", "qcow2", "-b", str(base), "-F", "raw",
                    str(spec.paths.disk), str(size))


async def rebase(disk: Path, backing: Path) -> None:
    """Point ``disk``'s backing file at ``backing`` without touching data (``rebase -u``)."""
    await _qemu_img("rebase", "rebase", "-u", "-f", "qcow2", "-F", "raw", "-b", str(backing),
                    str(disk))


async def virtual_size(disk: Path) -> int:
    """The disk's size as the guest sees it, in bytes (``qemu-img info``; read even while a
    QEMU holds the file, ``-U``)."""
    out = await _qemu_img("info", "info", "--output=json", "-U", str(disk))
    return int(json.loads(out)["virtual-size"])
