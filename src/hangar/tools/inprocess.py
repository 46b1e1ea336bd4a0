"""The in-process tier: tools run on this host in a bubblewrap sandbox.

Every call is one ``bwrap`` process (Debian's ``bubblewrap``) with:

* **no network**: a new, empty network namespace (only a loopback of its own);
* **a read-only host system**: ``/usr`` (and the ``/bin``, ``/lib`` links) bound
  read-only, plus an allow-list of harmless ``/etc`` entries (the dynamic
  linker's cache, CA certificates, time zone, Python's site files) and a
  synthesized ``passwd``, ``group`` and ``hosts``. Nothing else of the host is
  visible: not ``/etc/shadow``, ``/root``, ``/home``, ``/var`` (Hangar's key file)
  or ``/run``;
* **a private work folder and /tmp**: per-task host folders bound at ``/work``
  and ``/tmp``, removed when the task ends; every call of the task sees them.
  Everything else is read-only (the sandbox's own root is remounted so);
* **new PID, IPC, UTS and cgroup namespaces**, ``--die-with-parent``,
  ``--new-session`` (no terminal injection), no capabilities;
* **an allow-listed environment**: ``PATH``, ``HOME=/work``, ``TMPDIR``,
  ``LANG``, plus the host's ``TZ``/``LANG``/``LC_ALL`` when set and what the
  caller passes explicitly; nothing else of Hangar's environment (no key);
* **resource limits** (``setrlimit`` in the child): CPU 30 s (``RLIMIT_CPU``:
  SIGXCPU at the limit, SIGKILL one second later), 256 MiB of address space
  (``RLIMIT_AS``: allocations beyond it fail), files of at most 256 MiB
  (``RLIMIT_FSIZE``), 256 processes of the sandbox user (``RLIMIT_NPROC``);
* **a wall-clock timeout** (default 60 s) after which the whole process
  group is killed; **output capped** at 1 MiB, the rest read, counted and
  dropped (``truncated``).

When Hangar runs as root the sandbox runs as ``nobody`` (uid 65534), so even
a file bound by mistake would be read with nobody's rights; otherwise it
runs as the calling user. Files are read and written through the sandbox
too (``cat`` inside it), so a symlink planted in the work folder resolves
inside the sandbox, never on the host.
"""

from __future__ import annotations

import asyncio
import os
import resource
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass
from typing import Any
from pathlib import Path

from hangar.tools.definitions import MAX_OUTPUT_BYTES, WORK_DIR
from hangar.tools.format import command_result, resolve
from hangar.tools.results import ToolResult, cap_text
from hangar.tools.toolset import ToolSet

BWRAP = "bwrap"
NOBODY = 65534
ETC_ALLOW = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "ssl",
             "ca-certificates", "ca-certificates.conf", "localtime", "timezone", "os-release",
             "debian_version", "mime.types", "nsswitch.conf", "protocols", "services",
             "python3", "python3.11", "python3.12", "python3.13", "inputrc", "magic")
"""Entries of the host's /etc bound read-only (when present); none holds a secret."""
ENV_PASS = ("TZ", "LANG", "LC_ALL")
"""Host variables passed through when set."""
PATH = "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin"


@dataclass(frozen=True)
class ProcessLimits:
    """Limits of one sandboxed process. Seconds, MiB, bytes."""

    cpu_s: int = 30
    memory_mib: int = 256
    file_mib: int = 256
    processes: int = 256
    timeout_s: float = 60.0
    """Default wall-clock timeout of a command."""
    output_bytes: int = MAX_OUTPUT_BYTES
    tmp_mib: int = 256
    """Unused: /tmp is a per-task host folder (kept for a tmpfs variant)."""


@dataclass(frozen=True)
class ProcessResult:
    """A finished sandboxed process. ``stdout``/``stderr`` hold the kept bytes."""

    exit_code: int | None
    signal: int | None
    timed_out: bool
    stdout: bytes
    stderr: bytes
    stdout_total: int
    stderr_total: int
    duration_s: float

    @property
    def truncated(self) -> bool:
        return self.stdout_total > len(self.stdout) or self.stderr_total > len(self.stderr)


def available() -> str | None:
    """None when bubblewrap can run here, else why not."""
    if shutil.which(BWRAP) is None:
        return "bubblewrap is not installed (apt-get install bubblewrap)"
    return None


class Bubblewrap:
    """One task's sandbox on this host: its folders, and a runner of commands in it.

    Call ``close`` to remove the folders (``/work`` and ``/tmp`` of the task).
    Raises RuntimeError at creation when bubblewrap is missing.
    """

    def __init__(self, limits: ProcessLimits | None = None,
                 env: dict[str, str] | None = None) -> None:
        why = available()
        if why:
            raise RuntimeError(why)
        self.limits = limits or ProcessLimits()
        self.extra_env = dict(env or {})
        self.root = Path(tempfile.mkdtemp(prefix="hangar-task-"))
        self.work = self.root / "work"
        self.tmp = self.root / "tmp"
        self.etc = self.root / "etc"
        self.as_nobody = os.geteuid() == 0
        self.root.chmod(0o711)  # the sandbox user may pass through, not list
        for d in (self.work, self.tmp, self.etc):
            d.mkdir(mode=0o755)
        if self.as_nobody:
            for d in (self.work, self.tmp):
                os.chown(d, NOBODY, NOBODY)
        self.tmp.chmod(0o1777)
        user = "nobody" if self.as_nobody else "user"
        uid = NOBODY if self.as_nobody else os.getuid()
        gid = NOBODY if self.as_nobody else os.getgid()
        (self.etc / "passwd").write_text(f"{user}:x:{uid}:{gid}:{user}:{WORK_DIR}:/bin/sh\n")
        (self.etc / "group").write_text(f"{user}:x:{gid}:\n")
        (self.etc / "hosts").write_text("127.0.0.1\tlocalhost\n::1\t\tlocalhost\n")
        (self.etc / "hostname").write_text("sandbox\n")
        self._argv = self._base_argv()

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def _base_argv(self) -> list[str]:
        argv = [BWRAP, "--unshare-all", "--die-with-parent", "--new-session",
                "--hostname", "sandbox", "--ro-bind", "/usr", "/usr"]
        for link in ("bin", "lib", "lib64", "sbin", "lib32", "libx32"):
            target = Path("/") / link
            if target.is_symlink():
                argv += ["--symlink", os.readlink(target), f"/{link}"]
            elif target.is_dir():
                argv += ["--ro-bind", str(target), f"/{link}"]
        for name in ETC_ALLOW:
            if (Path("/etc") / name).exists():
                argv += ["--ro-bind", f"/etc/{name}", f"/etc/{name}"]
        for name in ("passwd", "group", "hosts", "hostname"):
            argv += ["--ro-bind", str(self.etc / name), f"/etc/{name}"]
        argv += ["--proc", "/proc", "--dev", "/dev",
                 "--bind", str(self.tmp), "/tmp", "--bind", str(self.work), WORK_DIR,
                 "--remount-ro", "/", "--clearenv"]
        env = {"PATH": PATH, "HOME": WORK_DIR, "TMPDIR": "/tmp", "LANG": "C.UTF-8",
               "USER": "nobody" if self.as_nobody else "user", "SHELL": "/bin/sh"}
        env.update({k: os.environ[k] for k in ENV_PASS if k in os.environ})
        env.update(self.extra_env)
        for k, v in env.items():
            argv += ["--setenv", k, v]
        return argv

    def _preexec(self) -> None:
        lim = self.limits
        resource.setrlimit(resource.RLIMIT_CPU, (lim.cpu_s, lim.cpu_s + 1))
        mem = lim.memory_mib << 20
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        fsize = lim.file_mib << 20
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
        resource.setrlimit(resource.RLIMIT_NPROC, (lim.processes, lim.processes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    def argv(self, command: list[str], cwd: str = WORK_DIR) -> list[str]:
        """The full bwrap command line that runs ``command`` (argv) in ``cwd``."""
        return [*self._argv, "--chdir", cwd, "--", *command]

    async def run(self, command: list[str], *, cwd: str = WORK_DIR, stdin: bytes | None = None,
                  timeout_s: float | None = None, output_bytes: int | None = None
                  ) -> ProcessResult:
        """Run ``command`` (argv) in the sandbox and wait for it.

        Keeps at most ``output_bytes`` (default 1 MiB) of each stream; reads
        and counts the rest. Kills the process group after ``timeout_s``.
        """
        timeout = timeout_s if timeout_s is not None else self.limits.timeout_s
        keep = output_bytes if output_bytes is not None else self.limits.output_bytes
        started = time.monotonic()
        kwargs: dict[str, Any] = {}
        if self.as_nobody:
            kwargs.update(user=NOBODY, group=NOBODY, extra_groups=[])
        spawn = asyncio.ensure_future(asyncio.create_subprocess_exec(
            *self.argv(command, cwd),
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            start_new_session=True, preexec_fn=self._preexec, close_fds=True,
            **kwargs))  # type: ignore[arg-type]
        try:
            proc = await asyncio.shield(spawn)
        except asyncio.CancelledError:  # cancelled while spawning: end what was spawned
            try:
                proc = await asyncio.wait_for(spawn, 10)
                _kill_group(proc.pid)
                await asyncio.wait_for(proc.wait(), 5)
            except BaseException:
                pass
            raise

        async def drain(stream: asyncio.StreamReader) -> tuple[bytes, int]:
            kept = bytearray()
            total = 0
            while chunk := await stream.read(65536):
                total += len(chunk)
                if len(kept) < keep:
                    kept += chunk[:keep - len(kept)]
            return bytes(kept), total

        async def feed() -> None:
            assert proc.stdin is not None
            try:
                proc.stdin.write(stdin or b"")
                await proc.stdin.drain()
            except (BrokenPipeError, ConnectionResetError):
                pass
            finally:
                proc.stdin.close()

        assert proc.stdout is not None and proc.stderr is not None
        readers = asyncio.gather(drain(proc.stdout), drain(proc.stderr),
                                 feed() if stdin is not None else asyncio.sleep(0))
        timed_out = False
        try:
            try:
                await asyncio.wait_for(asyncio.shield(proc.wait()), timeout)
            except asyncio.TimeoutError:
                timed_out = True
                _kill_group(proc.pid)
                await proc.wait()
            (out, out_total), (err, err_total), _ = await asyncio.wait_for(readers, 10)
        except BaseException:
            _kill_group(proc.pid)
            readers.cancel()
            try:  # reap it, so no process or pipe outlives the call
                await asyncio.wait_for(proc.wait(), 5)
                await readers
            except BaseException:
                pass
            raise
        rc = proc.returncode
        sig = -rc if rc is not None and rc < 0 else None
        if sig is None and rc is not None and rc > 128 and rc - 128 in (
                signal.SIGXCPU, signal.SIGKILL, signal.SIGSEGV):
            sig = rc - 128  # the shell reported its child's death by signal
        return ProcessResult(exit_code=rc if rc is None or rc >= 0 else 128 + (sig or 0),
                             signal=sig, timed_out=timed_out, stdout=out, stderr=err,
                             stdout_total=out_total, stderr_total=err_total,
                             duration_s=time.monotonic() - started)


def _kill_group(pid: int) -> None:
    if pid <= 1:
        return
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# ---------------------------------------------------------------------------------------------
# the tier's tools


MEMORY_SIGNS = (b"MemoryError", b"Cannot allocate memory", b"std::bad_alloc", b"out of memory",
                b"Out of memory")


class InProcessTools(ToolSet):
    """``run_command``, ``read_file`` and ``write_file`` in one task's ``Bubblewrap``."""

    tier = "in-process"

    def __init__(self, limits: ProcessLimits | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.box = Bubblewrap(limits, env)

    async def close(self) -> None:
        self.box.close()

    async def run_command(self, args: dict[str, Any], time_left: float | None) -> ToolResult:
        timeout = float(args.get("timeout_s") or self.box.limits.timeout_s)
        if time_left is not None:
            timeout = max(0.1, min(timeout, time_left))
        r = await self.box.run(["/bin/sh", "-c", str(args["command"])],
                               cwd=resolve(args.get("cwd")),
                               timeout_s=timeout)
        lim = self.box.limits
        note = None
        if not r.timed_out and (r.signal == signal.SIGXCPU or (
                r.signal == signal.SIGKILL and r.duration_s >= lim.cpu_s)):
            note = f"killed: CPU time limit of {lim.cpu_s} s reached"
        elif r.exit_code != 0 and any(s in r.stderr for s in MEMORY_SIGNS):
            note = (f"out of memory: the in-process tier allows {lim.memory_mib} MiB "
                    f"(exit code {r.exit_code})")
        return command_result(exit_code=r.exit_code, signal=r.signal, timed_out=r.timed_out,
                              stdout=r.stdout, stderr=r.stderr, stdout_total=r.stdout_total,
                              stderr_total=r.stderr_total, duration_s=r.duration_s,
                              timeout_s=timeout, limit_note=note)

    async def read_file(self, args: dict[str, Any], time_left: float | None = None
                        ) -> ToolResult:
        path = resolve(str(args["path"]))
        limit = int(args.get("max_bytes") or MAX_OUTPUT_BYTES)
        r = await self.box.run(["cat", "--", path], output_bytes=limit)
        if r.exit_code != 0:
            return ToolResult.failure(r.stderr.decode("utf-8", "replace").strip()
                                      or f"cannot read {path}", r.duration_s)
        text, cut = cap_text(r.stdout, limit)
        return ToolResult(ok=True, output=text, truncated=cut or r.stdout_total > limit,
                          duration_s=round(r.duration_s, 3),
                          data={"path": path, "size": r.stdout_total})

    async def write_file(self, args: dict[str, Any], time_left: float | None = None
                         ) -> ToolResult:
        path = resolve(str(args["path"]))
        data = str(args["content"]).encode()
        script = 'mkdir -p -- "$(dirname -- "$1")" && cat > "$1"'
        r = await self.box.run(["/bin/sh", "-c", script, "write_file", path], stdin=data)
        if r.exit_code != 0:
            return ToolResult.failure(r.stderr.decode("utf-8", "replace").strip()
                                      or f"cannot write {path}", r.duration_s)
        return ToolResult(ok=True, output=f"wrote {len(data)} bytes to {path}",
                          duration_s=round(r.duration_s, 3),
                          data={"path": path, "size": len(data)})

    HANDLERS = {"run_command": run_command, "read_file": read_file, "write_file": write_file}
