"""Shared base of the wire schemas: ``Model``, ``RequestBody``, ``Error`` and the bounds.

The bounds are the guest kernel's on arguments, environment and paths; ``check_args``,
``check_env`` and ``check_cwd`` apply them for every body that runs a command.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, field_validator, model_validator


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


class Error(Model):
    """Every error response: ``{"error": {"code", "message", ...context}}``."""

    error: dict[str, object]


class CommandRequest(RequestBody):
    """A request body that names a program to run in the guest (exec, a background
    process, a terminal): one check of its ``args``, ``env`` and ``cwd`` for all of them.
    Subclasses define those fields."""

    @field_validator("args", check_fields=False)
    @classmethod
    def _args(cls, value: list[str] | None) -> list[str] | None:
        return check_args(value)

    @field_validator("env", check_fields=False)
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        return check_env(value)

    @field_validator("cwd", check_fields=False)
    @classmethod
    def _cwd(cls, value: str | None) -> str | None:
        return check_cwd(value)

    @field_validator("command", check_fields=False)
    @classmethod
    def _command(cls, value: str | None) -> str | None:
        if value is not None:
            _no_nul("command", value)
        return value

    @model_validator(mode="after")
    def _sizes(self) -> Any:
        check_sizes(getattr(self, "command", None) or "", getattr(self, "args", None),
                    getattr(self, "env", {}))
        return self


def check_sizes(command: str, args: list[str] | None, env: dict[str, str]) -> None:
    """Raise ValueError when ``command`` with ``args`` is longer than the guest's PATH_MAX,
    or the command, args and env take more than ``ARGS_ENV_MAX`` bytes (each counted as
    execve does: its bytes, a NUL and a pointer). Exec, background processes and
    terminals all check with this."""
    if args is not None and _utf8_len(command) >= PATH_MAX:
        raise ValueError(f"command (the program, with args) is longer than the guest's "
                         f"PATH_MAX ({PATH_MAX} bytes)")
    argv = [command, *(args or ())]  # without args, the command is a shell line: sh -c CMD
    total = sum(_utf8_len(a) + 1 + 8 for a in argv) + sum(
        _utf8_len(k) + _utf8_len(v) + 2 + 8 for k, v in env.items())
    if total > ARGS_ENV_MAX:
        raise ValueError(f"args and env take {total} bytes; at most {ARGS_ENV_MAX} are "
                         "allowed (the guest kernel's execve limit is 2 MiB): pass large "
                         "data through stdin or a file")
