"""The code interpreter's Python kernels, run inside a ``code-interpreter`` guest (not on
the host): one ipykernel under a ``jupyter_client.KernelManager`` a context (``Kernel``),
its iopub messages mapped to the server's protocol lines (``to_line``: the ``result``
keys by MIME type, ``FORMATS``, its ``text`` without outer quotes as E2B's server gives it,
``unquoted``; ``error`` with its traceback's colours taken out), matplotlib figures also
given as structured charts and pandas DataFrames as data (``FORMATTERS_SETUP`` loads
``CHARTS``, ``code_interpreter_charts.py``, and ``DATA``, ``code_interpreter_data.py``, into
each kernel); ``Spares``, the one spare kernel kept started and warm for the next create
or restart. The server (``code_interpreter.py``) imports this file from its own folder;
it needs the image's jupyter_client and ipykernel, never Hangar's modules.
"""

from __future__ import annotations

import os
import queue
import re
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from jupyter_client.manager import KernelManager

from code_interpreter_kernels import Gone, Identity, Refused

KERNEL_START_S: float | None = None
"""Longest a kernel may take to answer after its process started, seconds: none of its own.
A dead kernel is noticed at once (``wait_for_ready`` watches it); a slow one is bounded by
what waits for it: the template's ready timeout at server start, a take's SPARE_WAIT_S
later. A fixed 120 s failed the start on a busy host (imports under emulation)."""
SPARE_NICE = 10
"""The spare's nice value until it is handed out (``Kernel.set_nice``): its start and imports
yield the guest's vCPU to the cells and commands running meanwhile (a weight of 110 against
1024), and still take all of it when the guest is idle."""
HERE = os.path.dirname(os.path.abspath(__file__))
CHARTS = os.path.join(HERE, "code_interpreter_charts.py")
DATA = os.path.join(HERE, "code_interpreter_data.py")
CHART_MIME = "application/vnd.hangar.chart+json"
"""A Python kernel's structured chart of a matplotlib figure (``CHARTS``): the result's
``chart``."""
DATA_MIME = "application/vnd.hangar.data+json"
"""A Python kernel's pandas DataFrame as columns of values (``DATA``): the result's ``data``."""
FORMATTERS_SETUP = f"""def _hangar_formatters():
    import importlib.util, os, sys
    for name, path in (("_hangar_charts", {CHARTS!r}), ("_hangar_data", {DATA!r})):
        if not os.path.exists(path):
            continue
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
        module.install(get_ipython())
_hangar_formatters()
del _hangar_formatters
"""
"""Run silently in each new kernel: the display formatters of ``CHARTS`` and ``DATA``."""
FORMATS = {
    "text/plain": "text", "text/html": "html", "text/markdown": "markdown",
    "image/svg+xml": "svg", "image/png": "png", "image/jpeg": "jpeg",
    "application/pdf": "pdf", "text/latex": "latex", "application/json": "json",
    "application/javascript": "javascript", CHART_MIME: "chart", DATA_MIME: "data",
}
"""MIME type → the result's key; other types go under ``extra``."""
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class Kernel:
    """One started ipykernel: its manager and a blocking client. Used by one thread at a time
    (a context's lock, or the spare's starter before it is handed out). It starts as the
    server's user (root) and moves to ``IDENTITY`` in place (``apply``: set*id, the
    environment, the folder), so that a spare warmed before a configure serves after it."""

    language = "python"

    def __init__(self, cwd: str, nice: int = 0) -> None:
        """Start a kernel in ``cwd``, at ``nice`` (``set_nice``) from its first
        instruction on; waits until it answers."""
        self.applied = 0
        """The ``Identity.version`` this kernel runs as."""
        self.cwd = cwd
        """The folder it runs in."""
        env = dict(os.environ, MPLBACKEND="module://matplotlib_inline.backend_inline",
                   PYTHONUNBUFFERED="1", PYDEVD_DISABLE_FILE_VALIDATION="1")
        env.pop("PYTHONPATH", None)  # Hangar's guest modules are no business of the kernel
        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(cwd=cwd, env=env,
                             extra_arguments=["--InteractiveShell.colors=NoColor",
                                              # no history file: the kernel may change user
                                              "--HistoryManager.enabled=False"])
        try:
            if nice:
                self.set_nice(nice)
            self.kc = self.km.blocking_client()
            self.kc.start_channels()
            self.kc.wait_for_ready(timeout=KERNEL_START_S)
            self.silent(FORMATTERS_SETUP)
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

    def apply(self, ident: Identity, cwd: str) -> None:
        """Run as ``ident`` from now on (its user, once, from root; its variables) in
        ``cwd``."""
        code = ["def _hangar_become():", "    import os",
                f"    os.environ.update({ident.env({})!r})"]
        if ident.user and ident.uid != 0:
            code += ["    if os.getuid() == 0:",
                     f"        os.setgroups({list(ident.groups)!r})",
                     f"        os.setgid({ident.gid})",
                     f"        os.setuid({ident.uid})"]
        code += [f"    os.chdir({cwd!r})", "_hangar_become()", "del _hangar_become"]
        self.silent("\n".join(code) + "\n")
        self.applied, self.cwd = ident.version, cwd

    def chdir(self, cwd: str) -> None:
        self.silent(f"__import__('os').chdir({cwd!r})")
        self.cwd = cwd

    def ready_in(self, ident: Identity, cwd: str) -> None:
        """Run as ``ident`` in ``cwd``, with one silent cell at most (none when it already
        does)."""
        if self.applied < ident.version:
            self.apply(ident, cwd)
        elif cwd != self.cwd:
            self.chdir(cwd)

    def set_nice(self, nice: int) -> None:
        """Give every thread of the kernel's process group (the kernel runs in a session of
        its own) the nice value ``nice``; threads and children made later inherit it. Only
        root may lower it again; a server that is not root keeps what it has."""
        process = getattr(getattr(self.km, "provisioner", None), "process", None)
        if process is None:
            return
        try:
            os.setpriority(os.PRIO_PGRP, os.getpgid(process.pid), nice)
        except OSError:
            pass

    def run(self, code: str, env: dict[str, str], emit: Any, gone: Any) -> None:
        """Run one cell with ``env`` set for it, calling ``emit(line_dict)`` for each output
        as it comes; ``gone()`` tells whether the client left (the kernel is then
        interrupted)."""
        if env:
            self.silent("import os as _hangar_os\n"
                        f"_hangar_saved = {{k: _hangar_os.environ.get(k) for k in {list(env)!r}}}\n"
                        f"_hangar_os.environ.update({env!r})\n")
        try:
            self._run(code, emit, gone)
        finally:
            if env:
                self.silent("for _k, _v in _hangar_saved.items():\n"
                            "    if _v is None: _hangar_os.environ.pop(_k, None)\n"
                            "    else: _hangar_os.environ[_k] = _v\n"
                            "del _hangar_saved, _k, _v\n")

    def _run(self, code: str, emit: Any, gone: Any) -> None:
        k = self
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


def shutdown_later(kernel: Kernel) -> None:
    """Kill ``kernel`` in a thread of its own: the caller answers at once."""
    threading.Thread(target=kernel.shutdown, name="kernel-shutdown", daemon=True).start()


def unquoted(text: str) -> str:
    """A result's ``text/plain`` as E2B's server gives it: without its outer quotes when it
    starts and ends with the same kind (``'supertest'``, a ``str``'s repr, is
    ``supertest``; escapes inside stay), else as it is."""
    if text and text[0] in "'\"" and text.endswith(text[0]):
        return text[1:-1]
    return text


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
        if isinstance(out.get("text"), str):
            out["text"] = unquoted(out["text"])
        if extra:
            out["extra"] = extra
        return out
    if kind == "error":
        return {"type": "error", "name": c.get("ename", ""), "value": c.get("evalue", ""),
                "traceback": ANSI.sub("", "\n".join(c.get("traceback") or []))}
    if kind == "execute_input":
        return {"type": "number_of_executions", "execution_count": c.get("execution_count")}
    return None


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
        self.handing = 0
        """Spares taken and still being prepared (``take``): none starts meanwhile."""

    def _spawn(self) -> None:
        """Start the next spare unless one is ready or starting, or a taken one is still
        being prepared (``take``)."""
        if self.ready is None and not self.starting and not self.handing:
            self.starting = True
            threading.Thread(target=self._start, name="spare-kernel", daemon=True).start()

    def _start(self) -> None:
        t0 = time.monotonic()
        try:
            kernel = Kernel(self.cwd, nice=SPARE_NICE)
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

    def take(self, timeout: float, prepare: Callable[[Kernel], None]) -> Kernel:
        """The ready spare, waiting up to ``timeout`` seconds for the one being started
        (starting one if none is), given the foreground's priority and then
        ``prepare(kernel)`` (its identity, its folder); only then does the next spare start
        in the background, so that the hand-out never shares the guest's CPU with a kernel
        start (6.8 s instead of under 1 s, measured under emulation with a 2.2 s boot).
        Raises Refused: 504 when none is ready in time (the start goes on: the next call
        gets it), 502 when the start it waited for failed (the next call tries again)."""
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
            self.handing += 1
        try:
            kernel.set_nice(0)
            prepare(kernel)
        except BaseException:
            shutdown_later(kernel)
            raise
        finally:
            with self.cond:
                self.handing -= 1
                self._spawn()
        return kernel

    def state(self) -> str:
        """``ready``, ``starting``, ``failed`` (the last start; the next take retries) or
        ``none`` (what ``/health`` shows)."""
        with self.cond:
            return ("ready" if self.ready is not None else "starting" if self.starting
                    else "failed" if self.failed else "none")
