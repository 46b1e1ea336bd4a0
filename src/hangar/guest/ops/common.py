"""What every guest operation shares: its error, its handler's shape, paths and the base env.

An operation is an ``async`` function ``handler(agent, meta, ch)``: ``agent``
the serving ``hangar.guest.agent.Agent`` (seen through ``AgentView``),
``meta`` the REQUEST frame's meta, ``ch`` its ``hangar.guest.channel.Channel``.
It returns the RESPONSE meta, or (meta, data bytes), or raises ``OpError``,
which the agent sends as an ERROR frame with that ``code``.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol, Union

from hangar.guest import paths

if TYPE_CHECKING:
    from hangar.guest.channel import Channel
    from hangar.guest.procs import ProcessTable

Result = Union[dict[str, Any], tuple[dict[str, Any], bytes]]
"""A RESPONSE: its meta, or its meta and data bytes."""


class AgentView(Protocol):
    """What an operation sees of the agent that serves it."""

    generation: int
    """The guest's fork generation (``hangar.guest.identity``), as the agent last set it."""

    procs: ProcessTable
    """The processes that outlive their connection (``hangar.guest.procs``)."""

    def hello_meta(self) -> dict[str, Any]:
        """The HELLO frame's meta (see ``hangar.guest.agent``)."""
        ...

    def alone(self, ch: Channel) -> tuple[int, ...] | None:
        """The fds of the host's connections when ``ch`` is the one request open, else
        None (``hangar.guest.spawn.Settle``)."""
        ...


Handler = Callable[[AgentView, dict[str, Any], "Channel"], Awaitable[Result]]
"""An operation: ``await handler(agent, meta, ch)`` → ``Result``; raises ``OpError``."""


class OpError(Exception):
    """A failure reported to the host as an ERROR frame."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


ERRNO_CODES = {
    errno.ENOENT: "not_found",
    errno.EISDIR: "is_directory",
    errno.ENOTDIR: "not_directory",
    errno.EEXIST: "exists",
    errno.ENOTEMPTY: "not_empty",
    errno.EACCES: "permission_denied",
    errno.EPERM: "permission_denied",
    errno.EINVAL: "invalid",
    errno.ENAMETOOLONG: "invalid",
}
"""ERROR codes of the errnos that have one of their own; any other is ``io_error``."""


def os_error(exc: OSError, path: str) -> OpError:
    """``exc`` as an OpError naming ``path``."""
    code = ERRNO_CODES.get(exc.errno or 0, "io_error")
    return OpError(code, f"{os.strerror(exc.errno or 0) if exc.errno else exc}: {path}")


BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": paths.HOME,
    "LANG": "C.UTF-8",
    "TERM": "xterm-256color",
    "USER": "root",
}
"""Every command's environment, with the template's (``template_env``) merged in."""


def template_env(path: str = paths.TEMPLATE_ENV) -> dict[str, str]:
    """The template's environment: a JSON object of strings; {} when absent or unreadable."""
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)
            and k and "=" not in k and "\0" not in k and "\0" not in v}


BASE_ENV.update(template_env())


def encodable(value: str) -> bool:
    """True when ``value`` can become bytes for the kernel (no lone surrogates but the
    ``surrogateescape`` ones that stand for raw bytes)."""
    try:
        value.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return False
    return True


def check_text(what: str, value: str) -> None:
    """OpError ``invalid`` naming ``what`` when ``value`` holds NUL or a lone surrogate."""
    if "\0" in value:
        raise OpError("invalid", f"{what} must not contain NUL bytes")
    if not encodable(value):
        raise OpError("invalid", f"{what} is not valid Unicode (a lone surrogate)")


def resolve(path: Any) -> str:
    """Absolute path of ``path``; relative paths start at the commands' HOME (``BASE_ENV``)."""
    if not isinstance(path, str) or not path or "\0" in path or not encodable(path):
        raise OpError("invalid", "path must be a non-empty string of valid Unicode without "
                                 "NUL bytes")
    return os.path.normpath(os.path.join(BASE_ENV["HOME"], path))


def mkstemp(directory: str, prefix: str, suffix: str = "") -> tuple[int, str]:
    """A new file of mode 0600 in ``directory``, opened for writing: (fd, path).

    ``tempfile.mkstemp`` without the module (its imports cost about 50 ms
    under TCG, paid by the first upload after every restore). Raises OSError.
    """
    for _ in range(100):
        path = os.path.join(directory, f"{prefix}{os.urandom(6).hex()}{suffix}")
        try:
            return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600), path
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary file name", directory)

