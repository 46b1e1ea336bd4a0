"""The code interpreter: calls to the server of a ``code-interpreter`` sandbox (port 49999).

The server runs in the guest (``hangar/images/files/code_interpreter.py``,
started by the recipe's start command) and speaks E2B's code interpreter
protocol. This module carries one HTTP/1.1 request to it over the agent's
tunnel (``SandboxManager.tunnel``: no guest NIC, no exposed port) and hands
its answer back: ``execute`` streams the server's NDJSON lines as they come
(``stdout``, ``stderr``, ``result``, ``error``, ``number_of_executions``,
``end_of_execution``; see the server's docstring), the context calls give
its JSON. The sandbox counts as busy while a call runs. ``configure`` (at an E2B create:
``hangar.core.e2b_user.prepare``) moves its kernels to E2B's default user, its home and the
sandbox's environment variables.

Errors: ``NoInterpreter`` (409) when nothing listens on the port (a sandbox
of another image); the server's refusals keep their status (400
``InvalidRequest``, 404 ``NotFound``, 413 ``TooLarge``, 429
``LimitExceeded``, 504 ``Timeout``: no kernel was ready for a context
create or restart within the server's wait); a kernel that failed to start
and a broken answer are ``GuestError`` (502). Context creates and restarts
answer at once: the server hands out the spare kernel it keeps started
(see its docstring), so only a second create in a row waits for a kernel
to start. A cell that
outlasts its ``timeout`` ends the stream with an ``error`` line named
``TimeoutError``; closing the connection makes the server interrupt the
kernel.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any

from hangar import json_items
from hangar.core.guestcalls import NoListener
from hangar.engines.agent_client import Tunnel
from hangar.errors import (GuestError, HangarError, InvalidRequest, LimitExceeded, NoInterpreter,
                           NotFound, Timeout, TooLarge)

if TYPE_CHECKING:
    from hangar.core.sandboxes import SandboxManager

PORT = 49999
"""The server's guest port (``hangar.images.recipes.CODE_INTERPRETER_PORT``)."""
IMAGE = "code-interpreter"
MAX_CODE_CHARS = 1 << 20
"""Longest cell, characters (the server takes bodies up to 4 MiB)."""
MAX_HEAD_BYTES = 64 << 10
MAX_JSON_BYTES = 4 << 20
"""Largest JSON answer of a context call, bytes."""
MAX_CONTEXTS = 1000
"""Most contexts a list may hold (each is a kernel process in the guest): a guest's list of
100,000 tiny ones took the event loop about 0.9 s to check, validate and encode."""
MAX_LINE_BYTES = 64 << 20
"""Longest NDJSON line of ``execute`` (a result with a large image), bytes."""
LINE_HOLD_BYTES = 1 << 20
"""Longest part of a line held before it is passed on in pieces, bytes: so a stream holds at
most about this much in the server, however long its lines."""
LINES_SLICE = 64 << 10
"""Bytes of complete lines split and filtered between two turns of the loop (one read may
hold the tunnel's window, 1 MiB: 1 MiB of short lines cost about 110 ms at once, review 29k
K-L2; 64 KiB of them about 7 ms). A line longer than this is taken whole with the ones
before it (a few C steps: its length is not what costs)."""
REQUEST_S = 300.0
"""Longest a context call may take, seconds: one that finds no spare kernel ready waits for
the one starting (up to the server's ``SPARE_WAIT_S``, 240 s, under this)."""


async def _request(m: SandboxManager, stack: AsyncExitStack, sandbox_id: str, method: str,
                   path: str, body: Any = None) -> tuple[int, bytes, Tunnel]:
    """Send one request; returns (status, body bytes already read, the tunnel)."""
    try:
        tunnel = await stack.enter_async_context(m.tunnel(sandbox_id, PORT))
    except NoListener:
        raise NoInterpreter(f"sandbox {sandbox_id} runs no code interpreter (nothing listens "
                            f"on port {PORT}); create it from the {IMAGE!r} image",
                            sandbox_id=sandbox_id, image=IMAGE) from None
    data = b"" if body is None else json.dumps(body).encode()
    head = (f"{method} {path} HTTP/1.1\r\nHost: localhost:{PORT}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
            "Connection: close\r\n\r\n").encode()
    await tunnel.write(head + data)
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = await tunnel.read()
        if not chunk:
            raise GuestError(f"the code interpreter of sandbox {sandbox_id} closed without "
                             "answering", sandbox_id=sandbox_id)
        buf += chunk
        if len(buf) > MAX_HEAD_BYTES:
            raise GuestError("the code interpreter's answer has an oversized head",
                             sandbox_id=sandbox_id)
    head_raw, _, rest = buf.partition(b"\r\n\r\n")
    try:
        status = int(head_raw.split(b" ", 2)[1])
    except (IndexError, ValueError):
        raise GuestError(f"the code interpreter answered {head_raw[:80]!r}",
                         sandbox_id=sandbox_id) from None
    return status, rest, tunnel


REFUSAL_BYTES = 16 << 10
"""Most bytes of a refusal's body read as its JSON (``{"error": ...}``); a longer one, the
guest's to write, is not parsed (review 29g G-H2) and its start is the message."""


def _refusal(status: int, raw: bytes, sandbox_id: str) -> HangarError:
    try:
        if len(raw) > REFUSAL_BYTES:
            raise ValueError("too long to parse")
        message = str(_parse(raw, sandbox_id)["error"]).encode("utf-8", "replace").decode()
    except (ValueError, KeyError, TypeError, RecursionError, GuestError):
        message = raw[:300].decode("utf-8", "replace") or f"status {status}"
    kinds = {400: InvalidRequest, 404: NotFound, 413: TooLarge, 504: Timeout}
    if status == 429:
        return LimitExceeded(message, sandbox_id=sandbox_id)
    return kinds.get(status, GuestError)(f"code interpreter: {message}", sandbox_id=sandbox_id)


async def _read_all(tunnel: Tunnel, rest: bytes, sandbox_id: str) -> bytes:
    buf = bytearray(rest)
    while chunk := await tunnel.read():
        buf += chunk
        if len(buf) > MAX_JSON_BYTES:
            raise GuestError("the code interpreter's answer is too large", sandbox_id=sandbox_id)
    return bytes(buf)


def _parse(raw: bytes, sandbox_id: str) -> Any:
    """The guest's JSON, its values counted before it is parsed (a parse builds every one
    before any is looked at). Raises GuestError (too many values), ValueError,
    RecursionError."""
    if json_items.too_many(raw):
        raise GuestError(f"the code interpreter's answer holds more than "
                         f"{json_items.MAX_ITEMS} JSON values", sandbox_id=sandbox_id)
    return json.loads(raw.decode("utf-8"))  # UTF-8 only, as counted


async def call(m: SandboxManager, sandbox_id: str, method: str, path: str,
               body: Any = None) -> Any:
    """One context call (``/contexts...``); returns its JSON (None for an empty answer).

    ``/contexts`` answers a context (POST) or a list of them (GET): ``{id, language, cwd}``,
    strings; any other shape is a GuestError.

    Raises NoInterpreter, InvalidRequest, NotFound, LimitExceeded, GuestError (see the
    module docstring) and the errors of ``SandboxManager.tunnel``.
    """
    async with AsyncExitStack() as stack:
        async with asyncio.timeout(REQUEST_S):
            status, rest, tunnel = await _request(m, stack, sandbox_id, method, path, body)
            raw = await _read_all(tunnel, rest, sandbox_id)
    if status >= 300:
        raise _refusal(status, raw, sandbox_id)
    if not raw.strip():
        return None
    try:  # up to MAX_JSON_BYTES of the guest's JSON: a large one is read off the loop
        value = _parse(raw, sandbox_id) if len(raw) <= 64 << 10 else \
            await asyncio.to_thread(_parse, raw, sandbox_id)
    except (ValueError, RecursionError):
        raise GuestError("the code interpreter's answer is not JSON",
                         sandbox_id=sandbox_id) from None
    if path == "/contexts" and method == "GET" and isinstance(value, list) \
            and len(value) > MAX_CONTEXTS:  # checked, validated and encoded on the loop
        raise GuestError(f"the code interpreter lists more than {MAX_CONTEXTS} contexts, the "
                         "most taken", sandbox_id=sandbox_id)
    if path == "/contexts" and not (_is_context(value) if method == "POST" else
                                    isinstance(value, list) and all(map(_is_context, value))):
        raise GuestError("the code interpreter's answer is not a context (a list of them for "
                         "GET): {id, language, cwd}", sandbox_id=sandbox_id)
    return value


async def configure(m: SandboxManager, sandbox_id: str, user: str | None,
                    envs: dict[str, str]) -> bool:
    """Tell the code interpreter of ``sandbox_id`` whom its kernels run as: ``user`` (None:
    root, as the server; contexts then start in that user's home) with ``envs`` set in every
    kernel (``POST /configure``). Returns False when the sandbox has no code interpreter
    (another image, or one built before ``/configure``). Raises the errors of ``call``."""
    try:
        await call(m, sandbox_id, "POST", "/configure", {"user": user, "envs": envs})
    except (NoInterpreter, NotFound):
        return False
    return True


def _is_context(value: Any) -> bool:
    """Whether ``value`` is a context as the API answers it: ``id``, ``language``, ``cwd``,
    each a string every encoder takes (no lone surrogate)."""
    if not isinstance(value, dict):
        return False
    for key in ("id", "language", "cwd"):
        v = value.get(key)
        if not isinstance(v, str):
            return False
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            return False
    return True


async def execute(m: SandboxManager, sandbox_id: str, code: str, *,
                  context_id: str | None = None, language: str | None = None,
                  env_vars: dict[str, str] | None = None,
                  timeout: float | None = None) -> AsyncIterator[bytes]:
    """Run ``code``; returns an iterator of the server's NDJSON lines (each ends in ``\\n``).

    The request is sent, and its status checked, before this returns, so a refusal
    raises here (NoInterpreter, NotFound for an unknown context, InvalidRequest,
    LimitExceeded, GuestError). ``timeout`` (seconds, None: none) bounds the cell: past
    it the stream ends with an ``error`` line named ``TimeoutError``.
    """
    if len(code) > MAX_CODE_CHARS:
        raise TooLarge(f"code is over {MAX_CODE_CHARS} characters", sandbox_id=sandbox_id)
    stack = AsyncExitStack()
    try:
        status, rest, tunnel = await _request(m, stack, sandbox_id, "POST", "/execute", {
            "code": code, "context_id": context_id, "language": language,
            "env_vars": env_vars or None})
        if status >= 300:
            raise _refusal(status, await _read_all(tunnel, rest, sandbox_id), sandbox_id)
    except BaseException:
        await stack.aclose()
        raise
    return _lines(stack, tunnel, rest, sandbox_id, timeout)


def _line(kind: str, **fields: Any) -> bytes:
    return (json.dumps({"type": kind, **fields}) + "\n").encode()


async def _lines(stack: AsyncExitStack, tunnel: Tunnel, rest: bytes, sandbox_id: str,
                 timeout: float | None) -> AsyncIterator[bytes]:
    """The server's lines as they come, the complete ones of each read from the guest in
    pieces of about ``LINES_SLICE`` bytes (blank ones left out), with a turn of the loop
    after each (a read of many short lines, the guest's to write, was one send each: 1 MiB
    of them held the loop about a second, review 29h H-H3; one piece a read, 110 ms, 29k
    K-L2). A line longer than ``LINE_HOLD_BYTES`` is passed on in
    pieces as its bytes arrive (the client gets the same bytes), so no line is held whole;
    one over ``MAX_LINE_BYTES`` is cut after that many bytes (however the guest's reads fell):
    a newline, then an ``OutputTooLarge`` error line."""
    deadline = None if timeout is None else time.monotonic() + timeout
    ended = False
    buf = bytearray(rest)
    passed = 0  # bytes of the current line already passed on
    try:
        while True:
            while (last := _slice_end(buf)) >= 0:
                block = bytes(buf[:last + 1])
                del buf[:last + 1]
                lines = block.split(b"\n")[:-1]
                if passed and passed + len(lines[0]) > MAX_LINE_BYTES:
                    yield lines[0][:MAX_LINE_BYTES - passed] + b"\n" + _too_large()
                    return
                if max(map(len, lines)) > MAX_LINE_BYTES:
                    yield b"\n" + _too_large()
                    return
                first = [lines.pop(0)] if passed else []  # the end of a line in pieces
                passed = 0
                kept = first + [ln for ln in lines if ln.strip()]
                ended = ended or b'"end_of_execution"' in block
                if kept:
                    yield b"\n".join(kept) + b"\n"
                await asyncio.sleep(0)
            if buf and (passed or len(buf) >= LINE_HOLD_BYTES):
                if passed + len(buf) > MAX_LINE_BYTES:  # its first MAX_LINE_BYTES pass
                    yield bytes(buf[:MAX_LINE_BYTES - passed]) + b"\n" + _too_large()
                    return
                passed += len(buf)
                yield bytes(buf)
                buf.clear()
            try:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                async with asyncio.timeout(left):
                    chunk = await tunnel.read()
            except TimeoutError:
                yield (b"\n" if passed else b"") + _line(
                    "error", name="TimeoutError", traceback="",
                    value=f"the cell ran over its timeout of {timeout:g} s; the kernel was "
                          "interrupted")
                return
            if not chunk:
                if not ended:
                    yield (b"\n" if passed else b"") + _line(
                        "error", name="InterpreterGone", traceback="",
                        value="the code interpreter closed the stream before the cell ended")
                return
            buf += chunk
    except HangarError as exc:
        yield (b"\n" if passed else b"") + _line("error", name=exc.code, value=exc.message,
                                                  traceback="")
    finally:
        await stack.aclose()


def _slice_end(buf: bytearray) -> int:
    """Where the next piece of complete lines of ``buf`` ends (the index of its last
    newline): the last newline of the first ``LINES_SLICE`` bytes, else the first one after
    them; -1 when ``buf`` holds no complete line."""
    last = buf.rfind(b"\n", 0, LINES_SLICE)
    return last if last >= 0 else buf.find(b"\n", LINES_SLICE)


def _too_large() -> bytes:
    return _line("error", name="OutputTooLarge", traceback="",
                 value=f"one output is over {MAX_LINE_BYTES} bytes, the limit")
