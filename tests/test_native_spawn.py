"""The guest agent's native spawn (``hangar.guest._spawn``), built as the initramfs builds
it and run here on the host: what a command starts with, and how each failure is told.

Starting a child straight into a cgroup (``CLONE_INTO_CGROUP``) needs cgroup v2, which
a test host may not have; ``test_guest_limits`` checks that part in a real guest.
"""

from __future__ import annotations

import importlib.util
import os
import select
import signal
import stat
from pathlib import Path
from types import ModuleType

import pytest

from hangar.images import initramfs

SRC = Path(initramfs.package_dir()) / "guest" / "_spawn.c"


@pytest.fixture(scope="module")
def native(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    if not initramfs.native_toolchain():
        pytest.skip("no C compiler or Python headers here: the guest uses posix_spawn")
    built = initramfs.native_build(SRC.read_bytes(), "_spawn")
    assert built is not None, "the toolchain is there, so the module must compile"
    path = tmp_path_factory.mktemp("native") / "_spawn.abi3.so"
    path.write_bytes(built)
    spec = importlib.util.spec_from_file_location("_spawn", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run(native: ModuleType, paths: list[str], argv: list[str], env: dict[str, str] | None = None,
        cwd: str | None = None, ids: tuple[int, int, tuple[int, ...]] = (-1, -1, ()),
        ) -> tuple[int, bytes]:
    """Start, collect stdout+stderr to the end, reap; (exit status, output)."""
    r, w = os.pipe()
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        pid, pidfd = native.spawn(paths, argv, env or {"PATH": "/usr/bin:/bin"}, (null, w, w),
                                  cwd, -1, *ids)
    finally:
        os.close(w)
        os.close(null)
    out = b""
    while chunk := os.read(r, 65536):
        out += chunk
    os.close(r)
    assert select.select([pidfd], [], [], 30)[0] == [pidfd], "the pidfd tells the exit"
    os.close(pidfd)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), out


def test_a_child_gets_its_argv_env_cwd_and_a_session_of_its_own(native, tmp_path) -> None:
    code, out = run(native, ["/bin/sh"], ["sh", "-c", 'echo "$0|$1|$A|$(pwd)"; '
                                                      'ps -o sid= -p $$; echo $$', "zero", "one"],
                    {"A": "é b", "PATH": "/usr/bin:/bin"}, str(tmp_path))
    line, sid, pid = out.decode().split("\n")[:3]
    assert code == 0 and line == f"zero|one|é b|{tmp_path}", out
    assert sid.strip() == pid, "setsid: the command leads a session of its own"


def test_every_signal_starts_at_its_default_and_unblocked(native) -> None:
    """Whatever the agent ignores, catches or blocks (nohup, Python's own SIGPIPE)."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGPIPE, signal.SIGHUP, signal.SIGUSR1)}
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, lambda *_: None)
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
    try:
        code, out = run(native, ["/bin/grep"], ["grep", "-E", "^Sig(Blk|Ign|Cgt)",
                                                "/proc/self/status"])
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        for s, h in saved.items():
            signal.signal(s, h)
    assert code == 0
    fields = dict(line.split() for line in out.decode().splitlines())
    assert int(fields["SigBlk:"], 16) == 0 and int(fields["SigIgn:"], 16) == 0, out


def test_the_callers_fds_stay_with_it(native) -> None:
    """The pipes' other ends and every fd the agent opened (close-on-exec, as Python opens
    each one) stay out of the command."""
    keep = os.open(os.devnull, os.O_RDONLY)
    try:
        code, out = run(native, ["/bin/ls"], ["ls", "/proc/self/fd"])
    finally:
        os.close(keep)
    fds = {int(x) for x in out.split()}
    assert code == 0 and {0, 1, 2} <= fds and keep not in fds, out


def test_the_path_is_searched_as_execvpe_does(native, tmp_path) -> None:
    """A candidate that does not exist is skipped; the first one that exists but cannot
    run gives the error when none runs; else ENOENT, naming the first candidate."""
    plain = tmp_path / "prog"
    plain.write_text("not a program")
    plain.chmod(0o644)
    code, out = run(native, [str(tmp_path / "none"), "/bin/echo"], ["echo", "found"])
    assert (code, out) == (0, b"found\n")
    with pytest.raises(PermissionError) as e:
        run(native, [str(tmp_path / "none"), str(plain), str(tmp_path / "none2")], ["prog"])
    assert e.value.filename == str(tmp_path / "none")
    with pytest.raises(FileNotFoundError):
        run(native, [str(tmp_path / "none"), str(tmp_path / "d" / "none")], ["none"])


def test_a_bad_cwd_is_told_as_the_cwd(native, tmp_path) -> None:
    with pytest.raises(FileNotFoundError) as e:
        run(native, ["/bin/true"], ["true"], cwd=str(tmp_path / "gone"))
    assert e.value.filename == str(tmp_path / "gone")
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(NotADirectoryError) as e2:
        run(native, ["/bin/true"], ["true"], cwd=str(f))
    assert e2.value.filename == str(f)


def test_nul_bytes_are_refused_before_anything_starts(native) -> None:
    for argv, env in ((["a\0b"], {}), (["true"], {"A": "x\0y"}), (["true"], {"A\0": "x"})):
        with pytest.raises(ValueError, match="null byte"):
            run(native, ["/bin/true"], argv, env)
    with pytest.raises(ValueError, match="null byte in cwd"):
        run(native, ["/bin/true"], ["true"], cwd="/tmp\0/etc")


@pytest.mark.skipif(os.geteuid() != 0, reason="takes another user's ids: needs root")
def test_a_command_runs_with_the_users_ids_and_groups_and_no_capability(native, tmp_path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    home.chmod(0o700)
    os.chown(home, 65534, 65534)
    code, out = run(native, ["/bin/sh"], ["sh", "-c", "id -u; id -g; id -G; "
                                          "grep -E '^Cap(Eff|Amb)' /proc/self/status; pwd"],
                    cwd=str(home), ids=(65534, 65534, (65534, 100)))
    uid, gid, groups, eff, amb, cwd = out.decode().splitlines()
    assert code == 0 and (uid, gid) == ("65534", "65534"), out
    assert sorted(groups.split()) == ["100", "65534"]
    assert int(eff.split()[1], 16) == 0 and int(amb.split()[1], 16) == 0
    assert cwd == str(home), "the cwd is entered before the ids change, as root"
    assert (os.getuid(), os.geteuid(), os.getgid()) == (0, 0, 0), "the caller keeps its own"
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
