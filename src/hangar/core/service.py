"""Core's face: the one module of ``hangar.core`` that api and cluster import.

The sandbox service is ``SandboxService`` (the ``SandboxManager`` of
``hangar.core.sandboxes``, which wires the parts). Outside core it is used
only through:

* its verbs and attributes named in ``SandboxService.PUBLIC``: create, get,
  list, delete, snapshot, fork, sleep, wake, exec, tunnel...;
* its named sub-surfaces (``SandboxService.SURFACES``), each a small typed
  object whose public methods are the verbs:

  ==============  =============================================================
  ``files``       a sandbox's files: read, write, list, stat, mkdir, remove, watch
  ``ports``       exposed guest ports and their signed tokens (``core.ports``)
  ``processes``   background processes (``core.processes``)
  ``terminals``   terminal sessions (``core.terminals``)
  ``desktop``     computer use and VNC (``core.desktop``)
  ``volumes``     named volumes, as ``VolumeView`` (``core.surfaces``)
  ``secrets``     the vault, as ``SecretView`` (``core.surfaces``)
  ``network``     running sandboxes' egress rules (``core.surfaces``)
  ``code``        the code interpreter (``core.surfaces``)
  ``builds``      template builds in build sandboxes (``core.builds``)
  ``pulls``       a registry's images pulled as images, for builds (``core.pulls``)
  ``teams``       teams, their quotas and use; who sees which sandbox (``core.teams``)
  ==============  =============================================================

* the frozen views it answers with instead of the store's rows
  (``hangar.core.views``: ``SandboxView``, ``SnapshotView``, ``VolumeView``,
  ``SecretView``; ``MachineView`` here), and the public types below.

``m.ports.expose(...)`` is the sanctioned form; reaching the parts behind
the face (``m.launcher``, ``m.calls``, ``m.store``, ``m.registry``...) is
not. ``tests/test_layers.py`` checks the imports, that no row class is
named, and every attribute chain from the service in api and cluster.

``e2b`` is E2B's dialect of core (tokens, template names, options, metrics) and
``e2b_user`` its default user, exported as named parts until they move beside E2B's
routes.
"""

from __future__ import annotations

from hangar.config import Settings
from hangar.core import e2b, e2b_user
from hangar.core.admission import CreateOptions, new_id
from hangar.core.build_steps import Copy, Env, Run, Step, User, Workdir
from hangar.core.build_steps import State as BuildState
from hangar.core.pulls import Credentials, ImagePulls
from hangar.core.acting import act_as, acting, acting_for
from hangar.core.teams import (
    Teams, TeamView, Usage, name_visible, quota_refusal,
    removal_refusal, scoped, unscoped,
)
from hangar.core.build_uploads import UPLOAD_MAX
from hangar.core.builds import Builds, BuildSpec, BuildView, BuiltSource, LogLine
from hangar.core.commands import (
    HOME, Command, ExecResult, FileEntry, FileEvent, FileList, StreamCapture, Tunnel, WriteResult,
)
from hangar.core.desktop import MAX_SCROLL, MAX_TYPE_CHARS, TYPE_DELAY_MS, VNC_PORT, Desktop
from hangar.core.events import Event, EventBus
from hangar.core.guestcalls import NoListener
from hangar.core.handover import (
    PLACEMENT_SCOPE, Adoptee, Placement, SharedSnapshot, Template, describe,
)
from hangar.core.hooks import Hooks
from hangar.core.idempotency import (
    MAX_KEY_LEN, IdempotencyStore, owner_of, request_hash, seal, seal_key, unseal,
)
from hangar.core.interpreter import MAX_CODE_CHARS
from hangar.core.lifecycle import (
    GONE, LIVE, VMM_STATES, Face, Guard, IllegalTransition, OnExpiry, State, check,
    check_desired, from_public, public_name, walk,
)
from hangar.core.memory import Memory, MemoryView
from hangar.core.machines import NAMES, USER_ID, Machine, MachineManager, desired_name
from hangar.core.ports import Exposure, Ports
from hangar.core.processes import ProcessInfo, ProcessOutput, Processes
from hangar.core.sandboxes import SandboxManager
from hangar.core.sleep import Connect, Connected
from hangar.core.starts import StartsView, leave_when
from hangar.core.surfaces import CodeFace, FilesFace, NetworkFace, SecretsFace, VolumesFace
from hangar.core.tasks import Tasks, every, race
from hangar.core.terminals import Terminal, Terminals
from hangar.core.views import (
    AttachmentView, SandboxView, SecretView, SnapshotView, VolumeView, sandbox_view,
    user_metadata,
)

SandboxService = SandboxManager
"""The sandbox service: one per server (``hangar.core.sandboxes.SandboxManager``)."""

MachineView = Machine
"""A user's machine as core shows it (frozen; ``hangar.core.machines.Machine``)."""

SURFACE_TYPES: dict[str, type] = {
    "files": FilesFace, "ports": Ports, "processes": Processes, "terminals": Terminals, "desktop": Desktop,
    "volumes": VolumesFace, "secrets": SecretsFace, "network": NetworkFace, "code": CodeFace,
    "builds": Builds, "pulls": ImagePulls, "teams": Teams, "host_memory": Memory,
    "settings": Settings, "events": EventBus,
}
"""The type of each sub-surface of ``SandboxService.SURFACES``: outside core, ``m.<name>``
is used only for these types' public names."""

MachineService = MachineManager
"""Users' machines that sleep when idle and wake on demand (``hangar.core.machines``)."""

__all__ = [
    # the services and their sub-surfaces
    "SandboxService", "SandboxManager", "MachineService", "MachineManager", "CodeFace",
    "FilesFace", "NetworkFace", "SecretsFace", "VolumesFace", "Desktop", "Builds",
    "ImagePulls", "Credentials", "Teams", "TeamView", "Usage", "Memory", "MemoryView",
    "acting", "acting_for", "act_as",
    "scoped", "unscoped", "name_visible", "quota_refusal", "removal_refusal",
    "SURFACE_TYPES", "e2b",
    "e2b_user",
    # views
    "AttachmentView", "MachineView", "SandboxView", "SecretView", "SnapshotView",
    "VolumeView", "sandbox_view", "user_metadata",
    # requests and results
    "CreateOptions", "Placement", "PLACEMENT_SCOPE", "Command", "ExecResult",
    "StreamCapture", "FileEntry", "FileEvent", "FileList", "WriteResult", "HOME", "Tunnel", "NoListener", "Exposure",
    "ProcessInfo", "ProcessOutput", "Terminal", "MAX_CODE_CHARS", "MAX_SCROLL",
    "StartsView", "leave_when",
    "MAX_TYPE_CHARS", "TYPE_DELAY_MS", "VNC_PORT",
    # template builds
    "UPLOAD_MAX", "BuildSpec", "BuildView", "BuiltSource", "LogLine", "Step", "Copy", "Run",
    "Env", "Workdir", "User", "BuildState",
    # states and their table
    "State", "GONE", "LIVE", "VMM_STATES", "Guard", "IllegalTransition", "check",
    "check_desired", "walk", "NAMES", "USER_ID", "new_id", "Face", "OnExpiry",
    "public_name", "from_public", "desired_name", "Connect", "Connected",
    # a cluster's part
    "Adoptee", "Hooks", "SharedSnapshot", "Template", "describe",
    # events, background tasks, idempotent requests
    "Event", "EventBus", "Tasks", "every", "race", "MAX_KEY_LEN", "IdempotencyStore",
    "owner_of", "request_hash", "seal", "seal_key", "unseal",
]
