"""Peer figures: gVisor (``runsc``, Debian's package), measured as Hangar's benches measure.

A container whose root is a busybox-static tree (``/bin/busybox`` of the
host, the one Hangar's initramfs uses) runs ``sleep``; commands enter it
with ``runsc exec``, as an orchestrator built on runsc would. No network
(``--network=none``), the build's default platform (ptrace in Debian 12's
2022 build). Needs root. Prints one JSON object; seconds unless named:

    python bench/peers/gvisor_peer.py [--boots 3] [--execs 50]

``create_to_first_exec_s``: ``runsc run --detach`` plus the first ``runsc exec
true`` (p50 over the boots); ``exec_true_s``: p50 and p95 of ``runsc exec
true``; ``idle``: Pss and Rss (MiB) of the sandbox and gofer processes after
8 s idle; with ``--storms 1,10,30``, ``storms``: that many creates (to the
first exec) at once, p50 and p95. When runsc is missing it prints
``{"skipped": reason}``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

QUIET = {"stdin": subprocess.DEVNULL, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
"""A detached sandbox keeps the stdio it was given: never a pipe this process would wait on."""


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def bundle(root: Path) -> Path:
    b = root / "bundle"
    (b / "rootfs" / "bin").mkdir(parents=True)
    shutil.copy("/bin/busybox", b / "rootfs" / "bin" / "busybox")
    for applet in ("sh", "true", "sleep", "cat"):
        (b / "rootfs" / "bin" / applet).symlink_to("busybox")
    subprocess.run(["runsc", "spec", "--", "/bin/sleep", "86400"], cwd=b, check=True, **QUIET)
    spec = json.loads((b / "config.json").read_text())
    spec["process"]["terminal"] = False
    (b / "config.json").write_text(json.dumps(spec))
    return b


def pids_of(name: str) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if name in Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode():
                    out.append(int(d))
            except OSError:
                pass
    return out


def rollup(pids: list[int]) -> dict[str, float]:
    tot = {"rss_mib": 0.0, "pss_mib": 0.0}
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                p = line.split()
                if len(p) == 3 and p[0] in ("Rss:", "Pss:"):
                    tot[p[0].rstrip(":").lower() + "_mib"] += int(p[1]) / 1024
        except OSError:
            pass
    return {k: round(v, 1) for k, v in tot.items()}


def storm(base: list[str], b: Path, n: int, tag: str) -> dict[str, object]:
    """``n`` containers created at once, each to its first exec; all deleted after."""
    lat: list[float] = []
    failed = 0
    lock = threading.Lock()
    go = threading.Event()

    def one(i: int) -> None:
        nonlocal failed
        cid = f"{tag}-{i}"
        go.wait()
        t = time.perf_counter()
        ok = subprocess.run([*base, "run", "--detach", "--bundle", str(b), cid], **QUIET
                            ).returncode == 0 and subprocess.run(
            [*base, "exec", cid, "/bin/true"], **QUIET).returncode == 0
        with lock:
            if ok:
                lat.append(time.perf_counter() - t)
            else:
                failed += 1

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    go.set()
    for t in threads:
        t.join()
    for i in range(n):
        subprocess.run([*base, "delete", "-force", f"{tag}-{i}"], **QUIET)
    return {"n": n, "p50_s": round(pct(lat, 0.5), 3) if lat else None,
            "p95_s": round(pct(lat, 0.95), 3) if lat else None, "ok": len(lat), "failed": failed}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--boots", type=int, default=3)
    ap.add_argument("--execs", type=int, default=50)
    ap.add_argument("--storms", default="")
    a = ap.parse_args()
    runsc = shutil.which("runsc")
    if runsc is None:
        print(json.dumps({"peer": "gvisor", "skipped": "runsc is not installed (apt-get install runsc)"}))
        return
    if os.geteuid() != 0:
        print(json.dumps({"peer": "gvisor", "skipped": "runsc needs root here"}))
        return
    version = subprocess.run([runsc, "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    root = Path(tempfile.mkdtemp(prefix="hgb-gvisor-"))
    base = [runsc, "--root", str(root / "state"), "--network=none"]
    b = bundle(root)
    creates: list[float] = []
    rtts: list[float] = []
    idle: dict[str, float] = {}
    try:
        for i in range(a.boots):
            cid = f"hgb-{os.getpid()}-{i}"
            t = time.perf_counter()
            subprocess.run([*base, "run", "--detach", "--bundle", str(b), cid], check=True, **QUIET)
            try:
                subprocess.run([*base, "exec", cid, "/bin/true"], check=True, **QUIET)
                creates.append(time.perf_counter() - t)
                if i == 0:
                    for _ in range(a.execs):
                        t = time.perf_counter()
                        subprocess.run([*base, "exec", cid, "/bin/true"], check=True, **QUIET)
                        rtts.append(time.perf_counter() - t)
                    time.sleep(8)
                    idle = rollup(pids_of(f"{cid}") + pids_of(str(b)))
            finally:
                subprocess.run([*base, "delete", "-force", cid], **QUIET)
        storms = [storm(base, b, int(n), f"hgb-{os.getpid()}-s{n}")
                  for n in a.storms.split(",") if n]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps({
        "peer": "gvisor", "version": version, "platform": "default of the build",
        "create_to_first_exec_s": {"p50": round(pct(creates, 0.5), 3), "runs": len(creates)},
        "exec_true_s": {"p50": round(pct(rtts, 0.5), 4), "p95": round(pct(rtts, 0.95), 4),
                        "runs": len(rtts)},
        "idle": idle, "storms": storms,
    }))


if __name__ == "__main__":
    main()
