"""Shared fixtures: a real Hangar server on real microVMs.

The guest image is built once per machine into ``$HANGAR_DATA_DIR``
(default /var/lib/hangar); each test session runs its own server on a
free port with a private data directory whose ``images`` links to that
cache. Every VM a test makes is deleted when it ends, and the session
fails if any VMM process of its data directory outlives it.

Waiting: ``wait_for(check, timeout, what)`` is the one polling helper.
Waits on a VM (a boot, a wake, a restore, a guest that must notice
something) come from this machine's own speed, never from constants tuned
on another: the session fixture ``waits`` times one create of the base
image on the session's server (a restore of its template snapshot, which
the install makes: a fraction of a cold boot), and ``waits.vm(k)`` is
``k`` such creates, at least ``VM_WAIT_FLOOR_S``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import httpx
import pytest

from hangar.engines.agent_client import AgentClient
from hangar.engines.base import VM, Engine, VMSpec, again_if_stalled
from hangar.engines.cgroups import Hierarchy
from hangar.engines.process import vmm_pids  # noqa: F401 (the tests import it from here)

pytest_plugins = [
    "log_guard",  # secrets the suite handled stay out of logs, stores, backups
    "schedule",  # how the tests spread over parallel workers (scripts/test.sh)
]

SHARED = Path(os.environ.get("HANGAR_DATA_DIR", "/var/lib/hangar"))
SRC = Path(__file__).resolve().parents[1] / "src"

T = TypeVar("T")


def wait_for(check: Callable[[], T], timeout: float, what: str, *, every: float = 0.1) -> T:
    """Call ``check`` every ``every`` seconds until it returns something truthy; return that.

    Raises AssertionError naming ``what`` and the last value when ``timeout``
    seconds pass first.
    """
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} "
                                 f"(last: {got!r})")
        time.sleep(every)


VM_WAIT_FLOOR_S = 30.0
"""The least any wait on a VM gets, seconds: a fast machine still has scheduling noise."""


@dataclass(frozen=True)
class Waits:
    """Deadlines for waits on VMs, from one create timed on this machine.

    ``boot_s`` is the wall time of ``POST /sandboxes`` for the base image at
    its default size: a restore of its template snapshot (VMM start, memory,
    agent; seconds), not a cold boot: 0.9-1.9 s on a 2-core TCG host at load
    1-5, 5-12 s at load 14 when a cold boot there took 38 s. ``vm(k)`` is ``k`` such
    creates, at least ``floor`` (default ``VM_WAIT_FLOOR_S``): use it for
    anything that waits on a guest (a boot, a wake, a restore, a TTL that a
    VM must honour).
    """

    boot_s: float

    def vm(self, k: float, floor: float = VM_WAIT_FLOOR_S) -> float:
        return max(floor, k * self.boot_s)


@contextlib.contextmanager
def engine_dir(base_image: Path, prefix: str) -> Iterator[Path]:
    """A data directory for one engine-level test, under /tmp (short, for Unix socket
    paths): its ``images`` links to the shared cache, with the shared engine probe. On
    exit every VMM whose command line still names it is killed, it is removed, and the
    leak fails the test."""
    root = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    (root / "images").symlink_to(base_image.parent)
    probe = SHARED / "engine-probe.json"
    if probe.exists():
        shutil.copy(probe, root / "engine-probe.json")
    try:
        yield root
    finally:
        leaked = vmm_pids(str(root))
        for pid in leaked:
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(root, ignore_errors=True)
        assert not leaked, f"VMM processes outlived the test: {leaked}"


async def boot_cold(engine: Engine, spec: VMSpec, timeout: float) -> tuple[VM, AgentClient]:
    """``engine.boot(spec)`` and its agent, as the core boots a sandbox
    (``hangar.core.launch``): a boot found stalled (``BootStalled``: its guest kernel
    disabled its only timer) is made again, ``BOOT_ATTEMPTS`` boots in all. The VM
    of a failed boot is stopped here; the caller owns the one returned."""
    async def attempt() -> tuple[VM, AgentClient]:
        vm = await engine.boot(spec)
        try:
            return vm, await engine.connect_agent(vm, timeout, cold=True)
        except BaseException:
            await engine.stop(vm)
            raise

    return await again_if_stalled(attempt, {"sandbox_id": spec.sandbox_id})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", autouse=True)
def later_images(request: pytest.FixtureRequest) -> None:
    """A module that needs an image other than base, or builds into the image cache
    (``schedule.needs_later_images``), first waits for the builds ``scripts/test.sh`` left
    running (a shared lock on ``schedule.LATER_LOCK``), then links what they made into the
    split servers made before; the module's own ``build_image`` then finds its image built
    (or builds it and says why not)."""
    import fcntl

    from schedule import LATER_LOCK, needs_later_images

    module = Path(str(request.path)).stem
    if not needs_later_images(module) or not LATER_LOCK.exists():
        return
    with open(LATER_LOCK, "rb") as f:
        started = time.monotonic()
        fcntl.flock(f, fcntl.LOCK_SH)
        waited = time.monotonic() - started
    if waited > 1:
        print(f"\n{module}: waited {waited:.0f} s for the images built in the background",
              file=sys.stderr)
    # servers made before those builds ended (a removed one is forgotten)
    _SPLIT_COPIES[:] = [(b, d) for b, d in _SPLIT_COPIES if (d / "images").is_dir()]
    for base_image, d in _SPLIT_COPIES:
        _link_builds(base_image.parent, d, base_image.name)


@pytest.fixture(scope="session", autouse=True)
def vmm_uid_claims() -> Iterator[None]:
    """At the end, the VMM uid claims that servers killed mid-test left behind (their data
    directories removed before a release) are dropped (``UidAllocator.sweep``)."""
    yield
    if os.geteuid() == 0:
        from hangar.engines.confine import ANY_UID
        from hangar.engines.uids import UidAllocator

        UidAllocator(1, ANY_UID).sweep()


@pytest.fixture(scope="session")
def base_image() -> Path:
    """Build (or reuse) the base image in the shared cache."""
    from hangar.images import build_image
    from hangar.layout import Layout

    layout = Layout(SHARED)
    layout.ensure()
    img = build_image(layout, "base", progress=lambda m: print(f"image: {m}", file=sys.stderr))
    # Run (or read) the probe boots once, so every test server reuses their answers.
    from hangar.engines.doctor import choose_engine
    from hangar.images import resolve_image

    choose_engine("auto", layout, resolve_image(layout, "base"))
    return img.dir


PRIVSEP = os.environ.get("HANGAR_TEST_PRIVSEP", "1") == "1"
"""Start every server split (``HANGAR_PRIVSEP=1``: its HTTP process runs as ``hangar``);
``HANGAR_TEST_PRIVSEP=0`` starts them as root (``HANGAR_PRIVSEP=0``)."""


@functools.lru_cache(maxsize=1)
def privsep_python() -> tuple[str, str]:
    """An interpreter whose standard library the ``hangar`` user can read after the
    split, and the PYTHONPATH it needs: this one when that user can read its standard
    library and packages (asked of the kernel as that user: scripts/install.sh grants it
    with ACLs), else the system's ``python3`` of the same version with this one's
    site-packages (a prefix under root's home that nobody granted)."""
    import pwd
    import sysconfig

    from hangar.privileged.split import unreadable

    pw = pwd.getpwnam("hangar")
    paths = sysconfig.get_paths()
    if unreadable([Path(paths["stdlib"]), Path(paths["purelib"]), SRC],
                  pw.pw_uid, pw.pw_gid) is None:
        return sys.executable, str(SRC)
    return "/usr/bin/python3", f"{SRC}:{paths['purelib']}"


class Server:
    """A ``hangar serve`` subprocess and an httpx client for it."""

    def __init__(self, data_dir: Path, port: int, extra_env: dict[str, str] | None = None):
        self.data_dir = data_dir
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        # No warm pool unless a test asks for one: pooled VMs would compete
        # for this machine's two cores with the VMs under test. No guest NICs
        # either: networking is tested inside namespaces (test_network.py).
        self.env = {**os.environ, "HANGAR_DATA_DIR": str(data_dir), "HANGAR_PORT": str(port),
                    "HANGAR_POOL_SIZE": "0", "HANGAR_NETWORK": "off", "PYTHONPATH": str(SRC),
                    **(extra_env or {})}
        self.python = server_python(self.env)
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = data_dir / "server.log"

    def start(self, timeout: float = 60) -> None:
        self.proc = subprocess.Popen(
            [self.python, "-m", "hangar.cli", "serve"], env=self.env,
            stdout=open(self.log, "ab"), stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("server did not start")

    def refresh_images(self) -> None:
        """Builds and names made in the shared image cache since this server started (a
        template a test built), linked into its images when they are a split server's copy
        and handed to its user as the split hands its own; nothing when it links the cache."""
        if not (self.data_dir / "images").is_symlink():
            _link_builds(SHARED / "images", self.data_dir)

    @property
    def key(self) -> str:
        return (self.data_dir / "api-key").read_text().strip()

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"X-API-Key": self.key}, timeout=300)

    def kill(self, sig: int = signal.SIGTERM) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def link_images(base_image: Path, d: Path, privsep: bool = PRIVSEP) -> None:
    """``d/images``: the shared image cache, linked; for a split server (the shared data
    dir is root's only) a hard-linked copy of it (other servers add and remove builds
    meanwhile: what vanished mid-copy is not needed). Its template snapshots are
    restored, not made again: the split hands their files to the server read-only
    (root's, group-readable by its group), which the shared cache's root servers read as
    before. Lock files and half-made snapshots are the shared cache's own, not linked."""
    if not privsep:
        (d / "images").symlink_to(base_image.parent)
        return
    (d / "images").mkdir()
    _link_builds(base_image.parent, d, base_image.name)
    assert (d / "images" / base_image.name / "rootfs.ext4").exists(), "image copy failed"
    _SPLIT_COPIES.append((base_image, d))


_SPLIT_COPIES: list[tuple[Path, Path]] = []
"""The (base image, data directory) of each split server whose image cache
``link_images`` copied: ``later_images`` adds the builds made since to them."""


def _link_builds(cache: Path, d: Path, also: str = "") -> None:
    """Into ``d/images``: the names of the image cache ``cache`` (a name that points
    elsewhere now is repointed), and a hard-linked copy of each build that a name points at
    (and ``also``) not already there. Only those builds: older ones are many and unused,
    and every entry linked in costs time at the start and removal of a server. A build
    added to a running server's copy is handed to it as ``hangar image build`` hands one
    (``split.hand_new``)."""
    from hangar.privileged.split import hand_new

    images = d / "images"
    started = any(images.iterdir())
    names = [e for e in cache.iterdir() if e.is_symlink() and not e.name.startswith(".")]
    builds = {also} - {""} | {os.readlink(e) for e in names}
    for e in names:
        target, mine = os.readlink(e), images / e.name
        if not mine.is_symlink() or os.readlink(mine) != target:
            tmp = images / f".{e.name}.new"
            tmp.unlink(missing_ok=True)
            tmp.symlink_to(target)
            os.replace(tmp, mine)
    new = [b for b in sorted(builds) if (cache / b).is_dir() and not (images / b).exists()]
    if not new:
        return
    subprocess.run(["cp", "-al", *(str(cache / b) for b in new), str(images)],
                   capture_output=True)
    for b in new:
        _unlink_locks(images / b)
        if started and (images / b).is_dir():
            hand_new(d, images / b)


def _unlink_locks(build: Path) -> None:
    """Lock files and half-made template snapshots out of a hard-linked copy of a build."""
    for snaps in build.glob("template-snapshots"):
        for entry in snaps.iterdir():
            if entry.name.startswith("."):
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)


def split_env(env: dict[str, str]) -> str:
    """Make ``env`` start a split server (``HANGAR_PRIVSEP=1``, the PYTHONPATH of
    ``privsep_python``); returns the interpreter to start it with."""
    python, env["PYTHONPATH"] = privsep_python()
    env["HANGAR_PRIVSEP"] = "1"
    return python


def server_python(env: dict[str, str]) -> str:
    """The interpreter to start a server of the suite with ``env``, which this sets up:
    split (``split_env``) when ``PRIVSEP`` or ``env`` asks for it (``HANGAR_PRIVSEP=1``),
    else ``HANGAR_PRIVSEP=0`` (a root server) and this interpreter."""
    if env.get("HANGAR_PRIVSEP", "1" if PRIVSEP else "0") == "1":
        return split_env(env)
    env["HANGAR_PRIVSEP"] = "0"
    return sys.executable


def make_data_dir(base_image: Path, privsep: bool = PRIVSEP) -> Path:
    d = Path(tempfile.mkdtemp(prefix="hg-", dir="/tmp"))
    link_images(base_image, d, privsep)
    for name in ("engine-probe.json", "firecracker-probe.json"):
        if (SHARED / name).exists():
            shutil.copy(SHARED / name, d / name)
    return d


@functools.cache
def vmm_cgroup_hierarchy() -> Hierarchy | None:
    """Where the suite's servers (and their root helpers) make VMM cgroups: they inherit
    this process's groups and settings, so the hierarchy detected here is theirs (on cgroup
    v1 the parent ``hangar`` lies under this process's own group of each controller, so
    a test runner's memory group holds its own). None when the host offers none. Detected
    once per test process: ``vmm_cgroups`` asks for it at every check."""
    return Hierarchy.detect(os.environ.get("HANGAR_VMM_CGROUPS", "auto"))[0]


def vmm_cgroups(sandbox_id: str) -> list[Path]:
    """The cgroup folders ``hangar/<sandbox_id>`` that exist, in each controller's
    hierarchy of ``vmm_cgroup_hierarchy`` (one on v2, one per controller on v1)."""
    at = vmm_cgroup_hierarchy()
    return [] if at is None else [d for d in at.group(sandbox_id).dirs if d.is_dir()]


def cleanup(server: Server) -> list[int]:
    """Delete what the server still runs, stop it, kill leftovers; return leaked pids."""
    try:
        with server.client() as c:
            for sb in c.get("/sandboxes").json().get("sandboxes", []):
                c.delete(f"/sandboxes/{sb['id']}")
    except Exception:
        pass
    server.kill()
    leaked = vmm_pids(str(server.data_dir))
    for pid in leaked:
        os.kill(pid, signal.SIGKILL)
    return leaked


@contextlib.contextmanager
def own_server(base_image: Path, env: dict[str, str] | None = None,
               data_dir: Path | None = None) -> Iterator[Server]:
    """A started server of a test's own, on ``data_dir`` (a new ``make_data_dir`` by
    default) with ``env`` added to its environment. Afterwards its sandboxes are deleted,
    it is stopped, its folder removed, and it fails if a VMM outlived it."""
    d = data_dir if data_dir is not None else make_data_dir(base_image)
    srv = Server(d, free_port(), env)
    try:
        srv.start()
        yield srv
    finally:
        leaked = cleanup(srv)
        shutil.rmtree(d, ignore_errors=True)
        assert not leaked, f"VMM processes outlived the server: {leaked}"


@pytest.fixture(scope="session")
def server(base_image: Path) -> Iterator[Server]:
    d = make_data_dir(base_image)
    srv = Server(d, free_port())
    srv.start()
    yield srv
    leaked = cleanup(srv)
    shutil.rmtree(d, ignore_errors=True)
    assert not leaked, f"VMM processes outlived the session: {leaked}"


@pytest.fixture(scope="session")
def waits(server: Server) -> Waits:
    """This machine's VM deadlines (``Waits``), from one create (a template restore) timed
    on the session's server. Printed once, so a slow run says how slow its machine was."""
    with server.client() as c:
        started = time.monotonic()
        r = c.post("/sandboxes", json={})
        took = time.monotonic() - started
        assert r.status_code == 201, r.text
        c.delete(f"/sandboxes/{r.json()['id']}")
    print(f"\none create of the base image ({r.json()['source']}) took {took:.1f} s here",
          file=sys.stderr)
    return Waits(boot_s=took)


@pytest.fixture(scope="session")
def api(server: Server) -> Iterator[httpx.Client]:
    with server.client() as c:
        yield c


@pytest.fixture(scope="session")
def sandbox(api: httpx.Client) -> Iterator[str]:
    """One running sandbox shared by the read-mostly tests of a session."""
    r = api.post("/sandboxes", json={})
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    yield sid
    api.delete(f"/sandboxes/{sid}")


@pytest.fixture
def fresh_sandbox(api: httpx.Client) -> Iterator[str]:
    """A sandbox of the test's own, deleted when it ends."""
    r = api.post("/sandboxes", json={})
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    yield sid
    api.delete(f"/sandboxes/{sid}")
