"""Benchmark: the orchestrator's overhead over the bare engine and the guest, as ratios.

Prints one JSON object. Each figure is measured twice in the same run:
through Hangar (HTTP → API → orchestrator → agent) and straight on the
engine (``QemuEngine`` + ``AgentClient``, no HTTP, no orchestrator);
``ratio`` is hangar / engine (for throughput, engine / hangar, so above 1
always means Hangar is slower).

    .venv/bin/python bench/sandbox_bench.py [--boots 3] [--execs 50] [--file-mib 16]
        [--idle 3] [--no-peers] [--quicksand-python PATH]

Figures: cold create to first exec (s), exec round trip of ``true`` through
the shell (``{"command": "true"}``) and without one (``"args": []``; p50,
p95, s), file write and read throughput (MiB/s), host memory per idle
sandbox (RSS of the VMM process, MiB; the same VMM either way).

In the same run, and the reason for ``targets``:

* ``guest_spawn_floor``: inside the guest, a Python program timing
  ``os.posix_spawn`` + ``waitpid`` of ``/bin/true`` and of ``/bin/sh -c true``,
  and ``subprocess.run(["/bin/true"])`` (p50 of 30, s): what any exec costs
  before Hangar adds anything;
* ``idle_memory``: ``--idle`` sandboxes of ``--memory-mib`` left idle for 10 s,
  then each VMM's Pss (its private memory plus its share of what VMMs share)
  beside its guest's own use, MemTotal - MemFree of the guest's
  /proc/meminfo (what ``free`` shows as used plus buff/cache);
* peers (``bench/peers``): quicksand and gVisor, measured the same way,
  skipped (and said so) when not installed. quicksand runs in the
  interpreter given by ``--quicksand-python`` or ``$QUICKSAND_PYTHON``.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import os
import statistics
import time

import httpx
from benchlib import SHARED, api_key, machine, pct, peer, start_server, stop_server

from hangar.engines.agent_client import exec_meta
from hangar.engines.base import VMSpec
from hangar.engines.qemu import QemuEngine, choose_accel
from hangar.images import build_image, resolve_image
from hangar.layout import Layout

FLOOR = r'''
import os, time, subprocess
def p50(f, n=30):
    for _ in range(3):
        f()
    xs = []
    for _ in range(n):
        t = time.perf_counter(); f(); xs.append(time.perf_counter() - t)
    return sorted(xs)[n // 2]
def spawn(argv):
    os.waitpid(os.posix_spawn(argv[0], argv, {"PATH": "/usr/bin:/bin"}), 0)
print({"posix_spawn_true_p50_s": p50(lambda: spawn(["/bin/true"])),
       "sh_c_true_p50_s": p50(lambda: spawn(["/bin/sh", "-c", "true"])),
       "subprocess_run_true_p50_s": p50(lambda: subprocess.run(["/bin/true"]))})
'''
IDLE_S = 10.0


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return 0.0


def pss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    return 0.0


def pair(hangar: float, engine: float, lower_is_better: bool = True) -> dict[str, float]:
    ratio = hangar / engine if lower_is_better else engine / hangar
    return {"hangar": round(hangar, 4), "engine": round(engine, 4), "ratio": round(ratio, 3)}


async def engine_side(layout: Layout, boots: int, execs: int, blob: bytes) -> dict[str, object]:
    image = resolve_image(layout, "base")
    accel, _ = choose_accel(layout, image.kernel, image.initrd)
    engine = QemuEngine(accel)
    creates, rtts, argv_rtts, writes, reads, rss = [], [], [], [], [], []
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
                    t = time.perf_counter()
                    await agent.exec(exec_meta("true", argv=["true"]))
                    argv_rtts.append(time.perf_counter() - t)
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
    return {"create": creates, "rtt": rtts, "argv_rtt": argv_rtts, "write": writes,
            "read": reads, "rss": rss, "accel": accel}


def hangar_side(layout: Layout, boots: int, execs: int, blob: bytes, idle: int,
                memory_mib: int) -> dict[str, object]:
    proc, d, url = start_server()
    creates, rtts, argv_rtts, writes, reads, rss = [], [], [], [], [], []
    floor: dict[str, float] = {}
    idle_figs: list[dict[str, float]] = []
    try:
        with httpx.Client(base_url=url, headers={"X-API-Key": api_key(d)}, timeout=300) as c:
            def run(sid: str, **body: object) -> dict[str, object]:
                return c.post(f"/sandboxes/{sid}/exec", json=body).raise_for_status().json()

            for i in range(boots):
                t = time.perf_counter()
                sid = c.post("/sandboxes", json={}).raise_for_status().json()["id"]
                run(sid, command="true")
                creates.append(time.perf_counter() - t)
                if i == 0:
                    for _ in range(execs):
                        t = time.perf_counter()
                        run(sid, command="true")
                        rtts.append(time.perf_counter() - t)
                        t = time.perf_counter()
                        run(sid, command="true", args=[])
                        argv_rtts.append(time.perf_counter() - t)
                    out = run(sid, command="python3", args=["-c", FLOOR], timeout=300)
                    floor = ast.literal_eval(str(out["stdout"]).strip())
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
            # Idle memory: fresh sandboxes of the asked size, left alone.
            ids = [c.post("/sandboxes", json={"memory_mib": memory_mib}).raise_for_status()
                   .json()["id"] for _ in range(idle)]
            time.sleep(IDLE_S)
            for sid in ids:
                pid = int((d / "sandboxes" / sid / "vmm.pid").read_text())
                meminfo = str(run(sid, command="cat", args=["/proc/meminfo"])["stdout"])
                mi = {ln.split(":")[0]: int(ln.split()[1]) for ln in meminfo.splitlines()}
                reported = c.get(f"/sandboxes/{sid}").raise_for_status().json()["memory"] or {}
                idle_figs.append({"pss_mib": pss_mib(pid), "rss_mib": rss_mib(pid),
                                  "guest_used_mib": (mi["MemTotal"] - mi["MemFree"]) / 1024,
                                  "get_host_mib": reported.get("host_mib") or 0.0,
                                  "get_guest_used_mib": reported.get("guest_used_mib") or 0.0})
            for sid in ids:
                c.delete(f"/sandboxes/{sid}").raise_for_status()
    finally:
        stop_server(proc, d)
    return {"create": creates, "rtt": rtts, "argv_rtt": argv_rtts, "write": writes,
            "read": reads, "rss": rss, "floor": floor, "idle": idle_figs}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--boots", type=int, default=3)
    ap.add_argument("--execs", type=int, default=50)
    ap.add_argument("--file-mib", type=int, default=16)
    ap.add_argument("--idle", type=int, default=3, help="idle sandboxes for the memory figure")
    ap.add_argument("--memory-mib", type=int, default=512)
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--quicksand-python", default=os.environ.get("QUICKSAND_PYTHON"))
    a = ap.parse_args()
    layout = Layout(SHARED)
    layout.ensure()
    build_image(layout, "base")
    blob = os.urandom(a.file_mib << 20)
    host = machine()
    e = asyncio.run(engine_side(layout, a.boots, a.execs, blob))
    h = hangar_side(layout, a.boots, a.execs, blob, a.idle, a.memory_mib)
    peers: dict[str, dict[str, object]] = {}
    if not a.no_peers:
        peers["quicksand"] = peer("quicksand", "--memory-mib", str(a.memory_mib),
                                  python=a.quicksand_python)
        peers["gvisor"] = peer("gvisor")
    mib = a.file_mib
    floor = h["floor"]
    idle = h["idle"]
    pss = statistics.mean(f["pss_mib"] for f in idle)
    guest = statistics.mean(f["guest_used_mib"] for f in idle)
    shell_p50, argv_p50 = pct(h["rtt"], 0.5), pct(h["argv_rtt"], 0.5)
    cold = statistics.median(h["create"])
    targets: dict[str, object] = {
        "exec_argv_p50_over_guest_posix_spawn_true": round(argv_p50 / floor["posix_spawn_true_p50_s"], 3),
        "exec_shell_p50_over_guest_sh_c_true": round(shell_p50 / floor["sh_c_true_p50_s"], 3),
        "idle_host_pss_over_guest_used": round(pss / guest, 3),
    }
    qs = peers.get("quicksand", {})
    if "exec_true_s" in qs:
        targets["exec_shell_p50_over_quicksand_exec_p50"] = round(
            shell_p50 / qs["exec_true_s"]["p50"], 3)  # type: ignore[index]
        targets["cold_create_over_quicksand"] = round(
            cold / qs["create_to_first_exec_s"]["p50"], 3)  # type: ignore[index]
    out = {
        "accel": e["accel"],
        "cold_create_to_first_exec_s": pair(cold, statistics.median(e["create"])),
        "exec_true_p50_s": pair(shell_p50, pct(e["rtt"], 0.5)),
        "exec_true_p95_s": pair(pct(h["rtt"], 0.95), pct(e["rtt"], 0.95)),
        "exec_true_argv_p50_s": pair(argv_p50, pct(e["argv_rtt"], 0.5)),
        "exec_true_argv_p95_s": pair(pct(h["argv_rtt"], 0.95), pct(e["argv_rtt"], 0.95)),
        "file_write_mib_per_s": pair(mib / statistics.median(h["write"]),
                                     mib / statistics.median(e["write"]), lower_is_better=False),
        "file_read_mib_per_s": pair(mib / statistics.median(h["read"]),
                                    mib / statistics.median(e["read"]), lower_is_better=False),
        "idle_vmm_rss_mib": pair(statistics.median(h["rss"]), statistics.median(e["rss"])),
        "guest_spawn_floor": {k: round(v, 4) for k, v in floor.items()},
        "idle_memory": {
            "sandboxes": len(idle), "memory_mib": a.memory_mib, "idle_s": IDLE_S,
            "host_pss_mib": round(pss, 1),
            "host_rss_mib": round(statistics.mean(f["rss_mib"] for f in idle), 1),
            "guest_used_mib": round(guest, 1),
            "get_reports": {"host_mib": round(statistics.mean(f["get_host_mib"] for f in idle), 1),
                            "guest_used_mib": round(statistics.mean(
                                f["get_guest_used_mib"] for f in idle), 1)},
        },
        "targets": targets,
        "peers": peers,
        "machine": host,
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "runs": {"boots": a.boots, "execs": a.execs, "file_mib": mib},
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
