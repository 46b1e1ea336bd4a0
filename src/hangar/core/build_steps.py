"""A template build's steps, run in its build sandbox's guest.

``Steps.run`` takes a sandbox that a build booted (``hangar.core.builds``) and
runs each step in its guest, in order, the way a Dockerfile's instructions
run: ``Copy`` places an uploaded archive's files, ``Run`` runs a shell command
as a user, ``Env``, ``Workdir`` and ``User`` change what the next steps (and
the template's sandboxes) get. Then the start command is started in the
background and the ready command run until it exits 0.

Nothing here runs on the host: every command is a guest command (as root for
the placing of files, as the step's user for ``Run``), so a hostile build
harms its own build VM only. A command's output is passed to ``say`` line by
line (``LINE_MAX`` bytes at most per line) as it comes.
"""

from __future__ import annotations

import asyncio
import posixpath
import shlex
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from hangar.core.commands import Command
from hangar.errors import HangarError
from hangar.guest.paths import RUNTIME_DIR

if TYPE_CHECKING:
    from hangar.core.sandboxes import SandboxManager

LINE_MAX = 4096
"""Longest log line kept from a step's output, bytes (a longer one is cut)."""
STEP_TIMEOUT_S = 3600.0
"""Longest one ``Run`` step may take, seconds."""
READY_TRY_S = 30.0
"""Longest one run of the ready command may take, seconds."""
READY_PAUSE_S = 0.5
"""Pause between two runs of the ready command that failed, seconds."""
START_TAIL = 4096
"""Bytes of a start command's output shown when it ends before it is ready."""
START_TAG = "template-start"
"""The tag of the start command's process in the guest (``hangar.core.processes``)."""
STAGE = "/tmp/.hangar-build"
"""Where a build's uploaded archives are put in the guest before their files are placed."""
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

Say = Callable[[str, str], None]
"""A log line's level (``info``, ``error``...) and its text."""


@dataclass(frozen=True)
class Copy:
    """Place the files of the uploaded archive ``files`` (its content hash) that ``src``
    (a path or glob relative to the archive's root) names at ``dest``, as ``COPY`` does:
    a folder's contents go into ``dest``; one file becomes ``dest`` unless it ends in
    ``/`` or is a folder. ``owner``: ``user[:group]`` (None: the current user);
    ``mode``: permission bits of every placed file (None: the archive's)."""

    files: str
    src: str
    dest: str
    owner: str | None = None
    mode: int | None = None


@dataclass(frozen=True)
class Run:
    """Run ``command`` with ``bash -c`` (``sh`` without bash) as ``user`` (None: the
    current user) in the current folder."""

    command: str
    user: str | None = None


@dataclass(frozen=True)
class Env:
    """Set environment variables for the next steps and the template's sandboxes."""

    values: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Workdir:
    """The folder the next steps (and the start command) run in; made if missing, and
    then the current user's."""

    path: str


@dataclass(frozen=True)
class User:
    """The user the next steps (and the start command) run as."""

    name: str


Step = Copy | Run | Env | Workdir | User


@dataclass(frozen=True)
class State:
    """What the steps so far left: the user, folder and environment of the next one."""

    user: str
    workdir: str
    env: dict[str, str] = field(default_factory=dict)


class StepFailed(HangarError):
    """A build step failed; ``step`` is its 0-based index, -1 for the start or ready
    command (E2B's ``reason.step`` is then ``finalize``)."""

    status, code = 400, "build_failed"

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message, step=step)
        self.step = step


def describe(step: Step) -> str:
    """A step as a Dockerfile line, for the log."""
    match step:
        case Copy():
            return f"COPY {step.src} {step.dest}"
        case Run():
            return f"RUN {step.command}" + (f" (as {step.user})" if step.user else "")
        case Env():
            return "ENV " + " ".join(f"{k}={v}" for k, v in step.values)
        case Workdir():
            return f"WORKDIR {step.path}"
        case User():
            return f"USER {step.name}"


# the placing of one archive's files, as root in the guest; argv: archive, src, dest,
# owner ("" for none), mode ("" for none)
_PLACE = r"""
import glob, os, shutil, subprocess, sys, tarfile, tempfile
tar, src, dest, owner, mode = sys.argv[1:6]
stage = tempfile.mkdtemp(prefix=".hangar-copy.", dir="/tmp")
try:
    # no tar program needed (busybox's lacks options); modes kept as Docker's COPY keeps
    # them (the build's own archive, in its own guest, where its RUN steps are root too)
    with tarfile.open(tar) as t:
        t.extractall(stage, **({"filter": "fully_trusted"} if hasattr(tarfile, "tar_filter")
                               else {}))
    matches = sorted(glob.glob(os.path.join(stage, src), recursive=True))
    if not matches:
        sys.exit("no file of the upload matches " + src)
    def isdir(p):
        return os.path.isdir(p) and not os.path.islink(p)
    into = dest.endswith("/") or len(matches) > 1 or isdir(matches[0]) or isdir(dest)
    made = not os.path.lexists(dest)
    pairs = []
    if into:
        os.makedirs(dest, exist_ok=True)
        for m in matches:
            if isdir(m):
                pairs += [(os.path.join(m, n), os.path.join(dest, n)) for n in os.listdir(m)]
            else:
                pairs.append((m, os.path.join(dest, os.path.basename(m))))
    else:
        os.makedirs(os.path.dirname(dest) or "/", exist_ok=True)
        pairs.append((matches[0], dest))
    for a, b in pairs:
        if isdir(a):
            shutil.copytree(a, b, symlinks=True, dirs_exist_ok=True)
        else:
            if os.path.lexists(b) and not isdir(b):
                os.unlink(b)
            shutil.copy2(a, b, follow_symlinks=False)
    placed = [b for _, b in pairs] + ([dest] if into and made else [])
    for top in placed:
        todo = [top]
        if isdir(top):
            for root, dirs, files in os.walk(top):
                todo += [os.path.join(root, n) for n in dirs + files]
        for p in todo:
            if owner:  # "user" alone: that user and its login group, as Docker's --chown
                who = owner if ":" in owner else owner + ":"
                subprocess.run(["chown", "-h", who, p], check=True)
            if mode and not os.path.islink(p):
                os.chmod(p, int(mode, 8))
finally:
    shutil.rmtree(stage, ignore_errors=True)
"""


HOME_OF = ('h=$(getent passwd "$u" 2>/dev/null | cut -d: -f6); [ -n "$h" ] || '
           'h=$(while IFS=: read -r n _ _ _ _ d _; do [ "$n" = "$u" ] && { echo "$d"; break; }; '
           'done < /etc/passwd)')
"""Shell that sets ``h`` to the home folder of user ``$u``: from the passwd database, else
read from /etc/passwd by the shell itself (images without getent, such as busybox's)."""


class Steps:
    """Runs a build's steps in one sandbox (``sandbox_id``) through ``manager``'s verbs."""

    def __init__(self, manager: SandboxManager, sandbox_id: str, say: Say,
                 archive: Callable[[str], Path],
                 on_step: Callable[[int, Step], None] | None = None) -> None:
        self.m = manager
        self.sid = sandbox_id
        self.say = say
        self.archive = archive
        """The host path of an uploaded archive, by its content hash."""
        self.on_step = on_step
        """Called with a step's 0-based index and the step as it begins (never with
        anything a guest printed: a guest's line may look like a step's)."""
        self._homes: dict[str, str] = {"root": "/root"}

    async def run(self, steps: tuple[Step, ...], state: State, first: int = 0,
                  after: Callable[[int, State, float], Awaitable[None]] | None = None
                  ) -> State:
        """Run ``steps`` in order from the ``first`` (0-based; the earlier ones' work is
        in the sandbox already) from ``state``; the state they leave. ``after`` is
        awaited after each step with its index, the state it left and the seconds it
        took. Raises StepFailed."""
        for i in range(first, len(steps)):
            step = steps[i]
            if self.on_step is not None:
                self.on_step(i, step)
            self.say("info", f"[builder {i + 1}/{len(steps)}] {describe(step)}")
            t0 = time.monotonic()
            try:
                state = await self._one(step, state)
            except StepFailed as e:
                raise StepFailed(str(e), i) from None
            except HangarError as e:
                raise StepFailed(f"failed to {describe(step)}: {e}", i) from None
            if after is not None:
                await after(i, state, time.monotonic() - t0)
        return state

    async def _one(self, step: Step, state: State) -> State:
        match step:
            case Env():
                return replace(state, env={**state.env, **dict(step.values)})
            case User():
                old_home = await self._check_user(state.user, describe(step))
                home = await self._check_user(step.name, describe(step))
                # the folder follows the user to its home unless a WORKDIR set another
                workdir = home if state.workdir == old_home else state.workdir
                return replace(state, user=step.name, workdir=workdir)
            case Workdir():
                path = posixpath.normpath(posixpath.join(state.workdir, step.path))
                await self._root(f"mkdir -p {shlex.quote(path)} && chown "
                                 f"{shlex.quote(state.user)}: {shlex.quote(path)}",
                                 f"WORKDIR {step.path}")
                return replace(state, workdir=path)
            case Run():
                user = step.user or state.user
                await self._check_user(user, step.command)
                await self._stream(self._as(user, step.command, state), step.command)
                return state
            case Copy():
                await self._copy(step, state)
                return state

    async def _check_user(self, user: str, what: str) -> str:
        """The home folder of ``user`` in the guest; raise StepFailed in E2B's words when
        there is no such user."""
        if user in self._homes:
            return self._homes[user]
        script = f'id -u -- "$0" >/dev/null || exit 1; u=$0; {HOME_OF}; echo "$h"'
        r = await self.m.exec(self.sid, Command(command="/bin/sh", args=["-c", script, user],
                                                timeout_s=READY_TRY_S))
        if r.exit_code != 0:
            raise StepFailed(f"failed to run command {what!r}: command failed: "
                             f"unauthenticated: invalid username: {user!r}", -1)
        home = r.stdout.head.decode("utf-8", "replace").strip() or "/"
        self._homes[user] = home
        return home

    def _as(self, user: str, script: str, state: State) -> Command:
        """``script`` (shell text) as ``user``, in ``state``'s folder and environment."""
        shell = "command -v bash >/dev/null && exec bash -c \"$0\" || exec sh -c \"$0\""
        env = {"PATH": PATH, **state.env}
        if user == "root":
            return Command(command="/bin/sh", args=["-c", shell, script], cwd=state.workdir,
                           env={"HOME": "/root", "USER": "root", **env})
        # setpriv by uid and gid (the user's own group may have another name); its home
        # from the passwd database; the user was checked to exist
        wrap = (f'u=$1; shift; {HOME_OF}; export HOME="${{h:-/}}" '
                'USER="$u" LOGNAME="$u"; exec setpriv --reuid="$(id -u "$u")" '
                '--regid="$(id -g "$u")" --init-groups /bin/sh -c "$@"')
        return Command(command="/bin/sh", args=["-c", wrap, "sh", user, shell, script],
                       cwd=state.workdir, env=env)

    async def _root(self, script: str, what: str) -> None:
        r = await self.m.exec(self.sid, Command(command="/bin/sh", args=["-c", script],
                                                timeout_s=STEP_TIMEOUT_S))
        if r.exit_code != 0:
            why = (r.stderr.head or r.stdout.head).decode("utf-8", "replace").strip()[:500]
            raise StepFailed(f"failed to {what}: {why or f'exit {r.exit_code}'}", -1)

    async def _stream(self, cmd: Command, what: str, timeout_s: float = STEP_TIMEOUT_S) -> None:
        """Run ``cmd``, its output to the log line by line; raise StepFailed unless it
        exits 0."""
        cmd = replace(cmd, timeout_s=timeout_s)
        parts = {"stdout": b"", "stderr": b""}
        code: int | None = None
        timed_out = False
        async for ev in self.m.exec_stream(self.sid, cmd):
            if ev.kind in parts:
                buf = parts[ev.kind] + ev.data
                *lines, rest = buf.split(b"\n")
                for line in lines:
                    self._line(ev.kind, line)
                if len(rest) > LINE_MAX:
                    self._line(ev.kind, rest)
                    rest = b""
                parts[ev.kind] = rest
            elif ev.kind == "exit" and ev.result is not None:
                code, timed_out = ev.result.exit_code, ev.result.timed_out
        for kind, rest in parts.items():
            if rest:
                self._line(kind, rest)
        if timed_out:
            raise StepFailed(f"failed to run command {what!r}: timed out after "
                             f"{timeout_s:.0f} s", -1)
        if code != 0:
            raise StepFailed(f"failed to run command {what!r}: command failed: exit status "
                             f"{code}", -1)

    def _line(self, kind: str, line: bytes) -> None:
        text = line[:LINE_MAX].decode("utf-8", "replace").rstrip("\r")
        self.say("error" if kind == "stderr" else "info", text)

    async def _copy(self, step: Copy, state: State) -> None:
        path = self.archive(step.files)
        inguest = f"{STAGE}/{step.files}.tar"

        async def chunks() -> AsyncIterator[bytes]:
            with open(path, "rb") as f:
                while chunk := await asyncio.to_thread(f.read, 1 << 20):
                    yield chunk

        await self._root(f"mkdir -p {STAGE} && chmod 700 {STAGE}", "make the staging folder")
        await self.m.files.write(self.sid, inguest, chunks(), 0o600)
        dest = posixpath.join(state.workdir, step.dest)
        if step.dest.endswith("/") and not dest.endswith("/"):
            dest += "/"
        owner = step.owner or state.user
        mode = "" if step.mode is None else format(step.mode, "o")
        # the image's python3, or Hangar's guest runtime in an image pulled without one
        cmd = Command(command="/bin/sh", args=[
            "-c", f'p={RUNTIME_DIR}/bin/python3; [ -x "$p" ] || p=python3; exec "$p" -c "$@"',
            "sh", _PLACE, inguest, step.src, dest, owner, mode], timeout_s=STEP_TIMEOUT_S)
        try:
            r = await self.m.exec(self.sid, cmd)
        finally:
            await self.m.exec(self.sid, Command(command="rm", args=["-f", inguest]))
        if r.exit_code != 0:
            why = r.stderr.head.decode("utf-8", "replace").strip().splitlines()
            raise StepFailed(f"failed to COPY {step.src} {step.dest}: "
                             f"{why[-1] if why else f'exit {r.exit_code}'}", -1)

    async def start(self, start: str | None, ready: str | None, state: State,
                    timeout_s: float) -> None:
        """Start ``start`` in the background (as the state's user, in its folder and
        environment), then run ``ready`` until it exits 0, for at most ``timeout_s``.
        Raises StepFailed (step -1) when the start fails, ends before ``ready`` passes
        (with its output's tail in the log), or ``ready`` never passes."""
        pid: int | None = None
        if start:
            self.say("info", f"[builder] START {start}")
            await self._check_user(state.user, start)
            try:
                info = await self.m.processes.start(
                    self.sid, self._as(state.user, start, state), tag=START_TAG)
            except HangarError as e:
                raise StepFailed(f"failed to start {start!r}: {e}", -1) from None
            pid = info.pid
        if not ready:
            return
        self.say("info", f"[builder] waiting for the ready command: {ready}")
        deadline = time.monotonic() + timeout_s
        while True:
            cmd = replace(self._as(state.user, ready, state), timeout_s=READY_TRY_S)
            r = await self.m.exec(self.sid, cmd)
            if r.exit_code == 0:
                self.say("info", "[builder] ready")
                return
            if pid is not None:
                await self._still_running(pid, start or "")
            if time.monotonic() > deadline:
                raise StepFailed(f"the ready command {ready!r} did not pass within "
                                 f"{timeout_s:.0f} s (last exit status {r.exit_code})", -1)
            await asyncio.sleep(READY_PAUSE_S)

    async def _still_running(self, pid: int, start: str) -> None:
        """Raise StepFailed when the start command (``pid``) has ended, its output's last
        ``START_TAIL`` bytes passed to the log first."""
        entry = next((p for p in await self.m.processes.list(self.sid) if p.pid == pid), None)
        if entry is None or entry.state == "running":
            return
        out = b""
        async for item in self.m.processes.attach(self.sid, pid, replay=True):
            data = getattr(item, "data", b"") or b""
            out = (out + data)[-START_TAIL:]
        for line in out.decode("utf-8", "replace").splitlines():
            self.say("error", line[:LINE_MAX])
        how = (f"signal {entry.signal}" if entry.signal else f"exit status {entry.exit_code}")
        raise StepFailed(f"the start command {start!r} ended ({how}) before the ready "
                         "command passed", -1)


async def remove_quietly(delete: Callable[[], Awaitable[None]]) -> None:
    """Run ``delete``, ignoring a sandbox that is already gone."""
    try:
        await delete()
    except HangarError:
        pass


__all__ = ["Copy", "Env", "Run", "State", "Step", "StepFailed", "Steps", "User", "Workdir",
           "describe", "remove_quietly"]
