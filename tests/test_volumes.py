"""Named volumes on real VMs: one writer at a time, read-only for many, data that outlives
its sandbox and the server, files read on the host without a sandbox (docs/volumes.md).

One server of the module's own (a restart is part of the story); four cold boots in all:
a writer, a second writer after it, and two readers at once.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from conftest import SRC, Server, own_server


CAP_MIB = 2048
"""HANGAR_VOLUMES_MAX_TOTAL_MIB of this module's server."""


@pytest.fixture(scope="module")
def srv(base_image: Path) -> Iterator[Server]:
    with own_server(base_image, {"HANGAR_VOLUMES_MAX_TOTAL_MIB": str(CAP_MIB)}) as s:
        yield s


@pytest.fixture(scope="module")
def api(srv: Server) -> Iterator[httpx.Client]:
    with srv.client() as c:
        yield c


def run(api: httpx.Client, sid: str, command: str) -> str:
    r = api.post(f"/sandboxes/{sid}/exec", json={"command": command})
    assert r.status_code == 200, r.text
    assert r.json()["exit_code"] == 0, r.json()
    return r.json()["stdout"]


def backup(srv: Server, dest: Path) -> subprocess.CompletedProcess[str]:
    """``hangar backup DEST`` of the server's data directory (it works while the server runs)."""
    out = subprocess.run([sys.executable, "-m", "hangar.cli", "backup", str(dest), "--data-dir",
                          str(srv.data_dir)], env={**os.environ, "PYTHONPATH": str(SRC)},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out


def create(api: httpx.Client, volumes: dict) -> str:
    r = api.post("/sandboxes", json={"volumes": volumes})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def test_bad_input_is_a_clear_4xx(api: httpx.Client) -> None:
    r = api.post("/volumes", json={"name": "tiny", "size_mib": 1})
    assert r.status_code == 422, r.text
    r = api.post("/volumes", json={"name": "Bad Name", "size_mib": 64})
    assert r.status_code == 422, r.text
    r = api.post("/volumes", json={"name": "vol-0123456789ab", "size_mib": 64})
    assert r.status_code == 400 and "shaped like an id" in r.json()["error"]["message"]
    r = api.post("/sandboxes", json={"volumes": {"/data": "no-such-volume"}})
    assert r.status_code == 404 and "no-such-volume" in r.json()["error"]["message"]
    for path in ("data", "/data/../etc", "/proc/x", "/", "/etc"):
        r = api.post("/sandboxes", json={"volumes": {path: "whatever"}})
        assert r.status_code == 400, (path, r.text)
    r = api.post("/sandboxes", json={"volumes": {f"/d{i}": "v" for i in range(5)}})
    assert r.status_code == 422, r.text
    assert api.get("/volumes/vol-000000000000").status_code == 404
    r = api.get("/volumes/nope/files", params={"path": "/"})
    assert r.status_code == 404
    assert api.get("/sandboxes").json()["sandboxes"] == []


def test_make_list_grow_and_read_without_a_sandbox(api: httpx.Client, srv: Server) -> None:
    r = api.post("/volumes", json={"name": "scratch", "size_mib": 64})
    assert r.status_code == 201, r.text
    vol = r.json()
    assert vol["id"].startswith("vol-") and vol["size_mib"] == 64 and vol["attached"] == []
    assert api.post("/volumes", json={"name": "scratch", "size_mib": 64}).status_code == 409
    image = srv.data_dir / "volumes" / vol["id"] / "volume.ext4"
    assert os.stat(image).st_blocks * 512 < 16 << 20  # sparse
    assert [v["id"] for v in api.get("/volumes").json()["volumes"]] == [vol["id"]]
    assert api.get("/volumes/scratch").json()["id"] == vol["id"]
    r = api.patch(f"/volumes/{vol['id']}", json={"size_mib": 32})
    assert r.status_code == 400 and "only grow" in r.json()["error"]["message"]
    r = api.patch(f"/volumes/{vol['id']}", json={"size_mib": 128})
    assert r.status_code == 200 and r.json()["size_mib"] == 128
    assert os.stat(image).st_size == 128 << 20
    # All volumes together stay within the server's cap, made or grown.
    r = api.post("/volumes", json={"name": "huge", "size_mib": CAP_MIB - 100})
    assert r.status_code == 409, r.text
    assert "HANGAR_VOLUMES_MAX_TOTAL_MIB" in r.json()["error"]["message"]
    r = api.patch(f"/volumes/{vol['id']}", json={"size_mib": CAP_MIB + 1})
    assert r.status_code == 409 and "cap of 2048 MiB" in r.json()["error"]["message"], r.text
    listing = api.get(f"/volumes/{vol['id']}/files", params={"path": "/"}).json()
    assert [e["name"] for e in listing["entries"]] == ["lost+found"]
    backup(srv, srv.data_dir / "b1.db")
    copy = srv.data_dir / "b1.volumes" / f"{vol['id']}.ext4"
    assert copy.stat().st_size == 128 << 20 and copy.stat().st_mode & 0o777 == 0o600
    r = api.get(f"/volumes/{vol['id']}/files", params={"path": "/../x\"y"})
    assert r.status_code == 400
    assert api.delete(f"/volumes/{vol['id']}").status_code == 204
    assert api.get(f"/volumes/{vol['id']}").status_code == 404
    assert not image.parent.exists()


def test_one_writer_then_another_then_readers_and_a_restart(api: httpx.Client,
                                                            srv: Server) -> None:
    vol = api.post("/volumes", json={"name": "shared", "size_mib": 64}).json()
    vid = vol["id"]
    first = create(api, {"/data": vid})
    got = api.get(f"/sandboxes/{first}").json()
    assert got["volumes"] == {"/data": {"volume": vid, "read_only": False}}
    assert got["source"] == "cold"
    run(api, first, "mkdir -p /data/notes && echo written-by-first > /data/notes/a.txt")
    # a second writer, or a reader, while the first writes: 409, and nothing is made
    for spec in ("shared", {"volume": "shared", "read_only": True}):
        r = api.post("/sandboxes", json={"volumes": {"/data": spec}})
        assert r.status_code == 409, r.text
        assert first in r.json()["error"]["message"]
    assert api.delete(f"/volumes/{vid}").status_code == 409
    assert api.patch(f"/volumes/{vid}", json={"size_mib": 128}).status_code == 409
    assert api.post(f"/sandboxes/{first}/snapshot").status_code == 409
    out = backup(srv, srv.data_dir / "b2.db")  # a volume being written is not copied
    assert f"volume {vid} not backed up: a sandbox holds it read-write" in out.stderr
    assert not (srv.data_dir / "b2.volumes" / f"{vid}.ext4").exists()
    assert api.get(f"/volumes/{vid}").json()["attached"] == [
        {"sandbox_id": first, "path": "/data", "read_only": False}]
    assert api.delete(f"/sandboxes/{first}").status_code == 204

    # the data outlives its sandbox: on the host (no sandbox) and in a second writer
    r = api.get(f"/volumes/{vid}/files", params={"path": "/notes/a.txt"})
    assert r.status_code == 200 and r.content == b"written-by-first\n"
    listing = api.get(f"/volumes/{vid}/files", params={"path": "/notes"}).json()
    assert [(e["name"], e["type"], e["size"]) for e in listing["entries"]] == [
        ("a.txt", "file", 17)]
    second = create(api, {"/mnt/v": "shared"})
    assert run(api, second, "cat /mnt/v/notes/a.txt") == "written-by-first\n"
    run(api, second, "echo second >> /mnt/v/notes/a.txt")

    # the server restarts while the second writes: its VM is adopted and keeps the volume;
    # deleted then (no call since the restart), its guest still unmounts it first
    srv.kill()
    srv.start()
    with srv.client() as c:
        assert c.get(f"/volumes/{vid}").json()["attached"] == [
            {"sandbox_id": second, "path": "/mnt/v", "read_only": False}]
        assert c.post("/sandboxes", json={"volumes": {"/data": vid}}).status_code == 409
        assert c.delete(f"/sandboxes/{second}").status_code == 204
        assert c.get(f"/volumes/{vid}").json()["attached"] == []
        r = c.get(f"/volumes/{vid}/files", params={"path": "/notes/a.txt"})
        assert r.content == b"written-by-first\nsecond\n"

        # read-only for many at once; a writer meanwhile is refused
        ro = {"/data": {"volume": vid, "read_only": True}}
        readers = [create(c, ro), create(c, ro)]
        for sid in readers:
            assert run(c, sid, "cat /data/notes/a.txt") == "written-by-first\nsecond\n"
            r = c.post(f"/sandboxes/{sid}/exec", json={"command": "touch /data/x"})
            assert r.json()["exit_code"] != 0
        assert c.post("/sandboxes", json={"volumes": {"/data": vid}}).status_code == 409
        assert len(c.get(f"/volumes/{vid}").json()["attached"]) == 2
        for sid in readers:
            assert c.delete(f"/sandboxes/{sid}").status_code == 204
        assert c.delete(f"/volumes/{vid}").status_code == 204


def test_e2b_sdk_volumes_map_onto_hangars(api: httpx.Client, srv: Server) -> None:
    """E2B's unmodified SDK: Volume.create/list/get_info/destroy and a sandbox's
    volume_mounts, on Hangar's volumes."""
    e2b = pytest.importorskip("e2b")
    opts = {"api_key": srv.key, "api_url": srv.url + "/e2b"}  # any key of the server
    saved = {k: os.environ.get(k) for k in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_DOMAIN")}
    os.environ.update({"E2B_API_URL": srv.url + "/e2b",
                       "E2B_SANDBOX_URL": srv.url + "/e2b/envd"})
    os.environ.pop("E2B_DOMAIN", None)
    try:
        vol = e2b.Volume.create("E2B_vol", **opts)
        assert vol.volume_id.startswith("vol-") and vol.name == "E2B_vol"
        assert [v.volume_id for v in e2b.Volume.list(**opts)
                if v.name == "E2B_vol"] == [vol.volume_id]
        assert api.get(f"/volumes/{vol.volume_id}").json()["size_mib"] == 1024
        sb = e2b.Sandbox.create(volume_mounts={"/mnt/e2b": vol}, api_key=opts["api_key"])
        try:
            sb.commands.run("echo via-e2b > /mnt/e2b/f.txt")
        finally:
            sb.kill()
        r = api.get(f"/volumes/{vol.volume_id}/files", params={"path": "/f.txt"})
        assert r.content == b"via-e2b\n"
        assert e2b.Volume.destroy(vol.volume_id, **opts) is True
        assert api.get(f"/volumes/{vol.volume_id}").status_code == 404
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_a_broken_image_is_a_clear_409_and_its_tools_run_confined(api: httpx.Client,
                                                                  srv: Server) -> None:
    """What a guest wrote is hostile: a volume whose filesystem is garbage is a 409
    ``volume_corrupt`` from the files route (debugfs, under bwrap, never a host mount) and
    from a grow, naming the repair, not a 500."""
    from hangar.images import volfs

    vid = api.post("/volumes", json={"name": "broken", "size_mib": 16}).json()["id"]
    image = srv.data_dir / "volumes" / vid / "volume.ext4"
    with open(image, "r+b") as f:
        f.write(os.urandom(1 << 16))
    r = api.get(f"/volumes/{vid}/files", params={"path": "/"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "volume_corrupt", r.text
    assert "cannot be read" in r.json()["error"]["message"], r.text
    r = api.patch(f"/volumes/{vid}", json={"size_mib": 32})
    assert r.status_code == 409 and r.json()["error"]["code"] == "volume_corrupt", r.text
    assert "hangar volume fsck broken" in r.json()["error"]["message"], r.text
    assert api.delete(f"/volumes/{vid}").status_code == 204
    argv, inside = volfs.confined_argv(image, ["debugfs", "-R", "ls", volfs.IMAGE_IN_VIEW])
    assert argv[0].endswith("bwrap") and "--unshare-all" in argv and inside == "/volume.ext4"
    assert argv[argv.index(str(image)) - 1] == "--ro-bind"


def test_a_volume_its_guest_scribbled_over_is_a_409_until_fsck_repairs_it(
        api: httpx.Client, srv: Server) -> None:
    """Class 9 (security round 3): a guest writes zeros over its volume's superblock. The
    next create that attaches it answers 409 ``volume_corrupt`` naming the volume and the
    repair (never a 5xx a client would retry), and so does the host-side file reader;
    ``hangar volume fsck NAME`` repairs it from a backup superblock (then the SDK's
    ``fsck_volume`` finds it sound), and the file the first guest wrote is there again."""
    from hangar.client import Hangar
    from hangar.errors import VolumeCorrupt

    vid = api.post("/volumes", json={"name": "scribbled", "size_mib": 64}).json()["id"]
    sid = create(api, {"/data": "scribbled"})
    run(api, sid, "echo kept > /data/kept && sync")
    run(api, sid, "dev=$(awk '$2==\"/data\"{print $1}' /proc/mounts) && umount /data && "
                  "dd if=/dev/zero of=$dev bs=1024 seek=1 count=1 conv=notrunc,fsync "
                  "status=none")
    assert api.delete(f"/sandboxes/{sid}").status_code == 204
    r = api.post("/sandboxes", json={"volumes": {"/data": "scribbled"}})
    assert r.status_code == 409, r.text
    err = r.json()["error"]
    assert err["code"] == "volume_corrupt", err
    assert "scribbled" in err["message"] and "hangar volume fsck scribbled" in err["message"]
    assert f"POST /volumes/{vid}/fsck" in err["message"], err
    assert api.get(f"/volumes/{vid}").json()["attached"] == []
    r = api.get(f"/volumes/{vid}/files", params={"path": "/"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "volume_corrupt", r.text
    with Hangar(srv.url, srv.key) as h:
        with pytest.raises(VolumeCorrupt):
            h.volume_files("scribbled", "/")
    out = subprocess.run([sys.executable, "-m", "hangar.cli", "volume", "fsck", "scribbled"],
                         env={**os.environ, "PYTHONPATH": str(SRC), "HANGAR_URL": srv.url,
                              "HANGAR_API_KEY": srv.key},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert f"{vid} (scribbled): repaired" in " ".join(out.stdout.split()), out.stdout
    with Hangar(srv.url, srv.key) as h:
        again = h.fsck_volume("scribbled")
        assert (again.exit_code, again.repaired) == (0, False), again
        assert [e.name for e in h.volume_files("scribbled", "/") if e.name == "kept"]
        assert h.volume_read("scribbled", "/kept") == b"kept\n"
    sid = create(api, {"/data": "scribbled"})
    assert run(api, sid, "cat /data/kept") == "kept\n"
    r = api.post(f"/volumes/{vid}/fsck")
    assert r.status_code == 409 and sid in r.json()["error"]["message"], r.text
    assert api.delete(f"/sandboxes/{sid}").status_code == 204
    assert api.delete(f"/volumes/{vid}").status_code == 204
