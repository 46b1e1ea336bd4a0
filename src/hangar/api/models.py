"""Request and response bodies of the REST API (pydantic).

These shapes are the public contract; ``/openapi.json`` is generated from
them. Sizes are MiB, durations seconds, byte counts bytes.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

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


class RequestBody(BaseModel):
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


class SetTimeout(RequestBody):
    """Body of ``POST /sandboxes/{id}/timeout``."""

    model_config = ConfigDict(extra="forbid")

    timeout: float = Field(ge=0, le=30 * 86400,
                           description="Seconds from now until the sandbox expires; 0: never.")


class Sandbox(BaseModel):
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
    error: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    desktop: str | None = None
    network: dict[str, object] | None = Field(None, description="Egress policy; null: no NIC.")


class SandboxList(BaseModel):
    sandboxes: list[Sandbox]


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
                                  description="Seconds; the whole process group is killed then.")
    max_output: int = Field(1 << 20, ge=0, le=3 << 19,
                            description="Bytes kept from the start of each stream; the last "
                                        "max_output/4 bytes are kept as the tail.")

    @field_validator("command")
    @classmethod
    def _command(cls, value: str) -> str:
        _no_nul("command", value)
        return value

    @field_validator("args")
    @classmethod
    def _args(cls, value: list[str] | None) -> list[str] | None:
        for i, arg in enumerate(value or ()):
            _no_nul(f"args[{i}]", arg)
            if _utf8_len(arg) > ARG_STRLEN_MAX:
                raise ValueError(f"args[{i}] is {_utf8_len(arg)} bytes; the guest kernel takes "
                                 f"at most {ARG_STRLEN_MAX} bytes in one argument "
                                 "(MAX_ARG_STRLEN): pass large data through stdin or a file")
        return value

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
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

    @field_validator("cwd")
    @classmethod
    def _cwd(cls, value: str | None) -> str | None:
        if value is not None:
            _no_nul("cwd", value)
            if _utf8_len(value) >= PATH_MAX:
                raise ValueError(f"cwd is longer than the guest's PATH_MAX ({PATH_MAX} bytes)")
        return value

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


class PathBody(RequestBody):
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
    image_id: str = Field("", description="The image build it restores onto, "
                                          "<image>-<digest>; gone: restores answer 409.")
    vcpus: int
    memory_mib: int
    disk_mib: int


class SnapshotList(BaseModel):
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
