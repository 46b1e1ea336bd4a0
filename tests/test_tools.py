"""Agent tools without a VM: definitions, the in-process tier on real bubblewrap, the cost
guard, events, the sync twin, the tunnel route's refusals and the MCP server over stdio.

The in-process cases are the issue's: a command tries to reach the network, read secrets,
take 1 GiB, spin the CPU, flood its output; each gets a result that says why it failed,
and the host is unchanged.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import sys
import time
from pathlib import Path

import httpx
import jsonschema
import pytest

import hangar.tools as ht
from conftest import SHARED, SRC, Server

pytestmark = pytest.mark.skipif(ht.inprocess.available() is not None,
                                reason="needs bubblewrap")


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


async def in_process(*commands: str, **task_opts: object) -> list[ht.ToolResult]:
    async with ht.task("in-process", "u-test", "In-process test", **task_opts) as t:
        return [await t.call("run_command", {"command": c, "timeout_s": 120}) for c in commands]


# -- definitions ------------------------------------------------------------------------------


def test_tiers_nest_and_schemas_export_in_both_formats() -> None:
    inproc, vm, browser = (set(ht.TIER_TOOLS[t]) for t in ht.TIERS)
    assert inproc < vm < browser
    assert {"search_code"} <= vm - inproc
    assert {"browser_navigate", "browser_interact", "browser_screenshot"} == browser - vm
    for tier in ht.TIERS:
        anth, oai = ht.anthropic_tools(tier), ht.openai_tools(tier)
        assert [t["name"] for t in anth] == list(ht.TIER_TOOLS[tier])
        for a, o in zip(anth, oai):
            assert set(a) == {"name", "description", "input_schema"}
            assert o["type"] == "function" and o["function"]["name"] == a["name"]
            assert o["function"]["parameters"] == a["input_schema"]
            jsonschema.Draft202012Validator.check_schema(a["input_schema"])
            assert a["input_schema"]["type"] == "object"
    with pytest.raises(ValueError, match="in-process, vm, browser"):
        ht.anthropic_tools("gpu")
    assert ht.validate("run_command", {"command": "ls"}) is None
    assert "required" in ht.validate("run_command", {})  # type: ignore[operator]
    assert "timeout_s" in ht.validate("run_command", {"command": "x", "timeout_s": 10_000})  # type: ignore[operator]
    assert "additional" in ht.validate("read_file", {"path": "a", "mode": "x"}).lower()  # type: ignore[union-attr]
    assert ht.validate("no_such_tool", {}) == "unknown tool 'no_such_tool'"


def test_each_tier_has_one_handler_table_naming_its_tools() -> None:
    from hangar.tools.toolset import tier_classes

    classes = tier_classes()
    assert set(classes) == set(ht.TIERS)
    for tier, cls in classes.items():
        assert cls.tier == tier
        assert set(cls.HANDLERS) == set(ht.TIER_TOOLS[tier]), tier
        assert all(asyncio.iscoroutinefunction(h) for h in cls.HANDLERS.values())

    async def unknown() -> ht.ToolResult:
        tools = classes["in-process"]()  # type: ignore[call-arg]
        try:
            return await tools.call("browser_navigate", {"url": "x"}, None)
        finally:
            await tools.close()

    r = run(unknown())
    assert not r.ok and r.error == "the in-process tier has no tool 'browser_navigate'"


def test_results_convert_for_both_apis() -> None:
    r = ht.ToolResult(ok=False, output="partial", error="exited with code 2", image=b"\x89PNG..",
                      data={"width": 4, "height": 3})
    a = r.to_anthropic("toolu_1")
    assert a["is_error"] is True and a["tool_use_id"] == "toolu_1"
    assert a["content"][0]["text"] == "partial\nerror: exited with code 2"
    assert a["content"][1]["source"]["media_type"] == "image/png"
    o = r.to_openai("call_1")
    assert o["role"] == "tool" and o["tool_call_id"] == "call_1" and "4x3" in o["content"]
    assert r.as_dict()["image_png_b64"]


# -- the in-process tier: the cases -------------------------------------------------------


def test_in_process_has_no_network() -> None:
    with socket.socket() as listener:  # a real service on the host's loopback
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        probe = ("python3 -c 'import socket,sys; s=socket.socket(); s.settimeout(5); "
                 "s.connect((sys.argv[1], int(sys.argv[2]))); print(\"CONNECTED\")' {} {}")
        results = run(in_process(probe.format("127.0.0.1", port), probe.format("127.0.0.1", 8080),
                                 probe.format("1.1.1.1", 443), probe.format("8.8.8.8", 53)))
    for r in results:
        assert not r.ok and "CONNECTED" not in r.output, r
    assert "Connection refused" in results[0].output
    assert "unreachable" in results[2].output


def test_in_process_reads_no_secrets(server: Server) -> None:
    key_files = [server.data_dir / "api-key", SHARED / "api-key"]
    assert key_files[0].exists()
    os.environ["HANGAR_API_KEY"] = server.key  # in the caller's environment only
    try:
        results = run(in_process("cat /etc/shadow", *(f"cat {p}" for p in key_files),
                                 "ls /root /home /var/lib/hangar", "env"))
    finally:
        del os.environ["HANGAR_API_KEY"]
    for r in results[:-1]:
        assert not r.ok and "No such file" in r.output, r
        assert server.key not in r.output
    env = results[-1]
    assert env.ok and server.key not in env.output and "HANGAR" not in env.output
    names = {line.split("=", 1)[0] for line in env.output.splitlines() if "=" in line}
    assert names <= {"PATH", "HOME", "TMPDIR", "LANG", "USER", "SHELL", "PWD", "TZ", "LC_ALL",
                     "SHLVL", "_", "OLDPWD"}, names


def test_in_process_memory_cpu_and_output_limits() -> None:
    started = time.monotonic()
    mem, out = run(in_process("python3 -c 'b = bytearray(1 << 30); print(len(b))'",
                              "head -c 5242880 /dev/zero | tr '\\0' x"))
    assert not mem.ok and "out of memory" in (mem.error or "") and "256 MiB" in mem.error  # type: ignore[operator]
    assert str(1 << 30) not in mem.output
    assert out.ok and out.truncated
    assert len(out.output.encode()) == 1 << 20 and set(out.output) == {"x"}
    assert out.data["stdout_bytes"] == 5 << 20
    assert time.monotonic() - started < 30

    cpu_started = time.monotonic()
    [cpu] = run(in_process("python3 -c 'while True: pass'"))
    took = time.monotonic() - cpu_started
    assert not cpu.ok and "CPU time limit of 30 s" in (cpu.error or ""), cpu
    assert not cpu.data["timed_out"]
    assert 29 <= took < 100, took


def test_in_process_wall_clock_timeout_kills_the_group() -> None:
    async def go() -> ht.ToolResult:
        async with ht.task("in-process", "u", "t") as t:
            return await t.call("run_command", {"command": "sleep 100 & sleep 100; echo never",
                                                "timeout_s": 1})
    r = run(go())
    assert not r.ok and r.data["timed_out"] and "timed out after 1 s" in (r.error or "")
    assert r.duration_s < 10


def test_in_process_leaves_the_host_unchanged() -> None:
    marker = f"hangar-escape-{secrets.token_hex(4)}"
    before = set(Path("/tmp").glob("hangar-task-*"))

    async def go() -> tuple[list[ht.ToolResult], Path]:
        async with ht.task("in-process", "u", "t") as t:
            rs = [await t.call("run_command", {"command": c}) for c in (
                f"touch /tmp/{marker} && ls /tmp", f"touch /usr/{marker}", f"touch /etc/{marker}",
                f"echo x > /{marker}", "echo kept > notes.txt")]
            rs.append(await t.call("read_file", {"path": f"/tmp/{marker}"}))
            rs.append(await t.call("read_file", {"path": "notes.txt"}))
            # A symlink planted in the work folder resolves inside the sandbox.
            rs.append(await t.call("run_command", {"command": "ln -s /etc/shadow link"}))
            rs.append(await t.call("read_file", {"path": "link"}))
            box = t._tools.box.root  # type: ignore[union-attr]
            assert box.exists()
            return rs, box

    rs, box = run(go())
    assert rs[0].ok and marker in rs[0].output  # its private /tmp
    assert not Path(f"/tmp/{marker}").exists()
    for r in rs[1:4]:
        assert not r.ok and "Read-only file system" in r.output, r
    assert not Path(f"/usr/{marker}").exists() and not Path(f"/etc/{marker}").exists()
    assert rs[5].ok and rs[6].output == "kept\n"
    assert not rs[8].ok and "No such file" in (rs[8].error or ""), rs[8]
    assert not box.exists()
    assert set(Path("/tmp").glob("hangar-task-*")) == before


# -- the cost guard and events ------------------------------------------------------------------


def test_tool_call_limit_ends_the_task_with_events_in_order() -> None:
    sink = ht.ListSink()

    async def go() -> tuple[list[ht.ToolResult], ht.Task]:
        async with ht.task("in-process", "u-7", "Limited", {"max_tool_calls": 3},
                           sink=sink) as t:
            rs = [await t.call("run_command", {"command": f"echo {i}"}) for i in range(5)]
            return rs, t

    rs, t = run(go())
    assert [r.ok for r in rs] == [True, True, True, False, False]
    assert "limit reached" in (rs[3].error or "") and "max_tool_calls=3" in rs[3].error  # type: ignore[operator]
    assert rs[3].data["limit"] == "tool_calls" and rs[4] == rs[3]
    assert t.result is not None and t.result.reason == "limit:tool_calls"
    assert t.result.usage.tool_calls == 3
    assert sink.kinds() == ["agent.task.started"] + ["agent.tool.started",
                                                     "agent.tool.finished"] * 3 + [
        "agent.task.ended"]
    start = sink.events[0].data
    assert start["task_id"] == t.task_id and start["tier"] == "in-process"
    assert start["name"] == "Limited" and start["source"] == "none"
    assert sink.events[1].data == {"task_id": t.task_id, "tool": "run_command",
                                   "summary": "echo 0"}
    assert sink.events[2].data["ok"] is True and sink.events[2].data["duration_s"] >= 0
    end = sink.events[-1].data
    assert end["reason"] == "limit:tool_calls" and end["usage"]["tool_calls"] == 3


def test_tokens_and_wall_time_limits() -> None:
    async def tokens() -> tuple[ht.ToolResult, ht.Task]:
        async with ht.task("in-process", "u", "t", {"max_tokens": 1000}) as t:
            t.report_tokens(600)
            assert (await t.call("run_command", {"command": "true"})).ok
            t.report_tokens(600)
            return await t.call("run_command", {"command": "true"}), t

    r, t = run(tokens())
    assert not r.ok and "1200 tokens" in (r.error or "") and t.result.reason == "limit:tokens"  # type: ignore[union-attr]

    async def wall() -> tuple[ht.ToolResult, ht.Task, float]:
        async with ht.task("in-process", "u", "t", {"max_wall_s": 2}) as t:
            started = time.monotonic()
            r = await t.call("run_command", {"command": "sleep 30", "timeout_s": 60})
            return r, t, time.monotonic() - started

    r, t, took = run(wall())
    assert not r.ok and r.data["limit"] == "wall_time", r
    assert took < 10 and t.result.reason == "limit:wall_time"  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="unknown limits"):
        ht.task("in-process", "u", "t", {"max_calls": 3})


def test_cancellation_ends_the_task() -> None:
    sink = ht.ListSink()
    box: list[Path] = []

    async def go() -> None:
        async with ht.task("in-process", "u", "t", sink=sink) as t:
            box.append(t._tools.box.root)  # type: ignore[union-attr]
            await t.call("run_command", {"command": "sleep 60", "timeout_s": 90})

    async def main() -> None:
        job = asyncio.create_task(go())
        while not sink.kinds() or sink.kinds()[-1] != "agent.tool.started":
            await asyncio.sleep(0.05)
        job.cancel()
        with pytest.raises(asyncio.CancelledError):
            await job

    run(main())
    assert sink.events[-1].data["reason"] == "cancelled"
    assert not box[0].exists()


def test_sync_twin() -> None:
    with ht.sync_task("in-process", "u", "Sync", {"max_tool_calls": 2}) as t:
        assert t.call("write_file", {"path": "a.txt", "content": "sync ✓"}).ok
        assert t.call("read_file", {"path": "a.txt"}).output == "sync ✓"
        assert "limit reached" in (t.call("read_file", {"path": "a.txt"}).error or "")
    assert t.result.reason == "limit:tool_calls"


def test_server_sink_tolerates_a_server_without_events() -> None:
    """An older Hangar answers 404 to POST /events: the task runs on, with one warning."""
    import http.server
    import threading

    class Old(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            self.send_error(404)

        def log_message(self, *args: object) -> None:
            pass

    old = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Old)
    threading.Thread(target=old.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{old.server_address[1]}"

    async def go() -> ht.Task:
        async with ht.task("in-process", "u", "t", url=url, api_key="k") as t:
            assert (await t.call("run_command", {"command": "true"})).ok
            return t

    try:
        with pytest.warns(RuntimeWarning, match="no POST /events"):
            t = run(go())
        assert t.result.reason == "done"  # type: ignore[union-attr]
    finally:
        old.shutdown()
        old.server_close()


# -- the tunnel route refuses what it must ---------------------------------------------------------


def test_tunnel_route_refusals(server: Server) -> None:
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus

    async def status(path: str, key: str | None) -> int:
        url = server.url.replace("http", "ws") + path
        try:
            async with connect(url, additional_headers={"X-API-Key": key} if key else {}):
                return 101
        except InvalidStatus as exc:
            return exc.response.status_code

    assert run(status("/sandboxes/sb-000000000000/tunnel/9222", None)) == 401
    assert run(status("/sandboxes/sb-000000000000/tunnel/9222", "hk_wrong")) == 401
    assert run(status("/sandboxes/sb-000000000000/tunnel/70000", server.key)) == 400
    assert run(status("/sandboxes/sb-000000000000/tunnel/9222", server.key)) == 404


# -- MCP over stdio (in-process tier: no VM) -------------------------------------------------------


def test_mcp_stdio_in_process() -> None:
    from mcp import Client
    from mcp.client.stdio import StdioServerParameters

    async def go() -> None:
        params = StdioServerParameters(
            command=sys.executable, args=["-m", "hangar.cli", "mcp", "--tier", "in-process"],
            env={**os.environ, "PYTHONPATH": str(SRC)})
        async with Client(params) as c:
            names = [t.name for t in (await c.list_tools()).tools]
            assert names == list(ht.TIER_TOOLS["in-process"])
            r = await c.call_tool("write_file", {"path": "m.txt", "content": "kept"})
            assert not r.is_error
            r = await c.call_tool("run_command", {"command": "cat m.txt; exit 4"})
            assert r.is_error and r.content[0].text.startswith("kept")
            assert r.structured_content["data"]["exit_code"] == 4
            r = await c.call_tool("search_code", {"pattern": "x"})
            assert r.is_error and "no tool" in r.content[0].text

    before = set(Path("/tmp").glob("hangar-task-*"))
    run(go())
    assert set(Path("/tmp").glob("hangar-task-*")) == before


def test_example_agent_loop_runs_with_the_scripted_model() -> None:
    import subprocess

    env = {k: v for k, v in os.environ.items()
           if k not in ("ANTHROPIC_API_KEY", "OPENAI_API_KEY")}
    env["PYTHONPATH"] = str(SRC)
    example = Path(__file__).resolve().parents[1] / "examples" / "agent_loop.py"
    r = subprocess.run([sys.executable, str(example), "--tier", "in-process"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "model: Scripted" in r.stdout and "-> ok 'PASS\\n'" in r.stdout
    assert "ended: done" in r.stdout


def test_mcp_streamable_http_keeps_a_task_per_session() -> None:
    """Over HTTP, `hangar mcp` needs a bearer token (loopback too): without one it does not
    start, a client of the official SDK without it gets 401, with it a task per session."""
    import subprocess

    import httpx2
    from conftest import free_port
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    env.pop("HANGAR_MCP_TOKEN", None)
    for host in ("0.0.0.0", "127.0.0.1"):
        refused = subprocess.run([sys.executable, "-m", "hangar.cli", "mcp", "--transport",
                                  "http", "--host", host, "--port", str(port), "--tier",
                                  "in-process"], env=env, capture_output=True, text=True,
                                 timeout=60)
        assert refused.returncode == 2 and "HANGAR_MCP_TOKEN" in refused.stderr, refused.stderr
    token = secrets.token_urlsafe(32)
    env["HANGAR_MCP_TOKEN"] = token
    url = f"http://127.0.0.1:{port}/mcp"
    before = set(Path("/tmp").glob("hangar-task-*"))
    proc = subprocess.Popen([sys.executable, "-m", "hangar.cli", "mcp", "--transport", "http",
                             "--port", str(port), "--tier", "in-process"], env=env)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(url, timeout=1)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.1)

        def client(bearer: str | None, seen: list[int] | None = None) -> Client:
            headers = {"Authorization": f"Bearer {bearer}"} if bearer else {}

            async def note(response: httpx2.Response) -> None:
                if seen is not None:
                    seen.append(response.status_code)

            return Client(streamable_http_client(url, http_client=httpx2.AsyncClient(
                headers=headers, timeout=httpx2.Timeout(60.0),
                event_hooks={"response": [note]})))

        async def refused_by_sdk(bearer: str | None) -> list[int]:
            seen: list[int] = []
            with pytest.raises(Exception):  # the SDK's error for the server's answer
                async with client(bearer, seen) as c:
                    await c.list_tools()
            return seen

        for bearer in (None, "wrong" + token):
            assert set(run(refused_by_sdk(bearer))) == {401}, bearer
            r = httpx.post(url, json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
                           headers={"Authorization": f"Bearer {bearer}"} if bearer else {})
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", r.text

        async def session(text: str) -> tuple[str, set[Path]]:
            async with client(token) as c:
                assert (await c.call_tool("write_file", {"path": "s.txt", "content": text})).content
                r = await c.call_tool("read_file", {"path": "s.txt"})
                return r.content[0].text, set(Path("/tmp").glob("hangar-task-*")) - before

        async def two() -> list[tuple[str, set[Path]]]:
            return list(await asyncio.gather(session("one"), session("two")))

        (a, dirs_a), (b, dirs_b) = run(two())
        assert (a, b) == ("one", "two")  # each session its own work folder
        assert len(dirs_a | dirs_b) == 2
        deadline = time.monotonic() + 20
        while set(Path("/tmp").glob("hangar-task-*")) - before:
            assert time.monotonic() < deadline, "closed sessions kept their tasks"
            time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_limit_and_a_leave_at_once_end_the_task_once() -> None:
    sink = ht.ListSink()

    async def go() -> ht.Task:
        async with ht.task("in-process", "u", "t", {"max_tokens": 10}, sink=sink) as t:
            t.report_tokens(11)  # the stop starts in the background; we leave at once
        return t

    t = run(go())
    assert sink.kinds().count("agent.task.ended") == 1
    assert t.result is not None and t.result.reason == "limit:tokens"
