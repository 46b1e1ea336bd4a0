"""A Firecracker sandbox's files: ids, the VMM's root, hard links, the writable drive.

The file names are ``hangar.layout.FirecrackerPaths`` (``FirecrackerFiles``
here). Every path given to Firecracker's API is relative to the VMM's root
(``.name``), so Firecracker resolves it in that directory, jailed or not, and
a snapshot (which records drive and socket paths) restores into any sandbox.
The image's kernel, initramfs and rootfs are hard-linked into the root (a
jailed VMM sees nothing outside its chroot), copied across filesystems.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

from hangar.errors import EngineError
from hangar.layout import FirecrackerPaths

FirecrackerFiles = FirecrackerPaths
"""The files of one sandbox's Firecracker VMM (``hangar.layout.FirecrackerPaths``)."""

UNIX_PATH_MAX = 107
"""Longest Unix socket path in bytes (``sun_path`` is 108 with its NUL)."""
VM_ID = re.compile(r"^[A-Za-z0-9-]{1,64}$")


def vm_id_for(sandbox_id: str) -> str:
    """Firecracker's (and the jailer's) ``--id`` for a sandbox: ``hangar-<id>``."""
    vm_id = f"hangar-{sandbox_id}"
    if not VM_ID.match(vm_id):
        raise EngineError(f"sandbox id {sandbox_id!r} cannot be a Firecracker id "
                          "(letters, digits and '-', at most 57 characters)")
    return vm_id


def vmm_args(files: FirecrackerFiles) -> list[str]:
    """Firecracker's own arguments: its API socket and log, relative to its root."""
    return ["--api-sock", files.api.name, "--log-path", files.log.name, "--level", "Warning"]


def check_socket_paths(files: FirecrackerFiles) -> None:
    """Raise EngineError when a socket path of ``files`` is too long for a Unix socket."""
    for sock in (files.api, files.vsock):
        if len(str(sock.absolute()).encode()) > UNIX_PATH_MAX:
            raise EngineError(f"socket path longer than {UNIX_PATH_MAX} bytes: {sock}; "
                              "use a shorter data directory")


def link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link ``src`` at ``dst``; copy (keeping holes) across filesystems.

    Raises EngineError when ``src`` cannot be read.
    """
    try:
        os.link(src, dst)
        return
    except OSError:
        pass
    out = subprocess.run(["cp", "--sparse=always", "--", str(src), str(dst)],
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise EngineError(f"cannot link or copy {src}: {out.stderr.strip()}")
    os.chmod(dst, 0o644)


def write_vm_json(files: FirecrackerFiles, meta: dict[str, Any]) -> None:
    """Record what was booted (``vm.json``), for ``FirecrackerEngine.adopt``."""
    files.vm_json.write_text(json.dumps(meta, indent=2))


def read_vm_json(files: FirecrackerFiles) -> dict[str, Any]:
    """``vm.json``, or {} when it is missing or garbled."""
    try:
        meta = json.loads(files.vm_json.read_text())
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


async def make_disk(files: FirecrackerFiles, size_mib: int,
                    owner: tuple[int, int] | None = None) -> None:
    """Create the sparse writable ext4 drive of ``size_mib`` MiB (about 1 MB allocated).

    ``mkfs.ext4`` with lazy inode table and journal init takes about 20 ms.
    ``owner`` (uid, gid) chowns it for a jailed VMM. Raises EngineError.
    """
    with open(files.disk, "wb") as f:
        f.truncate(size_mib << 20)
    proc = await asyncio.create_subprocess_exec(
        "mkfs.ext4", "-q", "-F", "-m", "0", "-L", "hangar-rw",
        "-E", "lazy_itable_init=1,lazy_journal_init=1,root_owner=0:0", str(files.disk),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    _, err = await proc.communicate()
    if proc.returncode != 0:
        raise EngineError(f"mkfs.ext4 failed: {err.decode(errors='replace').strip()}")
    if owner is not None:
        os.chown(files.disk, *owner)
