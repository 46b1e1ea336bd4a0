"""Benchmark: Hangar's exec against quicksand's, side by side in one run (issue 33: an exec
through Hangar at most quicksand's).

Prints one JSON object. One private ``hangar serve`` (``benchlib.start_server``) with one
sandbox of ``--image``, and quicksand's ``bench/peers/quicksand_peer.py --serve`` (one
alpine sandbox, forced onto TCG like Hangar's guests, in the interpreter named by
``--quicksand-python`` or ``$QUICKSAND_PYTHON``) running beside it. Round after round,
each of these runs once, each in every place of a round in turn, so that all see the same
load (seconds: p50, p90 and the fastest):

* ``hangar_exec_sh_s``: ``POST /sandboxes/{id}/exec`` of ``{"command": "true"}`` (the
  guest's ``/bin/sh -c true``), with a kept-alive ``httpx`` client, as the Python SDK;
* ``hangar_exec_argv_s``: the same of ``{"command": "true", "args": []}`` (no shell);
* ``quicksand_exec_s``: quicksand's ``await sandbox.execute("true")`` (its guest's shell,
  as quicksand always runs a command), timed in its own process around the call.

``ratio`` is each of Hangar's p50 over quicksand's. Without quicksand it prints Hangar's
figures and says why the ratio is missing.

After the rounds, ``guest_loop_true_s`` tells the two guests apart: one exec in each of
a shell loop that runs ``/bin/true`` ``LOOP`` times (the guest's shell forks and execs
it each time: Debian's dash and glibc's coreutils in Hangar's image, busybox and musl in
quicksand's alpine), divided by ``LOOP``; the fastest of ``LOOP_RUNS`` (seconds a spawn).

    .venv/bin/python bench/exec_peer_bench.py [--rounds 100] [--image base]
        [--quicksand-python PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from benchlib import PEERS, api_key, machine, pct, start_server, stats, stop_server

LOOP = 50
"""Spawns of ``/bin/true`` in one exec of a shell loop (``guest_loop_true_s``)."""
LOOP_RUNS = 3
LOOP_CMD = f"for i in {' '.join(str(i) for i in range(LOOP))}; do /bin/true; done"
READY_S = 600.0
"""Seconds quicksand gets to boot its sandbox (a first boot under TCG takes tens)."""


class Quicksand:
    """quicksand's peer in ``--serve`` mode: one timed ``execute`` per ``run``."""

    def __init__(self, python: str, memory_mib: int) -> None:
        self.proc = subprocess.Popen(
            [python, str(PEERS / "quicksand_peer.py"), "--serve", "--memory-mib",
             str(memory_mib)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True, bufsize=1,
            env={**os.environ, "QUICKSAND_AUTO_INSTALL": "0"})
        deadline = time.monotonic() + READY_S
        while time.monotonic() < deadline:
            got = self._line()
            if got.get("skipped"):
                raise RuntimeError(str(got["skipped"]))
            if got.get("ready"):
                return
        raise RuntimeError(f"quicksand's sandbox not ready in {READY_S:.0f} s")

    def _line(self) -> dict[str, object]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"quicksand's peer ended (exit {self.proc.wait()})")
        return json.loads(line) if line.startswith("{") else {}

    def run(self, command: str) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        while True:
            got = self._line()
            if "s" in got:
                return float(got["s"])  # type: ignore[arg-type]

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--image", default="base")
    ap.add_argument("--memory-mib", type=int, default=512)
    ap.add_argument("--quicksand-python", default=os.environ.get("QUICKSAND_PYTHON"))
    a = ap.parse_args()
    host = machine()
    skipped = None
    if not a.quicksand_python:
        skipped = "no quicksand interpreter (--quicksand-python or QUICKSAND_PYTHON)"
    elif not Path(a.quicksand_python).exists():
        skipped = f"no interpreter at {a.quicksand_python}"
    times: dict[str, list[float]] = {"hangar_exec_sh_s": [], "hangar_exec_argv_s": []}
    proc, d, url = start_server()
    qs: Quicksand | None = None
    loops: dict[str, float] = {}
    try:
        with httpx.Client(base_url=url, headers={"X-API-Key": api_key(d)}, timeout=600) as c:
            r = c.post("/sandboxes", json={"image": a.image, "memory_mib": a.memory_mib})
            r.raise_for_status()
            sid = r.json()["id"]
            if skipped is None:
                try:
                    qs = Quicksand(a.quicksand_python, a.memory_mib)
                    times["quicksand_exec_s"] = []
                except RuntimeError as exc:
                    skipped = str(exc)

            def hangar(body: dict[str, object]) -> Callable[[], float]:
                def go() -> float:
                    t = time.perf_counter()
                    r = c.post(f"/sandboxes/{sid}/exec", json=body)
                    took = time.perf_counter() - t
                    assert r.status_code == 200 and r.json()["exit_code"] == 0, r.text
                    return took
                return go

            calls: dict[str, Callable[[], float]] = {
                "hangar_exec_sh_s": hangar({"command": "true"}),
                "hangar_exec_argv_s": hangar({"command": "true", "args": []})}
            if qs is not None:
                calls["quicksand_exec_s"] = lambda: qs.run("true")  # type: ignore[union-attr]
            names = list(calls)
            for _ in range(5):
                for name in names:
                    calls[name]()
            for i in range(a.rounds):
                k = i % len(names)
                for name in names[k:] + names[:k]:
                    times[name].append(calls[name]())
            loops: dict[str, float] = {"hangar": min(
                hangar({"command": LOOP_CMD})() for _ in range(LOOP_RUNS)) / LOOP}
            if qs is not None:
                loops["quicksand"] = min(qs.run(LOOP_CMD) for _ in range(LOOP_RUNS)) / LOOP
            c.delete(f"/sandboxes/{sid}")
    finally:
        if qs is not None:
            qs.close()
        stop_server(proc, d)
    out: dict[str, object] = {"bench": "exec_peer", "host": host, "image": a.image,
                              "rounds": a.rounds}
    out.update({name: stats(xs) for name, xs in times.items()})
    out["guest_loop_true_s"] = {k: round(v, 4) for k, v in loops.items()}
    if "quicksand_exec_s" in times:
        q = pct(times["quicksand_exec_s"], 0.5)
        out["ratio"] = {
            "hangar_exec_sh_over_quicksand": round(pct(times["hangar_exec_sh_s"], 0.5) / q, 3),
            "hangar_exec_argv_over_quicksand": round(
                pct(times["hangar_exec_argv_s"], 0.5) / q, 3)}
    else:
        out["ratio"] = {"skipped": skipped}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
