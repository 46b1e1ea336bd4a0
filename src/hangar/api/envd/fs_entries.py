"""``filesystem.Filesystem``: Stat, MakeDir, Move, ListDir, Remove.

On the core's file operations (relative paths start at the guest's home,
``/root``). Entries: owner and group are ``root`` (Hangar's guests own
files as root), ``mode`` the permission bits, ``permissions`` as ``ls``
shows them, a symlink's type ``FILE_TYPE_SYMLINK`` (its target is not
read). Errors: no such path ``not_found`` (the SDK's
``FileNotFoundException``), MakeDir of an existing path ``already_exists``
(the SDK's ``make_dir`` gives False). Move renames (the destination's
folder must exist; an existing file there is replaced). ListDir goes
``depth`` levels down (0 and 1: the folder's own entries), at most
``MAX_ENTRIES`` entries.
"""

from __future__ import annotations

import posixpath
import stat as stat_mod
from typing import Any

from google.protobuf.message import Message

from hangar.api.envd.connect import Call, Method, RpcError, rpc_error
from hangar.api.envd.messages import FS
from hangar.core.service import HOME, Command, FileEntry
from hangar.errors import HangarError, NotFound

MAX_ENTRIES = 10_000
"""Most entries one ListDir returns."""
MAX_DEPTH = 32
_TYPES = {"file": (FS.FILE_TYPE_FILE, stat_mod.S_IFREG),
          "dir": (FS.FILE_TYPE_DIRECTORY, stat_mod.S_IFDIR),
          "symlink": (FS.FILE_TYPE_SYMLINK, stat_mod.S_IFLNK)}


def absolute(path: str) -> str:
    """``path`` as the guest resolves it (relative ones from ``HOME``), normalized."""
    return posixpath.normpath(path if path.startswith("/") else posixpath.join(HOME, path))


def entry_info(e: FileEntry) -> Any:
    """The ``EntryInfo`` of one of the core's entries."""
    ftype, bits = _TYPES.get(e.type, (FS.FILE_TYPE_UNSPECIFIED, 0))
    info = FS.EntryInfo(name=e.name, type=ftype, path=e.path, size=e.size, mode=e.mode,
                        permissions=stat_mod.filemode(bits | e.mode), owner="root",
                        group="root", is_symlink=e.type == "symlink")
    info.modified_time.FromNanoseconds(int(e.mtime * 1e9))
    return info


def _path(value: str, what: str = "path") -> str:
    if not value:
        raise RpcError("invalid_argument", f"{what} is empty")
    return value


async def stat(req: Any, call: Call) -> Message:
    env = call.context
    try:
        e = await env.manager.files.stat(env.sandbox_id, _path(req.path))
    except HangarError as exc:
        raise rpc_error(exc) from None
    return FS.StatResponse(entry=entry_info(e))


async def make_dir(req: Any, call: Call) -> Message:
    env = call.context
    path = _path(req.path)
    try:
        try:
            await env.manager.files.stat(env.sandbox_id, path)
        except NotFound:
            e = await env.manager.files.mkdir(env.sandbox_id, path, parents=True)
            return FS.MakeDirResponse(entry=entry_info(e))
    except HangarError as exc:
        raise rpc_error(exc) from None
    raise RpcError("already_exists", f"path {absolute(path)} already exists")


async def move(req: Any, call: Call) -> Message:
    env = call.context
    src, dst = _path(req.source, "source"), _path(req.destination, "destination")
    try:
        await env.manager.files.stat(env.sandbox_id, src)
        r = await env.manager.exec(env.sandbox_id, Command(
            command="mv", args=["-T", "--", absolute(src), absolute(dst)], timeout_s=60))
        if r.exit_code != 0:
            why = (r.stderr.head or r.stderr.tail).decode(errors="replace").strip()
            code = "not_found" if "No such file" in why else "invalid_argument"
            raise RpcError(code, f"cannot move {absolute(src)} to {absolute(dst)}: "
                                 f"{why[:300] or f'mv exited {r.exit_code}'}")
        e = await env.manager.files.stat(env.sandbox_id, dst)
    except HangarError as exc:
        raise rpc_error(exc) from None
    return FS.MoveResponse(entry=entry_info(e))


async def list_dir(req: Any, call: Call) -> Message:
    env = call.context
    depth = max(1, min(int(req.depth or 1), MAX_DEPTH))
    res = FS.ListDirResponse()
    todo = [(_path(req.path), 1)]
    try:
        while todo:
            path, level = todo.pop(0)
            listing = await env.manager.files.list(env.sandbox_id, path)
            for e in listing.entries:
                if len(res.entries) >= MAX_ENTRIES:
                    raise RpcError("resource_exhausted",
                                   f"more than {MAX_ENTRIES} entries: list a smaller depth")
                res.entries.append(entry_info(e))
                if e.type == "dir" and level < depth:
                    todo.append((e.path, level + 1))
    except HangarError as exc:
        raise rpc_error(exc) from None
    return res


async def remove(req: Any, call: Call) -> Message:
    env = call.context
    try:
        await env.manager.files.remove(env.sandbox_id, _path(req.path), recursive=True)
    except HangarError as exc:
        raise rpc_error(exc) from None
    return FS.RemoveResponse()


METHODS = {
    "filesystem.Filesystem/Stat": Method("unary", FS.StatRequest, FS.StatResponse, stat),
    "filesystem.Filesystem/MakeDir": Method("unary", FS.MakeDirRequest, FS.MakeDirResponse,
                                            make_dir),
    "filesystem.Filesystem/Move": Method("unary", FS.MoveRequest, FS.MoveResponse, move),
    "filesystem.Filesystem/ListDir": Method("unary", FS.ListDirRequest, FS.ListDirResponse,
                                            list_dir),
    "filesystem.Filesystem/Remove": Method("unary", FS.RemoveRequest, FS.RemoveResponse,
                                           remove),
}
