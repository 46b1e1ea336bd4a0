"""Benchmark: an HTTPS GET through a sandbox's secret-injecting proxy against a direct one.

Prints one JSON object. Runs a private ``hangar serve`` in network namespaces of its
own with the stand-in internet of ``tests/test_secrets.py`` (an HTTPS server at
203.0.113.1 on 443 and 8443 with a test CA's certificate), stores a secret, creates one
``base`` sandbox with it and, from that one guest (Python's http.client, timed by the
guest, a new connection and TLS handshake per GET, the placeholder in its
Authorization header):

* ``proxied_s``: GETs to api.example.test:443, which the guest's rules send to its
  mitmproxy (TLS to the guest with the sandbox's CA, the placeholder replaced, TLS to
  the server verified against the test CA);
* ``direct_s``: the same GETs to port 8443, which is not intercepted (the guest
  trusts the test CA itself).

``ratio`` is p50 proxied / p50 direct; issue 22's target is at most 1.3 under TCG.
Run as root (namespaces, TAP networking), with the proxy's environment made
(``.venv-proxy``, scripts/install.sh):

    .venv/bin/python bench/secret_proxy_bench.py [--gets 30]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from benchlib import machine, pct  # noqa: E402

IN_GUEST = r"""
import http.client, json, os, socket, ssl, sys, time
gets, ca = int(sys.argv[1]), sys.argv[2]
token = os.environ["GITHUB_TOKEN"]
system = ssl.create_default_context()
direct = ssl.create_default_context(cafile=ca)
def get(port, ctx):
    class C(http.client.HTTPSConnection):
        def connect(self):
            self.sock = ctx.wrap_socket(socket.create_connection(("203.0.113.1", port), 30),
                                        server_hostname="api.example.test")
    t = time.perf_counter()
    c = C("api.example.test", port, context=ctx, timeout=30)
    c.request("GET", "/", headers={"Authorization": "Bearer " + token})
    r = c.getresponse(); r.read(); c.close()
    return time.perf_counter() - t, r.status
out = {"proxied": [], "direct": [], "status": []}
get(443, system); get(8443, direct)  # warm both paths
for _ in range(gets):
    for name, port, ctx in (("proxied", 443, system), ("direct", 8443, direct)):
        took, status = get(port, ctx)
        out[name].append(took); out["status"].append(status)
print(json.dumps(out))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gets", type=int, default=30)
    args = parser.parse_args()
    import test_secrets as ts
    from conftest import base_image as built

    base_image = built.__wrapped__()  # the conftest fixture's function: the cached build
    with ts.stand_in_internet() as inet:
        h = ts.start_server(inet, base_image)
        c = h.client
        try:
            r = c.post("/secrets", json={"name": "bench", "value": ts.REAL,
                                         "hosts": ["api.example.test"]})
            r.raise_for_status()
            r = c.post("/sandboxes", json={"secrets": {"GITHUB_TOKEN": "bench"}})
            r.raise_for_status()
            sid = r.json()["id"]
            c.put(f"/sandboxes/{sid}/files", params={"path": "/root/test-ca.pem"},
                  content=inet.ca.read_bytes()).raise_for_status()
            r = c.post(f"/sandboxes/{sid}/exec", json={
                "command": "python3", "args": ["-c", IN_GUEST, str(args.gets),
                                               "/root/test-ca.pem"], "timeout": 1200})
            r.raise_for_status()
            got = json.loads(r.json()["stdout"])
            c.delete(f"/sandboxes/{sid}")
        finally:
            ts.stop_server(h)
    p, d = got["proxied"], got["direct"]
    statuses = sorted(set(got["status"]))
    print(json.dumps({
        "bench": "secret_proxy", "gets": args.gets, "statuses": statuses,
        "proxied_s": {"p50": round(pct(p, 0.5), 4), "p90": round(pct(p, 0.9), 4)},
        "direct_s": {"p50": round(pct(d, 0.5), 4), "p90": round(pct(d, 0.9), 4)},
        "ratio": round(pct(p, 0.5) / pct(d, 0.5), 3), "target_ratio": 1.3,
        "machine": machine()}, indent=2))


if __name__ == "__main__":
    main()
