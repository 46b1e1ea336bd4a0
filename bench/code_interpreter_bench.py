"""Benchmark: the code interpreter through Hangar's SDK, as one JSON object.

    .venv/bin/python bench/code_interpreter_bench.py [--creates 1] [--runs 30]

Figures (seconds):

* ``create_to_first_result``: ``Sandbox.create("code-interpreter")`` until
  ``run_code("1+1")`` has returned ``2``, per create (``--creates``), with
  whether the server booted cold or came from a snapshot (its create's
  ``source``, when the server reports one);
* ``run_code_1_plus_1``: p50, p95, min and max of ``run_code("1+1")`` in the
  last sandbox created (``--runs``, after 3 unmeasured), the round trip SDK → HTTP →
  API → agent tunnel → guest server → kernel and back;
* ``guest_memory_mib``: the guest's used memory (MemTotal - MemAvailable)
  with a warm kernel, beside the image's default size.

The server is private (``benchlib.start_server``: shared image cache, no
pool, no guest NIC); the image is built first if it is missing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from benchlib import SHARED, api_key, machine, pct, start_server, stop_server

from hangar.client import Hangar, Sandbox, Timeouts
from hangar.images import build_image
from hangar.images.recipes import RECIPES
from hangar.layout import Layout

IMAGE = "code-interpreter"


def round_trips(sb: Sandbox, runs: int) -> dict[str, object]:
    """``run_code("1+1")`` timings in ``sb`` and the guest's memory with a warm kernel."""
    for _ in range(3):
        sb.run_code("1+1")
    xs = []
    for _ in range(runs):
        t = time.perf_counter()
        assert sb.run_code("1+1").text == "2"
        xs.append(time.perf_counter() - t)
    mem = sb.exec("cat /proc/meminfo").stdout.split("\n")
    kib = {line.split(":")[0]: int(line.split()[1]) for line in mem if line}
    return {
        "run_code_1_plus_1": {"runs": runs, "p50_s": round(statistics.median(xs), 4),
                              "p95_s": round(pct(xs, 0.95), 4), "min_s": round(min(xs), 4),
                              "max_s": round(max(xs), 4)},
        "guest_memory_mib": {
            "used_with_warm_kernel": round((kib["MemTotal"] - kib["MemAvailable"]) / 1024),
            "default_size": RECIPES[IMAGE].default_memory_mib}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--creates", type=int, default=1)
    ap.add_argument("--runs", type=int, default=30)
    a = ap.parse_args()
    build_image(Layout(SHARED), IMAGE)
    proc, d, url = start_server()
    out: dict[str, object] = {"bench": "code_interpreter", "machine": machine()}
    try:
        with Hangar(url, api_key(d), timeouts=Timeouts(lifecycle=900)) as c:
            creates = []
            for i in range(a.creates):
                t0 = time.monotonic()
                with Sandbox.create(IMAGE, client=c) as sb:
                    created = time.monotonic() - t0
                    text = sb.run_code("1+1").text
                    first = time.monotonic() - t0
                    assert text == "2", text
                    creates.append({"create_s": round(created, 3),
                                    "create_to_first_result_s": round(first, 3),
                                    "source": getattr(sb.info, "source", None)})
                    if i == a.creates - 1:  # the last sandbox serves the round trips
                        out.update(round_trips(sb, a.runs))
            out["create_to_first_result"] = creates
    finally:
        stop_server(proc, d)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
