"""The code interpreter's server, run inside a ``code-interpreter`` guest (not on the host).

Written into the image by the ``code-interpreter`` recipe
(``hangar.images.recipes``) and started by its start command; it needs the
image's Debian packages (jupyter_client, ipykernel), never Hangar's modules.
It speaks the protocol of E2B's code interpreter on one TCP port (49999):

``POST /execute``  ``{"code", "context_id"?, "language"?, "env_vars"?}``: runs the
                   code in a context's kernel and streams newline-delimited JSON
                   objects as the kernel produces them, each with a ``type``:
                   ``stdout``/``stderr`` (``text``, ``timestamp`` in ns),
                   ``result`` (one key per format: ``text``, ``html``, ``markdown``,
                   ``svg``, ``png``, ``jpeg`` (base64), ``pdf``, ``latex``, ``json``,
                   ``javascript``, and a Python kernel's ``chart`` (a figure) and
                   ``data`` (a DataFrame), other MIME types under ``extra``; a
                   Python ``text`` loses its outer quotes, as E2B's; plus
                   ``is_main_result``: true for the cell's value, false for
                   ``display`` calls such as a matplotlib figure),
                   ``error`` (``name``, ``value``, ``traceback``),
                   ``number_of_executions`` (``execution_count``) and last
                   ``end_of_execution``. Without ``context_id`` the default
                   context runs it. ``env_vars`` hold for this run only.
``POST /contexts``  ``{"language"?, "cwd"?}``: a new context; answers ``{"id",
                   "language", "cwd"}``. Languages: ``python`` (the default),
                   ``javascript`` (``js``), ``typescript`` (``ts``), ``bash``, ``r``,
                   ``java``.
``GET /contexts``  every context. ``POST /contexts/{id}/restart`` gives it a new kernel
                   (its variables go); ``DELETE /contexts/{id}`` shuts it down.
``POST /configure`` ``{"user"?, "envs"?}``: whom kernels run as from now on (the host
                   sends it when an E2B sandbox is made: E2B's default user, the
                   create's envs): running kernels move to it (``Identity``), and
                   contexts in the server's folder move to the user's home.
``GET /health``    ``{"status": "ok", "spare": "ready"|"starting"|"failed"|"none",
                   "spare_start_s": seconds the last spare took to start, or null}``.

Each context is one ipykernel under a ``jupyter_client.KernelManager``; its
iopub messages are mapped to the lines above. One cell runs at a time in a
context (the next waits).

Kernels start ahead of need: starting one (and importing ``WARMUP``) takes
a second natively but 15 to 90 s under emulation (QEMU TCG), longer than
E2B's SDK waits for a call by default. So the server keeps one spare
kernel, started and warmed in the background (``Spares``): a create hands
it out at once (a ``cwd`` other than the server's is applied by a silent
``os.chdir``), a restart swaps it in at once and kills the old kernel, and
either then starts the next spare. When none is ready (two creates in a
row) the call waits for the one being started, up to ``SPARE_WAIT_S``;
only one kernel starts at a time, so that two starts never share the CPU.
The default context's kernel is started and warmed, then the spare, and
only then is the port bound: a port that accepts means both are ready,
which is what the image's ready check waits for, so a template snapshot
taken then holds both and every sandbox restored from it answers its
first create and restart at once. A spare costs about 130 MB of resident
memory (100 MB of it its own; measured natively with numpy, pandas and
matplotlib imported).

A client that goes away mid-cell interrupts the kernel. Bounds:
``MAX_BODY_BYTES`` per request, ``MAX_CONTEXTS`` contexts, one spare,
``MAX_REQUESTS`` requests at once (429 beyond); output is forwarded message
by message, never accumulated. Errors answer ``{"error": message}`` with
400, 404, 413, 429, 502 (a kernel failed to start) or 504 (no kernel ready
within ``SPARE_WAIT_S``). JavaScript and TypeScript contexts are Node.js processes
(``NodeKernel``), Bash ones ``bash`` processes (``BashKernel``), R ones ``Rscript``
processes (``RKernel``), Java ones JVMs on JShell (``JavaKernel``), started on demand (the
default JavaScript one before the port opens, after the spare); Python figures also come
back as structured charts. The kernels are in the files beside this one, which it imports:
``code_interpreter_jupyter.py`` (Python: ``Kernel``, the protocol's lines, the charts) and
``code_interpreter_kernels.py`` (``BashKernel``, ``NodeKernel``, ``RKernel``, ``JavaKernel``,
``Identity``; R's driver is ``code_interpreter_r.R``, Java's ``CodeInterpreterJava.java``).
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import select
import socket
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from code_interpreter_jupyter import Kernel, Spares, shutdown_later
from code_interpreter_kernels import (
    JAVA, NODE, RSCRIPT, BashKernel, Gone, Identity, JavaKernel, NodeKernel, Refused, RKernel,
)

PORT = 49999
MAX_BODY_BYTES = 4 << 20
"""Largest request body (code plus env vars), bytes."""
MAX_CONTEXTS = 16
MAX_REQUESTS = 32
MAX_ENV_VARS = 256
SPARE_WAIT_S = 240.0
"""Longest a create or restart waits for the spare being started, seconds: under the
host's 300 s per call (``hangar.core.interpreter.REQUEST_S``), so that the client gets
this server's clear 504 rather than the host's timeout."""
WARMUP = "__import__('numpy'), __import__('pandas'), __import__('matplotlib.pyplot')"
"""Run in every kernel (the default one and each spare) before it is used: the imports most
cells need, loaded without binding a name (a new context's namespace is empty)."""
LANGUAGES = {"python": "python", "python3": "python", "javascript": "javascript",
             "js": "javascript", "typescript": "typescript", "ts": "typescript",
             "bash": "bash"}
"""Language names a request may give → the context's language (R's and Java's when they
are installed)."""
if os.path.exists(RSCRIPT):
    LANGUAGES["r"] = "r"
if os.path.exists(JAVA):
    LANGUAGES["java"] = "java"


IDENTITY = Identity()
"""The current identity (replaced whole by ``/configure``)."""


def identity_of(user: str | None, envs: dict[str, str], version: int) -> Identity:
    """The identity for ``user`` (None: root, as the server) and ``envs``; Refused 400 for a
    user the guest does not know."""
    if not user:
        return Identity(version=version, envs=dict(envs))
    try:
        e = pwd.getpwnam(user)
    except KeyError:
        raise Refused(400, f"no user {user!r} in the sandbox") from None
    return Identity(version=version, user=user, uid=e.pw_uid, gid=e.pw_gid,
                    groups=tuple(os.getgrouplist(user, e.pw_gid)), home=e.pw_dir,
                    envs=dict(envs))


class KernelContext:
    """One context: its language, its kernel (swapped for a new one on restart), its working
    folder, and the lock that runs one cell at a time."""

    def __init__(self, kernel: Any, cwd: str, default: bool = False) -> None:
        self.id = uuid.uuid4().hex
        self.cwd = cwd
        self.default = default
        self.lock = threading.Lock()
        self.kernel = kernel
        self.language: str = kernel.language

    def view(self) -> dict[str, str]:
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    def ready(self) -> None:
        """Bring the kernel to the current identity and the context's folder (a kernel
        started earlier runs as the server, in its folder). Called with ``lock`` held."""
        if self.kernel.applied < IDENTITY.version:
            self.kernel.apply(IDENTITY, self.cwd)

    def restart(self, spares: Spares) -> None:
        """Give the context a new kernel of its language in its folder (a Python one is the
        spare, swapped in at once), waiting for a running cell to end; the old kernel is
        killed in the background: the variables go at once."""
        with self.lock:
            if self.language == "python":
                new = spares.take(SPARE_WAIT_S, lambda k: k.ready_in(IDENTITY, self.cwd))
            else:
                new = start_kernel(self.language, self.cwd, self.default)
            old, self.kernel = self.kernel, new
            shutdown_later(old)

    def shutdown(self) -> None:
        with self.lock:
            self.kernel.shutdown()

    def run(self, code: str, env: dict[str, str], emit: Any, gone: Any,
            typescript: bool = False) -> None:
        """Run one cell (``Kernel.run``); ``typescript``: a TypeScript cell in a JavaScript
        context."""
        with self.lock:
            self.ready()
            if typescript:
                self.kernel.run(code, env, emit, gone, typescript=True)
            else:
                self.kernel.run(code, env, emit, gone)


def start_kernel(language: str, cwd: str, default: bool = False) -> Any:
    """A new kernel of a language other than Python, started as ``IDENTITY`` in ``cwd``."""
    if language == "bash":
        return BashKernel(cwd, IDENTITY)
    if language == "r":
        return RKernel(cwd, IDENTITY)
    if language == "java":
        return JavaKernel(cwd, IDENTITY)
    return NodeKernel(language, cwd, IDENTITY)


class Contexts:
    """Every context by id, the default one of each language, and the spare Python kernel
    they are made from."""

    def __init__(self, cwd: str, spares: Spares) -> None:
        self.cwd = cwd
        self.spares = spares
        self.lock = threading.Lock()
        self.by_id: dict[str, KernelContext] = {}
        self.defaults: dict[str, str] = {}
        """Language → id of its default context."""
        self.pending = 0  # creates waiting for a kernel, counted against MAX_CONTEXTS

    def start_default(self, warmup: str) -> KernelContext:
        """Start the default Python context's own kernel (at server start, before any
        spare)."""
        kernel = Kernel(self.cwd)
        if warmup:
            kernel.silent(warmup)
        return self._put(KernelContext(kernel, self.cwd, default=True))

    def start_default_of(self, language: str) -> KernelContext | None:
        """Start the default context of another language, as E2B's server does for
        JavaScript (before the port opens, so that a template snapshot holds it and every
        sandbox lists it from the start); None (logged) when its runtime is missing or
        fails."""
        try:
            return self.default(language)
        except Exception as exc:
            print(f"code interpreter: no default {language} context: {exc}", file=sys.stderr,
                  flush=True)
            return None

    def _put(self, ctx: KernelContext) -> KernelContext:
        with self.lock:
            self.by_id[ctx.id] = ctx
            if ctx.default:
                self.defaults[ctx.language] = ctx.id
        return ctx

    def default(self, language: str = "python") -> KernelContext:
        """The default context of ``language``; made when there is none (or it was
        removed)."""
        with self.lock:
            ctx = self.by_id.get(self.defaults.get(language, ""))
            cwd = self.cwd
        return ctx if ctx is not None else self._add(language, cwd, default=True)

    def create(self, language: str, cwd: str | None) -> KernelContext:
        cwd = cwd or self.cwd
        if not os.path.isdir(cwd):
            raise Refused(400, f"cwd {cwd!r} is not a folder in the sandbox")
        return self._add(language, cwd)

    def _add(self, language: str, cwd: str, default: bool = False) -> KernelContext:
        with self.lock:
            if len(self.by_id) + self.pending >= MAX_CONTEXTS:
                raise Refused(429, f"at most {MAX_CONTEXTS} contexts; remove one first")
            self.pending += 1
        try:
            if language == "python":
                kernel = self.spares.take(SPARE_WAIT_S, lambda k: k.ready_in(IDENTITY, cwd))
            else:
                kernel = start_kernel(language, cwd, default)
            ctx = KernelContext(kernel, cwd, default)
        finally:
            with self.lock:
                self.pending -= 1
        with self.lock:
            if default:
                current = self.by_id.get(self.defaults.get(language, ""))
                if current is not None:  # another call made it meanwhile: hand that out
                    shutdown_later(ctx.kernel)
                    return current
                self.defaults[language] = ctx.id
                # a configure while it started moved the server's folder (to the user's
                # home): the default context follows, as the others did (``ready`` moves
                # its kernel, whose identity is older, before its first cell)
                ctx.cwd = self.cwd
            self.by_id[ctx.id] = ctx
        return ctx

    def configure(self, ident: Identity) -> None:
        """Make ``ident`` the current identity: new kernels start as it, the contexts made
        so far (the default ones) move to it now, and those in the server's folder move to
        the user's home, which becomes the default folder."""
        global IDENTITY
        home = ident.home if ident.user and ident.home and os.path.isdir(ident.home) else None
        with self.lock:
            IDENTITY = ident
            contexts = list(self.by_id.values())
            old_cwd, self.cwd = self.cwd, home or self.cwd
        for ctx in contexts:
            with ctx.lock:
                if ctx.cwd == old_cwd:
                    ctx.cwd = self.cwd
                try:
                    ctx.ready()
                except Exception as exc:  # its next cell tries again
                    print(f"code interpreter: context {ctx.id} not moved to the new identity: "
                          f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)

    def get(self, context_id: str) -> KernelContext:
        ctx = self.by_id.get(context_id)
        if ctx is None:
            raise Refused(404, f"no context {context_id!r}")
        return ctx

    def remove(self, context_id: str) -> None:
        with self.lock:
            ctx = self.get(context_id)
            del self.by_id[context_id]
        ctx.shutdown()


class Handler(BaseHTTPRequestHandler):
    server_version = "hangar-code-interpreter"
    contexts: Contexts
    slots = threading.BoundedSemaphore(MAX_REQUESTS)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass

    def do_GET(self) -> None:  # noqa: N802
        self._serve("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._serve("POST")

    def do_DELETE(self) -> None:  # noqa: N802
        self._serve("DELETE")

    def _serve(self, method: str) -> None:
        if not self.slots.acquire(blocking=False):
            self._json(429, {"error": f"at most {MAX_REQUESTS} requests at once"})
            return
        try:
            self._route(method, self.path.split("?", 1)[0].rstrip("/"))
        except Refused as exc:
            self._json(exc.status, {"error": str(exc)})
        except Gone:
            pass
        except Exception as exc:  # a kernel that fails to start or answer
            self._json(500, {"error": f"{type(exc).__name__}: {exc}"})
        finally:
            self.slots.release()

    def _route(self, method: str, path: str) -> None:
        parts = path.split("/")[1:]
        if method == "GET" and parts == ["health"]:
            spares = self.contexts.spares
            return self._json(200, {"status": "ok", "spare": spares.state(),
                                    "spare_start_s": spares.started_s})
        if method == "POST" and parts == ["execute"]:
            return self._execute(self._body())
        if method == "POST" and parts == ["configure"]:
            body = self._body()
            user, envs = body.get("user"), body.get("envs") or {}
            if user is not None and not isinstance(user, str):
                raise Refused(400, "user must be a string")
            self.contexts.configure(identity_of(user, _env_vars(envs), IDENTITY.version + 1))
            return self._json(200, {"cwd": self.contexts.cwd})
        if parts[:1] == ["contexts"]:
            if len(parts) == 1 and method == "GET":
                return self._json(200, [c.view() for c in list(self.contexts.by_id.values())])
            if len(parts) == 1 and method == "POST":
                body = self._body()
                language = _language(body.get("language"))
                cwd = body.get("cwd")
                if cwd is not None and not isinstance(cwd, str):
                    raise Refused(400, "cwd must be a string")
                return self._json(200, self.contexts.create(language, cwd).view())
            if len(parts) == 3 and parts[2] == "restart" and method == "POST":
                self.contexts.get(parts[1]).restart(self.contexts.spares)
                return self._json(200, {})
            if len(parts) == 2 and method == "DELETE":
                self.contexts.remove(parts[1])
                return self._empty(204)
        raise Refused(404, f"no route {method} {path or '/'}")

    def _body(self) -> dict[str, Any]:
        try:
            n = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            raise Refused(400, "bad Content-Length") from None
        if n > MAX_BODY_BYTES:
            raise Refused(413, f"the request body is over {MAX_BODY_BYTES} bytes")
        raw = self.rfile.read(n) if n else b"{}"
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            raise Refused(400, "the body is not JSON") from None
        if not isinstance(body, dict):
            raise Refused(400, "the body must be a JSON object")
        return body

    def _execute(self, body: dict[str, Any]) -> None:
        code = body.get("code")
        if not isinstance(code, str):
            raise Refused(400, "code must be a string")
        env = _env_vars(body.get("env_vars") or {})
        context_id = body.get("context_id")
        typescript = False
        if context_id:
            if body.get("language"):
                raise Refused(400, "give context_id or language, not both")
            ctx = self.contexts.get(str(context_id))
        else:
            language = _language(body.get("language"))
            # TypeScript cells without a context run in the default JavaScript one (E2B's
            # kernel serves both)
            ctx = self.contexts.default("javascript" if language == "typescript" else language)
            typescript = language == "typescript"
        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Cache-Control", "no-store")
        self.send_header("Connection", "close")
        self.end_headers()

        def emit(line: dict[str, Any]) -> None:
            try:
                self.wfile.write(json.dumps(line).encode() + b"\n")
                self.wfile.flush()
            except OSError:
                raise Gone() from None

        try:
            ctx.run(code, env, emit, lambda: _closed(self.connection), typescript=typescript)
        except Exception as exc:  # the stream has begun: the cell ends in an error
            if isinstance(exc, Gone):
                raise
            emit({"type": "error", "name": type(exc).__name__, "value": str(exc),
                  "traceback": ""})
            emit({"type": "end_of_execution"})

    def _json(self, status: int, value: Any) -> None:
        data = json.dumps(value).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _empty(self, status: int) -> None:
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()


def _closed(sock: socket.socket) -> bool:
    """Whether the peer closed ``sock`` (its request was read whole: only EOF is left)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def _language(language: Any) -> str:
    """The context language a request's ``language`` names (none: Python); Refused 400 for
    one not served here."""
    if language in (None, ""):
        return "python"
    if not isinstance(language, str) or language.lower() not in LANGUAGES:
        raise Refused(400, f"language {str(language)[:40]!r} is not served here (only "
                           f"{', '.join(sorted(set(LANGUAGES.values())))})")
    return LANGUAGES[language.lower()]


def _env_vars(env: Any) -> dict[str, str]:
    if (not isinstance(env, dict) or len(env) > MAX_ENV_VARS
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        raise Refused(400, f"env_vars must map at most {MAX_ENV_VARS} names to strings")
    return env


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, default=PORT)
    p.add_argument("--cwd", default=os.path.expanduser("~"))
    p.add_argument("--warmup", default=WARMUP)
    a = p.parse_args()
    t0 = time.monotonic()
    spares = Spares(a.cwd, a.warmup)
    contexts = Contexts(a.cwd, spares)
    contexts.start_default(a.warmup)
    t1 = time.monotonic()
    spares.wait()  # the port opens with both ready: a template snapshot then holds both
    t2 = time.monotonic()
    if os.path.exists(NODE):  # and the default JavaScript context, as E2B's server has
        contexts.start_default_of("javascript")
    Handler.contexts = contexts
    server = Server(("127.0.0.1", a.port), Handler)
    print(f"code interpreter: default kernel ready in {t1 - t0:.1f} s, spare in "
          f"{t2 - t1:.1f} s more, JavaScript in {time.monotonic() - t2:.1f} s more; "
          f"serving on port {a.port}", file=sys.stderr, flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
