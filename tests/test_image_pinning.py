"""Immutable image builds: a forced rebuild never moves a disk onto other bytes.

A private data directory gets a copy of the shared ``base`` build (as if the
user had built it earlier) and hard links of the shared debootstrap and
kernel caches (read, never written: debootstrap only adds files, and to the
private directory), so that ``hangar image build --force base`` there is a
real build of about a minute. The shared cache is never rebuilt or collected.

The scenario, on a real server and real VMs: a sandbox, a snapshot of it and a
machine are made on the old build; a forced rebuild makes a new id; the
running sandbox, a restore, a fork and a woken machine stay on the old
build's bytes with the guest's files intact, while new sandboxes get the new
build; with the old build gone, restore, fork and wake answer 409
``image_missing`` and change nothing; ``hangar image gc`` keeps pinned and
current builds and removes the old one once nothing pins it.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from conftest import SHARED, SRC, Server, cleanup, free_port
from hangar.images import get_recipe, resolve_image
from hangar.images.builder import content_digest
from hangar.images.vmlinux import is_x86_64_elf
from hangar.layout import Layout

pytestmark = pytest.mark.vm

BUILD_TIMEOUT_S = 900


class Env:
    def __init__(self, root: Path, server: Server, old_id: str) -> None:
        self.root = root
        self.layout = Layout(root)
        self.server = server
        self.old_id = old_id

    def hangar(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """Run the ``hangar`` CLI on this data directory, as a user would."""
        return subprocess.run(
            [sys.executable, "-m", "hangar.cli", *args, "--data-dir", str(self.root)],
            # the shape of this module's server (no guest networking), as a build for it
            env={**os.environ, "PYTHONPATH": str(SRC), "COLUMNS": "200", "HANGAR_NETWORK": "off"},
            capture_output=True, text=True, timeout=timeout, check=False)

    def backing_build(self, sandbox_id: str) -> str:
        """The image build under a QEMU sandbox's disk (its qcow2 backing file's folder)."""
        out = subprocess.run(["qemu-img", "info", "-U", "--output=json",
                              str(self.layout.sandbox(sandbox_id).disk)],
                             capture_output=True, text=True, check=True).stdout
        return Path(json.loads(out)["full-backing-filename"]).parent.name


@pytest.fixture(scope="module")
def env(base_image: Path) -> Iterator[Env]:
    root = Path(tempfile.mkdtemp(prefix="hgpin-", dir="/tmp"))
    layout = Layout(root)
    layout.ensure()
    shared = resolve_image(Layout(SHARED), "base")
    old = layout.image(shared.id)
    old.dir.mkdir()
    # A build the user made earlier: its bytes and manifest (the initramfs and
    # vmlinux are added on first use, as for any build made before this Hangar).
    for f in (shared.rootfs, shared.kernel, Path(shared.dir) / "manifest.json"):
        subprocess.run(["cp", "--sparse=always", "--reflink=auto", str(f), str(old.dir)],
                       check=True)
    shutil.copytree(Path(shared.dir) / "modules", old.modules, symlinks=True)
    layout.image_link("base").symlink_to(old.id)
    shared_layout = Layout(SHARED)
    for src, dst in ((shared_layout.debootstrap_cache, layout.debootstrap_cache),
                     (shared_layout.debs_cache, layout.debs_cache)):
        if src.is_dir():
            subprocess.run(["cp", "-al", str(src), str(dst)], check=True)
    for f in (shared_layout.qemu_probe_file, shared_layout.firecracker_probe_file):
        if f.exists():
            shutil.copy(f, root / f.name)
    server = Server(root, free_port(), {"HANGAR_ENGINE": "qemu"})
    server.start()
    try:
        yield Env(root, server, old.id)
    finally:
        leaked = cleanup(server)
        shutil.rmtree(root, ignore_errors=True)
        assert not leaked, f"VMM processes outlived the test: {leaked}"


def sh(api: httpx.Client, sid: str, command: str) -> str:
    r = api.post(f"/sandboxes/{sid}/exec", json={"command": command, "timeout": 60})
    assert r.status_code == 200, r.text
    assert r.json()["exit_code"] == 0, r.json()
    return r.json()["stdout"]


def read(api: httpx.Client, sid: str, path: str) -> bytes:
    r = api.get(f"/sandboxes/{sid}/files", params={"path": path})
    assert r.status_code == 200, r.text
    return r.content


def test_force_rebuild_keeps_every_disk_on_its_own_build(env: Env) -> None:
    data = secrets.token_bytes(300_000)  # bytes the old build's rootfs does not have
    with env.server.client() as api:
        # -- made on the old build: a sandbox, its snapshot, a machine ----------------
        r = api.post("/sandboxes", json={})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        assert r.json()["image_id"] == env.old_id
        assert api.put(f"/sandboxes/{sid}/files", params={"path": "/root/pin.bin"},
                       content=data).status_code == 200
        sh(api, sid, "sync")
        r = api.post(f"/sandboxes/{sid}/snapshot")
        assert r.status_code == 201, r.text
        snap = r.json()["id"]
        assert r.json()["image_id"] == env.old_id
        r = api.post("/machines/pin-user", json={"idle_timeout": 3600})
        assert r.status_code == 201, r.text
        msid = r.json()["sandbox_id"]
        sh(api, msid, "echo machine-file > /root/m.txt; sync")

        # -- a forced rebuild makes a new build beside the old one --------------------
        built = env.hangar("image", "build", "base", "--force", timeout=BUILD_TIMEOUT_S)
        assert built.returncode == 0, built.stderr[-3000:]
        new_id = os.readlink(env.layout.image_link("base"))
        assert new_id != env.old_id and new_id.startswith("base-")
        assert built.stdout.split()[0] == new_id
        new = env.layout.image(new_id)
        m = json.loads(new.manifest.read_text())
        assert m["id"] == new_id and m["recipe_digest"] == get_recipe("base").digest()
        assert content_digest(new.dir) == m["sha256"] and new_id == f"base-{m['sha256'][:12]}"
        assert m["kernel"]["vmlinux"]["bytes"] == new.vmlinux.stat().st_size
        assert is_x86_64_elf(new.vmlinux.read_bytes()[:64])  # unpacked at build time
        old = env.layout.image(env.old_id)
        assert old.rootfs.is_file(), "the old build stays while something pins it"
        assert content_digest(old.dir) != m["sha256"]

        # the running sandbox is still on the old bytes, its file intact
        assert env.backing_build(sid) == env.old_id
        assert read(api, sid, "/root/pin.bin") == data

        # -- restore and fork land on the pinned build, files intact ------------------
        sh(api, sid, "echo later > /root/after.txt")
        r = api.post(f"/sandboxes/{sid}/restore", json={"snapshot_id": snap})
        assert r.status_code == 200, r.text
        assert r.json()["image_id"] == env.old_id
        assert env.backing_build(sid) == env.old_id
        assert read(api, sid, "/root/pin.bin") == data
        assert sh(api, sid, "test -e /root/after.txt && echo yes || echo no") == "no\n"
        r = api.post(f"/snapshots/{snap}/sandboxes", json={})
        assert r.status_code == 201, r.text
        fork = r.json()["id"]
        assert env.backing_build(fork) == env.old_id
        assert read(api, fork, "/root/pin.bin") == data
        assert api.delete(f"/sandboxes/{fork}").status_code == 204

        # a new sandbox gets the new build, and it boots
        r = api.post("/sandboxes", json={})
        assert r.status_code == 201, r.text
        fresh = r.json()["id"]
        assert r.json()["image_id"] == new_id and env.backing_build(fresh) == new_id
        assert sh(api, fresh, "echo ok") == "ok\n"
        assert api.delete(f"/sandboxes/{fresh}").status_code == 204

        # the machine sleeps on its build
        r = api.post("/machines/pin-user/snapshot")
        assert r.status_code == 200 and r.json()["state"] == "sleeping", r.text

        # -- gc keeps what is pinned and current --------------------------------------
        dry = env.hangar("image", "gc", "--dry-run")
        assert dry.returncode == 0, dry.stderr
        assert f"kept {env.old_id} (pinned)" in dry.stdout
        assert f"kept {new_id} (current)" in dry.stdout
        assert "would remove 0 build(s)" in dry.stdout
        assert old.rootfs.is_file()

        # -- the pinned build gone (removed by hand): 409, and nothing changes --------
        hidden = env.layout.images / ".moved-away"
        os.replace(old.dir, hidden)
        try:
            r = api.post(f"/sandboxes/{sid}/restore", json={"snapshot_id": snap})
            assert r.status_code == 409 and r.json()["error"]["code"] == "image_missing", r.text
            assert env.old_id in r.json()["error"]["message"]
            assert api.get(f"/sandboxes/{sid}").json()["state"] == "running"
            assert read(api, sid, "/root/pin.bin") == data, "the VM was left as it was"
            before = {s["id"] for s in api.get("/sandboxes").json()["sandboxes"]}
            r = api.post(f"/snapshots/{snap}/sandboxes", json={})
            assert r.status_code == 409 and r.json()["error"]["code"] == "image_missing", r.text
            assert {s["id"] for s in api.get("/sandboxes").json()["sandboxes"]} == before
            r = api.post("/machines/pin-user/wake")
            assert r.status_code == 409 and r.json()["error"]["code"] == "image_missing", r.text
            assert api.get("/machines/pin-user").json()["state"] == "sleeping"
            assert not env.layout.sandbox(msid).dir.exists(), "no disk was made over other bytes"
        finally:
            os.replace(hidden, old.dir)

        # back in place: the machine wakes on its own build with its file
        r = api.post("/machines/pin-user/wake")
        assert r.status_code == 200, r.text
        assert env.backing_build(msid) == env.old_id
        assert sh(api, msid, "cat /root/m.txt") == "machine-file\n"

        # -- once nothing pins it, gc removes the old build, never the current one ----
        assert api.delete("/machines/pin-user").status_code == 204
        assert api.delete(f"/sandboxes/{sid}").status_code == 204
        dry = env.hangar("image", "gc", "--dry-run")
        assert f"kept {env.old_id} (pinned)" in dry.stdout, "the snapshot still pins it"
        assert api.delete(f"/snapshots/{snap}").status_code == 204
        dry = env.hangar("image", "gc", "--dry-run")
        assert f"would remove {env.old_id}" in dry.stdout and old.rootfs.is_file()
        done = env.hangar("image", "gc")
        assert done.returncode == 0, done.stderr
        assert f"removed {env.old_id}" in done.stdout and f"kept {new_id} (current)" in done.stdout
        assert not old.dir.exists() and new.rootfs.is_file()
        assert sorted(p.name for p in env.layout.images.iterdir()
                      if not p.name.startswith(".")) == ["base", new_id]
    assert "unexpected error" not in env.server.log.read_text(), "a call failed with a 500"
