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

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


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


ARG_STRLEN_MAX = 131071
"""Bytes in one argument or ``NAME=value`` string, the guest kernel's MAX_ARG_STRLEN
(32 pages of 4 KiB, linux/binfmts.h) less the terminating NUL."""
ARGS_ENV_MAX = 1 << 20
"""Bytes of ``args`` plus ``env`` (strings, NULs and pointers): half of the 2 MiB
execve(2) allows with the default 8 MiB stack, leaving room for the base environment."""
PATH_MAX = 4096
"""Bytes in a path the guest kernel accepts (linux/limits.h)."""


def _show(value: str, n: int = 40) -> str:
    """``value`` for an error message: repr'd and cut to ``n`` characters."""
    return repr(value if len(value) <= n else value[:n] + "...")


def _no_nul(field: str, value: str) -> None:
    if "\0" in value:
        raise ValueError(f"{field} must not contain NUL bytes (\\0); the guest kernel cannot "
                         "pass them to a program")


def _utf8_len(value: str) -> int:
    return len(value.encode("utf-8", "surrogatepass"))


def lone_surrogate(value: object, where: str = "") -> str | None:
    """Where in a decoded JSON value a string holds a lone UTF-16 surrogate, or None.

    JSON's ``\\ud800`` escapes can carry them; no UTF-8 encoder (a guest's
    file system, argv, a pipe) accepts them.
    """
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where or "body"
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            key = str(k)
            found = lone_surrogate(key, where) or lone_surrogate(
                v, f"{where}.{key}" if where else key)
            if found:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = lone_surrogate(v, f"{where}[{i}]")
            if found:
                return found
    return None


class RequestBody(Model):
    """Base of every request body: refuses strings that are not valid Unicode."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: object) -> object:
        where = lone_surrogate(data)
        if where is not None:
            raise ValueError(f"{where} is not valid Unicode (it holds a lone UTF-16 surrogate)")
        return data


class CreateSandbox(RequestBody):
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


class SetTimeout(RequestBody):
    """Body of ``POST /sandboxes/{id}/timeout``."""

    model_config = ConfigDict(extra="forbid")

    timeout: float = Field(ge=0, le=30 * 86400,
                           description="Seconds from now until the sandbox expires; 0: never.")


class SandboxMemory(Model):
    """What a running sandbox's memory costs the host, beside what its guest uses; MiB.

    Host figures are the VMM process's (``/proc/PID/smaps_rollup``); guest
    figures come from the guest kernel's balloon driver every few seconds
    (null without a balloon, e.g. under Firecracker, or before its first report).
    """

    host_mib: float = Field(description="Proportional set size of the VMM: its private "
                                        "memory plus its share of pages other processes share "
                                        "(QEMU's code, the guest kernel's file).")
    host_rss_mib: float = Field(description="Resident set size of the VMM.")
    guest_total_mib: float | None = Field(None, description="Memory the guest kernel manages.")
    guest_used_mib: float | None = Field(None, description="Guest memory in use: used plus "
                                                           "buffers and cache (all but free).")
    guest_cache_mib: float | None = Field(None, description="Of which the guest's disk cache.")
    guest_stats_age_s: float | None = Field(None, description="Age of the guest figures, "
                                                              "seconds.")


class SandboxInfo(Model):
    """A sandbox as the API shows it."""

    id: str
    state: str
    image: str
    image_id: str = Field("", description="The image build it runs on and is pinned to, "
                                          "<image>-<digest>; a rebuild never changes it.")
    engine: str
    accel: str
    vcpus: int
    memory_mib: int
    disk_mib: int
    created_at: float = Field(description="Unix time, seconds.")
    expires_at: float | None = Field(None, description="Unix time, seconds; null: no TTL.")
    error: str | None = Field(None, description="Why it failed, or the last error of a "
                                                "background step (e.g. a sleep or wake).")
    metadata: dict[str, str] = Field(default_factory=dict)
    desktop: str | None = None
    network: dict[str, object] | None = Field(None, description="Egress policy; null: no NIC.")
    source: str | None = Field(None, description="Where its VM came from: cold (booted for "
                                                 "it), pool (the warm pool) or fork.")
    memory: SandboxMemory | None = Field(
        None, description="Host memory it costs and its guest's own use; only in "
                          "GET /sandboxes/{id}, and only while its VM runs.")


class SandboxList(Model):
    sandboxes: list[SandboxInfo]


def check_env(value: dict[str, str]) -> dict[str, str]:
    """An exec's or terminal's ``env``: names without ``=`` or NUL, each NAME=value
    within the guest kernel's limit for one string. Raises ValueError."""
    for name, val in value.items():
        if not name:
            raise ValueError("env has an empty variable name")
        if "=" in name:
            raise ValueError(f"env name {_show(name)} must not contain '='")
        _no_nul(f"env name {_show(name)}", name)
        _no_nul(f"env[{_show(name)}]", val)
        if _utf8_len(name) + 1 + _utf8_len(val) > ARG_STRLEN_MAX:
            raise ValueError(f"env[{_show(name)}] is over {ARG_STRLEN_MAX} bytes "
                             "(NAME=value), the guest kernel's limit for one variable "
                             "(MAX_ARG_STRLEN): pass large data through stdin or a file")
    return value


def check_args(value: list[str] | None) -> list[str] | None:
    """A command's arguments: no NUL byte, none over the guest kernel's ``MAX_ARG_STRLEN``.

    Raises ValueError naming the argument.
    """
    for i, arg in enumerate(value or ()):
        _no_nul(f"args[{i}]", arg)
        if _utf8_len(arg) > ARG_STRLEN_MAX:
            raise ValueError(f"args[{i}] is {_utf8_len(arg)} bytes; the guest kernel takes "
                             f"at most {ARG_STRLEN_MAX} bytes in one argument "
                             "(MAX_ARG_STRLEN): pass large data through stdin or a file")
    return value


def check_cwd(value: str | None) -> str | None:
    """A working directory: no NUL, shorter than the guest's PATH_MAX. Raises ValueError."""
    if value is not None:
        _no_nul("cwd", value)
        if _utf8_len(value) >= PATH_MAX:
            raise ValueError(f"cwd is longer than the guest's PATH_MAX ({PATH_MAX} bytes)")
    return value


class ExecRequest(RequestBody):
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
                                  description="Seconds; the whole process group is killed then. "
                                              "null means the maximum, 86400 (24 h). The call "
                                              "fails with 504 when the guest has not answered "
                                              "10 s after it.")
    max_output: int = Field(1 << 20, ge=0, le=3 << 19,
                            description="Bytes kept from the start of each stream; the last "
                                        "max_output/4 bytes are kept as the tail.")
    show_command: bool = Field(False, description="Put the command text in the live events "
                                                  "(exec.started); off by default.")

    @field_validator("command")
    @classmethod
    def _command(cls, value: str) -> str:
        _no_nul("command", value)
        return value

    @field_validator("args")
    @classmethod
    def _args(cls, value: list[str] | None) -> list[str] | None:
        return check_args(value)

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        return check_env(value)

    @field_validator("cwd")
    @classmethod
    def _cwd(cls, value: str | None) -> str | None:
        return check_cwd(value)

    @model_validator(mode="after")
    def _sizes(self) -> "ExecRequest":
        if self.args is not None and _utf8_len(self.command) >= PATH_MAX:
            raise ValueError(f"command (the program, with args) is longer than the guest's "
                             f"PATH_MAX ({PATH_MAX} bytes)")
        argv = [self.command, *self.args] if self.args is not None else []
        total = sum(_utf8_len(a) + 1 + 8 for a in argv) + sum(
            _utf8_len(k) + _utf8_len(v) + 2 + 8 for k, v in self.env.items())
        if total > ARGS_ENV_MAX:
            raise ValueError(f"args and env take {total} bytes; at most {ARGS_ENV_MAX} are "
                             "allowed (the guest kernel's execve limit is 2 MiB): pass large "
                             "data through stdin or a file")
        return self


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
    ``signal``, ``timed_out``, ``duration_s`` and the byte totals; or, when
    the call fails after the stream began (the guest stopped answering:
    ``timeout``; its connection was lost: ``guest_error``), one ``error``
    line with ``code`` and ``message``, and nothing after it.
    """

    type: Literal["stdout", "stderr", "exit", "error"]
    data: str | None = None
    data_b64: str | None = None
    exit_code: int | None = None
    signal: int | None = None
    timed_out: bool = False
    duration_s: float | None = None
    stdout_bytes: int | None = None
    stderr_bytes: int | None = None
    code: str | None = None
    message: str | None = None

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


class PathBody(RequestBody):
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
    image_id: str = Field("", description="The image build it restores onto, "
                                          "<image>-<digest>; gone: restores answer 409.")
    vcpus: int
    memory_mib: int
    disk_mib: int


class SnapshotList(Model):
    snapshots: list[Snapshot]


class RestoreRequest(RequestBody):
    model_config = ConfigDict(extra="forbid")

    snapshot_id: str = Field(min_length=1, max_length=64)


class ForkRequest(RequestBody):
    """Body of ``POST /snapshots/{id}/sandboxes`` (optional)."""

    model_config = ConfigDict(extra="forbid")

    timeout: float | None = Field(None, ge=0, le=30 * 86400, description="Time to live, seconds.")
    metadata: dict[str, str] = Field(default_factory=dict, max_length=64)


class MachineRequest(RequestBody):
    """Body of ``POST /machines/{user_id}`` (optional; used only when creating)."""

    model_config = ConfigDict(extra="forbid")

    idle_timeout: float | None = Field(None, gt=0, le=30 * 86400,
                                       description="Idle seconds before the machine sleeps.")
    image: str | None = Field(None, pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")
    vcpus: int | None = Field(None, ge=1, le=32)
    memory_mib: int | None = Field(None, ge=128, le=65536)
    disk_mib: int | None = Field(None, ge=512, le=1048576)
    network: str | dict[str, object] | None = Field(
        None, description="Egress policy, as for POST /sandboxes.")


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
    """``GET /pool``: the warm pool of paused VMs, booted ahead of creates."""

    size: int = Field(description="VMs the pool keeps ready (HANGAR_POOL_SIZE).")
    ready: int = Field(description="Paused VMs ready to be taken now.")
    starting: int = Field(description="VMs booting to refill the pool.")
    max_age_s: float = Field(description="A pool VM older than this is replaced, seconds.")
    oldest_age_s: float | None = Field(None, description="Age of the oldest ready VM, seconds.")
    image: str = Field(description="The server's default template.")
    templates: dict[str, int] = Field(default_factory=dict, description=(
        "VMs kept ready per template (HANGAR_POOL_SIZE of the default one, plus "
        "HANGAR_POOL_TEMPLATES)."))


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


# -- terminals (pty) ---------------------------------------------------------------------------

PTY_MAX_SIDE = 1000
"""Largest terminal side, in characters."""


class PtyRequest(RequestBody):
    """Body of ``POST /sandboxes/{id}/pty``: what to run on a new pseudo-terminal.

    Without ``command`` the guest's login shell runs (``/bin/bash -l``).
    ``command`` is a shell string (``/bin/sh -c``), or with ``args`` the
    program and its arguments, as for exec.
    """

    model_config = ConfigDict(extra="forbid")

    command: str | None = Field(None, min_length=1, max_length=1 << 16)
    args: list[str] | None = Field(None, max_length=4096)
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    cols: int = Field(80, ge=1, le=PTY_MAX_SIDE, description="Terminal width, characters.")
    rows: int = Field(24, ge=1, le=PTY_MAX_SIDE, description="Terminal height, characters.")
    grace: float = Field(60.0, ge=1, le=86400, description=(
        "Seconds the session lives without a viewer before it is hung up (SIGHUP, then "
        "SIGKILL); also how long an ended session waits for a viewer to collect its exit code."))

    @field_validator("command")
    @classmethod
    def _command(cls, value: str | None) -> str | None:
        if value is not None:
            _no_nul("command", value)
        return value

    @field_validator("args")
    @classmethod
    def _args(cls, value: list[str] | None) -> list[str] | None:
        return check_args(value)

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        return check_env(value)

    @field_validator("cwd")
    @classmethod
    def _cwd(cls, value: str | None) -> str | None:
        return check_cwd(value)

    @model_validator(mode="after")
    def _program(self) -> "PtyRequest":
        if self.args is not None and self.command is None:
            raise ValueError("args need a command (the program to run)")
        if self.args is not None and _utf8_len(self.command or "") >= PATH_MAX:
            raise ValueError(f"command (the program, with args) is longer than the guest's "
                             f"PATH_MAX ({PATH_MAX} bytes)")
        total = sum(_utf8_len(a) + 9 for a in [self.command or "", *(self.args or ())]) + sum(
            _utf8_len(k) + _utf8_len(v) + 10 for k, v in self.env.items())
        if total > ARGS_ENV_MAX:
            raise ValueError(f"args and env take {total} bytes; at most {ARGS_ENV_MAX} are "
                             "allowed (the guest kernel's execve limit is 2 MiB)")
        return self


class PtySession(Model):
    """A terminal session (``/sandboxes/{id}/pty/{session}``)."""

    id: str
    sandbox_id: str
    state: Literal["running", "exited"]
    kind: Literal["shell", "command"] = Field(description="A login shell, or a given command.")
    pid: int = Field(description="The program's process id in the guest.")
    cols: int
    rows: int
    created_at: float = Field(description="Unix time, seconds.")
    attached: bool = Field(description="A viewer is connected now.")
    output_bytes: int = Field(description="Output produced so far (the offset of the next byte).")
    grace: float = Field(description="Seconds it lives without a viewer.")
    exit_code: int | None = Field(None, description="Once exited: 128+N when killed by signal "
                                                    "N; null when the guest went away.")


class PtySessionList(Model):
    sessions: list[PtySession]


class PtyTicket(Model):
    """A single-use ticket (valid 30 s) to attach to a terminal session over its WebSocket."""

    ticket: str
    session_id: str
    expires_at: float = Field(description="Unix time, seconds.")
    expires_in_s: float
    url: str = Field(description="Path of the WebSocket, ticket included (single use); add "
                                 "&offset=N to resume after the N-th output byte.")


# -- file watching --------------------------------------------------------------------------------


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
# -- exposed ports ------------------------------------------------------------------------------


class ExposePort(RequestBody):
    """Body of ``POST /sandboxes/{id}/ports``: expose a guest TCP port over HTTP."""

    model_config = ConfigDict(extra="forbid")

    port: int = Field(ge=1, le=65535, strict=True,
                      description="TCP port the guest listens on (on any address, or 127.0.0.1).")
    public: bool = Field(False, strict=True, description=(
        "true: anyone with the URL reaches it. false (private): requests need X-API-Key or "
        "a signed URL's token."))
    token_ttl: float | None = Field(None, gt=0, le=30 * 86400, description=(
        "Lifetime of the signed URL in the answer, seconds (default "
        "HANGAR_PORT_TOKEN_TTL_S, 3600)."))


class PortInfo(Model):
    """An exposed port and where to reach it.

    ``url`` is the address to use: ``host_url`` when the server has a domain
    (``HANGAR_DOMAIN``), else ``path_url``. A private port needs the
    ``X-API-Key`` header there, or ``signed_url``, which carries a token
    (``hangar_token=``) valid until ``token_expires_at`` for this port only;
    a browser that opens it gets a cookie for the rest of its visit.
    """

    sandbox_id: str
    port: int
    public: bool
    url: str
    path_url: str = Field(description="http(s)://<server>/sandboxes/<id>/ports/<port>/; the "
                                      "app gets X-Forwarded-Prefix: /sandboxes/<id>/ports/<port>.")
    host_url: str | None = Field(None, description="http(s)://<port>-<id>.<domain>/ when the "
                                                   "server has a domain, else null.")
    signed_url: str | None = Field(None, description="``url`` with a token; private ports only.")
    token: str | None = Field(None, description="The token alone (query hangar_token=).")
    token_expires_at: float | None = Field(None, description="Unix time, seconds.")
    created_at: float = Field(description="Unix time, seconds.")


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


class PublishEvent(RequestBody):
    """Body of ``POST /events``: an event of an agent platform (kinds under ``agent.``)."""

    model_config = ConfigDict(extra="forbid")

    kind: str = Field(pattern=AGENT_KIND, max_length=100,
                      description="e.g. agent.task.started, agent.tool.finished.")
    sandbox_id: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    data: dict[str, Any] = Field(default_factory=dict, max_length=64,
                                 description=f"JSON fields, at most {MAX_EVENT_DATA} bytes.")


# -- processes that outlive their connection --------------------------------------------------

PROCESS_TAG_MAX = 256
"""Characters of a process's tag."""
PROCESS_INPUT_MAX = 1 << 20
"""Bytes of stdin one ``POST .../processes/{pid}/stdin`` carries."""
SIGNAL_NAMES = {"SIGHUP": 1, "SIGINT": 2, "SIGQUIT": 3, "SIGKILL": 9, "SIGUSR1": 10,
                "SIGUSR2": 12, "SIGTERM": 15, "SIGCONT": 18, "SIGSTOP": 19}
"""Signals a request may name (Linux numbers); any other is given by number."""


class ProcessPty(Model):
    """A terminal for a process, in characters."""

    model_config = ConfigDict(extra="forbid")

    cols: int = Field(80, ge=1, le=PTY_MAX_SIDE)
    rows: int = Field(24, ge=1, le=PTY_MAX_SIDE)


class ProcessStart(RequestBody):
    """Body of ``POST /sandboxes/{id}/processes``: a process that runs in the background.

    ``command`` is a shell string (``/bin/sh -c``), or with ``args`` the
    program and its arguments, as for exec. The process outlives the request
    and any client: list it, attach to its output, write to its stdin,
    signal or kill it by pid (or ``tag``). ``stdin`` gives it a pipe to
    write to (else it reads /dev/null); ``pty`` runs it on a terminal;
    ``timeout`` kills its process group after that many seconds (none: it
    runs until it ends or is killed).
    """

    model_config = ConfigDict(extra="forbid")

    command: str = Field(min_length=1, max_length=1 << 20)
    args: list[str] | None = Field(None, max_length=4096)
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    tag: str | None = Field(None, min_length=1, max_length=PROCESS_TAG_MAX,
                            description="A name of the caller's choosing; unique among "
                                        "running processes.")
    stdin: bool = Field(False, description="Give it a stdin pipe (fed by .../stdin).")
    pty: ProcessPty | None = Field(None, description="Run it on a terminal of this size.")
    timeout: float | None = Field(None, gt=0, le=86400,
                                  description="Seconds until its process group is killed.")

    @field_validator("command")
    @classmethod
    def _command(cls, value: str) -> str:
        _no_nul("command", value)
        return value

    @field_validator("tag")
    @classmethod
    def _tag(cls, value: str | None) -> str | None:
        if value is not None:
            _no_nul("tag", value)
        return value

    @field_validator("args")
    @classmethod
    def _args(cls, value: list[str] | None) -> list[str] | None:
        return check_args(value)

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        return check_env(value)

    @field_validator("cwd")
    @classmethod
    def _cwd(cls, value: str | None) -> str | None:
        return check_cwd(value)

    @model_validator(mode="after")
    def _sizes(self) -> "ProcessStart":
        if self.args is not None and _utf8_len(self.command) >= PATH_MAX:
            raise ValueError(f"command (the program, with args) is longer than the guest's "
                             f"PATH_MAX ({PATH_MAX} bytes)")
        argv = [self.command, *self.args] if self.args is not None else []
        total = sum(_utf8_len(a) + 9 for a in argv) + sum(
            _utf8_len(k) + _utf8_len(v) + 10 for k, v in self.env.items())
        if total > ARGS_ENV_MAX:
            raise ValueError(f"args and env take {total} bytes; at most {ARGS_ENV_MAX} are "
                             "allowed (the guest kernel's execve limit is 2 MiB)")
        return self


class ProcessInfo(Model):
    """A process of the sandbox's table (``GET /sandboxes/{id}/processes``).

    ``origin`` is ``start`` (started by ``POST .../processes``) or ``exec``:
    the output of a program an exec left running in the background (``cmd
    &``), kept here so it never writes to a closed pipe; its ``pid`` is the
    exec's shell. ``exit_code`` is 128+N when signal N ended it. Output is
    kept in a ring of 1 MiB per process: ``output_bytes`` counts all it
    wrote, ``output_dropped`` what the ring no longer holds. ``command``,
    ``args`` and ``env`` are cut to 4096 characters in all (``truncated``).
    """

    pid: int
    tag: str | None = None
    command: str
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str
    truncated: bool = False
    origin: Literal["start", "exec"] = "start"
    pty: bool = False
    cols: int | None = None
    rows: int | None = None
    state: Literal["running", "exited"]
    exit_code: int | None = None
    signal: int | None = None
    timed_out: bool = False
    started_at: float = Field(description="Unix time, seconds.")
    ended_at: float | None = Field(None, description="Unix time, seconds.")
    output_open: bool = Field(description="A process still holds its output open.")
    output_bytes: int
    output_dropped: int
    stdin_open: bool


class ProcessList(Model):
    processes: list[ProcessInfo]


class ProcessInput(RequestBody):
    """Body of ``POST /sandboxes/{id}/processes/{pid}/stdin``: bytes for its stdin (or its
    terminal), text in ``data`` or base64 in ``data_b64``; ``close`` then closes its stdin
    (it reads EOF; not for a terminal: send Ctrl-D, ``\\u0004``)."""

    model_config = ConfigDict(extra="forbid")

    data: str | None = Field(None, max_length=PROCESS_INPUT_MAX)
    data_b64: str | None = Field(None, max_length=(PROCESS_INPUT_MAX // 3 + 1) * 4)
    close: bool = False

    def payload(self) -> bytes:
        """The bytes to write. Raises ValueError for bad base64 or too many bytes."""
        if self.data_b64 is not None:
            try:
                raw = base64.b64decode(self.data_b64, validate=True)
            except ValueError:
                raise ValueError("data_b64 is not valid base64") from None
        else:
            raw = (self.data or "").encode()
        if len(raw) > PROCESS_INPUT_MAX:
            raise ValueError(f"at most {PROCESS_INPUT_MAX} bytes of input per call")
        return raw


class ProcessInputResult(Model):
    written: int = Field(description="Bytes written.")
    stdin_open: bool


class ProcessSignal(RequestBody):
    """Body of ``POST /sandboxes/{id}/processes/{pid}/signal``: a signal for its process
    group, by number (1..64) or name (``SIGTERM``, ``TERM``, ``SIGKILL``...)."""

    model_config = ConfigDict(extra="forbid")

    signal: int | str = Field(description="1..64, or a name such as SIGTERM.")

    @field_validator("signal")
    @classmethod
    def _signal(cls, value: int | str) -> int:
        if isinstance(value, str):
            name = value.upper()
            num = SIGNAL_NAMES.get(name) or SIGNAL_NAMES.get("SIG" + name)
            if num is None:
                raise ValueError(f"unknown signal {_show(value)}; give its number (1..64) or "
                                 f"one of {', '.join(SIGNAL_NAMES)}")
            return num
        if not 0 < value < 65:
            raise ValueError("signal must be from 1 to 64")
        return value


class ProcessSignalResult(Model):
    delivered: bool = Field(description="False when no process of its group was left.")
    state: Literal["running", "exited"]
    exit_code: int | None = None
    signal: int | None = None


class ProcessResize(RequestBody):
    """Body of ``POST /sandboxes/{id}/processes/{pid}/resize``: a terminal's new size."""

    model_config = ConfigDict(extra="forbid")

    cols: int = Field(ge=1, le=PTY_MAX_SIDE)
    rows: int = Field(ge=1, le=PTY_MAX_SIDE)


class ProcessEvent(Model):
    """One line of ``GET /sandboxes/{id}/processes/{pid}`` (NDJSON, or SSE ``data:``).

    ``attached`` first (``process``: the entry then); then ``stdout``,
    ``stderr`` or ``pty`` with ``data`` (or ``data_b64`` when the chunk is
    not UTF-8): ``replay`` marks output written before the attach (asked
    with ``replay=true``), ``dropped`` bytes this client lost before it
    (it read too slowly; 1 MiB waits for it at most); ``keepalive`` every
    15 s of quiet; then ``end`` with the final ``process`` and the total
    ``dropped``, or ``error`` (``code``, ``message``) when the stream broke.
    """

    type: Literal["attached", "stdout", "stderr", "pty", "keepalive", "end", "error"]
    data: str | None = None
    data_b64: str | None = None
    replay: bool = False
    dropped: int = 0
    process: ProcessInfo | None = None
    code: str | None = None
    message: str | None = None

    @property
    def payload(self) -> bytes:
        """The output chunk's exact bytes (empty for other events)."""
        if self.data_b64 is not None:
            return base64.b64decode(self.data_b64)
        return (self.data or "").encode()
