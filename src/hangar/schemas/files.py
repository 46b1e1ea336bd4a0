"""Wire schemas of a sandbox's files: listings, writes, paths and watched changes."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from hangar.schemas.base import PATH_MAX, Model, RequestBody


class FileEntry(Model):
    name: str
    path: str
    type: Literal["file", "dir", "symlink", "other"]
    size: int = Field(description="Bytes.")
    mode: int
    mtime: float = Field(description="Unix time, seconds.")


class FileList(Model):
    path: str
    entries: list[FileEntry]


class WriteResult(Model):
    path: str
    size: int = Field(description="Bytes written.")


class PathBody(RequestBody):
    model_config = ConfigDict(extra="forbid")

    path: str = Field(min_length=1, max_length=PATH_MAX)
    parents: bool = True
    recursive: bool = False


class FileEvent(Model):
    """One change seen by ``GET /sandboxes/{id}/files/watch`` (inotify in the guest).

    ``type``: ``create``, ``modify``, ``delete``, ``move`` (``old_path`` →
    ``path``), or ``overflow`` (events were lost: rescan).
    """

    type: Literal["create", "modify", "delete", "move", "overflow"]
    path: str
    is_dir: bool = False
    time: float = Field(description="Unix time in the guest, seconds.")
    old_path: str | None = Field(None, description="Where a moved entry was before.")
