"""Benchmark: E2B's SDK create to first ``commands.run`` through Hangar, against Hangar's own
SDK create to first exec (issue 18's target: a p50 ratio of at most 1.1).

Prints one JSON object. One private ``hangar serve`` (``benchlib.start_server``:
the shared image cache, no pool, no guest NIC), and in one run, round after
round, the two sides in turn so that both see the same load (seconds):

* ``hangar``: ``hangar.client.Sandbox.create("base")`` (``POST /sandboxes``),
  then ``exec("true")`` (``/bin/sh -c true`` in the guest);
* ``e2b``: the unmodified ``e2b`` SDK's ``Sandbox.create("base")`` with only
  ``E2B_API_URL``, ``E2B_SANDBOX_URL`` and ``E2B_API_KEY`` set (``POST
  /e2b/v2/sandboxes``), then ``commands.run("true")`` (envd's Start over Connect
  RPC, ``/bin/bash -l -c true`` in the guest).

For each: ``create_s`` (the create call returned), ``first_call_s`` (the first
command, from then on) and ``total_s`` (create to the first command's result),
p50 over ``--rounds``; the sandbox is then removed (not timed). ``source`` is
the path each create took (``template``: restored from the image's booted
snapshot; ``cold``; ``pool``), read from Hangar's API afterwards. ``ratio`` is
the p50 of ``e2b.total_s`` over that of ``hangar.total_s``.

    .venv/bin/python bench/e2b_create_bench.py [--rounds 7] [--image base]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any, Callable

import httpx
from benchlib import api_key, e2b_env, machine, pct, start_server, stop_server

from hangar.client import Sandbox


Row = tuple[float, float, str]
"""(create_s, first_call_s, source) of one create."""


def hangar_side(url: str, key: str, image: str, source: Callable[[str], str]) -> Row:
    t0 = time.perf_counter()
    sb = Sandbox.create(image, base_url=url, api_key=key)
    t1 = time.perf_counter()
    try:
        sb.exec("true")
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1, source(sb.id)
    finally:
        sb.kill()


def e2b_side(image: str, source: Callable[[str], str]) -> Row:
    from e2b import Sandbox as E2BSandbox

    t0 = time.perf_counter()
    sb = E2BSandbox.create(image)
    t1 = time.perf_counter()
    try:
        sb.commands.run("true")
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1, source(sb.sandbox_id)
    finally:
        sb.kill()


def summary(rows: list[Row]) -> dict[str, Any]:
    create = [r[0] for r in rows]
    first = [r[1] for r in rows]
    total = [r[0] + r[1] for r in rows]
    return {"create_s": round(pct(create, 0.5), 3), "first_call_s": round(pct(first, 0.5), 3),
            "total_s": round(pct(total, 0.5), 3), "total_runs": [round(t, 3) for t in total],
            "sources": sorted({r[2] for r in rows})}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--image", default="base")
    a = ap.parse_args()
    host = machine()
    proc, d, url = start_server()
    try:
        key = api_key(d)
        os.environ.update(e2b_env(d, url))
        api = httpx.Client(base_url=url, headers={"X-API-Key": key}, timeout=60)

        def source(sid: str) -> str:
            r = api.get(f"/sandboxes/{sid}")
            r.raise_for_status()
            return str(r.json().get("source"))

        sides: dict[str, Callable[[], Row]] = {
            "hangar": lambda: hangar_side(url, key, a.image, source),
            "e2b": lambda: e2b_side(a.image, source),
        }
        for side in sides.values():  # the first create of a server may make the snapshot
            side()
        rows: dict[str, list[Row]] = {k: [] for k in sides}
        for _ in range(a.rounds):
            for name, side in sides.items():
                rows[name].append(side())
        out = {name: summary(rows[name]) for name in sides}
    finally:
        stop_server(proc, d)
    print(json.dumps({
        "benchmark": "e2b_create_to_first_command", "image": a.image, "rounds": a.rounds,
        **out,
        "ratio": round(out["e2b"]["total_s"] / out["hangar"]["total_s"], 3),
        "target_ratio": 1.1,
        "create_ratio": round(out["e2b"]["create_s"] / out["hangar"]["create_s"], 3),
        "machine": host, "load_avg_at_end": [round(x, 2) for x in os.getloadavg()],
    }, indent=2))


if __name__ == "__main__":
    main()
