"""Benchmark: warm pool, snapshot, restore and wake, each beside a cold boot.

Prints one JSON object. A Hangar server (real VMs) is started on a private
data directory sharing the image cache; every figure is measured in the
same run as cold boots of the same template, and ``ratio`` is the figure
divided by the cold boot's (below 1 means faster than booting).

    .venv/bin/python bench/state_bench.py [--runs 5] [--memory-mib 512]

Figures (seconds unless named): cold create to first exec (p50, p95);
create from the warm pool to first exec (p50, p95); restore in place to
first exec; fork from a snapshot to first exec; wake of a sleeping machine
to first exec; snapshot time and size, also per GiB of guest memory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import httpx
from benchlib import SHARED, api_key, pct, start_server, stop_server

from hangar.images import build_image
from hangar.layout import Layout


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--memory-mib", type=int, default=512)
    a = ap.parse_args()
    layout = Layout(SHARED)
    layout.ensure()
    build_image(layout, "base")
    proc, d, url = start_server({"HANGAR_POOL_SIZE": "1",
                                 "HANGAR_DEFAULT_MEMORY_MIB": str(a.memory_mib)})
    cold, pooled, restore, fork, wake, snap_s, snap_b = [], [], [], [], [], [], []
    try:
        with httpx.Client(base_url=url, headers={"X-API-Key": api_key(d)}, timeout=600) as c:
            def first_exec(sid: str) -> None:
                c.post(f"/sandboxes/{sid}/exec", json={"command": "true"}).raise_for_status()

            def pool_ready() -> None:
                for _ in range(600):
                    text = c.get("/metrics").text
                    if 'hangar_sandboxes{state="pooled"} 1.0' in text:
                        return
                    time.sleep(0.2)

            for _ in range(a.runs):
                # Cold: a shape the pool does not hold.
                t = time.perf_counter()
                sid = c.post("/sandboxes", json={"disk_mib": 2049}).raise_for_status().json()["id"]
                first_exec(sid)
                cold.append(time.perf_counter() - t)
                c.delete(f"/sandboxes/{sid}")
                pool_ready()
                t = time.perf_counter()
                sid = c.post("/sandboxes", json={}).raise_for_status().json()["id"]
                first_exec(sid)
                pooled.append(time.perf_counter() - t)
                t = time.perf_counter()
                s = c.post(f"/sandboxes/{sid}/snapshot").raise_for_status().json()
                snap_s.append(time.perf_counter() - t)
                snap_b.append(s["size_bytes"])
                t = time.perf_counter()
                c.post(f"/sandboxes/{sid}/restore", json={"snapshot_id": s["id"]}).raise_for_status()
                first_exec(sid)
                restore.append(time.perf_counter() - t)
                t = time.perf_counter()
                fid = c.post(f"/snapshots/{s['id']}/sandboxes").raise_for_status().json()["id"]
                first_exec(fid)
                fork.append(time.perf_counter() - t)
                for x in (sid, fid):
                    c.delete(f"/sandboxes/{x}")
                c.delete(f"/snapshots/{s['id']}")
            m = c.post("/machines/bench-user").raise_for_status().json()
            for _ in range(a.runs):
                c.post("/machines/bench-user/snapshot").raise_for_status()
                t = time.perf_counter()
                first_exec(m["sandbox_id"])  # the call wakes it
                wake.append(time.perf_counter() - t)
            c.delete("/machines/bench-user")
    finally:
        stop_server(proc, d)
    base = statistics.median(cold)

    def fig(xs: list[float]) -> dict[str, float]:
        return {"p50": round(pct(xs, 0.5), 3), "p95": round(pct(xs, 0.95), 3),
                "ratio_to_cold_p50": round(pct(xs, 0.5) / base, 3)}

    gib = a.memory_mib / 1024
    print(json.dumps({
        "cold_create_to_first_exec_s": fig(cold),
        "pool_create_to_first_exec_s": fig(pooled),
        "restore_to_first_exec_s": fig(restore),
        "fork_to_first_exec_s": fig(fork),
        "wake_to_first_exec_s": fig(wake),
        "snapshot_s": fig(snap_s),
        "snapshot_bytes_p50": int(pct([float(b) for b in snap_b], 0.5)),
        "snapshot_s_per_gib_memory": round(pct(snap_s, 0.5) / gib, 3),
        "snapshot_bytes_per_gib_memory": int(pct([float(b) for b in snap_b], 0.5) / gib),
        "runs": a.runs, "memory_mib": a.memory_mib,
    }, indent=2))


if __name__ == "__main__":
    main()
