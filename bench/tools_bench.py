"""Benchmark: what the agent tools' proxy costs, as ratios against a baseline in the same run.

Prints one JSON object with three pairs (p50 seconds; ``ratio`` = tools / baseline, so
above 1 means the proxy is slower):

* ``in_process_call``: ``Task.call("run_command", {"command": "true"})`` at the in-process
  tier against bare ``bwrap`` (the same namespaces, binds and limits) running ``true``;
* ``vm_call``: the same call at the vm tier against a plain exec of ``true``
  (``AsyncHangar.exec``) on the same sandbox; the target is a ratio of at most 1.2;
* ``task_start_from_pool``: entering a vm task whose VM comes from the warm pool (create,
  work folder, events) against a bare ``POST /sandboxes`` served from the pool.

    .venv/bin/python bench/tools_bench.py [--calls 30] [--pool-rounds 3]

Needs bubblewrap and the ``dev`` image (``hangar image build dev``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from benchlib import SHARED, api_key, pct, start_server, stop_server

import hangar.tools as ht
from hangar.client import AsyncHangar
from hangar.images import build_image
from hangar.layout import Layout
from hangar.tools.inprocess import Bubblewrap


def pair(tools: list[float], base: list[float]) -> dict[str, float]:
    t, b = statistics.median(tools), statistics.median(base)
    return {"tools_p50_s": round(t, 4), "baseline_p50_s": round(b, 4),
            "tools_p95_s": round(pct(tools, 0.95), 4), "baseline_p95_s": round(pct(base, 0.95), 4),
            "ratio": round(t / b, 3)}


async def in_process(calls: int) -> dict[str, float]:
    box = Bubblewrap()
    argv = box.argv(["true"])
    bare: list[float] = []
    try:
        for _ in range(calls):
            t = time.perf_counter()
            proc = await asyncio.create_subprocess_exec(*argv, preexec_fn=box._preexec)
            await proc.wait()
            bare.append(time.perf_counter() - t)
    finally:
        box.close()
    tools: list[float] = []
    async with ht.task("in-process", "bench", "bench", {"max_tool_calls": calls + 1}) as task:
        for _ in range(calls):
            t = time.perf_counter()
            r = await task.call("run_command", {"command": "true"})
            tools.append(time.perf_counter() - t)
            assert r.ok, r
    return pair(tools, bare)


async def vm_call(url: str, key: str, calls: int) -> dict[str, float]:
    tools: list[float] = []
    plain: list[float] = []
    async with ht.task("vm", "bench", "bench", {"max_tool_calls": 2 * calls + 2},
                       url=url, api_key=key) as task, AsyncHangar(url, key) as h:
        sid = task.sandbox_id
        assert sid is not None
        for _ in range(3):  # warm both paths
            await task.call("run_command", {"command": "true"})
            await h.exec(sid, "true")
        for _ in range(calls):  # interleaved, so drift hits both alike
            t = time.perf_counter()
            r = await task.call("run_command", {"command": "true"})
            tools.append(time.perf_counter() - t)
            assert r.ok, r
            t = time.perf_counter()
            await h.exec(sid, "true", cwd="/work")
            plain.append(time.perf_counter() - t)
    return pair(tools, plain)


def ready_count(log: str) -> int:
    return log.count("pool VM ready")


async def pool_start(url: str, key: str, log_path: object, rounds: int) -> dict[str, float]:
    from pathlib import Path

    log = Path(str(log_path))

    async def wait_ready(n: int) -> None:
        deadline = time.monotonic() + 300
        while ready_count(log.read_text()) < n:
            if time.monotonic() > deadline:
                raise RuntimeError("the warm pool did not refill in 300 s")
            await asyncio.sleep(0.2)

    tools: list[float] = []
    bare: list[float] = []
    ready = 1
    async with AsyncHangar(url, key) as h:
        for _ in range(rounds):
            await wait_ready(ready)
            t = time.perf_counter()
            sb = await h.create("dev")
            bare.append(time.perf_counter() - t)
            await h.delete(sb["id"])
            assert sb.get("source") == "pool", sb
            ready += 1
            await wait_ready(ready)
            t = time.perf_counter()
            async with ht.task("vm", "bench", "bench", url=url, api_key=key,
                               sink=ht.NullSink()) as task:
                tools.append(time.perf_counter() - t)
                assert task.source == "pool", task.source
            ready += 1
    return pair(tools, bare)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--pool-rounds", type=int, default=3)
    a = ap.parse_args()
    build_image(Layout(SHARED), "dev")
    out: dict[str, object] = {"in_process_call": asyncio.run(in_process(a.calls))}
    proc, d, url = start_server()
    try:
        out["vm_call"] = asyncio.run(vm_call(url, api_key(d), a.calls))
    finally:
        stop_server(proc, d)
    proc, d, url = start_server({"HANGAR_POOL_SIZE": "1", "HANGAR_DEFAULT_IMAGE": "dev"})
    try:
        out["task_start_from_pool"] = asyncio.run(
            pool_start(url, api_key(d), d / "server.log", a.pool_rounds))
    finally:
        stop_server(proc, d)
    out["vm_call"]["target_ratio"] = 1.2  # type: ignore[index]
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
