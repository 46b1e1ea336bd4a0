"""envd's REST routes: ``/health``, ``/files``, ``/envs``, ``/metrics``; the internal
ones refused.

==========================  ===============================================================
``GET /health``             204 (the gateway found the sandbox)
``GET /files``              the file at ``path`` (relative: from the user's home), as
                            ``application/octet-stream``, streamed; 404 none, 400 a folder
``POST /files``             ``multipart/form-data`` (each file part's filename is its
                            path, or the ``path`` parameter for a single part: a second
                            part is then 400, as E2B's envd answers) or
                            ``application/octet-stream`` (``path`` needed; ``Content-Encoding:
                            gzip`` read); parent folders made; answers
                            ``[{"name", "type": "file", "path"}]`` (and ``metadata``);
                            ``X-Metadata-<key>`` headers are the files' metadata
``GET /envs``               the environment a command of the call's user gets: the guest's, those the
                            sandbox's E2B create named (a JSON object)
``GET /metrics``            CPU count and use, memory and disk, read in the guest
``/init``, ``/freeze``,     403: E2B's orchestrator's own, never served from outside
``/unfreeze``, ``/fsfreeze``,
``/fsthaw``, ``/collapse``
``/files/compose``          501: not served
==========================  ===============================================================

Uploads are streamed to the guest as they arrive, never spooled: a multipart
body is parsed part by part (``_Parts``), a gzip body inflated piece by piece
(``hangar.api.inflate``); past ``GZIP_RATIO_FLOOR`` inflated bytes, a gzip body
inflating more than ``GZIP_RATIO`` times its size is refused 413 naming the
limit (a compression bomb).

Errors are E2B's ``{"code": <status>, "message"}``. A sandbox that is gone
was answered by the gateway (502, "... was not found").
"""

from __future__ import annotations

import asyncio
import json
import posixpath
import time
import urllib.parse
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.types import Receive, Scope, Send

from hangar.api.envd import fs_entries
from hangar.api.envd.connect import RpcError
from hangar.api.envd.fs_entries import absolute
from hangar.api.inflate import Inflater
from hangar.api.proxy.origin import SANDBOX_CSP
from hangar.core.service import Command, e2b, e2b_user
from hangar.errors import DiskFull, GuestError, HangarError, InvalidRequest, NotFound

INTERNAL = ("/init", "/freeze", "/unfreeze", "/fsfreeze", "/fsthaw", "/collapse")
MAX_FILES = 1000
"""Most file parts of one multipart upload."""
PART_HEAD_MAX = 16 << 10
"""Largest headers of one multipart part, bytes."""
PART_HEADERS_MAX = 16
"""Most headers of one multipart part."""
MAX_PARTS = 2 * MAX_FILES
"""Most parts of one multipart upload, fields and files alike."""
PARSE_SLICE = 4 << 10
"""Bytes of a multipart body parsed between two turns of the event loop: a received chunk
(up to 256 KiB) of empty parts would otherwise hold the loop for about 0.4 s."""
GZIP_RATIO = 200
"""A gzip upload may inflate to at most this many times its compressed size ..."""
GZIP_RATIO_FLOOR = 16 << 20
"""... once it is past this many bytes (a file of zeros compresses about 1000:1)."""
_STATUS_OF = {"is_directory": 400}


async def error(send: Send, status: int, message: str) -> None:
    await _json(send, status, {"code": status, "message": message})


async def _json(send: Send, status: int, body: Any) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": json.dumps(body).encode()})


def _status(exc: HangarError) -> int:
    """envd's status for ``exc``: 507 for a full disk (E2B's SDK raises its
    ``NotEnoughSpaceException`` for it, and does not retry), else Hangar's 4xx, else 500."""
    if isinstance(exc, DiskFull):
        return 507
    return exc.status if exc.status < 500 else 500


async def serve(scope: Scope, receive: Receive, send: Send, path: str, query: dict[str, str],
                headers: dict[str, str], envd: Any) -> None:
    """Answer one REST request of the data plane (see the module docstring)."""
    method = scope.get("method", "GET")
    if path in INTERNAL:
        await error(send, 403, f"{path} is an internal route of E2B's envd (its orchestrator's "
                               "own): Hangar's data plane does not serve it")
        return
    if path == "/files/compose":
        await error(send, 501, "/files/compose is not served by Hangar's data plane: "
                               "concatenate with a command (cat a b > c)")
        return
    routes = {("GET", "/health"): _health, ("GET", "/files"): _download,
              ("POST", "/files"): _upload, ("GET", "/envs"): _envs,
              ("GET", "/metrics"): _metrics}
    handler = routes.get((method, path))
    if handler is None:
        known = {p for _, p in routes}
        if path in known:
            await error(send, 405, f"{method} {path} is not served")
        else:
            await error(send, 404, f"{path} is not a route of envd")
        return
    try:
        await handler(scope, receive, send, query, headers, envd)
    except HangarError as exc:
        await error(send, _status(exc), exc.message)
    except RpcError as exc:
        await error(send, {"not_found": 404, "permission_denied": 403}.get(exc.code, 400),
                    exc.message)


async def _health(scope: Scope, receive: Receive, send: Send, query: dict[str, str],
                  headers: dict[str, str], envd: Any) -> None:
    await send({"type": "http.response.start", "status": 204, "headers": []})
    await send({"type": "http.response.body", "body": b""})


def _need_path(query: dict[str, str]) -> str:
    path = query.get("path", "")
    if not path:
        raise InvalidRequest("the path parameter is missing")
    return _no_controls(path)


def _no_controls(path: str) -> str:
    """``path``, unless it holds a control character (InvalidRequest, 400): no CR or LF
    of a client's path may reach a header (``content_disposition``) or a log line."""
    if any(ord(c) < 0x20 or ord(c) == 0x7f for c in path):
        raise InvalidRequest("the path holds a control character (CR, LF, NUL...), which "
                             "Hangar does not take in a file path", field="path")
    return path


def content_disposition(path: str) -> bytes:
    """``Content-Disposition`` of a download of ``path`` (RFC 6266): its base name only,
    as a quoted ASCII ``filename`` (anything else, quotes and backslashes as ``_``) and
    ``filename*`` in percent-encoded UTF-8; never the client's raw path."""
    name = posixpath.basename(absolute(path)) or "download"
    plain = "".join(c if 0x20 <= ord(c) < 0x7f and c not in '"\\' else "_" for c in name)
    encoded = urllib.parse.quote(name, safe="")
    return f"inline; filename=\"{plain}\"; filename*=UTF-8''{encoded}".encode("ascii")


async def _download(scope: Scope, receive: Receive, send: Send, query: dict[str, str],
                    headers: dict[str, str], envd: Any) -> None:
    path = absolute(_need_path(query), envd.home)
    chunks = envd.manager.files.read(envd.sandbox_id, path)
    # uvicorn drops what is sent after the client left without a word: watch for the
    # disconnect, else a download of an endless file would go on (and hold its slot) for good
    gone = asyncio.ensure_future(_disconnected(receive))
    try:
        first = await anext(chunks, b"")  # errors (no such file) before the answer starts
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"application/octet-stream"),
            (b"content-disposition", content_disposition(path)),
            # a guest's bytes on Hangar's origin: never sniffed into a page, and sandboxed
            # if a browser renders one anyway (review 29h L2)
            (b"x-content-type-options", b"nosniff"),
            (b"content-security-policy", SANDBOX_CSP)]})
        if first:
            await send({"type": "http.response.body", "body": first, "more_body": True})
        async for chunk in chunks:
            if gone.done():
                return
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
    finally:
        gone.cancel()
        await chunks.aclose()


async def _disconnected(receive: Receive) -> None:
    """Returns once the client has gone away (a GET's body is empty)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _written(r: Any) -> dict[str, Any]:
    return {"name": posixpath.basename(r.path), "type": "file", "path": r.path}


METADATA_HEADER = b"x-metadata-"
"""A request header ``X-Metadata-<key>: <value>`` of an upload is file metadata."""


def _metadata(scope: Scope) -> dict[str, str]:
    """The file metadata of an upload's ``X-Metadata-*`` headers (the first of a repeated
    one), checked and with lowercased keys (``e2b_user.check_metadata``). Raises
    InvalidRequest (400)."""
    found: dict[str, str] = {}
    for name, value in scope.get("headers", ()):
        if name.lower().startswith(METADATA_HEADER):
            key = name[len(METADATA_HEADER):].decode("latin-1").lower()
            found.setdefault(key, value.decode("latin-1"))
    return e2b_user.check_metadata(found)


async def _finish(envd: Any, out: list[dict[str, Any]], metadata: dict[str, str]) -> None:
    """Give the written files to the call's user and set their ``metadata`` (each upload
    replaces a file, so one without metadata leaves it none); named in the answer."""
    await e2b_user.give(envd.manager, envd.sandbox_id, [w["path"] for w in out], envd.user,
                        metadata or None)
    if metadata:
        for w in out:
            w["metadata"] = dict(metadata)


async def _body(receive: Receive, gzip: bool) -> AsyncIterator[bytes]:
    """The request body's bytes as they arrive; a gzip body inflated piece by piece under
    the bounds of ``GZIP_RATIO`` (``hangar.api.inflate``)."""
    inflate = Inflater(limit=None, ratio=GZIP_RATIO, ratio_floor=GZIP_RATIO_FLOOR) \
        if gzip else None
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise InvalidRequest("the client went away during the upload")
        data = msg.get("body", b"")
        if inflate is not None:
            for piece in inflate.feed(data):
                yield piece  # the guest takes it before the next piece is inflated
        elif data:
            yield data
        if not msg.get("more_body", False):
            if inflate is not None:
                inflate.close()
            return


async def _upload(scope: Scope, receive: Receive, send: Send, query: dict[str, str],
                  headers: dict[str, str], envd: Any) -> None:
    ctype, options = parse_options_header(headers.get("content-type", ""))
    ctype = ctype.strip().lower()
    encoding = headers.get("content-encoding", "").strip().lower()
    if encoding not in ("", "identity", "gzip"):
        raise InvalidRequest(f"Content-Encoding {encoding[:32]} is not served: gzip or none")
    _no_controls(query.get("path", ""))
    metadata = _metadata(scope)
    if ctype == b"application/octet-stream":
        path = absolute(_need_path(query), envd.home)
        await _folder(envd, path)
        r = await envd.manager.files.write(envd.sandbox_id, path,
                                           _body(receive, encoding == "gzip"))
        written = [_written(r)]
        await _finish(envd, written, metadata)
        await _json(send, 200, written)
        return
    if ctype != b"multipart/form-data":
        shown = ctype.decode("latin-1")[:64] or "(none)"
        raise InvalidRequest(f"content type {shown} is not served: send "
                             "multipart/form-data or application/octet-stream")
    if encoding == "gzip":
        raise InvalidRequest("Content-Encoding gzip is served for application/octet-stream "
                             "uploads only")
    boundary = options.get(b"boundary", b"")
    if not boundary or len(boundary) > 200:
        raise InvalidRequest("the multipart content type names no boundary (or one over "
                             "200 bytes)")
    out: list[dict[str, Any]] = []
    parts = _Parts(receive, boundary)
    while (part := await parts.next_part()) is not None:
        name, filename = part
        if filename is None:  # a form field, not a file: its bytes are skipped
            async for _ in parts.data():
                pass
            continue
        if len(out) >= MAX_FILES:
            raise InvalidRequest(f"the multipart body has more than {MAX_FILES} file parts, "
                                 "the limit")
        target = query.get("path") or filename
        if not target:
            raise InvalidRequest("a file part has no filename and no path parameter names "
                                 "its path")
        if query.get("path") and out:
            raise InvalidRequest(f"the path parameter names one file: a second file part "
                                 f"cannot go to the same path ({out[0]['path']} was written); "
                                 "name each part's path by its filename instead")
        target = absolute(_no_controls(target), envd.home)
        await _folder(envd, target)
        out.append(_written(await envd.manager.files.write(envd.sandbox_id, target,
                                                           parts.data())))
    if not out:
        raise InvalidRequest("the multipart body carries no file part")
    await _finish(envd, out, metadata)
    await _json(send, 200, out)


async def _folder(envd: Any, path: str) -> None:
    """Make the folders above ``path`` (absolute) as the call's user when they are missing,
    so that they are its own (the write itself makes them as root). Raises RpcError."""
    if envd.user == e2b.ROOT:
        return
    parent = posixpath.dirname(path)
    try:
        await envd.manager.files.stat(envd.sandbox_id, parent)
    except NotFound:
        await fs_entries.as_user(envd, ["mkdir", "-p", "--", parent], f"cannot make {parent}")


class _Parts:
    """A ``multipart/form-data`` body read part by part as it arrives, never spooled: each
    part's bytes go on (to the guest) before more of the body is read. Holds at most one
    received chunk and one part's headers (``PART_HEAD_MAX`` bytes)."""

    def __init__(self, receive: Receive, boundary: bytes) -> None:
        self._receive = receive
        self._events: deque[tuple[str, bytes]] = deque()
        self._head: list[tuple[bytes, bytes]] = []
        self._heads: deque[list[tuple[bytes, bytes]]] = deque()
        self._head_bytes = 0
        self._ended = False
        self._in_part = False
        self.parts = 0
        """Parts begun so far."""
        cb = self._events.append
        self._parser = MultipartParser(boundary, {
            "on_header_begin": lambda: self._head.append((b"", b"")),
            "on_header_field": lambda d, a, b: self._header(d[a:b], True),
            "on_header_value": lambda d, a, b: self._header(d[a:b], False),
            "on_headers_finished": self._headers_done,
            "on_part_data": lambda d, a, b: cb(("data", bytes(d[a:b]))),
            "on_part_end": lambda: cb(("end", b"")),
            "on_end": lambda: cb(("done", b"")),
        }, max_header_count=PART_HEADERS_MAX, max_header_size=PART_HEAD_MAX)

    def _headers_done(self) -> None:
        self.parts += 1
        if self.parts > MAX_PARTS:
            raise InvalidRequest(f"the multipart body has more than {MAX_PARTS} parts, "
                                 "the limit")
        self._events.append(("head", b""))
        self._heads.append(self._head)
        self._head, self._head_bytes = [], 0

    def _header(self, data: bytes, field: bool) -> None:
        self._head_bytes += len(data)
        if self._head_bytes > PART_HEAD_MAX:
            raise InvalidRequest(f"a multipart part's headers are over {PART_HEAD_MAX} bytes")
        name, value = self._head[-1]
        self._head[-1] = (name + data, value) if field else (name, value + data)

    async def _event(self) -> tuple[str, bytes]:
        while not self._events:
            if self._ended:
                raise InvalidRequest("the multipart body ends inside a part")
            msg = await self._receive()
            if msg["type"] == "http.disconnect":
                raise InvalidRequest("the client went away during the upload")
            try:
                body = msg.get("body", b"")
                for at in range(0, len(body), PARSE_SLICE):
                    if at:
                        await asyncio.sleep(0)
                    self._parser.write(body[at:at + PARSE_SLICE])
                if not msg.get("more_body", False):
                    self._ended = True
                    self._parser.finalize()
            except FormParserError as exc:
                raise InvalidRequest(f"the multipart body is malformed: {exc}") from None
        return self._events.popleft()

    async def next_part(self) -> tuple[str, str | None] | None:
        """The next part's (form name, filename or None for a field), or None at the end."""
        while True:
            kind, _ = await self._event()
            if kind == "done":
                return None
            if kind == "head":
                self._in_part = True
                for field, value in self._heads.popleft():
                    if field.strip().lower() == b"content-disposition":
                        _, opts = parse_options_header(value)
                        name = _text(opts.get(b"name", b""))
                        filename = _text(opts[b"filename"]) if b"filename" in opts else None
                        return name, filename
                return "", None

    async def data(self) -> AsyncIterator[bytes]:
        """The current part's bytes as they arrive, until the part ends."""
        while self._in_part:
            kind, data = await self._event()
            if kind == "data":
                pieces = [data]  # one received chunk parsed in slices: passed on whole
                while self._events and self._events[0][0] == "data":
                    pieces.append(self._events.popleft()[1])
                if any(pieces):
                    yield b"".join(pieces)
            elif kind == "end":
                self._in_part = False


def _text(raw: bytes) -> str:
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return raw.decode("latin-1")


ENVS_MAX = 64 << 10
"""Bytes of the guest's ``env -0`` read for ``GET /envs`` (a real guest's environment is a
few KiB: its base variables and at most 16 secrets' placeholders); a longer one is refused
(GuestError: envd's 500, as every guest fault there), and what is read is parsed on the loop
in about 11 ms (review 29k K-H4)."""


async def _envs(scope: Scope, receive: Receive, send: Send, query: dict[str, str],
                headers: dict[str, str], envd: Any) -> None:
    r = await envd.manager.exec(envd.sandbox_id, e2b_user.as_user(
        Command(command="env", args=["-0"], timeout_s=30, head=ENVS_MAX, tail=0), envd.user))
    if r.stdout.truncated:
        raise GuestError(f"the guest's environment is over {ENVS_MAX >> 10} KiB "
                         f"({r.stdout.total} bytes)", sandbox_id=envd.sandbox_id)
    out = {}
    for item in r.stdout.head.split(b"\0"):
        k, sep, v = item.decode(errors="replace").partition("=")
        if sep and k:
            out[k] = v
    out.update(e2b.envs_of(envd.manager, envd.options))
    await _json(send, 200, out)


_METRICS_SH = ("nproc; head -1 /proc/stat; sleep 0.2; head -1 /proc/stat; "
               "grep -E '^(MemTotal|MemAvailable|Cached):' /proc/meminfo; df -P -B1 / | tail -1")


def _cpu(line: str) -> tuple[int, int]:
    v = [int(x) for x in line.split()[1:]]
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    return sum(v), idle


async def _metrics(scope: Scope, receive: Receive, send: Send, query: dict[str, str],
                   headers: dict[str, str], envd: Any) -> None:
    r = await envd.manager.exec(envd.sandbox_id, Command(
        command=_METRICS_SH, timeout_s=30, head=e2b.SAMPLE_BYTES, tail=0))
    lines = r.stdout.head.decode(errors="replace").splitlines()
    try:
        (t0, i0), (t1, i1) = _cpu(lines[1]), _cpu(lines[2])
        mem = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in lines[3:6]}
        disk = lines[6].split()
        used_pct = 100.0 * (1 - (i1 - i0) / (t1 - t0)) if t1 > t0 else 0.0
        total, avail = mem["MemTotal"], mem["MemAvailable"]
        body = {"ts": int(time.time()), "cpu_count": int(lines[0]),
                "cpu_used_pct": round(used_pct, 2), "mem_total": total,
                "mem_used": total - avail, "mem_cache": mem.get("Cached", 0),
                "mem_total_mib": total >> 20, "mem_used_mib": (total - avail) >> 20,
                "disk_used": int(disk[2]), "disk_total": int(disk[1])}
    except (IndexError, ValueError, KeyError):
        raise GuestError("the guest's figures could not be read",  # the guest's fault: 502
                         sandbox_id=envd.sandbox_id) from None
    await _json(send, 200, body)
