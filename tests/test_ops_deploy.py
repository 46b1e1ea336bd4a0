"""scripts/deploy.sh against this machine over SSH: upgrades and rollbacks.

Debian's OpenSSH server runs on a free port with a throwaway key; the
"host" keeps its releases, settings and link under a temporary prefix, and
its server runs on a free port with a private data directory. This machine
runs no systemd, so the deploys take release.sh's restart without it
(SIGTERM to the pid file, setsid nohup), the path of scripts/install.sh.
Each deploy builds wheels from a copy of this checkout with its own version.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from conftest import make_data_dir, vmm_pids
from ops_support import ROOT, Sshd, fixed_port

vm = pytest.mark.vm
pytestmark = pytest.mark.skipif(not Path("/usr/sbin/sshd").exists() or os.geteuid() != 0,
                                reason="needs root and Debian's openssh-server")


@dataclass
class Host:
    base: Path
    sshd: Sshd
    data: Path
    port: int
    prefix: Path
    env_file: Path
    link: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self) -> httpx.Client:
        key = (self.data / "api-key").read_text().strip()
        return httpx.Client(base_url=self.url, headers={"X-API-Key": key}, timeout=300)

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=5).json()

    def current(self) -> str:
        return os.readlink(self.prefix / "current")

    @property
    def run(self) -> Path:
        """The nohup server's pid file and log (``HANGAR_RUN_DIR``: root's, not the data
        directory, which is the split server's)."""
        return self.base / "run"

    def server_pid(self) -> int | None:
        try:
            pid = int((self.run / "hangar.pid").read_text())
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            return None if state == "Z" else pid  # an exited child not yet reaped
        except (OSError, ValueError):
            return None


def source_tree(dest: Path, version: str, broken: bool = False) -> Path:
    """A copy of this checkout whose Hangar reports ``version``; ``broken``: /health fails."""
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "*.pyc")
    dest.mkdir(parents=True)
    for name in ("src", "scripts"):
        shutil.copytree(ROOT / name, dest / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md", "requirements.lock", "requirements-proxy.lock"):
        shutil.copy(ROOT / name, dest / name)
    init = dest / "src/hangar/__init__.py"
    text = init.read_text()
    assert '__version__ = "' in text
    init.write_text(text.split('__version__ = "')[0] + f'__version__ = "{version}"\n')
    if broken:
        with open(dest / "src/hangar/api/health.py", "a") as f:
            f.write('\n\nrouter.routes[:] = [r for r in router.routes\n'
                    '                    if getattr(r, "path", "") != "/health"]\n\n\n'
                    '@router.get("/health")\nasync def broken_health() -> None:\n'
                    '    raise RuntimeError("this build is broken on purpose")\n')
    return dest


def deploy(host: Host, tree: Path) -> subprocess.CompletedProcess[str]:
    """Run the tree's scripts/deploy.sh against root@127.0.0.1 over SSH."""
    argv = ["bash", str(tree / "scripts/deploy.sh")]
    ssh = host.sshd.ssh_args()
    for i in range(0, len(ssh), 2):
        argv += [ssh[i], ssh[i + 1]]
    argv += ["--prefix", str(host.prefix), "--env-file", str(host.env_file),
             "--link", str(host.link), "--health-timeout", "90", "root@127.0.0.1"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHON": sys.executable})
    print(r.stdout[-6000:], r.stderr[-6000:], sep="\n")
    log = host.run / "hangar.log"
    if r.returncode != 0 and log.exists():
        print("server log:", log.read_text()[-3000:], sep="\n")
    return r


@pytest.fixture(scope="module")
def host(base_image: Path) -> Iterator[Host]:
    # A folder of its own, not pytest's: the split server's user reaches the releases
    # through it (release.sh grants it with an ACL), and every other pytest session that
    # starts on this host (a second run, a developer's) takes group and other bits off
    # /tmp/pytest-of-root, the ACL's mask with them: the server could no longer start.
    base = Path(tempfile.mkdtemp(prefix="hg-deploy-", dir="/tmp"))
    sshd = Sshd(base / "ssh")
    sshd.start()
    data = make_data_dir(base_image)
    port = fixed_port()  # the server stops and starts on it
    env_file = base / "etc/hangar/hangar.env"
    env_file.parent.mkdir(parents=True)
    env_file.write_text(f"HANGAR_DATA_DIR={data}\nHANGAR_PORT={port}\nHANGAR_POOL_SIZE=0\n"
                        f"HANGAR_NETWORK=off\nHANGAR_RUN_DIR={base / 'run'}\n")
    h = Host(base, sshd, data, port, base / "opt/hangar", env_file, base / "bin/hangar")
    try:
        r = deploy(h, source_tree(base / "tree-1", "0.1.0+deploy.1"))
        assert r.returncode == 0, r.stderr
        yield h
    finally:
        try:
            with h.client() as c:
                for sb in c.get("/sandboxes").json().get("sandboxes", []):
                    c.delete(f"/sandboxes/{sb['id']}")
        except Exception:
            pass
        pid = h.server_pid()
        if pid:
            os.kill(pid, signal.SIGTERM)
            for _ in range(100):
                if h.server_pid() is None:
                    break
                time.sleep(0.2)
        leaked = vmm_pids(str(data))
        for p in leaked:
            os.kill(p, signal.SIGKILL)
        sshd.stop()
        shutil.rmtree(data, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)
        assert not leaked, f"VMM processes outlived the deploy tests: {leaked}"


@pytest.fixture(scope="module")
def running(host: Host) -> Iterator[dict]:
    """A sandbox with a process running in it, and how to recognise that same boot."""
    with host.client() as c:
        r = c.post("/sandboxes", json={})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        r = c.post(f"/sandboxes/{sid}/exec", json={
            "command": "setsid sleep 100000 >/dev/null 2>&1 < /dev/null & echo $!; "
                       "cat /proc/sys/kernel/random/boot_id"})
        pid, boot_id = r.json()["stdout"].split()
    yield {"id": sid, "pid": pid, "boot_id": boot_id,
           "vmm": vmm_pids(f"hangar-{sid}")}


def assert_same_vm(host: Host, sb: dict) -> None:
    with host.client() as c:
        r = c.post(f"/sandboxes/{sb['id']}/exec", json={
            "command": f"cat /proc/sys/kernel/random/boot_id; kill -0 {sb['pid']} && echo alive"})
        assert r.status_code == 200, r.text
        assert r.json()["stdout"].split() == [sb["boot_id"], "alive"]
        states = {s["id"]: s["state"] for s in c.get("/sandboxes").json()["sandboxes"]}
    assert states[sb["id"]] == "running"
    assert vmm_pids(f"hangar-{sb['id']}") == sb["vmm"]


@vm
def test_first_deploy_installs_a_release(host: Host) -> None:
    assert host.health()["version"] == "0.1.0+deploy.1"
    rel = host.prefix / host.current()
    assert (rel / "version").read_text().strip() == "0.1.0+deploy.1"
    assert os.readlink(host.link) == str(host.prefix / "current/venv/bin/hangar")
    out = subprocess.run([str(host.link), "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "backup" in out.stdout
    assert not list(Path("/tmp").glob("hangar-release.*")), "the upload was not removed"
    # The secret proxy's own environment, where the server looks for it (beside its venv).
    out = subprocess.run([str(rel / ".venv-proxy/bin/mitmdump"), "--version"],
                         capture_output=True, text=True)
    assert out.returncode == 0 and "Mitmproxy: 11.0.2" in out.stdout, out.stderr


@vm
def test_upgrade_keeps_a_running_sandbox(host: Host, running: dict) -> None:
    before_pid, before_release = host.server_pid(), host.current()
    r = deploy(host, source_tree(host.base / "tree-2", "0.1.0+deploy.2"))
    assert r.returncode == 0, r.stderr
    assert host.health()["version"] == "0.1.0+deploy.2"
    assert host.current() != before_release and host.server_pid() != before_pid
    assert (host.prefix / before_release / "venv").is_dir(), "the previous release is kept"
    assert_same_vm(host, running)
    assert "sandbox adopted" in (host.run / "hangar.log").read_text()


@vm
def test_failed_health_check_rolls_back(host: Host, running: dict) -> None:
    good = host.current()
    good_version = (host.prefix / good / "version").read_text().strip()
    r = deploy(host, source_tree(host.base / "tree-3", "0.1.0+deploy.3", broken=True))
    assert r.returncode == 2, r.stderr
    assert "rolled back" in r.stderr + r.stdout
    assert host.current() == good
    assert host.health()["version"] == good_version
    failed = [p for p in (host.prefix / "releases").iterdir() if (p / "FAILED").exists()]
    assert [p.name.split("-")[0] for p in failed] == ["0.1.0+deploy.3"]
    assert_same_vm(host, running)


@vm
def test_server_the_pid_file_does_not_name_stops_the_deploy(host: Host, tmp_path: Path) -> None:
    """A server answering on the port without the pid file (started by hand): refused."""
    pidfile = host.run / "hangar.pid"
    saved = pidfile.read_text()
    before = host.current()
    stage = tmp_path / "stage"
    (stage / "wheels").mkdir(parents=True)
    pidfile.unlink()
    try:
        r = subprocess.run(["bash", str(ROOT / "scripts/release.sh"), "--stage", str(stage),
                            "--version", "9.9.9", "--prefix", str(host.prefix),
                            "--env-file", str(host.env_file), "--link", "none",
                            "--images", "none"], capture_output=True, text=True, timeout=60)
    finally:
        pidfile.write_text(saved)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "does not name it" in r.stderr and "nothing was changed" in r.stderr
    assert host.current() == before
    assert not [p for p in (host.prefix / "releases").iterdir() if p.name.startswith("9.9.9")]
    assert host.health()["status"] == "ok"
