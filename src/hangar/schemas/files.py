"""Wire schemas of a sandbox's files: listings, writes, paths and watched changes."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, field_validator

from hangar.schemas.base import PATH_MAX, Model, RequestBody

NAME_MAX = 255
"""Bytes in one file name the guest kernel accepts (linux/limits.h)."""
GUEST_PATH_MAX = PATH_MAX + NAME_MAX
"""Characters in a path the guest reports: a listed folder's path (< ``PATH_MAX``) joined
with one of its names; longer ones are refused as malformed."""


def wire_safe(value: str) -> str:
    """``value`` with every lone surrogate (a name that is not UTF-8, as ``os.listdir``
    gives it: byte 0xff is ``\\udcff``) replaced by U+FFFD, so that every encoder (JSON,
    protobuf) takes it. Display only: the raw bytes are not kept."""
    try:
        value.encode("utf-8")
        return value
    except UnicodeEncodeError:
        return value.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


def _guest_str(value: str, most: int, what: str) -> str:
    if len(value) > most:
        raise ValueError(f"{what} is longer than {most} characters")
    return wire_safe(value)


class FileEntry(Model):
    name: str
    path: str
    type: Literal["file", "dir", "symlink", "other"]
    size: int = Field(description="Bytes.")
    mode: int
    mtime: float = Field(description="Unix time, seconds.", allow_inf_nan=False)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return _guest_str(value, NAME_MAX, "name")

    @field_validator("path")
    @classmethod
    def _path(cls, value: str) -> str:
        return _guest_str(value, GUEST_PATH_MAX, "path")


class FileList(Model):
    path: str
    entries: list[FileEntry]

    @field_validator("path")
    @classmethod
    def _path(cls, value: str) -> str:
        return _guest_str(value, GUEST_PATH_MAX, "path")


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
    time: float = Field(description="Unix time in the guest, seconds.", allow_inf_nan=False)
    old_path: str | None = Field(None, description="Where a moved entry was before.")

    @field_validator("path", "old_path")
    @classmethod
    def _path(cls, value: str | None) -> str | None:
        return None if value is None else _guest_str(value, PATH_MAX, "path")
