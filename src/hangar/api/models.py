"""Request and response bodies of the REST API (pydantic).

These shapes are the public contract; ``/openapi.json`` is generated from
them. Sizes are MiB, durations seconds, byte counts bytes.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class CreateSandbox(BaseModel):
    """Body of ``POST /sandboxes``; every field is optional."""

    model_config = ConfigDict(extra="forbid")

    image: str | None = Field(None, description="Template (image recipe) name; default 'base'.",
                              pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")
    vcpus: int | None = Field(None, ge=1, le=32)
    memory_mib: int | None = Field(None, ge=128, le=65536,
                                   description="Guest memory, MiB; default: the image's (desktop "
                                               "and dev: 2048), else the server's (512).")
    disk_mib: int | None = Field(None, ge=512, le=1048576, description="Writable disk, MiB.")
    timeout: float | None = Field(None, ge=0, le=30 * 86400,
                                  description="Time to live in seconds; 0 keeps it until deleted; "
                                              "default: the server's (one hour).")
    metadata: dict[str, str] = Field(default_factory=dict, max_length=64)
    network: str | dict[str, object] | None = Field(
        None, description="Egress policy: 'none', 'internet' (public addresses only), 'open', "
                          "or {'egress': ..., 'allow': [CIDR...], 'deny': [CIDR...]} where the "
                          "most specific entry wins. Default: 'internet' with TAP networking.")
    desktop: str | None = Field(
        None, pattern=r"^[1-9][0-9]{2,4}x[1-9][0-9]{2,4}x(16|24)$",
        description="Start a desktop of WIDTHxHEIGHTxDEPTH (pixels, bits), e.g. 1280x800x24; "
                    "needs an image with one (the 'desktop' recipe).")


class SetTimeout(BaseModel):
    """Body of ``POST /sandboxes/{id}/timeout``."""

    model_config = ConfigDict(extra="forbid")

    timeout: float = Field(ge=0, le=30 * 86400,
                           description="Seconds from now until the sandbox expires; 0: never.")


class Sandbox(BaseModel):
    """A sandbox as the API shows it."""

    id: str
    state: str
    image: str
    engine: str
    accel: str
    vcpus: int
    memory_mib: int
    disk_mib: int
    created_at: float = Field(description="Unix time, seconds.")
    expires_at: float | None = Field(None, description="Unix time, seconds; null: no TTL.")
    error: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    desktop: str | None = None
    network: dict[str, object] | None = Field(None, description="Egress policy; null: no NIC.")
    source: Literal["cold", "pool"] | None = Field(
        None, description="Only in the answer to a create: 'pool' when a warm-pool VM was "
                          "taken, 'cold' when one was booted.")


class SandboxList(BaseModel):
    sandboxes: list[Sandbox]


class ExecRequest(BaseModel):
    """Body of ``POST /sandboxes/{id}/exec``.

    ``command`` is a shell string run by ``/bin/sh -c``; when ``args`` is
    given, ``command`` is instead the program and ``args`` its arguments,
    with no shell involved.
    """

    model_config = ConfigDict(extra="forbid")

    command: str = Field(min_length=1, max_length=1 << 20)
    args: list[str] | None = None
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    stdin: str | None = Field(None, description="Text fed to stdin; none means EOF at once.")
    stdin_b64: str | None = Field(None, description="Bytes fed to stdin, base64.")
    timeout: float | None = Field(60.0, gt=0, le=86400,
                                  description="Seconds; the whole process group is killed then.")
    max_output: int = Field(1 << 20, ge=0, le=3 << 19,
                            description="Bytes kept from the start of each stream; the last "
                                        "max_output/4 bytes are kept as the tail.")


class ExecResponse(BaseModel):
    """Result of a command.

    ``stdout``/``stderr`` are UTF-8 text (invalid bytes become U+FFFD; the
    exact bytes are then in ``stdout_b64``/``stderr_b64``). When a stream
    is larger than the kept bytes, ``*_truncated`` is true, ``stdout`` holds
    the head, ``stdout_tail`` the last bytes, and ``*_bytes`` the total.
    ``exit_code`` is 128+N when the process died of signal N.
    """

    stdout: str
    stderr: str
    exit_code: int | None
    signal: int | None = None
    timed_out: bool = False
    duration_s: float
    stdout_bytes: int
    stderr_bytes: int
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    stdout_tail: str = ""
    stderr_tail: str = ""
    stdout_b64: str | None = None
    stderr_b64: str | None = None


class FileEntry(BaseModel):
    name: str
    path: str
    type: Literal["file", "dir", "symlink", "other"]
    size: int = Field(description="Bytes.")
    mode: int
    mtime: float = Field(description="Unix time, seconds.")


class FileList(BaseModel):
    path: str
    entries: list[FileEntry]


class WriteResult(BaseModel):
    path: str
    size: int = Field(description="Bytes written.")


class PathBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str = Field(min_length=1, max_length=4096)
    parents: bool = True
    recursive: bool = False


class Snapshot(BaseModel):
    """A snapshot: memory, device state and disk of a sandbox at one moment."""

    id: str
    sandbox_id: str
    size_bytes: int = Field(description="Bytes on disk.")
    created_at: float = Field(description="Unix time, seconds.")
    image: str
    vcpus: int
    memory_mib: int
    disk_mib: int


class SnapshotList(BaseModel):
    snapshots: list[Snapshot]


class RestoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    snapshot_id: str = Field(min_length=1, max_length=64)


class ForkRequest(BaseModel):
    """Body of ``POST /snapshots/{id}/sandboxes`` (optional)."""

    model_config = ConfigDict(extra="forbid")

    timeout: float | None = Field(None, ge=0, le=30 * 86400, description="Time to live, seconds.")
    metadata: dict[str, str] = Field(default_factory=dict, max_length=64)


class MachineRequest(BaseModel):
    """Body of ``POST /machines/{user_id}`` (optional; used only when creating)."""

    model_config = ConfigDict(extra="forbid")

    idle_timeout: float | None = Field(None, gt=0, le=30 * 86400,
                                       description="Idle seconds before the machine sleeps.")
    image: str | None = Field(None, pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")
    vcpus: int | None = Field(None, ge=1, le=32)
    memory_mib: int | None = Field(None, ge=128, le=65536)
    disk_mib: int | None = Field(None, ge=512, le=1048576)


class Machine(BaseModel):
    """A user's persistent machine.

    ``state``: creating, active, snapshotting, sleeping, waking or failed;
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


class Error(BaseModel):
    """Every error response: ``{"error": {"code", "message", ...context}}``."""

    error: dict[str, object]


class MachineList(BaseModel):
    machines: list[Machine]


class Health(BaseModel):
    status: Literal["ok"]
    version: str
    engine: dict[str, str]
    sandboxes: int = Field(description="Sandboxes that exist (warm-pool VMs not counted).")
