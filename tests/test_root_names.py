"""Class 1 (security round 3), review 29c: root writes through no name of the server's.

Each test plays a compromised split server (it owns the data directory, its
``images/`` and ``sandboxes/``) against a real root act: the root helper's
``prepare_vmm`` and ``vmm_exec`` (a ``reads`` path or bind target with ``..``,
H1), ``hangar serve``'s root phase (``server.lock`` and the probe caches, H2), the
no-systemd scripts' pid file and log (H3), and the ``vmlinux`` that root unpacks into
an image folder (H6). The server plants a symlink, a ``..`` path or a swapped name;
root refuses, or its act leaves the target unchanged (``Outside.untouched``).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import SRC, wait_for
from test_root_acts import Outside  # the folder of root's the server points its links at
from hangar.engines.confine import ConfineConfig, Confinement
from hangar.engines.qemu.argv import SECCOMP
from hangar.layout import Layout

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="root's acts run as root")

QEMU = shutil.which("qemu-system-x86_64") or "/usr/bin/qemu-system-x86_64"
OWNER = 999  # the server's uid in these tests
VMM_EXEC = SRC / "hangar" / "engines" / "vmm_exec.py"


def give(path: Path, uid: int = OWNER) -> None:
    """``path`` and everything below become the server's (as ``split.hand_over`` does)."""
    for dirpath, dirnames, filenames in os.walk(path):
        for name in [*dirnames, *filenames]:
            os.lchown(os.path.join(dirpath, name), uid, uid)
    os.lchown(path, uid, uid)


# -- H1: prepare_vmm's reads and vmm_exec's bind targets ---------------------------------


@pytest.fixture()
def helper_world(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A data directory with an image folder ``images/img-1`` and a sandbox folder
    ``sb-a``, a real root helper over it, and an ``Outside``."""
    from hangar.roothelper import Helper

    layout = Layout(tmp_path / "data")
    layout.ensure()
    (layout.images / "img-1").mkdir()
    sb = layout.sandboxes / "sb-a"
    sb.mkdir()
    (sb / "disk").write_text("disk")
    helper = Helper(layout, Confinement(ConfineConfig(uid_registry=tmp_path / "uids",
                                                      cgroups="off")), OWNER, QEMU)
    try:
        yield {"layout": layout, "helper": helper, "sb": sb,
               "outside": Outside(tmp_path)}
    finally:
        helper.answer(b'{"op": "release_vmm", "sandbox_id": "sb-a"}', [])
        for pid in list(helper.procs._children):
            try:
                os.kill(pid, 9)
            except OSError:
                pass
        helper.reap()


def climbing_read(layout: Layout, outside: Path) -> str:
    """The server's moves of review 29c's H1: in ``sandboxes/`` (its own) the folders of
    the images folder's path and ``.../images`` -> ``outside``; returns a ``reads`` path
    whose ``..`` climb from the view's tmpfs (on ``sandboxes/sb-a/.view``) into
    ``sandboxes/`` and on through that link, while ``os.path.normpath`` of it is
    ``images/evil``."""
    images = str(layout.images.absolute())
    plant = layout.sandboxes / Path(images.lstrip("/")).parent
    plant.mkdir(parents=True)
    (plant / "images").symlink_to(outside)
    (layout.images / "evil").mkdir()
    ups = len(Path(images.lstrip("/")).parts) + 2  # the tmpfs's root -> sb-a -> sandboxes
    read = images + "/.." * ups + images + "/evil"
    assert os.path.normpath(read) == images + "/evil"
    return read


def test_prepare_vmm_refuses_a_read_path_with_dot_dot(helper_world: dict[str, Any]) -> None:
    """H1: a ``reads`` path that is not already normal is refused by the protocol, and
    by ``Helper.image_dir`` itself: nothing is made, and no VMM can be spawned."""
    w = helper_world
    read = climbing_read(w["layout"], w["outside"].dir)
    req = {"op": "prepare_vmm", "sandbox_id": "sb-a", "vcpus": 1, "memory_mib": 64,
           "accel": "tcg", "tcg_cache_mib": 16, "reads": [read], "owned": ["disk"]}
    got = w["helper"].answer(json.dumps(req).encode(), [])
    assert got["ok"] is False and "'..' name" in got["error"], got
    for odd in (str(w["layout"].images) + "//img-1", str(w["layout"].images) + "/./img-1",
                str(w["layout"].images) + "/img-1/"):
        got = w["helper"].answer(json.dumps({**req, "reads": [odd]}).encode(), [])
        assert got["ok"] is False, (odd, got)
    from hangar.roothelper import Refused

    with pytest.raises(Refused, match="'..' name"):
        w["helper"].image_dir("sb-a", read)
    got = w["helper"].answer(json.dumps({"op": "spawn_vmm", "sandbox_id": "sb-a",
                                         "argv": [QEMU, "-sandbox", SECCOMP, "-version"]}
                                        ).encode(), [])
    assert got["ok"] is False, got
    w["outside"].untouched()
    got = w["helper"].answer(json.dumps({**req, "reads": [str(w["layout"].images / "img-1")]}
                                        ).encode(), [])
    assert got["ok"] is True, got  # the same request with a normal path passes


@pytest.mark.parametrize("kind", ["folder", "file"])
def test_vmm_exec_makes_nothing_for_a_bind_target_that_climbs_out(tmp_path: Path,
                                                                  kind: str) -> None:
    """H1, the second line: a plan whose bind target climbs out of the view's tmpfs with
    ``..`` (a folder or a file source) fails before ``vmm_exec`` makes anything, and the
    folder next to the view keeps its entries."""
    out = Outside(tmp_path)
    view = tmp_path / "view"
    view.mkdir()
    src = tmp_path / "src"
    if kind == "folder":
        src.mkdir()
    else:
        src.write_text("x")
    plan = {"root": str(view), "binds": [[str(src), "/../outside/evil", False]],
            "symlinks": [], "devices": []}
    r = subprocess.run([sys.executable, "-S", "-E", str(VMM_EXEC), json.dumps(plan), "--",
                        "/bin/true"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 126, r
    assert "view: '/../outside/evil' is not a plain absolute path" in r.stderr, r.stderr
    out.untouched()


def test_vmm_exec_makes_its_view_through_descriptors(tmp_path: Path) -> None:
    """The same ``vmm_exec`` with plain targets (a folder, a file, a symlink and a
    device) makes its view and runs the command in it."""
    view = tmp_path / "view"
    view.mkdir()
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "hello").write_text("from the bound folder\n")
    (tmp_path / "file").write_text("a bound file\n")
    plan = {"root": str(view), "binds": [["/usr", "/usr", False],
                                         [str(tmp_path / "src"), "/a/b/src", False],
                                         [str(tmp_path / "file"), "/a/c/file", False]],
            "symlinks": [[p, os.readlink(p)] for p in ("/bin", "/lib", "/lib64")
                         if os.path.islink(p)],
            "devices": [["null", 1, 3]]}
    r = subprocess.run([sys.executable, "-S", "-E", str(VMM_EXEC), json.dumps(plan), "--",
                        "/bin/sh", "-c", "cat /a/b/src/hello /a/c/file; ls /dev"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r
    assert r.stdout == "from the bound folder\na bound file\nnull\n", r.stdout


# -- H6: the vmlinux root unpacks into an image folder ------------------------------------


@pytest.fixture()
def server_image(base_image: Path, tmp_path: Path) -> dict[str, Any]:
    """A build folder of the server's (``vmlinuz`` and a ``manifest.json`` that records
    no ``vmlinux``), as ``split.give_images`` leaves one, and an ``Outside``."""
    img = tmp_path / "img-1"
    img.mkdir()
    shutil.copy(base_image / "vmlinuz", img / "vmlinuz")
    (img / "manifest.json").write_text(json.dumps({"kernel": {}}))
    give(img)
    return {"dir": img, "outside": Outside(tmp_path)}


def _swap_temporaries(folder: Path, secret: Path) -> int:
    """Fork the compromised server (uid ``OWNER``): on inotify's ``IN_CREATE`` of each
    temporary file in ``folder`` it moves that file aside and puts a symlink to
    ``secret`` in its place (review 29c's probe, won 4 times in 6 against a chmod by
    path). Returns its pid once its watch is in place (before, a loaded host let root
    make and rename its temporary unseen); it ends after 5 s or two swaps."""
    import ctypes
    import struct

    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid:
        os.close(ready_w)
        try:
            ready = os.read(ready_r, 1) == b"w"
        finally:
            os.close(ready_r)
        if not ready:
            os.waitpid(pid, 0)
            raise AssertionError("the swapping process set no watch")
        return pid
    os.close(ready_r)
    try:
        dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)  # its folder, below root's tmp
        os.setresgid(OWNER, OWNER, OWNER)
        os.setresuid(OWNER, OWNER, OWNER)
        libc = ctypes.CDLL(None, use_errno=True)
        ifd = libc.inotify_init1(os.O_NONBLOCK)
        if libc.inotify_add_watch(ifd, f"/proc/self/fd/{dfd}".encode(), 0x100) < 0:  # IN_CREATE
            raise OSError(ctypes.get_errno(), "inotify_add_watch")
        os.write(ready_w, b"w")
        import select
        import time

        swapped, deadline = 0, time.monotonic() + 5
        while swapped < 2 and time.monotonic() < deadline:
            if not select.select([ifd], [], [], 0.1)[0]:
                continue
            buf, off = os.read(ifd, 4096), 0
            while off < len(buf):
                _wd, _mask, _cookie, ln = struct.unpack_from("iIII", buf, off)
                name = buf[off + 16:off + 16 + ln].rstrip(b"\0").decode()
                off += 16 + ln
                if name.startswith("."):
                    try:
                        os.rename(name, f"aside{swapped}", src_dir_fd=dfd, dst_dir_fd=dfd)
                        os.symlink(secret, name, dir_fd=dfd)
                        swapped += 1
                    except OSError:
                        pass
    finally:
        os._exit(0)


def test_ensure_vmlinux_chmods_nothing_through_a_swapped_temporary(
        server_image: dict[str, Any]) -> None:
    """H6: root (``ensure_vmlinux``, as ``hangar serve``'s Firecracker probe runs it)
    unpacks the kernel while the server swaps each temporary name for a link to a root
    0600 file: the file keeps its mode, owner and content; ``vmlinux`` and the manifest
    are root's own new files, 0644."""
    from types import SimpleNamespace

    from hangar.images.vmlinux import ensure_vmlinux

    img, out = server_image["dir"], server_image["outside"]
    pid = _swap_temporaries(img, out.secret)
    try:
        try:
            got = ensure_vmlinux(SimpleNamespace(dir=img, vmlinux=None))  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001  (a swapped rename may refuse: fine)
            got = exc
    finally:
        os.waitpid(pid, 0)
    out.untouched()
    assert (img / "aside0").exists(), "the server swapped no temporary name"
    if isinstance(got, Path):
        st = os.lstat(got)
        assert stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode), st


@pytest.mark.parametrize("name", ["vmlinux", "vmlinuz", "manifest.json", ".vmlinux.PID.tmp"])
def test_ensure_vmlinux_follows_no_link_the_server_planted(server_image: dict[str, Any],
                                                           name: str) -> None:
    """H6: a link the server put at any name root reads or writes there (the kernel, the
    manifest, ``vmlinux``, the temporary file's name) is never read or written through:
    a read or a temporary through a link is refused, a name root writes is replaced."""
    from types import SimpleNamespace

    from hangar.errors import ImageError
    from hangar.images.vmlinux import ensure_vmlinux

    # the temporary's name holds the pid of the process that unpacks (this one): named in
    # the test, not in its id, so that every xdist worker collects the same tests
    name = name.replace("PID", str(os.getpid()))
    img, out = server_image["dir"], server_image["outside"]
    (img / name).unlink(missing_ok=True)
    (img / name).symlink_to(out.secret)
    os.lchown(img / name, OWNER, OWNER)
    image = SimpleNamespace(dir=img, vmlinux=None)
    if name == "vmlinux":
        assert ensure_vmlinux(image) == img / "vmlinux"  # type: ignore[arg-type]
        st = os.lstat(img / "vmlinux")
        assert stat.S_ISREG(st.st_mode) and st.st_uid == 0, st
        assert stat.S_IMODE(st.st_mode) == 0o644
        assert json.loads((img / "manifest.json").read_text())["kernel"]["vmlinux"]["bytes"] \
            == st.st_size
    else:
        with pytest.raises(ImageError):
            ensure_vmlinux(image)  # type: ignore[arg-type]
    out.untouched()


# -- H2: hangar serve's root phase in the server's data directory --------------------------


@pytest.fixture()
def split_data(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A data directory handed to the server (uid ``OWNER``) and an ``Outside``; the lock
    ``hold_data_dir`` keeps is released after the test."""
    from hangar.cli import serve

    layout = Layout(tmp_path / "data")
    layout.ensure()
    give(layout.root)
    before = list(serve._held)
    try:
        yield {"layout": layout, "outside": Outside(tmp_path)}
    finally:
        for fd in serve._held[len(before):]:
            os.close(fd)
        del serve._held[len(before):]


def plant(kind: str, at: Path, target: Path) -> None:
    """The server's move at ``at``: a symlink to ``target``, a FIFO, or (as on a host with
    ``protected_hardlinks=0``) a hard link to it."""
    if kind == "hardlink":
        os.link(target, at)
        return
    if kind == "symlink":
        at.symlink_to(target)
    else:
        os.mkfifo(at)
    os.lchown(at, OWNER, OWNER)


@pytest.mark.parametrize("kind", ["symlink", "fifo", "hardlink"])
def test_serve_takes_no_lock_through_a_name_the_server_planted(split_data: dict[str, Any],
                                                               kind: str) -> None:
    """H2: ``server.lock`` -> a root 0600 file (or a FIFO, or a hard link to it): the start
    refuses, naming the fix, and the file is neither truncated nor written; nothing of
    it is held open for the server."""
    from hangar.cli import serve
    from hangar.errors import ConfigError

    layout, out = split_data["layout"], split_data["outside"]
    plant(kind, layout.root / "server.lock", out.secret)
    if kind == "hardlink":
        out.before = out._state()  # the link's count is the server's move, not root's
    held = len(serve._held)
    with pytest.raises(ConfigError, match="is not a lock file of Hangar's.*remove it"):
        serve.hold_data_dir(layout)
    assert len(serve._held) == held
    out.untouched()


def test_serve_takes_the_servers_own_lock(split_data: dict[str, Any]) -> None:
    """The lock the split server's earlier start left (the server's, one link) is taken
    and holds this process's pid; a second start on it is refused naming that pid."""
    from hangar.cli import serve
    from hangar.errors import ConfigError

    layout = split_data["layout"]
    lock = layout.root / "server.lock"
    lock.write_text("12345678\nold\n")
    os.chown(lock, OWNER, OWNER)
    serve.hold_data_dir(layout)
    assert lock.read_text() == f"{os.getpid()}\n"
    second = ("import sys; from pathlib import Path; from hangar.cli import serve; "
              "from hangar.layout import Layout; serve.LOCK_WAIT_S = 0; "
              "serve.hold_data_dir(Layout(Path(sys.argv[1])))")
    r = subprocess.run([sys.executable, "-c", second, str(layout.root)],
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(SRC)})
    assert r.returncode != 0 and f"(pid {os.getpid()})" in r.stderr, r.stderr


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_probe_caches_are_never_written_or_read_through_the_servers_names(
        split_data: dict[str, Any], monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """H2: root's probe caches in ``<data>`` (Firecracker's at every root start on a
    jailer host, QEMU's for ``hangar doctor``): a symlink to a root file or a FIFO the
    server put at the cache's name is neither read (no hang) nor written through; the
    answer is written as a new file of root's, renamed over the name."""
    from types import SimpleNamespace

    from hangar.engines import doctor
    from hangar.engines.qemu import probe

    layout, out = split_data["layout"], split_data["outside"]
    for cache in (layout.firecracker_probe_file, layout.qemu_probe_file,
                  layout.firecracker_probe_file.with_suffix(".tmp")):
        plant(kind, cache, out.secret)
    monkeypatch.setattr(doctor, "_probe_key", lambda binary, image: "key")
    monkeypatch.setattr(doctor, "probe_boot", lambda image, binary, timeout: (False, "no"))
    monkeypatch.setattr(probe, "probe_kvm", lambda kernel, initrd: (False, "no KVM"))
    image: Any = SimpleNamespace()
    assert doctor.firecracker_usable(layout, image, Path("/bin/true")) == (False, "no")
    assert probe.choose_accel(layout, Path("/k"), Path("/i"))[0] == "tcg"
    out.untouched()
    for cache in (layout.firecracker_probe_file, layout.qemu_probe_file):
        st = os.lstat(cache)
        assert stat.S_ISREG(st.st_mode) and st.st_uid == 0, (cache, st)
    assert doctor.firecracker_usable(layout, image, Path("/bin/true")) == (False, "no (cached)")


# -- H3: the no-systemd scripts' pid file, log and signal ----------------------------------

SCRIPTS = SRC.parent / "scripts"


@pytest.fixture()
def nohup_host(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A data directory of the server's holding its planted ``hangar.pid`` -> a root 0600
    file and ``hangar.log`` -> a new name in a root folder (the names the scripts used
    to write as root); a fake ``hangar`` (``hangar serve`` sleeps), the scripts' env
    (``HANGAR_RUN_DIR`` a root folder of the test's), and the pids started, ended after."""
    data = tmp_path / "data"
    data.mkdir()
    out = Outside(tmp_path)
    (data / "hangar.pid").symlink_to(out.secret)
    (data / "hangar.log").symlink_to(out.dir / "newfile")
    give(data)
    hangar = tmp_path / "hangar"
    hangar.write_text("#!/bin/sh\nexec python3 -c 'import time; time.sleep(300)' \"$@\"\n")
    hangar.chmod(0o755)
    env = {**os.environ, "HANGAR_DATA_DIR": str(data), "HANGAR_RUN_DIR": str(tmp_path / "run")}
    started: list[int] = []
    try:
        yield {"data": data, "outside": out, "hangar": hangar, "env": env,
               "run": tmp_path / "run", "started": started}
    finally:
        for pid in started:
            try:
                os.kill(pid, 9)
            except OSError:
                pass


def sh(host: dict[str, Any], script: str) -> subprocess.CompletedProcess[str]:
    """Run ``script`` in bash with ``scripts/nohup-server.sh`` sourced (DATA set)."""
    return subprocess.run(["bash", "-c", f'set -euo pipefail; DATA=$HANGAR_DATA_DIR; '
                                         f'. {SCRIPTS}/nohup-server.sh; {script}'],
                          capture_output=True, text=True, timeout=60, env=host["env"])


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_nohup_start_writes_no_pid_or_log_through_the_servers_names(
        nohup_host: dict[str, Any]) -> None:
    """H3: the scripts' start (``start_server``) writes the pid and opens the log in
    ``HANGAR_RUN_DIR`` (root's, 0700): the server's links in the data directory are not
    written through, the root file keeps its content and no file is made where the log
    link points; ``scripts/stop.sh`` then stops the very server it started."""
    h = nohup_host
    r = sh(h, f"start_server {h['hangar']}; echo $!")
    assert r.returncode == 0, r.stderr
    pid = int(r.stdout.split()[-1])
    h["started"].append(pid)
    assert (h["run"] / "hangar.pid").read_text() == f"{pid}\n"
    st = os.lstat(h["run"])
    assert st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o700
    assert os.lstat(h["run"] / "hangar.log").st_uid == 0
    h["outside"].untouched()
    assert os.readlink(h["data"] / "hangar.pid") == str(h["outside"].secret)
    wait_for(lambda: sh(h, "server_pid").stdout.strip() == str(pid), 30,
             "the started process to exec `hangar serve`")
    r = subprocess.run(["bash", str(SCRIPTS / "stop.sh")], capture_output=True, text=True,
                       timeout=60, env=h["env"])
    assert r.returncode == 0 and f"stopped Hangar (pid {pid})" in r.stdout, r
    assert not alive(pid)
    assert not (h["run"] / "hangar.pid").exists()


@pytest.mark.parametrize("who", ["another program", "a server of another data directory"])
def test_stop_signals_no_pid_that_is_not_the_server(nohup_host: dict[str, Any],
                                                    who: str) -> None:
    """H3: the pid file names a process that is not ``hangar serve`` on this data
    directory (a reused pid: another program, or a server of another folder): stop.sh
    signals nothing, and the process keeps running."""
    h = nohup_host
    if who == "another program":
        argv = ["python3", "-c", "import time; time.sleep(300)"]
        env = h["env"]
    else:
        argv = [str(h["hangar"]), "serve"]
        env = {**h["env"], "HANGAR_DATA_DIR": str(h["run"].parent / "other")}
    proc = subprocess.Popen(argv, env=env, start_new_session=True)
    h["started"].append(proc.pid)
    h["run"].mkdir(mode=0o700)
    (h["run"] / "hangar.pid").write_text(f"{proc.pid}\n")
    r = subprocess.run(["bash", str(SCRIPTS / "stop.sh")], capture_output=True, text=True,
                       timeout=60, env=h["env"])
    assert r.returncode == 0 and "Hangar is not running" in r.stdout, r
    assert proc.poll() is None, "a process that is not the server was signalled"
    proc.kill()
    proc.wait()


def test_nohup_start_refuses_a_run_folder_the_server_may_write(
        nohup_host: dict[str, Any]) -> None:
    """H3: ``HANGAR_RUN_DIR`` set to a folder of the server's (in its data directory)
    is refused, naming the fix, before anything is started or written there."""
    h = nohup_host
    run = h["data"] / "run"
    h["env"]["HANGAR_RUN_DIR"] = str(run)
    r = sh(h, f"start_server {h['hangar']}")
    assert r.returncode == 1 and "is not root's alone" in r.stderr, r
    assert list(run.iterdir()) == []
    h["outside"].untouched()


# -- M3: the helper's removal of a Firecracker jail ---------------------------------------


def test_jail_release_never_opens_a_fifo_swapped_in_for_a_folder(
        helper_world: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """M3: the jail's ``root/`` is writable by the server's group; after the helper listed
    it, the server swaps a folder there for a FIFO (and leaves a link to root's folder):
    ``jail_release`` (and ``jail_prepare`` of a leftover jail) removes the jail without
    opening the FIFO (a reader would hang the helper) or following the link."""
    import threading
    import time

    from hangar.engines.firecracker.hostjail import HostJail
    from hangar.engines.firecracker.jailer import JailerConfig
    from hangar.privileged import beneath
    from hangar.roothelper import Helper

    w = helper_world
    config = JailerConfig(binary=Path("/nonexistent/jailer"), chroot_base=tmp_path / "jails",
                          uid_registry=tmp_path / "uids", cgroups="off")
    helper = Helper(w["layout"], Confinement(ConfineConfig(uid_registry=tmp_path / "uids",
                                                           cgroups="off")), OWNER, QEMU,
                    jail=HostJail(config, Path("/nonexistent/firecracker"), OWNER))
    root = tmp_path / "jails" / "firecracker" / "hangar-sb-a" / "root"
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    opened: list[bool] = []
    done = threading.Event()

    def watch() -> None:  # a writer opens a FIFO without blocking only while it is read
        while not done.is_set():
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
                opened.append(True)
            except OSError:
                pass
            time.sleep(0.001)

    real_listdir = os.listdir

    def listdir(fd: Any = ".") -> list[str]:  # the server's move, once root has listed
        names = real_listdir(fd)
        if isinstance(fd, int) and os.fstat(fd).st_ino == os.stat(root).st_ino \
                and "d" in names and (root / "d").is_dir():
            os.rename(root / "d", tmp_path / "d-aside")
            os.symlink(fifo, root / "d")  # a link to a FIFO where a folder was
        return names

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        for op in ("jail_prepare", "jail_release"):
            assert helper.answer(json.dumps({"op": "jail_prepare", "sandbox_id": "sb-a"}
                                            ).encode(), [])["ok"] is True
            (root / "d" / "e").mkdir(parents=True)
            (root / "escape").symlink_to(w["outside"].dir)
            monkeypatch.setattr(beneath.os, "listdir", listdir)
            got = helper.answer(json.dumps({"op": op, "sandbox_id": "sb-a"}).encode(), [])
            monkeypatch.setattr(beneath.os, "listdir", real_listdir)
            assert got["ok"] is True, got
            assert (tmp_path / "d-aside").is_dir()
            shutil.rmtree(tmp_path / "d-aside")
            if op == "jail_release":
                assert not root.parent.exists()
    finally:
        done.set()
        watcher.join()
    assert not opened
    w["outside"].untouched()
