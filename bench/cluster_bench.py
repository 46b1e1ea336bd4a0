"""Cluster benchmark: what the gateway and shared storage cost, as ratios in one run.

Brings up the three-node lab of tests/clusterlab.py (network namespaces,
etcd, an S3 server; one VM slot per node, two on node 2) and prints one
JSON object:

``create_forwarded_over_direct``
    median create time sent to a node that is drained (so placed on and
    forwarded to another node) over a create placed on the receiving node
    itself; target at most 1.2.
``exec_forwarded_over_direct``
    median round trip of ``true`` sent to a node that does not own the
    sandbox over the same exec sent to its owner; target at most 1.3.
``wake_cross_over_same``
    a machine's wake on another node (its snapshot downloaded from the
    store first) over its wake on the node it slept on, with the snapshot's
    size in bytes (``snapshot_bytes``).

Run as root: ``.venv/bin/python bench/cluster_bench.py [--rounds N]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from clusterlab import Lab, can_run  # noqa: E402

SHARED = Path("/var/lib/hangar")


def timed(fn):  # type: ignore[no-untyped-def]
    t = time.perf_counter()
    r = fn()
    return time.perf_counter() - t, r


def create(c):  # type: ignore[no-untyped-def]
    """A create, retried while the slot a delete just freed is still being released."""
    for _ in range(40):
        r = c.post("/sandboxes", json={})
        if r.status_code != 429:
            return r
        time.sleep(0.25)
    return r


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3, help="creates of each kind")
    ap.add_argument("--execs", type=int, default=40, help="exec round trips of each kind")
    args = ap.parse_args()
    why = can_run()
    if why:
        print(json.dumps({"skipped": why}))
        return 0
    lab = Lab(SHARED / "images" / "base")
    out: dict[str, object] = {}
    try:
        lab.up(slots=1)
        n1, n2, n3 = lab.nodes
        # -- creates: on the receiving node vs forwarded from a drained one -------------
        direct, forwarded = [], []
        lab.hangar("node", "drain", "n2")
        lab.hangar("node", "drain", "n3")
        time.sleep(1)
        with n1.client() as c:
            for _ in range(args.rounds):
                time.sleep(1.0)  # the last delete's slot is released asynchronously
                dt, r = timed(lambda: create(c))
                assert r.status_code == 201, r.text
                direct.append(dt)
                assert c.delete(f"/sandboxes/{r.json()['id']}").status_code == 204
        lab.hangar("node", "undrain", "n2")
        lab.hangar("node", "drain", "n1")
        time.sleep(1)
        with n1.client() as c:
            for _ in range(args.rounds):
                time.sleep(1.0)  # the last delete's slot is released asynchronously
                dt, r = timed(lambda: create(c))
                assert r.status_code == 201, r.text
                assert lab.owner(r.json()["id"]) == "n2"
                forwarded.append(dt)
                assert c.delete(f"/sandboxes/{r.json()['id']}").status_code == 204
        lab.hangar("node", "undrain", "n1")
        lab.hangar("node", "undrain", "n3")
        out["create_direct_s"] = round(statistics.median(direct), 3)
        out["create_forwarded_s"] = round(statistics.median(forwarded), 3)
        out["create_forwarded_over_direct"] = round(
            statistics.median(forwarded) / statistics.median(direct), 3)

        # -- exec round trips ---------------------------------------------------------
        with n1.client() as c:
            r = c.post("/machines/bench", json={"idle_timeout": 3600})
            assert r.status_code == 201, r.text
            sid = r.json()["sandbox_id"]
        assert lab.owner(sid) == "n1"
        ex = {"command": "true"}
        times: dict[str, list[float]] = {"direct": [], "forwarded": []}
        with n1.client() as own, n2.client() as other:
            for c in (own, other):
                c.post(f"/sandboxes/{sid}/exec", json=ex)  # connections warm
            for _ in range(args.execs):
                for name, c in (("direct", own), ("forwarded", other)):
                    dt, r = timed(lambda: c.post(f"/sandboxes/{sid}/exec", json=ex))
                    assert r.status_code == 200
                    times[name].append(dt)
        out["exec_direct_ms"] = round(1000 * statistics.median(times["direct"]), 2)
        out["exec_forwarded_ms"] = round(1000 * statistics.median(times["forwarded"]), 2)
        out["exec_forwarded_over_direct"] = round(
            statistics.median(times["forwarded"]) / statistics.median(times["direct"]), 3)

        # -- wakes: on the node it slept on, then on another (download included) --------
        with n1.client() as c:
            c.post(f"/sandboxes/{sid}/exec", json={"command": "head -c 20000000 /dev/urandom "
                                                            "> /root/ballast"})
            assert c.post("/machines/bench/snapshot").status_code == 200
            same, _ = timed(lambda: c.post("/machines/bench/wake"))
            assert lab.owner(sid) == "n1"
            assert c.post("/machines/bench/snapshot").status_code == 200
        size = 0
        for line in n1.log_tail(200000).splitlines():
            if '"snapshot shared"' in line:
                size = json.loads(line).get("size_bytes", size)
        lab.hangar("node", "drain", "n1")
        time.sleep(1)
        with n3.client() as c:
            cross, r = timed(lambda: c.post("/machines/bench/wake"))
            assert r.status_code == 200, r.text
        assert lab.owner(sid) == "n3"
        lab.hangar("node", "undrain", "n1")
        out["wake_same_node_s"] = round(same, 3)
        out["wake_cross_node_s"] = round(cross, 3)
        out["wake_cross_over_same"] = round(cross / same, 3)
        out["snapshot_bytes"] = size
        with n3.client() as c:
            c.delete("/machines/bench")
    finally:
        lab.close()
    out["targets"] = {"create_forwarded_over_direct": 1.2, "exec_forwarded_over_direct": 1.3}
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
