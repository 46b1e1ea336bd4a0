"""Real pieces for the operations tests: a test CA, nginx, sshd, Hangar's CLI.

Everything lives under a temporary folder and runs on free loopback ports;
each class stops what it started (``stop``), pass or fail.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from conftest import SRC, free_port

ROOT = SRC.parent
SCRIPTS = ROOT / "scripts"


def fixed_port() -> int:
    """A free port below the ephemeral range (32768-60999 on Linux).

    For a server that stops and starts again on the same port: while it is
    down, another process's free_port() (an ephemeral port) cannot take it.
    """
    import random

    for _ in range(200):
        port = random.randint(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port in 20000-32000")


def wait_port(port: int, proc: subprocess.Popen[bytes] | None = None, timeout: float = 20,
              host: str = "127.0.0.1") -> None:
    """Wait until ``host:port`` accepts connections; fail early if ``proc`` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode}")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing listens on {host}:{port} after {timeout} s")


def hangar_cli(*args: str, env: dict[str, str] | None = None,
               check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``hangar ARGS`` from this checkout's sources."""
    full_env = {**os.environ, "PYTHONPATH": str(SRC), **(env or {})}
    r = subprocess.run([sys.executable, "-m", "hangar.cli", *args], env=full_env,
                       capture_output=True, text=True, timeout=120)
    if check and r.returncode != 0:
        raise AssertionError(f"hangar {' '.join(args)} failed ({r.returncode}):\n"
                             f"{r.stdout}\n{r.stderr}")
    return r


class TestCA:
    """A throwaway CA and a certificate for ``localhost`` and 127.0.0.1 (openssl)."""

    __test__ = False

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.ca = folder / "ca.pem"
        self.cert = folder / "cert.pem"
        self.key = folder / "key.pem"
        ca_key = folder / "ca-key.pem"
        csr = folder / "cert.csr"
        ext = folder / "ext.cnf"
        ext.write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n"
                       "extendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\n")

        def ossl(*args: str) -> None:
            subprocess.run(["openssl", *args], check=True, capture_output=True)

        ossl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key),
             "-out", str(self.ca), "-days", "2", "-subj", "/CN=Hangar test CA")
        ossl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(self.key), "-out", str(csr),
             "-subj", "/CN=localhost")
        ossl("x509", "-req", "-in", str(csr), "-CA", str(self.ca), "-CAkey", str(ca_key),
             "-CAcreateserial", "-out", str(self.cert), "-days", "2", "-extfile", str(ext))


class Nginx:
    """Debian's nginx in the foreground with a private prefix, serving one site file."""

    def __init__(self, folder: Path, site: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.error_log = folder / "error.log"
        self.conf = folder / "nginx.conf"
        # Workers run as root: the temporary folders are private (0700).
        self.conf.write_text(f"""
user root;
worker_processes 1;
pid {folder}/nginx.pid;
error_log {self.error_log} info;
events {{ worker_connections 512; }}
http {{
    access_log {folder}/access.log;
    client_body_temp_path {folder}/client_body;
    proxy_temp_path {folder}/proxy;
    fastcgi_temp_path {folder}/fastcgi;
    uwsgi_temp_path {folder}/uwsgi;
    scgi_temp_path {folder}/scgi;
    include {site};
}}
""")
        self.proc: subprocess.Popen[bytes] | None = None

    def test_config(self) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["nginx", "-t", "-p", str(self.folder), "-e", str(self.error_log),
                               "-c", str(self.conf)], capture_output=True, text=True)

    def start(self, port: int, host: str = "127.0.0.1") -> None:
        self.proc = subprocess.Popen(
            ["nginx", "-p", str(self.folder), "-e", str(self.error_log), "-c", str(self.conf),
             "-g", "daemon off;"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
            start_new_session=True)
        try:
            wait_port(port, self.proc, host=host)
        except RuntimeError:
            self.stop()
            raise RuntimeError(f"nginx did not start: {self.error_log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


SYSTEMD = Path("/lib/systemd/systemd")
# Units a private systemd must never start: everything sysinit.target would pull in
# acts on the host (it wipes /tmp, applies sysctls, writes /etc and /var/log).
MASKED = """sysinit.target basic.target sockets.target timers.target paths.target local-fs.target
local-fs-pre.target swap.target network.target network-online.target network-pre.target
cryptsetup.target integritysetup.target veritysetup.target time-set.target
systemd-journald.service systemd-journald.socket systemd-journald-dev-log.socket
systemd-journald-audit.socket systemd-journal-flush.service systemd-tmpfiles-setup.service
systemd-tmpfiles-setup-dev.service systemd-tmpfiles-clean.timer systemd-sysctl.service
systemd-binfmt.service proc-sys-fs-binfmt_misc.automount proc-sys-fs-binfmt_misc.mount
systemd-sysusers.service systemd-modules-load.service systemd-remount-fs.service
systemd-update-utmp.service systemd-random-seed.service systemd-udevd.service
systemd-udev-trigger.service systemd-ask-password-console.path systemd-ask-password-wall.path
dev-hugepages.mount dev-mqueue.mount sys-kernel-debug.mount sys-kernel-tracing.mount
sys-fs-fuse-connections.mount sys-kernel-config.mount tmp.mount nftables.service
systemd-firstboot.service systemd-machine-id-commit.service ldconfig.service
systemd-hwdb-update.service systemd-journal-catalog-update.service
systemd-update-done.service systemd-pstore.service""".split()
ALLOWED_ACTIVE = {"init.scope", "-.slice", "system.slice", "hangar-test.target"}

RUN_SH = """#!/bin/sh
# PID 1 of new pid, mount, cgroup, uts and ipc namespaces; nothing mounted here
# reaches the host. systemd sees private /proc, /run, /tmp, /var/tmp and /var/log.
set -e
mount --make-rprivate /
mount -t proc proc /proc
# A folder under one of them that the units need (the image cache) is bound back on top.
keep=$(cat "$1/keep" 2>/dev/null || true)
if [ -n "$keep" ]; then mkdir -p "$1/kept"; mount --bind "$keep" "$1/kept"; fi
for d in /run /tmp /var/tmp /var/log; do mount -t tmpfs -o mode=0755 tmpfs "$d"; done
chmod 1777 /tmp /var/tmp
if [ -n "$keep" ]; then mkdir -p "$keep"; mount --bind "$1/kept" "$keep"; fi
mkdir -p /run/systemd/system
cp -r "$1"/units/. /run/systemd/system/
for u in $(cat "$1/masked"); do ln -sf /dev/null "/run/systemd/system/$u"; done
exec {systemd} --system --unit=hangar-test.target --log-target=null </dev/null >/dev/null 2>&1
"""

LAUNCH_SH = """#!/bin/sh
# Move into sub-cgroups of our own (named $2) in every hierarchy, then unshare.
set -e
while IFS=: read -r _ ctrl path; do
  case "$ctrl" in
    name=systemd) d=/sys/fs/cgroup/systemd ;;
    "") d=/sys/fs/cgroup/unified; [ -d "$d" ] || d=/sys/fs/cgroup ;;
    *) d=/sys/fs/cgroup/$ctrl ;;
  esac
  [ -d "$d$path" ] || continue
  mkdir -p "$d$path/$2"
  if [ -f "$d$path/cpuset.cpus" ] && [ -f "$d$path/$2/cpuset.cpus" ]; then
    cat "$d$path/cpuset.cpus" > "$d$path/$2/cpuset.cpus"
    cat "$d$path/cpuset.mems" > "$d$path/$2/cpuset.mems"
  fi
  echo $$ > "$d$path/$2/cgroup.procs" || true
done < /proc/self/cgroup
exec unshare --pid --fork --mount --cgroup --uts --ipc --propagation private \\
  env container=hangar-test sh "$1/run.sh" "$1"
"""


class PrivateSystemd:
    """A real systemd as PID 1 of private namespaces, running only the units given.

    Its /run, /tmp, /var/tmp and /var/log are private tmpfs and every unit that
    sysinit.target would start is masked, so it touches nothing of the host;
    ``units`` are copied to its /run/systemd/system. Files it must read live
    under ``folder`` (outside /tmp), or in ``keep``, a folder that stays visible
    where it is (e.g. an image cache under /tmp). ``stop`` powers it off and removes
    its cgroups.
    """

    def __init__(self, folder: Path, units: dict[str, str], keep: Path | None = None) -> None:
        self.folder = folder
        self.name = f"hangar-test-{os.getpid()}-{int(time.time())}"
        (folder / "units").mkdir(parents=True)
        for name, text in {**units, "hangar-test.target": "[Unit]\nDefaultDependencies=no\n"
                           }.items():
            (folder / "units" / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / "units" / name).write_text(text)
        (folder / "masked").write_text("\n".join(MASKED) + "\n")
        (folder / "run.sh").write_text(RUN_SH.replace("{systemd}", str(SYSTEMD)))
        (folder / "launch.sh").write_text(LAUNCH_SH)
        if keep is not None:
            (folder / "keep").write_text(str(keep))
        self.proc: subprocess.Popen[bytes] | None = None
        self.pid: int | None = None

    @staticmethod
    def unavailable() -> str | None:
        """Why a private systemd cannot run here, or None."""
        if os.geteuid() != 0:
            return "needs root"
        for tool in ("unshare", "nsenter", "systemctl"):
            if shutil.which(tool) is None:
                return f"needs {tool}"
        if not SYSTEMD.exists():
            return "needs systemd's binary"
        if Path("/run/systemd/system").is_dir():
            return "systemd runs this host: test the unit there instead"
        return None

    def start(self) -> None:
        self.proc = subprocess.Popen(["sh", str(self.folder / "launch.sh"), str(self.folder),
                                      self.name], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.pid is None:
                self.pid = _child_running(self.proc.pid, SYSTEMD)
            if self.pid and self.ctl("is-system-running", check=False).stdout.strip() in (
                    "running", "degraded"):
                break
            if self.proc.poll() is not None:
                raise RuntimeError("the private systemd exited at start")
            time.sleep(0.2)
        else:
            self.stop()
            raise RuntimeError("the private systemd did not come up in 30 s")
        active = self.active_units()
        if not active <= ALLOWED_ACTIVE:
            self.stop()
            raise RuntimeError(f"the private systemd started more than asked: {active}")

    def ctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """``systemctl ARGS`` inside; a failed ``start`` or ``restart`` says the unit's
        status (systemd's reason: a step that failed, an exit code) in its AssertionError."""
        r = self.run("systemctl", *args, check=False)
        if check and r.returncode != 0:
            why = ""
            if args and args[0] in ("start", "restart"):
                st = self.run("systemctl", "status", "--no-pager", "-l", *args[1:], check=False)
                why = st.stdout + st.stderr
            raise AssertionError(f"systemctl {' '.join(args)}: {r.returncode}\n{r.stdout}"
                                 f"{r.stderr}{why}")
        return r

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        assert self.pid
        r = subprocess.run(["nsenter", "-t", str(self.pid), "-m", "-p", "--", *argv],
                           capture_output=True, text=True, timeout=120)
        if check and r.returncode != 0:
            raise AssertionError(f"{' '.join(argv)}: {r.returncode}\n{r.stdout}{r.stderr}")
        return r

    def active_units(self) -> set[str]:
        out = self.ctl("list-units", "--no-legend", "--plain", "--state=active",
                       "--type=service,target,socket,timer,path,scope,slice,automount",
                       check=False).stdout
        return {line.split()[0] for line in out.splitlines() if line.strip()}

    def prop(self, unit: str, name: str) -> str:
        return self.ctl("show", "-p", name, "--value", unit).stdout.strip()

    def stop(self) -> None:
        if self.pid and self.proc and self.proc.poll() is None:
            self.run("systemctl", "poweroff", check=False)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                os.kill(self.pid, signal.SIGKILL)
                self.proc.wait()
        # The namespace's processes were killed with its init; the last of them (a split
        # server's helper, a VMM) may still be exiting: their cgroups empty soon after.
        deadline = time.monotonic() + 15
        for d in _cgroup_dirs(self.name):
            while time.monotonic() < deadline and any(
                    f.read_text().strip() for f in d.rglob("cgroup.procs")):
                time.sleep(0.1)
            for sub in sorted((p for p in d.rglob("*") if p.is_dir()),
                              key=lambda p: -len(p.parts)):
                sub.rmdir()
            d.rmdir()


def _child_running(parent: int, exe: Path) -> int | None:
    """The pid of a child of ``parent`` whose program is ``exe``, or None."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == parent and (d / "exe").resolve() == exe.resolve():
                return int(d.name)
        except (OSError, ValueError, IndexError):
            continue
    return None


def _cgroup_dirs(name: str) -> list[Path]:
    """The sub-cgroups ``name`` that launch.sh made beside this process's cgroups."""
    found = []
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, ctrl, path = line.split(":", 2)
        if ctrl == "name=systemd":
            base = Path("/sys/fs/cgroup/systemd")
        elif ctrl == "":
            base = Path("/sys/fs/cgroup/unified")
            if not base.is_dir():
                base = Path("/sys/fs/cgroup")
        else:
            base = Path("/sys/fs/cgroup") / ctrl
        d = base / path.lstrip("/") / name
        if d.is_dir():
            found.append(d)
    return found


class Sshd:
    """Debian's OpenSSH server on a free port, root login with a throwaway key only."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        folder.chmod(0o700)
        self.folder = folder
        self.port = free_port()
        self.client_key = folder / "id_ed25519"
        host_key = folder / "host_ed25519"
        for key in (self.client_key, host_key):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)],
                           check=True)
        auth = folder / "authorized_keys"
        auth.write_text((folder / "id_ed25519.pub").read_text())
        auth.chmod(0o600)
        self.config = folder / "sshd_config"
        self.config.write_text(f"""
Port {self.port}
ListenAddress 127.0.0.1
HostKey {host_key}
PidFile {folder}/sshd.pid
AuthorizedKeysFile {auth}
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PrintMotd no
Subsystem sftp internal-sftp
""")
        self.log = folder / "sshd.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._made_run_dir = False

    def start(self) -> None:
        run_dir = Path("/run/sshd")  # sshd's privilege separation folder
        if not run_dir.exists():
            run_dir.mkdir(mode=0o755)
            self._made_run_dir = True
        self.proc = subprocess.Popen(["/usr/sbin/sshd", "-D", "-e", "-f", str(self.config)],
                                     stdout=open(self.log, "ab"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        try:
            wait_port(self.port, self.proc)
        except RuntimeError:
            self.stop()
            raise RuntimeError(f"sshd did not start: {self.log.read_text()[-2000:]}")

    def ssh_args(self) -> list[str]:
        """Options for ssh (scripts/deploy.sh passes them on)."""
        return ["-p", str(self.port), "-i", str(self.client_key), "-o", "BatchMode=yes",
                "-o", "StrictHostKeyChecking=no", "-o", f"UserKnownHostsFile={os.devnull}",
                "-o", "LogLevel=ERROR"]

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self._made_run_dir:
            Path("/run/sshd").rmdir()
            self._made_run_dir = False
