"""Benchmark: a template built with E2B's SDK, then creates from it against cold starts of the
same template, as a ratio, in one run.

Prints one JSON object. Two private servers share the image cache
(``benchlib.start_server``: no pool, no guest NIC): ``built`` builds the template through
E2B's flow and serves its creates (each a restore of the build's snapshot); ``cold`` has
no template snapshots (``HANGAR_TEMPLATE_SNAPSHOTS=0``), so its creates boot the base image
cold. The template (E2B's SDK, unmodified, ``Template``): ``from_base_image()``, a file
copied in, a ``run_cmd``, and a web server as its start command with ``wait_for_port``.

* ``build_s``: ``Template.build`` from the call to its return (the first build, no
  cache), and ``rebuild_s`` for the same template unchanged (its snapshot reused);
* ``built``: ``Sandbox.create(name)`` until a first command (``true``) answers
  (``create_to_first_command_s``), and until a command that fetches the start
  command's page answers (``create_to_page_s``: the server is already up, saved
  running);
* ``cold``: ``Sandbox.create("base")`` booted cold until a first command answers, and
  until the same page answers after the same file and command, the start command
  started and the ready check run until it passes: a cold start of the template;

p50 over ``--rounds`` (seconds), taken in turns so both sides see the same load.
``ratio`` is built / cold create to first command (issue 31's target: at most 0.15);
``page_ratio`` the same for create to page.

    .venv/bin/python bench/template_build_bench.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import uuid
from pathlib import Path

from benchlib import e2b_env, machine, pct, start_server, stop_server

PAGE = "built\n"
START = "python3 -m http.server 8000"
READY = '[ -n "$(ss -Htuln sport = :8000)" ]'
FETCH = ("python3 -c \"import urllib.request as u; print(u.urlopen('http://127.0.0.1:8000/"
         "page.txt', timeout=10).read().decode(), end='')\"")


def use(env: dict[str, str]) -> None:
    os.environ.update(env)


def built_side(name: str) -> tuple[float, float]:
    """(create to a first command, to the start command's page) of the built template."""
    from e2b import Sandbox

    t0 = time.perf_counter()
    sb = Sandbox.create(name)
    try:
        sb.commands.run("true")
        first = time.perf_counter() - t0
        assert sb.commands.run(FETCH, cwd="/home/user").stdout == PAGE
        return first, time.perf_counter() - t0
    finally:
        sb.kill()


def cold_side() -> tuple[float, float]:
    """The same two figures for a cold boot of the base image, the file written, the start
    command started and its ready check run until it passes."""
    from e2b import Sandbox

    t0 = time.perf_counter()
    sb = Sandbox.create("base")
    try:
        sb.commands.run("true")
        first = time.perf_counter() - t0
        sb.commands.run(f"printf {PAGE!r} > page.txt && python3 -c 'import json, http.server'")
        sb.commands.run(START, background=True)
        while sb.commands.run(f"{READY} && echo up || true").stdout.strip() != "up":
            time.sleep(0.2)
        assert sb.commands.run(FETCH).stdout == PAGE
        return first, time.perf_counter() - t0
    finally:
        sb.kill()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    host = machine()
    from e2b import Template, wait_for_port

    built_srv = start_server()
    cold_srv = start_server({"HANGAR_TEMPLATE_SNAPSHOTS": "0", "HANGAR_BOOT_TIMEOUT_S": "900"})
    try:
        built_env = e2b_env(built_srv[1], built_srv[2])
        cold_env = e2b_env(cold_srv[1], cold_srv[2])
        ctx = Path(tempfile.mkdtemp(prefix="hgb-ctx-"))
        (ctx / "page.txt").write_text(PAGE)
        template = (Template(file_context_path=str(ctx)).from_base_image()
                    .copy("page.txt", "page.txt")
                    .run_cmd("python3 -c 'import json, http.server'")
                    .set_start_cmd(START, wait_for_port(8000)))
        name = f"bench-{uuid.uuid4().hex[:8]}"
        use(built_env)
        t0 = time.perf_counter()
        Template.build(template, name)
        build_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        Template.build(template, name)
        rebuild_s = time.perf_counter() - t0
        use(cold_env)
        cold_side()  # the cold server's first create warms its caches
        rows: dict[str, list[tuple[float, float]]] = {"built": [], "cold": []}
        for _ in range(a.rounds):
            use(built_env)
            rows["built"].append(built_side(name))
            use(cold_env)
            rows["cold"].append(cold_side())
    finally:
        stop_server(*built_srv[:2])
        stop_server(*cold_srv[:2])

    def figures(side: str) -> dict[str, object]:
        first = [r[0] for r in rows[side]]
        page = [r[1] for r in rows[side]]
        return {"create_to_first_command_s": round(pct(first, 0.5), 3),
                "create_to_page_s": round(pct(page, 0.5), 3),
                "first_runs": [round(x, 3) for x in first]}

    out = {side: figures(side) for side in rows}
    print(json.dumps({
        "benchmark": "e2b_template_build", "rounds": a.rounds,
        "build_s": round(build_s, 2), "rebuild_s": round(rebuild_s, 2), **out,
        "ratio": round(out["built"]["create_to_first_command_s"]  # type: ignore[operator]
                       / out["cold"]["create_to_first_command_s"], 3),
        "target_ratio": 0.15,
        "page_ratio": round(out["built"]["create_to_page_s"]  # type: ignore[operator]
                            / out["cold"]["create_to_page_s"], 3),
        "machine": host, "load_avg_at_end": [round(x, 2) for x in os.getloadavg()],
    }, indent=2))


if __name__ == "__main__":
    main()
