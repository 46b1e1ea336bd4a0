"""Files in a real microVM: binary-safe, atomic, and never through a shell."""

from __future__ import annotations

import os

import httpx
import pytest

pytestmark = pytest.mark.vm


def put(api: httpx.Client, sid: str, path: str, data: bytes) -> httpx.Response:
    return api.put(f"/sandboxes/{sid}/files", params={"path": path}, content=data)


def get(api: httpx.Client, sid: str, path: str) -> httpx.Response:
    return api.get(f"/sandboxes/{sid}/files", params={"path": path})


def test_all_byte_values_round_trip(api: httpx.Client, sandbox: str) -> None:
    data = bytes(range(256)) * 4
    r = put(api, sandbox, "/root/bytes.bin", data)
    assert r.status_code == 200 and r.json()["size"] == len(data)
    assert get(api, sandbox, "/root/bytes.bin").content == data
    r = api.post(f"/sandboxes/{sandbox}/exec", json={"command": "sha256sum /root/bytes.bin"})
    import hashlib

    assert r.json()["stdout"].split()[0] == hashlib.sha256(data).hexdigest()


def test_shell_looking_text_runs_nothing(api: httpx.Client, sandbox: str) -> None:
    text = ("line one\nEOF\n$(touch /tmp/pwned)\n`touch /tmp/pwned2`\n"
            "'single' \"double\" \\back\n<<EOF\n${HOME}\n").encode()
    assert put(api, sandbox, "/root/tricky.txt", text).status_code == 200
    assert get(api, sandbox, "/root/tricky.txt").content == text
    r = api.post(f"/sandboxes/{sandbox}/exec",
                 json={"command": "ls /tmp/pwned /tmp/pwned2 2>&1; true"})
    assert "No such file" in r.json()["stdout"]


def test_large_file_and_empty_file(api: httpx.Client, sandbox: str) -> None:
    data = os.urandom(8 * 1024 * 1024 + 17)
    assert put(api, sandbox, "big.bin", data).json()["size"] == len(data)
    assert get(api, sandbox, "/root/big.bin").content == data
    assert put(api, sandbox, "/root/empty", b"").json()["size"] == 0
    r = get(api, sandbox, "/root/empty")
    assert r.status_code == 200 and r.content == b""


def test_overwrite_is_atomic_and_parents_are_made(api: httpx.Client, sandbox: str) -> None:
    assert put(api, sandbox, "/root/a/b/c.txt", b"first").status_code == 200
    assert put(api, sandbox, "/root/a/b/c.txt", b"second").status_code == 200
    assert get(api, sandbox, "/root/a/b/c.txt").content == b"second"
    names = [e["name"] for e in api.get(f"/sandboxes/{sandbox}/files/list",
                                        params={"path": "/root/a/b"}).json()["entries"]]
    assert names == ["c.txt"], "no temporary files are left behind"


def test_list_stat_mkdir_remove(api: httpx.Client, sandbox: str) -> None:
    r = api.post(f"/sandboxes/{sandbox}/files/mkdir", json={"path": "/root/d1/d2"})
    assert r.status_code == 201 and r.json()["type"] == "dir"
    put(api, sandbox, "/root/d1/f.txt", b"12345")
    st = api.get(f"/sandboxes/{sandbox}/files/stat", params={"path": "/root/d1/f.txt"}).json()
    assert st["size"] == 5 and st["type"] == "file"
    entries = api.get(f"/sandboxes/{sandbox}/files/list", params={"path": "/root/d1"}).json()
    assert {(e["name"], e["type"]) for e in entries["entries"]} == {("d2", "dir"), ("f.txt", "file")}
    r = api.delete(f"/sandboxes/{sandbox}/files", params={"path": "/root/d1"})
    assert r.status_code == 409, "a non-empty directory needs recursive=true"
    r = api.delete(f"/sandboxes/{sandbox}/files", params={"path": "/root/d1", "recursive": True})
    assert r.status_code == 204
    assert get(api, sandbox, "/root/d1/f.txt").status_code == 404


def test_file_errors_are_clear(api: httpx.Client, sandbox: str) -> None:
    r = get(api, sandbox, "/root/does-not-exist")
    assert r.status_code == 404 and "does-not-exist" in r.json()["error"]["message"]
    r = get(api, sandbox, "/root")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
    r = put(api, sandbox, "/root", b"x")
    assert r.status_code == 400
    r = api.get(f"/sandboxes/{sandbox}/files")
    assert r.status_code == 422
    r = get(api, "sb-000000000000", "/root/x")
    assert r.status_code == 404


def test_relative_paths_start_at_the_guest_home_where_commands_run(
        api: httpx.Client, sandbox: str) -> None:
    """One base for relative paths: the guest's home, /root, which is also where a command
    without cwd runs (as in E2B, whose relative paths and commands start at its home)."""
    r = put(api, sandbox, "rel/notes.txt", b"relative")
    assert r.status_code == 200 and r.json()["path"] == "/root/rel/notes.txt"
    r = api.post(f"/sandboxes/{sandbox}/exec", json={"command": "pwd; cat rel/notes.txt"})
    assert r.json()["stdout"] == "/root\nrelative"
    assert get(api, sandbox, "/root/rel/notes.txt").content == b"relative"
    st = api.get(f"/sandboxes/{sandbox}/files/stat", params={"path": "rel/notes.txt"}).json()
    assert st["path"] == "/root/rel/notes.txt" and st["size"] == 8
    home = api.get(f"/sandboxes/{sandbox}/files/list").json()  # no path: the home
    assert home["path"] == "/root" and "rel" in {e["name"] for e in home["entries"]}
    listed = api.get(f"/sandboxes/{sandbox}/files/list", params={"path": "rel"}).json()
    assert listed["path"] == "/root/rel" and [e["path"] for e in listed["entries"]] == [
        "/root/rel/notes.txt"]
    r = api.post(f"/sandboxes/{sandbox}/files/mkdir", json={"path": "rel/sub"})
    assert r.status_code == 201 and r.json()["path"] == "/root/rel/sub"
    r = api.delete(f"/sandboxes/{sandbox}/files", params={"path": "rel", "recursive": True})
    assert r.status_code == 204
    assert api.get(f"/sandboxes/{sandbox}/files/stat",
                   params={"path": "/root/rel"}).status_code == 404


def test_the_spec_says_where_relative_paths_start(api: httpx.Client) -> None:
    spec = api.get("/openapi.json").json()
    listing = spec["paths"]["/sandboxes/{sandbox_id}/files/list"]["get"]
    path = next(p for p in listing["parameters"] if p["name"] == "path")
    assert path["schema"]["default"] == "/root"
    assert "relative to its home /root" in path["description"]
