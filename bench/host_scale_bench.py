"""Benchmark: one host at full scale (issue 33), in the format public sandbox benchmarks use.

    .venv/bin/python bench/host_scale_bench.py [--n 100] [--machines 1000]
        [--overcommit 4] [--steps seq,idle,storm,asleep] [--starts N] [--sleepers N]

One server on this host (``HANGAR_MEMORY_OVERCOMMIT`` ``--overcommit``, room for
``--n`` sandboxes of the default 512 MiB, creates from the booted ``base`` template),
driven over HTTP. Steps, each with its baseline measured in the same run:

* **seq**: ``--n`` sandboxes created one after another, each followed by its first
  command (``true``): create-to-first-command p50, p95, p99 (s), failures, wall time;
  baseline: the first one, alone on the host.
* **idle**: those ``--n`` sandboxes left idle for ``IDLE_S``: host CPU (% of a core per
  sandbox, from ``/proc/stat`` over ``SAMPLE_S``), host memory per sandbox
  (``MemAvailable`` against before the step), the VMMs' resident sets, ``/health``
  latency p50 and p95 (ms), and exec p50 in one of them against the same exec with one
  sandbox alone (measured before the first create).
* **storm**: the sandboxes deleted, then ``--n`` creates sent at once, each followed
  by its first command: p50, p95, p99, the first to finish, failures, wall time; ratio
  of its p50 to seq's; how many waited in the start queue (``hangar.core.starts``:
  ``--starts`` sets ``HANGAR_MAX_CONCURRENT_STARTS``) and how many it refused.
* **asleep**: ``--machines`` machines (``POST /machines/{user}``), each put to sleep,
  ``--sleepers`` at a time (default: the server's concurrent-start limit; the first one
  alone): disk per machine (MiB the data directory grew by, allocated and apparent),
  the wake p50 of 10 random ones against the wake of the first machine while it was
  alone, the server's CPU while they all sleep (% of a core over ``SAMPLE_S``), its
  start-up time with them all on disk (a restart), failures by reason, the wall time of
  making them and the highest 1-minute load average seen.

The server, its VMMs and its data directory (with every machine's snapshot) are
removed at the end, pass or fail, also when the bench is stopped with SIGINT, SIGTERM or
SIGHUP (``benchlib.stop_server``).

The server's CPU seconds and RSS are read after each step. Prints a table on stderr and
one JSON object on stdout (with the machine: cores, memory, engine).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from benchlib import api_key, machine, pct, proc_usage, start_server, stop_server

IDLE_S = 20.0
"""Seconds the sandboxes are left alone before the idle figures are read."""
SAMPLE_S = 10.0
"""Seconds over which the host's CPU is sampled."""
EXECS = 30
"""Execs timed for an exec p50."""


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def cpu_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of the host, from the first line of /proc/stat."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = f[3] + f[4]
    return sum(f) - idle, sum(f)


def meminfo_mib(field: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) // 1024
    return 0


def error_code(r: httpx.Response) -> str:
    """The error code of a Hangar error answer (``limit_exceeded``...), or ``?``."""
    try:
        return str(r.json()["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return "?"


def latencies(xs: list[float]) -> dict[str, float]:
    return {"p50": round(pct(xs, 0.5), 3), "p95": round(pct(xs, 0.95), 3),
            "p99": round(pct(xs, 0.99), 3)} if xs else {}


class Bench:
    def __init__(self, n: int, overcommit: float, starts: int | None = None) -> None:
        self.n = n
        self.proc, self.dir, self.url = start_server({
            "HANGAR_MAX_SANDBOXES": str(n + 8), "HANGAR_MEMORY_OVERCOMMIT": str(overcommit),
            "HANGAR_BOOT_TIMEOUT_S": "900", "HANGAR_MEMORY_PRESSURE_IDLE_S": "3600",
            **({"HANGAR_MAX_CONCURRENT_STARTS": str(starts)} if starts else {})})
        self.key = api_key(self.dir)
        self.c = self.client()
        self.out: dict[str, Any] = {}
        self.failed: dict[str, int] = {}
        """Failures by reason in the step under way (``first_command``)."""
        self.lock = threading.Lock()

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"X-API-Key": self.key}, timeout=1800)

    def server(self) -> dict[str, float]:
        u = proc_usage(self.proc.pid)
        return {"cpu_s": round(u["cpu_s"], 1), "rss_mib": round(u.get("rss_mib", 0.0), 1)}

    def first_command(self, c: httpx.Client) -> tuple[str | None, float]:
        """(id, seconds) of a create followed by its first command; id None on failure
        (its reason counted in ``self.failed``: ``create 429 limit_exceeded``...)."""
        t0 = time.monotonic()
        try:
            r = c.post("/sandboxes", json={})
        except httpx.HTTPError as exc:
            self.failure(f"create {type(exc).__name__}")
            return None, time.monotonic() - t0
        if r.status_code != 201:
            self.failure(f"create {r.status_code} {error_code(r)}")
            return None, time.monotonic() - t0
        sid = r.json()["id"]
        e = c.post(f"/sandboxes/{sid}/exec", json={"command": "true"})
        if e.status_code != 200:
            self.failure(f"exec {e.status_code} {error_code(e)}")
        return (sid if e.status_code == 200 else None), time.monotonic() - t0

    def failure(self, reason: str) -> None:
        with self.lock:
            self.failed[reason] = self.failed.get(reason, 0) + 1

    def exec_p50(self, sid: str) -> float:
        times = []
        for _ in range(EXECS):
            t0 = time.monotonic()
            self.c.post(f"/sandboxes/{sid}/exec", json={"command": "true"})
            times.append(time.monotonic() - t0)
        return round(statistics.median(times) * 1000, 1)

    def health_ms(self) -> dict[str, float]:
        """p50 and p95 of 50 ``/health`` probes, ms, each on a new connection as a load
        balancer's probe is. One client serves them all: ``httpx.get`` builds a client
        (and its TLS context) per call, which cost 34 ms of this process's own time on a
        loaded 2-core host and would be counted as the server's."""
        times = []
        probe = httpx.Client(base_url=self.url, timeout=10,
                             limits=httpx.Limits(max_keepalive_connections=0))
        with probe:
            for _ in range(50):
                t0 = time.monotonic()
                probe.get("/health").raise_for_status()
                times.append((time.monotonic() - t0) * 1000)
                time.sleep(0.05)
        return {"p50": round(pct(times, 0.5), 1), "p95": round(pct(times, 0.95), 1)}

    def delete_all(self) -> None:
        for sb in self.c.get("/sandboxes").json()["sandboxes"]:
            self.c.delete(f"/sandboxes/{sb['id']}")

    # -- steps ---------------------------------------------------------------------------

    def seq(self) -> list[str]:
        sid, alone = self.first_command(self.c)
        assert sid is not None, "the first create failed"
        self.out["exec_alone_ms"] = self.exec_p50(sid)
        ids, times, failed = [sid], [alone], 0
        t0 = time.monotonic()
        for i in range(self.n - 1):
            got, took = self.first_command(self.c)
            times.append(took)
            if got is None:
                failed += 1
            else:
                ids.append(got)
            if (i + 2) % 10 == 0:
                say(f"seq: {i + 2}/{self.n}, last {took:.2f} s")
        self.out["seq"] = {"n": self.n, "failures": failed, **latencies(times),
                           "first_s": round(alone, 3),
                           "wall_s": round(time.monotonic() - t0 + alone, 1),
                           "server": self.server()}
        return ids

    def idle(self, ids: list[str], avail_before: int) -> None:
        say(f"idle: {len(ids)} sandboxes, {IDLE_S:.0f} s")
        time.sleep(IDLE_S)
        b0, t0 = cpu_ticks()
        time.sleep(SAMPLE_S)
        b1, t1 = cpu_ticks()
        cores = os.cpu_count() or 1
        host_cpu = (b1 - b0) / max(1, t1 - t0) * 100 * cores  # % of one core
        cap = self.c.get("/capacity").json()["memory"]
        used = avail_before - meminfo_mib("MemAvailable")
        exec_ms = self.exec_p50(ids[len(ids) // 2])
        self.out["idle"] = {
            "n": len(ids), "host_cpu_pct_of_core_per_sandbox": round(host_cpu / len(ids), 2),
            "host_memory_mib_per_sandbox": round(used / len(ids), 1),
            "vmm_resident_mib_per_sandbox": round(cap["used_mib"] / len(ids), 1),
            "health_ms": self.health_ms(), "exec_ms": exec_ms,
            "exec_ratio_to_alone": round(exec_ms / self.out["exec_alone_ms"], 2),
            "server": self.server()}

    def storm(self) -> None:
        results: list[tuple[str | None, float]] = []
        lock = threading.Lock()

        def one() -> None:
            with self.client() as c:
                got = self.first_command(c)
            with lock:
                results.append(got)

        say(f"storm: {self.n} creates at once")
        self.failed = {}
        threads = [threading.Thread(target=one) for _ in range(self.n)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.monotonic() - t0
        times = [t for _, t in results]
        gate = self.c.get("/capacity").json()["starts"]
        self.out["storm"] = {"n": self.n, "failures": sum(1 for s, _ in results if s is None),
                             **latencies(times), "first_s": round(min(times), 2),
                             "wall_s": round(wall, 1), "max_concurrent_starts": gate["limit"],
                             "waited": gate["waited"], "refused": gate["refused"],
                             "failed_by_reason": dict(self.failed),
                             "p50_ratio_to_seq": round(pct(times, 0.5)
                                                       / self.out["seq"]["p50"], 2),
                             "server": self.server()}

    def asleep(self, machines: int, workers: int | None = None) -> None:
        du0, ap0 = self.du_mib(), self.du_mib(apparent=True)
        users = [f"u{i:05d}" for i in range(machines)]
        load: list[float] = [os.getloadavg()[0]]
        t0 = time.monotonic()
        self.failed = {}
        assert self.make_asleep(self.c, users[0]), f"the first machine: {self.failed}"
        t = time.monotonic()
        r = self.c.post(f"/machines/{users[0]}/wake")
        wake_alone = time.monotonic() - t
        assert r.status_code == 200, r.text
        assert self.make_asleep(self.c, users[0], create=False), self.failed
        limit = workers or int(self.c.get("/capacity").json()["starts"]["limit"])
        say(f"asleep: {machines} machines, {limit} at a time")
        asleep = [users[0], *self.put_to_sleep(users[1:], limit, load, t0)]
        setup = time.monotonic() - t0
        cpu0 = proc_usage(self.proc.pid)["cpu_s"]
        time.sleep(SAMPLE_S)
        idle_cpu = (proc_usage(self.proc.pid)["cpu_s"] - cpu0) / SAMPLE_S * 100
        per = (self.du_mib() - du0) / len(asleep)
        per_apparent = (self.du_mib(apparent=True) - ap0) / len(asleep)
        wakes = []
        for user in random.Random(33).sample(asleep[1:], min(10, len(asleep) - 1)):
            t = time.monotonic()
            r = self.c.post(f"/machines/{user}/wake")
            wakes.append(time.monotonic() - t)
            assert r.status_code == 200, r.text
            assert self.make_asleep(self.c, user, create=False), self.failed
        server = self.server()
        start = self.restart()
        self.out["asleep"] = {
            "machines": machines, "asleep": len(asleep), "at_a_time": limit,
            "failures": machines - len(asleep), "failed_by_reason": dict(self.failed),
            "disk_mib_per_machine": round(per, 1),
            "apparent_mib_per_machine": round(per_apparent, 1),
            "wake_alone_s": round(wake_alone, 3),
            "wake_p50_s": round(statistics.median(wakes), 3) if wakes else None,
            "wake_ratio_to_alone": round(statistics.median(wakes) / wake_alone, 2)
            if wakes else None, "wakes_s": [round(w, 2) for w in wakes],
            "server_idle_cpu_pct_of_core": round(idle_cpu, 1),
            "server_start_s": round(start, 2), "setup_s": round(setup, 1),
            "load_avg_1m_max": round(max(load), 2), "server": server}

    def make_asleep(self, c: httpx.Client, user: str, create: bool = True) -> bool:
        """Create ``user``'s machine (unless ``create`` is False) and put it to sleep; False
        on a failure (counted in ``self.failed`` by step, status and code)."""
        try:
            if create:
                r = c.post(f"/machines/{user}", json={})
                if r.status_code != 201:  # a new user: a new machine
                    self.failure(f"create {r.status_code} {error_code(r)}")
                    return False
            r = c.post(f"/machines/{user}/snapshot")
        except httpx.HTTPError as exc:
            self.failure(f"{'create' if create else 'sleep'} {type(exc).__name__}")
            return False
        if r.status_code != 200 or r.json().get("state") != "sleeping":
            self.failure(f"sleep {r.status_code} {error_code(r)}")
            return False
        return True

    def put_to_sleep(self, users: list[str], limit: int, load: list[float],
                     t0: float) -> list[str]:
        """Create and sleep ``users``' machines, ``limit`` at a time (each worker its own
        client); returns the users whose machine is asleep, appends 1-minute load averages
        to ``load``."""
        local = threading.local()
        clients: list[httpx.Client] = []
        done: list[str] = []
        count = 0

        def one(user: str) -> None:
            nonlocal count
            if not hasattr(local, "c"):
                local.c = self.client()
                with self.lock:
                    clients.append(local.c)
            ok = self.make_asleep(local.c, user)
            with self.lock:
                count += 1
                if ok:
                    done.append(user)
                if count % 50 == 0 or count == len(users):
                    load.append(os.getloadavg()[0])
                    say(f"asleep: {count + 1}/{len(users) + 1} ({time.monotonic() - t0:.0f} s,"
                        f" load {load[-1]:.1f}, failed {dict(self.failed)})")

        pool = ThreadPoolExecutor(limit)
        try:
            for f in [pool.submit(one, u) for u in users]:
                f.result()
        finally:  # stopped midway: what has not started never does
            pool.shutdown(cancel_futures=True)
            for c in clients:
                c.close()
        return done

    def du_mib(self, apparent: bool = False) -> float:
        """MiB the data directory takes on disk (allocated blocks; with ``apparent``, the
        files' sizes: snapshots' memory files are sparse)."""
        out = subprocess.run(["du", "-sm", *(["--apparent-size"] if apparent else []),
                              str(self.dir)], capture_output=True, text=True).stdout.split()
        return float(out[0]) if out else 0.0

    def restart(self) -> float:
        """Seconds from a new ``hangar serve`` on the same data directory to its /health."""
        self.proc.terminate()
        self.proc.wait(300)
        env = {**os.environ, "HANGAR_DATA_DIR": str(self.dir), "HANGAR_PORT":
               self.url.rsplit(":", 1)[1], "HANGAR_POOL_SIZE": "0", "HANGAR_NETWORK": "off",
               "HANGAR_PRIVSEP": "0", "HANGAR_MAX_SANDBOXES": str(self.n + 8)}
        t0 = time.monotonic()
        log = open(self.dir / "server.log", "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "hangar.cli", "serve"], env=env,
                                     stdout=log, stderr=subprocess.STDOUT)
        log.close()
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > 600:
                raise RuntimeError("the server did not come back in 600 s")
            time.sleep(0.05)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--machines", type=int, default=1000)
    ap.add_argument("--overcommit", type=float, default=4.0)
    ap.add_argument("--steps", default="seq,idle,storm,asleep")
    ap.add_argument("--sleepers", type=int, default=None,
                    help="machines created and put to sleep at once in the asleep step "
                         "(default: the server's concurrent-start limit)")
    ap.add_argument("--starts", type=int, default=None,
                    help="HANGAR_MAX_CONCURRENT_STARTS (default: the server's, max(2, cores)); "
                         "a large figure (e.g. 1000) starts everything at once, as before "
                         "issue 33's start queue")
    args = ap.parse_args()
    steps = set(args.steps.split(","))
    # A bench stopped by a signal still ends its server, VMMs and data directory (finally).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGHUP, lambda *_: sys.exit(129))
    b = Bench(args.n, args.overcommit, args.starts)
    try:
        b.out["machine"] = machine()
        b.out["engine"] = httpx.get(b.url + "/health", timeout=10).json()["engine"]
        b.out["settings"] = {"n": args.n, "overcommit": args.overcommit,
                             "memory_mib": 512, "template": "base",
                             "max_concurrent_starts": args.starts or "default"}
        avail_before = meminfo_mib("MemAvailable")
        if steps & {"seq", "idle", "storm"}:
            ids = b.seq()
            if "idle" in steps:
                b.idle(ids, avail_before)
            b.delete_all()
            if "storm" in steps:
                b.storm()
                b.delete_all()
        if "asleep" in steps:
            b.asleep(args.machines, args.sleepers)
    finally:
        b.c.close()
        stop_server(b.proc, b.dir)
    for step in ("seq", "idle", "storm", "asleep"):
        if step in b.out:
            say(f"{step:7} {json.dumps(b.out[step])}")
    print(json.dumps(b.out))


if __name__ == "__main__":
    main()
