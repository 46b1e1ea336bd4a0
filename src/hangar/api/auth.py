"""API-key authentication: the ``X-API-Key`` header, its keys, and throttling of guessers.

Keys (see ``hangar.keys`` for the files):

- the default key: ``HANGAR_API_KEY`` when set, else the file ``<data>/api-key``
  (generated on first start);
- any number of named keys in ``<data>/api-keys``, kept as SHA-256 hashes.

``KeyRing.load`` runs at start-up and raises ``ConfigError`` for an empty or
weak default key, or a malformed ``api-keys``: the server does not start.
Afterwards every request ``refresh``-es the ring: it compares the files'
(inode, size, mtime) with what it last read, two ``stat`` calls, and reloads
on a change, so ``hangar key add|rm|rotate`` takes effect on the next
request without a restart. A reload that finds a bad entry logs an error
and drops that entry (an emptied ``api-key`` accepts no key at all), never
the whole ring.

Matching hashes the presented key and compares it with *every* stored hash
by ``hmac.compare_digest`` without stopping at a match, so the time taken
tells nothing about which keys exist or how close a guess came.

Throttling (``Throttle``): each client address may present ``BURST`` wrong
keys, then one more every ``REFILL_S`` seconds; past that, a request from
that address that carries a key gets 429 with ``Retry-After`` *before* its
key is looked at, so a guesser learns nothing while throttled (the right
key is refused too until the wait is over). A request without a key is no
guess: it gets 401 and is not counted. Addresses are the TCP peer's; behind
a reverse proxy every client shares the proxy's address.

Keys are never logged, never accepted in a URL and never passed into a guest.
"""

from __future__ import annotations

import hmac
import logging
import math
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import Request, Security
from fastapi.security import APIKeyHeader

from hangar import keys as K
from hangar.errors import ConfigError, LimitExceeded, Unauthorized

log = logging.getLogger("hangar.api.auth")

HEADER = APIKeyHeader(name="X-API-Key", auto_error=False,
                      description="An API key: the server's default key (<data>/api-key) or a "
                                  "named key made by `hangar key add`.")

BURST = 20
"""Wrong keys one client address may present before it is throttled."""
REFILL_S = 3.0
"""Seconds after which a throttled address may try one more key."""
MAX_ADDRESSES = 4096
"""Client addresses remembered; the least recently seen is forgotten first."""


@dataclass(frozen=True)
class _Entry:
    name: str
    digest: bytes


def _signature(path: Path) -> tuple[int, int, int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError:
        return (-1, -1, -1, -1)
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class KeyRing:
    """The keys the server accepts, reloaded when their files change.

    ``default_file`` is ``<data>/api-key`` (used unless ``env_key`` is set),
    ``named_file`` is ``<data>/api-keys``.
    """

    def __init__(self, default_file: Path, named_file: Path, env_key: str | None = None) -> None:
        self.default_file = default_file
        self.named_file = named_file
        self.env_key = env_key
        self._entries: tuple[_Entry, ...] = ()
        self._seen: tuple[object, object] = (None, None)
        self._shared: tuple[_Entry, ...] = ()

    def share(self, name: str, hex_digests: list[str]) -> None:
        """Also accept keys whose SHA-256 (hex) is in ``hex_digests``, under ``name``:
        a cluster's keys, which every node accepts (``hangar.cluster``). Bad digests
        are ignored."""
        entries = []
        for h in hex_digests:
            try:
                d = bytes.fromhex(h)
            except ValueError:
                continue
            if len(d) == 32:
                entries.append(_Entry(name, d))
        self._shared = tuple(entries)

    def load(self) -> None:
        """Read every key strictly (start-up). Creates the default key file if absent.

        Raises ``ConfigError`` naming the file or variable and the fix.
        """
        if self.env_key is not None:
            default = K.check_env_key(self.env_key)
        else:
            default = K.read_default(self.default_file)
            if default is None:
                default = K.create_default(self.default_file)
                log.info("API key generated", extra={"file": str(self.default_file)})
        named, problems = K.read_named(self.named_file)
        if problems:
            raise ConfigError("; ".join(problems) + ". Fix the file, or remove the bad lines "
                              "and add keys again with `hangar key add NAME`")
        self._seen = self._signatures()
        self._entries = (_Entry(K.DEFAULT_NAME, K.digest(default)),
                         *(_Entry(k.name, k.digest) for k in named))

    def _signatures(self) -> tuple[object, object]:
        default = None if self.env_key is not None else _signature(self.default_file)
        return (default, _signature(self.named_file))

    def refresh(self) -> None:
        """Reload when a key file changed since it was last read; bad entries are dropped."""
        now = self._signatures()
        if now == self._seen:
            return
        self._seen = now
        entries: list[_Entry] = []
        if self.env_key is not None:
            entries.append(_Entry(K.DEFAULT_NAME, K.digest(self.env_key.strip())))
        else:
            try:
                default = K.read_default(self.default_file)
            except ConfigError as exc:
                log.error("default API key refused", extra={"reason": exc.message})
                default = None
            if default is not None:
                entries.append(_Entry(K.DEFAULT_NAME, K.digest(default)))
        named, problems = K.read_named(self.named_file)
        for problem in problems:
            log.error("named API key ignored", extra={"reason": problem})
        entries += [_Entry(k.name, k.digest) for k in named]
        self._entries = tuple(entries)
        log.info("API keys reloaded", extra={"names": ",".join(e.name for e in entries)})

    def match(self, given: str) -> str | None:
        """The name of the key ``given`` is, or None. Constant time in ``given`` and the keys."""
        if not given:
            return None
        d = K.digest(given)
        found = None
        for entry in (*self._entries, *self._shared):
            if hmac.compare_digest(d, entry.digest):
                found = entry.name
        return found

    def names(self) -> list[str]:
        return [e.name for e in (*self._entries, *self._shared)]


class Throttle:
    """Per-address token buckets of wrong keys: ``BURST`` at once, one per ``REFILL_S``."""

    def __init__(self, burst: int = BURST, refill_s: float = REFILL_S,
                 max_addresses: int = MAX_ADDRESSES) -> None:
        self.burst = burst
        self.refill_s = refill_s
        self.max_addresses = max_addresses
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # tokens, at

    def _tokens(self, address: str, now: float) -> float:
        tokens, at = self._buckets.get(address, (float(self.burst), now))
        return min(float(self.burst), tokens + (now - at) / self.refill_s)

    def wait(self, address: str) -> float:
        """Seconds until ``address`` may present a key again; 0 when it may now."""
        now = time.monotonic()
        tokens = self._tokens(address, now)
        return 0.0 if tokens >= 1 else (1 - tokens) * self.refill_s

    def failed(self, address: str) -> bool:
        """Count one wrong key from ``address``; True when that used up its last try."""
        now = time.monotonic()
        tokens = self._tokens(address, now) - 1
        self._buckets[address] = (tokens, now)
        self._buckets.move_to_end(address)
        while len(self._buckets) > self.max_addresses:
            self._buckets.popitem(last=False)
        return tokens < 1


def authenticate(state: Any, given: str | None, address: str) -> str:
    """The name of the key ``given`` (``default`` or a named key) that ``state``'s key
    ring accepts. Raises ``Unauthorized``, or ``LimitExceeded`` (429, ``Retry-After``)
    for a client address that presented too many wrong keys, without checking its key.

    ``state`` is the app's ``state`` (``keys``, ``throttle``); HTTP routes use
    ``require_key``, WebSocket routes that take the header call this themselves.
    """
    ring: KeyRing = state.keys
    throttle: Throttle = state.throttle
    if given:
        wait = throttle.wait(address)
        if wait > 0:
            raise LimitExceeded(
                f"too many wrong API keys from {address}; retry in {math.ceil(wait)} s",
                retry_after=wait)
    ring.refresh()
    name = ring.match(given or "")
    if name is None:
        if given and throttle.failed(address):
            log.warning("client throttled after wrong API keys", extra={"client": address})
        raise Unauthorized("missing or wrong X-API-Key header")
    return name


async def require_key(request: Request, given: str | None = Security(HEADER)) -> None:
    """FastAPI dependency: 401 unless the request carries a key the server accepts
    (see ``authenticate``). Sets ``request.state.key_name`` to the key's name.
    Runs on the event loop (two ``stat`` calls and a hash), not in a worker thread."""
    address = request.client.host if request.client else "unknown"
    request.state.key_name = authenticate(request.app.state, given, address)
