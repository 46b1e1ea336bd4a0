"""Client mistakes and hostile input: always a 4xx naming the field, never a 5xx.

A server of this module's own runs one sandbox and a cap of one sandbox,
so a hostile create that happens to be valid gets 429 instead of booting
a VM. The sweep walks every route of ``/openapi.json`` with hostile path,
query and body values and checks each answer: below 500, the JSON error
shape, no Python exception name, no host path.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import SRC, Server, cleanup, free_port, make_data_dir

pytestmark = pytest.mark.vm

EXCEPTION_NAME = re.compile(r"\b[A-Z][A-Za-z]*(Error|Exception)\b|Traceback")


@pytest.fixture(scope="module")
def hostile(base_image: Path) -> Iterator[tuple[Server, httpx.Client, str]]:
    d = make_data_dir(base_image)
    srv = Server(d, free_port(), {"HANGAR_MAX_SANDBOXES": "1"})
    try:
        srv.start()
        with srv.client() as c:
            r = c.post("/sandboxes", json={})
            assert r.status_code == 201, r.text
            yield srv, c, r.json()["id"]
    finally:
        leaked = cleanup(srv)
        shutil.rmtree(d, ignore_errors=True)
        assert not leaked, f"VMM processes outlived the module: {leaked}"


def host_paths(server: Server) -> list[str]:
    return [str(server.data_dir), str(SRC), str(Path(sys.executable).parent), "/var/lib/hangar"]


def check_error(r: httpx.Response, server: Server, what: object = None) -> dict[str, Any]:
    """The error object of a 4xx answer; fails on a 5xx, a bad shape or leaked internals."""
    assert r.status_code < 500, (what, r.status_code, r.text[:500])
    assert 400 <= r.status_code, (what, r.status_code, r.text[:300])
    text = r.text
    assert not EXCEPTION_NAME.search(text), (what, text[:500])
    for p in host_paths(server):
        assert p not in text, (what, p, text[:500])
    err = r.json()["error"]
    assert isinstance(err["code"], str) and err["code"], (what, text)
    assert isinstance(err["message"], str) and err["message"], (what, text)
    return err


def exec_both(c: httpx.Client, sid: str, body: dict[str, Any]) -> list[httpx.Response]:
    """The same body sent to /exec and /exec/stream (the stream read whole)."""
    out = [c.post(f"/sandboxes/{sid}/exec", json=body)]
    with c.stream("POST", f"/sandboxes/{sid}/exec/stream", json=body) as r:
        r.read()
    out.append(r)
    return out


def stream_events(r: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line) for line in r.text.splitlines() if line.strip()]


# -- exec: each mistake named ------------------------------------------------------


@pytest.mark.parametrize("body, field", [
    ({"command": "echo $A", "env": {"A": "x\0y"}}, "env"),
    ({"command": "/bin/echo", "args": ["ok", "a\0b"]}, "args[1]"),
    ({"command": "echo a\0b"}, "command"),
    ({"command": "/bin/echo\0", "args": []}, "command"),
    ({"command": "true", "env": {"A=B": "x"}}, "'A=B'"),
    ({"command": "true", "env": {"": "x"}}, "empty variable name"),
    ({"command": "true", "env": {"A\0": "x"}}, "env name"),
    ({"command": "true", "cwd": "/tmp\0/x"}, "cwd"),
    ({"command": "/bin/echo", "args": ["x" * 131072]}, "131071"),
    ({"command": "true", "env": {"BIG": "x" * 131072}}, "131071"),
    ({"command": "/bin/echo", "args": ["x" * 100_000] * 11}, "1048576"),
    ({"command": "x" * 5000, "args": []}, "PATH_MAX"),
])
def test_exec_mistakes_are_4xx_naming_the_field(hostile, body, field) -> None:
    srv, c, sid = hostile
    for r in exec_both(c, sid, body):
        err = check_error(r, srv, body.keys())
        assert r.status_code == 422, r.text[:300]  # the request's schema refuses each
        assert err["code"] == "invalid_request", err
        assert field in err["message"], (field, err["message"])
        assert "\0" not in r.text and "\\u0000" not in err["message"]


def test_missing_program_is_not_an_unknown_sandbox(hostile) -> None:
    srv, c, sid = hostile
    for name, mode in (("plain.txt", "644"), ("garbage.bin", "755")):
        r = c.put(f"/sandboxes/{sid}/files", params={"path": f"/root/{name}", "mode": int(mode, 8)},
                  content=b"\x7fnot a program\n")
        assert r.status_code == 200, r.text
    for program, code, words in [("no-such-program", 127, "command not found"),
                                 ("/no/such/program", 127, "No such file or directory"),
                                 ("/root/plain.txt", 126, "Permission denied"),
                                 ("/root/garbage.bin", 126, "Exec format error"),
                                 ("/etc", 126, "Permission denied")]:
        r, s = exec_both(c, sid, {"command": program, "args": ["x"]})
        assert r.status_code == 200, r.text
        assert r.json()["exit_code"] == code and words in r.json()["stderr"], r.json()
        assert r.json()["stdout"] == ""
        events = stream_events(s)
        assert s.status_code == 200 and events[-1]["type"] == "exit", s.text
        assert events[-1]["exit_code"] == code
        assert words in "".join(e.get("data", "") for e in events if e["type"] == "stderr")
    unknown = c.post("/sandboxes/sb-000000000000/exec", json={"command": "no-such-program",
                                                              "args": []})
    assert unknown.status_code == 404 and check_error(unknown, srv)["code"] == "not_found"
    # The same through a shell keeps the shell's own word for it.
    r = c.post(f"/sandboxes/{sid}/exec", json={"command": "no-such-program"}).json()
    assert r["exit_code"] == 127 and "not found" in r["stderr"]


def test_cwd_that_is_a_file_or_missing(hostile) -> None:
    srv, c, sid = hostile
    for body, words in [({"command": "pwd", "cwd": "/etc/hostname"}, "not a directory"),
                        ({"command": "/bin/pwd", "args": [], "cwd": "/etc/hostname"},
                         "not a directory"),
                        ({"command": "pwd", "cwd": "/no/such/dir"}, "no such directory")]:
        for r in exec_both(c, sid, body):
            err = check_error(r, srv, body)
            assert r.status_code == 400 and words in err["message"], err
            assert err["message"].startswith("cwd "), err


def test_long_scripts_run(hostile) -> None:
    """A shell script far over one argument's 128 KiB limit is delivered through a file."""
    srv, c, sid = hostile
    script = "n=0\n" + "n=$((n+1))\n" * 40_000 + 'echo "count=$n args=$#"; exit 4\n'
    assert len(script) > 400_000
    r = c.post(f"/sandboxes/{sid}/exec", json={"command": script, "timeout": 120})
    assert r.status_code == 200, r.text[:300]
    assert r.json()["stdout"] == "count=40000 args=0\n" and r.json()["exit_code"] == 4, r.json()
    left = c.post(f"/sandboxes/{sid}/exec", json={"command": "ls /run/hangar"}).json()["stdout"]
    assert "exec-" not in left, left  # the script file is removed afterwards
    # Near the limits, what is allowed runs: one 128 KiB argument, 1 MiB of env.
    arg = "y" * 131071
    r = c.post(f"/sandboxes/{sid}/exec", json={"command": "/bin/sh", "timeout": 60,
                                               "args": ["-c", 'echo ${#1}', "sh", arg]})
    assert r.status_code == 200 and r.json()["stdout"] == "131071\n", r.text[:300]
    env = {f"V{i}": "z" * 100_000 for i in range(10)}
    r = c.post(f"/sandboxes/{sid}/exec", json={"command": 'echo ${#V9}', "env": env})
    assert r.status_code == 200 and r.json()["stdout"] == "100000\n", r.text[:300]


def test_json_bodies_are_capped_but_uploads_are_not(hostile) -> None:
    srv, c, sid = hostile
    limit = 8 << 20
    big = json.dumps({"command": "true", "stdin": "x" * (limit + 10)}).encode()
    r = c.post(f"/sandboxes/{sid}/exec", content=big,
               headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text[:300]
    err = check_error(r, srv)
    assert err["code"] == "too_large" and err["limit_bytes"] == limit
    assert str(limit) in err["message"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        for i in range(0, len(big), 1 << 20):
            yield big[i:i + (1 << 20)]

    r = c.post(f"/sandboxes/{sid}/exec", content=chunks(),
               headers={"content-type": "application/json"})
    assert r.status_code == 413 and check_error(r, srv)["code"] == "too_large", r.text[:300]
    # Under the limit it runs; a text/plain body is capped the same way.
    ok = c.post(f"/sandboxes/{sid}/exec", json={"command": "wc -c", "stdin": "x" * (4 << 20)})
    assert ok.status_code == 200 and ok.json()["stdout"].strip() == str(4 << 20), ok.text[:300]
    r = c.post("/sandboxes", content=b"x" * (limit + 1), headers={"content-type": "text/plain"})
    assert r.status_code == 413, r.text[:300]
    # A file upload is streamed to the guest: not bound by the JSON limit.
    data = os.urandom(limit + (1 << 20))
    r = c.put(f"/sandboxes/{sid}/files", params={"path": "/root/big.bin"}, content=data)
    assert r.status_code == 200 and r.json()["size"] == len(data), r.text[:300]
    r = c.post(f"/sandboxes/{sid}/exec", json={"command": "sha256sum /root/big.bin; "
                                                          "rm /root/big.bin"})
    import hashlib

    assert r.json()["stdout"].split()[0] == hashlib.sha256(data).hexdigest()


# -- the sweep -----------------------------------------------------------------------

STRINGS = ["", "\0", "a\0b", "\ud800", "../../../../etc/passwd", "x" * 70_000, " ", "\n",
           "sb-' OR '1'='1", "${jndi:ldap://h/x}", "\u202e\U0001f642", "%s%n", "-1"]
NUMBERS = [-1, 0, 2 ** 64, -(2 ** 63), 1e308, -1e308, 1.5, -0.0]
OTHERS: list[Any] = [None, True, False, [], {}, ["\0"], {"\0": "\0"}, {"a": {"b": [1]}},
                     [[[[[]]]]]]
VALUES: list[Any] = STRINGS + NUMBERS + OTHERS
IDS = ["sb-000000000000", "%00", "a" * 300, "..", "%2e%2e%2f%2e%2e", "%ff%fe", "é", "sb-%0a",
       "alice", " "]
FILE_PATHS = ["", "\0", "a\0b", "/no/such/\u202e", "x" * 5000, "/root/" + "y" * 300, "/", " ",
              "..\\..", "/proc/self/status/x"]
RAW_BODIES = [b"{", b"[]", b'"x"', b"null", b"1", b"NaN", b"{\"a\": Infinity}",
              b"[" * 100_000 + b"]" * 100_000, b"\xff\xfe", b'{"command": "\\ud800"}',
              json.dumps({"a" * 1000: ["b"] * 10000}).encode()]
EXTRA_GETS = {
    # Nothing of these exists: 404.
    "/ui/..%2f..%2f..%2fetc%2fpasswd": 404, "/ui/%00": 404, "/novnc/..%2f..%2fapi-key": 404,
    "/sandboxes/%00/files/list?path=%00": 404, "/openapi.json/%00": 404, "/%00": 404,
    # Exposed ports' proxy (not in the spec): unknown sandboxes 404, impossible ports 400.
    "/sandboxes/sb-000000000000/ports/3000/..%2f..%2fapi-key": 404,
    "/sandboxes/%00/ports/3000/": 404, "/sandboxes/sb-000000000000/ports/99999/": 400,
    "/sandboxes/sb-000000000000/ports/0/x?hangar_token=%ff%00": 400}


def _resolve(spec: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        schema = spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    for key in ("anyOf", "oneOf"):
        for alt in schema.get(key, ()):
            alt = _resolve(spec, alt)
            if alt.get("type") == "object":
                return alt
    return schema


def _valid_base(op_path: str, schema: dict[str, Any]) -> dict[str, Any]:
    """The smallest body that passes validation: the required fields, with plain values."""
    plain = {"command": "true", "snapshot_id": "snap-000000000000", "path": "/root/sweep-dir",
             "x": 1, "y": 1, "text": "a", "keys": "Return", "direction": "down", "timeout": 60}
    return {k: plain.get(k, "a") for k in schema.get("required", ())}


def _operations(spec: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    ops = [(m.upper(), p, op) for p, ms in spec["paths"].items() for m, op in ms.items()]
    # Changes of the shared sandbox's lifetime come last; see the loop.
    return sorted(ops, key=lambda o: o[1].endswith("/timeout"))


def test_sweep_every_route_with_hostile_values(hostile) -> None:
    srv, c, sid = hostile
    spec = c.get("/openapi.json").json()
    seen: list[tuple[str, str, int]] = []
    failures: list[str] = []

    def send(method: str, url: str, *, params: dict[str, Any] | None = None,
             body: Any = ..., raw: bytes | None = None, what: object = None) -> None:
        kw: dict[str, Any] = {"params": params}
        if raw is not None:
            kw["content"] = raw
            kw["headers"] = {"content-type": "application/json"}
        elif body is not ...:
            # ensure_ascii: lone surrogates travel as \\ud800 escapes, as any JSON client may send.
            kw["content"] = json.dumps(body).encode()
            kw["headers"] = {"content-type": "application/json"}
        try:
            with c.stream(method, url, timeout=120, **kw) as r:
                # A live stream (GET /events) never ends by itself: its status is the answer.
                if not r.headers.get("content-type", "").startswith("text/event-stream"):
                    r.read()
        except httpx.HTTPError as exc:
            failures.append(f"{method} {url} {what}: transport error {exc!r}")
            return
        seen.append((method, url, r.status_code))
        if r.status_code >= 400:
            try:
                check_error(r, srv, (method, url, what))
            except (AssertionError, ValueError, KeyError) as exc:
                failures.append(f"{method} {url} {str(what)[:120]}: {str(exc)[:400]}")
        if url.endswith("/timeout") and r.status_code < 300:
            c.post(f"/sandboxes/{sid}/timeout", json={"timeout": 0})  # keep it alive

    def destructive(method: str, path: str) -> bool:
        return (method, path) in {("DELETE", "/sandboxes/{sandbox_id}"),
                                  ("POST", "/sandboxes/{sandbox_id}/snapshot")}

    for method, path, op in _operations(spec):
        params = [p for p in op.get("parameters", ()) if p["in"] == "path"]
        query = [p for p in op.get("parameters", ()) if p["in"] == "query"]
        content = op.get("requestBody", {}).get("content", {})
        schema = _resolve(spec, content["application/json"]["schema"]) if content else None
        # A path that does not exist: nothing valid by chance (say a recursive delete) harms.
        base_q = {q["name"]: "/root/sweep-none" for q in query if q.get("required")}
        base_body = _valid_base(path, schema) if schema is not None else ...

        def url_for(value: str) -> str:
            u = path
            for p in params:
                u = u.replace("{" + p["name"] + "}", value)
            return u

        # Hostile ids in the path (nothing they name exists).
        for value in IDS if params else [""]:
            send(method, url_for(value), params=base_q, body=base_body, what=("id", value))
        target = url_for(sid) if params and params[0]["name"] == "sandbox_id" else url_for("alice")
        if params and params[0]["name"] == "sandbox_id" and destructive(method, path):
            continue
        # Hostile query values.
        for q in query:
            values = (FILE_PATHS if q["name"] == "path"
                      else [*STRINGS, "1e3", "0x1ff", "-1", "99999"])
            for value in values:
                if method == "DELETE" and q["name"] == "path" and value in ("/",):
                    continue
                value = value[:8000]  # a URL has room for less than a body
                if value == "\ud800":  # no URL can carry it; raw bytes below instead
                    value = "\udcff"
                    url = f"{target}?{q['name']}=%ff%fe"
                    send(method, url, body=base_body, what=("query", q["name"], "%ff%fe"))
                    continue
                send(method, target, params={**base_q, q["name"]: value}, body=base_body,
                     what=("query", q["name"], value))
        if schema is None:
            continue
        # Hostile bodies whole, then one field at a time.
        for raw in RAW_BODIES:
            send(method, target, params=base_q, raw=raw, what=("raw", raw[:20]))
        for name in schema.get("properties", {}):
            for value in VALUES:
                send(method, target, params=base_q, body={**base_body, name: value},
                     what=("field", name, repr(value)[:40]))
    for url, want in EXTRA_GETS.items():
        r = c.get(url)
        seen.append(("GET", url, r.status_code))
        assert r.status_code == want, (url, r.status_code)
        assert "root:" not in r.text and srv.key not in r.text

    routes = {(m, p) for m, p, _ in _operations(spec)}
    print(f"{len(seen)} requests over {len(routes)} routes; "
          f"statuses: {sorted({s for *_, s in seen})}")
    assert not failures, "\n".join(failures[:40])
    assert len(routes) >= 30 and len(seen) > 1000
    # The shared sandbox survived all of it.
    r = c.post(f"/sandboxes/{sid}/exec", json={"command": "echo alive"})
    assert r.status_code == 200 and r.json()["stdout"] == "alive\n"


# -- the guest agent on its own --------------------------------------------------------


def test_agent_refuses_bad_exec_input_itself(tmp_path: Path) -> None:
    """The agent checks what the API checks, for any other caller (run on the host)."""
    from hangar.errors import HangarError
    from hangar.engines.agent_client import AgentClient

    sock = tmp_path / "agent.sock"
    proc = subprocess.Popen([sys.executable, "-m", "hangar.guest.agent", "--listen", str(sock)],
                            env={**os.environ, "PYTHONPATH": str(SRC)},
                            stderr=subprocess.DEVNULL)

    async def body() -> list[tuple[str, str]]:
        c = await AgentClient.connect(sock, 20)
        out = []
        try:
            for meta in [{"argv": ["echo", "a\0"]}, {"shell": "echo \0"},
                         {"shell": "true", "env": {"A=B": "1"}},
                         {"shell": "true", "env": {"": "1"}},
                         {"shell": "true", "env": {"A": "\0"}},
                         {"shell": "true", "cwd": "/etc/hostname"},
                         {"argv": ["/bin/echo", "x" * 200_000]}]:
                try:
                    await c.exec({"op": "exec", **meta})
                    out.append(("ran", repr(meta)[:60]))
                except HangarError as exc:
                    out.append((exc.code, exc.message))
            r = await c.exec({"op": "exec", "argv": ["no-such-program"]})
            out.append((str(r.exit_code), r.stderr.head.decode()))
        finally:
            await c.close()
        return out

    try:
        results = asyncio.run(body())
    finally:
        proc.kill()
        proc.wait()
    codes = [code for code, _ in results]
    assert codes == ["invalid_request"] * 7 + ["127"], results
    assert "not a directory" in results[5][1] and "E2BIG" in results[6][1]
    assert results[-1][1] == "no-such-program: command not found\n"
    assert not any(EXCEPTION_NAME.search(msg) for _, msg in results), results
