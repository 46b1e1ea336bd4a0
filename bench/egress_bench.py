"""Benchmark: egress by domain, through the host's proxy and forwarder beside direct paths.

Prints one JSON object. Builds ``tests/egress_lab.py``'s namespaces (a stand-in
internet with DNS, HTTP and HTTPS), runs ``hangar serve`` in the host namespace
(TAP networking, as root, no privilege split: the DNS forwarder's nftables
updates then skip the root helper's socket), boots one sandbox allowed only
``*.example.test`` and measures from inside the guest, each ``--n`` times:

* ``http_get_s``: a GET to a.example.test on port 80 (through the transparent
  proxy, which reads the Host header) against port 8080 of the same server
  (reached directly: its address was opened by the DNS answer);
* ``tls_get_s``: a TLS handshake and GET on 443 (the proxy reads the SNI)
  against 8443 (direct);
* ``dns_s``: ``gethostbyname`` of an allowed name (forwarded upstream and its
  address opened in the kernel) and of a denied one (answered REFUSED by the
  host alone);
* ``patch_s``: ``PATCH /sandboxes/{id}/network`` round trips (the rule change
  is in the kernel and the proxy when it answers).

``ratio`` is proxy / direct (p50); above 1 means the proxy costs time. The
guest runs under the same accelerator (TCG here), which dominates both sides.

    .venv/bin/python bench/egress_bench.py [--n 30]   (as root)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from benchlib import SHARED, machine, pct

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from netns import can_netns  # noqa: E402
from egress_lab import (  # noqa: E402
    DNS, GUEST, NAMES, NS_HOST, start_server, stop_server, topology,
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=30)
    args = ap.parse_args()
    reason = can_netns()
    if reason:
        raise SystemExit(f"egress_bench {reason}")
    a = NAMES["a.example.test"]
    with topology():
        d = Path(tempfile.mkdtemp(prefix="hgb-", dir="/tmp"))
        (d / "images").symlink_to(SHARED / "images")
        for name in ("engine-probe.json", "firecracker-probe.json"):
            if (SHARED / name).exists():
                shutil.copy(SHARED / name, d / name)
        env = {**os.environ, "HANGAR_DATA_DIR": str(d), "HANGAR_UDS": str(d / "api.sock"),
               "HANGAR_POOL_SIZE": "0", "HANGAR_NETWORK": "tap", "HANGAR_NET_DNS": DNS,
               "HANGAR_PRIVSEP": "0"}
        server = start_server(env, sys.executable, d)
        try:
            key = (d / "api-key").read_text().strip()
            with httpx.Client(transport=httpx.HTTPTransport(uds=str(d / "api.sock")),
                              base_url="http://hangar", headers={"X-API-Key": key},
                              timeout=300) as c:
                r = c.post("/sandboxes", json={"network": {
                    "allow": ["*.example.test"], "deny": ["0.0.0.0/0", "bad.example.test"]}})
                r.raise_for_status()
                sid = r.json()["id"]
                try:
                    n = args.n
                    steps = [["resolve", "a.example.test"],
                             ["times", "http_get", n, a, "a.example.test", 80],
                             ["times", "http_get", n, a, "a.example.test", 8080],
                             ["times", "tls_get", n, a, "a.example.test", 443],
                             ["times", "tls_get", n, a, "a.example.test", 8443],
                             ["times", "resolve", n, "a.example.test"],
                             ["times", "resolve", n, "bad.example.test"]]
                    r = c.post(f"/sandboxes/{sid}/exec", json={
                        "command": "python3", "args": ["-c", GUEST, json.dumps(steps)],
                        "timeout": 600})
                    r.raise_for_status()
                    got = json.loads(r.json()["stdout"])
                    patch = []
                    for i in range(n):
                        allow = ["*.example.test"] + (["other.test"] if i % 2 else [])
                        t = time.perf_counter()
                        c.patch(f"/sandboxes/{sid}/network",
                                json={"allow": allow}).raise_for_status()
                        patch.append(time.perf_counter() - t)
                finally:
                    c.delete(f"/sandboxes/{sid}")
        finally:
            stop_server(server)
            subprocess.run(["ip", "-n", NS_HOST, "link", "del", "hgbr0"], capture_output=True)
            shutil.rmtree(d, ignore_errors=True)

    def pair(proxy: list[float], direct: list[float]) -> dict[str, float]:
        return {"proxy_p50": round(pct(proxy, 0.5), 5), "direct_p50": round(pct(direct, 0.5), 5),
                "proxy_p90": round(pct(proxy, 0.9), 5), "direct_p90": round(pct(direct, 0.9), 5),
                "ratio": round(pct(proxy, 0.5) / pct(direct, 0.5), 3)}

    print(json.dumps({
        "bench": "egress", "n": args.n, "machine": machine(),
        "http_get_s": pair(got[1], got[2]), "tls_get_s": pair(got[3], got[4]),
        "dns_s": {"allowed_p50": round(pct(got[5], 0.5), 5),
                  "refused_p50": round(pct(got[6], 0.5), 5)},
        "patch_s": {"p50": round(pct(patch, 0.5), 5), "max": round(max(patch), 5)},
    }, indent=1))


if __name__ == "__main__":
    main()
