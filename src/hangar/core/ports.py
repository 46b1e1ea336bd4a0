"""Exposed ports: which guest TCP ports Hangar's HTTP server forwards to, and their tokens.

A sandbox's owner exposes a guest port (``POST /sandboxes/{id}/ports``);
``hangar.api.proxy`` then forwards HTTP and WebSocket requests for it over
the agent's tunnel (no guest NIC needed). This module keeps the records
(table ``ports``, so exposures survive a server restart along with their
sandboxes) and signs the URL tokens of private ports.

A **public** port is open to anyone who has its URL. A **private** port
needs the API key (``X-API-Key``) or a token: ``<expires>.<signature>``,
where ``expires`` is a Unix time in whole seconds and ``signature`` is the
unpadded base64url HMAC-SHA256, under the server's port key
(``<data>/port-key``, 32 random bytes, 0600, made on first use), of
``v1:<sandbox id>:<port>:<nonce>:<expires>``. The token names one port of
one sandbox, expires, and carries no key: it is safe in a URL (a link to
share, a browser's first visit), where the API key never goes. ``nonce``
is drawn anew each time a port is exposed, so closing a port revokes every
token issued for it. Tokens are checked by ``hmac.compare_digest``.

Ports of a sandbox are forgotten when it is deleted or expires.

**Connections** (``Ports.connection``): at most ``port_max_connections`` (64) open at
once to one port and ``sandbox_max_port_connections`` (256) to all ports of one
sandbox, counted over the port proxy and E2B's envd port forwarding alike; one more is
answered 429 ``limit_exceeded`` with ``Retry-After`` (``CAP_RETRY_S``), as a command
over ``max_execs_per_sandbox`` is. A connection does not make its sandbox busy
(``GuestCalls.tunnel(busy=False)``), so it never holds off a snapshot or a sleep: a
snapshot pauses it with the VM (it goes on after), a sleep ends it (the VM stops; the
client's next connection wakes the sandbox). It counts as activity when it opens and
when it ends, not while it idles.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from hangar.core.context import Context
from hangar.core.lifecycle import State
from hangar.core.store import PortRecord, SandboxRecord
from hangar.durable import read_small
from hangar.errors import ConfigError, Conflict, InvalidRequest, LimitExceeded, NotFound
from hangar.schemas.bounds import PORT_MAX, PORT_MIN, TTL_MAX_S

log = logging.getLogger("hangar.ports")

MAX_PORTS = 64
"""Ports one sandbox may have exposed at once."""
KEY_BYTES = 32
EXPOSABLE = frozenset(State) - {State.STOPPING, State.FAILED, State.DELETED, State.EXPIRED,
                                State.POOLED}
"""States in which a sandbox's ports may be exposed."""
ENDED = frozenset({State.DELETED, State.EXPIRED})
CAP_RETRY_S = 1.0
"""``Retry-After`` of a connection over a port's or a sandbox's cap, seconds."""
KEY_FILE_MAX = 4096
"""Most bytes read from the port key file (a larger one is refused, as a short one is)."""


@dataclass(frozen=True)
class Exposure:
    """One exposed port: ``public`` needs no credentials; times are Unix seconds."""

    sandbox_id: str
    port: int
    public: bool
    nonce: str
    created_at: float


def _exposure(rec: PortRecord) -> Exposure:
    return Exposure(rec.sandbox_id, rec.port, bool(rec.public), rec.nonce, rec.created_at)


def check_port(port: int) -> None:
    """Raise ``InvalidRequest`` unless ``port`` is a TCP port number (``PORT_MIN``..``PORT_MAX``)."""
    if isinstance(port, bool) or not isinstance(port, int) or not PORT_MIN <= port <= PORT_MAX:
        raise InvalidRequest(f"port {port!r} is outside {PORT_MIN}..{PORT_MAX}",
                             port=str(port)[:20])


class PortKey:
    """The secret that signs URL tokens, read from (or made in) ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._key: bytes | None = None

    def check(self) -> None:
        """Raise ConfigError, naming the fix, when the key file exists but is shorter than
        ``KEY_BYTES`` (empty, cut short): tokens signed with it could be forged. A missing
        file is fine (``key`` makes one). ``hangar serve`` calls this at start."""
        try:
            size = len(read_small(self.path, KEY_FILE_MAX))
        except FileNotFoundError:
            return
        except OSError as exc:
            raise ConfigError(f"cannot read the port key {self.path}: "
                              f"{exc.strerror or exc}") from None
        if size < KEY_BYTES:
            raise ConfigError(
                f"the port key {self.path} is {size} bytes, under the {KEY_BYTES} it must "
                "hold: it signs port URL tokens and E2B's access tokens, which a short key "
                f"lets anyone forge. Remove it (a new one is made at start: tokens issued "
                f"so far stop working) or write {KEY_BYTES} random bytes to it "
                f"(head -c {KEY_BYTES} /dev/urandom > {self.path}; chmod 600 {self.path})",
                path=str(self.path))

    def key(self) -> bytes:
        """The key's bytes; made (0600, atomically) when the file does not exist. Raises
        ConfigError when it exists and is too short (``check``)."""
        if self._key is None:
            self.check()
            try:
                data = read_small(self.path, KEY_FILE_MAX)
            except FileNotFoundError:
                data = b""
            if len(data) < KEY_BYTES:
                data = secrets.token_bytes(KEY_BYTES)
                tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
                tmp.unlink(missing_ok=True)  # a leftover, or a FIFO or link planted there
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                             | os.O_CLOEXEC, 0o600)
                try:
                    os.write(fd, data)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                try:
                    os.link(tmp, self.path)  # never replaces a key another process made
                except FileExistsError:
                    self.check()
                    data = read_small(self.path, KEY_FILE_MAX)
                finally:
                    tmp.unlink(missing_ok=True)
            self._key = data
        return self._key

    def sign(self, exposure: Exposure, expires: int) -> str:
        msg = f"v1:{exposure.sandbox_id}:{exposure.port}:{exposure.nonce}:{expires}".encode()
        mac = hmac.new(self.key(), msg, hashlib.sha256).digest()
        return base64.urlsafe_b64encode(mac).rstrip(b"=").decode()

    def issue(self, exposure: Exposure, ttl_s: float) -> tuple[str, int]:
        """A token for ``exposure`` valid ``ttl_s`` seconds: (token, expiry as Unix seconds)."""
        expires = int(time.time() + ttl_s)
        return f"{expires}.{self.sign(exposure, expires)}", expires

    def valid(self, token: str, exposure: Exposure) -> bool:
        """Whether ``token`` opens ``exposure`` now (signature right, not expired)."""
        stamp, sep, signature = token.partition(".")
        if not sep or not (stamp.isascii() and stamp.isdigit()) or len(stamp) > 12 \
                or len(signature) > 64:
            return False
        expires = int(stamp)
        if expires <= time.time():
            return False
        return hmac.compare_digest(signature.encode(), self.sign(exposure, expires).encode())


class Ports:
    """The exposed ports of every sandbox; one per server."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.key = PortKey(ctx.layout.port_key_file)
        self.open: dict[str, dict[int, int]] = {}
        """Sandbox id → port → connections open now."""
        ctx.store.on_transition(self._on_transition)

    @contextlib.contextmanager
    def connection(self, sandbox_id: str, port: int) -> Iterator[None]:
        """Count one connection to ``port`` of the sandbox while the block runs.

        Raises LimitExceeded (429, ``Retry-After``) when the port holds
        ``port_max_connections`` already, or the sandbox's ports together
        ``sandbox_max_port_connections`` (module docstring).
        """
        settings = self.ctx.settings
        per_port = getattr(settings, "port_max_connections", 64)
        per_sandbox = getattr(settings, "sandbox_max_port_connections", 256)
        ports = self.open.setdefault(sandbox_id, {})
        if ports.get(port, 0) >= per_port:
            raise LimitExceeded(f"port {port} of sandbox {sandbox_id} has {per_port} "
                                "connections open, the most allowed; retry shortly",
                                retry_after=CAP_RETRY_S, sandbox_id=sandbox_id, port=port)
        if sum(ports.values()) >= per_sandbox:
            raise LimitExceeded(f"sandbox {sandbox_id} has {per_sandbox} connections open "
                                "to its ports, the most allowed; retry shortly",
                                retry_after=CAP_RETRY_S, sandbox_id=sandbox_id, port=port)
        ports[port] = ports.get(port, 0) + 1
        try:
            yield
        finally:
            left = ports.get(port, 1) - 1
            if left > 0:
                ports[port] = left
            else:
                ports.pop(port, None)
            if not ports and self.open.get(sandbox_id) is ports:
                del self.open[sandbox_id]

    def _on_transition(self, rec: SandboxRecord, _from: frozenset[State], to: State) -> None:
        if to in ENDED:
            self.ctx.store.remove_ports(rec.id)

    def _live(self, sandbox_id: str) -> SandboxRecord:
        rec = self.ctx.record(sandbox_id)  # NotFound, Gone
        if rec.state not in EXPOSABLE:
            raise Conflict(f"sandbox {sandbox_id} is {rec.state.value}; its ports cannot be "
                           "reached", sandbox_id=sandbox_id, state=rec.state.value)
        return rec

    def expose(self, sandbox_id: str, port: int, public: bool) -> Exposure:
        """Expose ``port`` of the sandbox (again: its ``public`` flag is updated).

        Raises NotFound, Gone, Conflict (the sandbox is stopping or failed),
        InvalidRequest (a bad port number, or ``MAX_PORTS`` already exposed).
        """
        check_port(port)
        self._live(sandbox_id)
        have = self.ctx.store.port(sandbox_id, port)
        if have is None and len(self.ctx.store.ports(sandbox_id)) >= MAX_PORTS:
            raise InvalidRequest(f"sandbox {sandbox_id} has {MAX_PORTS} ports exposed, the "
                                 "most allowed; close one first", sandbox_id=sandbox_id)
        rec = PortRecord(sandbox_id=sandbox_id, port=port, public=public,
                         nonce=have.nonce if have else secrets.token_hex(8),
                         created_at=have.created_at if have else time.time())
        rec = self.ctx.store.put_port(rec)
        if have is None or bool(have.public) != public:
            log.info("port exposed", extra={"sandbox_id": sandbox_id, "port": port,
                                            "public": public})
            self.ctx.publish("port.exposed", sandbox_id, port=port, public=public)
        return _exposure(rec)

    def list(self, sandbox_id: str) -> list[Exposure]:
        """The sandbox's exposed ports. Raises NotFound, Gone."""
        self.ctx.record(sandbox_id)
        return [_exposure(r) for r in self.ctx.store.ports(sandbox_id)]

    def get(self, sandbox_id: str, port: int) -> Exposure:
        """One exposed port. Raises NotFound (the sandbox, or the port is not exposed), Gone."""
        check_port(port)
        self.ctx.record(sandbox_id)
        rec = self.ctx.store.port(sandbox_id, port)
        if rec is None:
            raise NotFound(f"port {port} of sandbox {sandbox_id} is not exposed",
                           sandbox_id=sandbox_id, port=port)
        return _exposure(rec)

    def close(self, sandbox_id: str, port: int) -> None:
        """Stop exposing ``port``; its tokens stop working. Raises NotFound, Gone."""
        self.get(sandbox_id, port)
        self.ctx.store.remove_ports(sandbox_id, port)
        log.info("port closed", extra={"sandbox_id": sandbox_id, "port": port})
        self.ctx.publish("port.closed", sandbox_id, port=port)

    def token(self, exposure: Exposure, ttl_s: float | None = None) -> tuple[str, int]:
        """A URL token for ``exposure`` (see the module docstring): (token, expiry, Unix s)."""
        ttl = self.ctx.settings.port_token_ttl_s if ttl_s is None else ttl_s
        if not 0 < ttl <= TTL_MAX_S:
            raise InvalidRequest(f"token_ttl must be in (0, {TTL_MAX_S}] seconds")
        return self.key.issue(exposure, ttl)

    def allows(self, exposure: Exposure, token: str | None) -> bool:
        """Whether ``token`` opens the private port ``exposure`` now."""
        return bool(token) and self.key.valid(token, exposure)  # type: ignore[arg-type]
