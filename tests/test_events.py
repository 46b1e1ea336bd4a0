"""Live events from a real server on a real VM: what is published, and what never is.

The app runs in this process (its lifespan entered here, requests through
httpx's ASGI transport), so the test reads the server's event bus
(``app.state.events``) directly; the sandbox is a real QEMU VM.
"""

from __future__ import annotations

import asyncio
import json
import shutil

import httpx
import pytest

from conftest import make_data_dir, vmm_pids
from hangar.server import create_app
from hangar.config import Settings

pytestmark = pytest.mark.vm


def test_lifecycle_and_exec_events(base_image) -> None:
    d = make_data_dir(base_image)
    app = create_app(Settings(data_dir=d, pool_size=0, network="off"))

    async def session() -> tuple[str, dict, list[dict]]:
        async with app.router.lifespan_context(app):
            h = {"X-API-Key": (d / "api-key").read_text().strip()}
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), headers=h,
                                         base_url="http://hangar", timeout=300) as tc:
                r = await tc.post("/sandboxes", json={"memory_mib": 256})
                assert r.status_code == 201, r.text
                sid = r.json()["id"]
                try:
                    r = await tc.post(f"/sandboxes/{sid}/exec", json={
                        "command": "echo private-output-$TOKEN", "env": {"TOKEN": "s3cret-value"}})
                    assert r.json()["stdout"] == "private-output-s3cret-value\n"
                    r = await tc.post(f"/sandboxes/{sid}/exec",
                                      json={"command": "echo shown; exit 3", "show_command": True})
                    assert r.json()["exit_code"] == 3
                    r = await tc.post(f"/sandboxes/{sid}/snapshot")
                    assert r.status_code == 201, r.text
                    snap = r.json()
                    assert (await tc.delete(f"/snapshots/{snap['id']}")).status_code == 204
                finally:
                    assert (await tc.delete(f"/sandboxes/{sid}")).status_code == 204
            return sid, snap, [e.as_dict() for e in app.state.events.since(None)]

    try:
        sid, snap, events = asyncio.run(session())
        assert vmm_pids(str(d)) == []
    finally:
        shutil.rmtree(d, ignore_errors=True)

    text = json.dumps(events)
    assert "private-output" not in text and "s3cret" not in text and "TOKEN" not in text
    mine = [e for e in events if e["sandbox_id"] == sid]
    assert [e["kind"] for e in mine] == [
        "sandbox.created", "exec.started", "exec.finished", "exec.started", "exec.finished",
        "snapshot.created", "sandbox.deleted"]
    created, start1, end1, start2, end2, snapped, _ = mine
    assert created["image"] == "base" and created["source"] == "cold"
    assert created["duration_s"] > 0
    assert "command" not in start1, "the command is shown only when asked for"
    assert start2["command"] == "echo shown; exit 3"
    assert start1["exec_id"] == end1["exec_id"] != start2["exec_id"] == end2["exec_id"]
    assert end1["exit_code"] == 0 and end2["exit_code"] == 3
    assert end2["timed_out"] is False and end2["duration_s"] >= 0
    assert snapped["snapshot_id"] == snap["id"] and snapped["size_bytes"] == snap["size_bytes"]
