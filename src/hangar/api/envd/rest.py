"""envd's REST routes: ``/health``, ``/files``, ``/envs``, ``/metrics``; the internal
ones refused.

==========================  ===============================================================
``GET /health``             204 (the gateway found the sandbox)
``GET /files``              the file at ``path`` (relative: from the user's home), as
                            ``application/octet-stream``, streamed; 404 none, 400 a folder
``POST /files``             ``multipart/form-data`` (each ``file`` part's filename is its
                            path, or the ``path`` parameter for a single part) or
                            ``application/octet-stream`` (``path`` needed; ``Content-Encoding:
                            gzip`` read); parent folders made; answers
                            ``[{"name", "type": "file", "path"}]``
``GET /envs``               the environment a command of the call's user gets: the guest's, those the
                            sandbox's E2B create named (a JSON object)
``GET /metrics``            CPU count and use, memory and disk, read in the guest
``/init``, ``/freeze``,     403: E2B's orchestrator's own, never served from outside
``/unfreeze``, ``/fsfreeze``,
``/fsthaw``, ``/collapse``
``/files/compose``          501: not served
==========================  ===============================================================

Errors are E2B's ``{"code": <status>, "message"}``. A sandbox that is gone
was answered by the gateway (502, "... was not found").
"""

from __future__ import annotations

import json
import posixpath
import time
import zlib
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from hangar.api.envd import fs_entries
from hangar.api.envd.connect import RpcError
from hangar.api.envd.fs_entries import absolute
from hangar.core.service import Command, e2b
from hangar.errors import DiskFull, HangarError, InvalidRequest, NotFound

INTERNAL = ("/init", "/freeze", "/unfreeze", "/fsfreeze", "/fsthaw", "/collapse")
MAX_FILES = 1000
"""Most parts of one multipart upload."""
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
    return path


async def _download(scope: Scope, receive: Receive, send: Send, query: dict[str, str],
                    headers: dict[str, str], envd: Any) -> None:
    path = absolute(_need_path(query), envd.home)
    chunks = envd.manager.files.read(envd.sandbox_id, path)
    try:
        first = await anext(chunks, b"")  # errors (no such file) before the answer starts
        name = posixpath.basename(path).replace('"', "")
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"application/octet-stream"),
            (b"content-disposition", f'inline; filename="{name}"'.encode("latin-1", "replace"))]})
        if first:
            await send({"type": "http.response.body", "body": first, "more_body": True})
        async for chunk in chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
    finally:
        await chunks.aclose()


def _written(r: Any) -> dict[str, str]:
    return {"name": posixpath.basename(r.path), "type": "file", "path": r.path}


async def _body(receive: Receive, gzip: bool) -> AsyncIterator[bytes]:
    inflate = zlib.decompressobj(wbits=31) if gzip else None
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise InvalidRequest("the client went away during the upload")
        data = msg.get("body", b"")
        if inflate is not None and data:
            try:
                data = inflate.decompress(data)
            except zlib.error as exc:
                raise InvalidRequest(f"the gzip body is broken: {exc}") from None
        if data:
            yield data
        if not msg.get("more_body", False):
            return


async def _upload(scope: Scope, receive: Receive, send: Send, query: dict[str, str],
                  headers: dict[str, str], envd: Any) -> None:
    ctype = headers.get("content-type", "").partition(";")[0].strip().lower()
    encoding = headers.get("content-encoding", "").strip().lower()
    if encoding not in ("", "identity", "gzip"):
        raise InvalidRequest(f"Content-Encoding {encoding[:32]} is not served: gzip or none")
    if ctype == "application/octet-stream":
        path = absolute(_need_path(query), envd.home)
        await _folder(envd, path)
        r = await envd.manager.files.write(envd.sandbox_id, path,
                                           _body(receive, encoding == "gzip"))
        await e2b.give(envd.manager, envd.sandbox_id, [r.path], envd.user)
        await _json(send, 200, [_written(r)])
        return
    if ctype != "multipart/form-data":
        raise InvalidRequest(f"content type {ctype or '(none)'} is not served: send "
                             "multipart/form-data or application/octet-stream")
    form = await Request(scope, receive).form(max_files=MAX_FILES)
    try:
        parts = [v for _, v in form.multi_items() if not isinstance(v, str)]
        if not parts:
            raise InvalidRequest("the multipart body carries no file part")
        out = []
        for part in parts:
            target = query.get("path") if len(parts) == 1 and query.get("path") else \
                part.filename
            if not target:
                raise InvalidRequest("a file part has no filename and no path parameter names "
                                     "its path")
            target = absolute(target, envd.home)
            await _folder(envd, target)
            out.append(_written(await envd.manager.files.write(
                envd.sandbox_id, target, _read(part))))
        await e2b.give(envd.manager, envd.sandbox_id, [w["path"] for w in out], envd.user)
        await _json(send, 200, out)
    finally:
        await form.close()


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


async def _read(part: Any) -> AsyncIterator[bytes]:
    await part.seek(0)
    while chunk := await part.read(1 << 20):
        yield chunk


async def _envs(scope: Scope, receive: Receive, send: Send, query: dict[str, str],
                headers: dict[str, str], envd: Any) -> None:
    r = await envd.manager.exec(envd.sandbox_id, e2b.as_user(
        Command(command="env", args=["-0"], timeout_s=30), envd.user))
    out = {}
    for item in r.stdout.head.split(b"\0"):
        k, sep, v = item.decode(errors="replace").partition("=")
        if sep and k:
            out[k] = v
    out.update(e2b.envs(envd.manager, envd.sandbox_id))
    await _json(send, 200, out)


_METRICS_SH = ("nproc; head -1 /proc/stat; sleep 0.2; head -1 /proc/stat; "
               "grep -E '^(MemTotal|MemAvailable|Cached):' /proc/meminfo; df -P -B1 / | tail -1")


def _cpu(line: str) -> tuple[int, int]:
    v = [int(x) for x in line.split()[1:]]
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    return sum(v), idle


async def _metrics(scope: Scope, receive: Receive, send: Send, query: dict[str, str],
                   headers: dict[str, str], envd: Any) -> None:
    r = await envd.manager.exec(envd.sandbox_id, Command(command=_METRICS_SH, timeout_s=30))
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
        raise HangarError("the guest's figures could not be read") from None
    await _json(send, 200, body)
