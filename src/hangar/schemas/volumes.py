"""Wire schemas of named volumes (``/volumes``) and of a create's ``volumes``.

Sizes are MiB, times Unix seconds, file sizes bytes. A volume is an ext4
image that outlives sandboxes; see docs/volumes.md.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import ConfigDict, Field

from hangar.schemas.base import Model, RequestBody

MAX_VOLUMES_PER_SANDBOX = 4
"""Volumes one sandbox attaches at most (the privileged helper passes at most 8 VMM-owned
files)."""
MIN_SIZE_MIB = 16
MAX_SIZE_MIB = 1 << 20
"""A volume's size bounds, MiB (16 MiB to 1 TiB)."""
MountPath = Annotated[str, Field(min_length=1, max_length=256)]
"""A guest mount path (``hangar.core.volumes.check_mount_path`` checks the rest)."""
VOLUME_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
"""A volume's name (``hangar.core.volumes.check_name`` also refuses an id's shape)."""


class VolumeMount(RequestBody):
    """One volume of a create's ``volumes``, in its long form."""

    model_config = ConfigDict(extra="forbid")

    volume: str = Field(min_length=1, max_length=64, description="The volume's id or name.")
    read_only: bool = Field(False, description="Mount it read-only: any number of sandboxes "
                                               "may, while none writes it.")


class MountedVolume(Model):
    """A sandbox's volume as ``GET /sandboxes/{id}`` shows it."""

    volume: str = Field(description="The volume's id.")
    read_only: bool


VolumeMounts = dict[str, str | VolumeMount]
"""A create's ``volumes``: guest path -> volume id or name (read-write), or a
``VolumeMount``."""


class CreateVolume(RequestBody):
    """Body of ``POST /volumes``."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=VOLUME_NAME, description="Unique name: 1-63 of A-Z a-z 0-9 . _ -, "
                                                       "not shaped like an id (vol-...).")
    size_mib: int = Field(ge=MIN_SIZE_MIB, le=MAX_SIZE_MIB, description="Size, MiB (16 MiB to 1 TiB); the "
                                                         "host holds only what is written.")


class ResizeVolume(RequestBody):
    """Body of ``PATCH /volumes/{id}``: grow it (offline: no sandbox may hold it)."""

    model_config = ConfigDict(extra="forbid")

    size_mib: int = Field(ge=MIN_SIZE_MIB, le=MAX_SIZE_MIB, description="New size, MiB; not smaller than now.")


class VolumeAttachment(Model):
    """A sandbox that holds a volume."""

    sandbox_id: str
    path: str = Field(description="Where the guest mounts it.")
    read_only: bool


class VolumeInfo(Model):
    """A named volume."""

    id: str
    name: str
    size_mib: int
    created_at: float
    updated_at: float
    attached: list[VolumeAttachment] = Field(
        default_factory=list, description="Sandboxes holding it now: one read-write, or any "
                                          "number read-only.")


class VolumeList(Model):
    volumes: list[VolumeInfo]


class VolumeFsck(Model):
    """What ``POST /volumes/{id}/fsck`` did: ``e2fsck -f -y`` on the volume's filesystem."""

    id: str
    name: str
    exit_code: int = Field(description="e2fsck's: 0 sound, 1 to 3 repaired (4 and up is a "
                                       "409 volume_corrupt instead).")
    repaired: bool = Field(description="Whether e2fsck changed anything.")
    output: str = Field(description="The last 4 KiB of e2fsck's output.")


class VolumeFileEntry(Model):
    """One entry of a folder of a volume."""

    name: str
    type: str = Field(description="file, dir, link or other.")
    size: int = Field(description="Bytes.")
    mode: int = Field(description="Permission bits.")
    uid: int
    gid: int


class VolumeFileList(Model):
    """``GET /volumes/{id}/files?path=`` of a folder (a file answers with its bytes)."""

    path: str
    entries: list[VolumeFileEntry]
    total: int = Field(description="Entries in the folder; at most 4096 are listed.")
