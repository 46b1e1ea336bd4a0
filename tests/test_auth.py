"""API keys against a real server: unsafe keys refused at start, named keys rotated
live with ``hangar key``, guessers throttled, keys never logged. No VM is booted.

Each test talks from its own loopback address (127.0.0.N), so the throttle (per
address and presented key) of one test never touches another.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from conftest import SRC, Server, cleanup, free_port, make_data_dir, own_server

LEGACY_KEY = secrets.token_hex(32)  # a key file of the old format: one line, 64 hex digits
USED: list[str] = []  # every key this module presents, right or wrong; none may be logged


def client(server: Server, address: str, key: str | None) -> httpx.Client:
    headers = {"X-API-Key": key} if key is not None else {}
    if key:
        USED.append(key)
    return httpx.Client(base_url=server.url, headers=headers, timeout=30,
                        transport=httpx.HTTPTransport(local_address=address))


def status(server: Server, address: str, key: str | None, path: str = "/sandboxes") -> int:
    with client(server, address, key) as c:
        return c.get(path).status_code


def hangar(server: Server, *args: str, key_env: str | None = None
           ) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HANGAR_DATA_DIR": str(server.data_dir), "HANGAR_URL": server.url,
           "PYTHONPATH": str(SRC)}
    env.pop("HANGAR_API_KEY", None)
    if key_env is not None:
        env["HANGAR_API_KEY"] = key_env
    return subprocess.run([sys.executable, "-m", "hangar.cli", *args], env=env, text=True,
                          capture_output=True, timeout=120)


@pytest.fixture(scope="module")
def keyed(base_image: Path) -> Iterator[Server]:
    d = make_data_dir(base_image)
    (d / "api-key").write_text(LEGACY_KEY + "\n")
    (d / "api-key").chmod(0o600)
    with own_server(base_image, {"HANGAR_LOG_LEVEL": "DEBUG"}, data_dir=d) as srv:
        yield srv


@pytest.mark.parametrize("case", ["empty file", "weak file", "two lines", "weak env",
                                  "bad named line"])
def test_unsafe_keys_stop_the_server(base_image: Path, case: str) -> None:
    d = make_data_dir(base_image)
    env: dict[str, str] = {}
    key_file, named_file = d / "api-key", d / "api-keys"
    expect = [str(key_file), "Fix"]
    if case == "empty file":
        key_file.write_text("")
        expect.append("empty")
    elif case == "weak file":
        key_file.write_text("changeme\n")
        expect.append("at least 32")
    elif case == "two lines":
        key_file.write_text(secrets.token_hex(32) + "\n" + secrets.token_hex(32) + "\n")
        expect += ["one key", "hangar key add"]
    elif case == "weak env":
        env["HANGAR_API_KEY"] = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
        expect = ["HANGAR_API_KEY", "distinct characters", "Fix"]
    else:
        named_file.write_text("ci hk_plaintext_key_is_not_a_hash\n")
        expect = [f"{named_file}:1", "hangar key add"]
    srv = Server(d, free_port(), env)
    try:
        proc = subprocess.run([sys.executable, "-m", "hangar.cli", "serve"], env=srv.env,
                              capture_output=True, text=True, timeout=60)
        said = proc.stdout + proc.stderr
        assert proc.returncode == 1, said
        for words in expect:
            assert words in " ".join(said.split()), (words, said)
        assert "Traceback" not in said and "Hangar on" not in said, said
        with pytest.raises(httpx.ConnectError):
            httpx.get(srv.url + "/health", timeout=2)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_the_old_key_file_and_the_env_key_keep_working(keyed: Server, base_image: Path) -> None:
    assert status(keyed, "127.0.0.10", LEGACY_KEY) == 200
    r = hangar(keyed, "ls")  # the CLI reads $HANGAR_DATA_DIR/api-key
    assert r.returncode == 0, r.stderr
    env_key = "hk_" + secrets.token_urlsafe(32)
    d = make_data_dir(base_image)
    srv = Server(d, free_port(), {"HANGAR_API_KEY": env_key})
    try:
        srv.start()
        assert status(srv, "127.0.0.10", env_key) == 200
        assert status(srv, "127.0.0.10", LEGACY_KEY) == 401
        assert not (d / "api-key").exists(), "HANGAR_API_KEY replaces the key file"
    finally:
        cleanup(srv)
        shutil.rmtree(d, ignore_errors=True)


def test_named_keys_rotate_without_a_restart(keyed: Server) -> None:
    addr = "127.0.0.11"
    r = hangar(keyed, "key", "add", "ci")
    assert r.returncode == 0, r.stderr
    ci = r.stdout.strip()
    USED.append(ci)
    assert ci.startswith("hk_") and len(ci) >= 40
    stored = (keyed.data_dir / "api-keys").read_text()
    assert ci not in stored and "ci sha256:" in stored, "only the key's hash is kept"
    assert (keyed.data_dir / "api-keys").stat().st_mode & 0o777 == 0o600
    assert status(keyed, addr, ci) == 200  # no restart
    assert hangar(keyed, "key", "add", "ci").returncode == 1  # the name is taken
    r = hangar(keyed, "key", "add", "Bad Name!")
    assert r.returncode == 1 and "key name" in r.stderr and "Traceback" not in r.stderr
    listing = hangar(keyed, "key", "ls")
    assert listing.returncode == 0 and "ci" in listing.stdout and "default" in listing.stdout
    assert ci not in listing.stdout and LEGACY_KEY not in listing.stdout

    r = hangar(keyed, "key", "rotate", "ci")
    assert r.returncode == 0, r.stderr
    ci2 = r.stdout.strip()
    USED.append(ci2)
    assert status(keyed, addr, ci) == 401 and status(keyed, addr, ci2) == 200
    assert status(keyed, addr, LEGACY_KEY) == 200  # the default key is untouched

    assert hangar(keyed, "key", "rm", "ci").returncode == 0
    assert status(keyed, addr, ci2) == 401
    r = hangar(keyed, "key", "rm", "ci")
    assert r.returncode == 1 and "no key called 'ci'" in r.stderr

    # The default key rotates too; the CLI and SDK on this host follow the file.
    r = hangar(keyed, "key", "rotate")
    assert r.returncode == 0, r.stderr
    new_default = (keyed.data_dir / "api-key").read_text().strip()
    USED.append(new_default)
    assert new_default == r.stdout.strip() != LEGACY_KEY
    assert status(keyed, addr, LEGACY_KEY) == 401 and status(keyed, addr, new_default) == 200
    assert hangar(keyed, "ls").returncode == 0
    # A key file emptied while the server runs accepts no key; the server keeps running.
    (keyed.data_dir / "api-key").write_text("")
    assert status(keyed, addr, new_default) == 401 and status(keyed, addr, "") == 401
    (keyed.data_dir / "api-key").write_text(LEGACY_KEY + "\n")
    assert status(keyed, addr, LEGACY_KEY) == 200


def test_wrong_keys_in_a_row_end_in_429(keyed: Server) -> None:
    guesser, neighbour = "127.0.0.2", "127.0.0.3"
    wrong = "hk_" + secrets.token_urlsafe(32)
    answers = []
    with client(keyed, guesser, wrong) as c:
        for _ in range(50):
            answers.append(c.get("/sandboxes"))
    codes = [r.status_code for r in answers]
    assert codes[0] == 401 and codes[-1] == 429, codes
    first = codes.index(429)
    assert set(codes[:first]) == {401} and set(codes[first:]) == {429}, codes
    assert first == 20, codes
    last = answers[-1]
    wait = int(last.headers["Retry-After"])
    assert 1 <= wait <= 3, last.headers
    assert last.json()["error"]["code"] == "limit_exceeded" and "wrong API key" in \
        last.json()["error"]["message"]
    # The bucket is this address *and this key*: the right key from the same address (every
    # local process shares 127.0.0.1) is never throttled by the wrong one, another wrong
    # key starts its own bucket, a missing key is a plain 401, another address is apart.
    assert status(keyed, guesser, LEGACY_KEY) == 200
    assert status(keyed, guesser, wrong) == 429
    assert status(keyed, guesser, "hk_" + secrets.token_urlsafe(32)) == 401
    assert status(keyed, guesser, None) == 401
    assert status(keyed, neighbour, LEGACY_KEY) == 200
    assert status(keyed, neighbour, wrong) == 401
    time.sleep(wait + 0.2)
    # One more guess is allowed per refill, not a new burst.
    assert status(keyed, guesser, wrong) == 401
    assert status(keyed, guesser, wrong) == 429


def test_keys_are_never_logged_nor_taken_from_the_url(keyed: Server) -> None:
    addr = "127.0.0.12"
    wrong = "hk_" + secrets.token_urlsafe(32)
    with httpx.Client(base_url=keyed.url, timeout=30,
                      transport=httpx.HTTPTransport(local_address=addr)) as c:
        # The right key is taken from the header only (any case), the wrong one never.
        for key, in_header in ((LEGACY_KEY, 200), (wrong, 401)):
            USED.append(key)
            assert c.get("/sandboxes", params={"api_key": key}).status_code == 401
            assert c.get("/sandboxes", params={"X-API-Key": key}).status_code == 401
            bearer = {"Authorization": f"Bearer {key}"}
            assert c.get("/sandboxes", headers=bearer).status_code == 401
            assert c.get("/sandboxes", headers={"x-api-key": key}).status_code == in_header
            r = c.post("/sandboxes/sb-000000000000/exec", headers={"X-API-Key": key},
                       json={"command": "true", "env": {"KEY": key}})
            assert r.status_code == (404 if in_header == 200 else 401), r.text
            r = c.get(f"/sandboxes/{key}", headers={"X-API-Key": LEGACY_KEY})
            assert r.status_code == 404, r.text
    log = keyed.log.read_text()
    assert '"level": "debug"' in log or '"level": "info"' in log, log[-500:]
    for key in USED:
        assert key not in log, "a key reached the server log"
