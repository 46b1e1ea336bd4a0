"""The vault: secrets encrypted at rest, and the placeholders sandboxes see instead.

A secret (``SecretRecord``) is a name, the hosts it may be sent to and its value sealed
with AES-256-GCM (``cryptography``), a fresh 96-bit nonce per seal and the secret's name
as associated data (a sealed value moved under another name does not open). The key is
32 random bytes in a file of its own (``key_file``: by default ``/etc/hangar/secrets.key``,
as root, outside the data directory; ``HANGAR_SECRETS_KEY_FILE``), mode 0600,
made on first use and read by ``hangar serve`` before it drops its privileges, so the
database (what ``hangar backup`` copies) holds ciphertext only.

A sandbox created with ``secrets: {"GITHUB_TOKEN": "gh"}`` gets a binding
(``SecretBindingRecord``, keyed by its id): for each variable, the secret's name and a
placeholder of its own (``hangar-secret-<32 hex>``), and a certificate authority made for
it (``hangar.core.secret_proxy``; its key sealed like a value). Its commands get the
placeholders in their environment (``env``); the real value is opened only to be handed
to the sandbox's egress proxy over a pipe (``resolved``), never to the guest, a log, an
event or a file.

Snapshots carry their sandbox's binding (same placeholders, same CA: the guest's memory
holds both), so a restore, a fork or a wake resolves the same placeholders against the
vault as it is then; a deleted secret is then refused like any unknown placeholder.

A secret stored with a team's key is the team's (``hangar.core.teams``): stored as
``TEAM/name`` (``scoped``; sealed under that name), so names are unique per team. A
team reads, rotates, deletes and binds its own secrets only, by the names it gave;
another team's is ``NotFound`` worded as a missing one. A binding keeps the stored
name, so a snapshot's, fork's or restore's resolves the same secret whoever acts.

Errors: InvalidRequest (bad name, value or hosts; a create naming a secret twice),
NotFound (no such secret), Conflict (the name is taken), ConfigError (an unreadable key).
"""

from __future__ import annotations

import base64
import os
import re
import secrets as _random
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from sqlalchemy import JSON, Float, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from hangar.core.store import Base, Store
from hangar.core.acting import acting
from hangar.core.teams import SCOPE_SEP, name_visible, scoped
from hangar.errors import ConfigError, Conflict, InvalidRequest, NotFound
from hangar.layout import Layout
from hangar.teams import NAME as TEAM_NAME
from hangar.schemas.secrets import (ENV_NAME, MAX_SECRETS_PER_SANDBOX, SECRET_NAME, check_hosts,
                                    check_value)

KEY_BYTES = 32
NONCE_BYTES = 12
MAX_SECRETS = 1024
"""Secrets one server keeps at most."""
PLACEHOLDER = re.compile(r"^hangar-secret-[0-9a-f]{32}$")
NAME = re.compile(SECRET_NAME)
ENV = re.compile(ENV_NAME)
CA_FILE = "/usr/local/share/ca-certificates/hangar-sandbox.crt"
"""Where a sandbox's guest keeps its proxy's CA certificate (also appended to the system
bundle, ``SYSTEM_BUNDLE``)."""
SYSTEM_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
CA_ENV = {"SSL_CERT_FILE": SYSTEM_BUNDLE, "REQUESTS_CA_BUNDLE": SYSTEM_BUNDLE,
          "NODE_EXTRA_CA_CERTS": CA_FILE}
"""Variables that point the usual TLS clients (OpenSSL, Python's requests, Node) at a
bundle that trusts the sandbox's proxy."""


class SecretRecord(Base):
    """A stored secret; ``sealed`` is base64 of nonce + AES-GCM ciphertext of its value.
    ``name``: as stored, ``TEAM/name`` for a team's (``hangar.core.teams.scoped``)."""

    __tablename__ = "secrets"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    hosts: Mapped[list[str]] = mapped_column(JSON)
    sealed: Mapped[str] = mapped_column(Text)
    created_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)


class SecretBindingRecord(Base):
    """The secrets of a sandbox, or of a snapshot (``owner``: its id).

    ``env``: ``{variable: {"secret": name, "placeholder": "hangar-secret-..."}}``;
    ``ca_cert``: the PEM certificate its guest trusts; ``ca_key``: its key, sealed."""

    __tablename__ = "secret_bindings"

    owner: Mapped[str] = mapped_column(String(32), primary_key=True)
    env: Mapped[dict[str, Any]] = mapped_column(JSON)
    ca_cert: Mapped[str] = mapped_column(Text)
    ca_key: Mapped[str] = mapped_column(Text)


def stored_name(name: str) -> bool:
    """Whether ``name`` is a stored secret's name: a name (``NAME``), or a team's
    ``TEAM/name``."""
    team, sep, rest = (name or "").partition(SCOPE_SEP)
    return bool(NAME.match(name or "") or (sep and TEAM_NAME.match(team) and NAME.match(rest)))


def default_key_file() -> Path:
    """``Layout.secrets_key_file()``: outside the data directory, so neither copies of it
    nor ``hangar backup`` take the key."""
    return Layout.secrets_key_file()


def load_key(path: Path, create: bool = True) -> bytes | None:
    """The vault's key from ``path``, made there (0600, in a folder made 0700) when it is
    missing and ``create`` (else None). Raises ConfigError when the file is unreadable,
    not 32 bytes, or readable by others than its owner."""
    path = Path(path)
    try:
        if not path.exists() and not create:
            return None
        if not path.exists():
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(_random.token_bytes(KEY_BYTES))
                f.flush()
                os.fsync(f.fileno())
        st = path.stat()
        if st.st_mode & 0o077:
            raise ConfigError(f"the vault's key file {path} is readable by others: "
                              f"chmod 600 {path}")
        key = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read or make the vault's key file {path}: "
                          f"{exc.strerror or exc}") from None
    if len(key) != KEY_BYTES:
        raise ConfigError(f"the vault's key file {path} is not {KEY_BYTES} bytes")
    return key


class Vault:
    """Secrets and sandboxes' bindings to them, in the server's store (see the module
    docstring). ``key`` is the vault's key, or None to read ``key_file`` on first use."""

    def __init__(self, store: Store, key_file: Path, key: bytes | None = None) -> None:
        self.store = store
        self.key_file = key_file
        self._key = key
        self._env: dict[str, dict[str, str]] = {}
        """``env`` by owner, read once: this server alone writes bindings."""
        for table in (SecretRecord.__table__, SecretBindingRecord.__table__):
            table.create(store.engine, checkfirst=True)  # type: ignore[attr-defined]

    # -- sealing --------------------------------------------------------------------------

    def _aead(self) -> AESGCM:
        if self._key is None:
            self._key = load_key(self.key_file)
            assert self._key is not None
        return AESGCM(self._key)

    def seal(self, label: str, plain: bytes) -> str:
        """``plain`` encrypted and authenticated under the vault's key, bound to ``label``."""
        nonce = _random.token_bytes(NONCE_BYTES)
        return base64.b64encode(nonce + self._aead().encrypt(nonce, plain,
                                                             label.encode())).decode()

    def open(self, label: str, sealed: str) -> bytes:
        """What ``seal(label, ...)`` sealed. Raises ConfigError when it does not open (another
        key, or a record moved or changed)."""
        try:
            raw = base64.b64decode(sealed)
            return self._aead().decrypt(raw[:NONCE_BYTES], raw[NONCE_BYTES:], label.encode())
        except (ValueError, InvalidTag):
            raise ConfigError(f"the vault cannot open {label!r}: it was sealed under another "
                              f"key than {self.key_file}'s, or changed") from None

    # -- secrets ------------------------------------------------------------------------

    def list(self) -> list[SecretRecord]:
        """The secrets the acting team may see, by stored name."""
        return sorted((r for r in self.store.list(SecretRecord) if name_visible(r.name)),
                      key=lambda r: r.name)

    def held_by(self, team: str) -> int:
        """How many secrets team ``team`` holds (stored as ``TEAM/name``)."""
        return sum(1 for r in self.store.list(SecretRecord)
                   if r.name.startswith(team + SCOPE_SEP))

    def get(self, name: str) -> SecretRecord:
        """The secret the acting team calls ``name`` (``scoped``; the operator may also
        give a team's whole ``TEAM/name``). Raises NotFound, for another team's secret in
        the very words of a missing one."""
        name = name or ""
        if NAME.match(name):
            stored: str | None = scoped(name)
        else:
            stored = name if acting() is None and stored_name(name) else None
        rec = self.store.find(SecretRecord, stored) if stored is not None else None
        if rec is None or not name_visible(rec.name):
            raise NotFound(f"no secret {name[:64]!r}")
        return rec

    def add(self, name: str, value: str, hosts: list[str]) -> SecretRecord:
        """Store a new secret, the acting team's (stored as ``scoped(name)``). Raises
        InvalidRequest (bad input), Conflict (name taken), LimitExceeded is not used: past
        ``MAX_SECRETS`` it is InvalidRequest."""
        if not NAME.match(name or ""):
            raise InvalidRequest(f"a secret's name matches {SECRET_NAME}")
        hosts = self._checked(value, hosts)
        shown, name = name, scoped(name)
        if self.store.find(SecretRecord, name) is not None:
            raise Conflict(f"a secret named {shown!r} exists; rotate it (hangar secret rotate, "
                           f"rotate_secret, PUT /secrets/{shown})")
        if len(self.store.list(SecretRecord)) >= MAX_SECRETS:
            raise InvalidRequest(f"this server keeps at most {MAX_SECRETS} secrets")
        now = time.time()
        rec = SecretRecord(name=name, hosts=hosts, sealed=self.seal(name, value.encode()),
                           created_at=now, updated_at=now)
        try:
            self.store.add(rec)
        except Exception as exc:  # a concurrent add of the same name (primary key)
            if "UNIQUE" in str(exc):
                raise Conflict(f"a secret named {shown!r} exists") from None
            raise
        return rec

    def rotate(self, name: str, value: str, hosts: list[str] | None) -> SecretRecord:
        """Replace a secret's value (and hosts). Raises NotFound, InvalidRequest."""
        old = self.get(name)
        hosts = self._checked(value, hosts if hosts is not None else list(old.hosts))
        rec = self.store.change(SecretRecord, old.name, hosts=hosts, updated_at=time.time(),
                                sealed=self.seal(old.name, value.encode()))
        if rec is None:
            raise NotFound(f"no secret {name!r}")
        return rec

    def delete(self, name: str) -> None:
        """Raises NotFound. Sandboxes bound to it refuse its placeholder from then on."""
        self.store.remove(SecretRecord, self.get(name).name)

    @staticmethod
    def _checked(value: str, hosts: list[str]) -> list[str]:
        try:
            check_value(value)
            return check_hosts(list(hosts))
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None

    # -- bindings -----------------------------------------------------------------------

    def check_request(self, wanted: Mapping[str, str] | None) -> dict[str, str]:
        """A create's ``secrets`` ({variable: secret name}), checked: names and variables
        well formed, at most ``MAX_SECRETS_PER_SANDBOX``, every secret stored and the
        acting team's (``get``). Returns {variable: stored name}. Raises InvalidRequest,
        NotFound (naming the missing secret; another team's is missing)."""
        if not wanted:
            return {}
        if len(wanted) > MAX_SECRETS_PER_SANDBOX:
            raise InvalidRequest(f"a sandbox takes at most {MAX_SECRETS_PER_SANDBOX} secrets")
        out: dict[str, str] = {}
        for var, name in wanted.items():
            if not isinstance(var, str) or not ENV.match(var) or var in CA_ENV:
                raise InvalidRequest(f"secrets: {str(var)[:64]!r} is not a variable name a "
                                     f"secret can take ({ENV_NAME}, not one of "
                                     f"{', '.join(CA_ENV)})")
            if not isinstance(name, str) or not NAME.match(name):
                raise InvalidRequest(f"secrets[{var}]: a secret's name matches {SECRET_NAME}")
            out[var] = self.get(name).name
        return out

    def bind(self, owner: str, wanted: Mapping[str, str], ca_cert: str, ca_key: bytes) -> None:
        """Give ``owner`` (a new sandbox) a placeholder per variable of ``wanted`` (checked
        by ``check_request``) and its proxy's CA."""
        env = {var: {"secret": name, "placeholder": f"hangar-secret-{_random.token_hex(16)}"}
               for var, name in wanted.items()}
        self._env.pop(owner, None)
        self.store.remove(SecretBindingRecord, owner)
        self.store.add(SecretBindingRecord(owner=owner, env=env, ca_cert=ca_cert,
                                           ca_key=self.seal(f"ca:{owner}", ca_key)))

    def binding(self, owner: str) -> SecretBindingRecord | None:
        """``owner``'s binding (a sandbox's or a snapshot's), or None: it has no secrets."""
        rec = self.store.find(SecretBindingRecord, owner)
        return rec if rec is not None and isinstance(rec.env, dict) and rec.env else None

    def copy(self, src: str, dst: str) -> bool:
        """Give ``dst`` the binding of ``src`` (a snapshot of a sandbox, a fork or restore of
        a snapshot): the same placeholders and CA. False when ``src`` has none (``dst``'s
        own, if any, is removed)."""
        rec = self.binding(src)
        self._env.pop(dst, None)
        self.store.remove(SecretBindingRecord, dst)
        if rec is None:
            return False
        key = self.open(f"ca:{src}", rec.ca_key)
        self.store.add(SecretBindingRecord(owner=dst, env=dict(rec.env), ca_cert=rec.ca_cert,
                                           ca_key=self.seal(f"ca:{dst}", key)))
        return True

    def forget(self, owner: str) -> None:
        """Remove ``owner``'s binding (its sandbox or snapshot is gone); never raises."""
        self._env.pop(owner, None)
        try:
            self.store.remove(SecretBindingRecord, owner)
        except Exception:
            pass

    def owners(self) -> list[str]:
        """Every id that holds a binding (for the recovery's sweep)."""
        return [r.owner for r in self.store.list(SecretBindingRecord)]

    def env(self, owner: str) -> dict[str, str]:
        """The variables a sandbox's commands get: its placeholders and ``CA_ENV``; {} for a
        sandbox without secrets. Read from the store once per owner."""
        got = self._env.get(owner)
        if got is not None:
            return dict(got)
        rec = self.binding(owner)
        if rec is None:
            got = {}
        else:
            got = {**CA_ENV, **{var: str(b.get("placeholder", "")) for var, b in rec.env.items()
                                if isinstance(b, dict)
                                and PLACEHOLDER.match(str(b.get("placeholder", "")))}}
        if len(self._env) > 4096:
            self._env.clear()
        self._env[owner] = got
        return dict(got)

    def ca(self, owner: str) -> tuple[str, bytes] | None:
        """(CA certificate PEM, CA key PEM) of ``owner``'s proxy, or None."""
        rec = self.binding(owner)
        if rec is None:
            return None
        return rec.ca_cert, self.open(f"ca:{owner}", rec.ca_key)

    def resolved(self, owner: str) -> dict[str, dict[str, Any]]:
        """What ``owner``'s proxy substitutes: ``{placeholder: {"name", "value", "hosts"}}``.
        A placeholder whose secret is gone has no value: the proxy refuses it everywhere.
        The one place a value is opened; hand it only to the proxy."""
        rec = self.binding(owner)
        out: dict[str, dict[str, Any]] = {}
        if rec is None:
            return out
        for b in rec.env.values():
            if not isinstance(b, dict) or not PLACEHOLDER.match(str(b.get("placeholder", ""))):
                continue
            name = str(b.get("secret", ""))
            sec = self.store.find(SecretRecord, name) if stored_name(name) else None
            value = self.open(name, sec.sealed).decode() if sec is not None else None
            # named in refusals and events as its sandbox's team calls it (its own team's)
            out[b["placeholder"]] = {"name": name.split(SCOPE_SEP, 1)[-1], "value": value,
                                     "hosts": list(sec.hosts) if sec is not None else []}
        return out


def with_env(cmd: Any, base: Mapping[str, str]) -> Any:
    """``cmd`` (a ``hangar.core.commands.Command``) with ``base`` under its own env (the
    caller's variables win); ``cmd`` itself when ``base`` is empty."""
    if not base:
        return cmd
    import dataclasses

    return dataclasses.replace(cmd, env={**base, **(cmd.env or {})})
