"""``hangar.durable``: all-or-nothing writes, and the first key file never half written."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from hangar import durable
from hangar.keys import create_default, read_default


def test_atomic_write_replaces_whole_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "record"
    durable.atomic_write(target, b"one", 0o600)
    durable.atomic_write(target, b"two" * 1000, 0o640)
    assert target.read_bytes() == b"two" * 1000
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["record"]


def test_exclusive_keeps_the_first_writer(tmp_path: Path) -> None:
    target = tmp_path / "api-key"
    durable.atomic_write(target, b"first\n", exclusive=True)
    with pytest.raises(FileExistsError):
        durable.atomic_write(target, b"second\n", exclusive=True)
    assert target.read_bytes() == b"first\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["api-key"]


def test_a_failed_write_leaves_the_old_file(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "record"
    target.write_bytes(b"old")

    def no_sync(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", no_sync)
    with pytest.raises(OSError):
        durable.atomic_write(target, b"new", 0o600)
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["record"]


def test_the_first_key_is_whole_or_absent(tmp_path: Path) -> None:
    key_file = tmp_path / "api-key"
    key = create_default(key_file)
    assert read_default(key_file) == key and stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert create_default(key_file) == key  # a second start finds it
    # A kill before the rename leaves only a temporary file, which is not the key file:
    # the next start makes the key.
    os.unlink(key_file)
    (tmp_path / ".api-key.12345.tmp").write_text("")
    assert read_default(key_file) is None
    assert create_default(key_file) != key and read_default(key_file)
    # An empty key file (left by an older version) is refused with the fix named.
    key_file.write_text("")
    from hangar.errors import ConfigError

    with pytest.raises(ConfigError, match="is empty.*hangar key rotate"):
        read_default(key_file)


# -- class 1 (review 29c M1, L1): key files root reads and writes in the server's folder --


def _planted(folder: Path) -> dict[str, Path]:
    """What a compromised server may put where root reads a key file: a link to a file
    root may read, a link to /dev/zero, a FIFO, and a file past the size cap."""
    secret = folder / "root-only"
    secret.write_text("hk_" + "s" * 60)
    (folder / "link").symlink_to(secret)
    (folder / "zero").symlink_to("/dev/zero")
    os.mkfifo(folder / "fifo")
    (folder / "huge").write_bytes(b"x" * ((1 << 20) + 1))
    return {n: folder / n for n in ("link", "zero", "fifo", "huge")}


def test_read_small_takes_only_a_small_regular_file(tmp_path: Path) -> None:
    planted = _planted(tmp_path)
    (tmp_path / "ok").write_bytes(b"abc")
    assert durable.read_small(tmp_path / "ok", 3) == b"abc"
    with pytest.raises(FileNotFoundError):
        durable.read_small(tmp_path / "absent", 10)
    for name, errno_ in (("link", 40), ("zero", 40), ("fifo", 22), ("huge", 27)):
        with pytest.raises(OSError) as err:  # at once: a FIFO never blocks the reader
            durable.read_small(planted[name], 4096)
        assert err.value.errno == errno_, name


def test_key_files_planted_by_the_server_are_refused_with_a_message(tmp_path: Path) -> None:
    from hangar.core.ports import PortKey
    from hangar.errors import ConfigError
    from hangar.keys import read_named
    planted = _planted(tmp_path)
    for path in planted.values():
        with pytest.raises(ConfigError, match="cannot read the API key file"):
            read_default(path)
        keys, problems = read_named(path)
        assert keys == [] and len(problems) == 1 and "cannot read" in problems[0]
        with pytest.raises(ConfigError, match="cannot read the port key"):
            PortKey(path).check()


def test_atomic_write_never_opens_what_was_planted_at_its_temporary_name(
        tmp_path: Path) -> None:
    target = tmp_path / "api-key"
    tmp = tmp_path / f".api-key.{os.getpid()}.tmp"
    os.mkfifo(tmp)  # a FIFO: an open for writing would block until a reader came
    durable.atomic_write(target, b"new\n")
    assert target.read_bytes() == b"new\n" and not tmp.exists()
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    tmp.symlink_to(victim)
    durable.atomic_write(target, b"newer\n")
    assert target.read_bytes() == b"newer\n" and victim.read_bytes() == b"keep"
