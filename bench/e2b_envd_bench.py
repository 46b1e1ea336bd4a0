"""Benchmark: ``commands.run("true")`` through E2B's SDK and Hangar's envd, against Hangar's
own exec (issue 18's target: a p50 ratio of at most 1.2).

Prints one JSON object. Boots one ``base`` sandbox on a private ``hangar
serve`` and, in one run, makes these calls in turn, round after round, so
that all of them see the same load (seconds):

* ``hangar_exec_s``: ``Sandbox.exec("true")`` of Hangar's own SDK (a blocking
  ``POST /sandboxes/{id}/exec``, ``/bin/sh -c true`` in the guest): the baseline;
* ``e2b_run_s``: ``Sandbox.commands.run("true")`` of the unmodified ``e2b`` SDK
  with ``E2B_SANDBOX_URL`` at ``/e2b/envd`` (Connect RPC server stream,
  ``/bin/bash -l -c true`` in the guest, as E2B's SDK asks);
* ``envd_sh_s``: the same Start call made by hand (``httpx``, Connect's JSON
  stream) with ``/bin/sh -c true``, the very program Hangar's exec runs: the
  data plane's own cost, the guest's work being equal;
* ``envd_bash_login_s``: that call with ``/bin/bash -l -c true``, the SDK's
  program: ``e2b_run_s`` less this is the SDK's own client-side cost;
* ``hangar_exec_bash_login_s``: Hangar's exec of ``/bin/bash -l -c true``: the
  guest's work of the SDK's call through Hangar's own path.

``ratio`` is the p50 of ``e2b_run_s`` over the p50 of ``hangar_exec_s`` (the
target), ``ratio_of_min`` the same of their fastest calls (what an idle host
would show, the least moved by other work on a shared one); ``adapter_ratio``
that of ``envd_sh_s`` (the path alone); ``login_adapter_ratio``
``envd_bash_login_s`` over ``hangar_exec_bash_login_s``.
The guest's own part, timed inside it (``guest_ms``: ``sh -c true``, ``bash
-c true``, ``bash -l -c true``, p50 of 20), shows how much of ``ratio`` is the
login shell the SDK asks for rather than the path through the server.
``login_profile`` says whether the image has Hangar's light login scripts
(``hangar.images.recipes.LOGIN_PROFILE``) or Debian's, which start ``id -u``
and ``mesg n`` on every login shell.

Where the rest of ``ratio`` went (2026-12-02 and -05, in guests, QEMU TCG):
bash's own start, about three times dash's, and not for ld.so's work (a few
ms, alike for both: ``LD_DEBUG=statistics``) but because every dynamically
linked process runs its code at new, randomized addresses, which TCG
translates anew (with ``setarch -R``, ``/bin/true`` takes 5 ms instead of 22).
Images now run Debian's ``bash-static`` as ``/bin/bash``
(``hangar.images.debian.static_bash``): not position-independent, its
translations are reused, and ``bash -l -c true`` costs less than ``sh -c
true``. ``guest_ms`` shows it: ``bash_login_c`` below ``sh_c``.
docs/performance.md has the figures.

    .venv/bin/python bench/e2b_envd_bench.py [--runs 40] [--image base]
"""

from __future__ import annotations

import argparse
import json
import os
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
        subprocess.run(argv, check=True, stdin=subprocess.DEVNULL)
        out.append(time.perf_counter() - t)
    return round(sorted(out)[len(out) // 2] * 1000, 1)
print(json.dumps({"sh_c": timed(["/bin/sh", "-c", "true"]),
                  "bash_c": timed(["/bin/bash", "-c", "true"]),
                  "bash_login_c": timed(["/bin/bash", "-l", "-c", "true"])}))
"""


def stats(xs: list[float]) -> dict[str, float]:
    return {"p50": round(pct(xs, 0.5), 4), "p90": round(pct(xs, 0.9), 4),
            "mean": round(statistics.mean(xs), 4), "min": round(min(xs), 4)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--image", default="base")
    args = ap.parse_args()
    host = machine()
    proc, data_dir, url = start_server()
    try:
        key = api_key(data_dir)
        with Sandbox.create(args.image, base_url=url, api_key=key) as sbx:
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
            headers = {"E2b-Sandbox-Id": sbx.id, "X-Access-Token": token,
                       "Content-Type": "application/connect+json"}
            conn = httpx.Client(base_url=f"{url}/e2b/envd", headers=headers, timeout=60)

            def start(cmd: str, argv: list[str]) -> None:
                body = json.dumps({"process": {"cmd": cmd, "args": argv}}).encode()
                r = conn.post("/process.Process/Start",
                              content=struct.pack(">BI", 0, len(body)) + body)
                assert r.status_code == 200 and b'"end"' in r.content, r.content

            calls = {
                "hangar_exec_s": lambda: sbx.exec("true"),
                "e2b_run_s": lambda: e2b.commands.run("true"),
                "envd_sh_s": lambda: start("/bin/sh", ["-c", "true"]),
                "envd_bash_login_s": lambda: start("/bin/bash", ["-l", "-c", "true"]),
                "hangar_exec_bash_login_s": lambda: sbx.exec("/bin/bash",
                                                             args=["-l", "-c", "true"]),
            }
            for call in calls.values():  # warm every path (connections, the page cache)
                for _ in range(3):
                    call()
            times: dict[str, list[float]] = {name: [] for name in calls}
            for _ in range(args.runs):
                for name, call in calls.items():
                    t = time.perf_counter()
                    call()
                    times[name].append(time.perf_counter() - t)
            sbx.files.write("/root/bench_guest.py", IN_GUEST)
            guest = json.loads(sbx.exec("python3 /root/bench_guest.py 20").stdout)
            light = "Hangar" in sbx.exec("cat /etc/profile").stdout
            image_id = sbx.info.image_id
        p50 = {name: pct(xs, 0.5) for name, xs in times.items()}
        print(json.dumps({
            "benchmark": "e2b_envd_commands_run_true",
            "runs": args.runs, "image": args.image, "image_id": image_id,
            "login_profile": "hangar (light)" if light else "debian",
            **{name: stats(xs) for name, xs in times.items()},
            "ratio": round(p50["e2b_run_s"] / p50["hangar_exec_s"], 3),
            "target_ratio": 1.2,
            "ratio_of_min": round(min(times["e2b_run_s"]) / min(times["hangar_exec_s"]), 3),
            "adapter_ratio": round(p50["envd_sh_s"] / p50["hangar_exec_s"], 3),
            "login_adapter_ratio": round(p50["envd_bash_login_s"]
                                         / p50["hangar_exec_bash_login_s"], 3),
            "sdk_client_s": round(p50["e2b_run_s"] - p50["envd_bash_login_s"], 4),
            "guest_ms": guest,
            "machine": host,
            "load_avg_at_end": [round(x, 2) for x in os.getloadavg()],
        }))
    finally:
        stop_server(proc, data_dir)


if __name__ == "__main__":
    main()
