"""``filesystem.Filesystem``: WatchDir (a server stream), and CreateWatcher,
GetWatcherEvents, RemoveWatcher (the same, polled: what E2B's SDK uses).

On the core's file watches (inotify in the guest). An event's ``name`` is
its path relative to the watched folder. Hangar's events map as:
``create`` → CREATE, ``modify`` → WRITE, ``delete`` → REMOVE, a ``move``
→ RENAME of the old name and CREATE of the new one; a file written through
``/files`` (Hangar writes a temporary file and renames it into place, then
gives it its owner) → CREATE, WRITE and CHMOD of its name, as E2B's envd
reports a written file, its temporary file never shown; ``overflow``
(events lost) is dropped. With ``include_entry`` (envd 0.6.3), each CREATE,
WRITE and CHMOD event carries the ``EntryInfo`` of its path when the poll
(or the stream's batch) finds it still there (best effort, as E2B's envd).
``allow_network_mounts`` (envd 0.6.4) is taken: Hangar's watches refuse no
mount, so it changes nothing.
Only folders are watched: a file's path is ``invalid_argument``. A poll that
finds no event waits up to ``SETTLE_S`` for one, so that a write made just
before it is seen, as E2B's envd sees it.

A watcher keeps at most ``MAX_EVENTS`` events and ``MAX_EVENT_CHARS`` characters of
their names between two polls (the oldest go), at most
``Settings.envd_max_watchers_per_sandbox`` (16) live in a sandbox (running, or ended
still holding events; a slot is taken before the watch starts and given back when it
fails), and one not polled for ``IDLE_S`` seconds is removed (swept at every create,
poll and remove). While one is open the sandbox
counts as busy (no snapshot or sleep under it), as with any watch.
"""

from __future__ import annotations

import asyncio
import contextlib
import posixpath
import secrets
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.message import Message

from hangar.api.envd.connect import Call, Method, RpcError, rpc_error
from hangar.api.envd.fs_entries import absolute, entry_infos
from hangar.api.envd.messages import FS
from hangar.core.service import FileEvent
from hangar.errors import HangarError
from hangar.turns import Turns, extend

log = logging.getLogger("hangar.envd")
MAX_EVENTS = 10_000
MAX_EVENT_CHARS = 1 << 20
"""Most characters of event names one watcher holds between two polls."""
MAX_PER_SANDBOX = 16
"""Live watchers per sandbox when the manager names no ``envd_max_watchers_per_sandbox``."""
IDLE_S = 600.0
SETTLE_S = 1.0
"""Longest a poll that finds no event waits for one (``Watchers.take``), seconds."""
COALESCE_S = 0.05
"""How long a poll waits, once an event arrived, for the rest of its batch, seconds."""
TEMP_PREFIX = ".hangar-"
"""The guest's temporary files of a write (``op_write_file``)."""


def _name(root: str, path: str) -> str:
    rel = posixpath.relpath(path, root)
    return path if rel.startswith("..") else rel


def _hidden(path: str) -> bool:
    return posixpath.basename(path).startswith(TEMP_PREFIX)


def events_of(root: str, batch: list[FileEvent]) -> list[Any]:
    """``FilesystemEvent``s of one batch of the core's events under ``root``."""
    out: list[Any] = []

    def add(path: str, kind: int) -> None:
        out.append(FS.FilesystemEvent(name=_name(root, path), type=kind))

    for e in batch:
        if e.type == "move":
            if e.old_path and _hidden(e.old_path):
                add(e.path, FS.EVENT_TYPE_CREATE)
                add(e.path, FS.EVENT_TYPE_WRITE)
                add(e.path, FS.EVENT_TYPE_CHMOD)
                continue
            if e.old_path:
                add(e.old_path, FS.EVENT_TYPE_RENAME)
            add(e.path, FS.EVENT_TYPE_CREATE)
        elif _hidden(e.path) or e.type == "overflow":
            continue
        else:
            add(e.path, {"create": FS.EVENT_TYPE_CREATE, "modify": FS.EVENT_TYPE_WRITE,
                         "delete": FS.EVENT_TYPE_REMOVE}[e.type])
    return out


def _check(req: Any, home: str) -> str:
    if not req.path:
        raise RpcError("invalid_argument", "path is empty")
    return absolute(req.path, home)


_WITH_ENTRY = frozenset({FS.EVENT_TYPE_CREATE, FS.EVENT_TYPE_WRITE, FS.EVENT_TYPE_CHMOD})
"""Events whose path should still be there: they get its ``EntryInfo`` (``include_entry``)."""


async def with_entries(env: Any, root: str, events: list[Any]) -> None:
    """Set the ``entry`` of each CREATE, WRITE and CHMOD event of ``events`` (of the watch
    of ``root``) whose path is there now: one stat a path and one read of their owners,
    the entries set a slice at a time with turns of the loop between (``hangar.turns``).
    Best effort: a path gone, a guest call that fails, or more metadata than an answer
    carries (``fs_entries.entry_infos``), leaves events without one."""
    paths = {posixpath.join(root, ev.name) for ev in events if ev.type in _WITH_ENTRY}
    found = []
    for path in sorted(paths):
        with contextlib.suppress(HangarError):
            found.append(await env.manager.files.stat(env.sandbox_id, path))
    if not found:
        return
    try:
        infos = {info.path: info for info in await entry_infos(env, found,
                                                               budget=MAX_EVENT_CHARS)}
    except (HangarError, RpcError):  # best effort: too much metadata gives no entries
        return
    turns = Turns()
    for ev in events:
        info = infos.get(posixpath.join(root, ev.name)) if ev.type in _WITH_ENTRY else None
        if info is not None:
            ev.entry.CopyFrom(info)
        await turns.tick()


async def _folder(env: Any, root: str) -> None:
    """Raises RpcError unless ``root`` is a folder (``not_found``, or ``invalid_argument``
    for a file: E2B's envd watches folders only)."""
    try:
        e = await env.manager.files.stat(env.sandbox_id, root)
    except HangarError as exc:
        raise rpc_error(exc) from None
    if e.type != "dir":
        raise RpcError("invalid_argument", f"path {root} is not a directory: only folders "
                                           "are watched")


async def watch_dir(req: Any, call: Call) -> AsyncIterator[Message]:
    env = call.context
    root = _check(req, env.home)
    await _folder(env, root)
    gen = env.manager.files.watch(env.sandbox_id, root, bool(req.recursive))
    try:
        async for batch in gen:
            if not batch:
                ev = FS.WatchDirResponse()
                ev.start.SetInParent()
                yield ev
                continue
            events = events_of(root, batch)
            if req.include_entry:
                await with_entries(env, root, events)
            for fe in events:
                yield FS.WatchDirResponse(filesystem=fe)
    except HangarError as exc:
        raise rpc_error(exc) from None
    finally:
        await gen.aclose()


@dataclass
class Watcher:
    id: str
    sandbox_id: str
    root: str
    include_entry: bool = False
    """Events carry their path's ``EntryInfo`` (``with_entries``, when polled)."""
    events: deque[Any] = field(default_factory=lambda: deque(maxlen=MAX_EVENTS))
    polled: float = field(default_factory=time.monotonic)
    task: asyncio.Task[None] | None = None
    error: HangarError | None = None
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when events are added, cleared when they are taken."""
    chars: int = 0
    """Characters of the names of ``events``."""

    def add(self, events: list[Any]) -> None:
        """Keep ``events``, dropping the oldest past ``MAX_EVENTS`` or ``MAX_EVENT_CHARS``."""
        for ev in events:
            if len(self.events) >= MAX_EVENTS:
                self.chars -= len(self.events.popleft().name)
            self.events.append(ev)
            self.chars += len(ev.name)
            while self.chars > MAX_EVENT_CHARS and self.events:
                self.chars -= len(self.events.popleft().name)


class Watchers:
    """The polled watchers of every sandbox on this server."""

    def __init__(self) -> None:
        self._all: dict[str, Watcher] = {}

    def get(self, sandbox_id: str, watcher_id: str) -> Watcher:
        w = self._all.get(watcher_id)
        if w is None or w.sandbox_id != sandbox_id:
            raise RpcError("not_found", f"watcher {watcher_id[:64]} not found")
        return w

    def live(self, sandbox_id: str) -> int:
        """Watchers of ``sandbox_id`` being made or running, or ended still holding events
        (one whose watch ended with no event left, kept until polled for its error, does
        not count)."""
        return sum(w.sandbox_id == sandbox_id
                   and (w.task is None or not w.task.done() or bool(w.events))
                   for w in self._all.values())

    def _sweep(self) -> None:
        """Drop ended watchers nobody polled for ``IDLE_S``."""
        now = time.monotonic()
        for w in [w for w in self._all.values() if w.task is not None and w.task.done()
                  and now - w.polled > IDLE_S]:
            self._all.pop(w.id, None)

    async def create(self, manager: Any, sandbox_id: str, path: str, root: str,
                     recursive: bool, include_entry: bool = False) -> Watcher:
        """A running watcher of ``path``. Its slot is taken (checked and counted with no
        wait between) before the watch starts and given back if it fails, so a burst of
        creates cannot pass the cap together. Raises RpcError (resource_exhausted past
        ``Settings.envd_max_watchers_per_sandbox``) and the watch's errors."""
        cap = getattr(getattr(manager, "settings", None), "envd_max_watchers_per_sandbox",
                      MAX_PER_SANDBOX)
        self._sweep()
        if self.live(sandbox_id) >= cap:
            raise RpcError("resource_exhausted", f"sandbox {sandbox_id} has {cap} "
                                                 "watchers, the most allowed: remove one")
        w = Watcher(id="w-" + secrets.token_hex(8), sandbox_id=sandbox_id, root=root,
                    include_entry=include_entry)
        self._all[w.id] = w
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        w.task = asyncio.ensure_future(self._run(manager, w, path, recursive, ready))
        try:
            await ready
        except BaseException:
            self._all.pop(w.id, None)
            w.task.cancel()
            raise
        return w

    async def _run(self, manager: Any, w: Watcher, path: str, recursive: bool,
                   ready: asyncio.Future[None]) -> None:
        gen = manager.files.watch(w.sandbox_id, path, recursive)
        nxt: asyncio.Future[Any] | None = None
        try:
            nxt = asyncio.ensure_future(gen.__anext__())
            while True:
                done, _ = await asyncio.wait({nxt}, timeout=IDLE_S / 10)
                if not done:
                    if time.monotonic() - w.polled > IDLE_S:
                        self._all.pop(w.id, None)  # nobody polls it any more
                        break
                    continue
                batch = nxt.result()
                if not ready.done():
                    ready.set_result(None)
                w.add(events_of(w.root, batch))
                if w.events:
                    w.arrived.set()
                nxt = asyncio.ensure_future(gen.__anext__())
        except StopAsyncIteration:
            pass
        except HangarError as exc:
            if not ready.done():
                ready.set_exception(exc)
            w.error = exc
        except Exception as exc:  # a bug or a guest value nothing takes: the poll says so
            log.exception("envd watcher failed", extra={"sandbox_id": w.sandbox_id})
            w.error = HangarError(f"the watch of {w.root} failed: {type(exc).__name__}")
            if not ready.done():
                ready.set_exception(w.error)
        finally:
            if not ready.done():
                ready.set_exception(HangarError(f"the watch of {w.root} ended before it was "
                                                "in place"))
            # The generator's pending step is ended first: while it runs, aclose() fails
            # ("already running"), and the watch would hold the sandbox busy for good.
            await _end(nxt)
            with contextlib.suppress(BaseException):
                await gen.aclose()

    async def take(self, w: Watcher) -> list[Any]:
        """The events gathered since the last poll. With none yet, waits up to
        ``SETTLE_S`` for the guest's events of what was just done (E2B's envd sees a
        write in a watched folder before the write's answer; here its event follows
        through the agent), then ``COALESCE_S`` for the rest of their batch."""
        w.polled = time.monotonic()
        self._sweep()
        if not w.events and w.error is None and w.task is not None and not w.task.done():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(w.arrived.wait(), SETTLE_S)
                await asyncio.sleep(COALESCE_S)
        out = list(w.events)
        w.events.clear()
        w.chars = 0
        w.arrived.clear()
        return out

    def remove(self, w: Watcher) -> None:
        self._all.pop(w.id, None)
        self._sweep()
        if w.task is not None:
            w.task.cancel()


async def create_watcher(req: Any, call: Call) -> Message:
    env = call.context
    root = _check(req, env.home)
    await _folder(env, root)
    try:
        w = await env.watchers.create(env.manager, env.sandbox_id, root, root,
                                      bool(req.recursive), bool(req.include_entry))
    except HangarError as exc:
        raise rpc_error(exc) from None
    return FS.CreateWatcherResponse(watcher_id=w.id)


async def get_watcher_events(req: Any, call: Call) -> Message:
    env = call.context
    w = env.watchers.get(env.sandbox_id, req.watcher_id)
    events = await env.watchers.take(w)
    if not events and w.error is not None:
        env.watchers.remove(w)
        raise rpc_error(w.error)
    if w.include_entry and events:
        await with_entries(env, w.root, events)
    res = FS.GetWatcherEventsResponse()
    await extend(res.events, events)  # up to MAX_EVENTS, each copied
    return res


async def remove_watcher(req: Any, call: Call) -> Message:
    env = call.context
    env.watchers.remove(env.watchers.get(env.sandbox_id, req.watcher_id))
    return FS.RemoveWatcherResponse()


async def _end(step: asyncio.Future[Any] | None) -> None:
    """Cancel a pending step of a watch's generator and wait until it has ended, even
    when the task that waits is itself being cancelled (``Watchers.remove``)."""
    if step is None or step.done():
        return
    step.cancel()
    while not step.done():
        with contextlib.suppress(BaseException):
            await asyncio.wait({step})


def _keepalive() -> Message:
    ev = FS.WatchDirResponse()
    ev.keepalive.SetInParent()
    return ev


METHODS = {
    "filesystem.Filesystem/WatchDir": Method("server", FS.WatchDirRequest, FS.WatchDirResponse,
                                             watch_dir, _keepalive),
    "filesystem.Filesystem/CreateWatcher": Method(
        "unary", FS.CreateWatcherRequest, FS.CreateWatcherResponse, create_watcher),
    "filesystem.Filesystem/GetWatcherEvents": Method(
        "unary", FS.GetWatcherEventsRequest, FS.GetWatcherEventsResponse, get_watcher_events),
    "filesystem.Filesystem/RemoveWatcher": Method(
        "unary", FS.RemoveWatcherRequest, FS.RemoveWatcherResponse, remove_watcher),
}
