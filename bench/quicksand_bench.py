"""Benchmark: a create from a booted template against quicksand's create, in one run
(issue 19's target: a ratio of at most 0.03).

Prints one JSON object. One private ``hangar serve`` (``benchlib.start_server``:
the shared image cache, no pool, no guest NIC: every create restores the
image's template snapshot) and quicksand (``bench/peers/quicksand_peer.py`` in
the interpreter named by ``--quicksand-python`` or ``$QUICKSAND_PYTHON``,
forced onto TCG like Hangar's guests, ``QUICKSAND_AUTO_INSTALL=0``), round
after round in turn so that both see the same load (seconds):

* ``hangar``: ``POST /sandboxes`` of ``--image`` until an exec of ``true``
  answers (``template_bench.create_to_exec``), ``--per-round`` creates a round;
* ``quicksand``: ``Sandbox(image="alpine", accel=TCG)`` entered until
  ``execute("true")`` returned, one create a round (a fresh process each time,
  its import not counted).

``ratio`` is Hangar's p50 over quicksand's. Without quicksand the bench
still prints Hangar's figures, and ``ratio`` says why it was skipped.

    .venv/bin/python bench/quicksand_bench.py [--rounds 3] [--per-round 3]
        [--image base] [--quicksand-python PATH]
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from benchlib import machine, pct, peer, start_server, stop_server
from template_bench import client, create_to_exec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--per-round", type=int, default=3)
    ap.add_argument("--image", default="base")
    ap.add_argument("--memory-mib", type=int, default=512)
    ap.add_argument("--quicksand-python", default=os.environ.get("QUICKSAND_PYTHON"))
    a = ap.parse_args()
    host = machine()
    hangar: list[float] = []
    sources: set[str] = set()
    qs: list[float] = []
    qs_runs: list[dict[str, Any]] = []
    skipped: str | None = None if a.quicksand_python else \
        "no quicksand interpreter (--quicksand-python or QUICKSAND_PYTHON)"
    proc, d, url = start_server()
    try:
        with client(d, url) as c:
            create_to_exec(c, a.image)  # the first create of a server may make the snapshot
            for _ in range(a.rounds):
                for _ in range(a.per_round):
                    took, source = create_to_exec(c, a.image)
                    hangar.append(took)
                    sources.add(source)
                if skipped is None:
                    r = peer("quicksand", "--boots", "1", "--execs", "0", "--memory-mib",
                             str(a.memory_mib), python=a.quicksand_python)
                    if "skipped" in r:
                        skipped = str(r["skipped"])
                    else:
                        qs_runs.append(r)
                        qs.extend(r["create_to_first_exec_s"]["each"])  # type: ignore[index]
    finally:
        stop_server(proc, d)
    h50 = pct(hangar, 0.5)
    out: dict[str, Any] = {
        "benchmark": "template_create_vs_quicksand", "image": a.image,
        "hangar": {"create_to_first_exec_s": {"p50": round(h50, 3), "runs": len(hangar),
                                              "each": [round(x, 3) for x in hangar]},
                   "sources": sorted(sources)},
        "quicksand": {"create_to_first_exec_s": {"p50": round(pct(qs, 0.5), 3),
                                                 "runs": len(qs),
                                                 "each": [round(x, 3) for x in qs]},
                      "accel": sorted({str(r.get("accel")) for r in qs_runs}),
                      "version": qs_runs[0].get("version")} if qs else {"skipped": skipped},
        "ratio": round(h50 / pct(qs, 0.5), 4) if qs else f"skipped: {skipped}",
        "target_ratio": 0.03,
        "machine": host, "load_avg_at_end": [round(x, 2) for x in os.getloadavg()],
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
