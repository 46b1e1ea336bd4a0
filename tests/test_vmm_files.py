"""Root never follows a name a confined VMM can swap (``hangar.engines.safefs``).

A sandbox folder is set up as for a confined VMM (``Confinement.prepare`` and
``console_argv``, as root). As the VMM's own uid, it can write but neither
remove nor swap its disk and console folder; it can swap its console log for
a link to a host sentinel file (and a disk and console folder are swapped for
links by hand, as an older layout allowed). Everything the server does as root with that folder afterwards (read
the console for an error message, give the disk to the VMM again, copy the
disk into a snapshot, write the pid file, remove the folder) leaves the
sentinels as they were: same bytes, owner and mode.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from hangar.engines import process, safefs
from hangar.engines.base import Engine
from hangar.engines.confine import ConfineConfig, Confinement
from hangar.engines.qemu import QemuEngine
from hangar.layout import SandboxPaths

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="confinement needs root")


def fingerprint(p: Path) -> tuple[str, int, int, int]:
    st = p.stat()
    return hashlib.sha256(p.read_bytes()).hexdigest(), st.st_uid, st.st_gid, st.st_mode


def as_vmm(uid: int, script: str, ok: bool = True) -> None:
    out = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                          "sh", "-ec", script], capture_output=True, text=True)
    assert (out.returncode == 0) == ok, (script, out.stderr)


@pytest.fixture
def tmp_path() -> Iterator[Path]:
    """A folder the VMM's uid can traverse (pytest's own is root's only)."""
    d = Path(tempfile.mkdtemp(prefix="hangar-links-"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_links_the_vmm_makes_are_never_followed(tmp_path: Path) -> None:
    host = tmp_path / "host"
    host.mkdir(mode=0o700)
    sentinel = host / "secret"
    sentinel.write_bytes(b"host secret\n" * 100)
    sentinel.chmod(0o600)
    before, before_dir = fingerprint(sentinel), host.stat()

    confine = Confinement(ConfineConfig(cgroups="off", uid_registry=tmp_path / "uids",
                                        console_log_bytes=64 << 10))
    sandboxes = tmp_path / "sandboxes"
    sandboxes.mkdir()
    sandboxes.chmod(0o755)
    paths = SandboxPaths(sandboxes / "sb-links")
    paths.dir.mkdir()
    paths.disk.write_bytes(b"disk")
    plan = confine.prepare("sb-links", paths, vcpus=1, memory_mib=64, accel="tcg", reads=[],
                           owned=[paths.disk])
    uid = plan.uid
    assert uid is not None and uid != 0
    if confine.console_argv(paths) is None:
        pytest.skip("multilog is not installed")
    (paths.console_dir / "current").write_bytes(b"boot line\n")
    os.chown(paths.console_dir / "current", uid, uid)
    assert Engine.console_tail(paths) == "boot line"

    # Its disk and console folder are the server's, written through its group: the VMM can
    # neither remove nor rename them (sticky folder).
    assert paths.disk.stat().st_gid == uid and paths.disk.stat().st_mode & 0o777 == 0o660
    as_vmm(uid, f"echo x >> {paths.disk}")
    as_vmm(uid, f"cd {paths.dir}; rm -f disk.qcow2", ok=False)
    as_vmm(uid, f"cd {paths.dir}; mv console console.old", ok=False)
    # What multilog (as the VMM's uid) writes is its own: it swaps that for a link.
    as_vmm(uid, f"cd {paths.dir}; rm -f console/current; ln -s {sentinel} console/current")
    assert Engine.console_tail(paths) == "no console output"
    # A disk swapped all the same (an older layout gave the VMM its disk) is never followed.
    paths.disk.unlink()
    paths.disk.symlink_to(sentinel)
    assert process.tail(paths.disk) == ""
    with pytest.raises(OSError):
        confine.prepare("sb-links", paths, vcpus=1, memory_mib=64, accel="tcg", reads=[],
                        owned=[paths.disk])
    with pytest.raises(OSError):
        safefs.copy_out(paths.dir, "disk.qcow2", tmp_path / "snapshot-disk")
    assert not (tmp_path / "snapshot-disk").exists()

    # Its console folder swapped for a link to a host folder: not given to the VMM.
    paths.console_dir.rename(paths.dir / "console.old")
    paths.console_dir.symlink_to(host)
    with pytest.raises(OSError):
        confine.console_argv(paths)
    assert Engine.console_tail(paths) == "no console output"
    assert (host.stat().st_uid, host.stat().st_mode) == (before_dir.st_uid, before_dir.st_mode)

    # Names the server writes: a link the VMM made first is replaced, never written through.
    as_vmm(uid, f"cd {paths.dir}; ln -s {sentinel} vmm.pid")
    safefs.replace_file(paths.dir, "vmm.pid", b"4242\n")
    assert not paths.pid_file.is_symlink() and paths.pid_file.stat().st_uid == 0
    assert process.read_pid(paths.pid_file) == 4242
    as_vmm(uid, f"cd {paths.dir}; rm -f vmm.log; ln -s {sentinel} vmm.log")
    with pytest.raises(OSError):
        safefs.open_append(paths.dir, "vmm.log")

    # Removal: the folder goes, the sentinels stay.
    engine = QemuEngine("tcg", confine=confine)
    asyncio.run(engine._cleanup(paths, None))
    assert not paths.dir.exists()
    assert fingerprint(sentinel) == before
    assert sorted(os.listdir(host)) == ["secret"]
    assert confine.uids.lookup(paths.dir) is None
