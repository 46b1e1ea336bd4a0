"""Hostile OCI images: what import refuses, and what a template build on one cannot touch.

The archives are OCI image layouts written here with ``tarfile`` (nothing is
normalized: absolute names, ``..``, devices, links out of the tree). Refused
images fail before anything is unpacked. The accepted one has absolute links
that point at sentinel files in a host folder outside the tree; a template on
it (files written through the links, build steps that try the links, /proc/sys,
/dev, a host loopback port and a chroot escape) and a template on that template
(whose build trims the tree) are built for real, and the sentinels' checksums
are the same after. Builds go into the shared image cache under this run's
own names and are removed after.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import stat
import subprocess
import tarfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import SHARED
from oci_support import busybox_rootfs, layer, member, oci_archive, tree_layer

from hangar.errors import InvalidRequest
from hangar.images import confined, oci, oci_check, safetree
from hangar.images.template_builder import build_template, remove_template
from hangar.images.template_file import load_template
from hangar.layout import Layout

NAME = f"t-{os.getpid()}-hostile"
SYM, LNK, DIR = tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.DIRTYPE


def unpack(tmp_path: Path, layers: list[bytes]) -> oci.OciImage:
    oci_archive(tmp_path / "image.tar", layers)
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    return oci.unpack(tmp_path / "image.tar", work, lambda _m: None)


# -- what import refuses (one answer per case) ------------------------------------------------

REFUSED = {
    "character device": ([member("dev/evil", tarfile.CHRTYPE)], "is a device node"),
    "block device": ([member("sda", tarfile.BLKTYPE)], "is a device node"),
    "absolute member": ([member("/etc/passwd", data=b"x")], "is an absolute path"),
    "dot-dot member": ([member("etc/../../outside", data=b"x")], "has a '..' component"),
    "link above the root": ([member("etc", DIR, mode=0o755),
                             member("etc/up", SYM, link="../../../host")],
                            "above the image's root"),
    "hard link out (absolute)": ([member("passwd", LNK, link="/etc/passwd")],
                                 "is a hard link whose target is an absolute path"),
    "hard link out (dot-dot)": ([member("passwd", LNK, link="../../etc/passwd")],
                                "is a hard link whose target has a '..' component"),
    "hard link to nothing made": ([member("passwd", LNK, link="etc/shadow")],
                                  "which no earlier member made a file"),
    "write through a link": ([member("etc", SYM, link="/etc"),
                              member("etc/cron.d/evil", data=b"* * * * * root sh\n")],
                             "which an earlier member made a symbolic link"),
    "hard link through a link": ([member("etc", SYM, link="/etc"),
                                  member("passwd", LNK, link="etc/passwd")],
                                 "which no earlier member made a file"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_import_refuses(tmp_path: Path, case: str) -> None:
    entries, why = REFUSED[case]
    with pytest.raises(InvalidRequest) as e:
        unpack(tmp_path, [layer(entries)])
    assert why in e.value.message, e.value.message
    assert not (tmp_path / "work" / "bundle").exists()  # refused before anything unpacked


def test_a_link_made_in_a_lower_layer_is_known_above(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match="which an earlier member made a symbolic link"):
        unpack(tmp_path, [layer([member("var", SYM, link="/var")]),
                          layer([member("var/lib/evil", data=b"x")])])


def test_a_whiteout_lifts_a_lower_link(tmp_path: Path) -> None:
    """A later layer that removes a link (whiteout) may make a real folder there."""
    image = unpack(tmp_path, [layer([member("run", SYM, link="/var/run")]),
                              layer([member(".wh.run"), member("run", DIR, mode=0o755),
                                     member("run/x", data=b"real\n")])])
    assert (image.rootfs / "run").is_dir() and not (image.rootfs / "run").is_symlink()
    assert (image.rootfs / "run" / "x").read_text() == "real\n"


@pytest.mark.parametrize("bound, value, entries, why", [
    ("MAX_MEMBERS", 3, [member(f"f{i}") for i in range(4)], "more than 3 files"),
    ("MAX_BYTES", 10, [member("big", data=b"x" * 11)], "exceed 10 bytes"),
    ("MAX_PATH", 64, [member("a" * 65)], "is longer than 64 bytes"),
])
def test_import_bounds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bound: str,
                       value: int, entries: list, why: str) -> None:
    monkeypatch.setattr(oci_check, bound, value)
    with pytest.raises(InvalidRequest, match=why):
        unpack(tmp_path, [layer(entries)])


def test_import_bounds_layers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(oci_check, "MAX_LAYERS", 2)
    with pytest.raises(InvalidRequest, match="3 layers, more than 2"):
        unpack(tmp_path, [layer([member(f"f{i}")]) for i in range(3)])


# -- what is accepted, and what a build on it cannot touch -------------------------------------


def checksums(folder: Path) -> dict[str, str]:
    """Every entry below ``folder``: its type, mode, owner and content hash (or target)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        for n in dirnames + filenames:
            p = Path(dirpath) / n
            st = p.lstat()
            what = (os.readlink(p) if p.is_symlink() else
                    hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir")
            out[str(p.relative_to(folder))] = f"{st.st_mode:o} {st.st_uid} {what}"
    return out


@pytest.fixture
def host(tmp_path: Path) -> Path:
    """Sentinel files on the host, outside any tree."""
    h = tmp_path / "host"
    for rel, text in {"passwd": "root:x:0:0::/root:/bin/sh\n", "log/syslog": "host log\n",
                      "doc/README": "host doc\n", "locale/fr/x.mo": "host locale\n",
                      "share/man/man1/a.1": "host man\n", "cron.d/job": "host cron\n"}.items():
        (h / rel).parent.mkdir(parents=True, exist_ok=True)
        (h / rel).write_text(text)
    return h


@pytest.fixture
def listener() -> Iterator[tuple[int, list[str]]]:
    """A host loopback port; what connected to it."""
    seen: list[str] = []
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(0.2)
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                c, _ = srv.accept()
            except OSError:
                continue
            seen.append("connected")
            c.close()
    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        yield srv.getsockname()[1], seen
    finally:
        stop.set()
        t.join()
        srv.close()


def hostile_tree(root: Path, host: Path) -> None:
    """A busybox tree whose links point at the host's sentinels by absolute paths."""
    busybox_rootfs(root, {"/etc/os-release": 'NAME="hostile"\n'})
    (root / "etc" / "passwd").symlink_to(host / "passwd")
    (root / "etc" / "cron.d").symlink_to(host / "cron.d")
    (root / "var").mkdir()
    (root / "var" / "log").symlink_to(host / "log")
    (root / "usr" / "share").mkdir(parents=True)
    (root / "usr" / "share" / "doc").symlink_to(host / "doc")
    (root / "usr" / "share" / "locale").symlink_to(host / "locale")
    (root / "usr" / "share" / "man").symlink_to(host / "share" / "man")
    (root / "srv").symlink_to(host)
    (root / "bin" / "su").unlink()  # busybox's applet link
    (root / "bin" / "su").write_text("#!/bin/sh\n")
    (root / "bin" / "su").chmod(0o4755)  # set-user-ID: kept, it acts in the guest only


def debugfs(image: Path, request: str) -> str:
    return subprocess.run(["debugfs", "-R", request, str(image)], capture_output=True,
                          text=True, timeout=60).stdout


def test_a_template_on_a_hostile_image_changes_nothing_on_the_host(
        tmp_path: Path, host: Path, listener: tuple[int, list[str]]) -> None:
    port, connections = listener
    hostile_tree(tmp_path / "root", host)
    oci_archive(tmp_path / "hostile.tar", [tree_layer(tmp_path / "root")])
    sysctl = Path("/proc/sys/kernel/printk_ratelimit")
    before, sysctl_before = checksums(host), sysctl.read_text()
    assert len(before) >= 9
    probe = (
        "echo pwned > /etc/passwd; echo pwned > /etc/cron.d/job; echo pwned > /var/log/syslog;"
        f"mkdir -p {host} && echo pwned > {host}/passwd;"
        f"echo 77 > {sysctl} 2>/dev/null || echo sysctl-refused >> /probe;"
        "echo x > /dev/sda 2>/dev/null || echo no-sda >> /probe;"
        "mknod /dev/evil b 8 0 2>/dev/null || echo mknod-refused >> /probe;"
        "ls /dev | tr '\\n' ' ' >> /probe; echo >> /probe;"
        f"nc -w 2 127.0.0.1 {port} </dev/null 2>/dev/null || echo no-network >> /probe;"
        "ls /sys 2>/dev/null | wc -l >> /probe;"
        # the root is the tree alone (pivot_root; the host's tree is detached)
        "ls /proc/1/root/ | tr '\\n' ' ' >> /probe; echo >> /probe;"
        "cat /proc/self/uid_map >> /probe; id -u >> /probe; sleep 317 &"
    )
    (tmp_path / "t.toml").write_text(
        f'name = "{NAME}"\noci = "hostile.tar"\n'
        f"steps = ['''{probe}''']\n"
        '[[files]]\ndest = "/etc/passwd"\ncontent = "guest passwd\\n"\n'
        '[[files]]\ndest = "/var/log/app.log"\ncontent = "guest log\\n"\n')
    (tmp_path / "child.toml").write_text(f'name = "{NAME}-child"\nbase = "{NAME}"\n')
    layout = Layout(SHARED)
    try:
        lines: list[str] = []
        image = build_template(layout, load_template(tmp_path / "t.toml"), force=True,
                               progress=lines.append)
        assert any("checked" in ln and "no devices" in ln for ln in lines)
        assert any(f"owned by uid {confined.UID_BASE}+" in ln for ln in lines)
        child = build_template(layout, load_template(tmp_path / "child.toml"), force=True)
        assert checksums(host) == before
        assert sysctl.read_text() == sysctl_before
        assert connections == []
        # what the step wrote landed in the guest's own tree, at the links' guest targets
        probe_out = debugfs(image.rootfs, "cat /probe").split("\n")
        assert probe_out[:3] == ["sysctl-refused", "no-sda", "mknod-refused"], probe_out
        assert probe_out[3].split() == ["fd", "full", "null", "ptmx", "pts", "random", "shm",
                                        "stderr", "stdin", "stdout", "tty", "urandom", "zero"]
        assert probe_out[4:6] == ["no-network", "0"], probe_out
        assert set(probe_out[6].split()) <= {"bin", "dev", "etc", "proc", "probe", "root",
                                             "srv", "tmp", "usr", "var"}, probe_out
        assert probe_out[7].split() == ["0", str(confined.UID_BASE), str(confined.UID_COUNT)]
        assert probe_out[8] == "0"
        assert debugfs(image.rootfs, f"cat {host}/passwd") == "pwned\n"
        assert debugfs(image.rootfs, "cat /etc/passwd") == "pwned\n"  # the file, not a link
        assert debugfs(image.rootfs, f"cat {host}/log/app.log") == "guest log\n"
        # owners came back: root's files are uid 0 in the image, the set-user-ID bit kept
        stat_su = debugfs(image.rootfs, "stat /bin/su")
        assert "User:     0" in stat_su and "Mode:  04755" in stat_su, stat_su
        assert "User:     0" in debugfs(image.rootfs, "stat /probe")
        assert child.id.startswith(f"{NAME}-child-")
        left = subprocess.run(["pgrep", "-f", "sleep 317"], capture_output=True, text=True)
        assert left.stdout == ""  # the step's daemon died with its PID namespace
    finally:
        for name in (f"{NAME}-child", NAME):
            try:
                remove_template(layout, name, set())
            except Exception:
                pass
            for d in (SHARED / "images").glob(f"{name}-*"):
                if d.name.rsplit("-", 1)[0] == name:
                    shutil.rmtree(d, ignore_errors=True)
            layout.image_lock(name).unlink(missing_ok=True)  # this run's name alone
    assert checksums(host) == before


def test_safetree_never_leaves_the_tree(tmp_path: Path, host: Path) -> None:
    """Reads, writes, copies, removals and trims through absolute, relative and looping
    links stay in the tree."""
    from hangar.images.rootfs import trim

    before = checksums(host)
    root = tmp_path / "root"
    hostile_tree(root, host)
    (root / "up").symlink_to("../../../../../../..")
    trim(root)  # its globs meet links to the host's doc, locale, man and log folders
    assert safetree.read_file(root, "/etc/passwd") is None  # a dangling link in the guest
    assert safetree.read_file(root, f"/up{host}/passwd") is None
    safetree.write_file(root, "/etc/passwd", "guest\n")
    safetree.write_file(root, "/var/log/new", "guest\n")
    safetree.copy_in(host, root, "/usr/share/doc/copied")
    safetree.remove(root, "/etc/cron.d/job")
    safetree.remove(root, "/etc/cron.d")
    safetree.make_dirs(root, "/srv/made", 0o700)
    assert checksums(host) == before
    assert (root / "etc" / "passwd").read_text() == "guest\n"
    assert not (root / "etc" / "cron.d").is_symlink() and not (root / "etc/cron.d").exists()
    inside_host = root / str(host).lstrip("/")
    assert (inside_host / "log" / "new").read_text() == "guest\n"
    assert (inside_host / "doc" / "copied" / "passwd").read_text().startswith("root:x:0")
    assert (inside_host / "made").is_dir()


def test_files_under_lists_without_following_or_opening_what_is_not_a_folder(
        tmp_path: Path) -> None:
    """``safetree.files_under`` (the trims' walk) lists every non-folder below a folder, a
    link as a link (never followed) and a FIFO unopened (``beneath.fwalk``)."""
    root = tmp_path / "root"
    (root / "var/log/deep").mkdir(parents=True)
    (root / "var/log/deep/file").write_text("x")
    (root / "var/log/out").symlink_to("/etc")
    os.mkfifo(root / "var/log/fifo")
    found = {name: stat.S_IFMT(st.st_mode)
             for _fd, name, st in safetree.files_under(root, "/var/log")}
    assert found == {"file": stat.S_IFREG, "out": stat.S_IFLNK, "fifo": stat.S_IFIFO}
    assert list(safetree.files_under(root, "/var/missing")) == []


def test_cli_import_of_a_refused_image_says_why(tmp_path: Path) -> None:
    """``hangar template import`` of a hostile archive: exit 1 and the reason, no traceback,
    nothing built."""
    import sys

    from conftest import SRC

    oci_archive(tmp_path / "bad.tar", [layer([member("bin", DIR, mode=0o755),
                                              member("bin/disk", tarfile.BLKTYPE)])])
    data = tmp_path / "data"
    r = subprocess.run([sys.executable, "-m", "hangar.cli", "template", "import",
                        str(tmp_path / "bad.tar"), "--name", "refused"],
                       env={**os.environ, "HANGAR_DATA_DIR": str(data), "PYTHONPATH": str(SRC),
                            "COLUMNS": "300"},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr
    assert "layer 1: 'bin/disk' is a device node" in r.stderr
    assert "Traceback" not in r.stderr
    assert not list((data / "images").glob("refused*"))


@pytest.mark.parametrize("network", [False, True])
def test_a_step_reaches_the_network_only_when_asked(
        tmp_path: Path, listener: tuple[int, list[str]], network: bool) -> None:
    """Without ``network`` a step has a loopback of its own; with it, the host's network
    (loopback services included: the documented cost)."""
    port, connections = listener
    root = tmp_path / "root"
    busybox_rootfs(root)
    with confined.shifted(root, lambda _m: None):
        out = confined.run_in_tree(
            "probe", root, ["/bin/sh", "-c", f"nc -w 2 127.0.0.1 {port} </dev/null && echo "
                                             "reached || echo unreachable"],
            env={"PATH": "/bin"}, network=network)
    assert out.splitlines()[-1] == ("reached" if network else "unreachable")
    deadline = time.monotonic() + 5  # the listener's thread accepts in its own time
    while network and not connections and time.monotonic() < deadline:
        time.sleep(0.05)
    assert connections == (["connected"] if network else [])
    assert os.stat(root / "bin" / "busybox").st_uid == 0  # owners moved back
