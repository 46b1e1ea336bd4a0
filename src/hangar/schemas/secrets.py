"""Wire schemas of the vault: ``/secrets`` and a create's ``secrets`` (docs/security.md,
"Secrets and the vault").

A secret's value goes in (``CreateSecret``, ``RotateSecret``) and never comes out: every
answer (``SecretInfo``) names a secret and its hosts only.
"""

from __future__ import annotations

import re

from pydantic import ConfigDict, Field, field_validator

from hangar.schemas.base import Model, RequestBody

SECRET_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
"""A secret's name: 1-63 of ``A-Za-z0-9._-``, starting with a letter or digit."""
ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]{0,127}$"
"""The environment variable a sandbox sees a secret's placeholder in."""
MAX_VALUE_BYTES = 8192
"""Longest secret value, bytes of UTF-8 (it travels in an HTTP header)."""
MAX_HOSTS = 16
"""Most hosts one secret may be sent to."""
MAX_SECRETS_PER_SANDBOX = 16
"""Most secrets one sandbox may be given."""
HOST = re.compile(r"^(\*\.)?([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)*"
                  r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
"""A host a secret may go to: a DNS name (lower case), or ``*.`` and a name, which matches
every name under it (not the name itself)."""


def check_value(value: str) -> str:
    """A secret's value: 1 to ``MAX_VALUE_BYTES`` bytes, printable in an HTTP header (no
    control characters: no CR, LF or NUL). Raises ValueError."""
    size = len(value.encode("utf-8", "surrogatepass"))
    if not 1 <= size <= MAX_VALUE_BYTES:
        raise ValueError(f"a secret's value is 1 to {MAX_VALUE_BYTES} bytes; got {size}")
    if any(ord(c) < 0x20 or ord(c) == 0x7f for c in value):
        raise ValueError("a secret's value must not hold control characters (CR, LF, NUL...): "
                         "it is sent in an HTTP header")
    return value


def check_hosts(hosts: list[str]) -> list[str]:
    """Hosts as the vault keeps them: lower case, no trailing dot, each at most 253 bytes,
    1 to ``MAX_HOSTS`` of them, no repeats. Raises ValueError naming the bad one."""
    if not 1 <= len(hosts) <= MAX_HOSTS:
        raise ValueError(f"a secret names 1 to {MAX_HOSTS} hosts; got {len(hosts)}")
    out: list[str] = []
    for raw in hosts:
        host = raw.strip().lower().rstrip(".")
        if len(host) > 253 or not HOST.match(host):
            raise ValueError(f"host {raw[:80]!r} is not a DNS name or '*.' and a name "
                             "(e.g. api.github.com, *.example.test)")
        if host not in out:
            out.append(host)
    return out


class CreateSecret(RequestBody):
    """Body of ``POST /secrets``: a new secret (409 if the name is taken)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=SECRET_NAME, description="1-63 of A-Za-z0-9._-.")
    value: str = Field(max_length=MAX_VALUE_BYTES,
                       description=f"The secret, at most {MAX_VALUE_BYTES} bytes, no control "
                                   "characters. Stored encrypted; never shown again.")
    hosts: list[str] = Field(max_length=MAX_HOSTS, description=(
        "Hosts the proxy may send it to: names, or '*.' and a name for every name under it."))

    _value = field_validator("value")(classmethod(lambda cls, v: check_value(v)))
    _hosts = field_validator("hosts")(classmethod(lambda cls, v: check_hosts(v)))


class RotateSecret(RequestBody):
    """Body of ``PUT /secrets/{name}``: a new value (and hosts) for an existing secret."""

    model_config = ConfigDict(extra="forbid")

    value: str = Field(max_length=MAX_VALUE_BYTES, description="The new value.")
    hosts: list[str] | None = Field(None, max_length=MAX_HOSTS,
                                    description="New hosts; null keeps the old ones.")

    _value = field_validator("value")(classmethod(lambda cls, v: check_value(v)))
    _hosts = field_validator("hosts")(classmethod(
        lambda cls, v: None if v is None else check_hosts(v)))


class SecretInfo(Model):
    """A secret as the API shows it: never its value."""

    name: str
    hosts: list[str]
    created_at: float = Field(description="Unix time, seconds.")
    updated_at: float = Field(description="Unix time of the last rotation, seconds.")


class SecretList(Model):
    secrets: list[SecretInfo]
