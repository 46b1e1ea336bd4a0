"""Wire schemas of the REST API (pydantic only), shared by the server and the SDK.

These shapes are the public contract: the server (``hangar.api``) validates
requests and renders responses with them, ``/openapi.json`` is generated
from them, and the SDK (``hangar.client``) parses its results into them.
This module imports pydantic and nothing of FastAPI, SQLAlchemy or the
core, so ``pip install hangar`` (the SDK and CLI alone) can use it.

Sizes are MiB, durations seconds, times Unix seconds, byte counts bytes,
coordinates pixels.

Models tolerate fields they do not know when parsing a response
(``extra="ignore"``, pydantic's default), so an older SDK keeps working
against a newer server; request bodies forbid them (``extra="forbid"``).
"""

from __future__ import annotations

import base64
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class Model(BaseModel):
    """Base of every wire schema.

    Fields are attributes (``result.exit_code``). Reading them by name
    (``result["exit_code"]``, ``result.get("signal")``, ``"data" in chunk``) also works, as the
    dict results of the 0.1 SDK did, so code written against those keeps
    running; new code should use attributes, which type checkers follow.
    """

    def __getitem__(self, name: str) -> Any:
        if name not in type(self).model_fields:
            raise KeyError(name)
        return getattr(self, name)

    def __contains__(self, name: object) -> bool:
        """True when the model has the field ``name`` and it is set (not None)."""
        return isinstance(name, str) and name in type(self).model_fields \
            and getattr(self, name) is not None

    def get(self, name: str, default: Any = None) -> Any:
        """The field ``name``, or ``default`` when the model has no such field."""
        return getattr(self, name, default) if name in type(self).model_fields else default


class CreateSandbox(Model):
    """Body of ``POST /sandboxes``; every field is optional."""

    model_config = ConfigDict(extra="forbid")

    image: str | None = Field(None, description="Template (image recipe) name; default 'base'.",
                              pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")
    vcpus: int | None = Field(None, ge=1, le=32)
    memory_mib: int | None = Field(None, ge=128, le=65536, description="Guest memory, MiB.")
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


class SetTimeout(Model):
    """Body of ``POST /sandboxes/{id}/timeout``."""

    model_config = ConfigDict(extra="forbid")

    timeout: float = Field(ge=0, le=30 * 86400,
                           description="Seconds from now until the sandbox expires; 0: never.")


class SandboxInfo(Model):
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


class SandboxList(Model):
    sandboxes: list[SandboxInfo]


class ExecRequest(Model):
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
    show_command: bool = Field(False, description="Put the command text in the live events "
                                                  "(exec.started); off by default.")


class ExecResult(Model):
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

    @property
    def ok(self) -> bool:
        """True when the command exited 0 and did not time out."""
        return self.exit_code == 0 and not self.timed_out


class ExecStreamEvent(Model):
    """One line of ``POST /sandboxes/{id}/exec/stream`` (NDJSON).

    ``type`` is ``stdout`` or ``stderr`` (with ``data``, or ``data_b64``
    when the bytes are not UTF-8), then one ``exit`` with ``exit_code``,
    ``signal``, ``timed_out``, ``duration_s`` and the byte totals.
    """

    type: Literal["stdout", "stderr", "exit"]
    data: str | None = None
    data_b64: str | None = None
    exit_code: int | None = None
    signal: int | None = None
    timed_out: bool = False
    duration_s: float | None = None
    stdout_bytes: int | None = None
    stderr_bytes: int | None = None

    @property
    def payload(self) -> bytes:
        """The output chunk's exact bytes (empty for ``exit``)."""
        if self.data_b64 is not None:
            return base64.b64decode(self.data_b64)
        return (self.data or "").encode()


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


class PathBody(Model):
    model_config = ConfigDict(extra="forbid")

    path: str = Field(min_length=1, max_length=4096)
    parents: bool = True
    recursive: bool = False


class Snapshot(Model):
    """A snapshot: memory, device state and disk of a sandbox at one moment."""

    id: str
    sandbox_id: str
    size_bytes: int = Field(description="Bytes on disk.")
    created_at: float = Field(description="Unix time, seconds.")
    image: str
    vcpus: int
    memory_mib: int
    disk_mib: int


class SnapshotList(Model):
    snapshots: list[Snapshot]


class RestoreRequest(Model):
    model_config = ConfigDict(extra="forbid")

    snapshot_id: str = Field(min_length=1, max_length=64)


class ForkRequest(Model):
    """Body of ``POST /snapshots/{id}/sandboxes`` (optional)."""

    model_config = ConfigDict(extra="forbid")

    timeout: float | None = Field(None, ge=0, le=30 * 86400, description="Time to live, seconds.")
    metadata: dict[str, str] = Field(default_factory=dict, max_length=64)


class MachineRequest(Model):
    """Body of ``POST /machines/{user_id}`` (optional; used only when creating)."""

    model_config = ConfigDict(extra="forbid")

    idle_timeout: float | None = Field(None, gt=0, le=30 * 86400,
                                       description="Idle seconds before the machine sleeps.")
    image: str | None = Field(None, pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")
    vcpus: int | None = Field(None, ge=1, le=32)
    memory_mib: int | None = Field(None, ge=128, le=65536)
    disk_mib: int | None = Field(None, ge=512, le=1048576)


class MachineInfo(Model):
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


class Error(Model):
    """Every error response: ``{"error": {"code", "message", ...context}}``."""

    error: dict[str, object]


class MachineList(Model):
    machines: list[MachineInfo]


class Health(Model):
    status: Literal["ok"]
    version: str
    engine: dict[str, str]
    sandboxes: int = Field(description="Sandboxes that exist (warm-pool VMs not counted).")


class PoolStatus(Model):
    """``GET /pool``: the warm pool of paused VMs of the default template."""

    size: int = Field(description="VMs the pool keeps ready (HANGAR_POOL_SIZE).")
    ready: int = Field(description="Paused VMs ready to be taken now.")
    starting: int = Field(description="VMs booting to refill the pool.")
    max_age_s: float = Field(description="A pool VM older than this is replaced, seconds.")
    oldest_age_s: float | None = Field(None, description="Age of the oldest ready VM, seconds.")
    image: str = Field(description="The template the pool boots.")


# -- desktop (pixels) ---------------------------------------------------------------------------


class ScreenshotResponse(Model):
    """A PNG screenshot, base64; ``width``/``height`` are the image's pixels."""

    format: Literal["png"] = "png"
    image: str = Field(description="The PNG, base64.")
    width: int
    height: int
    screen_width: int
    screen_height: int
    duration_s: float


class ActionResult(Model):
    """The answer to a pointer or keyboard action."""

    ok: Literal[True] = True


class KeyResult(ActionResult):
    keys: list[str] = Field(description="The combinations as sent to X, aliases resolved.")


class DisplayInfo(Model):
    """``GET /sandboxes/{id}/display``: the screen and the pointer."""

    width: int = Field(description="Pixels.")
    height: int = Field(description="Pixels.")
    depth: int = Field(description="Bits per pixel.")
    cursor_x: int
    cursor_y: int
    vnc: bool = Field(description="x11vnc listens: live viewing can connect.")


class VncTicket(Model):
    """A single-use ticket for the live desktop WebSocket."""

    ticket: str
    view_only: bool
    expires_at: float = Field(description="Unix time, seconds.")
    expires_in_s: float
    url: str = Field(description="Path of the WebSocket, ticket included (single use).")


# -- live events --------------------------------------------------------------------------------

AGENT_KIND = r"^agent(\.[a-z0-9_]{1,32}){1,4}$"
"""Kinds a client may publish: ``agent.`` and up to four dotted lower-case words."""
MAX_EVENT_DATA = 16 * 1024
"""Bytes of JSON a published event's ``data`` may hold."""


class Event(Model):
    """One live event of ``GET /events`` (its SSE ``data:`` line).

    ``id`` is opaque (``<stream>:<n>``): pass the last one seen back as
    ``Last-Event-ID`` to get what was missed. ``kind`` is one of those
    listed in ``hangar.core.events`` (``sandbox.created``,
    ``exec.finished``, ``agent.tool.started``...); ``data`` holds its
    fields (never command output, environment, file contents or secrets).
    """

    id: str
    time: float = Field(description="Unix time, seconds.")
    kind: str
    sandbox_id: str | None = None
    data: dict[str, Any] = Field(default_factory=dict)


class PublishEvent(Model):
    """Body of ``POST /events``: an event of an agent platform (kinds under ``agent.``)."""

    model_config = ConfigDict(extra="forbid")

    kind: str = Field(pattern=AGENT_KIND, max_length=100,
                      description="e.g. agent.task.started, agent.tool.finished.")
    sandbox_id: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    data: dict[str, Any] = Field(default_factory=dict, max_length=64,
                                 description=f"JSON fields, at most {MAX_EVENT_DATA} bytes.")
