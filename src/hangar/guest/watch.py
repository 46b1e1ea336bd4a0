"""The agent's ``watch`` operation: file changes under a path, from inotify(7) through ctypes.

Standard library only. Frames on the request's channel (``hangar.guest.protocol``,
version 2)::

    host → guest  REQUEST  {"op": "watch", "path": P, "recursive": bool}
    guest → host  DATA     {"stream": "watch", "ready": true, "path": P, "dirs": N}  (first)
    guest → host  DATA     {"stream": "watch", "events": [event, ...]}               (batches)
    host → guest  CANCEL                                        stop: nothing more is sent
    guest → host  RESPONSE {"events": total, "reason": "deleted"}  the path itself went away

Batches go out within the host's window (``Channel.stream``): while the
host's reader lags, the watch stops reading inotify, whose queue in the
kernel then fills and overflows (an ``overflow`` event) instead of anything
growing here or in the server. A batch holds at most ``BATCH`` events and
``BATCH_BYTES`` of JSON, so it fits a window with room to spare. Frames from
the host other than CANCEL are read and ignored.

An event is ``{"type", "path", "is_dir", "time"}`` (``time``: Unix seconds)
with ``type`` one of:

``create``    a file or folder appeared (also one moved in from outside the tree)
``modify``    a file's content was written (``IN_MODIFY``; consecutive writes to one
              file within one read of the inotify queue count once)
``delete``    a file or folder was removed (also one moved out of the tree)
``move``      renamed within the tree: ``old_path`` → ``path``
``overflow``  the kernel's queue overflowed (``IN_Q_OVERFLOW``), the folder cap
              was reached, or an event was too large to send (``BATCH_BYTES``):
              events were lost, rescan what matters

With ``recursive``, every folder under the path is watched, and folders
created or moved in later are added as they appear (their contents found by
a scan are reported as ``create``). At most ``MAX_DIRS`` folders are watched
per request. The watch ends (``reason: deleted``) when the watched path
itself is removed or moved away.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import stat
import struct
import json
import time
from typing import TYPE_CHECKING, Any

from hangar.guest import protocol as P

if TYPE_CHECKING:
    from hangar.guest.channel import Channel

IN_MODIFY = 0x00000002
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ISDIR = 0x40000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC
MASK = (IN_MODIFY | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE | IN_DELETE_SELF
        | IN_MOVE_SELF)
EVENT = struct.Struct("iIII")
"""struct inotify_event without its name: wd, mask, cookie, len (inotify(7))."""

MAX_DIRS = 8192
"""Folders one watch may cover."""
BATCH = 256
"""Events per DATA frame, at most."""
BATCH_BYTES = P.CHUNK
"""Bytes of JSON events per DATA frame, at most, so a frame is no larger than a DATA frame
of output. An event larger than that (paths deeper than ``PATH_MAX`` can exist) is sent as
an ``overflow`` event instead."""
MOVE_WAIT_S = 0.1
"""Seconds to wait for a rename's IN_MOVED_TO after its IN_MOVED_FROM."""

_LIBC: Any = None


def _libc() -> Any:
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
    return _LIBC


def _check(rc: int, what: str) -> int:
    if rc < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), what)
    return rc


class TooMany(Exception):
    """More folders than ``MAX_DIRS`` under the watched path."""


class Watcher:
    """An inotify instance over one path (and, recursively, the folders under it)."""

    def __init__(self, root: str, recursive: bool, max_dirs: int = MAX_DIRS) -> None:
        self.root = root
        self.recursive = recursive
        self.max_dirs = max_dirs
        self.paths: dict[int, str] = {}
        self.capped = False
        self.pending: dict[int, tuple[str, bool]] = {}
        """Renames seen from their IN_MOVED_FROM half only, by cookie."""
        st = os.stat(root)  # OSError when missing
        self.root_is_dir = stat.S_ISDIR(st.st_mode)
        self.fd = _check(_libc().inotify_init1(IN_NONBLOCK | IN_CLOEXEC), "inotify_init1")
        try:
            self._add(root, strict=True)
            if recursive and self.root_is_dir:
                self._add_tree(root, strict=True)
        except BaseException:
            os.close(self.fd)
            raise

    def close(self) -> None:
        os.close(self.fd)

    def _add(self, path: str, strict: bool = False) -> bool:
        if len(self.paths) >= self.max_dirs:
            if strict:
                raise TooMany(path)
            self.capped = True
            return False
        wd = _libc().inotify_add_watch(self.fd, os.fsencode(path), MASK)
        if wd < 0:
            if strict and path == self.root:
                _check(wd, path)
            return False  # removed meanwhile, or no permission: skip it
        self.paths[wd] = path
        return True

    def _add_tree(self, top: str, strict: bool = False,
                  found: list[dict[str, Any]] | None = None) -> None:
        """Watch every folder under ``top``; report what is found there when ``found`` is a
        list (a folder that appeared after the watch began)."""
        for dirpath, dirnames, filenames in os.walk(top):
            for name in list(dirnames):
                path = os.path.join(dirpath, name)
                if found is not None:
                    found.append(event("create", path, True))
                if not self._add(path, strict):
                    dirnames.remove(name)  # not watched: neither are the folders under it
            if found is not None:
                found.extend(event("create", os.path.join(dirpath, n), False)
                             for n in filenames)

    def _rename_tree(self, old: str, new: str) -> None:
        prefix = old + "/"
        for wd, p in list(self.paths.items()):
            if p == old:
                self.paths[wd] = new
            elif p.startswith(prefix):
                self.paths[wd] = new + p[len(old):]

    def read(self) -> tuple[list[dict[str, Any]], bool]:
        """Events now in the queue, and whether the watched path itself is gone."""
        try:
            raw = os.read(self.fd, 1 << 16)
        except BlockingIOError:
            return [], False
        events: list[dict[str, Any]] = []
        gone = False
        off = 0
        while off + EVENT.size <= len(raw):
            wd, mask, cookie, n = EVENT.unpack_from(raw, off)
            name = raw[off + EVENT.size:off + EVENT.size + n].split(b"\0", 1)[0]
            off += EVENT.size + n
            if mask & IN_Q_OVERFLOW:
                events.append(event("overflow", self.root, False))
                continue
            base = self.paths.get(wd)
            if mask & IN_IGNORED:
                self.paths.pop(wd, None)
                continue
            if base is None:
                continue
            path = os.path.join(base, os.fsdecode(name)) if name else base
            is_dir = bool(mask & IN_ISDIR)
            if mask & (IN_DELETE_SELF | IN_MOVE_SELF):
                if base == self.root:
                    gone = True
                    events.append(event("delete", self.root, self.root_is_dir))
                continue
            if mask & IN_CREATE:
                events.append(event("create", path, is_dir))
                if is_dir and self.recursive:
                    self._add(path)
                    self._add_tree(path, found=events)
            elif mask & IN_MODIFY:
                last = events[-1] if events else None
                if not (last and last["type"] == "modify" and last["path"] == path):
                    events.append(event("modify", path, is_dir))
            elif mask & IN_DELETE:
                events.append(event("delete", path, is_dir))
            elif mask & IN_MOVED_FROM:
                self.pending[cookie] = (path, is_dir)
            elif mask & IN_MOVED_TO:
                if cookie in self.pending:
                    old, _ = self.pending.pop(cookie)
                    ev = event("move", path, is_dir)
                    ev["old_path"] = old
                    events.append(ev)
                    if is_dir:
                        self._rename_tree(old, path)
                else:
                    events.append(event("create", path, is_dir))
                    if is_dir and self.recursive:
                        self._add(path)
                        self._add_tree(path, found=events)
        if self.capped:
            events.append(event("overflow", self.root, True))
            self.capped = False
        return events, gone

    def flush(self) -> list[dict[str, Any]]:
        """Moves whose other half never came (moved out of the tree) as ``delete`` events."""
        out = [event("delete", p, d) for p, d in self.pending.values()]
        self.pending.clear()
        return out


def event(kind: str, path: str, is_dir: bool) -> dict[str, Any]:
    return {"type": kind, "path": path, "is_dir": is_dir, "time": time.time()}


def batches(events: list[dict[str, Any]], root: str) -> list[list[dict[str, Any]]]:
    """``events`` in order, cut into batches of at most ``BATCH`` events and
    ``BATCH_BYTES`` bytes of JSON; an event larger than that becomes an ``overflow``
    event of ``root``."""
    out: list[list[dict[str, Any]]] = []
    batch: list[dict[str, Any]] = []
    size = 0
    for e in events:
        n = len(json.dumps(e, separators=(",", ":"))) + 1
        if n > BATCH_BYTES:
            e = event("overflow", root, True)
            n = len(json.dumps(e, separators=(",", ":"))) + 1
        if batch and (len(batch) >= BATCH or size + n > BATCH_BYTES):
            out.append(batch)
            batch, size = [], 0
        batch.append(e)
        size += n
    if batch:
        out.append(batch)
    return out


async def run(ch: Channel, path: str, recursive: bool) -> dict[str, Any]:
    """Watch ``path`` until the host CANCELs or the path goes away; see the module docstring.

    Returns the RESPONSE meta (``reason`` ``deleted``). Raises OSError
    (missing path, no inotify) or ``TooMany``.
    """
    loop = asyncio.get_running_loop()
    w = Watcher(path, recursive)
    ready = asyncio.Event()
    total = 0

    async def ignore_input() -> None:
        while True:
            await ch.get()  # the host sends nothing else; take it all the same

    try:
        loop.add_reader(w.fd, ready.set)
        await ch.stream({"stream": "watch", "ready": True, "path": path,
                         "dirs": len(w.paths)})
        reader = asyncio.create_task(ignore_input())
        try:
            while True:
                await ready.wait()
                ready.clear()
                events, gone = w.read()
                if w.pending and not gone:  # a rename's second half may be a read away
                    deadline = loop.time() + MOVE_WAIT_S
                    while True:
                        more, gone = w.read()  # non-blocking: also after a timeout, since
                        events += more         # a stalled guest's clock may jump past it
                        if gone or not w.pending or loop.time() >= deadline:
                            break
                        try:
                            await asyncio.wait_for(ready.wait(), deadline - loop.time())
                        except asyncio.TimeoutError:
                            pass
                        ready.clear()
                    events += w.flush()
                for batch in batches(events, path):  # each waits for the host's window
                    await ch.stream({"stream": "watch", "events": batch})
                total += len(events)
                if gone:
                    break
        finally:
            reader.cancel()
    finally:
        loop.remove_reader(w.fd)
        w.close()
    return {"events": total, "reason": "deleted"}
