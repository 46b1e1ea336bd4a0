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
