"""Benchmark: the orchestrator's overhead over the bare engine, as ratios.

Prints one JSON object. Each figure is measured twice in the same run:
through Hangar (HTTP → API → orchestrator → agent) and straight on the
engine (``QemuEngine`` + ``AgentClient``, no HTTP, no orchestrator);
``ratio`` is hangar / engine (for throughput, engine / hangar, so above 1
always means Hangar is slower).

    .venv/bin/python bench/sandbox_bench.py [--boots 3] [--execs 50] [--file-mib 16]

Figures: cold create to first exec (s), exec round trip of ``true`` (p50,
p95, s), file write and read throughput (MiB/s), host memory per idle
sandbox (RSS of the VMM process, MiB; the same VMM either way).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time

import httpx
from benchlib import SHARED, api_key, pct, start_server, stop_server

from hangar.engines.agent_client import exec_meta
from hangar.engines.base import VMSpec
from hangar.engines.qemu import QemuEngine, choose_accel
from hangar.images import build_image, resolve_image
from hangar.layout import Layout


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return 0.0


def pair(hangar: float, engine: float, lower_is_better: bool = True) -> dict[str, float]:
    ratio = hangar / engine if lower_is_better else engine / hangar
    return {"hangar": round(hangar, 4), "engine": round(engine, 4), "ratio": round(ratio, 3)}


async def engine_side(layout: Layout, boots: int, execs: int, blob: bytes) -> dict[str, object]:
    image = resolve_image(layout, "base")
    accel, _ = choose_accel(layout, image.kernel, image.initrd)
    engine = QemuEngine(accel)
    creates, rtts, writes, reads, rss = [], [], [], [], []
    for i in range(boots):
        sid = f"bench{i}"
        spec = VMSpec(sid, image, layout.sandbox(sid))
        t = time.perf_counter()
        vm = await engine.boot(spec)
        try:
            agent = await engine.connect_agent(vm, 120)
            await agent.exec(exec_meta("true"))
            creates.append(time.perf_counter() - t)
            if i == 0:
                for _ in range(execs):
                    t = time.perf_counter()
                    await agent.exec(exec_meta("true"))
                    rtts.append(time.perf_counter() - t)
                for _ in range(3):
                    t = time.perf_counter()
                    await agent.write_file("/root/blob", [blob])
                    writes.append(time.perf_counter() - t)
                    t = time.perf_counter()
                    got = b"".join([c async for c in agent.read_file("/root/blob")])
                    reads.append(time.perf_counter() - t)
                    assert got == blob
                await asyncio.sleep(2)
                rss.append(rss_mib(vm.pid))
            await agent.close()
        finally:
            await engine.stop(vm)
    return {"create": creates, "rtt": rtts, "write": writes, "read": reads, "rss": rss,
            "accel": accel}


def hangar_side(layout: Layout, boots: int, execs: int, blob: bytes) -> dict[str, object]:
    proc, d, url = start_server()
    creates, rtts, writes, reads, rss = [], [], [], [], []
    try:
        with httpx.Client(base_url=url, headers={"X-API-Key": api_key(d)}, timeout=300) as c:
            for i in range(boots):
                t = time.perf_counter()
                sid = c.post("/sandboxes", json={}).raise_for_status().json()["id"]
                c.post(f"/sandboxes/{sid}/exec", json={"command": "true"}).raise_for_status()
                creates.append(time.perf_counter() - t)
                if i == 0:
                    for _ in range(execs):
                        t = time.perf_counter()
                        c.post(f"/sandboxes/{sid}/exec", json={"command": "true"}).raise_for_status()
                        rtts.append(time.perf_counter() - t)
                    for _ in range(3):
                        t = time.perf_counter()
                        c.put(f"/sandboxes/{sid}/files", params={"path": "/root/blob"},
                              content=blob).raise_for_status()
                        writes.append(time.perf_counter() - t)
                        t = time.perf_counter()
                        got = c.get(f"/sandboxes/{sid}/files", params={"path": "/root/blob"})
                        reads.append(time.perf_counter() - t)
                        assert got.content == blob
                    time.sleep(2)
                    pid = int((d / "sandboxes" / sid / "vmm.pid").read_text())
                    rss.append(rss_mib(pid))
                c.delete(f"/sandboxes/{sid}").raise_for_status()
    finally:
        stop_server(proc, d)
    return {"create": creates, "rtt": rtts, "write": writes, "read": reads, "rss": rss}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--boots", type=int, default=3)
    ap.add_argument("--execs", type=int, default=50)
    ap.add_argument("--file-mib", type=int, default=16)
    a = ap.parse_args()
    layout = Layout(SHARED)
    layout.ensure()
    build_image(layout, "base")
    blob = os.urandom(a.file_mib << 20)
    e = asyncio.run(engine_side(layout, a.boots, a.execs, blob))
    h = hangar_side(layout, a.boots, a.execs, blob)
    mib = a.file_mib
    out = {
        "accel": e["accel"],
        "cold_create_to_first_exec_s": pair(statistics.median(h["create"]),
                                            statistics.median(e["create"])),
        "exec_true_p50_s": pair(pct(h["rtt"], 0.5), pct(e["rtt"], 0.5)),
        "exec_true_p95_s": pair(pct(h["rtt"], 0.95), pct(e["rtt"], 0.95)),
        "file_write_mib_per_s": pair(mib / statistics.median(h["write"]),
                                     mib / statistics.median(e["write"]), lower_is_better=False),
        "file_read_mib_per_s": pair(mib / statistics.median(h["read"]),
                                    mib / statistics.median(e["read"]), lower_is_better=False),
        "idle_vmm_rss_mib": pair(statistics.median(h["rss"]), statistics.median(e["rss"])),
        "runs": {"boots": a.boots, "execs": a.execs, "file_mib": mib},
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
