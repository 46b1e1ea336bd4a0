"""Benchmark: booted templates against cold boots of the same image, as ratios, in one run.

Prints one JSON object. Two servers on this host share the image cache:
one restores every create from the image's template snapshot (the
default), the other boots every create cold (``HANGAR_TEMPLATE_SNAPSHOTS=0``);
neither has a warm pool or guest NICs, and both wait up to 900 s for a
guest agent (a storm of 30 cold boots on a busy host outlasts the default 60 s).

    .venv/bin/python bench/template_bench.py [--image base] [--boots 5] [--idle 10]
        [--storm 30] [--no-peers] [--quicksand-python PATH]

Figures (seconds, MiB):

* ``create_to_first_exec_s``: ``POST /sandboxes`` until an exec of ``true``
  answers, median of ``--boots``, from the template and cold;
* ``idle_pss``: ``--idle`` sandboxes of each kind left idle for 15 s, then
  each VMM's Pss (``GET /sandboxes/{id}``'s ``memory.host_mib``: pages a
  template's clones share are split among them) beside the guest's own
  use (``memory.guest_used_mib``), mean per sandbox;
* ``storm``: ``--storm`` creates sent at once; p50 and p95 of their
  latencies, and failures, from the template and cold;
* ``pool``: the same create from a warm pool of restored clones (one
  server with ``HANGAR_POOL_SIZE=2``), median of ``--boots``, and each pooled
  VM's Pss (its VMM's, from /proc): what the pool saves and what it costs;
* quicksand's create (``bench/peers/quicksand_peer.py``), skipped with its
  reason when it is not installed.

``targets`` holds the issue's ratios: template / cold create (at most
0.15), template / quicksand create (at most 0.03), template / cold idle Pss
(at most 0.6), template Pss / guest use (at most 1.5), template / cold storm
p50 (at most 0.25).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
from benchlib import api_key, machine, pct, peer, proc_usage, start_server, stop_server

BOOT_TIMEOUT = {"HANGAR_BOOT_TIMEOUT_S": "900"}
"""Both sides wait as long as a storm of cold boots on a busy 2-core host needs."""


def vmm_pids(d: Any) -> list[int]:
    """Pids of the VMMs whose command line names the data directory ``d``."""
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes()
            except OSError:
                continue
            if cmd.startswith(b"/usr/bin/qemu") and str(d).encode() in cmd:
                out.append(int(p.name))
    return out


def client(d: Any, url: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"X-API-Key": api_key(d)}, timeout=900)


def create_to_exec(c: httpx.Client, image: str) -> tuple[float, str]:
    t0 = time.monotonic()
    r = c.post("/sandboxes", json={"image": image, "timeout": 0})
    r.raise_for_status()
    sid = r.json()["id"]
    e = c.post(f"/sandboxes/{sid}/exec", json={"command": "true"})
    e.raise_for_status()
    took = time.monotonic() - t0
    c.delete(f"/sandboxes/{sid}")
    return took, r.json()["source"]


def idle(c: httpx.Client, image: str, n: int) -> dict[str, Any]:
    ids = []
    for _ in range(n):
        r = c.post("/sandboxes", json={"image": image, "timeout": 0})
        r.raise_for_status()
        ids.append(r.json()["id"])
    time.sleep(15)
    host, guest = [], []
    for sid in ids:
        m = c.get(f"/sandboxes/{sid}").json().get("memory") or {}
        if m.get("host_mib") is not None:
            host.append(m["host_mib"])
        if m.get("guest_used_mib") is not None:
            guest.append(m["guest_used_mib"])
    for sid in ids:
        c.delete(f"/sandboxes/{sid}")
    return {"sandboxes": n, "host_pss_mib": round(statistics.mean(host), 1) if host else None,
            "guest_used_mib": round(statistics.mean(guest), 1) if guest else None,
            "host_pss_total_mib": round(sum(host), 1)}


def storm(d: Any, url: str, image: str, n: int) -> dict[str, Any]:
    async def one(ac: httpx.AsyncClient) -> tuple[float, int, str]:
        t0 = time.monotonic()
        r = await ac.post("/sandboxes", json={"image": image, "timeout": 0})
        return time.monotonic() - t0, r.status_code, r.text

    async def run() -> list[tuple[float, int, str]]:
        async with httpx.AsyncClient(base_url=url, headers={"X-API-Key": api_key(d)},
                                     timeout=900) as ac:
            out = await asyncio.gather(*(one(ac) for _ in range(n)))
            for _t, code, text in out:
                if code == 201:
                    await ac.delete(f"/sandboxes/{json.loads(text)['id']}")
            return out

    t0 = time.monotonic()
    out = asyncio.run(run())
    took = [t for t, code, _ in out if code == 201]
    return {"creates": n, "failed": sum(1 for _t, code, _ in out if code != 201),
            "p50_s": round(pct(took, 0.5), 3) if took else None,
            "p95_s": round(pct(took, 0.95), 3) if took else None,
            "wall_s": round(time.monotonic() - t0, 2),
            "errors": sorted({text[:160] for _t, code, text in out if code != 201})[:3]}


def pool_side(image: str, boots: int) -> dict[str, Any]:
    proc, d, url = start_server({"HANGAR_POOL_SIZE": "2", "HANGAR_DEFAULT_IMAGE": image,
                                 **BOOT_TIMEOUT})
    try:
        with client(d, url) as c:
            deadline = time.monotonic() + 600
            while c.get("/pool").json()["ready"] < 2 and time.monotonic() < deadline:
                time.sleep(0.5)
            time.sleep(15)  # as idle as the idle figures
            pss = [proc_usage(pid)["pss_mib"] for pid in vmm_pids(d)]
            takes = []
            for _ in range(boots):
                while c.get("/pool").json()["ready"] < 1 and time.monotonic() < deadline:
                    time.sleep(0.5)
                took, source = create_to_exec(c, image)
                if source == "pool":
                    takes.append(took)
            return {"create_to_first_exec_s": round(statistics.median(takes), 3) if takes
                    else None, "pooled": len(takes),
                    "pooled_vm_pss_mib": round(statistics.mean(pss), 1) if pss else None}
    finally:
        stop_server(proc, d)


def side(env: dict[str, str], image: str, boots: int, n_idle: int, n_storm: int,
         want: str) -> dict[str, Any]:
    proc, d, url = start_server(env)
    try:
        with client(d, url) as c:
            t0 = time.monotonic()
            _took, source = create_to_exec(c, image)  # makes the snapshot if missing
            first = time.monotonic() - t0
            assert source == want, f"the first create took the {source} path, not {want}"
            creates = [create_to_exec(c, image)[0] for _ in range(boots)]
            mem = idle(c, image, n_idle)
        return {"first_create_s": round(first, 2),
                "create_to_first_exec_s": round(statistics.median(creates), 3),
                "create_runs": [round(x, 3) for x in creates], "idle": mem,
                "storm": storm(d, url, image, n_storm)}
    finally:
        stop_server(proc, d)


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--image", default="base")
    ap.add_argument("--boots", type=int, default=5)
    ap.add_argument("--idle", type=int, default=10)
    ap.add_argument("--storm", type=int, default=30)
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--no-pool", action="store_true")
    ap.add_argument("--quicksand-python", default=None)
    a = ap.parse_args()
    host = machine()
    t = side(BOOT_TIMEOUT, a.image, a.boots, a.idle, a.storm, "template")
    cold = side({"HANGAR_TEMPLATE_SNAPSHOTS": "0", **BOOT_TIMEOUT}, a.image, a.boots, a.idle, a.storm, "cold")
    pool = {"skipped": "--no-pool"} if a.no_pool else pool_side(a.image, a.boots)
    qs: dict[str, Any] = {"skipped": "--no-peers"}
    if not a.no_peers:
        import os
        qs = peer("quicksand", "--boots", "3", "--execs", "5",
                  python=a.quicksand_python or os.environ.get("QUICKSAND_PYTHON"))
    qs_create = (qs.get("create_to_first_exec_s") or {}).get("p50") if "skipped" not in qs \
        else None
    targets = {
        "template_over_cold_create": ratio(t["create_to_first_exec_s"],
                                           cold["create_to_first_exec_s"]),
        "template_over_quicksand_create": ratio(t["create_to_first_exec_s"], qs_create)
        if qs_create else f"skipped: {qs.get('skipped')}",
        "template_over_cold_idle_pss": ratio(t["idle"]["host_pss_mib"],
                                             cold["idle"]["host_pss_mib"]),
        "template_idle_pss_over_guest_used": ratio(t["idle"]["host_pss_mib"],
                                                   t["idle"]["guest_used_mib"]),
        "template_over_cold_storm_p50": ratio(t["storm"]["p50_s"], cold["storm"]["p50_s"]),
    }
    limits = {"template_over_cold_create": 0.15, "template_over_quicksand_create": 0.03,
              "template_over_cold_idle_pss": 0.6, "template_idle_pss_over_guest_used": 1.5,
              "template_over_cold_storm_p50": 0.25}
    met = {k: (v <= limits[k]) if isinstance(v, float) else None for k, v in targets.items()}
    print(json.dumps({"machine": host, "image": a.image, "template": t, "cold": cold,
                      "pool": pool, "quicksand": qs, "targets": targets, "limits": limits,
                      "met": met}, indent=2))


if __name__ == "__main__":
    main()
