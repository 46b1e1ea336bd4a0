"""Wire schemas of the REST API (pydantic only), shared by the server and the SDK.

These shapes are the public contract: the server (``hangar.api``) validates
requests and renders responses with them, ``/openapi.json`` is generated
from them, and the SDK (``hangar.client``) parses its results into them.
This package imports pydantic and nothing of FastAPI, SQLAlchemy or the
core, so ``pip install hangar`` (the SDK and CLI alone) can use it.

Sizes are MiB, durations seconds, times Unix seconds, byte counts bytes,
coordinates pixels.

Models tolerate fields they do not know when parsing a response
(``extra="ignore"``, pydantic's default), so an older SDK keeps working
against a newer server; request bodies forbid them (``extra="forbid"``).
"""

from __future__ import annotations

# One module per area; this package re-exports their names, so
# ``from hangar.schemas import X`` keeps working.

from hangar.schemas.base import (
    ARGS_ENV_MAX, ARG_STRLEN_MAX, Error, Model, PATH_MAX, RequestBody, _no_nul, _show, _utf8_len,
    check_args, check_cwd, check_env, lone_surrogate,
)
from hangar.schemas.desktop import (
    ActionResult, DisplayInfo, KeyResult, ScreenshotResponse, VncTicket,
)
from hangar.schemas.events import AGENT_KIND, Event, MAX_EVENT_DATA, PublishEvent
from hangar.schemas.exec import ExecRequest, ExecResult, ExecStreamEvent
from hangar.schemas.files import FileEntry, FileEvent, FileList, PathBody, WriteResult
from hangar.schemas.machines import (
    ForkRequest, MachineInfo, MachineList, MachineRequest, RestoreRequest, Snapshot, SnapshotList,
)
from hangar.schemas.network import NetworkRules, NetworkRulesUpdate
from hangar.schemas.ports import ExposePort, PortInfo
from hangar.schemas.processes import (
    PROCESS_INPUT_MAX, PROCESS_TAG_MAX, ProcessEvent, ProcessInfo, ProcessInput,
    ProcessInputResult, ProcessList, ProcessPty, ProcessResize, ProcessSignal, ProcessSignalResult,
    ProcessStart, SIGNAL_NAMES,
)
from hangar.schemas.pty import PTY_MAX_SIDE, PtyRequest, PtySession, PtySessionList, PtyTicket
from hangar.schemas.volumes import (
    CreateVolume, MountedVolume, ResizeVolume, VolumeAttachment, VolumeFileEntry, VolumeFileList, VolumeInfo,
    VolumeFsck, VolumeList, VolumeMount,
)
from hangar.schemas.secrets import CreateSecret, RotateSecret, SecretInfo, SecretList
from hangar.schemas.teams import (
    CreateTeam, LIMIT_NAMES, TeamInfo, TeamLimits, TeamList, TeamUsage, UpdateTeam,
)
from hangar.schemas.sandboxes import (
    Capacity, CreateSandbox, Health, MemoryStatus, PoolStatus, StartsStatus, SandboxInfo, SandboxList, SandboxMemory, SetTimeout,
)

__all__ = [
    "CreateSecret", "RotateSecret", "SecretInfo", "SecretList",
    "CreateTeam", "LIMIT_NAMES", "TeamInfo", "TeamLimits", "TeamList", "TeamUsage", "UpdateTeam",
    "NetworkRules", "NetworkRulesUpdate",
    "CreateVolume", "MountedVolume", "ResizeVolume", "VolumeAttachment", "VolumeFileEntry", "VolumeFileList",
    "VolumeFsck", "VolumeInfo", "VolumeList", "VolumeMount",
    "AGENT_KIND",
    "ARGS_ENV_MAX",
    "ARG_STRLEN_MAX",
    "ActionResult",
    "CreateSandbox",
    "DisplayInfo",
    "Error",
    "Event",
    "ExecRequest",
    "ExecResult",
    "ExecStreamEvent",
    "ExposePort",
    "FileEntry",
    "FileEvent",
    "FileList",
    "ForkRequest",
    "Health",
    "KeyResult",
    "MAX_EVENT_DATA",
    "MachineInfo",
    "MachineList",
    "MachineRequest",
    "Model",
    "PATH_MAX",
    "PROCESS_INPUT_MAX",
    "PROCESS_TAG_MAX",
    "PTY_MAX_SIDE",
    "PathBody",
    "PoolStatus", "Capacity", "MemoryStatus", "StartsStatus",
    "PortInfo",
    "ProcessEvent",
    "ProcessInfo",
    "ProcessInput",
    "ProcessInputResult",
    "ProcessList",
    "ProcessPty",
    "ProcessResize",
    "ProcessSignal",
    "ProcessSignalResult",
    "ProcessStart",
    "PtyRequest",
    "PtySession",
    "PtySessionList",
    "PtyTicket",
    "PublishEvent",
    "RequestBody",
    "RestoreRequest",
    "SIGNAL_NAMES",
    "SandboxInfo",
    "SandboxList",
    "SandboxMemory",
    "ScreenshotResponse",
    "SetTimeout",
    "Snapshot",
    "SnapshotList",
    "VncTicket",
    "WriteResult",
    "check_args",
    "check_cwd",
    "check_env",
    "lone_surrogate",
]
