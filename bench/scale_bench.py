"""Benchmark: the cost curve from 1 to 30 sandboxes, with ratios against baselines of the run.

    .venv/bin/python bench/scale_bench.py [--storms 1,10,30] [--pools 0,5] [--clients 10]
        [--execs 30] [--memory-mib 256] [--budget-gib 16] [--plot docs/performance-scale.png]
        [--no-peers]

Prints the machine and a table on stderr, one JSON object on stdout, and
saves a PNG plot (matplotlib: the ``bench`` extra, in requirements.lock). Steps, each
on a Hangar server of its own (real VMs, ``--memory-mib`` guests):

* **create storms**: N creates sent at once (``POST /sandboxes``, which
  answers once the guest agent is ready), with no warm pool and with a pool
  of 5; latency p50 and p95 (s), failures, and the storm's ratio to the
  single create without a pool. Before each storm the pool is full again.
* **concurrent exec**: ``--clients`` clients, each on a sandbox of its own,
  running ``true`` ``--execs`` times at once; p50 and p95 (s), ratio to one
  client alone on one sandbox in the same run.
* **idle density**: those sandboxes left idle for 20 s: each VMM's Pss and
  Rss (MiB), its guest's own use (``GET /sandboxes/{id}`` memory), its CPU
  (% of a core, from /proc), and how many fit ``--budget-gib``: by memory
  (budget / Pss per sandbox) and by CPU (cores / idle CPU per sandbox).
  ``ksm_estimate`` hashes the guest RAM pages each VMM holds
  (/proc/PID/pagemap and /proc/PID/mem) and counts those identical to
  another page: what KSM could merge if it ran (``HANGAR_KSM=1`` and the
  host's ksmd; an estimate, not a measure of ksmd).
* **server**: its CPU seconds and RSS at the end of each step.

Peers (``bench/peers``), the same storms where their cost allows: gVisor
(``runsc``), and quicksand (single creates: 10 or 30 of its VMs would need
8 to 24 GiB here). Skipped, and said so, when not installed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from benchlib import SHARED, api_key, machine, pct, peer, proc_usage, start_server, stop_server

from hangar.images import build_image
from hangar.layout import Layout

IDLE_S = 20.0
PAGE = 4096


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Bench:
    """One server and its client; steps record their figures in ``out``."""

    def __init__(self, pool: int, memory_mib: int) -> None:
        self.pool = pool
        self.memory_mib = memory_mib
        self.proc, self.dir, self.url = start_server({
            "HANGAR_POOL_SIZE": str(pool), "HANGAR_DEFAULT_MEMORY_MIB": str(memory_mib),
            "HANGAR_MAX_SANDBOXES": "64", "HANGAR_BOOT_TIMEOUT_S": "900"})
        self.key = api_key(self.dir)
        self.c = self.client()

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"X-API-Key": self.key}, timeout=1200)

    def close(self) -> None:
        self.c.close()
        stop_server(self.proc, self.dir)

    def server(self) -> dict[str, float]:
        u = proc_usage(self.proc.pid)
        return {"cpu_s": round(u["cpu_s"], 2), "rss_mib": round(u["rss_mib"], 1)}

    def vmm_pid(self, sid: str) -> int:
        return int((self.dir / "sandboxes" / sid / "vmm.pid").read_text())

    def pooled(self) -> int:
        for line in self.c.get("/metrics").text.splitlines():
            if line.startswith('hangar_sandboxes{state="pooled"}'):
                return int(float(line.split()[-1]))
        return 0

    def wait_pool(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while self.pool and self.pooled() < self.pool and time.monotonic() < deadline:
            time.sleep(1)
        time.sleep(3)  # let the last boot's guest settle

    def storm(self, n: int) -> dict[str, Any]:
        """``n`` creates at once; every sandbox made is deleted afterwards."""
        self.wait_pool()
        lat: list[float] = []
        ids: list[str] = []
        failed: list[str] = []
        lock = threading.Lock()
        go = threading.Event()

        def one() -> None:
            with self.client() as c:
                go.wait()
                t = time.perf_counter()
                r = c.post("/sandboxes", json={})
                took = time.perf_counter() - t
                with lock:
                    if r.status_code == 201:
                        lat.append(took)
                        ids.append(r.json()["id"])
                    else:
                        failed.append(f"{r.status_code} {r.text[:120]}")

        threads = [threading.Thread(target=one) for _ in range(n)]
        for t in threads:
            t.start()
        cpu0 = proc_usage(self.proc.pid)["cpu_s"]
        t0 = time.perf_counter()
        go.set()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        server = self.server()
        server["cpu_s_step"] = round(server["cpu_s"] - cpu0, 2)
        self.delete(ids)
        return {"n": n, "pool": self.pool, "p50_s": round(pct(lat, 0.5), 3) if lat else None,
                "p95_s": round(pct(lat, 0.95), 3) if lat else None,
                "max_s": round(max(lat), 3) if lat else None, "wall_s": round(wall, 2),
                "ok": len(lat), "failed": failed, "server": server}

    def delete(self, ids: list[str]) -> None:
        threads = [threading.Thread(target=lambda s=s: self.c.delete(f"/sandboxes/{s}"))
                   for s in ids]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def make(self, n: int) -> list[str]:
        return [self.c.post("/sandboxes", json={}).raise_for_status().json()["id"]
                for _ in range(n)]

    def execs(self, ids: list[str], per_client: int) -> dict[str, Any]:
        """One client alone, then one client per sandbox at once; ``true`` each time."""
        def loop(c: httpx.Client, sid: str, n: int, out: list[float]) -> None:
            for _ in range(n):
                t = time.perf_counter()
                c.post(f"/sandboxes/{sid}/exec", json={"command": "true"}).raise_for_status()
                out.append(time.perf_counter() - t)

        single: list[float] = []
        loop(self.c, ids[0], 3, [])
        loop(self.c, ids[0], per_client, single)
        lat: list[list[float]] = [[] for _ in ids]
        clients = [self.client() for _ in ids]
        cpu0 = proc_usage(self.proc.pid)["cpu_s"]
        threads = [threading.Thread(target=loop, args=(c, sid, per_client, out))
                   for c, sid, out in zip(clients, ids, lat)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        for c in clients:
            c.close()
        every = [x for xs in lat for x in xs]
        server = self.server()
        server["cpu_ms_per_exec"] = round((server["cpu_s"] - cpu0) / len(every) * 1000, 2)
        return {"clients": len(ids), "execs_each": per_client,
                "single_p50_s": round(pct(single, 0.5), 4),
                "single_p95_s": round(pct(single, 0.95), 4),
                "p50_s": round(pct(every, 0.5), 4), "p95_s": round(pct(every, 0.95), 4),
                "ratio_p50_to_single": round(pct(every, 0.5) / pct(single, 0.5), 3),
                "execs_per_s": round(len(every) / wall, 1), "server": server}

    def density(self, ids: list[str], budget_gib: float) -> dict[str, Any]:
        pids = [self.vmm_pid(s) for s in ids]
        before = {p: proc_usage(p)["cpu_s"] for p in pids}
        time.sleep(IDLE_S)
        usage = {p: proc_usage(p) for p in pids}
        guest = []
        for sid in ids:
            m = self.c.get(f"/sandboxes/{sid}").raise_for_status().json().get("memory") or {}
            guest.append(m.get("guest_used_mib") or 0.0)
        n = len(pids)
        pss = statistics.mean(u["pss_mib"] for u in usage.values())
        rss = statistics.mean(u["rss_mib"] for u in usage.values())
        cpu_pct = statistics.mean((usage[p]["cpu_s"] - before[p]) / IDLE_S * 100 for p in pids)
        ksm = ksm_estimate(pids, self.memory_mib)
        server = self.server()
        per = pss + server["rss_mib"] / n
        budget = budget_gib * 1024
        cores = os.cpu_count() or 1
        return {
            "sandboxes": n, "memory_mib": self.memory_mib, "idle_s": IDLE_S,
            "host_pss_mib": round(pss, 1), "host_rss_mib": round(rss, 1),
            "guest_used_mib": round(statistics.mean(guest), 1),
            "host_over_guest": round(pss / statistics.mean(guest), 3) if any(guest) else None,
            "idle_cpu_pct_of_a_core": round(cpu_pct, 2),
            "fit_in_budget": {"budget_gib": budget_gib,
                              "by_memory": int(budget // per),
                              "by_memory_with_ksm_estimate": int(
                                  budget // max(1.0, per - ksm["saved_mib_per_vm"])),
                              "by_idle_cpu": int(cores * 100 // cpu_pct) if cpu_pct > 0 else None},
            "ksm_estimate": ksm, "server": server,
        }


def ram_mapping(pid: int, size: int) -> tuple[int, int] | None:
    """The address range of the VMM's guest RAM: its anonymous mapping of ``size`` bytes."""
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        parts = line.split()
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        if hi - lo == size and len(parts) == 5 and parts[1].startswith("rw"):
            return lo, hi
    return None


def ksm_estimate(pids: list[int], memory_mib: int) -> dict[str, Any]:
    """Resident guest-RAM pages of these VMMs and how many KSM could merge (see the docstring)."""
    seen: Counter[bytes] = Counter()
    present = 0
    for pid in pids:
        rng = ram_mapping(pid, memory_mib << 20)
        if rng is None:
            continue
        lo, hi = rng
        with open(f"/proc/{pid}/pagemap", "rb") as pm, open(f"/proc/{pid}/mem", "rb") as mem:
            pm.seek(lo // PAGE * 8)
            entries = pm.read((hi - lo) // PAGE * 8)
            for i in range(len(entries) // 8):
                if not int.from_bytes(entries[i * 8:i * 8 + 8], "little") >> 63:
                    continue
                mem.seek(lo + i * PAGE)
                seen[hashlib.blake2b(mem.read(PAGE), digest_size=16).digest()] += 1
                present += 1
    saved = present - len(seen)
    n = max(1, len(pids))
    return {"resident_guest_pages": present, "distinct_pages": len(seen),
            "mergeable_fraction": round(saved / present, 3) if present else 0.0,
            "saved_mib_per_vm": round(saved * PAGE / (1 << 20) / n, 1)}


def table(res: dict[str, Any]) -> str:
    rows = ["create storms (s)        n  pool    p50    p95    max  ok  fail  server cpu_s  rss MiB"]
    for s in res["storms"]:
        rows.append(f"{'':24}{s['n']:3} {s['pool']:5} {s['p50_s'] or 0:6.2f} {s['p95_s'] or 0:6.2f}"
                    f" {s['max_s'] or 0:6.2f} {s['ok']:3} {len(s['failed']):5}"
                    f" {s['server']['cpu_s_step']:12.2f} {s['server']['rss_mib']:8.0f}")
    e = res["exec"]
    rows.append(f"exec true, {e['clients']} clients x {e['execs_each']}: p50 {e['p50_s'] * 1000:.1f} ms,"
                f" p95 {e['p95_s'] * 1000:.1f} ms (one client: p50 {e['single_p50_s'] * 1000:.1f} ms);"
                f" {e['execs_per_s']} execs/s; server {e['server']['cpu_ms_per_exec']} ms CPU/exec")
    d = res["density"]
    f = d["fit_in_budget"]
    rows.append(f"idle {d['memory_mib']} MiB sandboxes: Pss {d['host_pss_mib']} MiB, Rss "
                f"{d['host_rss_mib']} MiB, guest {d['guest_used_mib']} MiB, CPU "
                f"{d['idle_cpu_pct_of_a_core']} % of a core; in {f['budget_gib']} GiB: "
                f"{f['by_memory']} by memory, {f['by_memory_with_ksm_estimate']} with KSM "
                f"(estimate), {f['by_idle_cpu']} by idle CPU")
    return "\n".join(rows)


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    ax = axes[0]
    for pool, style in zip(sorted({s["pool"] for s in res["storms"]}), ("o-", "s-", "d-")):
        pts = [s for s in res["storms"] if s["pool"] == pool and s["p50_s"] is not None]
        if pts:
            ax.plot([s["n"] for s in pts], [s["p50_s"] for s in pts], style,
                    label=f"Hangar p50, pool {pool}")
            ax.plot([s["n"] for s in pts], [s["p95_s"] for s in pts], style, alpha=0.4,
                    label=f"Hangar p95, pool {pool}")
    gv = res["peers"].get("gvisor", {}).get("storms", [])
    if gv:
        ax.plot([s["n"] for s in gv], [s["p50_s"] for s in gv], "^--", label="gVisor p50")
    qs = res["peers"].get("quicksand", {})
    if "create_to_first_exec_s" in qs:
        ax.plot([1], [qs["create_to_first_exec_s"]["p50"]], "v", label="quicksand (1)")
    ax.set_xlabel("creates at once")
    ax.set_ylabel("create latency, s")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(sorted({s["n"] for s in res["storms"]}))
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_title("Create storms")
    ax.legend(fontsize=7)
    ax = axes[1]
    e = res["exec"]
    ax.bar(["1 client\np50", "1 client\np95", f"{e['clients']} clients\np50",
            f"{e['clients']} clients\np95"],
           [e["single_p50_s"] * 1000, e["single_p95_s"] * 1000, e["p50_s"] * 1000,
            e["p95_s"] * 1000], color=["C0", "C0", "C1", "C1"])
    ax.set_ylabel("exec true, ms")
    ax.set_title("Exec latency")
    ax = axes[2]
    d = res["density"]
    ks = d["ksm_estimate"]["saved_mib_per_vm"]
    ax.bar(["guest's\nown use", "host Pss", "host Pss\nwith KSM\n(estimate)"],
           [d["guest_used_mib"], d["host_pss_mib"], max(0.0, d["host_pss_mib"] - ks)],
           color=["C2", "C3", "C4"])
    ax.set_ylabel("MiB per idle sandbox")
    ax.set_title(f"Idle {d['memory_mib']} MiB sandboxes ({d['sandboxes']})")
    m = res["machine"]
    fig.suptitle(f"Hangar cost curve: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, "
                 f"QEMU TCG; load before {m['load_avg_1_5_15'][0]}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--storms", default="1,10,30")
    ap.add_argument("--pools", default="0,5")
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--execs", type=int, default=30)
    ap.add_argument("--memory-mib", type=int, default=256)
    ap.add_argument("--budget-gib", type=float, default=16)
    ap.add_argument("--plot", default="docs/performance-scale.png")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--quicksand-python", default=os.environ.get("QUICKSAND_PYTHON"))
    a = ap.parse_args()
    layout = Layout(SHARED)
    layout.ensure()
    build_image(layout, "base")
    storms = [int(x) for x in a.storms.split(",")]
    res: dict[str, Any] = {"machine": machine(), "storms": [], "peers": {}}
    say(json.dumps(res["machine"]))
    for pool in [int(x) for x in a.pools.split(",")]:
        b = Bench(pool, a.memory_mib)
        try:
            for n in storms:
                say(f"storm of {n}, pool {pool}")
                res["storms"].append(b.storm(n))
            if pool == 0:
                say(f"{a.clients} sandboxes for exec and density")
                ids = b.make(a.clients)
                res["exec"] = b.execs(ids, a.execs)
                res["density"] = b.density(ids, a.budget_gib)
                b.delete(ids)
        finally:
            b.close()
    base = next(s for s in res["storms"] if s["n"] == min(storms) and s["pool"] == 0)
    for s in res["storms"]:
        if s["p50_s"] and base["p50_s"]:
            s["ratio_p50_to_single_cold"] = round(s["p50_s"] / base["p50_s"], 3)
    if not a.no_peers:
        say("peers")
        res["peers"]["gvisor"] = peer("gvisor", "--storms", a.storms)
        res["peers"]["quicksand"] = peer("quicksand", "--boots", "1", "--execs", "10",
                                         "--memory-mib", str(a.memory_mib),
                                         python=a.quicksand_python)
    res["load_after"] = [round(x, 2) for x in os.getloadavg()]
    say(table(res))
    if a.plot:
        plot(res, Path(a.plot))
        say(f"plot: {a.plot}")
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
