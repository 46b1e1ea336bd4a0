"""Keys of a team on disk (``hangar.keys``): the ``api-keys`` line with ``team=TEAM``,
``KeyStore.add --team``, rotation, the server ring's ``team_of``, the ``hangar key``
commands, and the SDK's and CLI's checks made before a request; then ``hangar team``
and ``hangar key add --team`` against a real server (no VM is booted)."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SRC, Server

from hangar import keys as K
from hangar import teams as T
from hangar.client import AsyncHangar, Hangar
from hangar.errors import ConfigError, InvalidRequest, NotFound
from hangar.schemas import teams as S

HEX = "ab" * 32
OLD = (f"# an api-keys file written before teams\n"
       f"ci sha256:{HEX} 1700000000\n"
       f"bare sha256:{'cd' * 32}\n")


def store(d: Path) -> K.KeyStore:
    K.create_default(d / "api-key")
    return K.KeyStore(d / "api-key", d / "api-keys")


def test_old_lines_parse_unchanged_and_are_written_back_as_they_were() -> None:
    keys, problems = K.parse_named(OLD, Path("api-keys"))
    assert problems == []
    assert keys == [K.NamedKey("ci", bytes.fromhex(HEX), 1700000000.0, None),
                    K.NamedKey("bare", bytes.fromhex("cd" * 32), None, None)]
    assert [k.line() for k in keys] == [f"ci sha256:{HEX} 1700000000",
                                        f"bare sha256:{'cd' * 32}"]


def test_team_lines_round_trip() -> None:
    text = f"ci sha256:{HEX} 1700000000 team=red-2\nno-time sha256:{'cd' * 32} team=blue\n"
    keys, problems = K.parse_named(text, Path("api-keys"))
    assert problems == []
    assert [(k.name, k.created, k.team) for k in keys] == [
        ("ci", 1700000000.0, "red-2"), ("no-time", None, "blue")]
    assert "".join(k.line() + "\n" for k in keys) == text


@pytest.mark.parametrize("tail", ["team=", "team=Red", "team=-x", "team=a_b", "team=a b",
                                  "group=red", "team=red extra"])
def test_a_bad_team_part_is_a_bad_line(tail: str) -> None:
    keys, problems = K.parse_named(f"ci sha256:{HEX} 1700000000 {tail}\n", Path("f"))
    assert keys == [] and len(problems) == 1 and "f:1" in problems[0]
    assert "team=TEAM" in problems[0]


def test_add_with_an_unknown_team_is_not_found_and_writes_nothing(tmp_path: Path) -> None:
    s = store(tmp_path)
    with pytest.raises(NotFound) as got:
        s.add("ci", team="red")
    assert got.value.message == "no team 'red'; `hangar team create red` makes one"
    with pytest.raises(InvalidRequest):
        s.add("ci", team="Not A Team")
    assert not s.named_file.exists()


def test_a_team_key_is_stored_listed_and_rotated_with_its_team(tmp_path: Path) -> None:
    s = store(tmp_path)
    T.TeamStore(tmp_path / "teams.json").create("red", max_sandboxes=2)
    red = s.add("ci", team="red")
    op = s.add("ops")
    e2b = s.add("agent", e2b=True, team="red")
    assert e2b.startswith("e2b_")
    text = s.named_file.read_text()
    assert "[team=TEAM]" in text.splitlines()[0]  # the header names the format
    assert f"ci sha256:{K.digest(red).hex()} " in text and text.count(" team=red\n") == 2
    assert [(e[0], e[4]) for e in s.entries()] == [
        ("default", None), ("ci", "red"), ("ops", None), ("agent", "red")]
    assert s.team_keys("red") == ["ci", "agent"] and s.team_keys("blue") == []

    new = s.rotate("ci")
    keys, problems = K.read_named(s.named_file)
    assert problems == []
    ci = next(k for k in keys if k.name == "ci")
    assert ci.team == "red" and ci.digest == K.digest(new) != K.digest(red)
    assert next(k for k in keys if k.name == "ops").team is None
    assert K.digest(op) == next(k for k in keys if k.name == "ops").digest

    s.named_file.write_text(text + "broken line\n")
    with pytest.raises(ConfigError):
        s.team_keys("red")


def test_the_ring_tells_a_keys_team(tmp_path: Path) -> None:
    s = store(tmp_path)
    T.TeamStore(tmp_path / "teams.json").create("red")
    red = s.add("ci", team="red")
    op = s.add("ops")
    ring = K.KeyRing(s.default_file, s.named_file)
    ring.load()
    shared = "hk_" + "s" * 8 + "0123456789abcdefghijklmnopqrstuvwxyz"
    ring.share("cluster", [K.digest(shared).hex()])
    default = s.default_file.read_text().strip()
    found = {k: ring.match(k) for k in (red, op, default, shared)}
    assert found == {red: "ci", op: "ops", default: "default", shared: "cluster"}
    assert [ring.team_of(n) for n in ("ci", "ops", "default", "cluster", "nobody")] == [
        "red", None, None, None, None]

    # A key added later is seen with its team on the next refresh, without a restart.
    blue_key = (T.TeamStore(tmp_path / "teams.json").create("blue"), s.add("bot", team="blue"))[1]
    os.utime(s.named_file, ns=(1, 1))  # a change within the mtime granularity is seen too
    ring.refresh()
    assert ring.match(blue_key) == "bot" and ring.team_of("bot") == "blue"
    assert ring.team_of("ci") == "red"


def cli(data_dir: Path, *args: str, url: str = "http://127.0.0.1:1",
        key: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HANGAR_DATA_DIR": str(data_dir), "PYTHONPATH": str(SRC),
           "HANGAR_URL": url, "COLUMNS": "200"}
    env.pop("HANGAR_API_KEY", None)
    if key is not None:
        env["HANGAR_API_KEY"] = key
    return subprocess.run([sys.executable, "-m", "hangar.cli", *args], env=env, text=True,
                          capture_output=True, timeout=120)


def test_hangar_key_add_team_and_ls(tmp_path: Path) -> None:
    store(tmp_path)
    r = cli(tmp_path, "key", "add", "ci", "--team", "red")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "no team 'red'; `hangar team create red` makes one" in r.stderr
    r = cli(tmp_path, "key", "add", "ci", "--team", "[/x]")  # markup is shown, not read
    assert r.returncode == 1 and "[/x]" in r.stderr and "Traceback" not in r.stderr

    T.TeamStore(tmp_path / "teams.json").create("red")
    r = cli(tmp_path, "key", "add", "ci", "--team", "red")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().startswith("hk_") and "of team 'red'" in r.stderr
    assert cli(tmp_path, "key", "add", "ops").returncode == 0
    r = cli(tmp_path, "key", "ls")
    assert r.returncode == 0, r.stderr
    cells = table(r.stdout)
    assert cells[0][:2] == ["name", "team"]
    rows = {c[0]: c[1] for c in cells[1:]}
    assert (rows["default"], rows["ci"], rows["ops"]) == ("-", "red", "-")


def test_hangar_team_set_refuses_contradictions_before_any_request(tmp_path: Path) -> None:
    r = cli(tmp_path, "team", "set", "red", "--max-vcpus", "4", "--no-max-vcpus")
    assert r.returncode == 2 and "--max-vcpus or --no-max-vcpus, not both" in r.stderr
    r = cli(tmp_path, "team", "set", "red")
    assert r.returncode == 2 and "nothing to change" in r.stderr
    r = cli(tmp_path, "team", "create", "red", "--max-vcpus", "-1")
    assert r.returncode == 2 and "Traceback" not in r.stderr


def test_the_wire_schema_follows_the_teams_module() -> None:
    assert S.LIMIT_NAMES == T.LIMITS
    assert S.TEAM_NAME == T.NAME.pattern and S.LIMIT_MAX == T.LIMIT_MAX


def test_the_sdk_refuses_an_unknown_limit_before_sending() -> None:
    """Port 1 answers nothing: the error comes from the SDK's own check."""
    key = "hk_" + "k" * 4 + "0123456789abcdefghijklmnopqrstuvwxyzAB"
    with Hangar("http://127.0.0.1:1", key) as h:
        with pytest.raises(InvalidRequest) as got:
            h.create_team("red", max_cpus=4)
        assert "'max_cpus' is not a team limit" in got.value.message
        with pytest.raises(InvalidRequest):
            h.update_team("red", max_ram=None)

    async def run() -> None:
        async with AsyncHangar("http://127.0.0.1:1", key) as a:
            with pytest.raises(InvalidRequest):
                await a.create_team("red", max_cpus=4)

    asyncio.run(run())


def table(stdout: str) -> list[list[str]]:
    """The cells of a rich table's rows (the header first)."""
    return [[c.strip() for c in re.split("[│┃]", line)[1:-1]]
            for line in stdout.splitlines() if line.startswith(("│", "┃"))]


def test_hangar_team_commands_against_a_server(server: Server) -> None:
    d, url = server.data_dir, server.url

    def run(*args: str, key: str | None = None) -> subprocess.CompletedProcess[str]:
        return cli(d, *args, url=url, key=key)

    r = run("team", "create", "cli-red", "--max-sandboxes", "2", "--max-vcpus", "4")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ("team cli-red: max_sandboxes=2 max_vcpus=4 max_memory_mib=- "
                                "max_disk_mib=- max_volumes_mib=-")
    r = run("team", "create", "cli-red")
    assert r.returncode == 1 and "cli-red" in r.stderr and "Traceback" not in r.stderr
    r = run("team", "ls")
    assert r.returncode == 0, r.stderr
    rows = {c[0]: c[1:] for c in table(r.stdout)}
    assert rows["name"][:5] == ["sandboxes", "vCPUs", "memory (MiB)", "disk (MiB)",
                                "volumes (MiB)"]
    assert rows["cli-red"][:5] == ["0 / 2", "0 / 4", "0 / -", "0 / -", "0 / -"]

    r = run("team", "set", "cli-red", "--no-max-vcpus", "--max-memory-mib", "2048")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ("team cli-red: max_sandboxes=2 max_vcpus=- "
                                "max_memory_mib=2048 max_disk_mib=- max_volumes_mib=-")
    r = run("team", "set", "no-such-team", "--max-vcpus", "1")
    assert r.returncode == 1 and "no-such-team" in r.stderr

    # A key of the team: made on the host; the team's routes are closed to it.
    r = run("key", "add", "cli-red-ci", "--team", "cli-red")
    assert r.returncode == 0, r.stderr
    team_key = r.stdout.strip()
    try:
        r = run("team", "ls", key=team_key)
        assert r.returncode == 1 and "a team's key cannot use /teams" in r.stderr
        r = run("team", "rm", "cli-red")  # it still holds a key
        assert r.returncode == 1 and "cli-red-ci" in r.stderr
    finally:
        assert run("key", "rm", "cli-red-ci").returncode == 0
    r = run("team", "rm", "cli-red")
    assert r.returncode == 0, r.stderr
    assert "cli-red" not in run("team", "ls").stdout
