"""Benchmark: ``commands.run("true")`` through E2B's SDK and Hangar's envd, against Hangar's
own exec (issue 18's target: a p50 ratio of at most 1.2).

Prints one JSON object. Boots one ``base`` sandbox on a private ``hangar
serve`` and, in one run, alternates the two calls so that both see the same
load:

* ``hangar_exec_s``: ``Sandbox.exec("true")`` of Hangar's own SDK (a blocking
  ``POST /sandboxes/{id}/exec``, ``/bin/sh -c true`` in the guest);
* ``e2b_run_s``: ``Sandbox.commands.run("true")`` of the unmodified ``e2b`` SDK
  with ``E2B_SANDBOX_URL`` at ``/e2b/envd`` (Connect RPC server stream,
  ``/bin/bash -l -c true`` in the guest, as E2B's SDK asks).

* ``envd_sh_s``: the same Start call made by hand (``httpx``, Connect's JSON
  stream) with ``/bin/sh -c true``, the very program Hangar's exec runs: the
  data plane's own cost, the guest's work being equal.

``ratio`` is the p50 of ``e2b_run_s`` over the p50 of ``hangar_exec_s``;
``adapter_ratio`` that of ``envd_sh_s``. The guest's own part, timed inside
it (``guest_sh_s``, ``guest_bash_login_s``), shows how much of ``ratio`` is
the login shell the SDK asks for (under TCG: bash, and the ``id`` and
``mesg`` that Debian's login scripts run, each a process) rather than the
path through the server.

    .venv/bin/python bench/e2b_envd_bench.py [--runs 40]
"""

from __future__ import annotations

import argparse
import json
import statistics
import struct
import time

import httpx
from benchlib import api_key, machine, pct, start_server, stop_server
from e2b import ConnectionConfig
from e2b import Sandbox as E2BSandbox
from packaging.version import Version

from hangar.api.envd.versions import ENVD_VERSION
from hangar.client import Sandbox

IN_GUEST = r"""
import json, subprocess, sys, time
n = int(sys.argv[1])
def timed(argv):
    out = []
    for _ in range(n):
        t = time.perf_counter()
        subprocess.run(argv, check=True)
        out.append(time.perf_counter() - t)
    return sorted(out)[len(out) // 2]
print(json.dumps({"sh": timed(["/bin/sh", "-c", "true"]),
                  "bash_login": timed(["/bin/bash", "-l", "-c", "true"])}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=40)
    args = ap.parse_args()
    proc, data_dir, url = start_server()
    try:
        key = api_key(data_dir)
        with Sandbox.create(base_url=url, api_key=key) as sbx:
            r = httpx.get(f"{url}/e2b/sandboxes/{sbx.id}", headers={"X-API-Key": key})
            r.raise_for_status()
            token = r.json()["envdAccessToken"]  # what E2B's control plane hands out
            cfg = ConnectionConfig(api_key="e2b_" + "0" * 40, sandbox_url=f"{url}/e2b/envd",
                                   extra_sandbox_headers={
                                       "E2b-Sandbox-Id": sbx.id, "E2b-Sandbox-Port": "49983",
                                       "X-Access-Token": token})
            e2b = E2BSandbox(sandbox_id=sbx.id, envd_version=Version(ENVD_VERSION),
                             envd_access_token=token, sandbox_domain=None,
                             connection_config=cfg)
            for _ in range(3):  # warm both paths (connections, the guest's page cache)
                sbx.exec("true")
                e2b.commands.run("true")
            own: list[float] = []
            theirs: list[float] = []
            raw: list[float] = []
            body = json.dumps({"process": {"cmd": "/bin/sh", "args": ["-c", "true"]}}).encode()
            framed = struct.pack(">BI", 0, len(body)) + body
            headers = {"E2b-Sandbox-Id": sbx.id, "X-Access-Token": token,
                       "Content-Type": "application/connect+json"}
            conn = httpx.Client(base_url=f"{url}/e2b/envd", headers=headers, timeout=60)
            for _ in range(args.runs):
                t = time.perf_counter()
                r = conn.post("/process.Process/Start", content=framed)
                assert r.status_code == 200 and b'"end"' in r.content, r.content
                raw.append(time.perf_counter() - t)
                t = time.perf_counter()
                sbx.exec("true")
                own.append(time.perf_counter() - t)
                t = time.perf_counter()
                e2b.commands.run("true")
                theirs.append(time.perf_counter() - t)
            sbx.files.write("/root/bench_guest.py", IN_GUEST)
            guest = json.loads(sbx.exec("python3 /root/bench_guest.py 20").stdout)
        p50_own, p50_theirs = pct(own, 0.5), pct(theirs, 0.5)
        print(json.dumps({
            "benchmark": "e2b_envd_commands_run_true",
            "runs": args.runs,
            "hangar_exec_s": {"p50": round(p50_own, 4), "p90": round(pct(own, 0.9), 4),
                              "mean": round(statistics.mean(own), 4)},
            "e2b_run_s": {"p50": round(p50_theirs, 4), "p90": round(pct(theirs, 0.9), 4),
                          "mean": round(statistics.mean(theirs), 4)},
            "envd_sh_s": {"p50": round(pct(raw, 0.5), 4), "p90": round(pct(raw, 0.9), 4),
                          "mean": round(statistics.mean(raw), 4)},
            "ratio": round(p50_theirs / p50_own, 3),
            "adapter_ratio": round(pct(raw, 0.5) / p50_own, 3),
            "target_ratio": 1.2,
            "guest_sh_s": round(guest["sh"], 4),
            "guest_bash_login_s": round(guest["bash_login"], 4),
            "machine": machine(),
        }))
    finally:
        stop_server(proc, data_dir)


if __name__ == "__main__":
    main()
