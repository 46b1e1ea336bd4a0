"""Exec in a real microVM over the REST API: the cases users rely on."""

from __future__ import annotations

import base64
import json
import time

import httpx
import pytest

pytestmark = pytest.mark.vm


def run(api: httpx.Client, sid: str, **body: object) -> dict:
    r = api.post(f"/sandboxes/{sid}/exec", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_streams_apart_and_exit_code(api: httpx.Client, sandbox: str) -> None:
    r = run(api, sandbox, command="echo to-out; echo to-err 1>&2; exit 3")
    assert r["stdout"] == "to-out\n"
    assert r["stderr"] == "to-err\n"
    assert r["exit_code"] == 3
    assert r["timed_out"] is False


def test_killed_by_signal_is_never_zero(api: httpx.Client, sandbox: str) -> None:
    r = run(api, sandbox, command="sh -c 'kill -KILL $$'")
    assert r["exit_code"] == 137, r  # 128 + SIGKILL, whichever process of the command it hit
    assert r["exit_code"] != 0


def test_timeout_kills_the_whole_group(api: httpx.Client, sandbox: str) -> None:
    started = time.monotonic()
    r = run(api, sandbox, command="echo before; sleep 45 & sleep 40", timeout=2)
    took = time.monotonic() - started
    assert r["timed_out"] is True
    assert r["stdout"] == "before\n", "output printed before the timeout is kept"
    assert took < 10, f"a 2 s timeout took {took:.1f} s"
    ps = run(api, sandbox, command="ps -eo args")
    assert "sleep 45" not in ps["stdout"] and "sleep 40" not in ps["stdout"], ps["stdout"]


def test_stdin_none_means_eof(api: httpx.Client, sandbox: str) -> None:
    started = time.monotonic()
    r = run(api, sandbox, command="cat", timeout=20)
    assert r["exit_code"] == 0 and r["stdout"] == "" and not r["timed_out"]
    assert time.monotonic() - started < 10


def test_stdin_is_fed(api: httpx.Client, sandbox: str) -> None:
    r = run(api, sandbox, command='read l; echo "got:$l"', stdin="abc\n")
    assert r["stdout"] == "got:abc\n"
    raw = bytes(range(256))
    r = run(api, sandbox, command="od -An -tx1 -v | tr -d ' \\n'",
            stdin_b64=base64.b64encode(raw).decode())
    assert r["stdout"] == raw.hex()


def test_argv_runs_without_a_shell(api: httpx.Client, sandbox: str) -> None:
    r = run(api, sandbox, command="/bin/echo", args=["$(id)", "a b", "`x`"])
    assert r["stdout"] == "$(id) a b `x`\n"


def test_env_and_cwd(api: httpx.Client, sandbox: str) -> None:
    r = run(api, sandbox, command='echo "$GREETING"; pwd', env={"GREETING": "hi there"}, cwd="/tmp")
    assert r["stdout"] == "hi there\n/tmp\n"


def test_invalid_utf8_and_random_bytes(api: httpx.Client, sandbox: str) -> None:
    r = run(api, sandbox, command=r"printf 'ok\377\376end'")
    assert r["exit_code"] == 0
    assert base64.b64decode(r["stdout_b64"]) == b"ok\xff\xfeend"
    assert r["stdout"].startswith("ok") and r["stdout"].endswith("end")
    r = run(api, sandbox, command="head -c 4096 /dev/urandom")
    assert r["exit_code"] == 0
    assert r["stdout_bytes"] == 4096
    assert len(base64.b64decode(r["stdout_b64"])) == 4096


def test_huge_output_is_bounded(api: httpx.Client, sandbox: str, server) -> None:
    r = run(api, sandbox, command="yes abcdefgh | head -c 300000000; echo TAIL-MARK; exit 5",
            timeout=300)
    assert r["exit_code"] == 5
    assert r["stdout_truncated"] is True
    assert r["stdout_bytes"] == 300000000 + len("TAIL-MARK\n")
    assert len(r["stdout"]) <= 1 << 20
    assert r["stdout"].startswith("abcdefgh\n")
    assert r["stdout_tail"].endswith("TAIL-MARK\n")
    # The server never held the whole output: its resident memory stays small.
    with open(f"/proc/{server.proc.pid}/status") as f:
        rss_kib = int(next(line for line in f if line.startswith("VmRSS")).split()[1])
    assert rss_kib < 400 * 1024, f"server RSS {rss_kib} KiB"


def test_a_keyed_exec_is_replayed_when_small_and_refused_when_large(
        api: httpx.Client, sandbox: str, server) -> None:
    """An Idempotency-Key's answer is kept for a repeat up to 64 KiB; of a larger one only
    that it was given, so its repeat is a 409 and the command never runs twice (review
    29k K-M2: every answer up to 4 MiB was kept for 24 h)."""
    import secrets
    import sqlite3

    tag = secrets.token_hex(4)
    mark = f"/tmp/idem-{tag}"

    def keyed(key: str, command: str) -> httpx.Response:
        return api.post(f"/sandboxes/{sandbox}/exec", json={"command": command},
                        headers={"Idempotency-Key": key})

    small = f"echo ran >> {mark}; echo small"
    first, again = keyed(f"small-{tag}", small), keyed(f"small-{tag}", small)
    assert first.status_code == again.status_code == 200, again.text
    assert again.headers["idempotent-replayed"] == "true" and again.json() == first.json()
    large = f"echo ran >> {mark}; head -c 100000 /dev/zero | tr '\\0' a"
    first, again = keyed(f"large-{tag}", large), keyed(f"large-{tag}", large)
    assert first.status_code == 200 and first.json()["stdout"] == "a" * 100_000
    assert again.status_code == 409, again.text
    assert again.json()["error"]["code"] == "conflict"
    assert "64 KiB" in again.json()["error"]["message"]
    assert run(api, sandbox, command=f"cat {mark}")["stdout"] == "ran\n" * 2
    with sqlite3.connect(server.data_dir / "hangar.db") as con:
        sizes = dict(con.execute("SELECT key, length(body) FROM idempotency_keys "
                                 "WHERE key LIKE ?", (f"%-{tag}",)).fetchall())
    assert sizes[f"large-{tag}"] == 0 and 0 < sizes[f"small-{tag}"] < 1024


def test_orphans_are_reaped(api: httpx.Client, sandbox: str) -> None:
    run(api, sandbox, command="for i in $(seq 100); do (sleep 0.1 &) ; done")
    time.sleep(2)
    r = run(api, sandbox, command="ps -eo stat= | grep -c '^Z' || true")
    assert r["stdout"].strip() == "0"


def test_concurrent_execs(api: httpx.Client, sandbox: str, server) -> None:
    import concurrent.futures as cf

    def one(i: int) -> str:
        with server.client() as c:
            return run(c, sandbox, command=f"sleep 0.5; echo {i}")["stdout"]

    with cf.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(one, range(8)))
    assert outs == [f"{i}\n" for i in range(8)]


def test_stream_delivers_every_byte(api: httpx.Client, sandbox: str) -> None:
    events = []
    with api.stream("POST", f"/sandboxes/{sandbox}/exec/stream",
                    json={"command": "for i in 1 2 3; do echo line$i; sleep 0.2; done; "
                                     "head -c 3000000 /dev/zero; echo err >&2; exit 4"}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("application/x-ndjson")
        for line in r.iter_lines():
            if line:
                events.append(json.loads(line))
    out = b"".join(e["data"].encode() if "data" in e else base64.b64decode(e["data_b64"])
                   for e in events if e["type"] == "stdout")
    assert out == b"line1\nline2\nline3\n" + b"\0" * 3000000
    assert "".join(e.get("data", "") for e in events if e["type"] == "stderr") == "err\n"
    assert events[-1]["type"] == "exit" and events[-1]["exit_code"] == 4


def test_exec_in_unknown_or_deleted_sandbox(api: httpx.Client, fresh_sandbox: str) -> None:
    r = api.post("/sandboxes/sb-000000000000/exec", json={"command": "true"})
    assert r.status_code == 404
    assert api.delete(f"/sandboxes/{fresh_sandbox}").status_code == 204
    r = api.post(f"/sandboxes/{fresh_sandbox}/exec", json={"command": "true"})
    assert r.status_code == 404, r.text  # deleted: as unknown as one never made
    assert r.json()["error"]["code"] == "not_found"
    # And the VM of the deleted sandbox is gone.
    from conftest import vmm_pids

    assert vmm_pids(fresh_sandbox) == []


def test_background_process_outlives_its_exec(api: httpx.Client, sandbox: str) -> None:
    started = time.monotonic()
    r = run(api, sandbox, command="sleep 300 & echo $! > /tmp/bg.pid; echo started", timeout=30)
    assert r["stdout"] == "started\n" and not r["timed_out"]
    assert time.monotonic() - started < 10, "the exec waits for the shell, not for its children"
    assert run(api, sandbox, command="kill -0 $(cat /tmp/bg.pid) && echo alive")["stdout"] == "alive\n"
    run(api, sandbox, command="kill $(cat /tmp/bg.pid)")


def test_a_large_answer_is_streamed_as_the_same_json() -> None:
    """An answer of more than ``STREAMED_ANSWER_BYTES`` of output is streamed a piece at a
    time (so a client that does not read holds a piece of the server, not 22 MiB: review
    29l H2), and says exactly what the model says: control characters, non-UTF-8 output
    (``stdout_b64``), tails, and the fields left out when None. No piece costs the loop more
    than a few ms of CPU."""
    import asyncio

    from hangar.api.sandboxes import (
        STREAMED_ANSWER_BYTES, _answer_pieces, exec_answer, exec_response,
    )
    from hangar.core.service import ExecResult, StreamCapture
    from loop_stalls import measured

    out = StreamCapture(head=b"\x01\"\\\n" * (3 << 18) + "😀".encode() * 50000 + b"\xf0\x9f",
                        tail=b"\x98\x80\xff end", total=9 << 20, truncated=True)
    err = StreamCapture(head="é".encode() * 1000, total=2000)
    r = ExecResult(exit_code=3, signal=None, timed_out=False, duration_s=1.5, stdout=out,
                   stderr=err)
    assert len(out.head) > STREAMED_ANSWER_BYTES
    small = ExecResult(exit_code=0, signal=None, timed_out=False, duration_s=0.1,
                       stdout=StreamCapture(head=b"ok\n", total=3))
    assert not hasattr(exec_answer(small), "body_iterator")  # the model, encoded at once
    streamed = exec_answer(r)
    assert hasattr(streamed, "body_iterator")

    async def collect() -> list[bytes]:
        return [piece async for piece in _answer_pieces(r)]

    pieces, stalls = asyncio.run(measured(collect()))
    stalls.check_cpu(0.08)
    want = exec_response(r).model_dump(exclude_none=True)
    assert json.loads(b"".join(pieces)) == want
    assert "signal" not in want and want["stdout_b64"] and want["stderr"] == "é" * 1000
