"""The file operations: ``read_file``, ``write_file``, ``list_dir``, ``stat``, ``mkdir``,
``remove``.

Paths are resolved by ``hangar.guest.ops.common.resolve`` (relative ones start at
the commands' HOME). An entry (``list_dir``, ``stat``, ``mkdir``) is ``{name, path,
type, size, mode, mtime}`` (``entry``). Failures are ERROR frames: ``not_found``,
``is_directory``, ``not_directory``, ``exists``, ``not_empty``,
``permission_denied``, ``invalid``, ``io_error``.
"""

from __future__ import annotations

import os
import stat as stat_mod
from typing import TYPE_CHECKING, Any

from hangar.guest import paths
from hangar.guest import protocol as P
from hangar.guest.ops.common import AgentView, OpError, mkstemp, os_error, resolve

if TYPE_CHECKING:
    from hangar.guest.channel import Channel


def entry(path: str, name: str | None = None) -> dict[str, Any]:
    """One directory entry: name, path, type (file, dir, symlink, other), size (bytes), mode,
    mtime (Unix seconds), of the link itself for a symlink. Raises OSError."""
    st = os.lstat(path)
    if stat_mod.S_ISDIR(st.st_mode):
        kind = "dir"
    elif stat_mod.S_ISREG(st.st_mode):
        kind = "file"
    elif stat_mod.S_ISLNK(st.st_mode):
        kind = "symlink"
    else:
        kind = "other"
    return {
        "name": name if name is not None else os.path.basename(path) or "/",
        "path": path,
        "type": kind,
        "size": st.st_size,
        "mode": stat_mod.S_IMODE(st.st_mode),
        "mtime": st.st_mtime,
    }


async def read_file(agent: AgentView, meta: dict[str, Any], ch: Channel) -> dict[str, Any]:
    """Stream the file at ``path`` as DATA frames of stream ``file`` (as the host's window
    allows); RESPONSE ``{path, size}`` (bytes sent). ERROR ``is_directory`` for a folder."""
    path = resolve(meta.get("path"))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise os_error(exc, path) from None
    size = 0
    try:
        st = os.fstat(fd)
        if stat_mod.S_ISDIR(st.st_mode):
            raise OpError("is_directory", f"is a directory: {path}")
        while True:
            chunk = os.read(fd, P.CHUNK)
            if not chunk:
                break
            size += len(chunk)
            await ch.stream({"stream": "file"}, chunk)  # waits for the host's window
    finally:
        os.close(fd)
    return {"path": path, "size": size}


async def write_file(agent: AgentView, meta: dict[str, Any], ch: Channel) -> dict[str, Any]:
    """Write the DATA frames up to EOF to ``path``, atomically (a temporary file, fsync'd, then
    renamed). meta: ``mode`` (0..0o7777, default 0o644), ``parents`` (default true: make the
    folders above). RESPONSE ``{path, size}`` (bytes written)."""
    path = resolve(meta.get("path"))
    mode = meta.get("mode", 0o644)
    if not isinstance(mode, int) or not 0 <= mode <= 0o7777:
        raise OpError("invalid", "mode must be an integer permission value")
    parent = os.path.dirname(path)
    if os.path.isdir(path):
        raise OpError("is_directory", f"is a directory: {path}")
    try:
        if meta.get("parents", True):
            os.makedirs(parent, exist_ok=True)
        fd, tmp = mkstemp(parent, ".hangar-")
    except OSError as exc:
        raise os_error(exc, parent) from None
    size = 0
    ok = False
    try:
        while True:
            frame = await ch.get()
            if frame.kind == P.Kind.DATA:
                view = memoryview(frame.data)
                while view:
                    n = os.write(fd, view)
                    view = view[n:]
                size += len(frame.data)
            elif frame.kind == P.Kind.EOF:
                break
        os.fchmod(fd, mode)
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, path)
        ok = True
    except OSError as exc:
        raise os_error(exc, path) from None
    finally:
        if fd >= 0:
            os.close(fd)
        if not ok:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    return {"path": path, "size": size}


async def list_dir(agent: AgentView, meta: dict[str, Any], ch: Channel) -> dict[str, Any]:
    """The entries of the folder ``path`` (default HOME), by name: ``{path, entries}``."""
    path = resolve(meta.get("path", paths.HOME))
    try:
        names = sorted(os.listdir(path))
    except OSError as exc:
        raise os_error(exc, path) from None
    entries = []
    for name in names:
        try:
            entries.append(entry(os.path.join(path, name), name))
        except OSError:
            continue  # removed while listing
    return {"path": path, "entries": entries}


async def stat(agent: AgentView, meta: dict[str, Any], ch: Channel) -> dict[str, Any]:
    """The entry of ``path`` (of a symlink itself, not its target)."""
    path = resolve(meta.get("path"))
    try:
        return entry(path)
    except OSError as exc:
        raise os_error(exc, path) from None


async def mkdir(agent: AgentView, meta: dict[str, Any], ch: Channel) -> dict[str, Any]:
    """Make the folder ``path``; ``parents`` (default true) like ``mkdir -p``. Its entry."""
    path = resolve(meta.get("path"))
    try:
        if meta.get("parents", True):
            os.makedirs(path, exist_ok=True)
        else:
            os.mkdir(path)
        return entry(path)
    except OSError as exc:
        raise os_error(exc, path) from None


async def remove(agent: AgentView, meta: dict[str, Any], ch: Channel) -> dict[str, Any]:
    """Remove the file or empty folder ``path``; ``recursive``: a folder and all below it.
    ``{path}``. ERROR ``invalid`` for ``/``, ``not_empty`` for a full folder not recursive."""
    path = resolve(meta.get("path"))
    if path == "/":
        raise OpError("invalid", "refusing to remove /")
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            if meta.get("recursive"):
                import shutil

                shutil.rmtree(path)
            else:
                os.rmdir(path)
        else:
            os.unlink(path)
    except OSError as exc:
        raise os_error(exc, path) from None
    return {"path": path}
