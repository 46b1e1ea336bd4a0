# Generated from hangar/client/_async/files.py by scripts/gen_sync.py: do not edit.
"""A sandbox's files: the flat client's calls (``/sandboxes/{id}/files``): write, read,
list, stat, make a folder, remove, and watch for changes. Paths are the guest's;
relative ones start at /root.

Mixed into ``AsyncHangar``; its methods run on the flat client (``self``). Source of
``hangar/client/_sync/files.py``.
"""

from __future__ import annotations

import builtins

from hangar.client._sync.mixin import flat_client as _client
from hangar.client._sync.streams import FileWatch
from hangar.schemas import FileEntry, FileList, WriteResult


class FileCalls:
    """The flat client's file methods (mixed into ``AsyncHangar``)."""

    def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644, *,
                         request_timeout: float | None = None,
                         retry: bool | None = None) -> WriteResult:
        """``PUT /sandboxes/{id}/files``: write ``data`` to ``path`` (atomic in the guest).

        Relative paths start at /root; ``mode`` is the file's permission
        bits. The timeout grows with the size. Raises NotFound, InvalidRequest.
        """
        c = _client(self)
        t = c._t(request_timeout, c.config.timeouts.upload(len(data)))
        return WriteResult.model_validate(c._json(
            "PUT", f"/sandboxes/{sandbox_id}/files", params={"path": path, "mode": mode},
            content=data, timeout=t, retry=retry is not False))

    def read_file(self, sandbox_id: str, path: str, *, request_timeout: float | None = None,
                        retry: bool | None = None) -> bytes:
        """``GET /sandboxes/{id}/files``: a file's bytes. Raises NotFound, InvalidRequest."""
        c = _client(self)
        t = c._t(request_timeout, c.config.timeouts.transfer)
        return (c._send("GET", f"/sandboxes/{sandbox_id}/files",
                              params={"path": path}, timeout=t,
                              retry=retry is not False)).content

    def list_files(self, sandbox_id: str, path: str = "/root", *,
                         request_timeout: float | None = None,
                         retry: bool | None = None) -> builtins.list[FileEntry]:
        """``GET /sandboxes/{id}/files/list``: a directory's entries."""
        c = _client(self)
        t = c._t(request_timeout, c.config.timeouts.control)
        return FileList.model_validate(c._json(
            "GET", f"/sandboxes/{sandbox_id}/files/list", params={"path": path}, timeout=t,
            retry=retry is not False)).entries

    def stat_file(self, sandbox_id: str, path: str, *, request_timeout: float | None = None,
                        retry: bool | None = None) -> FileEntry:
        """``GET /sandboxes/{id}/files/stat``: one path's type, size, mode and time."""
        c = _client(self)
        t = c._t(request_timeout, c.config.timeouts.control)
        return FileEntry.model_validate(c._json(
            "GET", f"/sandboxes/{sandbox_id}/files/stat", params={"path": path}, timeout=t,
            retry=retry is not False))

    def make_dir(self, sandbox_id: str, path: str, parents: bool = True, *,
                       request_timeout: float | None = None,
                       retry: bool | None = None) -> FileEntry:
        """``POST /sandboxes/{id}/files/mkdir``: create a directory (and its parents)."""
        c = _client(self)
        t = c._t(request_timeout, c.config.timeouts.control)
        return FileEntry.model_validate(c._json(
            "POST", f"/sandboxes/{sandbox_id}/files/mkdir",
            json={"path": path, "parents": parents}, timeout=t, retry=retry is not False))

    def remove_file(self, sandbox_id: str, path: str, recursive: bool = False, *,
                          request_timeout: float | None = None,
                          retry: bool | None = None) -> None:
        """``DELETE /sandboxes/{id}/files``: remove a file, or a directory with ``recursive``."""
        c = _client(self)
        t = c._t(request_timeout, c.config.timeouts.control)
        c._send("DELETE", f"/sandboxes/{sandbox_id}/files",
                      params={"path": path, "recursive": recursive}, timeout=t,
                      retry=retry is not False)

    def watch_files(self, sandbox_id: str, path: str, recursive: bool = False, *,
                    request_timeout: float | None = None) -> FileWatch:
        """``GET /sandboxes/{id}/files/watch``: file changes under ``path``, as they happen.

        Returns an ``AsyncFileWatch``: ``async with`` it (the watch is in place
        once entered) and iterate ``FileEvent`` objects (``create``,
        ``modify``, ``delete``, ``move``, ``overflow``). ``recursive`` covers
        every folder below too. ``request_timeout`` is the longest silence
        tolerated (default 45 s; the server sends a keep-alive every 15 s).
        """
        c = _client(self)
        t = c._t(request_timeout, c.config.timeouts.events)
        return FileWatch(c, sandbox_id, path, recursive, t)
