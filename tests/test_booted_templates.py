"""Booted templates: every create restores its image's template snapshot (real VMs).

One template of this run's own (``bt-<pid>``, on ``base``) whose start command
takes 20 s; its builds go into the shared image cache and are removed when the
module ends. One server of this module's own (no pool, no guest NICs: the
NIC's renumbering is covered by test_network.py's restores).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import SHARED, SRC, Server, boot_cold, cleanup, free_port, make_data_dir, vmm_pids

from hangar.images import resolve_image
from hangar.images.template_builder import build_template, remove_template
from hangar.images.template_file import load_template
from hangar.layout import ImagePaths, Layout

NAME = f"bt-{os.getpid()}"
SLOW = """
name = "{name}"
base = "base"
env = {{ VERSION = "{version}" }}
start = "sleep 20 && python3 -m http.server 8000"
workdir = "/srv"
steps = ["echo {version} > /srv/version"]

[ready]
port = 8000
timeout = 300
"""
BROKEN = """
name = "{name}-broken"
base = "{name}"
start = "echo broken starting; exit 1"

[ready]
port = 9
timeout = 600
"""

pytestmark = pytest.mark.vm


def build(text: str, tmp: Path) -> Any:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "t.toml").write_text(text)
    return build_template(Layout(SHARED), load_template(tmp / "t.toml"))


def sh(c: httpx.Client, sid: str, command: str) -> str:
    r = c.post(f"/sandboxes/{sid}/exec", json={"command": command, "timeout": 60})
    assert r.status_code == 200, r.text
    assert r.json()["exit_code"] == 0, r.json()
    return r.json()["stdout"]


def create(c: httpx.Client, **body: Any) -> tuple[dict[str, Any], float]:
    t0 = time.monotonic()
    r = c.post("/sandboxes", json={"image": NAME, **body})
    took = time.monotonic() - t0
    assert r.status_code == 201, r.text
    return r.json(), took


@pytest.fixture(scope="module")
def template(base_image: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Built with the CLI, which ends by making its template snapshot (in the shape this
    module's server uses: its settings come from the same environment)."""
    tmp = tmp_path_factory.mktemp("booted")
    (tmp / "t.toml").write_text(SLOW.format(name=NAME, version="one"))
    try:
        env = {**os.environ, "HANGAR_DATA_DIR": str(SHARED), "PYTHONPATH": str(SRC),
               "HANGAR_NETWORK": "off", "COLUMNS": "200"}
        done = subprocess.run([sys.executable, "-m", "hangar.cli", "template", "build", "-f",
                               str(tmp / "t.toml")], env=env, capture_output=True, text=True,
                              timeout=1800)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "template snapshot" in done.stderr
        yield resolve_image(Layout(SHARED), NAME)
    finally:
        for name in (f"{NAME}-broken", NAME):
            try:
                remove_template(Layout(SHARED), name, set())
            except Exception:
                pass
            for d in (SHARED / "images").glob(f"{name}-*"):
                if d.is_dir() and not d.is_symlink():
                    shutil.rmtree(d, ignore_errors=True)
            Layout(SHARED).image_lock(name).unlink(missing_ok=True)  # this run's name alone


@pytest.fixture(scope="module")
def server(template: Any) -> Iterator[Server]:
    d = make_data_dir(template.dir)
    srv = Server(d, free_port())
    try:
        srv.start()
        yield srv
    finally:
        leaked = cleanup(srv)
        shutil.copy(srv.log, Path("/tmp") / f"{NAME}-server.log")  # for a failure's story
        shutil.rmtree(d, ignore_errors=True)
        assert not leaked, f"VMM processes outlived the module: {leaked}"


def test_a_slow_service_is_started_once_and_creates_restore_it(server: Server,
                                                                template: Any) -> None:
    """The build made the snapshot (boot, the 20 s start, the ready check); every create
    is a restore whose service answers at once."""
    snaps = [p for p in ImagePaths(template.dir).template_snapshots.iterdir() if p.is_dir()]
    assert len(snaps) == 1
    manifest = json.loads((snaps[0] / "snapshot.json").read_text())
    assert manifest["template"] is True and manifest["image_digest"] == template.digest
    with server.client() as c:
        first, _ = create(c)
        assert first["source"] == "template"
        sb, took = create(c)
        assert sb["source"] == "template"
        # A cold create could not answer before the start command's 20 s sleep ended.
        assert took < 20, f"a create from the template took {took:.1f} s"
        # The service answers at once: one connection, no retry (a refused one fails).
        out = sh(c, sb["id"], "python3 -c \"import urllib.request as u; "
                              "print(u.urlopen('http://127.0.0.1:8000/version').read().decode())\"")
        assert out.strip() == "one"
        assert c.get(f"/sandboxes/{sb['id']}").json()["source"] == "template"
        for s in (first, sb):
            c.delete(f"/sandboxes/{s['id']}")


PROBE = ("python3 -c \"import uuid; print(uuid.uuid4())\"; head -c 16 /dev/urandom | od -An -tx1 "
         "| tr -d ' \\n'; echo; hostname; cat /etc/machine-id; cat /run/hangar/fork-generation")


def test_two_sandboxes_of_one_template_are_two_machines(server: Server) -> None:
    with server.client() as c:
        a, _ = create(c)
        b, _ = create(c)
        outs = [sh(c, s["id"], PROBE).split("\n") for s in (a, b)]
        for field in range(5):
            assert outs[0][field] != outs[1][field], (field, outs)
        assert outs[0][2] == a["id"] and outs[1][2] == b["id"]
        for s in (a, b):
            c.delete(f"/sandboxes/{s['id']}")


def test_a_size_the_snapshot_was_not_made_with_boots_cold(server: Server) -> None:
    with server.client() as c:
        sb, _ = create(c, memory_mib=384)
        assert sb["source"] == "cold"
        # a cold boot of a template runs its start command: the service answers too
        assert "one" in sh(c, sb["id"], "cat /srv/version")
        c.delete(f"/sandboxes/{sb['id']}")


def test_a_storm_of_creates_all_restore(server: Server) -> None:
    async def storm() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, headers={"X-API-Key": server.key},
                                     timeout=600) as ac:
            return await asyncio.gather(*(ac.post("/sandboxes", json={"image": NAME})
                                          for _ in range(10)))

    answers = asyncio.run(storm())
    with server.client() as c:
        for r in answers:
            if r.status_code == 201:
                c.delete(f"/sandboxes/{r.json()['id']}")
    assert [r.status_code for r in answers] == [201] * 10, [r.text for r in answers]
    assert {r.json()["source"] for r in answers} == {"template"}


def test_a_server_killed_mid_restore_leaves_nothing(server: Server) -> None:
    server.kill(signal.SIGKILL)
    server.env["HANGAR_TEST_CRASH_AT"] = "create.restoring"
    server.start()
    with server.client() as c:
        with pytest.raises(httpx.TransportError):
            c.post("/sandboxes", json={"image": NAME})
    server.proc.wait(30)  # type: ignore[union-attr]
    server.env.pop("HANGAR_TEST_CRASH_AT")
    server.start()
    with server.client() as c:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            left = [s for s in c.get("/sandboxes").json()["sandboxes"]]
            if not left and not vmm_pids(str(server.data_dir)):
                break
            time.sleep(0.5)
        assert left == [] and vmm_pids(str(server.data_dir)) == []
        assert "unfinished create removed" in server.log.read_text()
        sb, _ = create(c)  # and the template still restores
        assert sb["source"] == "template"
        c.delete(f"/sandboxes/{sb['id']}")


def test_a_rebuilt_template_makes_new_sandboxes_and_old_ones_run_on(
        server: Server, template: Any, tmp_path: Path) -> None:
    with server.client() as c:
        old, _ = create(c)
        sh(c, old["id"], "echo kept > /root/mark")
        r = c.post(f"/sandboxes/{old['id']}/snapshot")
        assert r.status_code == 201, r.text
        snap = r.json()["id"]
        new_build = build(SLOW.format(name=NAME, version="two"), tmp_path)
        server.refresh_images()
        assert new_build.digest != template.digest
        new, _ = create(c)
        assert new["source"] == "template" and new["image_id"] == new_build.id
        assert sh(c, new["id"], "cat /srv/version").strip() == "two"
        # the old build's sandbox and snapshot keep working
        assert sh(c, old["id"], "cat /srv/version; cat /root/mark").split() == ["one", "kept"]
        r = c.post(f"/snapshots/{snap}/sandboxes", json={})
        assert r.status_code == 201, r.text
        fork = r.json()["id"]
        assert sh(c, fork, "cat /srv/version; cat /root/mark").split() == ["one", "kept"]
        for sid in (old["id"], new["id"], fork):
            c.delete(f"/sandboxes/{sid}")
        c.delete(f"/snapshots/{snap}")


def test_a_start_command_that_exits_fails_at_once_with_its_log(server: Server,
                                                               tmp_path: Path) -> None:
    """Its ready timeout is 600 s; the create fails as soon as the command has exited,
    with a 502 the SDK does not retry."""
    build(BROKEN.format(name=NAME), tmp_path)
    server.refresh_images()
    with server.client() as c:
        before = len(vmm_pids(str(server.data_dir)))
        t0 = time.monotonic()
        r = c.post("/sandboxes", json={"image": f"{NAME}-broken"})
        took = time.monotonic() - t0
        assert r.status_code == 502, r.text
        err = r.json()["error"]
        assert err["code"] == "guest_error"
        assert "start command exited with status 1" in err["message"]
        assert "broken starting" in err["message"]
        assert took < 300
        assert c.get("/sandboxes").json()["sandboxes"] == []
        deadline = time.monotonic() + 30
        while len(vmm_pids(str(server.data_dir))) > before and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(vmm_pids(str(server.data_dir))) <= before


# -- clones with NICs, on test_network.py's namespaces (engine level, as there) ------------

from test_network import Guests, guests, manager, needs_netns, topology  # noqa: E402,F401


@needs_netns
def test_clones_of_one_template_get_their_own_mac_and_address_and_reach_the_network(
        guests: Guests, tmp_path: Path) -> None:
    """QEMU's saved virtio-net state holds the template's MAC: each clone is given its own
    MAC and address from inside (``Launcher.restore_template``'s ``renet_meta``)."""
    from hangar.core.launch import renet_meta
    from hangar.engines.base import VMSpec
    from hangar.engines.snapshot_io import refresh_guest

    async def go() -> list[dict[str, str]]:
        g = guests
        net = await g.manager.attach_async("tpl-net", "internet")
        g.nets["tpl-net"] = net
        spec = VMSpec("tpl-net", g.image, g.layout.sandbox("tpl-net"), memory_mib=256, net=net,
                      template_source=True)
        vm, agent = await boot_cold(g.engine, spec, 120)
        g.vms["tpl-net"] = vm
        await agent.exec({"op": "exec", "shell": "true", "timeout": 30})
        dest = tmp_path / "tpl"
        await g.engine.snapshot(vm, dest, template=True)
        await agent.close()
        await g.engine.stop(vm)
        g.vms.pop("tpl-net")
        out = []
        for sid in ("sb-clone-a", "sb-clone-b"):
            n = await g.manager.attach_async(sid, "internet")
            g.nets[sid] = n
            clone = await g.engine.restore(VMSpec(sid, g.image, g.layout.sandbox(sid),
                                                  memory_mib=256, net=n), dest)
            g.vms[sid] = clone
            g.agents[sid] = a = await g.engine.connect_agent(clone, 120)
            await refresh_guest(a)
            r = await a.exec(renet_meta(n))
            assert r.exit_code == 0, r.stderr.head
            code, text = await g.sh(sid, "d=$(ls /sys/class/net | grep -v '^lo$' | head -n1); "
                                         "cat /sys/class/net/$d/address; "
                                         "ip -4 -o addr show dev $d | awk '{print $4}'")
            assert code == 0, text
            mac, addr = text.split()[:2]
            probe = await g.probe(sid, "203.0.113.1:80")
            out.append({"mac": mac, "addr": addr.split("/")[0], "want_mac": n.mac,
                        "want_addr": n.ip, "body": probe["body"]})
        g.engine.release_snapshot(dest)
        return out

    a, b = asyncio.run(go())
    for c in (a, b):
        assert c["mac"] == c["want_mac"] and c["addr"] == c["want_addr"], c
        assert c["body"] == "hello from the stand-in internet\n", c
    assert a["mac"] != b["mac"] and a["addr"] != b["addr"]
