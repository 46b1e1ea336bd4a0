"""Benchmark: a command of E2B's default user against root's, Hangar's exec and the guest's
own spawn, in one sandbox (issue 33: ``commands.run`` as ``user`` at most 1.2 times
Hangar's exec; Hangar's argv exec at most 1.3 times the guest's ``posix_spawn``).

Prints one JSON object. One private ``hangar serve`` (``benchlib.start_server``), one
sandbox of ``--image`` made by E2B's SDK through ``/e2b`` (so its envd calls default to
E2B's user ``user``), and, round after round, these calls, so that all see the same
load, each in every place of a round in turn (seconds: p50, p90 and the fastest):

* ``hangar_exec_argv_s``: ``POST /sandboxes/{id}/exec`` of ``{"command": "true",
  "args": []}`` (no shell; the guest spawns ``true`` as root);
* ``hangar_exec_sh_s``: the same of ``{"command": "true"}`` (``/bin/sh -c true``);
* ``e2b_run_root_s``: the unmodified ``e2b`` SDK's ``commands.run("true",
  user="root")`` (``/bin/bash -l -c true``, as the SDK asks);
* ``e2b_run_user_s``: ``commands.run("true")``, as ``user``: the guest agent takes the
  user's ids itself (``hangar.guest.users``);
* ``envd_setpriv_user_s``: what ``commands.run("true")`` ran before that, made by hand:
  envd's Start (Connect's JSON stream), as root, of ``setpriv --reuid=user
  --regid=user --init-groups -- /bin/bash -l -c true`` with the user's ``HOME``,
  ``USER``, ``LOGNAME`` and home as cwd.

In each round too, in its turn, a Python program kept running in the guest
(started as root through envd, fed a line a round, not timed here) times one spawn
(``os.posix_spawn`` + ``waitpid``) each of: ``/bin/true`` (``guest_spawn_true_s``, the
floor), ``/bin/sh -c true``, ``/bin/true`` as ``user`` the agent's way (the thread's
real ids, ``resetids``) and through ``setpriv``.

    .venv/bin/python bench/e2b_user_bench.py [--rounds 60] [--image base]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import struct
import time
from typing import Any, Callable

import httpx
from benchlib import api_key, e2b_env, machine, pct, start_server, stats, stop_server
from e2b import Sandbox as E2BSandbox

FLOOR = r"""
import ctypes, json, os, pwd, sys, time
pw = pwd.getpwnam("user")
groups = os.getgrouplist("user", pw.pw_gid)
libc = ctypes.CDLL(None, use_errno=True)
def ids(u, g, gs):  # the calling thread's real ids (x86_64: setgroups, setresgid, setresuid)
    assert libc.syscall(116, len(gs), (ctypes.c_uint * max(1, len(gs)))(*gs)) == 0
    assert libc.syscall(119, g, -1, -1) == 0 and libc.syscall(117, u, -1, -1) == 0
env = {"PATH": "/usr/bin:/bin"}
def root(argv):
    os.waitpid(os.posix_spawn(argv[0], argv, env), 0)
def as_user(argv):
    ids(pw.pw_uid, pw.pw_gid, groups)
    try:
        pid = os.posix_spawn(argv[0], argv, env, resetids=True)
    finally:
        ids(0, 0, [])
    os.waitpid(pid, 0)
SETPRIV = ["/usr/bin/setpriv", "--reuid=user", "--regid=user", "--init-groups", "--"]
ways = {"guest_spawn_true_s": lambda: root(["/bin/true"]),
        "guest_spawn_sh_c_true_s": lambda: root(["/bin/sh", "-c", "true"]),
        "guest_spawn_true_as_user_s": lambda: as_user(["/bin/true"]),
        "guest_spawn_setpriv_true_s": lambda: root(SETPRIV + ["/bin/true"])}
for line in sys.stdin:
    out = {}
    for k, f in ways.items():
        t = time.perf_counter(); f(); out[k] = time.perf_counter() - t
    print(json.dumps(out), flush=True)
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--image", default="base")
    args = ap.parse_args()
    host = machine()
    proc, data_dir, url = start_server()
    try:
        e2b = e2b_env(data_dir, url)
        sbx = E2BSandbox.create(args.image, timeout=3600, api_url=e2b["E2B_API_URL"],
                                api_key=e2b["E2B_API_KEY"],
                                sandbox_url=e2b["E2B_SANDBOX_URL"])
        try:
            rest = httpx.Client(base_url=url, headers={"X-API-Key": api_key(data_dir)},
                                timeout=120)
            envd = httpx.Client(base_url=e2b["E2B_SANDBOX_URL"], timeout=120, headers={
                "E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": sbx._envd_access_token,
                "Content-Type": "application/connect+json"})

            def exec_(**body: Any) -> dict[str, Any]:
                r = rest.post(f"/sandboxes/{sbx.sandbox_id}/exec", json=body)
                r.raise_for_status()
                out = r.json()
                assert out["exit_code"] == 0, out
                return out

            def setpriv_start() -> None:
                body = json.dumps({"process": {
                    "cmd": "setpriv", "args": ["--reuid=user", "--regid=user", "--init-groups",
                                               "--", "/bin/bash", "-l", "-c", "true"],
                    "envs": {"HOME": "/home/user", "USER": "user", "LOGNAME": "user"},
                    "cwd": "/home/user"}}).encode()
                r = envd.post("/process.Process/Start",
                              content=struct.pack(">BI", 0, len(body)) + body,
                              headers={"Authorization": "Basic cm9vdDo="})  # user root
                assert r.status_code == 200 and b"exit status 0" in r.content, r.content

            who = sbx.commands.run("id -un; id -G").stdout.split("\n")
            assert who[0] == "user", who
            calls: dict[str, Callable[[], object]] = {
                "hangar_exec_argv_s": lambda: exec_(command="true", args=[]),
                "hangar_exec_sh_s": lambda: exec_(command="true"),
                "e2b_run_root_s": lambda: sbx.commands.run("true", user="root"),
                "e2b_run_user_s": lambda: sbx.commands.run("true"),
                "envd_setpriv_user_s": setpriv_start,
            }
            floor_proc = sbx.commands.run(f"exec python3 -u -c {shlex.quote(FLOOR)}",
                                          background=True, stdin=True, user="root", timeout=0)
            floor_out = iter(floor_proc)

            def floor_step() -> dict[str, float]:
                sbx.commands.send_stdin(floor_proc.pid, "go\n")
                line = ""
                while not line.endswith("\n"):
                    out, err, _ = next(floor_out)
                    assert not err, err
                    line += out or ""
                return json.loads(line)

            for _ in range(3):  # warm every path
                floor_step()
                for call in calls.values():
                    call()
            times: dict[str, list[float]] = {name: [] for name in calls}
            floor: dict[str, list[float]] = {}
            order: list[str | None] = [None, *calls]  # None: the guest's own spawns
            for i in range(args.rounds):
                shift = i % len(order)  # each call in each place of a round, in turn
                for name in order[shift:] + order[:shift]:
                    if name is None:
                        for k, x in floor_step().items():  # timed in the guest
                            floor.setdefault(k, []).append(x)
                        continue
                    t = time.perf_counter()
                    calls[name]()
                    times[name].append(time.perf_counter() - t)
            floor_proc.kill()
        finally:
            sbx.kill()
        p50 = {k: pct(v, 0.5) for k, v in {**times, **floor}.items()}
        print(json.dumps({
            "benchmark": "e2b_user_commands_run_true", "rounds": args.rounds,
            "image": args.image, "groups_of_user": who[1],
            **{k: stats(v) for k, v in times.items()},
            "guest": {k: stats(v) for k, v in floor.items()},
            "ratios_p50": {
                "e2b_user_over_hangar_exec_sh": round(p50["e2b_run_user_s"]
                                                      / p50["hangar_exec_sh_s"], 3),
                "e2b_user_over_e2b_root": round(p50["e2b_run_user_s"]
                                                / p50["e2b_run_root_s"], 3),
                "envd_setpriv_user_over_hangar_exec_sh": round(
                    p50["envd_setpriv_user_s"] / p50["hangar_exec_sh_s"], 3),
                "hangar_exec_argv_over_guest_spawn_true": round(
                    p50["hangar_exec_argv_s"] / p50["guest_spawn_true_s"], 3),
                "hangar_exec_sh_over_guest_spawn_sh_c_true": round(
                    p50["hangar_exec_sh_s"] / p50["guest_spawn_sh_c_true_s"], 3),
            },
            "machine": host, "load_avg_at_end": [round(x, 2) for x in os.getloadavg()],
        }, indent=1))
    finally:
        stop_server(proc, data_dir)


if __name__ == "__main__":
    main()
