"""Class 1 (security round 3): root acts only on what it opened itself.

The split server owns its data directory, so a compromised server may swap
any name there for a symlink at any moment. Each test here plays that
server against the real root helper (``hangar.roothelper.Helper``, driven
through its request table as ``tests/test_privsep.py`` does, with real
QEMU, ``vmm_exec`` and Firecracker's jailer preparation) or a real root CLI,
swaps a name for a symlink (before the request, between two requests, or
all the time from a thread), and asserts that root refused and that nothing
outside was touched: ``outside`` keeps its owner, mode, content and
entries. One test per request of the helper's table that touches a path,
one per root CLI path (``hand_new`` of the image and template builds,
``hangar backup``), and the uid ranges.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import SRC, wait_for
from hangar.engines.confine import ConfineConfig, Confinement
from hangar.engines.qemu.argv import SECCOMP
from hangar.errors import ConfigError
from hangar.layout import Layout

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the root helper runs as root")

QEMU = shutil.which("qemu-system-x86_64") or "/usr/bin/qemu-system-x86_64"
OWNER = 999  # the server's uid in these tests (the helper's owner_uid)


class Outside:
    """A folder of root's outside the data directory, with a secret file, that a
    compromised server points its symlinks at; ``untouched`` says nothing changed."""

    def __init__(self, root: Path) -> None:
        self.dir = root / "outside"
        self.dir.mkdir(mode=0o700)
        self.secret = self.dir / "secret"
        self.secret.write_text("root's own\n")
        os.chmod(self.secret, 0o600)
        self.before = self._state()

    def _state(self) -> Any:
        def one(p: Path) -> tuple[int, int, int]:
            st = os.lstat(p)
            return st.st_uid, st.st_gid, st.st_mode

        return (one(self.dir), one(self.secret), self.secret.read_text(),
                sorted(os.listdir(self.dir)))

    def untouched(self) -> None:
        assert self._state() == self.before, (self.before, self._state())


@pytest.fixture()
def world(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A data directory with one image (``images/img`` -> ``img-1``) and one sandbox
    folder (``sb-a``, with a ``disk``), a helper over it, and an ``Outside``."""
    from hangar.roothelper import Helper

    layout = Layout(tmp_path / "data")
    layout.ensure()
    img = layout.images / "img-1"
    img.mkdir()
    (img / "vmlinuz").write_text("kernel")
    os.chmod(img / "vmlinuz", 0o600)
    (layout.images / "img").symlink_to("img-1")
    sb = layout.sandboxes / "sb-a"
    sb.mkdir()
    (sb / "disk").write_text("disk")
    confine = Confinement(ConfineConfig(uid_registry=tmp_path / "uids", cgroups="off"))
    helper = Helper(layout, confine, OWNER, QEMU)
    out = Outside(tmp_path)
    try:
        yield {"layout": layout, "helper": helper, "outside": out, "sb": sb, "img": img}
    finally:
        helper.answer(b'{"op": "release_vmm", "sandbox_id": "sb-a"}', [])
        for pid in list(helper.procs._children):
            try:
                os.kill(pid, 9)
            except OSError:
                pass
        helper.reap()


def ask(helper: Any, **req: Any) -> dict[str, Any]:
    return helper.answer(json.dumps(req).encode(), [])


def prepare(w: dict[str, Any], **over: Any) -> dict[str, Any]:
    req = {"op": "prepare_vmm", "sandbox_id": "sb-a", "vcpus": 1, "memory_mib": 64,
           "accel": "tcg", "tcg_cache_mib": 16,
           "reads": [str(w["layout"].images / "img")], "owned": ["disk"], **over}
    return ask(w["helper"], **req)


def spawn(w: dict[str, Any]) -> dict[str, Any]:
    return ask(w["helper"], op="spawn_vmm", sandbox_id="sb-a",
               argv=[QEMU, "-sandbox", SECCOMP, "-version"])


def swap(name: Path, target: Path) -> Path:
    """Play the server: move ``name`` aside and put a symlink to ``target`` in its place;
    returns where the original went."""
    aside = name.with_name(name.name + ".aside")
    os.rename(name, aside)
    name.symlink_to(target)
    return aside


# -- prepare_vmm -------------------------------------------------------------------------


def test_prepare_vmm_refuses_a_sandbox_folder_swapped_for_a_symlink(world: dict[str, Any]
                                                                     ) -> None:
    swap(world["sb"], world["outside"].dir)
    got = prepare(world)
    assert got["ok"] is False and "is not a sandbox folder" in got["error"], got
    world["outside"].untouched()


def test_prepare_vmm_refuses_a_sandboxes_folder_swapped_for_a_symlink(
        world: dict[str, Any]) -> None:
    """``<data>/sandboxes`` itself is the server's: a symlink there is never followed,
    even to a folder that holds a real ``sb-a``."""
    out = world["outside"]
    shutil.copytree(world["sb"], out.dir / "sb-a")
    out.before = out._state()
    swap(world["layout"].sandboxes, out.dir)
    got = prepare(world)
    assert got["ok"] is False and "is not a sandbox folder" in got["error"], got
    out.untouched()
    assert os.lstat(out.dir / "sb-a").st_uid == 0


def test_prepare_vmm_refuses_an_owned_file_swapped_for_a_symlink(world: dict[str, Any]
                                                                 ) -> None:
    (world["sb"] / "disk").unlink()
    (world["sb"] / "disk").symlink_to(world["outside"].secret)
    got = prepare(world)
    assert got["ok"] is False and "Too many levels of symbolic links" in got["error"], got
    world["outside"].untouched()


def test_prepare_vmm_refuses_an_image_folder_swapped_for_a_symlink(world: dict[str, Any]
                                                                   ) -> None:
    swap(world["img"], world["outside"].dir)
    got = prepare(world)
    assert got["ok"] is False and "is not an image folder" in got["error"], got
    world["outside"].untouched()


def test_prepare_vmm_changes_no_mode_through_a_link_in_an_image_folder(
        world: dict[str, Any]) -> None:
    """The image's files are made readable to the VMM through descriptors: a link the
    server put among them is left alone, its target keeps its mode."""
    (world["img"] / "initrd").symlink_to(world["outside"].secret)
    got = prepare(world)
    assert got["ok"] is True, got
    assert stat.S_IMODE(os.stat(world["img"] / "vmlinuz").st_mode) == 0o644
    world["outside"].untouched()


@pytest.mark.parametrize("name", [".view", "console"])
def test_prepare_vmm_refuses_its_view_or_console_folder_swapped_for_a_symlink(
        world: dict[str, Any], name: str) -> None:
    (world["sb"] / name).symlink_to(world["outside"].dir)
    got = prepare(world)
    assert got["ok"] is False and "symbolic links" in got["error"], got
    world["outside"].untouched()


def test_prepare_vmm_writes_no_cgroup_file_through_a_symlink(tmp_path: Path) -> None:
    """With cgroups on, ``vmm.cgroup`` is written as a new file renamed over the name:
    a symlink the server put there is replaced, its target never written."""
    from hangar.roothelper import Helper

    confine = Confinement(ConfineConfig(uid_registry=tmp_path / "uids"))
    if confine.hierarchy is None:
        pytest.fail(f"no cgroup hierarchy on this host: {confine.measures()[2].reason}")
    layout = Layout(tmp_path / "data")
    layout.ensure()
    (layout.images / "img-1").mkdir()
    sb = layout.sandboxes / "sb-cg"
    sb.mkdir()
    out = Outside(tmp_path)
    (sb / "vmm.cgroup").symlink_to(out.secret)
    helper = Helper(layout, confine, OWNER, QEMU)
    got = helper.answer(json.dumps({
        "op": "prepare_vmm", "sandbox_id": "sb-cg", "vcpus": 1, "memory_mib": 64,
        "accel": "tcg", "tcg_cache_mib": 16, "reads": [str(layout.images / "img-1")],
        "owned": []}).encode(), [])
    try:
        assert got["ok"] is True, got
        assert not (sb / "vmm.cgroup").is_symlink()
        out.untouched()
    finally:
        assert helper.answer(b'{"op": "release_vmm", "sandbox_id": "sb-cg"}', [])["ok"]
    assert not any(Path(d).exists() for d in (sb / "vmm.cgroup").read_text().split())


def test_prepare_vmm_races_a_server_that_swaps_the_folder_all_the_time(
        world: dict[str, Any]) -> None:
    """Between check and use: a thread swaps ``sb-a`` and a symlink to ``outside`` as
    fast as it can while the helper prepares again and again. Whichever it opened, it
    acted on a real sandbox folder only: ``outside`` is never touched."""
    sb, out = world["sb"], world["outside"]
    link = sb.with_name("sb-a.link")
    link.symlink_to(out.dir)
    real = sb.with_name("sb-a.real")
    stop = threading.Event()

    def flip() -> None:
        while not stop.is_set():
            os.rename(sb, real)
            os.rename(link, sb)  # now a symlink
            os.rename(sb, link)
            os.rename(real, sb)

    t = threading.Thread(target=flip)
    t.start()
    answers = []
    try:
        for _ in range(200):
            answers.append(prepare(world)["ok"])
            ask(world["helper"], op="release_vmm", sandbox_id="sb-a")
    finally:
        stop.set()
        t.join()
    out.untouched()
    assert False in answers  # the race was run (some refused) ...
    assert os.lstat(link).st_uid == 0 and stat.S_ISLNK(os.lstat(link).st_mode)


# -- spawn_vmm ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["vmm.log", "vmm.pid"])
def test_spawn_vmm_writes_no_log_or_pid_through_a_symlink_put_after_prepare(
        world: dict[str, Any], name: str) -> None:
    assert prepare(world)["ok"] is True
    (world["sb"] / name).unlink(missing_ok=True)
    (world["sb"] / name).symlink_to(world["outside"].secret)
    got = spawn(world)
    world["outside"].untouched()
    if name == "vmm.log":  # opened to append: refused
        assert got["ok"] is False and "symbolic links" in got["error"], got
    else:  # written as a new file renamed over the link
        assert got["ok"] is True, got
        assert not (world["sb"] / name).is_symlink()


def test_spawn_vmm_refuses_a_folder_swapped_after_prepare(world: dict[str, Any]) -> None:
    assert prepare(world)["ok"] is True
    swap(world["sb"], world["outside"].dir)
    got = spawn(world)
    assert got["ok"] is False and "is not a sandbox folder" in got["error"], got
    world["outside"].untouched()


def test_spawn_vmm_binds_only_the_image_folder_it_opened(world: dict[str, Any]) -> None:
    """The image's folder is swapped for a symlink to ``outside`` after prepare:
    ``vmm_exec`` binds by name, then checks the bind against the folder the helper
    opened, and refuses to start the VMM with the other folder in its view."""
    assert prepare(world)["ok"] is True
    swap(world["img"], world["outside"].dir)
    got = spawn(world)
    assert got["ok"] is True, got
    log = world["sb"] / "vmm.log"
    text = wait_for(lambda: log.exists() and "vmm_exec" in log.read_text() and log.read_text(),
                    120, "vmm_exec's refusal")
    assert "is not the folder that was opened" in text, text
    current = world["sb"] / "console" / "current"
    assert not current.exists() or "QEMU emulator" not in current.read_text()
    world["outside"].untouched()


def test_spawn_vmm_starts_a_vmm_that_was_not_swapped(world: dict[str, Any]) -> None:
    """The same steps without a swap start QEMU (its version on the console)."""
    assert prepare(world)["ok"] is True
    assert spawn(world)["ok"] is True
    current = world["sb"] / "console" / "current"
    wait_for(lambda: current.exists() and "QEMU emulator" in current.read_text(), 120,
             "QEMU's version on the console")


# -- release_vmm -------------------------------------------------------------------------


def test_release_vmm_removes_only_the_cgroups_it_made(world: dict[str, Any],
                                                      tmp_path: Path) -> None:
    """``vmm.cgroup`` lies in the server's folder (and a restart's hand-over makes it the
    server's): the helper never reads it, and removes only the folders of its hierarchy
    made for that sandbox, whatever the file names (the server's own file, a link to a
    file of root's, or a file of root's)."""
    decoy = tmp_path / "decoy"
    decoy.mkdir()
    helper = world["helper"]
    helper.confine.hierarchy = type("H", (), {"bases": (tmp_path / "cg",)})()
    (tmp_path / "cg").mkdir()
    other = tmp_path / "cg" / "sb-other"
    other.mkdir()
    cg = world["sb"] / "vmm.cgroup"
    cg.write_text(f"{decoy}\n{other}\n")
    os.chown(cg, OWNER, OWNER)  # the server's own file
    assert ask(helper, op="release_vmm", sandbox_id="sb-a")["ok"] is True
    assert decoy.is_dir() and other.is_dir()
    cg.unlink()
    root_file = tmp_path / "root-file"
    root_file.write_text(f"{decoy}\n")
    cg.symlink_to(root_file)
    assert ask(helper, op="release_vmm", sandbox_id="sb-a")["ok"] is True
    assert decoy.is_dir()
    cg.unlink()
    cg.write_text(f"{decoy}\n{other}\n{tmp_path / 'cg' / 'sb-a'}\n")  # root's, but not its
    (tmp_path / "cg" / "sb-a").mkdir()
    assert ask(helper, op="release_vmm", sandbox_id="sb-a")["ok"] is True
    assert decoy.is_dir() and other.is_dir()
    assert not (tmp_path / "cg" / "sb-a").exists()  # its own went


# -- the jailer's requests ---------------------------------------------------------------


@pytest.fixture()
def jailed(world: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    from hangar.engines.firecracker.hostjail import HostJail
    from hangar.engines.firecracker.jailer import JailerConfig
    from hangar.roothelper import Helper

    base = tmp_path / "jails"
    config = JailerConfig(binary=Path("/nonexistent/jailer"), chroot_base=base,
                          uid_registry=tmp_path / "uids", cgroups="off")
    jail = HostJail(config, Path("/nonexistent/firecracker"), OWNER)
    helper = Helper(world["layout"], Confinement(ConfineConfig(
        uid_registry=tmp_path / "uids", cgroups="off")), OWNER, QEMU, jail=jail)
    return {**world, "helper": helper, "jail": jail,
            "root": base / "firecracker" / "hangar-sb-a" / "root"}


def test_jail_prepare_refuses_a_sandbox_folder_swapped_for_a_symlink(
        jailed: dict[str, Any]) -> None:
    swap(jailed["sb"], jailed["outside"].dir)
    got = ask(jailed["helper"], op="jail_prepare", sandbox_id="sb-a")
    assert got["ok"] is False and "is not a sandbox folder" in got["error"], got
    jailed["outside"].untouched()


def test_jail_link_follows_no_symlink_to_its_source_or_target(jailed: dict[str, Any]
                                                              ) -> None:
    h = jailed["helper"]
    assert ask(h, op="jail_prepare", sandbox_id="sb-a")["ok"] is True
    kernel = str(jailed["layout"].images / "img-1" / "vmlinuz")
    via_link = str(jailed["layout"].images / "img" / "vmlinuz")  # images/img is a link
    got = ask(h, op="jail_link", sandbox_id="sb-a", links=[[via_link, "vmlinux"]])
    assert got["ok"] is False and "symbolic links" in got["error"], got
    (jailed["root"] / "vmlinux").symlink_to(jailed["outside"].secret)  # the server's
    got = ask(h, op="jail_link", sandbox_id="sb-a", links=[[kernel, "vmlinux"]])
    assert got["ok"] is False and "File exists" in got["error"], got
    (jailed["root"] / "vmlinux").unlink()
    assert ask(h, op="jail_link", sandbox_id="sb-a", links=[[kernel, "vmlinux"]])["ok"]
    assert os.stat(jailed["root"] / "vmlinux").st_ino == os.stat(kernel).st_ino
    jailed["outside"].untouched()


def test_jail_spawn_gives_and_writes_nothing_through_a_symlink(jailed: dict[str, Any]
                                                               ) -> None:
    h, root = jailed["helper"], jailed["root"]
    assert ask(h, op="jail_prepare", sandbox_id="sb-a")["ok"] is True
    (root / "firecracker.log").symlink_to(jailed["outside"].secret)
    (root / "disk.ext4").write_text("disk")
    got = ask(h, op="jail_spawn", sandbox_id="sb-a", vcpus=1, memory_mib=64)
    assert got["ok"] is False and "symbolic links" in got["error"], got
    (root / "firecracker.log").unlink()
    (root / "firecracker.log").write_text("")
    (jailed["sb"] / "vmm.log").symlink_to(jailed["outside"].secret)
    got = ask(h, op="jail_spawn", sandbox_id="sb-a", vcpus=1, memory_mib=64)
    assert got["ok"] is False and "symbolic links" in got["error"], got
    jailed["outside"].untouched()


def test_jail_spawn_clears_what_the_server_planted_for_the_jailer(jailed: dict[str, Any]
                                                                 ) -> None:
    """REVIEW29d D-H1: the jailer (Firecracker 1.12's) copies its binary to
    ``root/firecracker`` as root without ``O_NOFOLLOW`` and makes ``dev/`` there; before it
    runs, the root is closed to the server's group and everything but the linked files,
    the log and the disk is removed, nothing followed or opened."""
    h, root, out = jailed["helper"], jailed["root"], jailed["outside"]
    assert ask(h, op="jail_prepare", sandbox_id="sb-a")["ok"] is True
    (root / "firecracker.log").write_text("")
    (root / "disk.ext4").write_text("disk")
    (root / "firecracker").symlink_to(out.secret)
    (root / "dev").symlink_to(out.dir)
    os.mkfifo(root / "run")
    got = ask(h, op="jail_spawn", sandbox_id="sb-a", vcpus=1, memory_mib=64)
    assert got["ok"] is False, got  # the jailer named here does not exist
    assert sorted(os.listdir(root)) == ["disk.ext4", "firecracker.log"]
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o711
    out.untouched()


def test_jail_release_removes_the_jail_without_following_its_links(
        jailed: dict[str, Any]) -> None:
    h, root = jailed["helper"], jailed["root"]
    assert ask(h, op="jail_prepare", sandbox_id="sb-a")["ok"] is True
    (root / "escape").symlink_to(jailed["outside"].dir)
    assert ask(h, op="jail_release", sandbox_id="sb-a")["ok"] is True
    assert not root.exists()
    jailed["outside"].untouched()


# -- uid ranges --------------------------------------------------------------------------


def test_uid_ranges_of_builds_and_vmms_do_not_overlap(tmp_path: Path) -> None:
    """QEMU's VMMs, jailed Firecracker VMMs and image builds each have their own uids;
    the helper refuses to start with ranges that overlap."""
    from hangar.engines.firecracker.hostjail import HostJail
    from hangar.engines.firecracker.jailer import JailerConfig
    from hangar.images.confined import UID_BASE, UID_COUNT
    from hangar.roothelper import Helper, check_disjoint

    qemu, fc = ConfineConfig(), JailerConfig(binary=Path("/x"))
    check_disjoint({"qemu": (qemu.uid_base, qemu.uid_count), "builds": (UID_BASE, UID_COUNT),
                    "firecracker": (fc.uid_base, fc.uid_count)})
    with pytest.raises(ConfigError, match="overlap"):
        check_disjoint({"a": (300_000, 65_536), "b": (365_535, 10)})
    layout = Layout(tmp_path / "data")
    layout.ensure()
    bad = HostJail(JailerConfig(binary=Path("/x"), uid_base=UID_BASE + 10,
                                chroot_base=tmp_path / "jails"), Path("/x"), OWNER)
    with pytest.raises(ConfigError, match="image builds"):
        Helper(layout, Confinement(ConfineConfig(uid_registry=tmp_path / "u")), OWNER, QEMU,
               jail=bad)


# -- root CLIs ---------------------------------------------------------------------------


def test_hand_new_chowns_nothing_through_a_swapped_image_cache(tmp_path: Path) -> None:
    """``hangar image build``/``template build`` hand a new build to a split server's
    user: the walk starts at the data directory and follows no symlink the server put
    on the way (its ``images`` folder swapped for a link to ``outside``)."""
    from hangar.privileged.split import hand_new

    data = tmp_path / "data"
    (data / "images" / "b-1" / "template-snapshots" / "t").mkdir(parents=True)
    (data / "images" / "b-1" / "template-snapshots" / "t" / "mem").write_text("m")
    os.chown(data, OWNER, OWNER)
    out = Outside(tmp_path)
    (out.dir / "b-1").mkdir()
    out.before = out._state()
    aside = swap(data / "images", out.dir)
    with pytest.raises(OSError, match="symlink|symbolic"):
        hand_new(data, data / "images" / "b-1")
    out.untouched()
    assert os.stat(out.dir / "b-1").st_uid == 0
    (data / "images").unlink()
    os.rename(aside, data / "images")
    hand_new(data, data / "images" / "b-1")
    snap = data / "images" / "b-1" / "template-snapshots" / "t"
    assert os.stat(snap).st_uid == OWNER
    assert os.stat(snap / "mem").st_uid == 0 and os.stat(snap / "mem").st_gid == OWNER


def split_data(tmp_path: Path) -> tuple[Layout, Outside]:
    """A data directory as a split server has it (``<data>``, ``images``, ``cache`` and
    ``cache/build`` its user's), and an ``Outside``."""
    layout = Layout(tmp_path / "data")
    layout.ensure()
    layout.build_cache.mkdir()
    for p in (layout.root, layout.images, layout.cache, layout.build_cache):
        os.chown(p, OWNER, OWNER)
    return layout, Outside(tmp_path)


def test_image_build_stages_where_a_swapped_name_reaches_nothing(tmp_path: Path) -> None:
    """``hangar image build`` as root beside a split server: its staging folder
    (``images/.staging-*``) and work tree (``cache/build/*``) are root's own, held by
    descriptor. The server swaps both names for symlinks to ``outside`` after they were
    made; what the build's tools then write (``mkfs.ext4`` packing the tree, ``cp``, a
    file written by path) lands in root's folders, never in ``outside``; publishing
    refuses the swapped staging name, and the clean-up removes root's folders' contents
    only. A build lock or ``images`` swapped for a symlink is refused, nothing truncated."""
    from hangar.errors import ImageError
    from hangar.images.catalogue import image_lock
    from hangar.images.packing import pack, tree_size
    from hangar.images.staging import PRIVATE_ROOT, BuildRoom
    from hangar.layout import ImagePaths

    layout, out = split_data(tmp_path)
    tree = tmp_path / "tree"
    (tree / "etc").mkdir(parents=True)
    (tree / "etc" / "hostname").write_text("guest\n")
    room = BuildRoom(layout, "base", "base-r-")
    bind = room.work
    try:
        stage_aside = swap(layout.images / room.stage_name, out.dir)
        work_aside = swap(layout.build_cache / room.work_name, out.dir)
        assert str(room.work).startswith(f"{PRIVATE_ROOT}/")  # a path of root's chain
        content, inodes = tree_size(tree)
        pack(tree, ImagePaths(room.stage).rootfs, content, inodes, lambda _m: None)
        subprocess.run(["cp", "-a", str(tree), str(room.work / "root")], check=True)
        (room.stage / "manifest.json").write_text("{}")
        out.untouched()
        assert (stage_aside / "rootfs.ext4").stat().st_size > 0
        assert (work_aside / "root" / "etc" / "hostname").read_text() == "guest\n"
        with pytest.raises(ImageError, match="swapped"):
            room.publish("base-000000000001")
        assert (layout.images / "base-000000000001").is_symlink()  # moved, not followed
        out.untouched()
    finally:
        room.close()
    out.untouched()
    assert os.listdir(stage_aside) == [] and os.listdir(work_aside) == []
    assert not bind.exists() and str(bind) not in Path("/proc/self/mountinfo").read_text()
    # the build lock swapped for a link to root's secret: refused, not truncated
    (layout.images / ".base.lock").symlink_to(out.secret)
    with pytest.raises(OSError, match="symbolic|symlink"):
        with image_lock(layout, "base"):
            pass
    out.untouched()
    # ``images`` itself swapped: no room is made anywhere
    (layout.images / ".base.lock").unlink()
    swap(layout.images, out.dir)
    with pytest.raises(OSError, match="symlink|symbolic"):
        BuildRoom(layout, "base", "base-r-")
    out.untouched()


def test_image_build_takes_the_build_caches_back(tmp_path: Path) -> None:
    """The build caches (``<data>/cache``: .debs, lists, the apt lock, work trees) are
    root's: an earlier Hangar handed them to the server, whose links there (a .deb, the
    apt lock pointing at root's secret) a build removes before any tool runs, and whose
    files it gives back to root; the apt lock is then taken without following a link or
    truncating; a cached kernel .deb that apt's index does not list is not used."""
    from hangar.images.debian import flock
    from hangar.images.kernel import listed_debs
    from hangar.images.staging import BuildRoom

    layout, out = split_data(tmp_path)
    layout.debs_cache.mkdir()
    (layout.debs_cache / "linux-image-cloud-amd64_1_amd64.deb").symlink_to(out.secret)
    (layout.debs_cache / "linux-image-cloud-amd64_2_amd64.deb").write_bytes(b"not Debian's")
    layout.apt_lock.symlink_to(out.secret)
    for p in (layout.debs_cache, layout.debs_cache / "linux-image-cloud-amd64_2_amd64.deb"):
        os.chown(p, OWNER, OWNER)
    with BuildRoom(layout, "base", "base-r-") as room:
        debs = room.cached(layout.debs_cache)
        assert sorted(os.listdir(debs)) == ["linux-image-cloud-amd64_2_amd64.deb"]
        assert not os.path.lexists(room.cached(layout.apt_lock))
        for p in (layout.cache, layout.debs_cache, debs / "linux-image-cloud-amd64_2_amd64.deb"):
            st = os.stat(p)
            assert (st.st_uid, st.st_gid) == (0, 0) and not st.st_mode & 0o022, p
        with flock(room.cached(layout.apt_lock)):
            pass
        assert listed_debs("linux-image-cloud-amd64", debs) == set()
    (layout.cache / ".apt.lock").unlink()
    (layout.cache / ".apt.lock").symlink_to(out.secret)
    with pytest.raises(OSError, match="symbolic|symlink"):
        with flock(layout.apt_lock):
            pass
    out.untouched()


def test_image_build_publishes_only_the_folder_it_staged(tmp_path: Path) -> None:
    """Unswapped, the staging folder becomes ``images/<id>`` (checked after the rename to
    be the very folder staged), readable, and the ``<name>`` link points at it."""
    from hangar.images.catalogue import point_symlink
    from hangar.images.staging import BuildRoom

    layout, out = split_data(tmp_path)
    with BuildRoom(layout, "base", "base-r-") as room:
        (room.stage / "vmlinuz").write_text("k")
        assert room.publish("base-000000000002")
    final = layout.images / "base-000000000002"
    assert (final / "vmlinuz").read_text() == "k" and stat.S_IMODE(final.stat().st_mode) == 0o755
    point_symlink(layout, "base", final)
    assert os.readlink(layout.images / "base") == final.name
    assert not list(layout.images.glob(".staging-*")) and os.listdir(layout.build_cache) == []
    out.untouched()


def test_template_build_reads_its_base_only_by_descriptor(tmp_path: Path) -> None:
    """``hangar template build`` copies its base build (``images/<base id>``, a folder of
    the server's) through descriptors: the base's rootfs is put on a loop device by its
    descriptor and mounted read-only, its kernel and modules copied from descriptors. A
    base kernel swapped for a link to root's secret is refused; a link put in its modules
    tree is copied as a link, never followed; the template's own staging and work folders
    are root's (``BuildRoom``), as for an image build."""
    from hangar.images.guest_image import GuestImage
    from hangar.images.packing import pack, tree_size
    from hangar.images.staging import BuildRoom
    from hangar.images.template_builder import _copy_base
    from hangar.layout import ImagePaths

    layout, out = split_data(tmp_path)
    tree = tmp_path / "tree"
    (tree / "etc").mkdir(parents=True)
    (tree / "etc" / "os-release").write_text("ID=test\n")
    base = ImagePaths(layout.images / "t-000000000001")
    (base.modules / "6.1.0-x" / "kernel").mkdir(parents=True)
    (base.modules / "6.1.0-x" / "modules.dep").write_text("")
    (base.modules / "6.1.0-x" / "kernel" / "a.ko").write_bytes(b"ko")
    (base.modules / "6.1.0-x" / "build").symlink_to(out.dir)  # the server's link
    content, inodes = tree_size(tree)
    pack(tree, base.rootfs, content, inodes, lambda _m: None)
    base.kernel.write_bytes(b"kernel")
    for d in (base.dir, base.modules, base.modules / "6.1.0-x"):
        os.chown(d, OWNER, OWNER)  # as give_images leaves a build: folders the server's
    image = GuestImage(name="t", digest="000000000001", dir=base.dir, kernel=base.kernel,
                       initrd=base.dir / "initrd.img", rootfs=base.rootfs,
                       kernel_version="6.1.0-x")
    with BuildRoom(layout, "child", "child-r-") as room:
        _copy_base(layout, image, room.work / "root", room.work, room.stage)
        assert (room.work / "root" / "etc" / "os-release").read_text() == "ID=test\n"
        got = ImagePaths(room.stage)
        assert got.kernel.read_bytes() == b"kernel"
        assert (got.modules / "6.1.0-x" / "kernel" / "a.ko").read_bytes() == b"ko"
        assert os.readlink(got.modules / "6.1.0-x" / "build") == str(out.dir)
    aside = swap(base.kernel, out.secret)
    with BuildRoom(layout, "child", "child-r-") as room:
        with pytest.raises(OSError, match="symbolic|symlink"):
            _copy_base(layout, image, room.work / "root", room.work, room.stage)
        assert not ImagePaths(room.stage).kernel.exists()
    base.kernel.unlink()
    os.rename(aside, base.kernel)
    swap(base.rootfs, out.secret)
    with BuildRoom(layout, "child", "child-r-") as room:
        with pytest.raises(OSError, match="symbolic|symlink"):
            _copy_base(layout, image, room.work / "root", room.work, room.stage)
    out.untouched()
    assert not list(layout.images.glob(".staging-*")) and os.listdir(layout.build_cache) == []


def test_image_gc_removes_only_through_descriptors(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """``hangar image gc`` as root beside a split server: a build the server swaps for a
    symlink to ``outside`` between gc's checks and the removal is renamed and unlinked as
    a link, never followed; leftovers (``.staging-*``, ``.trash-*``) that are links are
    unlinked; a link inside a build removed is not followed. ``outside`` is untouched."""
    from hangar.images import gc

    layout, out = split_data(tmp_path)
    (out.dir / "base-000000000005").mkdir()  # a look-alike the swap points at
    (out.dir / "base-000000000005" / "manifest.json").write_text("root's")
    out.before = out._state()

    def build(digest: str, built_at: float) -> Path:
        d = layout.images / f"base-{digest}"
        (d / "modules").mkdir(parents=True)
        (d / "modules" / "6.1.0-x").symlink_to(out.dir)  # the server's link inside
        (d / "rootfs.ext4").write_bytes(b"r")
        (d / "manifest.json").write_text(json.dumps({
            "format": 2, "id": d.name, "name": "base", "digest": digest,
            "recipe_digest": "r", "recipe": {"description": ""},
            "kernel": {"version": "6.1.0-x"}, "sizes": {"rootfs_bytes": 1},
            "built_at": built_at, "build_seconds": {"total": 1}}))
        os.chown(d, OWNER, OWNER)
        return d

    cur = build("000000000001", 2.0)
    (layout.images / "base").symlink_to(cur.name)
    old = build("000000000002", 1.0)
    raced = build("000000000003", 1.5)
    (layout.images / ".staging-base-x1").symlink_to(out.dir)
    (layout.images / ".trash-base-000000000009-1").symlink_to(out.dir)
    real_in_use = gc.in_use

    def in_use(build_dir: Path, opened: set[tuple[int, int]]) -> bool:
        busy = real_in_use(build_dir, opened)
        if build_dir.name == raced.name:  # the server, after gc's checks of this build
            swap(raced, out.dir / "base-000000000005")
        return busy

    monkeypatch.setattr(gc, "in_use", in_use)
    done = gc.collect(layout, set(), only=None)
    assert sorted(i.id for i in done.removed) == [old.name, raced.name]
    assert not old.exists() and not raced.exists() and cur.is_dir()
    assert (layout.images / f"{raced.name}.aside").is_dir()  # the server's, left to it
    assert not [p for p in layout.images.iterdir() if p.name.startswith((".staging", ".trash"))]
    out.untouched()


def test_backup_as_root_follows_no_symlink_of_a_split_data_directory(tmp_path: Path) -> None:
    """``hangar backup`` run by root over a split server's data directory: the copy is
    written through a descriptor of a folder root opened without following the server's
    symlinks (a ``backups`` swapped for a link to a folder of root's is refused), the
    database read must be the regular file opened beside it (one swapped for a link to
    a database of root's is refused, as is a WAL that is a FIFO or a link), and a volume
    image swapped for a link to a file of root's is left out; nothing outside is touched, and the copy of a sound data
    directory is made."""
    import sqlite3

    data = tmp_path / "data"
    (data / "volumes" / "vol-0123456789ab").mkdir(parents=True)
    db = sqlite3.connect(data / "hangar.db")
    db.execute("CREATE TABLE volumes (id TEXT, created_at REAL)")
    db.execute("INSERT INTO volumes VALUES ('vol-0123456789ab', 1)")
    db.execute("CREATE TABLE volume_attachments (volume_id, sandbox_id, read_only)")
    db.execute("CREATE TABLE sandboxes (id, state)")
    db.commit()
    db.close()
    out = Outside(tmp_path)
    private = out.dir / "root.db"
    shutil.copy(data / "hangar.db", private)
    out.before = out._state()
    (data / "volumes" / "vol-0123456789ab" / "volume.ext4").symlink_to(out.secret)
    for p in (data, data / "hangar.db", data / "volumes"):
        os.chown(p, OWNER, OWNER)

    def backup(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "hangar.cli", "backup", *args],
                              capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": str(SRC),
                                   "HANGAR_DATA_DIR": str(data)})

    (data / "backups").symlink_to(out.dir)
    got = backup()
    assert got.returncode == 1 and "cannot write into" in got.stderr, got.stderr
    out.untouched()
    (data / "backups").unlink()
    os.rename(data / "hangar.db", data / "hangar.db.aside")
    (data / "hangar.db").symlink_to(private)
    got = backup()
    assert got.returncode == 1 and "is not the server's database" in got.stderr, got.stderr
    (data / "hangar.db").unlink()
    os.rename(data / "hangar.db.aside", data / "hangar.db")
    # SQLite never opens a name of the server's: a FIFO as the WAL (where SQLite's read
    # of it blocked for ever, review 29d D-L4) or a link to a file of root's is refused
    os.mkfifo(data / "hangar.db-wal")
    got = backup()
    assert got.returncode == 1 and "cannot copy" in got.stderr, got.stderr
    (data / "hangar.db-wal").unlink()
    (data / "hangar.db-wal").symlink_to(out.secret)
    got = backup()
    assert got.returncode == 1 and "cannot copy" in got.stderr, got.stderr
    (data / "hangar.db-wal").unlink()
    got = backup()
    assert got.returncode == 0, got.stderr
    assert "volume vol-0123456789ab not backed up: its image is not a regular file" \
        in got.stderr, got.stderr
    copies = list((data / "backups").glob("hangar-*.db"))
    assert len(copies) == 1
    assert sqlite3.connect(copies[0]).execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    assert not list(copies[0].with_suffix(".volumes").iterdir())
    out.untouched()


def test_the_helper_opens_the_data_directory_itself(world: dict[str, Any]) -> None:
    """The descriptor the helper walks from is the data directory it was given (opened
    when it started), so renaming names inside changes nothing of it."""
    st = os.fstat(world["helper"].data_fd)
    assert (st.st_dev, st.st_ino) == (os.stat(world["layout"].root).st_dev,
                                      os.stat(world["layout"].root).st_ino)


def test_remove_tree_never_opens_a_link_fifo_or_device_put_in_a_folders_place(
        tmp_path: Path) -> None:
    """``beneath.remove_tree`` (image gc's, a build's leftovers') opens each folder with
    ``O_DIRECTORY | O_NOFOLLOW | O_NONBLOCK``: links to a folder, a FIFO and a device
    below the tree are unlinked, never opened or followed (a FIFO opened would hang root;
    review round 3, G12), and what they point at stays."""
    from hangar.privileged import beneath

    outside = tmp_path / "outside"
    (outside / "keep").mkdir(parents=True)
    (outside / "keep" / "f").write_text("kept")
    os.mkfifo(outside / "fifo")
    tree = tmp_path / "tree"
    (tree / "a" / "b").mkdir(parents=True)
    (tree / "a" / "b" / "file").write_text("x")
    (tree / "a" / "to-dir").symlink_to(outside / "keep")
    (tree / "a" / "to-fifo").symlink_to(outside / "fifo")
    os.mkfifo(tree / "a" / "b" / "fifo")
    os.mknod(tree / "a" / "null", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    top = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        beneath.remove_tree(top, "tree")
        beneath.remove_tree(top, "tree")  # a missing name is left alone
        os.symlink(outside / "keep", tmp_path / "tree")
        beneath.remove_tree(top, "tree")  # the name itself a link: unlinked, not followed
    finally:
        os.close(top)
    assert not os.path.lexists(tree)
    assert (outside / "keep" / "f").read_text() == "kept" and (outside / "fifo").exists()


# -- the template snapshot of a root build (review 29b, G3 and G13) ------------------------


def test_root_confines_a_vmm_only_on_an_image_folder_it_opened(tmp_path: Path) -> None:
    """Root's own engine (a build's template VM where the data directory is root's, a root
    server) prepares a VMM's view without a helper: it opens each folder the VMM reads
    itself, never resolving its path, and makes root's files there readable through that
    descriptor. A build folder swapped for a link to a folder of root's 0600 files is
    refused and those files keep their modes; the folder opened is the one the VMM's bind
    must be (``Plan.same``), held until the release."""
    import asyncio

    layout = Layout(tmp_path / "data")
    layout.ensure()
    img = layout.images / "img-1"
    img.mkdir()
    (img / "vmlinuz").write_text("kernel")
    os.chmod(img / "vmlinuz", 0o600)
    paths = layout.sandbox("tpl-0123456789ab")
    paths.dir.mkdir()
    (paths.dir / "disk").write_text("disk")
    out = Outside(tmp_path)
    confine = Confinement(ConfineConfig(uid_registry=tmp_path / "uids", cgroups="off"))
    assert confine.helper is None and confine.view

    def prepare() -> Any:
        return confine.prepare(paths.dir.name, paths, vcpus=1, memory_mib=64, accel="tcg",
                               reads=[img], owned=[paths.dir / "disk"])

    aside = swap(img, out.dir)
    with pytest.raises(OSError, match="symbolic|Not a directory"):
        prepare()
    out.untouched()
    img.unlink()
    os.rename(aside, img)
    try:
        plan = prepare()
        opened = plan.same[str(img)]
        assert opened.startswith(f"/proc/{os.getpid()}/fd/")
        assert os.path.samestat(os.stat(opened), os.stat(img))
        assert (str(img), str(img), False) in plan.binds
        assert stat.S_IMODE(os.stat(img / "vmlinuz").st_mode) == 0o644
    finally:
        asyncio.run(confine.release(paths))
    assert confine._held == {}
    out.untouched()


@pytest.fixture()
def split_copy(base_image: Path, monkeypatch: pytest.MonkeyPatch
               ) -> Iterator[tuple[Layout, Any, tuple[int, int]]]:
    """A data directory as a split server leaves it (handed over to the ``hangar``
    user), with a hard-linked copy of the shared cache's builds and template snapshots;
    the base build as ``image_at`` gives it; the server's uid and gid. The step's
    settings are the suite servers' (no guest NIC)."""
    import pwd

    from conftest import make_data_dir
    from hangar.images.staging import image_at
    from hangar.privileged.split import hand_over

    try:
        pw = pwd.getpwnam("hangar")
    except KeyError:
        pytest.skip("no user hangar (scripts/install.sh makes it)")
    d = make_data_dir(base_image, privsep=True)
    monkeypatch.setenv("HANGAR_DATA_DIR", str(d))
    monkeypatch.setenv("HANGAR_NETWORK", "off")
    monkeypatch.setenv("PYTHONPATH", str(SRC))
    layout = Layout(d)
    layout.ensure()
    hand_over(layout, pw.pw_uid, pw.pw_gid)
    try:
        yield layout, image_at(layout, base_image.name), (pw.pw_uid, pw.pw_gid)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_the_template_step_beside_a_split_server_runs_as_its_user(
        split_copy: tuple[Layout, Any, tuple[int, int]], tmp_path: Path) -> None:
    """``hangar image build``/``template build`` as root beside a split server make the
    build's template snapshot as that server's user, through a root helper of their own
    (``hangar.cli.snapshot_step``): the snapshot found (or made) is the one the server
    restores (same key). Then the server, compromised, plants ``.<key>.lock`` -> a file
    of root's, then ``template-snapshots`` -> a folder of root's (where root itself would
    have made its lock file): the step makes nothing, says so, and root's file and folder
    are untouched; no template VM is left."""
    from hangar.cli import snapshot_step
    from hangar.cli.common import template_snapshot
    from hangar.layout import ImagePaths

    layout, image, (uid, gid) = split_copy
    assert snapshot_step.where(layout, image.id) == (uid, gid)
    said: list[str] = []
    made = snapshot_step.as_server(layout, image, said.append)
    snaps = ImagePaths(image.dir).template_snapshots
    assert made is not None and made.parent == snaps, said
    key = made.name  # the suite's servers' own snapshot: found, not made again
    out = Outside(tmp_path)
    shutil.rmtree(made)  # the server's own folder: it may remove it
    (snaps / f".{key}.lock").unlink(missing_ok=True)
    (snaps / f".{key}.lock").symlink_to(out.secret)
    said.clear()
    template_snapshot(layout, image, said.append)
    assert any("no template snapshot made now" in m for m in said), said
    out.untouched()
    aside = swap(snaps, out.dir)
    said.clear()
    template_snapshot(layout, image, said.append)
    assert any("no template snapshot made now" in m for m in said), said
    out.untouched()
    assert not (out.dir / key).exists() and aside.is_dir()
    assert [p.name for p in layout.sandboxes.iterdir() if p.name.startswith("tpl-")] == []


def test_the_template_step_refuses_a_build_folder_swapped_for_a_link(
        split_copy: tuple[Layout, Any, tuple[int, int]], tmp_path: Path) -> None:
    """The server swaps ``images/<build>`` for a link to a folder of root's 0600 files
    before the step: nothing there is handed over, made readable or written, and the step
    refuses (the server makes the snapshot on its first create). (Swapped after the
    hand-over, the step's own process, the server's user, finds no build there.)"""
    from hangar.cli.common import template_snapshot
    from hangar.errors import EngineError

    layout, image, _ = split_copy
    out = Outside(tmp_path)
    swap(image.dir, out.dir)
    with pytest.raises(EngineError, match="that others may change"):
        template_snapshot(layout, image, lambda _m: None)
    out.untouched()


def test_root_makes_no_template_snapshot_where_another_user_may_write(
        tmp_path: Path) -> None:
    """Where the data directory is root's, root makes the build's template snapshot
    itself, so every folder it works in must be root's alone: a ``sandboxes`` of another
    user, or a ``template-snapshots`` that is a link, is refused before anything is
    opened there."""
    from hangar.cli import snapshot_step

    layout = Layout(tmp_path / "data")
    layout.ensure()
    build = layout.images / "base-0123"
    build.mkdir()
    assert snapshot_step.where(layout, "base-0123") is None
    out = Outside(tmp_path)
    (build / "template-snapshots").symlink_to(out.dir)
    with pytest.raises(OSError, match="symbolic"):
        snapshot_step.where(layout, "base-0123")
    (build / "template-snapshots").unlink()
    os.chown(layout.sandboxes, OWNER, OWNER)
    with pytest.raises(OSError, match="not root's alone"):
        snapshot_step.where(layout, "base-0123")
    os.chown(layout.sandboxes, 0, 0)
    os.chmod(layout.images, 0o777)
    with pytest.raises(OSError, match="not root's alone"):
        snapshot_step.where(layout, "base-0123")
    out.untouched()


def test_root_walks_never_open_a_fifo_or_link_swapped_in_for_a_folder(
        tmp_path: Path) -> None:
    """``beneath.fwalk`` (``give_images``, ``hand_new``, ``hand_over``, ``take_back``)
    opens each subfolder with ``O_DIRECTORY | O_NOFOLLOW | O_NONBLOCK`` relative to its
    parent: a folder the server swaps for a link to a FIFO (or for a FIFO) after it was
    listed is skipped, never opened (Python 3.11's ``os.fwalk`` opened it with plain
    ``O_RDONLY`` and blocked there forever; review 29b, G12), and the rest is walked."""
    from hangar.privileged import beneath
    from hangar.privileged.split import give_images

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    tree = tmp_path / "images"
    for sub in ("a/x", "b/y", "c"):
        (tree / sub).mkdir(parents=True)
    opened: list[bool] = []
    done = threading.Event()

    def watch() -> None:  # a writer can open a FIFO without blocking only while read
        while not done.is_set():
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
                opened.append(True)
            except OSError:
                pass
            time.sleep(0.001)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    top = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    seen: list[tuple[str, ...]] = []
    try:
        for rel, _dirs, _files, _fd in beneath.fwalk(top, "images"):
            seen.append(rel)
            if rel == ():  # listed: now the server swaps two of its folders
                swap(tree / "a", fifo)
                os.rename(tree / "b", tmp_path / "b-aside")
                os.mkfifo(tree / "b")
    finally:
        done.set()
        watcher.join()
        os.close(top)
    assert sorted(seen) == [(), ("c",)] and not opened
    give_images(tree, OWNER, OWNER)  # the whole hand-over: the links and FIFOs left alone
    assert os.stat(tree / "c").st_uid == OWNER and os.stat(fifo).st_uid == 0 and not opened


def test_taking_the_caches_back_never_walks_into_a_build_work_tree(tmp_path: Path) -> None:
    """``split.take_back`` runs at every build's start and every split server's start,
    beside other builds: it removes a symlink or FIFO planted in the build caches and
    makes a work tree of ``cache/build`` root's, but never walks into one, where a
    build in progress has symlinks and FIFOs of its own (an image built beside a server's
    start came out with no symlink in ``/usr/bin``, and so no ``python3``)."""
    from hangar.layout import BUILD_CACHE, Layout
    from hangar.privileged.split import take_back

    assert Layout(tmp_path / "data").build_cache.name == BUILD_CACHE
    cache = tmp_path / "cache"
    (cache / "debootstrap").mkdir(parents=True)
    os.symlink("/etc/passwd", cache / "debootstrap" / "planted.deb")
    os.mkfifo(cache / "fifo")
    work = cache / BUILD_CACHE / "dev-1234"
    (work / "root" / "usr" / "bin").mkdir(parents=True)
    os.symlink("python3.11", work / "root" / "usr" / "bin" / "python3")
    os.mkfifo(work / "root" / "initctl")
    os.chown(work, 65534, 65534)  # handed over by an earlier Hangar
    os.chmod(work, 0o777)
    fd = os.open(cache, os.O_RDONLY | os.O_DIRECTORY)
    try:
        take_back(fd)
    finally:
        os.close(fd)
    assert not os.path.lexists(cache / "debootstrap" / "planted.deb")
    assert not os.path.lexists(cache / "fifo")
    st = os.lstat(work)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 0, 0o755)
    assert os.readlink(work / "root" / "usr" / "bin" / "python3") == "python3.11"
    assert stat.S_ISFIFO(os.lstat(work / "root" / "initctl").st_mode)


def test_a_split_server_start_leaves_a_build_in_progress_roots(tmp_path: Path) -> None:
    """``split.give_images`` (a split server's start) hands the image cache's folders to
    the server's user, but not a build in progress (``.staging-<name>-*``) or one being
    removed (``.trash-*``): root writes there by names below them."""
    from hangar.privileged.split import give_images

    images = tmp_path / "images"
    for d in ("base-1/template-snapshots", ".staging-dev-x", ".trash-base-0-1/sub"):
        (images / d).mkdir(parents=True)
    (images / ".staging-dev-x" / "rootfs.ext4").write_bytes(b"")
    os.chmod(images / ".staging-dev-x", 0o700)
    give_images(images, 65534, 65534)
    assert os.lstat(images / "base-1" / "template-snapshots").st_uid == 65534
    for d in (".staging-dev-x", ".trash-base-0-1", ".trash-base-0-1/sub"):
        st = os.lstat(images / d)
        assert (st.st_uid, st.st_gid) == (0, 0), d
    assert stat.S_IMODE(os.lstat(images / ".staging-dev-x").st_mode) == 0o700
