"""API keys on disk: the default key file, named keys kept as hashes, strength rules.

Two files in the data directory (see ``hangar.layout``), both 0600::

    api-key     the default key, plain text, one line. Generated on first
                start; the CLI and the SDK on this host read it (so does
                anything that reads "a file holding one key").
    api-keys    named keys, one a line: ``NAME sha256:HEX CREATED team=TEAM``
                (CREATED in Unix seconds; ``team=TEAM`` only for a team's key,
                so files written before teams parse unchanged); ``#`` starts a
                comment. Only the SHA-256 of each key is kept, so the file
                grants nothing if it leaks. Written by ``hangar key add|rm|rotate``.

A key with a team acts for that team only (``hangar.teams``); a key without
one, the default key and a cluster's shared keys are *operator* keys. A
cluster's team keys are kept in etcd, not in these files
(``KeyRing.share_team_keys``, ``hangar.cluster.teams``).

A plain SHA-256 (no salt, no slow hash) is enough because every named key
is random: 32 bytes (256 bits) made by ``generate``, or 20 bytes (160 bits)
in E2B's format (``e2b_`` and 40 hex digits, ``generate_e2b``, for
programs written for E2B's SDKs): there is nothing to guess.
``HANGAR_API_KEY``, when set, takes the place of the ``api-key`` file.

A key is *weak* (``weakness``) when it is shorter than ``MIN_LENGTH``
characters, has fewer than ``MIN_DISTINCT`` distinct characters, repeats a
short pattern, or holds characters an HTTP header cannot carry; the server
refuses to start with one.

Writers take an exclusive ``flock`` on the data directory and replace a
file by rename, so the server (which watches both files) never reads half
a file and two ``hangar key`` commands never lose each other's change.

The server side (no HTTP here: the API's routes and a cluster's gateway both use it):

- ``KeyRing``: the keys the server accepts. ``load`` runs at start-up and
  raises ``ConfigError`` for an empty or weak default key, or a malformed
  ``api-keys``: the server does not start. Afterwards every request
  ``refresh``-es the ring: it compares the files' (inode, size, mtime) with
  what it last read, two ``stat`` calls, and reloads on a change, so
  ``hangar key add|rm|rotate`` takes effect on the next request without a
  restart. A reload that finds a bad entry logs an error and drops that
  entry (an emptied ``api-key`` accepts no key at all), never the whole ring.
  Matching hashes the presented key and compares it with *every* stored
  hash by ``hmac.compare_digest`` without stopping at a match, so the time
  taken tells nothing about which keys exist or how close a guess came.
- ``Throttle``: wrong keys are counted per *bucket*: the client's address
  together with a digest of the key it presented (``bucket``). A bucket may
  take ``BURST`` wrong keys, then one more every ``REFILL_S`` seconds; past
  that, a request in that bucket gets 429 with ``Retry-After`` *before* its
  key is looked at, so a client hammering one wrong key learns nothing while
  throttled. Because the presented key is part of the bucket, one client's
  wrong keys never throttle another key: every process on this host shares
  the loopback address, and a local script retrying a stale key must not
  lock the operator's CLI (which presents the right key) out. A correct key
  is never throttled: its bucket is only charged when that same key is
  wrong. Guessing with ever new keys is not slowed by the buckets; what
  stops it is the keys' strength (``weakness``: at least 32 characters;
  generated keys hold 160 or 256 random bits), not a rate. A request
  without a key is no guess: it gets 401 and is not counted.
- ``authenticate``: the one check of a presented key, with both of the above.

Keys are never logged, never accepted in a URL and never passed into a guest.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import logging
import math
import os
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hangar.durable import atomic_write, read_small
from hangar.errors import (
    ConfigError, Conflict, InvalidRequest, LimitExceeded, NotFound, Unauthorized,
)
from hangar.teams import NAME as TEAM_NAME, TeamStore, check_name as check_team_name

log = logging.getLogger("hangar.keys")

PREFIX = "hk_"
E2B_PREFIX = "e2b_"
MIN_LENGTH = 32
"""Characters; a generated key has 46 (``hk_`` + 43 of URL-safe base64)."""
MIN_DISTINCT = 8
DEFAULT_NAME = "default"
NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
_LINE = re.compile(r"^(\S+)\s+sha256:([0-9a-f]{64})(?:\s+(\d+(?:\.\d+)?))?"
                   r"(?:\s+team=(\S+))?$")
_HEADER_SAFE = re.compile(r"^[\x21-\x7e]+$")
SHARED_SUFFIX = "@cluster"
"""Ends the name of a cluster's team key (``KeyRing.share_team_keys``)."""
MAX_KEY_FILE_BYTES = 4096
"""Most bytes read from ``api-key`` (one key and its newline; more is refused)."""
MAX_NAMED_FILE_BYTES = 1 << 20
"""Most bytes read from ``api-keys`` (about 10,000 named keys)."""


def generate() -> str:
    """A new key: ``hk_`` and 32 random bytes, URL-safe base64 (46 characters)."""
    return PREFIX + secrets.token_urlsafe(32)


def generate_e2b() -> str:
    """A new key in E2B's format: ``e2b_`` and 20 random bytes as 40 hex digits (44
    characters), which E2B's SDKs take as an API key as is."""
    return E2B_PREFIX + secrets.token_hex(20)


def digest(key: str) -> bytes:
    """SHA-256 of the key's UTF-8 bytes (32 bytes)."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def fingerprint(key_digest: bytes) -> str:
    """A short, safe-to-show name for a key: ``sha256:`` and 12 hex digits of its hash."""
    return "sha256:" + key_digest.hex()[:12]


def weakness(key: str) -> str | None:
    """Why ``key`` is too weak to protect the server, or None when it is fine."""
    if not key:
        return "it is empty"
    if not _HEADER_SAFE.match(key):
        return "it holds spaces, control or non-ASCII characters, which an HTTP header cannot carry"
    if len(key) < MIN_LENGTH:
        return f"it is {len(key)} characters long; at least {MIN_LENGTH} are needed"
    if len(set(key)) < MIN_DISTINCT:
        return (f"it uses only {len(set(key))} distinct characters; at least {MIN_DISTINCT} "
                "are needed")
    for n in range(1, 9):
        if len(key) % n == 0 and key == key[:n] * (len(key) // n):
            return "it repeats a short pattern"
    return None


@dataclass(frozen=True)
class NamedKey:
    """One line of ``api-keys``: a name, the key's SHA-256, when it was made (Unix s) and
    its team (None: an operator key)."""

    name: str
    digest: bytes
    created: float | None = None
    team: str | None = None

    def line(self) -> str:
        created = f" {int(self.created)}" if self.created is not None else ""
        team = f" team={self.team}" if self.team is not None else ""
        return f"{self.name} sha256:{self.digest.hex()}{created}{team}"


def read_default(path: Path) -> str | None:
    """The key in a file holding one key (stripped), or None when the file is absent.

    Raises ``ConfigError`` naming the file and the fix when the key is empty
    or weak, or when the file holds more than one line.
    """
    try:
        text = read_small(path, MAX_KEY_FILE_BYTES).decode("utf-8", "surrogateescape")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"cannot read the API key file {path}: {exc.strerror}") from None
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if len(lines) > 1:
        raise ConfigError(
            f"the API key file {path} holds {len(lines)} lines but must hold one key. Fix: keep "
            f"one key there; named keys belong in {path.with_name('api-keys')} "
            f"(`hangar key add NAME`)")
    key = lines[0] if lines else ""
    if not key:
        raise ConfigError(
            f"the API key file {path} is empty (a first start killed before the key was "
            f"written, by a version that wrote it in place, or an emptied file). Fix: run "
            f"`hangar key rotate` to write a new key there, or delete the file and start the "
            f"server, which generates one")
    problem = weakness(key)
    if problem:
        raise ConfigError(
            f"the API key in {path} is unsafe: {problem}. Fix: run `hangar key rotate` to "
            f"write a new random key there (or delete the file and start the server, which "
            f"generates one)")
    return key


def check_env_key(key: str, variable: str = "HANGAR_API_KEY") -> str:
    """``key`` (stripped) when it is strong; ``ConfigError`` naming ``variable`` otherwise."""
    key = key.strip()
    problem = weakness(key)
    if problem:
        raise ConfigError(
            f"{variable} is unsafe: {problem}. Fix: unset it to use the key file, or set it "
            f"to a random key of at least {MIN_LENGTH} characters, such as the output of "
            f"`python3 -c 'import secrets; print(\"hk_\" + secrets.token_urlsafe(32))'`")
    return key


def parse_named(text: str, path: Path) -> tuple[list[NamedKey], list[str]]:
    """The entries of an ``api-keys`` text and a message for each bad line."""
    keys: list[NamedKey] = []
    problems: list[str] = []
    seen: set[str] = set()
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = _LINE.match(line)
        if (not m or not NAME.match(m.group(1)) or m.group(1) == DEFAULT_NAME
                or (m.group(4) is not None and not TEAM_NAME.fullmatch(m.group(4)))):
            problems.append(f"{path}:{n}: not a named key line (NAME sha256:HEX CREATED "
                            "[team=TEAM]); named keys are written by `hangar key add NAME`")
            continue
        if m.group(1) in seen:
            problems.append(f"{path}:{n}: the name {m.group(1)!r} appears twice")
            continue
        seen.add(m.group(1))
        keys.append(NamedKey(m.group(1), bytes.fromhex(m.group(2)),
                             float(m.group(3)) if m.group(3) else None, m.group(4)))
    return keys, problems


def read_named(path: Path) -> tuple[list[NamedKey], list[str]]:
    """The named keys of ``path`` (none when it is absent) and a message per bad line."""
    try:
        text = read_small(path, MAX_NAMED_FILE_BYTES).decode("utf-8", "replace")
    except FileNotFoundError:
        return [], []
    except OSError as exc:
        return [], [f"cannot read {path}: {exc.strerror}"]
    return parse_named(text, path)


def write_private(path: Path, text: str) -> None:
    """Replace ``path`` with ``text``, durably (``hangar.durable.atomic_write``: a 0600
    temporary file, fsync, rename, fsync of the folder)."""
    atomic_write(path, text.encode(), 0o600)


def create_default(path: Path) -> str:
    """Write a new default key to ``path`` if it does not exist (0600); return the key there.

    Atomic and durable (``atomic_write`` with ``exclusive``): a kill at any moment leaves
    either no file (the next start makes one) or the whole key, never an empty file.
    """
    key = generate()
    try:
        atomic_write(path, (key + "\n").encode(), 0o600, exclusive=True)
    except FileExistsError:
        found = read_default(path)
        assert found is not None
        return found
    return key


@contextmanager
def locked(data_dir: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``data_dir`` (``flock``) while changing key files."""
    fd = os.open(data_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class KeyStore:
    """The key files of one data directory, for ``hangar key`` (changes take a lock).

    ``default_file`` is ``<data>/api-key``, ``named_file`` ``<data>/api-keys``.
    """

    def __init__(self, default_file: Path, named_file: Path) -> None:
        self.default_file = default_file
        self.named_file = named_file

    def _named_strict(self) -> list[NamedKey]:
        keys, problems = read_named(self.named_file)
        if problems:
            raise ConfigError("; ".join(problems))
        return keys

    def _write_named(self, keys: list[NamedKey]) -> None:
        header = ("# Hangar's named API keys: NAME sha256:HEX CREATED [team=TEAM]\n"
                  "# (CREATED in Unix seconds; no team: an operator key).\n"
                  "# Only hashes are kept. Change with `hangar key add|rm|rotate`.\n")
        write_private(self.named_file, header + "".join(k.line() + "\n" for k in keys))

    @staticmethod
    def check_name(name: str) -> None:
        if not NAME.match(name):
            raise InvalidRequest(f"key name {name!r} must be 1-64 of a-z, 0-9, '.', '_', '-', "
                                 "starting with a letter or digit")

    def entries(self) -> list[tuple[str, str, float | None, str, str | None]]:
        """(name, fingerprint, created, where, team) of each key, the default key first if
        any; team is None for an operator key (the default key is one)."""
        out: list[tuple[str, str, float | None, str, str | None]] = []
        try:
            key = read_default(self.default_file)
        except ConfigError:
            out.append((DEFAULT_NAME, "unsafe", None, str(self.default_file), None))
        else:
            if key is not None:
                created = self.default_file.stat().st_mtime
                out.append((DEFAULT_NAME, fingerprint(digest(key)), created,
                            str(self.default_file), None))
        for k in self._named_strict():
            out.append((k.name, fingerprint(k.digest), k.created, str(self.named_file), k.team))
        return out

    def team_keys(self, team: str) -> list[str]:
        """Names of the named keys of ``team``, in file order (empty for an unknown team).
        Raises ConfigError when ``api-keys`` holds a bad line."""
        return [k.name for k in self._named_strict() if k.team == team]

    def add(self, name: str, e2b: bool = False, team: str | None = None) -> str:
        """Make a key called ``name`` and return it (only its hash is stored); in E2B's
        format (``generate_e2b``) when ``e2b``; acting for ``team`` when given (None: an
        operator key).

        Raises InvalidRequest (a bad key or team name), Conflict (the name exists) or
        NotFound (no such team in ``<data>/teams.json``).
        """
        self.check_name(name)
        if team is not None:
            check_team_name(team)
        if name == DEFAULT_NAME:
            raise Conflict("'default' is the key in the api-key file; change it with "
                           "`hangar key rotate`")
        with locked(self.named_file.parent):
            if team is not None and not TeamStore(self.named_file.parent / "teams.json") \
                    .exists(team):
                raise NotFound(f"no team {team!r}; `hangar team create {team}` makes one")
            keys = self._named_strict()
            if any(k.name == name for k in keys):
                raise Conflict(f"a key called {name!r} exists; `hangar key rotate {name}` "
                               "replaces it")
            key = generate_e2b() if e2b else generate()
            keys.append(NamedKey(name, digest(key), time.time(), team))
            self._write_named(keys)
        return key

    def remove(self, name: str) -> None:
        """Remove the named key ``name``; NotFound when there is none."""
        if name == DEFAULT_NAME:
            raise Conflict("the default key cannot be removed (the CLI on this host uses it); "
                           "`hangar key rotate` replaces it")
        with locked(self.named_file.parent):
            keys = self._named_strict()
            if not any(k.name == name for k in keys):
                raise NotFound(f"no key called {name!r}")
            self._write_named([k for k in keys if k.name != name])

    def rotate(self, name: str = DEFAULT_NAME, e2b: bool = False) -> str:
        """Give ``name`` a new key and return it (in E2B's format when ``e2b``); the old
        one stops working at once, and the new one keeps its team."""
        with locked(self.named_file.parent):
            key = generate_e2b() if e2b else generate()
            if name == DEFAULT_NAME:
                write_private(self.default_file, key + "\n")
                return key
            keys = self._named_strict()
            if not any(k.name == name for k in keys):
                raise NotFound(f"no key called {name!r}; `hangar key add {name}` makes one")
            self._write_named([NamedKey(name, digest(key), time.time(), k.team)
                               if k.name == name else k for k in keys])
        return key


# -- the server's side: the ring of accepted keys, throttling, the check ----------------

BURST = 20
"""Wrong keys one bucket (client address and presented key) may present before it is
throttled."""
REFILL_S = 3.0
"""Seconds after which a throttled bucket may try once more."""
MAX_ADDRESSES = 4096
"""Buckets remembered; the least recently seen is forgotten first."""


def bucket(address: str, given: str) -> str:
    """The throttle bucket of a key ``given`` from ``address``: the address and 16 hex
    digits of the key's SHA-256 (see the module docstring)."""
    return f"{address}|{digest(given).hex()[:16]}"


def client_identity(scope: Any) -> str:
    """The address of an ASGI request's TCP peer (``"unknown"`` without one, e.g. a Unix
    socket). Port-independent: every connection of a client has the same one."""
    client = scope.get("client") if hasattr(scope, "get") else None
    return str(client[0]) if client else "unknown"


@dataclass(frozen=True)
class _Entry:
    name: str
    digest: bytes
    team: str | None = None


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
        self._teams: tuple[_Entry, ...] = ()

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

    def share_team_keys(self, keys: list[tuple[str, str, str]]) -> None:
        """Also accept a cluster's team keys: ``(name, SHA-256 hex, team)`` each, replacing
        the ones given before (``hangar.cluster``: ``/hangar/keys/``). Each is known as
        ``NAME@cluster`` (``SHARED_SUFFIX``: no key file's name has an ``@``), so it never
        takes the team, or the lack of one, of a key of this host's files. Bad digests are
        ignored."""
        entries = []
        for name, hex_digest, team in keys:
            try:
                d = bytes.fromhex(hex_digest)
            except ValueError:
                continue
            if len(d) == 32 and TEAM_NAME.fullmatch(team):
                entries.append(_Entry(name + SHARED_SUFFIX, d, team))
        self._teams = tuple(entries)

    def load(self) -> None:
        """Read every key strictly (start-up). Creates the default key file if absent.

        Raises ``ConfigError`` naming the file or variable and the fix.
        """
        if self.env_key is not None:
            default = check_env_key(self.env_key)
        else:
            default = read_default(self.default_file)
            if default is None:
                default = create_default(self.default_file)
                log.info("API key generated", extra={"file": str(self.default_file)})
        named, problems = read_named(self.named_file)
        if problems:
            raise ConfigError("; ".join(problems) + ". Fix the file, or remove the bad lines "
                              "and add keys again with `hangar key add NAME`")
        self._seen = self._signatures()
        self._entries = (_Entry(DEFAULT_NAME, digest(default)),
                         *(_Entry(k.name, k.digest, k.team) for k in named))

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
            entries.append(_Entry(DEFAULT_NAME, digest(self.env_key.strip())))
        else:
            try:
                default = read_default(self.default_file)
            except ConfigError as exc:
                log.error("default API key refused", extra={"reason": exc.message})
                default = None
            if default is not None:
                entries.append(_Entry(DEFAULT_NAME, digest(default)))
        named, problems = read_named(self.named_file)
        for problem in problems:
            log.error("named API key ignored", extra={"reason": problem})
        entries += [_Entry(k.name, k.digest, k.team) for k in named]
        self._entries = tuple(entries)
        log.info("API keys reloaded", extra={"names": ",".join(e.name for e in entries)})

    def match(self, given: str) -> str | None:
        """The name of the key ``given`` is, or None. Constant time in ``given`` and the keys."""
        if not given:
            return None
        d = digest(given)
        found = None
        for entry in (*self._entries, *self._shared, *self._teams):
            if hmac.compare_digest(d, entry.digest):
                found = entry.name
        return found

    def team_of(self, name: str) -> str | None:
        """The team key ``name`` (from ``match``) acts for; None for an operator key (the
        default key, a named key without a team, a cluster's shared keys) or an unknown
        name. Named keys come before shared ones, as in ``match``; a cluster's team keys
        (``share_team_keys``) have names of their own."""
        for entry in (*self._entries, *self._teams):
            if entry.name == name:
                return entry.team
        return None

    def names(self) -> list[str]:
        return [e.name for e in (*self._entries, *self._shared, *self._teams)]


class Throttle:
    """Token buckets of wrong keys, by ``bucket`` (address and presented key): ``BURST`` at
    once, one per ``REFILL_S``. The methods' ``address`` is a bucket's name."""

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
    when this key from this client ``address`` was wrong too often (its ``bucket``),
    without checking it again.

    ``state`` is anything with ``keys`` (a ``KeyRing``) and ``throttle`` (a ``Throttle``):
    the app's ``state``. The API's routes use it through ``hangar.api.auth.require_key``,
    its WebSocket routes and a cluster's gateway (``hangar.cluster.gateway``) call it.
    """
    ring: KeyRing = state.keys
    throttle: Throttle = state.throttle
    where = bucket(address, given) if given else address
    if given:
        wait = throttle.wait(where)
        if wait > 0:
            raise LimitExceeded(
                f"this wrong API key was sent from {address} too often; retry in "
                f"{math.ceil(wait)} s", retry_after=wait)
    ring.refresh()
    name = ring.match(given or "")
    if name is None:
        if given and throttle.failed(where):
            log.warning("client throttled after wrong API keys",
                        extra={"client": address, "key_digest": where.partition("|")[2]})
        raise Unauthorized("missing or wrong X-API-Key header")
    return name
