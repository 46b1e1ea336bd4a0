"""Real pieces for the operations tests: a test CA, nginx, sshd, Hangar's CLI.

Everything lives under a temporary folder and runs on free loopback ports;
each class stops what it started (``stop``), pass or fail.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from conftest import SRC, free_port

ROOT = SRC.parent
SCRIPTS = ROOT / "scripts"


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

    def start(self, port: int) -> None:
        self.proc = subprocess.Popen(
            ["nginx", "-p", str(self.folder), "-e", str(self.error_log), "-c", str(self.conf),
             "-g", "daemon off;"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
            start_new_session=True)
        try:
            wait_port(port, self.proc)
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
