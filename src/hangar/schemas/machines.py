"""Wire schemas of snapshots (restore, fork) and machines (long-lived sandboxes)."""

from __future__ import annotations

from pydantic import ConfigDict, Field, field_validator

from hangar.schemas.base import Model, RequestBody
from hangar.schemas.bounds import (
    DISK_MIB_MAX, DISK_MIB_MIN, MEMORY_MIB_MAX, MEMORY_MIB_MIN, METADATA_ENTRIES, TTL_MAX_S,
    VCPUS_MAX, VCPUS_MIN, check_metadata, check_network,
)


class Snapshot(Model):
    """A snapshot: memory, device state and disk of a sandbox at one moment."""

    id: str
    sandbox_id: str
    size_bytes: int = Field(description="Bytes on disk.")
    created_at: float = Field(description="Unix time, seconds.")
    image: str
    image_id: str = Field("", description="The image build it restores onto, "
                                          "<image>-<digest>; gone: restores answer 409.")
    vcpus: int
    memory_mib: int
    disk_mib: int
    team: str | None = Field(None, description="The team of the sandbox it was taken of "
                                               "(docs/security.md, teams); null: the operator's.")


class SnapshotList(Model):
    snapshots: list[Snapshot]


class RestoreRequest(RequestBody):
    model_config = ConfigDict(extra="forbid")

    snapshot_id: str = Field(min_length=1, max_length=64)


class ForkRequest(RequestBody):
    """Body of ``POST /snapshots/{id}/sandboxes`` (optional)."""

    model_config = ConfigDict(extra="forbid")

    timeout: float | None = Field(None, ge=0, le=TTL_MAX_S, description="Time to live, seconds.")
    metadata: dict[str, str] = Field(default_factory=dict, max_length=METADATA_ENTRIES)

    _metadata = field_validator("metadata")(classmethod(
        lambda cls, v: check_metadata(v)))


class MachineRequest(RequestBody):
    """Body of ``POST /machines/{user_id}`` (optional; used only when creating)."""

    model_config = ConfigDict(extra="forbid")

    idle_timeout: float | None = Field(None, gt=0, le=TTL_MAX_S,
                                       description="Idle seconds before the machine sleeps.")
    image: str | None = Field(None, pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")
    vcpus: int | None = Field(None, ge=VCPUS_MIN, le=VCPUS_MAX)
    memory_mib: int | None = Field(None, ge=MEMORY_MIB_MIN, le=MEMORY_MIB_MAX)
    disk_mib: int | None = Field(None, ge=DISK_MIB_MIN, le=DISK_MIB_MAX)
    network: str | dict[str, object] | None = Field(
        None, description="Egress policy, as for POST /sandboxes.")

    _network = field_validator("network")(classmethod(
        lambda cls, v: check_network(v)))


class MachineInfo(Model):
    """A user's persistent machine.

    ``state``: creating, active, unresponsive, snapshotting, sleeping, waking,
    restoring, stopping or failed;
    ``desired_state``: active or sleeping. Exec and files go to
    ``/sandboxes/{sandbox_id}/...`` (or ``/machines/{user_id}/exec``) and
    wake a sleeping machine first.
    """

    user_id: str
    sandbox_id: str
    state: str
    desired_state: str
    idle_timeout_s: float
    last_active_at: float = Field(description="Unix time, seconds.")
    created_at: float = Field(description="Unix time, seconds.")


class MachineList(Model):
    machines: list[MachineInfo]
