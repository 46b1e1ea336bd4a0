"""Benchmark: the code interpreter through Hangar's SDK and E2B's, as one JSON object.

    .venv/bin/python bench/code_interpreter_bench.py [--creates 3] [--runs 30] [--no-e2b]

One private server (``benchlib.start_server``: the shared image cache, no
pool, no guest NIC); the image is built first if there is no build of it
(an existing build is used as it is, even one of an older recipe: its id is
printed). Figures (seconds), in one run, the two SDKs in turn so that both
see the same load:

* ``create_to_first_result``: per side, ``create_s`` (the create call
  returned) and ``create_to_first_result_s`` (until ``run_code("1+1")`` gave
  ``2``), p50 over ``--creates`` rounds, and the path each create took
  (``source``: ``template``, restored from the image's booted snapshot, or
  ``cold``). ``hangar``: ``hangar.client.Sandbox.create("code-interpreter")``
  and ``sb.run_code``; ``e2b``: the unmodified ``e2b-code-interpreter`` SDK's
  ``Sandbox.create()`` (its default template, ``code-interpreter-v1``) with
  only E2B's three variables set, and its ``run_code`` (port 49999 through
  ``/e2b/envd``). ``ratio``: e2b over hangar.
* ``run_code_1_plus_1``: p50, p95, min and max of ``run_code("1+1")`` in one
  sandbox, Hangar's SDK and E2B's alternating (``--runs`` each, after 3
  unmeasured), the round trip SDK → HTTP → API → agent tunnel → guest server
  → kernel and back; ``ratio``: e2b's p50 over hangar's.
* ``guest_memory_mib``: the guest's used memory (MemTotal - MemAvailable)
  with a warm kernel and a spare, beside the image's default size.
* ``contexts``: per SDK (E2B's ``create_code_context`` and
  ``restart_code_context``, and Hangar's), in a sandbox from the template,
  ``--contexts`` rounds each of: ``create_s`` and ``restart_s`` with the
  guest's spare kernel ready (the bench waits for it between calls, reading
  the guest server's ``/health``), and ``second_create_s``, a create made
  right after another (no spare ready: it waits for a kernel to start, as
  every create did before the spare). ``baseline_run_code_s`` is the p50 of
  ``run_code("1+1")`` in the same sandbox; ``ratio`` is each p50 over it
  (a create or restart that hands out the spare is one such round trip).
  ``spare_wait_s`` is how long the next spare took to be ready after a call
  that used one (``spare_start_s`` as the guest server timed it).
* ``spare_kernel``: the spare's memory in a fresh sandbox (the newer of its
  two kernels): ``rss_mib`` and ``pss_mib`` (its share of pages it shares).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any, Callable

from benchlib import SHARED, api_key, e2b_env, machine, pct, start_server, stop_server

from hangar.client import Hangar, Sandbox, Timeouts
from hangar.errors import NotFound
from hangar.images import build_image, resolve_image
from hangar.images.recipes import RECIPES
from hangar.layout import Layout

IMAGE = "code-interpreter"


def timing(xs: list[float]) -> dict[str, float]:
    return {"runs": len(xs), "p50_s": round(pct(xs, 0.5), 4), "p95_s": round(pct(xs, 0.95), 4),
            "min_s": round(min(xs), 4), "max_s": round(max(xs), 4)}


def hangar_create(c: Hangar) -> dict[str, Any]:
    t0 = time.monotonic()
    with Sandbox.create(IMAGE, client=c) as sb:
        created = time.monotonic() - t0
        text = sb.run_code("1+1").text
        first = time.monotonic() - t0
        assert text == "2", text
        return {"create_s": created, "first_s": first, "source": sb.info.source}


def e2b_create(source: Callable[[str], str]) -> dict[str, Any]:
    from e2b_code_interpreter import Sandbox as E2BSandbox

    t0 = time.monotonic()
    sbx = E2BSandbox.create(timeout=600)
    try:
        created = time.monotonic() - t0
        text = sbx.run_code("1+1").text
        first = time.monotonic() - t0
        assert text == "2", text
        return {"create_s": created, "first_s": first, "source": source(sbx.sandbox_id)}
    finally:
        sbx.kill()


def creates_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {"create_s": round(pct([r["create_s"] for r in rows], 0.5), 3),
            "create_to_first_result_s": round(pct([r["first_s"] for r in rows], 0.5), 3),
            "runs": [round(r["first_s"], 3) for r in rows],
            "sources": sorted({str(r["source"]) for r in rows})}


SPARE_STATE = ("import json, urllib.request\n"
               "url = 'http://127.0.0.1:49999/health'\n"
               "print(json.dumps(json.load(urllib.request.urlopen(url, timeout=30))))\n")
KERNELS = ("import glob, json\n"
           "out = []\n"
           "for d in glob.glob('/proc/[0-9]*'):\n"
           "    try:\n"
           "        if b'ipykernel_launcher' not in open(d + '/cmdline', 'rb').read(): continue\n"
           "        start = int(open(d + '/stat').read().rsplit(')', 1)[1].split()[19])\n"
           "        roll = dict(l.split(':', 1) for l in open(d + '/smaps_rollup') if ':' in l)\n"
           "        kib = {k: int(v.split()[0]) for k, v in roll.items()\n"
           "               if v.strip().endswith('kB')}\n"
           "        out.append({'start': start, 'rss_kib': kib['Rss'], 'pss_kib': kib['Pss']})\n"
           "    except OSError: pass\n"
           "print(json.dumps(sorted(out, key=lambda k: k['start'])))\n")


def spare(run: Callable[[str], str], timeout: float = 1800) -> dict[str, Any]:
    """Wait until the guest server's spare kernel is ready; its ``/health``, plus
    ``waited_s``."""
    t0 = time.monotonic()
    while True:
        health = json.loads(run("python3 /root/spare_state.py"))
        if health["spare"] == "ready":
            return {**health, "waited_s": time.monotonic() - t0}
        if health["spare"] != "starting" or time.monotonic() - t0 > timeout:
            raise RuntimeError(f"no spare kernel: {health}")
        time.sleep(0.5)


def contexts(sb: Sandbox, e2b: Any, rounds: int) -> dict[str, Any]:
    """Context create and restart latencies in ``sb`` (module docstring)."""
    def run(cmd: str) -> str:
        return sb.exec(cmd, timeout=300).stdout

    sb.files.write("/root/spare_state.py", SPARE_STATE)
    base: list[float] = []
    for i in range(13):
        t = time.perf_counter()
        assert sb.run_code("1+1").text == "2"
        if i >= 3:
            base.append(time.perf_counter() - t)
    sides: dict[str, dict[str, Callable[..., Any]]] = {"hangar": {
        "create": sb.create_code_context, "restart": sb.restart_code_context,
        "remove": sb.remove_code_context}}
    if e2b is not None:
        sides["e2b"] = {"create": lambda: e2b.create_code_context(request_timeout=600),
                        "restart": e2b.restart_code_context,
                        "remove": e2b.remove_code_context}
    xs: dict[str, dict[str, list[float]]] = {
        name: {k: [] for k in ("create_s", "restart_s", "second_create_s", "spare_wait_s")}
        for name in sides}

    def timed(name: str, key: str, call: Callable[[], Any]) -> Any:
        t = time.perf_counter()
        out = call()
        xs[name][key].append(time.perf_counter() - t)
        return out

    for _ in range(rounds):
        for name, f in sides.items():
            spare(run)
            ctx = timed(name, "create_s", f["create"])
            xs[name]["spare_wait_s"].append(spare(run)["waited_s"])
            timed(name, "restart_s", lambda: f["restart"](ctx))
            second = timed(name, "second_create_s", f["create"])  # the spare is starting
            for c in (ctx, second):
                f["remove"](c)
    b50 = pct(base, 0.5)
    out: dict[str, Any] = {"baseline_run_code_s": round(b50, 4)}
    for name, d in xs.items():
        out[name] = {k: timing(v) for k, v in d.items()}
        out[name]["ratio"] = {k: round(pct(d[k], 0.5) / b50, 2)
                              for k in ("create_s", "restart_s", "second_create_s")}
    out["spare_start_s_last"] = spare(run).get("spare_start_s")
    return out


def spare_memory(sb: Sandbox) -> dict[str, Any]:
    """The newer of a fresh sandbox's two kernels (the spare): RSS and PSS, MiB."""
    sb.files.write("/root/kernels.py", KERNELS)
    kernels = json.loads(sb.exec("python3 /root/kernels.py", timeout=300).stdout)
    assert len(kernels) == 2, kernels  # the default context's and the spare
    k = kernels[-1]
    return {"rss_mib": round(k["rss_kib"] / 1024, 1), "pss_mib": round(k["pss_kib"] / 1024, 1),
            "default_kernel_rss_mib": round(kernels[0]["rss_kib"] / 1024, 1)}


def round_trips(sb: Sandbox, e2b: Any, runs: int) -> dict[str, Any]:
    """``run_code("1+1")`` timings in ``sb`` through both SDKs, and the guest's memory."""
    calls: dict[str, Callable[[], str]] = {"hangar": lambda: sb.run_code("1+1").text}
    if e2b is not None:
        calls["e2b"] = lambda: e2b.run_code("1+1").text
    for call in calls.values():
        for _ in range(3):
            call()
    xs: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(runs):
        for name, call in calls.items():
            t = time.perf_counter()
            assert call() == "2"
            xs[name].append(time.perf_counter() - t)
    mem = sb.exec("cat /proc/meminfo").stdout.split("\n")
    kib = {line.split(":")[0]: int(line.split()[1]) for line in mem if line}
    out: dict[str, Any] = {name: timing(v) for name, v in xs.items()}
    if e2b is not None:
        out["ratio"] = round(out["e2b"]["p50_s"] / out["hangar"]["p50_s"], 3)
    return {"run_code_1_plus_1": out,
            "guest_memory_mib": {
                "used_with_warm_kernel": round((kib["MemTotal"] - kib["MemAvailable"]) / 1024),
                "default_size": RECIPES[IMAGE].default_memory_mib}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--creates", type=int, default=3)
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--contexts", type=int, default=3,
                    help="rounds of context create/restart per SDK (0: none)")
    ap.add_argument("--only-contexts", action="store_true",
                    help="skip the create-to-first-result and run_code rounds")
    ap.add_argument("--no-e2b", action="store_true", help="Hangar's SDK only")
    a = ap.parse_args()
    layout = Layout(SHARED)
    try:
        image = resolve_image(layout, IMAGE)
    except NotFound:
        image = build_image(layout, IMAGE)
    out: dict[str, Any] = {"bench": "code_interpreter", "image_id": image.id,
                           "machine": machine()}
    proc, d, url = start_server()
    try:
        with Hangar(url, api_key(d), timeouts=Timeouts(lifecycle=900)) as c:
            if not a.no_e2b:
                os.environ.update(e2b_env(d, url))

            def source(sid: str) -> str:
                return str(c.get(sid).source)

            sides: dict[str, Callable[[], dict[str, Any]]] = {"hangar": lambda: hangar_create(c)}
            if not a.no_e2b:
                sides["e2b"] = lambda: e2b_create(source)
            rows: dict[str, list[dict[str, Any]]] = {k: [] for k in sides}
            for _ in range(0 if a.only_contexts else a.creates):
                for name, side in sides.items():
                    rows[name].append(side())
            creates = {name: creates_summary(r) for name, r in rows.items() if r}
            if not a.no_e2b and not a.only_contexts:
                creates["ratio"] = round(creates["e2b"]["create_to_first_result_s"]
                                         / creates["hangar"]["create_to_first_result_s"], 3)
            out["create_to_first_result"] = creates
            with Sandbox.create(IMAGE, client=c) as sb:
                e2b = None
                if not a.no_e2b:
                    from e2b_code_interpreter import Sandbox as E2BSandbox

                    e2b = E2BSandbox.connect(sb.id)
                out["spare_kernel"] = spare_memory(sb)
                if not a.only_contexts:
                    out.update(round_trips(sb, e2b, a.runs))
                if a.contexts:
                    out["contexts"] = contexts(sb, e2b, a.contexts)
    finally:
        stop_server(proc, d)
    out["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
