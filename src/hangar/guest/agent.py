"""The guest agent: runs inside every sandbox, standard library only.

It serves the framed protocol of ``hangar.guest.protocol`` over the
virtio-serial port named ``hangar.agent`` (``/dev/vportNpM``), or, for
tests on a host, over a Unix socket (``--listen PATH``).

Operations (``meta["op"]`` of a REQUEST frame):

``hello``       agent version, protocol version, boot id, uptime (s), window,
                requests in progress (this one included), fork generation
``exec``        run a command; see ``Agent.op_exec``
``read_file``   stream a file's bytes as DATA frames (stream ``file``)
``write_file``  receive DATA frames until EOF; write atomically (temp + rename)
``list_dir``    entries of a directory
``stat``        one entry
``mkdir``       make a directory (``parents`` like ``mkdir -p``)
``remove``      remove a file, or a directory (``recursive``)
``connect``     a TCP tunnel to a port inside the guest (e.g. x11vnc's 5900):
                DATA frames of stream ``socket`` both ways, EOF to half-close
``pty``         a program on a pseudo-terminal: input, output, resize, exit code
                (``hangar.guest.terminal``)
``watch``       file changes under a path, from inotify (``hangar.guest.watch``)
``set_time``    set the wall clock (``unix_ns``), used after a restore
``reseed``      mix host entropy into the kernel's pool, used after a restore
``identity``    a fork's own hostname, machine-id and fork generation
                (``hangar.guest.identity``), used after a fork or restore

Failures end the channel with an ERROR frame whose ``code`` is one of
``not_found``, ``is_directory``, ``not_directory``, ``exists``,
``not_empty``, ``permission_denied``, ``invalid``, ``io_error``,
``unsupported_version``, ``internal``.

Flow control: stream bytes to the host (exec output, file reads, tunnel
bytes) go out only while the host's window for the channel has room
(``Channel.stream``, ``hangar.guest.channel``), so a slow reader on the host blocks the writer
here (an exec's pipe fills and the command waits, a terminal's program
blocks on its writes, a file watch stops reading inotify); bytes from the
host are acknowledged as they are taken (``Channel.get``). CANCEL cancels
the request's task: an exec's process group is killed, a file or socket is
closed, a terminal is hung up, a watch stops. A host connection that ends
cancels all of its requests (``Session.close``).

The agent is one-per-guest and trusts its host: the guest, not the agent,
is the security boundary. Orphaned processes are reaped by PID 1
(``hangar.guest.init``); the agent reaps its own children.
"""

from __future__ import annotations

import asyncio
import base64
import errno
import fcntl
import json
import math
import os
import signal
import stat as stat_mod
import struct
import sys
import time
from typing import Any

from hangar import __version__
from hangar.guest import identity
from hangar.guest import protocol as P
from hangar.guest import spawn, terminal, watch
from hangar.guest.channel import Channel, Session
from hangar.guest.identity import read_generation

PORT_NAME = "hangar.agent"
RNDADDENTROPY = 0x40085203  # _IOW('R', 0x03, int[2]), linux/random.h
RNDRESEEDCRNG = 0x5207  # _IO('R', 0x07)
BOOT_ID = os.urandom(16).hex()
DEFAULT_HEAD = 1 << 20  # bytes of output kept from the start
DEFAULT_TAIL = 1 << 18  # bytes of output kept from the end
MAX_HEAD = 3 << 19  # 1.5 MiB: two streams' head and tail fit one frame (MAX_DATA)
MAX_TAIL = 1 << 19
DRAIN_GRACE_S = 0.5  # seconds to keep reading pipes after the command exits
BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
    "TERM": "xterm-256color",
    "USER": "root",
}
TEMPLATE_ENV_FILE = "/etc/hangar/env.json"
"""A template's environment (``hangar.images.template_builder``), merged into ``BASE_ENV``."""


def template_env(path: str = TEMPLATE_ENV_FILE) -> dict[str, str]:
    """The template's environment: a JSON object of strings; {} when absent or unreadable."""
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)
            and k and "=" not in k and "\0" not in k and "\0" not in v}


BASE_ENV.update(template_env())


BOOT_MARKS = "/run/hangar/boot"
"""Guest uptimes (s) at the steps of its boot, one ``<step> <uptime>`` a line, written by
the initramfs (``initramfs``: its /init began) and the guest init (``init``: PID 1's
Python began; ``agent``: the agent was started)."""


def boot_marks(path: str = BOOT_MARKS) -> dict[str, float]:
    """The boot's marks (see ``BOOT_MARKS``); {} when there are none (a test host)."""
    marks: dict[str, float] = {}
    try:
        with open(path) as f:
            for line in f:
                step, _, value = line.partition(" ")
                try:
                    marks[step] = float(value)
                except ValueError:
                    continue
    except OSError:
        pass
    return marks


class OpError(Exception):
    """A failure reported to the host as an ERROR frame."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


ERRNO_CODES = {
    errno.ENOENT: "not_found",
    errno.EISDIR: "is_directory",
    errno.ENOTDIR: "not_directory",
    errno.EEXIST: "exists",
    errno.ENOTEMPTY: "not_empty",
    errno.EACCES: "permission_denied",
    errno.EPERM: "permission_denied",
    errno.EINVAL: "invalid",
    errno.ENAMETOOLONG: "invalid",
}


def mkstemp(directory: str, prefix: str, suffix: str = "") -> tuple[int, str]:
    """A new file of mode 0600 in ``directory``, opened for writing: (fd, path).

    ``tempfile.mkstemp`` without the module (its imports cost about 50 ms
    under TCG, paid by the first upload after every restore). Raises OSError.
    """
    for _ in range(100):
        path = os.path.join(directory, f"{prefix}{os.urandom(6).hex()}{suffix}")
        try:
            return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600), path
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary file name", directory)


def os_error(exc: OSError, path: str) -> OpError:
    code = ERRNO_CODES.get(exc.errno or 0, "io_error")
    return OpError(code, f"{os.strerror(exc.errno or 0) if exc.errno else exc}: {path}")


def encodable(value: str) -> bool:
    """True when ``value`` can become bytes for the kernel (no lone surrogates but the
    ``surrogateescape`` ones that stand for raw bytes)."""
    try:
        value.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return False
    return True


def resolve(path: Any) -> str:
    """Absolute path of ``path``; relative paths start at /root."""
    if not isinstance(path, str) or not path or "\0" in path or not encodable(path):
        raise OpError("invalid", "path must be a non-empty string of valid Unicode without "
                                 "NUL bytes")
    return os.path.normpath(os.path.join(BASE_ENV["HOME"], path))


def entry(path: str, name: str | None = None) -> dict[str, Any]:
    st = os.lstat(path)
    if stat_mod.S_ISDIR(st.st_mode):
        kind = "dir"
    elif stat_mod.S_ISREG(st.st_mode):
        kind = "file"
    elif stat_mod.S_ISLNK(st.st_mode):
        kind = "symlink"
    else:
        kind = "other"
    return {
        "name": name if name is not None else os.path.basename(path) or "/",
        "path": path,
        "type": kind,
        "size": st.st_size,
        "mode": stat_mod.S_IMODE(st.st_mode),
        "mtime": st.st_mtime,
    }


SHELL_INLINE_MAX = 64 << 10
"""Bytes of a shell string passed as ``sh -c`` argument; longer ones go through a file."""
SCRIPT_DIR = "/run/hangar"
ENOENT_EXIT, NOEXEC_EXIT = 127, 126  # the shell's codes (POSIX, "Command Search and Execution")


def _no_nul(what: str, value: str) -> None:
    if "\0" in value:
        raise OpError("invalid", f"{what} must not contain NUL bytes")
    if not encodable(value):
        raise OpError("invalid", f"{what} is not valid Unicode (a lone surrogate)")


def exec_argv(meta: dict[str, Any]) -> tuple[list[str], str | None]:
    """The argv of an exec request and the script file it made (None: none).

    ``meta["argv"]`` runs as is; ``meta["shell"]`` runs by ``/bin/sh -c``,
    through a 0600 file in ``SCRIPT_DIR`` when longer than ``SHELL_INLINE_MAX``.
    """
    argv = meta.get("argv")
    shell = meta.get("shell")
    if argv is not None:
        if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
            raise OpError("invalid", "argv must be a non-empty list of strings")
        if not argv[0]:
            raise OpError("invalid", "the program name is empty")
        for i, a in enumerate(argv):
            _no_nul("the program name" if i == 0 else f"args[{i - 1}]", a)
        return argv, None
    if not isinstance(shell, str):
        raise OpError("invalid", "exec needs argv or shell")
    _no_nul("command", shell)
    script = shell.encode("utf-8", "surrogateescape")
    if len(script) <= SHELL_INLINE_MAX:
        return ["/bin/sh", "-c", shell], None
    try:
        fd, path = mkstemp(SCRIPT_DIR if os.path.isdir(SCRIPT_DIR) else "/tmp", "exec-", ".sh")
        with os.fdopen(fd, "wb") as f:
            f.write(script)
    except OSError as exc:
        raise os_error(exc, "the script file") from None
    return ["/bin/sh", "-c", f". {path}"], path


def exec_env(extra: Any) -> dict[str, str]:
    """``BASE_ENV`` updated with the request's ``env``; OpError ``invalid`` for a bad one."""
    env = dict(BASE_ENV)
    if extra is None:
        return env
    if not isinstance(extra, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in extra.items()
    ):
        raise OpError("invalid", "env must map strings to strings")
    for name, value in extra.items():
        if not name:
            raise OpError("invalid", "env has an empty variable name")
        if "=" in name:
            raise OpError("invalid", f"env name {name[:40]!r} must not contain '='")
        _no_nul("env names", name)
        _no_nul(f"env[{name[:40]!r}]", value)
    env.update(extra)
    return env


def exec_cwd(value: Any) -> str:
    """The absolute working directory of an exec; OpError naming ``cwd`` when unusable."""
    if value is None or value == "":
        return BASE_ENV["HOME"]
    if not isinstance(value, str):
        raise OpError("invalid", "cwd must be a string")
    _no_nul("cwd", value)
    cwd = resolve(value)
    try:
        st = os.stat(cwd)
    except FileNotFoundError:
        raise OpError("invalid", f"cwd {cwd}: no such directory") from None
    except OSError as exc:
        raise OpError(ERRNO_CODES.get(exc.errno or 0, "invalid"),
                      f"cwd {cwd}: {os.strerror(exc.errno or 0)}") from None
    if not stat_mod.S_ISDIR(st.st_mode):
        raise OpError("not_directory", f"cwd {cwd}: not a directory")
    return cwd


def spawn_failure(exc: OSError, program: str, cwd: str) -> tuple[int, str]:
    """(exit code, stderr text) for a program that could not be started, as a shell says it.

    Raises OpError for what is no missing or unrunnable program: arguments
    over the kernel's limit (E2BIG), an unusable cwd, or a failure of the
    guest itself (ENOMEM, EAGAIN...).
    """
    err = exc.errno or 0
    if err == errno.E2BIG:
        raise OpError("invalid", "args and env are too long for the guest kernel (E2BIG: "
                                 "at most 128 KiB per string and about 2 MiB in all); pass "
                                 "large data through stdin or a file") from None
    if exc.filename == cwd and program != cwd:
        raise OpError(ERRNO_CODES.get(err, "invalid"),
                      f"cwd {cwd}: {os.strerror(err)}") from None
    if err == errno.ENOENT:
        if "/" not in program:
            return ENOENT_EXIT, f"{program}: command not found\n"
        return ENOENT_EXIT, f"{program}: {os.strerror(err)}\n"
    if err in (errno.EACCES, errno.EPERM, errno.ENOEXEC, errno.EISDIR, errno.ENOTDIR,
               errno.ELOOP, errno.ENAMETOOLONG, errno.ETXTBSY, errno.ELIBBAD):
        return NOEXEC_EXIT, f"{program}: {os.strerror(err)}\n"
    raise os_error(exc, program) from None


class Capture:
    """Bounded capture of one output stream: a head, a tail and a byte count."""

    def __init__(self, head: int, tail: int) -> None:
        self.head_limit = head
        self.tail_limit = tail
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.head_limit - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk and self.tail_limit > 0:
            self.tail += chunk
            if len(self.tail) > 2 * self.tail_limit:
                del self.tail[: len(self.tail) - self.tail_limit]

    def result(self) -> tuple[dict[str, Any], bytes]:
        """Meta (``head``/``tail`` lengths, ``total``, ``truncated``) and the kept bytes."""
        if len(self.tail) > self.tail_limit:
            del self.tail[: len(self.tail) - self.tail_limit]
        truncated = self.total > len(self.head) + len(self.tail)
        if not truncated:
            whole, tail = bytes(self.head + self.tail), b""
        else:
            whole, tail = bytes(self.head), bytes(self.tail)
        meta = {"head": len(whole), "tail": len(tail), "total": self.total, "truncated": truncated}
        return meta, whole + tail


class Agent:
    """Serves requests; one instance per guest, surviving host reconnects."""

    def __init__(self) -> None:
        self.sessions: set[Session] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.generation = read_generation()

    # -- transport ---------------------------------------------------------

    def hello_meta(self) -> dict[str, Any]:
        try:
            with open("/proc/uptime") as f:
                uptime = float(f.read().split()[0])
        except OSError:
            uptime = None
        return {
            "agent_version": __version__,
            "protocol": P.VERSION,
            "window": P.WINDOW,
            "boot_id": BOOT_ID,
            "pid": os.getpid(),
            "uptime_s": uptime,
            "requests": len(self.tasks),
            "generation": self.generation,
            "boot": boot_marks(),
        }

    async def session(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Serve one host connection until it closes; then cancel its requests."""
        session = Session(writer)
        self.sessions.add(session)
        await session.send(P.Kind.HELLO, 0, self.hello_meta())
        decoder = P.Decoder()
        try:
            while True:
                data = await reader.read(1 << 16)
                if not data:
                    break
                for frame in decoder.feed(data):
                    await self.dispatch(frame, session)
        finally:
            self.sessions.discard(session)
            session.close()
            try:
                writer.transport.abort()
            except Exception:
                pass

    async def dispatch(self, frame: P.Frame, session: Session) -> None:
        if frame.version != P.VERSION:
            await session.send(P.Kind.ERROR, frame.channel, {
                "code": "unsupported_version",
                "message": f"agent speaks protocol {P.VERSION}, got {frame.version}",
            })
            return
        ch = session.channels.get(frame.channel)
        if frame.kind == P.Kind.REQUEST:
            if ch is not None:
                await session.send(P.Kind.ERROR, frame.channel,
                                   {"code": "invalid", "message": "channel already open"})
                return
            ch = session.channels[frame.channel] = Channel(session, frame.channel)
            task = ch.task = asyncio.create_task(self.run_request(frame, ch))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        elif ch is None:
            return  # a channel that ended: late frames are dropped
        elif frame.kind == P.Kind.WINDOW:
            ch.outflow.grant(P.granted(frame))
        elif frame.kind == P.Kind.CANCEL:
            if ch.task is not None:
                ch.task.cancel()
        else:
            if frame.kind in P.FLOW_KINDS:
                ch.inflow.arrive(frame.size)  # the host is trusted to keep to its window
            ch.inbox.put_nowait(frame)

    async def run_request(self, frame: P.Frame, ch: Channel) -> None:
        op = frame.meta.get("op")
        handler = getattr(self, f"op_{op}", None) if isinstance(op, str) else None
        try:
            if handler is None:
                raise OpError("invalid", f"unknown operation: {op!r}")
            result = await handler(frame.channel, frame.meta, ch)
            data = b""
            if isinstance(result, tuple):
                result, data = result
            await ch.send(P.Kind.RESPONSE, result, data)
        except OpError as exc:
            await ch.send(P.Kind.ERROR, {"code": exc.code, "message": exc.message})
        except asyncio.CancelledError:
            pass  # the host cancelled (CANCEL) or went away: it expects nothing more
        except Exception:  # the agent must outlive any one request
            # The traceback goes to the guest's console (serial.log on the
            # host); the caller gets no exception text.
            import traceback

            traceback.print_exc(file=sys.stderr)
            await ch.send(P.Kind.ERROR, {
                "code": "internal",
                "message": f"the guest agent failed during {op!r}; its console log has details"})
        finally:
            if ch.session.channels.get(frame.channel) is ch:
                del ch.session.channels[frame.channel]

    # -- operations --------------------------------------------------------

    async def op_hello(self, cid: int, meta: dict[str, Any], ch: Channel) -> dict[str, Any]:
        return self.hello_meta()

    async def op_exec(self, cid: int, meta: dict[str, Any], ch: Channel,
                      ) -> tuple[dict[str, Any], bytes]:
        """Run a command.

        meta: ``argv`` (list of str) or ``shell`` (str, run by /bin/sh -c);
        ``env`` (dict), ``cwd`` (str, default /root), ``stdin`` (bool: DATA
        frames of stream ``stdin`` and an EOF follow; false means EOF at
        once), ``timeout`` (seconds; the whole process group is killed),
        ``stream`` (bool: send stdout/stderr as DATA frames), ``head`` and
        ``tail`` (bytes kept of each stream when not streaming). Streamed
        output goes out as the host's window allows, so a slow reader makes
        the command wait on its pipe; after the command exits its pipes are
        drained for ``DRAIN_GRACE_S``, or while the host's window is full up
        to the timeout (then the rest is dropped; the totals count what was
        sent).

        Returns (as RESPONSE meta) ``exit_code`` (128+N when killed by signal N), ``signal``,
        ``timed_out``, ``duration_s``, and per stream ``stdout``/``stderr``
        captures (``head`` and ``tail`` lengths, ``total`` bytes, a
        ``truncated`` flag); the RESPONSE data holds stdout's head and tail
        then stderr's, back to back.

        A shell string longer than ``SHELL_INLINE_MAX`` bytes is written to
        a file under /run/hangar and sourced by ``/bin/sh -c``, so scripts
        of any size run (one argument may not exceed 128 KiB). A program
        that cannot be started (``argv``) is answered as a shell would: exit
        127 when it is not found, 126 when it cannot be executed, with the
        reason on stderr and ``not_started`` set. ERROR ``invalid`` for NUL
        bytes in argv, env or cwd, an env name that is empty or holds
        ``=``, a missing cwd, or arguments over the kernel's limit (E2BIG);
        ``not_directory`` for a cwd that is not a directory.
        """
        argv, script = exec_argv(meta)
        try:
            env = exec_env(meta.get("env"))
            cwd = exec_cwd(meta.get("cwd"))
            timeout = meta.get("timeout")
            if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
                raise OpError("invalid", "timeout must be a positive number of seconds")
            stream = bool(meta.get("stream"))
            want_stdin = bool(meta.get("stdin"))
            try:
                head = min(int(meta.get("head", DEFAULT_HEAD)), MAX_HEAD)
                tail = min(int(meta.get("tail", DEFAULT_TAIL)), MAX_TAIL)
            except (TypeError, ValueError):
                raise OpError("invalid", "head and tail must be byte counts") from None

            started = time.monotonic()
            try:
                pid, stdin_fd, out_fd, err_fd = spawn.spawn(argv, env, cwd, stdin_pipe=want_stdin)
            except OSError as exc:
                code, message = spawn_failure(exc, argv[0], cwd)
                return await self._not_started(ch, stream, head, tail, code, message, started)
            captures = {"stdout": Capture(head, tail), "stderr": Capture(head, tail)}
            chunks: asyncio.Queue[tuple[str, bytes]] | None = asyncio.Queue() if stream else None
            cmd = spawn.Command(pid, stdin_fd, out_fd, err_fd,
                                (lambda name, chunk: chunks.put_nowait((name, chunk)))
                                if chunks is not None
                                else (lambda name, chunk: captures[name].add(chunk)),
                                paced=stream)
            try:
                return await self._run(ch, cmd, captures, chunks, want_stdin, timeout, started)
            finally:
                if cmd.returncode is None:  # cancelled: never leave the group behind
                    cmd.kill(signal.SIGKILL)
                cmd.close()
        finally:
            if script is not None:
                try:
                    os.unlink(script)
                except OSError:
                    pass

    async def _not_started(self, ch: Channel, stream: bool, head: int, tail: int, code: int,
                           message: str, started: float) -> tuple[dict[str, Any], bytes]:
        """The result of a program that could not be started: ``code`` and ``message``
        on stderr, as a shell reports it (127 not found, 126 not executable)."""
        err = message.encode("utf-8", "replace")
        result: dict[str, Any] = {"exit_code": code, "signal": None, "timed_out": False,
                                  "duration_s": round(time.monotonic() - started, 6),
                                  "pid": None, "not_started": True}
        if stream:
            await ch.stream({"stream": "stderr"}, err)
            result["stdout"], result["stderr"] = {"total": 0}, {"total": len(err)}
            return result, b""
        out_cap, err_cap = Capture(head, tail), Capture(head, tail)
        err_cap.add(err)
        (result["stdout"], out_kept), (result["stderr"], err_kept) = (out_cap.result(),
                                                                      err_cap.result())
        return result, out_kept + err_kept

    async def _run(self, ch: Channel, cmd: spawn.Command, captures: dict[str, Capture],
                   chunks: asyncio.Queue[tuple[str, bytes]] | None, want_stdin: bool,
                   timeout: float | None, started: float) -> tuple[dict[str, Any], bytes]:
        """Wait for a started command, feeding stdin and relaying signals; see ``op_exec``.

        Streaming (``chunks``): each chunk goes out once the host's window has
        room, and only then is that pipe read again (``Command.resume``), so a
        slow reader makes the command wait on its pipe.
        """
        stream = chunks is not None

        async def relay() -> None:
            assert chunks is not None
            while True:
                name, chunk = await chunks.get()
                await ch.stream({"stream": name}, chunk)  # waits while the window is full
                captures[name].total += len(chunk)
                cmd.resume(name)

        async def feed() -> None:
            """Route inbound frames: stdin data, stdin EOF, signals."""
            stdin_open = want_stdin
            while True:
                frame = await ch.get()
                if frame.kind == P.Kind.DATA and stdin_open:
                    try:
                        await cmd.write_stdin(frame.data)
                    except (BrokenPipeError, ConnectionResetError):
                        stdin_open = False
                elif frame.kind == P.Kind.EOF and stdin_open:
                    stdin_open = False
                    cmd.close_stdin()
                elif frame.kind == P.Kind.SIGNAL:
                    sig = frame.meta.get("signal", signal.SIGKILL)
                    if isinstance(sig, int) and 0 < sig < 65:
                        cmd.kill(sig)

        feeder = asyncio.create_task(feed())
        relayer = asyncio.create_task(relay()) if stream else None
        expired: list[bool] = []

        def expire() -> None:
            expired.append(True)
            cmd.kill(signal.SIGKILL)

        timer = (asyncio.get_running_loop().call_later(timeout, expire)
                 if timeout is not None else None)
        try:
            await cmd.exited
            if expired:
                cmd.kill(signal.SIGKILL)  # members of the group that outlived the leader
            # Drain: output to its end (streaming: every chunk sent). A pipe still open
            # DRAIN_GRACE_S after the exit (a background process holds it) is cut off,
            # unless the relay waits for the host's window (a slow reader), which it may
            # do until the timeout.
            until = time.monotonic() + DRAIN_GRACE_S
            if not expired:
                until = max(until, started + timeout + DRAIN_GRACE_S if timeout else math.inf)
            pending = {f for f in cmd.eof.values() if not f.done()}
            while pending:
                if relayer is not None and relayer.done():
                    break
                _, pending = await asyncio.wait(
                    pending, timeout=max(0.0, min(DRAIN_GRACE_S, until - time.monotonic())))
                if pending and (not ch.outflow.waiting or time.monotonic() >= until):
                    break
            if relayer is not None and relayer.done() and relayer.exception() is not None:
                raise relayer.exception()  # type: ignore[misc]
        finally:
            if timer is not None:
                timer.cancel()
            for t in (feeder, relayer):
                if t is not None:
                    t.cancel()
            await asyncio.gather(*(t for t in (feeder, relayer) if t is not None),
                                 return_exceptions=True)
            cmd.close()
        timed_out = bool(expired)

        rc = cmd.returncode
        sig = -rc if rc is not None and rc < 0 else None
        result: dict[str, Any] = {
            "exit_code": 128 + sig if sig else rc,
            "signal": sig,
            "timed_out": timed_out,
            "duration_s": round(time.monotonic() - started, 6),
            "pid": cmd.pid,
        }
        data = b""
        for name, cap in captures.items():
            if stream:
                result[name] = {"total": cap.total}
            else:
                result[name], kept = cap.result()
                data += kept
        return result, data

    async def op_read_file(self, cid: int, meta: dict[str, Any], ch: Channel) -> dict[str, Any]:
        path = resolve(meta.get("path"))
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise os_error(exc, path) from None
        size = 0
        try:
            st = os.fstat(fd)
            if stat_mod.S_ISDIR(st.st_mode):
                raise OpError("is_directory", f"is a directory: {path}")
            while True:
                chunk = os.read(fd, P.CHUNK)
                if not chunk:
                    break
                size += len(chunk)
                await ch.stream({"stream": "file"}, chunk)  # waits for the host's window
        finally:
            os.close(fd)
        return {"path": path, "size": size}

    async def op_write_file(self, cid: int, meta: dict[str, Any], ch: Channel) -> dict[str, Any]:
        path = resolve(meta.get("path"))
        mode = meta.get("mode", 0o644)
        if not isinstance(mode, int) or not 0 <= mode <= 0o7777:
            raise OpError("invalid", "mode must be an integer permission value")
        parent = os.path.dirname(path)
        if os.path.isdir(path):
            raise OpError("is_directory", f"is a directory: {path}")
        try:
            if meta.get("parents", True):
                os.makedirs(parent, exist_ok=True)
            fd, tmp = mkstemp(parent, ".hangar-")
        except OSError as exc:
            raise os_error(exc, parent) from None
        size = 0
        ok = False
        try:
            while True:
                frame = await ch.get()
                if frame.kind == P.Kind.DATA:
                    view = memoryview(frame.data)
                    while view:
                        n = os.write(fd, view)
                        view = view[n:]
                    size += len(frame.data)
                elif frame.kind == P.Kind.EOF:
                    break
            os.fchmod(fd, mode)
            os.fsync(fd)
            os.close(fd)
            fd = -1
            os.replace(tmp, path)
            ok = True
        except OSError as exc:
            raise os_error(exc, path) from None
        finally:
            if fd >= 0:
                os.close(fd)
            if not ok:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
        return {"path": path, "size": size}

    async def op_list_dir(self, cid: int, meta: dict[str, Any], ch: Channel) -> dict[str, Any]:
        path = resolve(meta.get("path", "/root"))
        try:
            names = sorted(os.listdir(path))
        except OSError as exc:
            raise os_error(exc, path) from None
        entries = []
        for name in names:
            try:
                entries.append(entry(os.path.join(path, name), name))
            except OSError:
                continue  # removed while listing
        return {"path": path, "entries": entries}

    async def op_stat(self, cid: int, meta: dict[str, Any], ch: Channel) -> dict[str, Any]:
        path = resolve(meta.get("path"))
        try:
            return entry(path)
        except OSError as exc:
            raise os_error(exc, path) from None

    async def op_mkdir(self, cid: int, meta: dict[str, Any], ch: Channel) -> dict[str, Any]:
        path = resolve(meta.get("path"))
        try:
            if meta.get("parents", True):
                os.makedirs(path, exist_ok=True)
            else:
                os.mkdir(path)
            return entry(path)
        except OSError as exc:
            raise os_error(exc, path) from None

    async def op_remove(self, cid: int, meta: dict[str, Any], ch: Channel) -> dict[str, Any]:
        path = resolve(meta.get("path"))
        if path == "/":
            raise OpError("invalid", "refusing to remove /")
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                if meta.get("recursive"):
                    import shutil

                    shutil.rmtree(path)
                else:
                    os.rmdir(path)
            else:
                os.unlink(path)
        except OSError as exc:
            raise os_error(exc, path) from None
        return {"path": path}

    async def op_connect(self, cid: int, meta: dict[str, Any], ch: Channel) -> dict[str, Any]:
        """Tunnel bytes between the channel and a TCP port in the guest.

        meta: ``port`` (int), ``host`` (default 127.0.0.1). The first DATA
        frame (empty, ``connected: true``) says the connection is open;
        ends with RESPONSE ``{bytes_in, bytes_out}`` when both sides closed.
        """
        port = meta.get("port")
        host = meta.get("host", "127.0.0.1")
        if not isinstance(port, int) or not 0 < port < 65536 or not isinstance(host, str):
            raise OpError("invalid", "connect needs a TCP port (1-65535)")
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 10)
        except (OSError, asyncio.TimeoutError) as exc:
            raise OpError("not_found", f"cannot connect to {host}:{port}: {exc}") from None
        await ch.stream({"stream": "socket", "connected": True})
        counts = {"in": 0, "out": 0}

        async def upstream() -> None:
            while True:
                chunk = await reader.read(P.CHUNK)
                if not chunk:
                    await ch.stream({"stream": "socket"}, kind=P.Kind.EOF)
                    return
                counts["out"] += len(chunk)
                await ch.stream({"stream": "socket"}, chunk)  # waits for the host's window

        async def downstream() -> None:
            while True:
                frame = await ch.get()
                if frame.kind == P.Kind.DATA:
                    counts["in"] += len(frame.data)
                    writer.write(frame.data)
                    await writer.drain()
                elif frame.kind in (P.Kind.EOF, P.Kind.SIGNAL):
                    if writer.can_write_eof():
                        writer.write_eof()
                    return

        up = asyncio.create_task(upstream())
        down = asyncio.create_task(downstream())
        try:
            done, pending = await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
            if down in done:  # host closed: let the guest side finish, briefly
                await asyncio.wait({up}, timeout=2)
            else:  # guest side closed: the host decides when to end
                await down
        except (ConnectionError, OSError):
            pass
        finally:
            for t in (up, down):
                t.cancel()
            writer.close()
        return {"bytes_in": counts["in"], "bytes_out": counts["out"]}

    async def op_pty(self, cid: int, meta: dict[str, Any], ch: Channel) -> dict[str, Any]:
        """A program on a pseudo-terminal; frames in ``hangar.guest.terminal``.

        meta: ``argv`` or ``shell`` as for exec (neither: ``/bin/bash -l``,
        else ``/bin/sh``), ``env``, ``cwd``, ``cols`` and ``rows`` (1..1000,
        default 80x24). ERROR ``invalid`` for bad input or a program that
        cannot be started.
        """
        if meta.get("argv") is None and meta.get("shell") is None:
            shell = "/bin/bash" if os.access("/bin/bash", os.X_OK) else "/bin/sh"
            argv, script = [shell, "-l"], None
        else:
            argv, script = exec_argv(meta)
        try:
            env = exec_env(meta.get("env"))
            cwd = exec_cwd(meta.get("cwd"))
            try:
                cols, rows = terminal.check_size(meta.get("cols", 80), meta.get("rows", 24))
            except ValueError as exc:
                raise OpError("invalid", str(exc)) from None
            try:
                return await terminal.run(ch, argv, env, cwd, cols, rows)
            except OSError as exc:
                _, message = spawn_failure(exc, argv[0], cwd)
                raise OpError("invalid", message.strip()) from None
        finally:
            if script is not None:
                try:
                    os.unlink(script)
                except OSError:
                    pass

    async def op_watch(self, cid: int, meta: dict[str, Any], ch: Channel) -> dict[str, Any]:
        """File changes under ``path`` (``recursive``: and every folder below it) until the
        host CANCELs the watch or the path goes away; frames and events in
        ``hangar.guest.watch``."""
        path = resolve(meta.get("path"))
        try:
            return await watch.run(ch, path, bool(meta.get("recursive")))
        except watch.TooMany:
            raise OpError("invalid", f"more than {watch.MAX_DIRS} folders under {path}; "
                                     "watch a smaller tree") from None
        except OSError as exc:
            raise os_error(exc, path) from None

    async def op_set_time(self, cid: int, meta: dict[str, Any], ch: Channel) -> dict[str, Any]:
        ns = meta.get("unix_ns")
        if not isinstance(ns, int):
            raise OpError("invalid", "unix_ns must be an integer")
        before = time.time_ns()
        try:
            time.clock_settime_ns(time.CLOCK_REALTIME, ns)
        except OSError as exc:
            raise os_error(exc, "CLOCK_REALTIME") from None
        return {"skew_s": (ns - before) / 1e9}

    async def op_reseed(self, cid: int, meta: dict[str, Any], ch: Channel) -> dict[str, Any]:
        try:
            seed = base64.b64decode(meta.get("seed", ""), validate=True)
        except (ValueError, TypeError):
            raise OpError("invalid", "seed must be base64") from None
        reseeded = False
        with open("/dev/random", "wb") as f:
            try:
                # Credit the seed and reseed the kernel's CRNG now: a plain
                # write only mixes it in, and clones of one snapshot would
                # keep drawing the same stream until the next periodic reseed.
                fcntl.ioctl(f, RNDADDENTROPY, struct.pack("ii", len(seed) * 8, len(seed)) + seed)
                fcntl.ioctl(f, RNDRESEEDCRNG)
                reseeded = True
            except OSError:
                f.write(seed)
        return {"bytes": len(seed), "reseeded": reseeded}

    async def op_identity(self, cid: int, meta: dict[str, Any], ch: Channel) -> dict[str, Any]:
        """Make this guest a machine of its own after a fork or restore.

        meta: ``hostname`` (the sandbox id), ``machine_id`` (32 lowercase hex
        digits) and ``generation`` (a non-negative integer), each optional;
        see ``hangar.guest.identity``. Returns the three as they now are.
        """
        hostname = meta.get("hostname")
        machine_id = meta.get("machine_id")
        generation = meta.get("generation")
        if hostname is not None and not (isinstance(hostname, str)
                                         and identity.valid_hostname(hostname)):
            raise OpError("invalid", "hostname must be one DNS label (letters, digits, '-')")
        if machine_id is not None and not (isinstance(machine_id, str)
                                           and identity.valid_machine_id(machine_id)):
            raise OpError("invalid", "machine_id must be 32 lowercase hex digits")
        if generation is not None and (not isinstance(generation, int)
                                       or isinstance(generation, bool) or generation < 0):
            raise OpError("invalid", "generation must be a non-negative integer")
        try:
            if hostname is not None:
                failed = identity.set_hostname(hostname)
                if failed:
                    raise OpError("io_error", "; ".join(failed))
            if machine_id is not None:
                identity.set_machine_id(machine_id)
            if generation is not None:
                identity.write_generation(generation)
                self.generation = generation
        except OSError as exc:
            raise os_error(exc, "the guest's identity files") from None
        try:
            with open(identity.MACHINE_ID) as f:
                current_id = f.read().strip()
        except OSError:
            current_id = None
        return {"hostname": os.uname().nodename, "machine_id": current_id,
                "generation": self.generation}


def find_port(name: str = PORT_NAME) -> str | None:
    """Path of the virtio-serial port called ``name``, or None."""
    base = "/sys/class/virtio-ports"
    try:
        ports = os.listdir(base)
    except OSError:
        return None
    for port in ports:
        try:
            with open(os.path.join(base, port, "name")) as f:
                if f.read().strip() == name:
                    return "/dev/" + port
        except OSError:
            continue
    return None


async def serve_port(agent: Agent) -> None:
    """Serve the virtio-serial port, reopening it whenever the host goes away."""
    loop = asyncio.get_running_loop()
    while True:
        path = find_port()
        if path is None or not os.path.exists(path):
            await asyncio.sleep(0.05)
            continue
        try:
            rfd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:  # EBUSY while an earlier open is still closing
            print(f"hangar-agent: cannot open {path}: {exc}", file=sys.stderr, flush=True)
            await asyncio.sleep(0.2)
            continue
        wfd = os.dup(rfd)
        reader = asyncio.StreamReader(limit=P.MAX_DATA * 2)
        rtrans, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(rfd, "rb", buffering=0))
        wtrans, wproto = await loop.connect_write_pipe(
            asyncio.streams.FlowControlMixin, os.fdopen(wfd, "wb", buffering=0))
        writer = asyncio.StreamWriter(wtrans, wproto, None, loop)
        try:
            await agent.session(reader, writer)
        finally:
            # abort, not close: a write the absent host never read would
            # otherwise keep the port open (and busy) forever.
            rtrans.close()
            wtrans.abort()
        await asyncio.sleep(0.05)  # host away: the port reads EOF until it returns


async def serve_unix(agent: Agent, path: str) -> None:
    """Serve a Unix socket (one host at a time); used to test the agent on a host."""
    server = await asyncio.start_unix_server(agent.session, path=path, limit=P.MAX_DATA * 2)
    async with server:
        await server.serve_forever()


VSOCK_PORT = 52
"""The agent's vsock port under Firecracker (host side: ``CONNECT 52``)."""


def kernel_channel(path: str = "/proc/cmdline") -> str | None:
    """The value of ``hangar.channel=`` on the kernel command line, or None."""
    try:
        with open(path) as f:
            words = f.read().split()
    except OSError:
        return None
    for word in words:
        if word.startswith("hangar.channel="):
            return word.split("=", 1)[1]
    return None


async def serve_vsock(agent: Agent, port: int = VSOCK_PORT) -> None:
    """Serve AF_VSOCK ``port`` (Firecracker's agent channel); each connection is a session.

    The host reaches it through Firecracker's Unix socket with ``CONNECT
    <port>``. Waits until the vsock transport exists (its modules load in
    the initramfs). After a snapshot restore the device resets and drops
    every connection, but this listening socket survives and the host
    simply connects again; the newest connection takes over the agent.
    """
    import socket

    warned = False
    while True:
        try:
            sock = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)
        except OSError as exc:  # no vsock transport yet
            if not warned:
                print(f"hangar-agent: waiting for vsock: {exc}", file=sys.stderr, flush=True)
                warned = True
            await asyncio.sleep(0.05)
            continue
        try:
            sock.bind((socket.VMADDR_CID_ANY, port))
            sock.listen(8)
        except OSError as exc:
            sock.close()
            if not warned:
                print(f"hangar-agent: cannot listen on vsock port {port}: {exc}",
                      file=sys.stderr, flush=True)
                warned = True
            await asyncio.sleep(0.05)
            continue
        break
    sock.setblocking(False)
    server = await asyncio.start_server(agent.session, sock=sock, limit=P.MAX_DATA * 2)
    async with server:
        await server.serve_forever()


MALLOC_WARMUP = 1 << 20
"""Bytes allocated and freed once at start: see ``warm_malloc``."""


def warm_malloc(size: int = MALLOC_WARMUP) -> None:
    """Have glibc's malloc serve blocks up to ``size`` bytes from its heap.

    glibc maps every block above its threshold (128 KiB at first) with mmap
    and unmaps it on free, and raises the threshold only when a mapped block
    larger than it is freed. asyncio reads the agent's port 256 KiB at a time,
    so until then every read maps, faults in and unmaps fresh pages: under
    TCG that halved uploads (16 MiB written at 12 MiB/s, 24 once warmed).
    Freeing one mapped block of ``size`` raises the threshold to it.
    """
    bytearray(size)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    warm_malloc()
    agent = Agent()
    if len(args) == 2 and args[0] == "--listen":
        coro = serve_unix(agent, os.path.abspath(args[1]))
    elif kernel_channel() == "vsock":
        coro = serve_vsock(agent)
    else:
        coro = serve_port(agent)
    try:  # a command's default cwd: spawning there needs no chdir
        os.chdir(BASE_ENV["HOME"])
    except OSError:
        pass
    print(f"hangar-agent {__version__} protocol {P.VERSION} starting", file=sys.stderr, flush=True)
    asyncio.run(coro)


if __name__ == "__main__":
    main()
