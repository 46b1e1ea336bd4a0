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
                   ``javascript``, other MIME types under ``extra``; plus
                   ``is_main_result``: true for the cell's value, false for
                   ``display`` calls such as a matplotlib figure),
                   ``error`` (``name``, ``value``, ``traceback``),
                   ``number_of_executions`` (``execution_count``) and last
                   ``end_of_execution``. Without ``context_id`` the default
                   context runs it. ``env_vars`` hold for this run only.
``POST /contexts``  ``{"language"?, "cwd"?}``: a new context; answers ``{"id",
                   "language", "cwd"}``.
``GET /contexts``  every context. ``POST /contexts/{id}/restart`` gives it a new kernel
                   (its variables go); ``DELETE /contexts/{id}`` shuts it down.
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
within ``SPARE_WAIT_S``). Python only.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import select
import socket
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from jupyter_client.manager import KernelManager

PORT = 49999
MAX_BODY_BYTES = 4 << 20
"""Largest request body (code plus env vars), bytes."""
MAX_CONTEXTS = 16
MAX_REQUESTS = 32
MAX_ENV_VARS = 256
KERNEL_START_S: float | None = None
"""Longest a kernel may take to answer after its process started, seconds: none of its own.
A dead kernel is noticed at once (``wait_for_ready`` watches it); a slow one is bounded by
what waits for it: the template's ready timeout at server start, a take's SPARE_WAIT_S
later. A fixed 120 s failed the start on a busy host (imports under emulation)."""
SPARE_WAIT_S = 240.0
"""Longest a create or restart waits for the spare being started, seconds: under the
host's 300 s per call (``hangar.core.interpreter.REQUEST_S``), so that the client gets
this server's clear 504 rather than the host's timeout."""
WARMUP = "__import__('numpy'), __import__('pandas'), __import__('matplotlib.pyplot')"
"""Run in every kernel (the default one and each spare) before it is used: the imports most
cells need, loaded without binding a name (a new context's namespace is empty)."""
FORMATS = {
    "text/plain": "text", "text/html": "html", "text/markdown": "markdown",
    "image/svg+xml": "svg", "image/png": "png", "image/jpeg": "jpeg",
    "application/pdf": "pdf", "text/latex": "latex", "application/json": "json",
    "application/javascript": "javascript",
}
"""MIME type → the result's key; other types go under ``extra``."""
LANGUAGES = ("python", "python3")
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Gone(Exception):
    """The client closed its connection mid-cell."""


class Kernel:
    """One started ipykernel: its manager and a blocking client. Used by one thread at a time
    (a context's lock, or the spare's starter before it is handed out)."""

    def __init__(self, cwd: str) -> None:
        env = dict(os.environ, MPLBACKEND="module://matplotlib_inline.backend_inline",
                   PYTHONUNBUFFERED="1", PYDEVD_DISABLE_FILE_VALIDATION="1")
        env.pop("PYTHONPATH", None)  # Hangar's guest modules are no business of the kernel
        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(cwd=cwd, env=env,
                             extra_arguments=["--InteractiveShell.colors=NoColor"])
        try:
            self.kc = self.km.blocking_client()
            self.kc.start_channels()
            self.kc.wait_for_ready(timeout=KERNEL_START_S)
        except BaseException:
            self.km.shutdown_kernel(now=True)
            raise

    def shutdown(self) -> None:
        """Stop the client and kill the kernel (no graceful shutdown request: nothing of it
        is kept)."""
        try:
            self.kc.stop_channels()
        finally:
            self.km.shutdown_kernel(now=True)

    def silent(self, code: str) -> None:
        """Run ``code`` with no output, history or count, waiting for the kernel to idle
        however long that takes (under emulation on a busy host, the warm-up's imports take
        minutes; the template's ready timeout bounds the whole start). Returning early
        would open the port, and a template's snapshot would hold a half-done import that
        every copy then finishes on its first cell."""
        msg_id = self.kc.execute(code, silent=True, store_history=False)
        self.drain(msg_id, timeout=None)

    def drain(self, msg_id: str, timeout: float | None = 30.0) -> None:
        """Read iopub until ``msg_id``'s cell idles (or ``timeout`` s), then its reply."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while deadline is None or time.monotonic() < deadline:
            try:
                msg = self.kc.get_iopub_msg(timeout=1)
            except queue.Empty:
                if not self.km.is_alive():
                    return
                continue
            if (msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "status"
                    and msg["content"].get("execution_state") == "idle"):
                break
        self.reply(msg_id)

    def reply(self, msg_id: str) -> None:
        """Consume the shell reply of ``msg_id`` (replies would pile up otherwise)."""
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                msg = self.kc.get_shell_msg(timeout=1)
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") == msg_id:
                return


def _shutdown_later(kernel: Kernel) -> None:
    """Kill ``kernel`` in a thread of its own: the caller answers at once."""
    threading.Thread(target=kernel.shutdown, name="kernel-shutdown", daemon=True).start()


class Spares:
    """The spare kernel: at most one, started and warmed in the background, handed out by
    ``take``. One start runs at a time (a second one at once would only halve the CPU of
    both under emulation); a failed start is retried by the next ``take``."""

    def __init__(self, cwd: str, warmup: str) -> None:
        self.cwd = cwd
        self.warmup = warmup
        self.cond = threading.Condition()
        self.ready: Kernel | None = None
        self.starting = False
        self.failed: str | None = None
        self.started_s: float | None = None
        """Seconds the last spare took to start and warm up (None before the first)."""

    def _spawn(self) -> None:
        if self.ready is None and not self.starting:
            self.starting = True
            threading.Thread(target=self._start, name="spare-kernel", daemon=True).start()

    def _start(self) -> None:
        t0 = time.monotonic()
        try:
            kernel = Kernel(self.cwd)
            try:
                if self.warmup:
                    kernel.silent(self.warmup)
                if not kernel.km.is_alive():
                    raise RuntimeError("the kernel died while it imported the warm-up modules")
            except BaseException:
                kernel.shutdown()
                raise
        except Exception as exc:  # reported to the waiting takes; the next take retries
            with self.cond:
                self.starting = False
                self.failed = f"{type(exc).__name__}: {exc}"
                self.cond.notify_all()
            print(f"code interpreter: spare kernel failed: {self.failed}", file=sys.stderr,
                  flush=True)
            return
        with self.cond:
            self.ready, self.starting, self.failed = kernel, False, None
            self.started_s = time.monotonic() - t0
            self.cond.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until a spare is ready (True) or ``timeout`` seconds pass (False); starts one
        if none is ready or starting."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            while self.ready is None:
                self._spawn()
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self.cond.wait(left)
            return True

    def take(self, timeout: float) -> Kernel:
        """The ready spare, waiting up to ``timeout`` seconds for the one being started
        (starting one if none is); the next one then starts in the background. Raises
        Refused: 504 when none is ready in time (the start goes on: the next call gets
        it), 502 when the start it waited for failed (the next call tries again)."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while self.ready is None:
                self._spawn()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Refused(504, f"no kernel was ready within {timeout:g} s; one is "
                                       "starting: try again")
                self.cond.wait(left)
                if self.ready is None and not self.starting and self.failed is not None:
                    raise Refused(502, f"a kernel failed to start: {self.failed}")
            kernel, self.ready = self.ready, None
            self._spawn()
            return kernel

    def state(self) -> str:
        """``ready``, ``starting``, ``failed`` (the last start; the next take retries) or
        ``none`` (what ``/health`` shows)."""
        with self.cond:
            return ("ready" if self.ready is not None else "starting" if self.starting
                    else "failed" if self.failed else "none")

class KernelContext:
    """One context: its kernel (swapped for a spare on restart), its working folder, and the
    lock that runs one cell at a time."""

    def __init__(self, kernel: Kernel, cwd: str, default: bool = False) -> None:
        self.id = uuid.uuid4().hex
        self.cwd = cwd
        self.default = default
        self.lock = threading.Lock()
        self.kernel = kernel

    def view(self) -> dict[str, str]:
        return {"id": self.id, "language": "python", "cwd": self.cwd}

    def enter_cwd(self) -> None:
        """Move the kernel to the context's folder (a spare starts in the server's)."""
        self.kernel.silent(f"__import__('os').chdir({self.cwd!r})")

    def restart(self, spares: Spares) -> None:
        """Swap in the spare (waiting for a running cell to end, as a restart always did)
        and kill the old kernel in the background: the variables go at once."""
        with self.lock:
            old, self.kernel = self.kernel, spares.take(SPARE_WAIT_S)
            _shutdown_later(old)
            if self.cwd != spares.cwd:
                self.enter_cwd()

    def shutdown(self) -> None:
        with self.lock:
            self.kernel.shutdown()

    def run(self, code: str, env: dict[str, str], emit: Any, gone: Any) -> None:
        """Run one cell, calling ``emit(line_dict)`` for each output as it comes;
        ``gone()`` tells whether the client left (the kernel is then interrupted)."""
        with self.lock:
            k = self.kernel
            if env:
                k.silent("import os as _hangar_os\n"
                         f"_hangar_saved = {{k: _hangar_os.environ.get(k) for k in {list(env)!r}}}\n"
                         f"_hangar_os.environ.update({env!r})\n")
            try:
                self._run(k, code, emit, gone)
            finally:
                if env:
                    k.silent("for _k, _v in _hangar_saved.items():\n"
                             "    if _v is None: _hangar_os.environ.pop(_k, None)\n"
                             "    else: _hangar_os.environ[_k] = _v\n"
                             "del _hangar_saved, _k, _v\n")

    @staticmethod
    def _run(k: Kernel, code: str, emit: Any, gone: Any) -> None:
        msg_id = k.kc.execute(code, store_history=True, allow_stdin=False, stop_on_error=True)
        try:
            while True:
                try:
                    msg = k.kc.get_iopub_msg(timeout=1)
                except queue.Empty:
                    if gone():
                        raise Gone() from None
                    if not k.km.is_alive():
                        emit({"type": "error", "name": "KernelDied",
                              "value": "the kernel died; restart the context",
                              "traceback": ""})
                        break
                    continue
                if msg["parent_header"].get("msg_id") != msg_id:
                    continue
                kind, c = msg["msg_type"], msg["content"]
                if kind == "status" and c.get("execution_state") == "idle":
                    break
                line = to_line(kind, c)
                if line is not None:
                    emit(line)
        except Gone:
            k.km.interrupt_kernel()
            k.drain(msg_id)
            raise
        k.reply(msg_id)
        emit({"type": "end_of_execution"})


def to_line(kind: str, c: dict[str, Any]) -> dict[str, Any] | None:
    """The protocol line for one iopub message, or None for messages it does not show."""
    if kind == "stream":
        return {"type": "stderr" if c.get("name") == "stderr" else "stdout",
                "text": c.get("text", ""), "timestamp": time.time_ns()}
    if kind in ("execute_result", "display_data"):
        out: dict[str, Any] = {"type": "result", "is_main_result": kind == "execute_result"}
        extra: dict[str, Any] = {}
        for mime, value in (c.get("data") or {}).items():
            if mime in FORMATS:
                out[FORMATS[mime]] = value
            else:
                extra[mime] = value
        if extra:
            out["extra"] = extra
        return out
    if kind == "error":
        return {"type": "error", "name": c.get("ename", ""), "value": c.get("evalue", ""),
                "traceback": ANSI.sub("", "\n".join(c.get("traceback") or []))}
    if kind == "execute_input":
        return {"type": "number_of_executions", "execution_count": c.get("execution_count")}
    return None


class Contexts:
    """Every context by id, the default one first, and the spare kernel they are made from."""

    def __init__(self, cwd: str, spares: Spares) -> None:
        self.cwd = cwd
        self.spares = spares
        self.lock = threading.Lock()
        self.by_id: dict[str, KernelContext] = {}
        self.default_id: str | None = None
        self.pending = 0  # creates waiting for a kernel, counted against MAX_CONTEXTS

    def start_default(self, warmup: str) -> KernelContext:
        """Start the default context's own kernel (at server start, before any spare)."""
        kernel = Kernel(self.cwd)
        if warmup:
            kernel.silent(warmup)
        ctx = KernelContext(kernel, self.cwd, default=True)
        with self.lock:
            self.by_id[ctx.id] = ctx
            self.default_id = ctx.id
        return ctx

    def default(self) -> KernelContext:
        """The default context; a spare becomes it when it was removed."""
        with self.lock:
            ctx = self.by_id.get(self.default_id or "")
        return ctx if ctx is not None else self._add(self.cwd, default=True)

    def create(self, cwd: str | None) -> KernelContext:
        cwd = cwd or self.cwd
        if not os.path.isdir(cwd):
            raise Refused(400, f"cwd {cwd!r} is not a folder in the sandbox")
        return self._add(cwd)

    def _add(self, cwd: str, default: bool = False) -> KernelContext:
        with self.lock:
            if len(self.by_id) + self.pending >= MAX_CONTEXTS:
                raise Refused(429, f"at most {MAX_CONTEXTS} contexts; remove one first")
            self.pending += 1
        try:
            ctx = KernelContext(self.spares.take(SPARE_WAIT_S), cwd, default)
            if cwd != self.cwd:
                ctx.enter_cwd()
        finally:
            with self.lock:
                self.pending -= 1
        with self.lock:
            if default:
                current = self.by_id.get(self.default_id or "")
                if current is not None:  # another call made it meanwhile: hand that out
                    _shutdown_later(ctx.kernel)
                    return current
                self.default_id = ctx.id
            self.by_id[ctx.id] = ctx
        return ctx

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
        if parts[:1] == ["contexts"]:
            if len(parts) == 1 and method == "GET":
                return self._json(200, [c.view() for c in list(self.contexts.by_id.values())])
            if len(parts) == 1 and method == "POST":
                body = self._body()
                _language(body.get("language"))
                cwd = body.get("cwd")
                if cwd is not None and not isinstance(cwd, str):
                    raise Refused(400, "cwd must be a string")
                return self._json(200, self.contexts.create(cwd).view())
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
        env = body.get("env_vars") or {}
        if (not isinstance(env, dict) or len(env) > MAX_ENV_VARS
                or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
            raise Refused(400, f"env_vars must map at most {MAX_ENV_VARS} names to strings")
        context_id = body.get("context_id")
        if context_id:
            if body.get("language"):
                raise Refused(400, "give context_id or language, not both")
            ctx = self.contexts.get(str(context_id))
        else:
            _language(body.get("language"))
            ctx = self.contexts.default()
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

        ctx.run(code, env, emit, lambda: _closed(self.connection))

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


def _language(language: Any) -> None:
    if language not in (None, "", *LANGUAGES):
        raise Refused(400, f"language {language!r} is not served here (only python)")


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
    Handler.contexts = contexts
    server = Server(("127.0.0.1", a.port), Handler)
    print(f"code interpreter: default kernel ready in {t1 - t0:.1f} s, spare in "
          f"{time.monotonic() - t1:.1f} s more; serving on port {a.port}",
          file=sys.stderr, flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
