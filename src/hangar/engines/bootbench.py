"""``hangar bench boot``: boot guests straight on the engine and time their phases.

Each run boots one VM of ``image`` in a private temporary directory (no
server, no database, no network), waits for the agent's greeting, runs
``true`` once (the first exec), and stops the VM. The phases are those of
``hangar.engines.boot_phases``, as the server logs them for every boot;
``first_exec`` is the host's time from asking for the boot to the result
of that first command. All figures in seconds.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from hangar.engines.agent_client import exec_meta
from hangar.engines.base import Engine, VMSpec
from hangar.engines.boot_phases import boot_phases
from hangar.images import GuestImage
from hangar.layout import Layout

BOOT_TIMEOUT_S = 120.0


async def boot_once(engine: Engine, image: GuestImage, layout: Layout, n: int,
                    memory_mib: int) -> dict[str, float]:
    """One boot's phases plus ``first_exec``; the VM and its files are gone on return."""
    sid = f"bench-{n}"
    spec = VMSpec(sid, image, layout.sandbox(sid), 1, memory_mib, 2048, hostname=sid)
    started = time.perf_counter()
    vm = await engine.boot(spec)
    try:
        agent = await engine.connect_agent(vm, BOOT_TIMEOUT_S, cold=True)  # a stall: BootStalled
        try:
            phases = boot_phases(agent.hello, time.perf_counter() - started)
            await agent.exec(exec_meta(argv=["true"]))
            phases["first_exec"] = round(time.perf_counter() - started, 3)
        finally:
            await agent.close()
    finally:
        await engine.stop(vm)
    return phases


async def bench_boot(engine: Engine, image: GuestImage, runs: int = 3,
                     memory_mib: int = 512) -> dict[str, Any]:
    """Boot ``runs`` times one after the other; returns every run and the medians."""
    root = Path(tempfile.mkdtemp(prefix="hangar-bench-"))
    try:
        layout = Layout(root)
        layout.sandboxes.mkdir(parents=True, exist_ok=True)
        results = [await boot_once(engine, image, layout, n, memory_mib) for n in range(runs)]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    keys = [k for k in results[0]] if results else []
    median = {k: round(statistics.median(r[k] for r in results if k in r), 3) for k in keys}
    return {"engine": engine.describe(), "image": image.id, "memory_mib": memory_mib,
            "runs": results, "median": median}
