"""Guest images: recipes, a real build of ``base``, its initramfs, and real boots.

The image cache is ``$HANGAR_DATA_DIR`` (default /var/lib/hangar), so the
slow debootstrap runs once per machine; the ``base_image`` fixture builds it
when missing. Boots use QEMU's microvm under TCG (never KVM: this host's
nested KVM hangs ordinary kernels). Every QEMU process and temporary file a
test makes is removed when it ends, pass or fail.
"""

from __future__ import annotations

import ast
import gzip
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hangar.errors import ImageError, NotFound
from hangar.guest import init as guest_init
from hangar.images import (
    GuestImage,
    build_image,
    get_recipe,
    initramfs,
    list_images,
    resolve_image,
)
from hangar.images.builder import host_mirror
from hangar.images.debian import UNSAFE_IO_CONF, unsafe_io
from hangar.images.commands import remove_tree, run
from hangar.images.recipes import RECIPES, Recipe
from hangar.layout import Layout

DATA_DIR = Path(os.environ.get("HANGAR_DATA_DIR", "/var/lib/hangar"))
QEMU = shutil.which("qemu-system-x86_64")
BOOT_TIMEOUT_S = 90.0

needs_qemu = pytest.mark.skipif(QEMU is None, reason="qemu-system-x86_64 is not installed")

# A stand-in for hangar.guest.agent, to test what the init promises the agent:
# the port by name, PYTHONPATH, env, hostname, the grown root, mounts, restart
# after an exit, orphan reaping, and the poweroff command.
STUB_AGENT = r'''
import glob, os, subprocess, sys, time
if not os.path.exists("/run/stub-ran-once"):
    open("/run/stub-ran-once", "w").close()
    print("stub-agent: first run, exiting 3 to be restarted", flush=True)
    sys.exit(3)
dev = None
for p in glob.glob("/sys/class/virtio-ports/*/name"):
    with open(p) as f:
        if f.read().strip() == "hangar.agent":
            dev = "/dev/" + p.split("/")[-2]
fd = os.open(dev, os.O_RDWR)
# an orphan: our child forks a grandchild and exits; the grandchild goes to PID 1
if os.fork() == 0:
    if os.fork() == 0:
        time.sleep(0.2)
        os._exit(0)
    os._exit(0)
os.wait()
deadline = time.monotonic() + 30
while True:
    st = os.statvfs("/")
    size = st.f_blocks * st.f_frsize
    if size > 1 << 30 or time.monotonic() > deadline:
        break
    time.sleep(0.2)
time.sleep(0.5)
zombies = 0
for stat in glob.glob("/proc/[0-9]*/stat"):
    try:
        fields = open(stat).read().rsplit(")", 1)[1].split()
    except OSError:
        continue
    if fields[0] == "Z":
        zombies += 1
mounts = sorted(line.split()[1] for line in open("/proc/mounts"))
hostname = open("/proc/sys/kernel/hostname").read().strip()
lo_up = int(open("/sys/class/net/lo/flags").read(), 16) & 1
msg = (f"STUB-AGENT hostname={hostname} root_bytes={size} zombies={zombies} lo_up={lo_up} "
       f"pythonpath={os.environ.get('PYTHONPATH')} lang={os.environ.get('LANG')} "
       f"ppid={os.getppid()} sid_is_pid={os.getsid(0) == os.getpid()} "
       f"mounts={','.join(mounts)}\n")
os.write(fd, msg.encode())
data = os.read(fd, 4096)
os.write(fd, b"ECHO " + data)
subprocess.run(["poweroff"])
time.sleep(60)
'''


# ---------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="session")
def layout() -> Layout:
    return Layout(DATA_DIR)


@pytest.fixture(scope="session")
def base_image(layout: Layout) -> GuestImage:
    """The ``base`` image, built (a minute or more) when it is not in the cache."""
    if os.geteuid() != 0:
        pytest.skip("building images needs root (debootstrap)")
    return build_image(layout, "base", progress=lambda m: print(f"[build base] {m}", flush=True))


def tsc_khz() -> int | None:
    """The host's TSC rate: under TCG the guest reads the host's TSC."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("cpu MHz"):
                return int(float(line.split(":")[1]) * 1000)
    except (OSError, ValueError):
        pass
    return None


class Vm:
    """One QEMU microvm under TCG, its console captured in memory."""

    def __init__(self, image: GuestImage, workdir: Path, *, initrd: Path | None = None,
                 append: str = "") -> None:
        self.workdir = workdir
        self.disk = workdir / "disk.qcow2"
        self.agent_sock = workdir / "agent.sock"
        subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(image.rootfs),
                        "-F", "raw", str(self.disk), "2G"], check=True)
        cmdline = image.cmdline
        khz = tsc_khz()
        if khz:
            # Under a busy host the kernel's TSC calibration against the PIT can
            # fail, and the boot then hangs; give it the rate instead.
            cmdline += f" tsc_early_khz={khz} tsc=reliable"
        self.argv = [
            QEMU or "qemu-system-x86_64", "-M", "microvm,rtc=on", "-accel", "tcg", "-cpu", "max",
            "-m", "512", "-smp", "1", "-nodefaults", "-no-user-config", "-nographic",
            "-serial", "stdio", "-no-reboot",
            "-kernel", str(image.kernel), "-initrd", str(initrd or image.initrd),
            "-append", f"{cmdline} {append}".strip(),
            "-drive", f"id=root,file={self.disk},format=qcow2,if=none",
            "-device", "virtio-blk-device,drive=root",
            "-device", "virtio-serial-device",
            "-chardev", f"socket,id=agent,path={self.agent_sock},server=on,wait=off",
            "-device", "virtserialport,chardev=agent,name=hangar.agent",
        ]
        self.output = b""
        self._cond = threading.Condition()
        self.started = time.monotonic()
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        while chunk := self.proc.stdout.read1(65536):
            with self._cond:
                self.output += chunk
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_for(self, needle: bytes, timeout: float) -> float | None:
        """Seconds from QEMU's start until ``needle`` showed on the console, or None."""
        end = time.monotonic() + timeout
        with self._cond:
            while needle not in self.output:
                left = end - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                    return None
                self._cond.wait(min(left, 0.5))
            return time.monotonic() - self.started

    def wait_exit(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, 9)
            except ProcessLookupError:
                pass
            self.proc.wait(10)
        self._reader.join(5)
        if self.proc.stdout:
            self.proc.stdout.close()

    def console(self) -> str:
        return self.output.decode(errors="replace")


@pytest.fixture
def vms() -> Iterator[list[Vm]]:
    """Start VMs with ``vms.append(Vm(...))``: killed and their files removed at the end."""
    started: list[Vm] = []
    try:
        yield started
    finally:
        for vm in started:
            vm.kill()
            shutil.rmtree(vm.workdir, ignore_errors=True)


def new_workdir() -> Path:
    # Short, for the 108-byte limit of a unix socket path.
    return Path(tempfile.mkdtemp(prefix="hangar-img-test-"))


# ---------------------------------------------------------------------------------------------
# recipes and helpers (no build needed)


def test_recipes() -> None:
    base = get_recipe("base")
    assert isinstance(base, Recipe) and base.suite == "bookworm"
    assert "python3" in base.packages
    assert all("bash-static" in r.packages for r in RECIPES.values())  # /bin/bash: static
    assert "desktop" in RECIPES
    assert {"xvfb", "x11vnc", "xdotool", "scrot", "chromium"} <= set(RECIPES["desktop"].packages)
    assert re.fullmatch(r"[0-9a-f]{12}", base.digest())
    assert base.digest() == get_recipe("base").digest()
    assert base.digest() != RECIPES["desktop"].digest()
    other = Recipe(name="base", packages=base.packages + ("curl",), description=base.description)
    assert other.digest() != base.digest()
    reworded = Recipe(name="base", packages=base.packages, files=base.files,
                      description="other words")
    assert reworded.digest() == base.digest()
    with pytest.raises(NotFound):
        get_recipe("no-such-recipe")


def test_recipe_sizes_files_and_apt_packages() -> None:
    import dataclasses

    from hangar.images.recipes import RecipeFile

    base, desktop, dev = get_recipe("base"), get_recipe("desktop"), get_recipe("dev")
    assert (desktop.default_vcpus, desktop.default_memory_mib) == (2, 2048)
    assert (dev.default_vcpus, dev.default_memory_mib) == (2, 2048)
    assert base.default_memory_mib is None  # the server's default applies
    # Default sizes are not part of the image; files and apt packages are.
    assert dataclasses.replace(base, default_memory_mib=4096).digest() == base.digest()
    with_file = dataclasses.replace(base, files=(RecipeFile("/etc/x", "y"),))
    assert with_file.digest() != base.digest()
    assert dataclasses.replace(base, apt_packages=("npm",)).digest() != base.digest()
    assert {"git", "nodejs", "ripgrep", "python3-venv", "build-essential"} <= set(dev.packages)
    assert {"npm", "yarnpkg"} <= set(dev.apt_packages)
    assert any(f.path == "/usr/local/bin/yarn" and f.mode == 0o755 for f in dev.files)
    [flags] = [f for f in desktop.files if f.path == "/etc/chromium.d/hangar"]
    assert "--no-sandbox" in flags.content and "--disable-dev-shm-usage" in flags.content


def test_host_mirror_reads_deb822(tmp_path: Path) -> None:
    f = tmp_path / "debian.sources"
    f.write_text(
        "Types: deb\n# a comment\nURIs: http://mirror.invalid/debian\n"
        "Suites: bookworm bookworm-updates\nComponents: main\n\n"
        "Types: deb\nURIs: http://mirror.invalid/debian-security\n"
        "Suites: bookworm-security\nComponents: main\n\n"
        "Types: deb-src\nURIs: http://src.invalid/debian\nSuites: trixie\n")
    assert host_mirror("bookworm", f) == "http://mirror.invalid/debian"
    assert host_mirror("bookworm-security", f) == "http://mirror.invalid/debian-security"
    assert host_mirror("trixie", f) is None  # deb-src only
    assert host_mirror("bookworm", tmp_path / "missing") is None


def test_failed_step_raises_image_error_with_tail() -> None:
    with pytest.raises(ImageError) as e:
        run("demo", ["sh", "-c", "echo first; echo the-reason >&2; exit 3"])
    assert e.value.context["step"] == "demo" and e.value.context["exit_code"] == 3
    assert "the-reason" in e.value.message


def test_dpkg_skips_its_syncs_only_while_the_tree_is_built(tmp_path: Path) -> None:
    """debootstrap's and apt-get's dpkg read ``force-unsafe-io`` from the tree while it is
    built; the option leaves the tree with the build step, also when the step fails."""
    conf = tmp_path / UNSAFE_IO_CONF
    with unsafe_io(tmp_path):
        assert conf.read_text() == "force-unsafe-io\n"
    assert not conf.exists()
    with pytest.raises(ImageError), unsafe_io(tmp_path):
        raise ImageError("debootstrap failed")
    assert not conf.exists() and conf.parent.is_dir()


def test_remove_tree_unmounts_first() -> None:
    d = Path(tempfile.mkdtemp(prefix="hangar-img-test-"))
    try:
        (d / "proc").mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(d / "proc")],
                          check=False).returncode != 0:
            pytest.skip("cannot mount here")
        remove_tree(d)
        assert not d.exists()
    finally:
        subprocess.run(["umount", "-l", str(d / "proc")], capture_output=True, check=False)
        shutil.rmtree(d, ignore_errors=True)


def test_failed_build_cleans_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failing debootstrap raises ImageError with its output, and leaves no trees behind."""
    if os.geteuid() != 0:
        pytest.skip("building images needs root (debootstrap)")
    from hangar.images import recipes

    monkeypatch.setitem(recipes.RECIPES, "broken",
                        Recipe(name="broken", packages=("no-such-package-hangar-test",)))
    root = Path(tempfile.mkdtemp(prefix="hangar-img-test-"))
    try:
        lay = Layout(root)
        with pytest.raises(ImageError) as e:
            build_image(lay, "broken")
        assert e.value.context["step"] == "debootstrap"
        assert "no-such-package-hangar-test" in e.value.message
        assert list((lay.cache / "build").iterdir()) == []
        assert [p.name for p in lay.images.iterdir()] == [".broken.lock"]
        with pytest.raises(NotFound):
            resolve_image(lay, "broken")
    finally:
        remove_tree(root)


def test_guest_init_helpers() -> None:
    assert guest_init.parse_cmdline("console=ttyS0 rw hangar.hostname=box-1\n") == {
        "console": "ttyS0", "rw": "", "hangar.hostname": "box-1"}
    assert guest_init.valid_hostname("sb-54a95a8f2fee")
    assert not guest_init.valid_hostname("bad_name") and not guest_init.valid_hostname("-x")
    assert not guest_init.valid_hostname("")


def test_guest_sources_and_init_script() -> None:
    src = initramfs.guest_sources()
    assert {"hangar/__init__.py", "hangar/guest/__init__.py", "hangar/guest/protocol.py",
            "hangar/guest/init.py"} <= set(src)
    # guest/ holds exactly what runs in the guest: all of it travels (its C source, to be
    # built into the initramfs), nothing else does
    guest = Path(initramfs.package_dir()) / "guest"
    assert set(src) == {"hangar/__init__.py", "hangar/guest/_spawn.c"} | {
        f"hangar/guest/{p.relative_to(guest).as_posix()}" for p in guest.rglob("*.py")
        if "__pycache__" not in p.parts}
    for path, data in src.items():  # and none of its Python imports the host's side
        if not path.endswith(".py"):
            continue
        for node in ast.walk(ast.parse(data)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert not name.startswith("hangar.") or name.startswith("hangar.guest"), \
                    (path, name)
    script = initramfs.render_init("6.1.0-test")
    if Path("/bin/busybox").exists():
        r = subprocess.run(["/bin/busybox", "sh", "-n"], input=script, text=True,
                           capture_output=True, check=False)
        assert r.returncode == 0, r.stderr


# ---------------------------------------------------------------------------------------------
# the built image


def test_image_files_and_manifest(base_image: GuestImage, layout: Layout) -> None:
    for f in (base_image.rootfs, base_image.kernel, base_image.initrd):
        assert f.is_file() and f.stat().st_size > 0, f
    assert (layout.images / "base").resolve() == base_image.dir
    m = json.loads((base_image.dir / "manifest.json").read_text())
    # the id names the build; builds made before ids covered the bytes carry the recipe's digest
    assert base_image.dir.name == base_image.id == f"base-{m['digest']}"
    assert m.get("recipe_digest", m["digest"]) == get_recipe("base").digest()
    assert base_image.recipe_digest == get_recipe("base").digest()
    if m["format"] >= 2:
        assert m["id"] == base_image.id and m["digest"] == m["sha256"][:12]
        assert m["kernel"]["vmlinux"]["bytes"] == (base_image.dir / "vmlinux").stat().st_size
    assert m["name"] == "base" and m["recipe"]["packages"] == list(get_recipe("base").packages)
    assert m["kernel"]["version"] == base_image.kernel_version
    assert m["python_version"] and m["python_version"].startswith("3.")
    assert m["sizes"]["rootfs_bytes"] == base_image.rootfs.stat().st_size
    assert m["sizes"]["rootfs_bytes"] > m["sizes"]["content_bytes"] > 50 * 2**20
    assert (base_image.dir / "modules" / base_image.kernel_version / "modules.dep").is_file()
    assert not list((layout.cache / "build").glob("*")), "temporary build trees left behind"
    assert not list(layout.images.glob(".staging-base-*")), "staging directories left behind"


def test_cached_build_is_fast(base_image: GuestImage, layout: Layout) -> None:
    t = time.monotonic()
    again = build_image(layout, "base")
    elapsed = time.monotonic() - t
    assert again == base_image
    assert elapsed < 0.5, f"cached build_image took {elapsed:.2f} s"


def test_list_and_resolve(base_image: GuestImage, layout: Layout) -> None:
    infos = [i for i in list_images(layout) if i.dir == base_image.dir]
    assert len(infos) == 1
    info = infos[0]
    assert info.current and not info.stale and info.digest == base_image.digest
    assert info.rootfs_bytes > 0 and info.build_seconds > 0
    assert resolve_image(layout, "base") == base_image
    assert resolve_image(layout, f"base-{base_image.digest}") == base_image
    with pytest.raises(NotFound):
        resolve_image(layout, "never-built")
    with pytest.raises(NotFound):
        resolve_image(layout, "../etc")


def test_initrd_contents(base_image: GuestImage) -> None:
    listing = subprocess.run(["cpio", "-t", "--quiet"], input=gzip.decompress(
        base_image.initrd.read_bytes()), capture_output=True, check=True).stdout.decode().split()
    names = set(listing)
    kmods = f"lib/modules/{base_image.kernel_version}"
    for need in ("init", "bin/busybox", "bin/sh", "bin/switch_root", "bin/modprobe",
                 "dev/console", f"{kmods}/modules.dep", f"{kmods}/modules.alias",
                 "hangar/python/hangar/__init__.py", "hangar/python/hangar/guest/init.py",
                 "hangar/python/hangar/guest/protocol.py"):
        assert need in names, need
    # the native spawn, compiled where this host can (hangar.images.initramfs), never its source
    native = "hangar/python/hangar/guest/_spawn.abi3.so"
    assert (native in names) == bool(initramfs.native_toolchain()), native
    assert "hangar/python/hangar/guest/_spawn.c" not in names
    m = json.loads((base_image.dir / "manifest.json").read_text())
    if m["python_version"] == f"{sys.version_info.major}.{sys.version_info.minor}":
        tag = sys.implementation.cache_tag
        assert f"hangar/python/hangar/guest/__pycache__/init.{tag}.pyc" in names
    mods = {Path(n).name for n in names if n.endswith(".ko")}
    assert {"virtio.ko", "virtio_ring.ko", "virtio_mmio.ko", "virtio_blk.ko", "virtio_console.ko",
            "virtio_net.ko", "virtio-rng.ko", "vsock.ko",
            "vmw_vsock_virtio_transport.ko"} <= mods
    assert "ext4.ko" not in mods  # built into this kernel
    order, builtin = initramfs.module_closure(base_image.dir / "modules" / base_image.kernel_version,
                                              ["ext4", "virtio_blk"])
    assert builtin == ["ext4"]
    assert [Path(p).name for p in order] == ["virtio_ring.ko", "virtio.ko", "virtio_blk.ko"]


def test_new_guest_files_reuse_rootfs_with_new_initrd(base_image: GuestImage,
                                                      layout: Layout) -> None:
    src = initramfs.guest_sources()
    src["hangar/guest/agent.py"] = b"# changed\n" + src.get("hangar/guest/agent.py", b"")
    img = resolve_image(layout, "base", sources=src)
    try:
        assert img.rootfs == base_image.rootfs and img.dir == base_image.dir
        assert img.initrd != base_image.initrd and img.initrd.is_file()
        assert re.fullmatch(r"initrd-[0-9a-f]{12}\.img", img.initrd.name)
        # the symlink keeps following this Hangar's own guest files
        assert (base_image.dir / "initrd.img").resolve() == base_image.initrd
    finally:
        img.initrd.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# boots


@needs_qemu
@pytest.mark.vm
def test_probe_boot_powers_off(base_image: GuestImage, vms: list[Vm]) -> None:
    vm = Vm(base_image, new_workdir(), append="hangar.probe=1")
    vms.append(vm)
    rc = vm.wait_exit(60)
    assert rc == 0, f"QEMU did not exit 0 by itself within 60 s (rc={rc}):\n{vm.console()[-3000:]}"
    assert "HANGAR-PROBE-OK" in vm.console()
    print(f"probe boot: {time.monotonic() - vm.started:.2f} s wall")


@needs_qemu
@pytest.mark.vm
def test_boot_starts_agent(base_image: GuestImage, vms: list[Vm]) -> None:
    vm = Vm(base_image, new_workdir())
    vms.append(vm)
    t = vm.wait_for(b"hangar-init: agent started", BOOT_TIMEOUT_S)
    assert t is not None, f"no 'agent started' within {BOOT_TIMEOUT_S} s:\n{vm.console()[-3000:]}"
    assert "FATAL" not in vm.console()
    m = re.search(r"at uptime ([0-9.]+) s", vm.console())
    print(f"boot to 'agent started': {t:.2f} s wall, {m.group(1) if m else '?'} s guest uptime")


@needs_qemu
@pytest.mark.vm
def test_boot_with_stub_agent(base_image: GuestImage, layout: Layout, vms: list[Vm]) -> None:
    """The init's promises to the agent, checked by a stand-in agent over the real port."""
    src = initramfs.guest_sources()
    src["hangar/guest/agent.py"] = STUB_AGENT.encode()
    img = resolve_image(layout, "base", sources=src)
    try:
        vm = Vm(base_image, new_workdir(), initrd=img.initrd, append="hangar.hostname=box-7")
        vms.append(vm)
        assert vm.wait_for(b"hangar-init: agent started", BOOT_TIMEOUT_S), vm.console()[-3000:]
        deadline = time.monotonic() + BOOT_TIMEOUT_S
        while not vm.agent_sock.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(vm.agent_sock))
            s.settimeout(BOOT_TIMEOUT_S)
            buf = b""
            while b"\n" not in buf:
                chunk = s.recv(4096)
                assert chunk, f"port closed:\n{vm.console()[-3000:]}"
                buf += chunk
            line = buf.decode()
            s.sendall(b"ping\n")
            echo = b""
            while b"\n" not in echo:
                echo += s.recv(4096)
        assert echo == b"ECHO ping\n"
        fields = dict(w.split("=", 1) for w in line.split()[1:])
        assert fields["hostname"] == "box-7"
        assert int(fields["root_bytes"]) > 1.5 * 2**30, "resize2fs did not grow the root"
        assert fields["zombies"] == "0", vm.console()[-3000:]
        assert fields["lo_up"] == "1"
        assert fields["pythonpath"] == "/usr/lib/hangar/python" and fields["lang"] == "C.UTF-8"
        assert fields["ppid"] == "1" and fields["sid_is_pid"] == "True"
        mounts = set(fields["mounts"].split(","))
        assert {"/", "/proc", "/sys", "/dev", "/dev/pts", "/dev/shm", "/run", "/tmp"} <= mounts
        console = vm.console()
        assert "ended: exit 3" in console and "agent restarted" in console
        # the stub ran `poweroff`: PID 1 powers off and QEMU exits by itself
        rc = vm.wait_exit(60)
        assert rc == 0, vm.console()[-3000:]
        assert "hangar-init: powering off (signal 15" in vm.console()
    finally:
        img.initrd.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# pinned builds and garbage collection, on small builds made by hand in a private data dir


def fake_build(lay: Layout, name: str, digest: str, built_at: float) -> Path:
    """A build directory as the builder leaves it, with tiny files."""
    d = lay.image(f"{name}-{digest}").dir
    (d / "modules" / "6.1.0-x").mkdir(parents=True)
    (d / "rootfs.ext4").write_bytes(os.urandom(4096))
    (d / "vmlinuz").write_bytes(os.urandom(512))
    (d / "manifest.json").write_text(json.dumps({
        "format": 2, "id": d.name, "name": name, "digest": digest, "recipe_digest": "r",
        "recipe": {"description": ""}, "kernel": {"version": "6.1.0-x"},
        "sizes": {"rootfs_bytes": 4096}, "built_at": built_at, "build_seconds": {"total": 1}}))
    return d


def test_resolve_pinned_finds_that_build_or_refuses(tmp_path: Path) -> None:
    from hangar.errors import ImageMissing
    from hangar.images import resolve_pinned

    lay = Layout(tmp_path)
    lay.ensure()
    fake_build(lay, "base", "aaaaaaaaaaaa", 1.0)
    fake_build(lay, "base", "bbbbbbbbbbbb", 2.0)
    lay.image_link("base").symlink_to("base-bbbbbbbbbbbb")
    for digest in ("cccccccccccc", "", "../x"):
        with pytest.raises(ImageMissing) as e:  # never another build of the recipe
            resolve_pinned(lay, "base", digest)
        assert e.value.status == 409 and e.value.code == "image_missing"
    with pytest.raises(ImageMissing):  # a folder whose manifest names another build
        shutil.copytree(lay.image("base-aaaaaaaaaaaa").dir, lay.image("base-dddddddddddd").dir)
        resolve_pinned(lay, "base", "dddddddddddd")


def test_gc_keeps_current_pinned_and_in_use_builds(tmp_path: Path) -> None:
    from hangar.images.gc import collect

    lay = Layout(tmp_path / "data")
    lay.ensure()
    cur = fake_build(lay, "base", "000000000001", 5.0)
    lay.image_link("base").symlink_to(cur.name)
    pinned = fake_build(lay, "base", "000000000002", 4.0)
    linked = fake_build(lay, "base", "000000000003", 3.0)
    os.link(linked / "rootfs.ext4", tmp_path / "sandbox-rootfs.ext4")  # as Firecracker does
    opened = fake_build(lay, "base", "000000000004", 2.0)
    free = fake_build(lay, "base", "000000000005", 1.0)
    other = fake_build(lay, "desktop", "000000000006", 1.0)
    stage = lay.images / f"{lay.image_staging_prefix('base')}x1"
    stage.mkdir()
    (lay.images / ".trash-base-000000000009-1").mkdir()
    with open(opened / "rootfs.ext4", "rb"):  # as a running QEMU holds its backing file
        dry = collect(lay, {pinned.name}, dry_run=True)
        assert [i.id for i in dry.removed] == sorted([free.name, other.name])
        assert {(k.image.id, k.reason) for k in dry.kept} == {
            (cur.name, "current"), (pinned.name, "pinned"), (linked.name, "in use"),
            (opened.name, "in use")}
        assert free.is_dir() and stage.is_dir(), "a dry run removes nothing"
        assert dry.freed_bytes > 0

        # a bare recipe name pins every build of that recipe
        kept = collect(lay, {pinned.name, "desktop"}, dry_run=True)
        assert [i.id for i in kept.removed] == [free.name]

        done = collect(lay, {pinned.name, "desktop"})
    assert [i.id for i in done.removed] == [free.name]
    assert not free.exists()
    for d in (cur, pinned, linked, opened, other):
        assert (d / "rootfs.ext4").is_file()
    assert sorted(p.name for p in lay.images.iterdir() if p.name.startswith((".staging",
                                                                             ".trash"))) == []
    assert lay.image_link("base").resolve() == cur.resolve()

    # a data dir whose images folder is someone else's cache is not collected from
    shared = Layout(tmp_path / "other")
    shared.root.mkdir()
    (shared.root / "images").symlink_to(lay.images)
    with pytest.raises(ImageError, match="symlink"):
        collect(shared, set())
