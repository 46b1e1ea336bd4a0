"""What the benchmarks share: a private Hangar server, percentiles, the machine, peers.

``start_server`` runs ``hangar serve`` on a free port with a private data
directory that links the shared image cache (``$HANGAR_DATA_DIR``, default
/var/lib/hangar) and copies its cached probe results; guests get no NIC and
there is no warm pool unless ``env`` says otherwise. ``stop_server`` ends it
and removes the directory; ``e2b_env`` gives E2B's SDKs the variables that point
them at it. ``machine`` describes the host (CPU, memory,
kernel, QEMU, load); ``peer`` runs a script of ``bench/peers`` and returns
its JSON; ``proc_usage`` reads a process's CPU seconds and memory.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from hangar.engines.process import vmm_pids

PEERS = Path(__file__).resolve().parent / "peers"

SHARED = Path(os.environ.get("HANGAR_DATA_DIR", "/var/lib/hangar"))


def pct(xs: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``xs``, nearest rank."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def stats(xs: list[float]) -> dict[str, float]:
    """p50, p90 and the fastest of ``xs`` (seconds, 4 digits), and how many (``n``)."""
    return {"p50": round(pct(xs, 0.5), 4), "p90": round(pct(xs, 0.9), 4),
            "min": round(min(xs), 4), "n": len(xs)}


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
            "HANGAR_POOL_SIZE": "0", "HANGAR_NETWORK": "off",
            # its images are a link to the host's cache, which the privilege split's root
            # helper refuses (docs/operations.md): one root process, as a second server
            "HANGAR_PRIVSEP": "0", **(env or {})}
    log = open(d / "server.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "hangar.cli", "serve"], env=full,
                            stdout=log, stderr=subprocess.STDOUT)
    log.close()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            shutil.rmtree(d, ignore_errors=True)
            raise RuntimeError("hangar serve exited")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, d, url
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    stop_server(proc, d)  # not left running (with its data directory) on a busy host
    raise RuntimeError("hangar serve did not come up in 120 s")


def api_key(data_dir: Path) -> str:
    return (data_dir / "api-key").read_text().strip()


def e2b_env(data_dir: Path, url: str) -> dict[str, str]:
    """E2B's three variables for the server at ``url``: ``E2B_API_URL``, ``E2B_SANDBOX_URL``
    and an ``E2B_API_KEY`` made by ``hangar key add NAME --e2b`` in its data directory."""
    env = {**os.environ, "HANGAR_DATA_DIR": str(data_dir)}
    out = subprocess.run([sys.executable, "-m", "hangar.cli", "key", "add", "bench", "--e2b"],
                         env=env, capture_output=True, text=True, timeout=120, check=True)
    return {"E2B_API_URL": f"{url}/e2b", "E2B_SANDBOX_URL": f"{url}/e2b/envd",
            "E2B_API_KEY": out.stdout.strip()}


def stop_server(proc: subprocess.Popen[bytes], data_dir: Path) -> None:
    """Stop the server, then end the VMMs it started (a server's VMMs outlive it by
    design, for a restart to adopt them; a bench stopped midway must not leave them
    running) and remove its data directory."""
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    for pid in vmm_pids(str(data_dir)):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    shutil.rmtree(data_dir, ignore_errors=True)


def machine() -> dict[str, object]:
    """The host the figures come from: CPU, cores, memory, kernel, QEMU, load average."""
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        mem_kib = int(Path("/proc/meminfo").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        mem_kib = 0
    qemu = subprocess.run(["qemu-system-x86_64", "--version"], capture_output=True,
                          text=True).stdout.split("\n")[0]
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(mem_kib / (1 << 20), 1),
            "kernel": os.uname().release, "qemu": qemu, "python": sys.version.split()[0],
            "load_avg_1_5_15": [round(x, 2) for x in os.getloadavg()]}


def proc_usage(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) and memory (Rss, Pss; MiB) of process ``pid``."""
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    out = {"cpu_s": (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        p = line.split()
        if len(p) == 3 and p[0] in ("Rss:", "Pss:"):
            out[p[0].rstrip(":").lower() + "_mib"] = int(p[1]) / 1024
    return out


def peer(name: str, *args: str, python: str | None = None, timeout: float = 1800
         ) -> dict[str, object]:
    """Run ``bench/peers/<name>_peer.py`` with ``python`` (default: this interpreter);
    its JSON, or ``{"skipped": reason}``."""
    exe = python or sys.executable
    if not Path(exe).exists():
        return {"peer": name, "skipped": f"no interpreter at {exe}"}
    try:
        out = subprocess.run([exe, str(PEERS / f"{name}_peer.py"), *args], capture_output=True,
                             text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"peer": name, "skipped": f"did not finish in {timeout:.0f} s"}
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        return {"peer": name, "skipped": f"failed: {out.stderr.strip()[-300:]}"}
    return json.loads(lines[-1])
