"""Agent tools in real microVMs (the ``dev`` image): a vm task's tools, clean-up whatever
the way out, isolation between users, the cost guard, the warm pool, and MCP over stdio.

Every test asserts that the task's sandbox is gone afterwards: no record, no VMM process.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import pty
import re
import select
import shutil
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import hangar.tools as ht
from conftest import SHARED, SRC, Server, cleanup, free_port, make_data_dir, vmm_pids

vm = pytest.mark.vm

PROJECT = {
    "proj/package.json": '{"name": "demo", "version": "1.0.0", '
                         '"scripts": {"test": "node test.js"}}\n',
    "proj/lib.js": "function computeTotal(items) {\n  return items.reduce((a, b) => a + b, 0);\n}\n"
                   "module.exports = { computeTotal };\n",
    "proj/test.js": "const { computeTotal } = require('./lib');\n"
                    "if (computeTotal([1, 2, 3]) !== 6) process.exit(1);\nconsole.log('ok 6');\n",
}


@pytest.fixture(scope="session")
def dev_image(base_image: Path) -> Path:
    """Build (or reuse) the dev image in the shared cache: minutes the first time."""
    from hangar.images import build_image
    from hangar.layout import Layout

    return build_image(Layout(SHARED), "dev",
                       progress=lambda m: print(f"image: {m}", file=sys.stderr)).dir


def opts(server: Server, **more: object) -> dict[str, object]:
    return {"url": server.url, "api_key": server.key, **more}


def gone(api: httpx.Client, sandbox_id: str | None) -> bool:
    assert sandbox_id
    return api.get(f"/sandboxes/{sandbox_id}").status_code == 404 and not vmm_pids(sandbox_id)


@vm
def test_vm_task_builds_a_project(server: Server, api: httpx.Client, dev_image: Path) -> None:
    sink = ht.ListSink()

    async def go() -> tuple[ht.Task, dict[str, ht.ToolResult]]:
        out: dict[str, ht.ToolResult] = {}
        async with ht.task("vm", "u-build", "Test Runner", {"max_tool_calls": 50},
                           **opts(server, sink=sink)) as t:
            assert t.source == "template" and t.sandbox is not None
            assert (t.sandbox.vcpus, t.sandbox.memory_mib, t.sandbox.image) == (2, 2048, "dev")
            listed = api.get(f"/sandboxes/{t.sandbox_id}").json()
            assert listed["metadata"]["hangar.task"] == t.task_id
            for path, content in PROJECT.items():
                assert (await t.call("write_file", {"path": path, "content": content})).ok
            out["git"] = await t.call("run_command", {"command": (
                "git init -q && git add -A && git -c user.email=ci@example.com -c user.name=ci "
                "commit -qm 'first' && git log --oneline | wc -l && git status --porcelain"),
                "cwd": "proj"})
            out["node"] = await t.call("run_command", {"command": "node -e 'console.log(6*7)'"})
            out["test"] = await t.call("run_command", {"command": "node test.js", "cwd": "proj"})
            out["yarn"] = await t.call("run_command", {"command": "yarn --version"})
            out["fail"] = await t.call("run_command", {"command": "node -e 'process.exit(3)'"})
            out["read"] = await t.call("read_file", {"path": "/work/proj/lib.js"})
            out["missing"] = await t.call("read_file", {"path": "proj/nope.js"})
            out["search"] = await t.call("search_code", {"pattern": "computeTotal",
                                                         "glob": "*.js"})
            out["few"] = await t.call("search_code", {"pattern": "computeTotal",
                                                      "max_results": 1})
            out["bad"] = await t.call("search_code", {"pattern": "("})
            out["env"] = await t.call("run_command", {"command": "env"})
        return t, out

    t, out = asyncio.run(go())
    assert out["git"].ok and out["git"].output == "1\n", out["git"]
    assert out["node"].ok and out["node"].output == "42\n"
    assert out["test"].ok and "ok 6" in out["test"].output
    assert out["yarn"].ok and out["yarn"].output.strip().startswith("1.")
    assert not out["fail"].ok and out["fail"].error == "exited with code 3"
    assert out["read"].ok and out["read"].output == PROJECT["proj/lib.js"]
    assert not out["missing"].ok and "No such file" in (out["missing"].error or "")
    s = out["search"]
    assert s.ok and s.data["total"] == 4 and s.data["left_out"] == 0
    assert {(m["path"], m["line"]) for m in s.data["matches"]} == {
        ("proj/lib.js", 1), ("proj/lib.js", 4), ("proj/test.js", 1), ("proj/test.js", 2)}
    assert "proj/lib.js:1: function computeTotal(items) {" in s.output
    assert out["few"].data["left_out"] == 3 and len(out["few"].data["matches"]) == 1
    assert "3 more matches" in out["few"].output
    assert not out["bad"].ok and "regex" in (out["bad"].error or "").lower()
    assert server.key not in out["env"].output and "HANGAR_API_KEY" not in out["env"].output
    assert t.result is not None and t.result.reason == "done" and t.result.usage.vm_s > 0
    assert gone(api, t.sandbox_id)
    kinds = sink.kinds()
    assert kinds[:2] == ["agent.task.starting", "agent.task.started"]
    assert kinds[-1] == "agent.task.ended"
    assert sink.events[0].sandbox_id is None and sink.events[0].data["tier"] == "vm"
    started = sink.events[1].data
    assert {k: started[k] for k in ("tier", "vcpus", "memory_mib", "source")} == {
        "tier": "vm", "vcpus": 2, "memory_mib": 2048, "source": "template"}
    assert all(e.sandbox_id == t.sandbox_id for e in sink.events[1:])


@vm
def test_a_task_that_raises_or_is_cancelled_leaves_no_sandbox(server: Server, api: httpx.Client,
                                                              dev_image: Path) -> None:
    seen: list[str] = []

    async def raising() -> None:
        async with ht.task("vm", "u-raise", "Raiser", **opts(server)) as t:
            seen.append(t.sandbox_id)  # type: ignore[arg-type]
            assert (await t.call("write_file", {"path": "x", "content": "x"})).ok
            raise RuntimeError("the agent loop broke")

    with pytest.raises(RuntimeError, match="loop broke"):
        asyncio.run(raising())
    assert gone(api, seen[0])

    sink = ht.ListSink()

    async def cancelled() -> None:
        async def work() -> None:
            async with ht.task("vm", "u-cancel", "Canceller", **opts(server, sink=sink)) as t:
                seen.append(t.sandbox_id)  # type: ignore[arg-type]
                await t.call("run_command", {"command": "sleep 120", "timeout_s": 200})

        job = asyncio.create_task(work())
        while "agent.tool.started" not in sink.kinds():
            await asyncio.sleep(0.1)
        job.cancel()
        with pytest.raises(asyncio.CancelledError):
            await job

    asyncio.run(cancelled())
    assert sink.events[-1].kind == "agent.task.ended"
    assert sink.events[-1].data["reason"] == "cancelled"
    assert gone(api, seen[1])


@vm
def test_two_users_cannot_see_each_other(server: Server, api: httpx.Client,
                                         dev_image: Path) -> None:
    async def go() -> tuple[list[ht.ToolResult], list[str]]:
        async with ht.task("vm", "alice", "A", **opts(server)) as a, \
                ht.task("vm", "bob", "B", **opts(server)) as b:
            assert a.sandbox_id != b.sandbox_id
            assert (await a.call("write_file", {"path": "secret.txt",
                                                "content": "alice's secret"})).ok
            rs = [await b.call("read_file", {"path": "secret.txt"}),
                  await b.call("run_command", {"command": "ls -A /work; cat /work/secret.txt; "
                                                          "ls /root /tmp"}),
                  await b.call("search_code", {"pattern": "secret"}),
                  await a.call("read_file", {"path": "secret.txt"})]
            return rs, [a.sandbox_id, b.sandbox_id]  # type: ignore[list-item]

    rs, ids = asyncio.run(go())
    assert not rs[0].ok and "No such file" in (rs[0].error or "")
    assert "alice's secret" not in rs[1].output
    assert all("alice's secret" not in m["text"] for m in rs[2].data.get("matches", []))
    assert rs[3].output == "alice's secret"
    assert all(gone(api, i) for i in ids)


@vm
def test_tool_call_limit_stops_a_vm_task(server: Server, api: httpx.Client,
                                        dev_image: Path) -> None:
    async def go() -> tuple[list[ht.ToolResult], ht.Task, bool]:
        async with ht.task("vm", "u-lim", "Limited", {"max_tool_calls": 3}, **opts(server)) as t:
            rs = [await t.call("run_command", {"command": f"echo {i}"}) for i in range(3)]
            rs.append(await t.call("run_command", {"command": "echo 3"}))
            vm_gone = gone(api, t.sandbox_id)  # already, before the task is left
            rs.append(await t.call("read_file", {"path": "x"}))
            return rs, t, vm_gone

    rs, t, vm_gone = asyncio.run(go())
    assert [r.ok for r in rs[:3]] == [True, True, True]
    assert not rs[3].ok and rs[3].error is not None
    assert rs[3].error.startswith("limit reached: 3 tool calls used")
    assert "VM was deleted" in rs[3].error and rs[4].error == rs[3].error
    assert vm_gone
    assert t.result is not None and t.result.reason == "limit:tool_calls"


@vm
def test_boot_counts_against_the_wall_and_vm_clocks(server: Server, api: httpx.Client,
                                                    dev_image: Path) -> None:
    """The clocks start when the task asks for its VM: a wall limit shorter than getting
    the VM (a restore of the dev image's template, or a boot) ends the task as soon as it
    has its VM, and VM-seconds cover that time."""
    wall = 0.01  # s: less than any restore or boot takes, even with KVM

    async def go() -> tuple[ht.Task, float, ht.ToolResult, bool]:
        asked = time.monotonic()
        async with ht.task("vm", "u-clock", "Clocked", {"max_wall_s": wall},
                           **opts(server)) as t:
            booted = time.monotonic() - asked
            r = await t.call("run_command", {"command": "true"})
            return t, booted, r, gone(api, t.sandbox_id)

    t, booted, r, vm_gone = asyncio.run(go())
    assert booted > wall
    assert not r.ok and r.data["limit"] == "wall_time", r
    assert vm_gone and t.result is not None and t.result.reason == "limit:wall_time"
    usage = t.result.usage
    assert usage.tool_calls == 0 and usage.wall_s >= booted - 0.1
    assert usage.vm_s >= t.result.vcpus * booted * 0.5


@vm
def test_mcp_stdio_runs_a_command_in_a_vm(server: Server, api: httpx.Client,
                                          dev_image: Path) -> None:
    from mcp import Client
    from mcp.client.stdio import StdioServerParameters

    r = api.post("/volumes", json={"name": "mcp-notes", "size_mib": 64})
    assert r.status_code == 201, r.text
    vid = r.json()["id"]
    env = {**os.environ, "PYTHONPATH": str(SRC), "HANGAR_URL": server.url,
           "HANGAR_API_KEY": server.key}

    async def go() -> str:
        params = StdioServerParameters(
            command=sys.executable, args=["-m", "hangar.cli", "mcp", "--tier", "vm",
                                          "--user", "mcp-test", "--volume", "/data=mcp-notes"],
            env=env)
        async with Client(params) as c:
            names = [t.name for t in (await c.list_tools()).tools]
            assert names == list(ht.TIER_TOOLS["vm"])
            r = await c.call_tool("run_command", {"command": "echo hi | tee /data/note.txt"})
            assert not r.is_error and r.content[0].text == "hi\n", r
            [sb] = [s for s in api.get("/sandboxes").json()["sandboxes"]
                    if s["metadata"].get("hangar.user") == "mcp-test"]
            got = api.get(f"/sandboxes/{sb['id']}").json()["volumes"]
            assert got == {"/data": {"volume": vid, "read_only": False}}, got
            return sb["id"]

    try:
        sid = asyncio.run(go())
        deadline = time.monotonic() + 30
        while not gone(api, sid):
            assert time.monotonic() < deadline, "closing the MCP session did not delete its VM"
            time.sleep(0.2)
        # What the session's VM wrote outlives it, in the volume.
        r = api.get(f"/volumes/{vid}/files", params={"path": "/note.txt"})
        assert r.status_code == 200 and r.content == b"hi\n", r.text
    finally:
        api.delete(f"/volumes/{vid}")
    # A malformed option, or one that shapes a VM on the in-process tier, is refused at once.
    for args in (["--volume", "no-equals"], ["--tier", "in-process", "--allow", "x.test"]):
        out = subprocess.run([sys.executable, "-m", "hangar.cli", "mcp", *args], env=env,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and "error:" in out.stdout + out.stderr, (args, out)


@pytest.fixture(scope="module")
def pool_server(dev_image: Path) -> Iterator[Server]:
    """A server whose warm pool holds one VM of the dev image (the vm tier's shape)."""
    d = make_data_dir(dev_image)
    srv = Server(d, free_port(), {"HANGAR_POOL_SIZE": "1", "HANGAR_DEFAULT_IMAGE": "dev"})
    srv.start()
    yield srv
    leaked = cleanup(srv)
    shutil.rmtree(d, ignore_errors=True)
    assert not leaked, f"VMM processes outlived the test: {leaked}"


@vm
def test_task_takes_its_vm_from_the_pool(pool_server: Server) -> None:
    deadline = time.monotonic() + 240
    while "pool VM ready" not in pool_server.log.read_text():
        assert time.monotonic() < deadline, "the warm pool never filled"
        time.sleep(0.5)

    async def go() -> ht.Task:
        async with ht.task("vm", "u-pool", "Pooled", **opts(pool_server)) as t:
            assert t.source == "pool"
            r = await t.call("run_command", {"command": "nproc; echo ok"})
            assert r.ok and r.output.split() == ["2", "ok"], r
        return t

    t = asyncio.run(go())
    assert t.sandbox is not None and t.sandbox.memory_mib == 2048
    assert t.result is not None and t.result.source == "pool"
    with pool_server.client() as api:
        assert gone(api, t.sandbox_id)


ANSI = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]|\r")


@vm
def test_hangar_events_shows_a_running_vm_task(server: Server, api: httpx.Client,
                                               dev_image: Path) -> None:
    """The platform's chat view: `hangar events` in a terminal shows the task's tier, its VM
    and the running tool with its elapsed seconds while `sleep 5` runs."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 200, 0, 0))
    env = {**os.environ, "PYTHONPATH": str(SRC), "HANGAR_URL": server.url,
           "HANGAR_API_KEY": server.key, "TERM": "xterm-256color"}
    viewer = subprocess.Popen([sys.executable, "-m", "hangar.cli", "events"], stdin=slave,
                              stdout=slave, stderr=slave, env=env, start_new_session=True)
    os.close(slave)
    seen = bytearray()
    done = threading.Event()
    task: list[ht.Task] = []

    def run_task() -> None:
        async def go() -> None:
            async with ht.task("vm", "u-events", "Test Runner", **opts(server)) as t:
                task.append(t)
                assert (await t.call("run_command", {"command": "sleep 5"})).ok
        try:
            asyncio.run(go())
        finally:
            done.set()

    try:
        time.sleep(2)  # the viewer subscribes before the task starts
        worker = threading.Thread(target=run_task)
        worker.start()
        deadline = time.monotonic() + 240
        while not done.is_set() or select.select([master], [], [], 0)[0]:
            assert time.monotonic() < deadline, "the task did not finish"
            if select.select([master], [], [], 0.2)[0]:
                try:
                    seen += os.read(master, 65536)
                except OSError:
                    break
        worker.join()
        time.sleep(1.5)
        while select.select([master], [], [], 0.2)[0]:
            seen += os.read(master, 65536)
    finally:
        viewer.terminate()
        viewer.wait(10)
        os.close(master)
    [t] = task
    text = ANSI.sub(b"", bytes(seen)).decode(errors="replace")
    vm_short = re.escape(t.sandbox_id[:7])
    running = re.findall(rf"Test Runner \(vm\) running: sleep 5 \((\d+) s elapsed\), "
                         rf"VM {vm_short}…, 2 vCPU, 2 GB", text)
    assert running, text[-3000:]
    assert max(int(s) for s in running) >= 2, f"elapsed time never grew: {running}"
    assert re.search(rf"Test Runner \(vm\)\s+started( \((cold|template)\))?, VM {vm_short}", text), \
        text[-3000:]
    assert gone(api, t.sandbox_id)
