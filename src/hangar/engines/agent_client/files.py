"""The guest's plain file calls, host side: ``stat``, ``list_dir``, ``mkdir``, ``remove``.

``FileCalls`` adds one typed method per operation to a ``Connection`` (the
guest's side: ``hangar.guest.ops.files``); a file's bytes move through
``AgentClient.read_file`` and ``write_file`` (``client``), which carry
streams. What the guest answers is read here and nowhere else: a
``GuestFile`` per entry, a ``GuestFolder`` per listing. A guest is hostile:
every field is checked and every string cut to a bound; an answer that is no
entry is one ``GuestError``.

Each call keeps to ``deadlines.control_s`` (else ``Timeout``). Relative
paths start at the guest's home (``hangar.guest.paths.HOME``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hangar.engines.agent_client.connection import Connection
from hangar.engines.agent_client.results import int_or_none
from hangar.errors import GuestError
from hangar.turns import mapped

MAX_PATH = 8192
"""Characters kept of a path or name the guest sends (twice Linux's ``PATH_MAX``)."""
MAX_ENTRIES = 1_000_000
"""Entries kept of one folder's listing."""
KINDS = frozenset({"file", "dir", "symlink", "other"})
"""What a ``GuestFile.type`` may be."""


@dataclass(frozen=True)
class GuestFile:
    """One file in the guest, as ``lstat`` sees it (a symlink's own entry, not its target's).

    ``type`` is ``file``, ``dir``, ``symlink`` or ``other``; ``size`` in
    bytes; ``mode`` the permission bits; ``mtime`` Unix seconds.
    """

    name: str
    path: str
    type: str
    size: int
    mode: int
    mtime: float


@dataclass(frozen=True)
class GuestFolder:
    """A folder's absolute ``path`` and its ``entries``, sorted by name."""

    path: str
    entries: tuple[GuestFile, ...]


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError("not a string")
    return value[:MAX_PATH]


def guest_file(m: Any) -> GuestFile:
    """The entry in a guest's answer; ValueError or TypeError when it is none."""
    if not isinstance(m, dict):
        raise TypeError("not an entry")
    kind = m.get("type")
    size, mode = int_or_none(m.get("size")), int_or_none(m.get("mode"))
    mtime = m.get("mtime")
    if kind not in KINDS or size is None or mode is None \
            or not isinstance(mtime, (int, float)) or isinstance(mtime, bool):
        raise ValueError("not an entry")
    return GuestFile(_text(m.get("name")), _text(m.get("path")), str(kind), size, mode,
                     float(mtime))


def _checked(meta: dict[str, Any], what: str) -> GuestFile:
    try:
        return guest_file(meta)
    except (TypeError, ValueError):
        raise GuestError(f"the guest agent sent a malformed {what} answer") from None


class FileCalls(Connection):
    """The guest's plain file calls (see the module docstring); a mixin of ``AgentClient``."""

    async def stat(self, path: str) -> GuestFile:
        """``path``'s entry (a symlink's own). Raises NotFound, InvalidRequest (a bad
        path, permission denied), Timeout, GuestError."""
        return _checked(await self.call("stat", path=path), "stat")

    async def list_dir(self, path: str) -> GuestFolder:
        """The folder ``path``'s absolute path and entries, by name (an entry removed while
        listed is left out). Raises NotFound, InvalidRequest (not a folder, a bad path),
        Timeout, GuestError. The entries (up to about 16,000 in the 1 MiB answer) are read
        ``hangar.turns.EVERY`` at a time, with turns of the loop between."""
        meta = await self.call("list_dir", path=path)
        try:
            entries = meta.get("entries")
            if not isinstance(entries, list):
                raise TypeError("no entries")
            return GuestFolder(_text(meta.get("path")),
                               tuple(await mapped(guest_file, entries[:MAX_ENTRIES])))
        except (TypeError, ValueError):
            raise GuestError("the guest agent sent a malformed folder listing") from None

    async def mkdir(self, path: str, parents: bool = True) -> GuestFile:
        """Make the folder ``path`` (``parents``: its missing parents too, and an existing
        folder is fine, like ``mkdir -p``); its entry. Raises NotFound (no parent),
        Conflict (something is there), InvalidRequest, Timeout, GuestError."""
        return _checked(await self.call("mkdir", path=path, parents=parents), "mkdir")

    async def remove(self, path: str, recursive: bool = False) -> None:
        """Remove the file or empty folder ``path`` (``recursive``: a folder and all below
        it). Raises NotFound, InvalidRequest (``/``), Conflict (a folder not empty and not
        ``recursive``), Timeout, GuestError."""
        await self.call("remove", path=path, recursive=recursive)
