"""A snapshot's migration stream compressed with zstd on its way to and from disk.

QEMU writes (on save) or reads (on load) its migration stream through one
end of a pipe that the server hands it (QMP ``getfd``); a ``zstd`` process
that the server starts holds the other end and the file, which the server
opened: ``zstd -1`` from the pipe into ``state.mig``, ``zstd -d`` from
``state.mig`` into the pipe. So QEMU stays confined (it opens no file and
spawns nothing), the server's event loop moves no byte, and compression
runs beside the migration on the other core.

Measured on a 512 MiB guest from the ``base`` template (TCG, 2 cores): a
104 MiB stream became 29 MiB at level 1 in 0.34 s of one core (level 3: 27
MiB in 0.47 s), and decompressed in 0.11 s.

``compressing`` and ``decompressing`` each give a ``StreamPipe``: hand
``qemu_end`` to QEMU, then ``handed_over`` (the server's copy must be
closed, or zstd never sees the end of the stream), wait for the migration
``alongside`` zstd, and ``finish`` (a save: zstd's last writes) once it has
completed. Leaving the ``async with`` kills zstd if it still
runs, reaps it and closes every descriptor, pass or fail. Each failure is
an ``EngineError`` (``Timeout`` for time): zstd missing, a file that is not
a whole zstd stream, a write that fails (a full disk), a pipe that breaks.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import re
import shutil
import signal
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TypeVar

from hangar.errors import EngineError, Timeout

LEVEL = 1
"""zstd's compression level: its fastest but the ``--fast`` ones (see the module docstring)."""
MAGIC = b"\x28\xb5\x2f\xfd"
"""The first four bytes of a zstd frame."""
PIPE_BYTES = 1 << 20
"""The pipe's capacity asked for (``F_SETPIPE_SZ``; Linux's default is 64 KiB)."""
T = TypeVar("T")
EXPLAIN_S = 2.0
"""Seconds to wait for zstd's exit when the migration failed, to tell its reason."""
VERIFY_S = 30.0
"""Seconds ``zstd -t`` may take to test a file whose load failed (about 0.1 s per 30 MiB)."""


class StreamPipe:
    """One zstd process at the far end of the pipe whose ``qemu_end`` QEMU gets."""

    def __init__(self, proc: asyncio.subprocess.Process, qemu_end: int, path: Path,
                 saving: bool, sandbox_id: str) -> None:
        self.proc = proc
        self.qemu_end: int = qemu_end
        """The descriptor to pass to QEMU: the pipe's write end on save, its read end on
        load; -1 once ``handed_over``."""
        self.path = path
        self.saving = saving
        self.doing = f"{'writing' if saving else 'reading'} {path.name}"
        self.sandbox_id = sandbox_id
        self._stderr = b""

    def handed_over(self) -> None:
        """Close the server's copy of ``qemu_end`` (QEMU holds its own). Never raises."""
        if self.qemu_end >= 0:
            os.close(self.qemu_end)
            self.qemu_end = -1

    async def finish(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for zstd to exit; raises ``EngineError`` when it
        failed (its own message) and ``Timeout`` when it has not exited by then."""
        self.handed_over()
        try:
            _, err = await asyncio.wait_for(self.proc.communicate(), max(0.1, timeout))
        except TimeoutError:
            raise Timeout(f"zstd did not finish {self.doing} in {timeout:.0f} s",
                          sandbox_id=self.sandbox_id) from None
        self._stderr = err or self._stderr
        if self.proc.returncode != 0:
            raise EngineError(f"zstd failed {self.doing}: {self.reason()}",
                              sandbox_id=self.sandbox_id)

    def broken(self) -> bool:
        """zstd was stopped by the pipe: QEMU closed its end before zstd was done."""
        return (self.proc.returncode == -signal.SIGPIPE
                or "broken pipe" in self.reason().lower())

    async def failure(self) -> EngineError | None:
        """Why the migration failed, if zstd can tell: its own error (a file that is not a
        zstd stream, a full disk), or on load, when QEMU stopped reading mid-stream, what
        ``zstd -t`` finds wrong in the file (zstd checks a frame's checksum only at its
        end, after it has handed QEMU the corrupt part). None: QEMU's error says why."""
        try:
            await self.finish(EXPLAIN_S)
        except Timeout:
            return None
        except EngineError as exc:
            if not self.broken():
                return exc
            return None if self.saving else await self.verify()
        return None

    async def verify(self) -> EngineError | None:
        """Test the whole file with ``zstd -t`` (for at most ``VERIFY_S``): an EngineError
        that names the damage, or None when it is a whole zstd stream (or the test did
        not finish). The test's process is reaped either way."""
        fd = _open(self.path, os.O_RDONLY)
        try:
            proc = await _spawn([_zstd(), "-t", "-q"], fd, asyncio.subprocess.DEVNULL)
        finally:
            os.close(fd)
        try:
            _, err = await asyncio.wait_for(proc.communicate(), VERIFY_S)
        except TimeoutError:
            return None
        finally:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        if proc.returncode == 0:
            return None
        return EngineError(f"{self.path.name} is corrupt (zstd -t: "
                           f"{_last_line(err, proc.returncode)})", sandbox_id=self.sandbox_id)

    async def alongside(self, migration: Awaitable[T]) -> T:
        """Await ``migration`` (the wait for QEMU's) while watching zstd; returns its result.

        When zstd fails first (a corrupt file: it stops writing, and QEMU, seeing a pipe
        whose writer is gone but no end of stream, might wait for its timeout), the
        migration is cancelled and zstd's error raised at once; when the migration fails,
        the error is the one ``failure`` finds, else QEMU's. Raises ``EngineError``,
        ``Timeout``.
        """
        task = asyncio.ensure_future(migration)
        exited = asyncio.ensure_future(self.proc.wait())
        try:
            await asyncio.wait({task, exited}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done() and self.proc.returncode != 0:
                failed = await self.failure()
                if failed is not None:
                    raise failed
            try:
                return await task
            except EngineError as exc:
                raise (await self.failure() or exc) from None
        finally:
            pending = {t for t in (task, exited) if not t.done()}
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.wait(pending)
            if not task.cancelled():
                task.exception()  # retrieved: raised above, or replaced by zstd's

    def reason(self) -> str:
        """zstd's last line of output, or its exit status."""
        return _last_line(self._stderr, self.proc.returncode)

    async def close(self) -> None:
        """Close the server's descriptor and end zstd if it still runs, reaping it."""
        self.handed_over()
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        await self.proc.wait()


def _last_line(stderr: bytes | None, returncode: int | None) -> str:
    """zstd's last line of error output without the name of its input (stdin), or its
    exit status."""
    lines = (stderr or b"").decode(errors="replace").strip().splitlines()
    if not lines:
        return f"exit status {returncode}"
    return re.sub(r"^(zstd: )?/\*stdin\*\\ ?: *", "", lines[-1].strip())


def _zstd() -> str:
    exe = shutil.which("zstd")
    if exe is None:
        raise EngineError("zstd is not installed, and snapshots' memory is stored with it: "
                          "install it (scripts/install.sh does)")
    return exe


def _open(path: Path, flags: int) -> int:
    try:
        return os.open(path, flags | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise EngineError(f"cannot open {path.name}: {exc.strerror}") from None


async def _spawn(argv: list[str], stdin: int, stdout: int) -> asyncio.subprocess.Process:
    try:
        return await asyncio.create_subprocess_exec(*argv, stdin=stdin, stdout=stdout,
                                                    stderr=asyncio.subprocess.PIPE)
    except OSError as exc:
        raise EngineError(f"cannot start zstd: {exc}") from None


def _pipe() -> tuple[int, int]:
    r, w = os.pipe()  # not inherited by any child but the one given an end as stdio
    with contextlib.suppress(OSError):
        fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    return r, w


@asynccontextmanager
async def _piped(argv: list[str], path: Path, file_flags: int, saving: bool,
                 sandbox_id: str) -> AsyncIterator[StreamPipe]:
    file_fd = _open(path, file_flags)
    r = w = -1
    try:
        r, w = _pipe()
        stdin, stdout, qemu_end = (r, file_fd, w) if saving else (file_fd, w, r)
        proc = await _spawn(argv, stdin, stdout)
    except BaseException:
        for fd in (r, w):
            if fd >= 0:
                os.close(fd)
        raise
    finally:
        os.close(file_fd)
    os.close(stdin if saving else stdout)  # zstd's end: the child holds its copy
    pipe = StreamPipe(proc, qemu_end, path, saving, sandbox_id)
    try:
        yield pipe
    finally:
        await asyncio.shield(pipe.close())


@asynccontextmanager
async def compressing(path: Path, sandbox_id: str = "") -> AsyncIterator[StreamPipe]:
    """A ``zstd -1`` from a pipe into ``path`` (created or truncated, mode 0600); the pipe's
    write end is the ``StreamPipe.qemu_end``. Raises EngineError (no zstd, no file)."""
    async with _piped([_zstd(), f"-{LEVEL}", "-q", "-c"], path,
                      os.O_WRONLY | os.O_CREAT | os.O_TRUNC, True, sandbox_id) as pipe:
        yield pipe


@asynccontextmanager
async def decompressing(path: Path, sandbox_id: str = "") -> AsyncIterator[StreamPipe]:
    """A ``zstd -d`` from ``path`` into a pipe whose read end is the ``StreamPipe.qemu_end``.
    Raises EngineError (no zstd, no file)."""
    async with _piped([_zstd(), "-d", "-q", "-c"], path, os.O_RDONLY, False,
                      sandbox_id) as pipe:
        yield pipe
