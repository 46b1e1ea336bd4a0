"""The SDK's object surface (Sandbox, Machine), blocking and asyncio, on real microVMs,
and a check that every REST route has an SDK method."""

from __future__ import annotations

import asyncio
import inspect
import re

import pytest

from conftest import Server, vmm_pids

from hangar.client import (
    AsyncHangar, AsyncSandbox, ExecResult, Hangar, Machine, Sandbox, SandboxInfo,
)
from hangar.errors import Busy, NotFound


def test_every_rest_route_has_an_sdk_method() -> None:
    """Each flat-client method names its route in its docstring (``GET /path``); every
    route of the OpenAPI spec must be named by one, in both clients."""
    from hangar.api.app import create_app

    def norm(path: str) -> str:
        return re.sub(r"\{[^}]*\}", "{}", path)

    spec = create_app().openapi()
    routes = {(m.upper(), norm(p)) for p, ops in spec["paths"].items() for m in ops
              if not p.startswith(("/ui", "/novnc")) and p != "/"}
    for cls in (Hangar, AsyncHangar):
        named: set[tuple[str, str]] = set()
        for name, fn in inspect.getmembers(cls, inspect.isfunction):
            if name.startswith("_"):
                continue
            for m, p in re.findall(r"``(GET|POST|PUT|PATCH|DELETE) (/[^`]*)``", fn.__doc__ or ""):
                named.add((m, norm(p)))
        assert routes - named == set(), f"{cls.__name__} lacks methods for {routes - named}"
        assert named - routes == set(), f"{cls.__name__} names unknown routes {named - routes}"


@pytest.mark.vm
def test_sandbox_objects(server: Server) -> None:
    with Hangar(server.url, server.key) as h:
        with Sandbox.create(client=h, metadata={"case": "objects"}, timeout=600) as sb:
            assert isinstance(sb.info, SandboxInfo) and sb.info.state == "running"
            assert sb.info.metadata == {"case": "objects"}
            r = sb.exec("echo $((6*7)); echo oops >&2; exit 4")
            assert isinstance(r, ExecResult)
            assert (r.stdout, r.stderr, r.exit_code, r.ok) == ("42\n", "oops\n", 4, False)
            assert r["stdout"] == "42\n" and r.get("signal") is None  # 0.1's dict access
            assert sb.exec("cat", stdin=b"\x00\xff").stdout_b64 is not None
            chunks = list(sb.exec_stream("printf a; printf b >&2"))
            assert b"".join(c.payload for c in chunks if c.type == "stdout") == b"a"
            assert chunks[-1].type == "exit" and chunks[-1].exit_code == 0
            sb.files.make_dir("/root/d/e")
            assert sb.files.write("/root/d/e/f.txt", "héllo").size == 6
            assert sb.files.read("/root/d/e/f.txt") == "héllo".encode()
            assert sb.files.stat("/root/d/e/f.txt").type == "file"
            assert [e.name for e in sb.files.list("/root/d/e")] == ["f.txt"]
            sb.files.remove("/root/d", recursive=True)
            with pytest.raises(NotFound):
                sb.files.read("/root/d/e/f.txt")
            before = sb.info.expires_at
            assert sb.set_timeout(3600).expires_at > (before or 0)
            snap = sb.snapshot()
            assert snap.sandbox_id == sb.id and snap.size_bytes > 0
            assert snap.id in [s.id for s in h.list_snapshots(sb.id)]
            sb.exec("echo after > /root/mark")
            assert sb.restore(snap.id).state == "running"
            assert sb.exec("cat /root/mark").exit_code != 0
            with sb.fork(snap.id, timeout=300) as twin:
                assert twin.id != sb.id and twin.exec("hostname").exit_code == 0
                twin_id = twin.id
            with pytest.raises(NotFound):
                h.get(twin_id)
            h.delete_snapshot(snap.id)
            with pytest.raises(NotFound):
                h.get_snapshot(snap.id)
            again = Sandbox.connect(sb.id, client=h)
            with again:
                assert again.refresh().id == sb.id
            assert h.get(sb.id).state == "running"  # connect() leaves it running
            sid = sb.id
        with pytest.raises(NotFound):
            h.get(sid)  # create() kills it at the end of the block
        assert vmm_pids(sid) == [] and vmm_pids(twin_id) == []


@pytest.mark.vm
def test_async_sandbox_and_events(server: Server) -> None:
    async def main() -> None:
        async with AsyncHangar(server.url, server.key) as h:
            sb = await AsyncSandbox.create(client=h)
            async with sb:
                events = h.events(sandbox_id=sb.id, kinds=["exec.finished"])
                first = asyncio.ensure_future(events.__anext__())
                await asyncio.sleep(0.5)
                r = await sb.exec("exit 5", show_command=True)
                assert r.exit_code == 5
                ev = await asyncio.wait_for(first, 10)
                assert ev.kind == "exec.finished" and ev.sandbox_id == sb.id
                assert ev.data["exit_code"] == 5 and ev.data["duration_s"] >= 0
                await events.aclose()
                out = [c async for c in sb.exec_stream("echo hi")]
                assert out[0].payload == b"hi\n" and out[-1].type == "exit"
                await sb.files.write("x", b"1")
                assert await sb.files.read("/root/x") == b"1"
                sid = sb.id
            with pytest.raises(NotFound):
                await h.get(sid)

    asyncio.run(main())


@pytest.mark.vm
def test_machine_objects(server: Server) -> None:
    with Hangar(server.url, server.key) as h:
        m = Machine.get_or_create("sdk-user", idle_timeout=600, client=h)
        try:
            assert m.info.state == "active" and m.sandbox_id.startswith("sb-")
            assert Machine.get_or_create("sdk-user", client=h).sandbox_id == m.sandbox_id
            m.files.write("/root/kept", "yes")
            for _ in range(50):
                try:
                    assert m.sleep().state == "sleeping"
                    break
                except Busy:
                    pass
            assert h.get_machine("sdk-user").state == "sleeping"
            assert m.exec("cat /root/kept").stdout == "yes"  # wakes it
            assert m.refresh().state == "active"
            assert m.sleep().state == "sleeping" and m.wake().state == "active"
            assert "sdk-user" in [x.user_id for x in h.list_machines()]
        finally:
            m.delete()
        with pytest.raises(NotFound):
            h.get_machine("sdk-user")
