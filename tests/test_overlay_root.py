"""The guest side of Firecracker's disk layout, checked under QEMU.

Firecracker sandboxes boot the image's rootfs as a read-only drive plus a
writable drive of their own (``hangar.overlay=/dev/vdb``); the initramfs
stacks them with overlayfs. No guest boots under Firecracker on this host,
so the same kernel arguments and drives are given to a QEMU guest here.
"""

from __future__ import annotations

import asyncio
import hashlib
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from conftest import SHARED, vmm_pids
from hangar.engines.agent_client import AgentClient, exec_meta
from hangar.engines.base import VMSpec
from hangar.engines.qemu import QemuEngine
from hangar.images import resolve_image
from hangar.layout import Layout

pytestmark = pytest.mark.vm


def digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def test_read_only_root_with_a_writable_overlay(base_image: Path) -> None:
    image = resolve_image(Layout(SHARED), "base")
    d = Path(tempfile.mkdtemp(prefix="hgo-", dir="/tmp"))
    rw = d / "rw.ext4"
    subprocess.run(["truncate", "-s", "512M", str(rw)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-L", "hangar-rw", str(rw)], check=True)
    before = digest(image.rootfs)
    engine = QemuEngine("tcg")
    spec = VMSpec("overlaytest", image, Layout(d).sandbox("overlaytest"))
    argv = engine.command(spec)
    i = next(n for n, a in enumerate(argv) if a.startswith("id=root,file="))
    argv[i] = f"id=root,file={image.rootfs},format=raw,if=none,readonly=on"
    k = argv.index("-append") + 1
    argv[k] = argv[k].replace("root=/dev/vda rw", "root=/dev/vda ro hangar.overlay=/dev/vdb")
    argv += ["-drive", f"id=rw,file={rw},format=raw,if=none",
             "-device", "virtio-blk-device,drive=rw"]
    spec.paths.dir.mkdir(parents=True)
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)

    async def drive() -> tuple[str, str]:
        agent = await AgentClient.connect(spec.paths.agent, 120)
        try:
            r = await agent.exec(exec_meta("echo kept > /root/new.txt; sync; "
                                           "findmnt -no FSTYPE /; cat /root/new.txt"))
            return r.stdout.head.decode(), r.stderr.head.decode()
        finally:
            await agent.close()

    try:
        out, err = asyncio.run(drive())
        assert out == "overlay\nkept\n", err
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(d, ignore_errors=True)
    assert digest(image.rootfs) == before, "the shared image was not written"
    assert vmm_pids("overlaytest") == []
