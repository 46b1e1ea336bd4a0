"""What the benchmarks share: a private Hangar server and percentiles.

``start_server`` runs ``hangar serve`` on a free port with a private data
directory that links the shared image cache (``$HANGAR_DATA_DIR``, default
/var/lib/hangar) and copies its cached probe results; guests get no NIC and
there is no warm pool unless ``env`` says otherwise. ``stop_server`` ends it
and removes the directory.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

SHARED = Path(os.environ.get("HANGAR_DATA_DIR", "/var/lib/hangar"))


def pct(xs: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``xs``, nearest rank."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def start_server(env: dict[str, str] | None = None
                 ) -> tuple[subprocess.Popen[bytes], Path, str]:
    """(process, data directory, base URL) of a ready server; its log is
    ``<data directory>/server.log``."""
    d = Path(tempfile.mkdtemp(prefix="hgb-", dir="/tmp"))
    (d / "images").symlink_to(SHARED / "images")
    for name in ("engine-probe.json", "firecracker-probe.json"):
        if (SHARED / name).exists():
            shutil.copy(SHARED / name, d / name)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    full = {**os.environ, "HANGAR_DATA_DIR": str(d), "HANGAR_PORT": str(port),
            "HANGAR_POOL_SIZE": "0", "HANGAR_NETWORK": "off", **(env or {})}
    log = open(d / "server.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "hangar.cli", "serve"], env=full,
                            stdout=log, stderr=subprocess.STDOUT)
    log.close()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("hangar serve exited")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, d, url
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError("hangar serve did not come up in 120 s")


def api_key(data_dir: Path) -> str:
    return (data_dir / "api-key").read_text().strip()


def stop_server(proc: subprocess.Popen[bytes], data_dir: Path) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    shutil.rmtree(data_dir, ignore_errors=True)
