"""Running the host tools an image build needs, with errors that say which step failed.

Every external command of a build goes through ``run``: its output is read
line by line (so a progress callback can show it), the last lines are kept,
and a non-zero exit or a timeout becomes ``ImageError`` carrying the step's
name and that tail. Also here: the temporary-directory helpers, which unmount
anything left mounted below a tree (debootstrap mounts /proc and /sys in its
target) before deleting it, so a failed build can never delete through a
mount into the host; and ``inside``, which resolves a guest path in a tree
without ever leaving it (trees made from OCI images are not ours).
"""

from __future__ import annotations

import collections
import os
import shutil
import subprocess
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from hangar.errors import ImageError

Progress = Callable[[str], None]

TAIL_LINES = 25
MAX_LINE = 65536
"""Characters of one output line kept (a longer one is split): a build step's output is
the image's to choose."""
MAX_OUTPUT = 8 << 20
"""Characters of a command's output kept for its caller; past that only the tail is."""


def require_tools(*names: str) -> None:
    """Raise ``ImageError`` naming every tool of ``names`` missing from PATH (and /usr/sbin)."""
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    missing = [n for n in names if shutil.which(n, path=path) is None]
    if missing:
        raise ImageError(
            f"host tools missing for an image build: {', '.join(missing)} "
            "(install debootstrap, e2fsprogs, kmod, dpkg and apt)",
            missing=missing,
        )


def run(
    step: str,
    argv: Sequence[str | os.PathLike[str]],
    *,
    progress: Progress | None = None,
    echo: Callable[[str], bool] | None = None,
    timeout: float = 1800.0,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
) -> str:
    """Run ``argv`` to completion and return its combined stdout+stderr.

    ``echo(line)`` picks which output lines go to ``progress`` (none when
    unset). ``timeout`` is in seconds; on expiry the process is killed.
    """
    argv = [os.fspath(a) for a in argv]
    full_env = dict(os.environ, LC_ALL="C", DEBIAN_FRONTEND="noninteractive")
    full_env["PATH"] = full_env.get("PATH", "/usr/bin:/bin") + ":/usr/sbin:/sbin"
    if env:
        full_env.update(env)
    try:
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            cwd=cwd, env=full_env, text=True, errors="replace", start_new_session=True,
        )
    except OSError as e:
        raise ImageError(f"image build step {step!r} could not start {argv[0]}: {e}", step=step) from e
    timed_out = threading.Event()

    def kill() -> None:
        timed_out.set()
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass

    timer = threading.Timer(timeout, kill)
    timer.daemon = True
    timer.start()
    out: list[str] = []
    kept = 0
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    try:
        assert proc.stdout is not None
        for line in iter(lambda: proc.stdout.readline(MAX_LINE), ""):  # type: ignore[union-attr]
            line = line.rstrip("\n")
            kept += len(line) + 1
            if kept <= MAX_OUTPUT:
                out.append(line)
            tail.append(line)
            if progress is not None and echo is not None and echo(line):
                progress(line)
        rc = proc.wait()
    except BaseException:
        kill()
        proc.wait()
        raise
    finally:
        timer.cancel()
    if timed_out.is_set():
        raise ImageError(
            f"image build step {step!r} timed out after {timeout:.0f} s:\n" + "\n".join(tail),
            step=step, timeout_s=timeout,
        )
    if rc != 0:
        raise ImageError(
            f"image build step {step!r} failed (exit {rc}):\n" + "\n".join(tail),
            step=step, exit_code=rc,
        )
    return "\n".join(out)


def mounts_under(path: Path) -> list[Path]:
    """Mount points at or below ``path``, deepest first (from /proc/self/mountinfo)."""
    root = os.path.realpath(path)
    found: list[str] = []
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                mp = line.split()[4].encode().decode("unicode_escape")
                if mp == root or mp.startswith(root + "/"):
                    found.append(mp)
    except OSError:
        return []
    return [Path(p) for p in sorted(found, key=len, reverse=True)]


def remove_tree(path: Path) -> None:
    """Delete ``path`` after lazily unmounting anything mounted below it.

    Refuses (raises ``ImageError``) rather than delete through a mount that
    would not go away.
    """
    if not path.exists() and not path.is_symlink():
        return
    for mp in mounts_under(path):
        subprocess.run(["umount", "-l", str(mp)], capture_output=True, check=False)
    left = mounts_under(path)
    if left:
        raise ImageError(f"cannot remove {path}: still mounted: {', '.join(map(str, left))}")
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
        if path.exists():  # e.g. immutable files; try harder once
            subprocess.run(["rm", "-rf", "--one-file-system", str(path)],
                           capture_output=True, check=False)
    else:
        path.unlink(missing_ok=True)


MAX_SYMLINK_HOPS = 40


def inside(root: Path, path: str, *, follow_last: bool = False) -> Path:
    """The host path of ``path`` as a guest whose root is ``root`` sees it; never outside.

    Symlinks in the tree are followed as the guest would follow them
    (absolute targets start at ``root``, ``..`` stops at it), so a tree made
    from someone else's image cannot send a write through a link such as
    ``etc -> /etc`` onto the host. The last component is followed only with
    ``follow_last``: writers replace a link there rather than write through
    it. Raises ``ImageError`` on a symlink loop.
    """
    parts = [p for p in path.split("/") if p not in ("", ".")]
    cur = root
    hops = 0
    while parts:
        name = parts.pop(0)
        if name == "..":
            cur = cur.parent if cur != root else root
            continue
        nxt = cur / name
        if nxt.is_symlink() and (parts or follow_last):
            hops += 1
            if hops > MAX_SYMLINK_HOPS:
                raise ImageError(f"too many symbolic links resolving {path} in the image")
            target = os.readlink(nxt)
            if target.startswith("/"):
                cur = root
            parts = [p for p in target.split("/") if p not in ("", ".")] + parts
            continue
        cur = nxt
    return cur
