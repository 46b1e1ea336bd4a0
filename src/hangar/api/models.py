"""Request and response bodies of the REST API.

The schemas live in ``hangar.schemas`` (pydantic only), which the SDK
shares; this module keeps the names the routes use.
"""

from __future__ import annotations

from hangar.schemas import (
    ARG_STRLEN_MAX, ARGS_ENV_MAX, PATH_MAX, RequestBody, lone_surrogate,
    ActionResult, CreateSandbox, DisplayInfo, Error, Event, ExecRequest, ExecResult,
    ExecStreamEvent, FileEntry, FileList, ForkRequest, Health, KeyResult, MachineInfo,
    MachineList, MachineRequest, PathBody, PoolStatus, PublishEvent, RestoreRequest, SandboxInfo,
    SandboxList, ScreenshotResponse, SetTimeout, Snapshot, SnapshotList, VncTicket, WriteResult,
)

Sandbox = SandboxInfo
Machine = MachineInfo
ExecResponse = ExecResult

__all__ = [
    "ARG_STRLEN_MAX", "ARGS_ENV_MAX", "PATH_MAX", "RequestBody", "lone_surrogate",
    "ActionResult", "CreateSandbox", "DisplayInfo", "Error", "Event", "ExecRequest", "ExecResponse",
    "ExecResult", "ExecStreamEvent", "FileEntry", "FileList", "ForkRequest", "Health", "KeyResult",
    "Machine", "MachineInfo", "MachineList", "MachineRequest", "PathBody", "PoolStatus",
    "PublishEvent", "RestoreRequest", "Sandbox", "SandboxInfo", "SandboxList",
    "ScreenshotResponse", "SetTimeout", "Snapshot", "SnapshotList", "VncTicket", "WriteResult",
]
