"""The code interpreter's kernels other than Python's, run inside a ``code-interpreter``
guest (not on the host), and what they share with its server (``code_interpreter.py``,
which imports this file from its own folder): the errors a request ends with
(``Refused``, ``Gone``) and whom a kernel runs as (``Identity``).

``BashKernel`` is one ``bash`` process a context; ``NodeKernel`` one Node.js process
running ``NODE_DRIVER`` (``code_interpreter_node.js``) for JavaScript and TypeScript;
``RKernel`` one ``Rscript`` process running ``R_DRIVER`` (``code_interpreter_r.R``);
``JavaKernel`` one JVM running ``JAVA_DRIVER`` (``CodeInterpreterJava.java``). All
take the cell's ``emit`` (one protocol line a call, as the server streams them) and
``gone`` (True once the client left); a kernel remembers the identity it started as, and
the server moves it to a newer one (``apply``) before it runs a cell.
"""

from __future__ import annotations

import base64
import codecs
import json
import os
import re
import select
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
NODE = "/usr/bin/node"
NODE_DRIVER = os.path.join(HERE, "code_interpreter_node.js")
RSCRIPT = "/usr/bin/Rscript"
R_DRIVER = os.path.join(HERE, "code_interpreter_r.R")
JAVA = "/usr/bin/java"
JAVA_DRIVER = os.path.join(HERE, "CodeInterpreterJava.java")

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Gone(Exception):
    """The client closed its connection mid-cell."""


@dataclass(frozen=True)
class Identity:
    """Whom kernels run as and what they inherit, as ``POST /configure`` last set it (the
    host sets it once a sandbox is made: E2B's default user and the sandbox's environment
    variables). ``version`` 0 is the server's own (root, nothing added): a kernel started
    before a configure is moved to the newer one before it runs a cell (``Kernel.apply``)."""

    version: int = 0
    user: str | None = None
    uid: int = 0
    gid: int = 0
    groups: tuple[int, ...] = ()
    home: str | None = None
    envs: dict[str, str] = field(default_factory=dict)

    def env(self, base: dict[str, str]) -> dict[str, str]:
        """``base`` with this identity's variables (its user's HOME, USER, LOGNAME)."""
        out = dict(base, **self.envs)
        if self.user:
            out.update(HOME=self.home or "/", USER=self.user, LOGNAME=self.user)
        return out

    def popen(self) -> dict[str, Any]:
        """``subprocess.Popen`` arguments that start a process as this identity's user."""
        if not self.user or self.uid == os.getuid():
            return {}
        return {"user": self.uid, "group": self.gid, "extra_groups": list(self.groups)}


def _lines_of(buf: str, emit: Any, kind: str, final: bool = False) -> str:
    """Emit the whole lines of ``buf`` (each with its newline; the rest too when ``final``)
    as ``kind`` lines; returns what is left."""
    while True:
        nl = buf.find("\n")
        if nl < 0:
            break
        emit({"type": kind, "text": buf[:nl + 1], "timestamp": time.time_ns()})
        buf = buf[nl + 1:]
    if final and buf:
        emit({"type": kind, "text": buf, "timestamp": time.time_ns()})
        buf = ""
    return buf


class Respawns:
    """For a kernel whose process cannot change its user (a shell, R, a JVM): ``apply``
    starts a new process as the newer identity in ``cwd`` (the context's variables go)."""

    def apply(self, ident: Identity, cwd: str) -> None:
        self.shutdown()  # type: ignore[attr-defined]
        self.cwd = cwd
        self._start(ident)  # type: ignore[attr-defined]
        self.applied = ident.version


class BashKernel(Respawns):
    """A Bash context: one ``bash`` process (as the identity's user) that sources each cell
    from a file of its own, so variables, functions and the folder stay between cells.
    After a cell each stream gets a random marker (stdout's with the exit status) that
    ends it; a cell that exits non-zero ends with an ``error`` line (``name``
    ``ExitCodeError``, ``value`` the status). A client that leaves mid-cell ends the
    process group: the next cell gets a new shell."""

    language = "bash"

    def __init__(self, cwd: str, ident: Identity) -> None:
        self.applied = ident.version
        self.cwd = cwd
        self._start(ident)

    def _start(self, ident: Identity) -> None:
        self.ident = ident
        self.dir = tempfile.mkdtemp(prefix="hangar-bash-")
        if ident.user:
            os.chown(self.dir, ident.uid, ident.gid)
        env = ident.env(dict(os.environ, TERM="dumb"))
        env.pop("PYTHONPATH", None)
        self.proc = subprocess.Popen(
            ["/bin/bash", "--noprofile", "--norc"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=self.cwd, env=env,
            start_new_session=True, **ident.popen())

    def chdir(self, cwd: str) -> None:
        self.cwd = cwd

    def shutdown(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass
        self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def run(self, code: str, env: dict[str, str], emit: Any, gone: Any) -> None:
        for name in env:
            if not ENV_NAME.match(name):
                raise Refused(400, f"env_vars: {name!r} is not a shell variable name")
        mark = uuid.uuid4().hex
        cell = os.path.join(self.dir, "cell.sh")
        with open(cell, "w") as f:
            f.write(code + "\n")
        prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        script = (f"{prefix} source {shlex.quote(cell)} </dev/null\n"
                  f"printf '%s %d\\n' {mark} $? ; printf '%s\\n' {mark} >&2\n")
        assert self.proc.stdin is not None and self.proc.stdout and self.proc.stderr
        try:
            self.proc.stdin.write(script.encode())
            self.proc.stdin.flush()
        except OSError:
            emit({"type": "error", "name": "KernelDied", "traceback": "",
                  "value": "the shell exited; restart the context"})
            emit({"type": "end_of_execution"})
            return
        out_fd, err_fd = self.proc.stdout.fileno(), self.proc.stderr.fileno()
        tag = mark.encode()
        raw = {out_fd: b"", err_fd: b""}
        text = {out_fd: "", err_fd: ""}
        decode = {fd: codecs.getincrementaldecoder("utf-8")("replace") for fd in raw}
        kind = {out_fd: "stdout", err_fd: "stderr"}
        done = {out_fd: False, err_fd: False}
        status = 0
        while not all(done.values()):
            ready, _, _ = select.select([fd for fd, d in done.items() if not d], [], [], 1)
            if not ready:
                if gone():  # a new shell for the next cell: this one may be stuck
                    self.shutdown()
                    self._start(self.ident)
                    raise Gone()
                continue
            for fd in ready:
                chunk = os.read(fd, 65536)
                if not chunk:  # the shell exited (``exit`` in a cell)
                    done[fd], status = True, -1
                    piece, raw[fd] = raw[fd], b""
                else:
                    raw[fd] += chunk
                    at = raw[fd].find(tag)
                    if at >= 0:
                        if fd == out_fd:
                            rest = raw[fd][at + len(tag):]
                            if b"\n" not in rest:
                                continue  # the status is still on its way
                            status = int(rest.split(b"\n", 1)[0].strip() or b"0")
                        piece, raw[fd] = raw[fd][:at], b""
                        done[fd] = True
                    else:  # keep what may be the start of a marker split between reads
                        cut = max(0, len(raw[fd]) - len(tag) + 1)
                        piece, raw[fd] = raw[fd][:cut], raw[fd][cut:]
                text[fd] = _lines_of(text[fd] + decode[fd].decode(piece, final=done[fd]),
                                     emit, kind[fd])
        for fd in (out_fd, err_fd):
            _lines_of(text[fd], emit, kind[fd], final=True)
        if status == -1:
            emit({"type": "error", "name": "KernelDied", "traceback": "",
                  "value": "the shell exited; restart the context"})
        elif status:
            emit({"type": "error", "name": "ExitCodeError", "value": str(status),
                  "traceback": f"the cell exited with status {status}"})
        emit({"type": "end_of_execution"})


class NodeKernel:
    """A JavaScript or TypeScript context: one Node.js process running ``NODE_DRIVER``, which
    takes one JSON request a line on its stdin (``run``, ``become``) and answers lines of
    this protocol (plus ``ready`` and ``done``) on the descriptor named by its argument."""

    def __init__(self, language: str, cwd: str, ident: Identity) -> None:
        self.language = language
        self.applied = ident.version
        self.cwd = cwd
        self._start(ident)

    def _start(self, ident: Identity) -> None:
        self.ident = ident
        language, cwd = self.language, self.cwd
        r, w = os.pipe()
        env = ident.env(dict(os.environ))
        env.pop("PYTHONPATH", None)
        env.setdefault("LANG", "C.UTF-8")
        try:
            # the answer pipe is the kernel's user's: a driver that opens /dev/fd/N (R's,
            # Java's) is refused a pipe of root's
            if ident.popen():
                os.fchown(w, ident.uid, ident.gid)
            self.proc = subprocess.Popen(
                self.command(w),
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL, stderr=None, cwd=cwd, env=env, pass_fds=(w,),
                start_new_session=True, **ident.popen())
        except BaseException:
            os.close(r)
            raise
        finally:
            os.close(w)
        self.events, self.buf = r, b""
        first = self._next(lambda: False)
        if first is None or first.get("type") != "ready":
            self.shutdown()
            raise RuntimeError(f"the {language} kernel did not start: {first!r}")

    def command(self, fd: int) -> list[str]:
        """The driver's argv, answering on descriptor ``fd``."""
        return [NODE, NODE_DRIVER, str(fd), self.language]

    def encode(self, request: dict[str, Any]) -> bytes:
        """One request as the driver reads it: a JSON line."""
        return json.dumps(request).encode() + b"\n"

    def _next(self, gone: Any) -> dict[str, Any] | None:
        """The driver's next line (None: it exited); raises Gone when the client leaves."""
        while True:
            nl = self.buf.find(b"\n")
            if nl >= 0:
                line, self.buf = self.buf[:nl], self.buf[nl + 1:]
                try:
                    value = json.loads(line)
                except ValueError:
                    continue
                if isinstance(value, dict):
                    return value
                continue
            ready, _, _ = select.select([self.events], [], [], 1)
            if ready:
                chunk = os.read(self.events, 1 << 20)
                if not chunk:
                    return None
                self.buf += chunk
                continue
            if gone():
                raise Gone()
            if self.proc.poll() is not None:
                return None

    def _call(self, request: dict[str, Any], emit: Any, gone: Any) -> bool:
        """Send one request and pass its lines to ``emit`` up to its ``done``; False when
        the driver exited."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(self.encode(request))
            self.proc.stdin.flush()
        except OSError:
            return False
        while True:
            line = self._next(gone)
            if line is None:
                return False
            if line.get("type") == "done":
                return True
            emit(line)

    def apply(self, ident: Identity, cwd: str) -> None:
        self.cwd = cwd
        ok = self._call({"op": "become", "uid": ident.uid if ident.user else None,
                         "gid": ident.gid, "groups": list(ident.groups),
                         "env": ident.env({}), "cwd": cwd}, lambda _line: None, lambda: False)
        if not ok:
            raise RuntimeError(f"the {self.language} kernel exited")
        self.ident = ident
        self.applied = ident.version

    def chdir(self, cwd: str) -> None:
        self.cwd = cwd
        self._call({"op": "chdir", "cwd": cwd}, lambda _line: None, lambda: False)

    def shutdown(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass
        self.proc.wait()
        os.close(self.events)

    def run(self, code: str, env: dict[str, str], emit: Any, gone: Any,
            typescript: bool = False) -> None:
        try:
            ok = self._call({"op": "run", "code": code, "env": env,
                             "typescript": typescript}, emit, gone)
        except Gone:  # a new process for the next cell: this one may be stuck
            self.shutdown()
            self._start(self.ident)
            raise
        if not ok:
            emit({"type": "error", "name": "KernelDied", "traceback": "",
                  "value": f"the {self.language} kernel exited; restart the context"})
        emit({"type": "end_of_execution"})


class RKernel(Respawns, NodeKernel):
    """An R context: one ``Rscript`` process running ``R_DRIVER`` (``code_interpreter_r.R``),
    with the same line protocol as ``NodeKernel``'s driver (``run``, ``chdir``). R cannot
    change its user (``Respawns``)."""

    def __init__(self, cwd: str, ident: Identity) -> None:
        super().__init__("r", cwd, ident)

    def command(self, fd: int) -> list[str]:
        return [RSCRIPT, "--vanilla", R_DRIVER, str(fd)]


class JavaKernel(Respawns, NodeKernel):
    """A Java context: one JVM running ``JAVA_DRIVER`` (``CodeInterpreterJava.java``, on
    JShell's API), with a line protocol of its own (tab-separated base64 fields, no JSON
    parser needed in Java) and the same answers. A run's ``env`` and the identity's
    variables are also system properties, as E2B's Java kernel gives them. A JVM cannot
    change its user either (``Respawns``)."""

    def __init__(self, cwd: str, ident: Identity) -> None:
        super().__init__("java", cwd, ident)

    def command(self, fd: int) -> list[str]:
        return [JAVA, "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1", "-Xshare:auto",
                f"-Dhangar.properties={','.join(self.ident.envs)}", JAVA_DRIVER, str(fd)]

    def encode(self, request: dict[str, Any]) -> bytes:
        def b64(text: str) -> str:
            return base64.b64encode(text.encode("utf-8", "surrogatepass")).decode()

        if request.get("op") == "run":
            fields = ["run", b64(request["code"])] + [
                b64(f"{k}={v}") for k, v in (request.get("env") or {}).items()]
        elif request.get("op") == "chdir":
            fields = ["chdir", b64(request["cwd"])]
        else:
            fields = ["noop"]
        return "\t".join(fields).encode() + b"\n"
