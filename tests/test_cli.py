"""The ``hangar`` CLI against a real server: create, exec, files, ls, rm."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SRC, Server, Waits, vmm_pids, wait_for

pytestmark = pytest.mark.vm


def hangar(server: Server, *args: str, stdin: bytes | None = None, timeout: float = 300) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "HANGAR_URL": server.url, "HANGAR_API_KEY": server.key,
           "PYTHONPATH": str(SRC), "HANGAR_NO_STDIN": "" if stdin is not None else "1"}
    return subprocess.run([sys.executable, "-m", "hangar.cli", *args], env=env, input=stdin,
                          capture_output=True, timeout=timeout)


def test_cli_round_trip(server: Server, tmp_path: Path) -> None:
    r = hangar(server, "create")
    assert r.returncode == 0, r.stderr
    sid = r.stdout.decode().strip()
    try:
        assert sid.startswith("sb-")
        assert sid in hangar(server, "ls").stdout.decode()
        r = hangar(server, "exec", sid, "--", "sh", "-c", "echo out; echo err >&2; exit 7")
        assert r.returncode == 7
        assert r.stdout == b"out\n" and r.stderr.endswith(b"err\n")
        r = hangar(server, "exec", sid, "--", "cat", stdin=b"piped\n")
        assert r.returncode == 0 and r.stdout == b"piped\n"
        src = tmp_path / "in.bin"
        src.write_bytes(bytes(range(256)))
        assert hangar(server, "files", "put", sid, str(src), "/root/in.bin").returncode == 0
        dst = tmp_path / "out.bin"
        assert hangar(server, "files", "get", sid, "/root/in.bin", str(dst)).returncode == 0
        assert dst.read_bytes() == bytes(range(256))
        assert "in.bin" in hangar(server, "files", "ls", sid, "/root").stdout.decode()
        r = hangar(server, "files", "get", sid, "/root/missing")
        assert r.returncode == 1 and b"missing" in r.stderr and b"Traceback" not in r.stderr
    finally:
        r = hangar(server, "rm", sid)
    assert r.returncode == 0
    assert vmm_pids(sid) == []
    r = hangar(server, "exec", sid, "--", "true")
    assert r.returncode == 1 and b"Traceback" not in r.stderr


def test_a_missing_key_says_where_it_was_looked_for(server: Server, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "HANGAR_API_KEY"}
    env.update(HANGAR_URL=server.url, HANGAR_DATA_DIR=str(tmp_path), PYTHONPATH=str(SRC))
    r = subprocess.run([sys.executable, "-m", "hangar.cli", "ls"], env=env,
                       capture_output=True, timeout=60)
    assert r.returncode == 1 and b"Traceback" not in r.stderr
    err = r.stderr.decode()
    assert "X-API-Key" in err and f"{tmp_path}/api-key (missing" in err, err


def test_shell_with_piped_input_ends_when_the_input_does(server: Server) -> None:
    sid = hangar(server, "create").stdout.decode().strip()
    try:
        r = hangar(server, "shell", sid, stdin=b"echo hello-$((6 * 7))\n", timeout=60)
        assert r.returncode == 0, r.stderr
        assert b"hello-42" in r.stdout
        # The session's status is the remote program's: the shell's last command's.
        r = hangar(server, "shell", sid, stdin=b"date\n(exit 3)\n", timeout=60)
        assert r.returncode == 3, (r.stdout, r.stderr)
        r = hangar(server, "shell", sid, stdin=b"echo no-newline-at-the-end", timeout=60)
        assert r.returncode == 0 and b"no-newline-at-the-end" in r.stdout, (r.stdout, r.stderr)
        for piped in (b"through\n", b"through"):  # a program reading bytes gets them, then EOF
            r = hangar(server, "shell", sid, "--", "sh", "-c", "cat; exit 5", stdin=piped,
                       timeout=60)
            assert r.returncode == 5 and b"through" in r.stdout, (r.stdout, r.stderr)
    finally:
        hangar(server, "rm", sid)


def test_status_names_the_engine_once(server: Server) -> None:
    r = hangar(server, "status")
    assert r.returncode == 0, r.stderr
    line = r.stdout.decode().splitlines()[0]
    assert "engine=" not in r.stdout.decode(), r.stdout
    assert re.search(r"; engine qemu \d+\.\d+\S* \((tcg|kvm)\)$", line), line


def test_rm_of_an_expired_or_deleted_sandbox_is_done(server: Server, waits: Waits) -> None:
    sid = hangar(server, "create", "--timeout", "1").stdout.decode().strip()
    with server.client() as c:
        wait_for(lambda: c.get(f"/sandboxes/{sid}").status_code == 410, 1 + waits.vm(2),
                 "the 1 s TTL to expire", every=0.2)
    r = hangar(server, "rm", sid)
    assert r.returncode == 0, r.stderr
    assert r.stdout.decode().strip() == f"{sid} had already expired; nothing to delete"
    live = hangar(server, "create").stdout.decode().strip()
    assert hangar(server, "rm", live).stdout.decode().strip() == f"deleted {live}"
    r = hangar(server, "rm", live)
    assert r.returncode == 0, r.stderr
    assert "already deleted" in r.stdout.decode()
