"""``filesystem.Filesystem``: Stat, MakeDir, Move, ListDir, Remove.

On the core's file operations, as the call's user (``Envd.user``: E2B's
default ``user`` for a sandbox made through ``/e2b``, or ``root``); relative
paths start at that user's home. Entries: owner and group by name, read in
the guest (``hangar.core.e2b_user.owners``), ``mode`` the permission bits,
``permissions`` as ``ls`` shows them, ``metadata`` the file's E2B metadata
(``user.e2b.*`` extended attributes, read with the owners); a symlink has the type of what it
reaches and its absolute ``symlink_target`` (``FILE_TYPE_SYMLINK`` when it
dangles). Errors: no such path ``not_found`` (the SDK's
``FileNotFoundException``), MakeDir of an existing path ``already_exists``
(the SDK's ``make_dir`` gives False). MakeDir and Move run as the call's
user (what they make is its own). Move renames (the destination's folder
must exist; an existing file there is replaced). Remove of a missing path
succeeds, as E2B's does. ListDir goes ``depth`` levels down (0 and 1: the
folder's own entries) and lists in a walk's order (each folder before its
entries, names sorted), at most ``MAX_ENTRIES`` entries, ``MAX_LIST_CHARS`` characters of
paths, names and metadata and ``MAX_METADATA_PAIRS`` metadata pairs (past any
``resource_exhausted`` naming it). Its entries are built a slice at a time with turns of the
event loop between (``hangar.turns``), and encoded so too (``connect.Codec.encode_async``).
"""

from __future__ import annotations

import asyncio
import posixpath
import stat as stat_mod
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from google.protobuf.message import Message

from hangar.api.envd.connect import Call, Method, RpcError, rpc_error
from hangar.api.envd.messages import FS
from hangar.core.service import Command, FileEntry, HOME, e2b_user
from hangar.errors import HangarError, NotFound
from hangar.turns import extend, mapped

MAX_ENTRIES = 10_000
"""Most entries one ListDir returns."""
MAX_LIST_CHARS = 4 << 20
"""Most characters of paths and names one ListDir returns (its answer and the entries
it holds in memory are a few times that)."""
MAX_METADATA_PAIRS = 20_000
"""Most metadata key-value pairs of one answer's entries (ListDir's, a poll's): each pair
costs about what an entry costs to build and encode, and the character budget alone let
10,000 files of 64 one-character keys through, 640,000 pairs (1.3-1.6 s to encode, review
29k K-H3). Two pairs a file of a full listing."""
MAX_DEPTH = 32
LIST_AT_ONCE = 4
"""Most ListDir answers built at once for one sandbox (each may hold tens of MiB while it is
built); more wait their turn."""
LIST_AT_ONCE_ALL = 32
"""Most ListDir answers built at once on the server, all sandboxes together."""


class Listings:
    """Turns for building ListDir answers: at most ``LIST_AT_ONCE`` per sandbox and
    ``LIST_AT_ONCE_ALL`` in all, so that many concurrent listings of a large tree cost the
    server a bounded amount of memory (REVIEW29b G4). One per server (app state)."""

    def __init__(self) -> None:
        self._all = asyncio.Semaphore(LIST_AT_ONCE_ALL)
        self._by_sandbox: dict[str, tuple[asyncio.Semaphore, int]] = {}

    @asynccontextmanager
    async def turn(self, sandbox_id: str) -> AsyncIterator[None]:
        """Waits for a turn of ``sandbox_id`` and the server's; holds both while in use."""
        sem, users = self._by_sandbox.get(sandbox_id, (asyncio.Semaphore(LIST_AT_ONCE), 0))
        self._by_sandbox[sandbox_id] = (sem, users + 1)
        try:
            async with sem, self._all:
                yield
        finally:
            sem, users = self._by_sandbox[sandbox_id]
            if users == 1:
                del self._by_sandbox[sandbox_id]
            else:
                self._by_sandbox[sandbox_id] = (sem, users - 1)
_SECONDS = (-62135596800, 253402300799)
"""The range of a protobuf ``Timestamp`` (years 1 to 9999); a guest's mtime past it (tmpfs
keeps 64-bit times) is clamped."""
_INT64_MAX = (1 << 63) - 1
_TYPES = {"file": (FS.FILE_TYPE_FILE, stat_mod.S_IFREG),
          "dir": (FS.FILE_TYPE_DIRECTORY, stat_mod.S_IFDIR),
          "symlink": (FS.FILE_TYPE_SYMLINK, stat_mod.S_IFLNK)}


def absolute(path: str, home: str = HOME) -> str:
    """``path`` as the guest resolves it (relative ones from ``home``), normalized."""
    return posixpath.normpath(path if path.startswith("/") else posixpath.join(home, path))


def entry_info(e: FileEntry, who: e2b_user.Owner | None = None) -> Any:
    """The ``EntryInfo`` of one of the core's entries; ``who`` owns it (root when None)."""
    ftype, bits = _TYPES.get(e.type, (FS.FILE_TYPE_UNSPECIFIED, 0))
    if e.type == "symlink" and who is not None and who.target_type in _TYPES:
        ftype = _TYPES[who.target_type][0]
    mode = e.mode & 0xFFFFFFFF  # a uint32 on the wire; the guest reports only the S_IMODE bits
    info = FS.EntryInfo(name=e.name, type=ftype, path=e.path,
                        size=min(max(e.size, 0), _INT64_MAX), mode=mode,
                        permissions=stat_mod.filemode(bits | mode),
                        owner=who.owner if who else "root", group=who.group if who else "root",
                        is_symlink=e.type == "symlink")
    if e.type == "symlink" and who is not None and who.target:
        info.symlink_target = who.target
    if who is not None and who.metadata:
        info.metadata.update(who.metadata)
    info.modified_time.FromNanoseconds(int(min(max(e.mtime, _SECONDS[0]), _SECONDS[1]) * 1e9))
    return info


async def entry_infos(env: Any, entries: list[FileEntry],
                      budget: int | None = None) -> list[Any]:
    """The ``EntryInfo`` of each of ``entries``, their owners read in the guest at once,
    built ``hangar.turns.EVERY`` at a time with turns of the loop between. Raises the guest
    call's errors, and with a ``budget`` RpcError (``resource_exhausted``) when their
    metadata (what the guest set, each file's bounded: ``e2b_user.METADATA_READ_KEYS``)
    holds more than ``MAX_METADATA_PAIRS`` pairs or ``budget`` characters."""
    who = await e2b_user.owners(env.manager, env.sandbox_id, [e.path for e in entries],
                                max_pairs=None if budget is None else MAX_METADATA_PAIRS)
    if budget is not None and e2b_user.metadata_pairs(who) > MAX_METADATA_PAIRS:
        raise RpcError("resource_exhausted",
                       f"the files hold more than {MAX_METADATA_PAIRS} metadata pairs, the "
                       "most one answer carries: list a smaller depth")
    if budget is not None and e2b_user.metadata_chars(who) > budget:
        raise RpcError("resource_exhausted",
                       f"the file metadata is over the {budget} characters left of this "
                       f"answer's {MAX_LIST_CHARS} (paths, names and metadata): list a "
                       "smaller depth")
    return await mapped(lambda e: entry_info(e, who.get(e.path)), entries)


async def as_user(env: Any, argv: list[str], what: str) -> None:
    """Run ``argv`` in the guest as the call's user. Raises RpcError (``not_found``,
    ``permission_denied``, else ``invalid_argument``) naming ``what`` when it fails, and
    the guest call's errors."""
    r = await env.manager.exec(env.sandbox_id, e2b_user.as_user(
        Command(command=argv[0], args=argv[1:], timeout_s=60), env.user))
    if r.exit_code != 0:
        why = (r.stderr.head or r.stderr.tail).decode(errors="replace").strip()
        code = "not_found" if "No such file" in why else \
            "permission_denied" if "Permission denied" in why else "invalid_argument"
        raise RpcError(code, f"{what}: {why[:300] or f'{argv[0]} exited {r.exit_code}'}")


def _path(value: str, what: str = "path") -> str:
    if not value:
        raise RpcError("invalid_argument", f"{what} is empty")
    return value


async def stat(req: Any, call: Call) -> Message:
    env = call.context
    try:
        e = await env.manager.files.stat(env.sandbox_id, absolute(_path(req.path), env.home))
        info, = await entry_infos(env, [e])
    except HangarError as exc:
        raise rpc_error(exc) from None
    return FS.StatResponse(entry=info)


async def make_dir(req: Any, call: Call) -> Message:
    env = call.context
    path = absolute(_path(req.path), env.home)
    try:
        try:
            await env.manager.files.stat(env.sandbox_id, path)
        except NotFound:
            await as_user(env, ["mkdir", "-p", "--", path], f"cannot make {path}")
            info, = await entry_infos(env, [await env.manager.files.stat(env.sandbox_id, path)])
            return FS.MakeDirResponse(entry=info)
    except HangarError as exc:
        raise rpc_error(exc) from None
    raise RpcError("already_exists", f"path {path} already exists")


async def move(req: Any, call: Call) -> Message:
    env = call.context
    src = absolute(_path(req.source, "source"), env.home)
    dst = absolute(_path(req.destination, "destination"), env.home)
    try:
        await env.manager.files.stat(env.sandbox_id, src)
        await as_user(env, ["mv", "-T", "--", src, dst], f"cannot move {src} to {dst}")
        info, = await entry_infos(env, [await env.manager.files.stat(env.sandbox_id, dst)])
    except HangarError as exc:
        raise rpc_error(exc) from None
    return FS.MoveResponse(entry=info)


async def list_dir(req: Any, call: Call) -> Message:
    env = call.context
    depth = max(1, min(int(req.depth or 1), MAX_DEPTH))
    top = absolute(_path(req.path), env.home)
    async with env.listings.turn(env.sandbox_id):
        return await _list(env, top, depth)


async def _list(env: Any, top: str, depth: int) -> Message:
    """ListDir's answer for ``top`` (absolute), ``depth`` levels down. Raises RpcError."""
    found: list[FileEntry] = []
    chars = 0
    todo = [(top, 1)]
    try:
        while todo:
            path, level = todo.pop(0)
            listing = await env.manager.files.list(env.sandbox_id, path)
            for e in listing.entries:
                if len(found) >= MAX_ENTRIES:
                    raise RpcError("resource_exhausted",
                                   f"more than {MAX_ENTRIES} entries: list a smaller depth")
                chars += len(e.path) + len(e.name)
                if chars > MAX_LIST_CHARS:
                    raise RpcError("resource_exhausted",
                                   f"more than {MAX_LIST_CHARS} characters of paths and names: "
                                   "list a smaller depth")
                found.append(e)
                if e.type == "dir" and level < depth:
                    todo.append((e.path, level + 1))
        found.sort(key=lambda e: e.path.split("/"))  # a walk's order, as E2B's envd lists
        res = FS.ListDirResponse()
        await extend(res.entries, await entry_infos(env, found, budget=MAX_LIST_CHARS - chars))
    except HangarError as exc:
        raise rpc_error(exc) from None
    return res


async def remove(req: Any, call: Call) -> Message:
    env = call.context
    try:
        await env.manager.files.remove(env.sandbox_id, absolute(_path(req.path), env.home),
                                       recursive=True)
    except NotFound:
        pass  # E2B's envd removes a missing path without an error
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
