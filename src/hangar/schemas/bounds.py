"""Bounds on client-set strings that the server stores or passes on: one rule, one place.

Every string a client sets and the server keeps (a sandbox's metadata, E2B's
``envVars``, names, network rules) has a length bound here, and a request over
one gets 400 ``invalid_request`` naming the field and the limit. Both APIs
use these checks: Hangar's (``hangar.schemas``' request bodies, as pydantic
validators) and E2B's (``hangar.api.e2b.models``). Bounds that come from the
guest kernel (an argument, an environment variable, a path: ``MAX_ARG_STRLEN``,
``PATH_MAX``) live in ``hangar.schemas.base``.

Metadata is opaque to the server: it is stored as given and shown back, and
nothing in Hangar reads it as state (``hangar.core.store``). Its bounds keep
one record small: at most ``METADATA_ENTRIES`` entries, a key of 1 to
``METADATA_KEY_BYTES`` bytes (UTF-8), a value of at most ``METADATA_VALUE_BYTES``
bytes, and ``METADATA_TOTAL_BYTES`` in all (keys plus values). The figures
follow Kubernetes' annotations (a key of at most 253 + 63 bytes; 256 KiB in all)
cut to what a sandbox's label needs.

Numeric bounds that several places check (a request body, the server's
settings, a template file, the CLI, the agent client) are named here too, and
imported wherever they are checked: a sandbox's size (``VCPUS_*``,
``MEMORY_MIB_*``, ``DISK_MIB_*``), the longest time to live (``TTL_MAX_S``), the
longest command (``EXEC_TIMEOUT_MAX_S``), a TCP port (``PORT_*``) and a desktop's size
(``DESKTOP_MAX_PIXELS``). A test (tests/test_bounds.py) finds no second spelling of them in
the source.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from hangar.schemas.base import _show, _utf8_len

METADATA_ENTRIES = 64
"""Most entries in one sandbox's metadata."""
METADATA_KEY_BYTES = 256
"""Longest metadata key, bytes of UTF-8."""
METADATA_VALUE_BYTES = 4096
"""Longest metadata value, bytes of UTF-8."""
METADATA_TOTAL_BYTES = 64 * 1024
"""Most bytes of one sandbox's metadata, keys and values together (UTF-8)."""
ENV_ENTRIES = 256
"""Most default environment variables of a sandbox (E2B's ``envVars``)."""
ENV_TOTAL_BYTES = 256 * 1024
"""Most bytes of a sandbox's default environment (``NAME=value`` strings, UTF-8)."""
NAME_BYTES = 256
"""Longest name a client gives (a template, a snapshot name, a tag), bytes."""
RULES = 256
"""Most entries in one list of network rules (E2B's ``allowOut``, ``denyOut``)."""
RULE_BYTES = 256
"""Longest network rule (an address or CIDR), bytes."""
QUERY_BYTES = 8192
"""Longest filter a list takes in its query (E2B's ``metadata=k=v&...``), bytes."""

VCPUS_MIN = 1
VCPUS_MAX = 32
"""The virtual CPUs a sandbox, machine or template may ask for."""
MEMORY_MIB_MIN = 128
MEMORY_MIB_MAX = 65536
"""The guest memory a sandbox, machine or template may ask for (and the server's default
may be), MiB."""
DISK_MIB_MIN = 512
DISK_MIB_MAX = 1 << 20
"""The writable disk a sandbox or machine may ask for (and the server's default may be),
MiB (512 MiB to 1 TiB; the server's ``max_disk_mib`` may cap it lower)."""
TTL_MAX_S = 30 * 86400
"""Longest time to live a client may set (a sandbox's or machine's ``timeout``, a machine's
``idle_timeout``, a port URL's ``token_ttl``, and the server's default of the last),
seconds: 30 days."""
EXEC_TIMEOUT_MAX_S = 86400
"""Longest a command may run (an exec's, a process's or a code run's ``timeout``), seconds:
24 h; also what an exec without a timeout gets (the agent client's ``exec_max_s``)."""
PORT_MIN = 1
PORT_MAX = 65535
"""A TCP port, in a guest or on the host."""
DESKTOP_MAX_PIXELS = 4096 * 4096
"""Most pixels (width x height) of a sandbox's desktop: the largest screen a screenshot is
decoded (and scaled) for, at 1.2 s of CPU and 180 MiB a shot (review 29k K-M1); 4K
(3840x2160 or 4096x2160), 4096x4096 and 8192x2048 fit. Each side is also 64..8192 pixels
(``hangar.guest.desktop.MAX_SIDE``, what Xvfb is started with)."""

__all__ = ["DESKTOP_MAX_PIXELS", "DISK_MIB_MAX", "DISK_MIB_MIN", "ENV_ENTRIES",
           "ENV_TOTAL_BYTES", "EXEC_TIMEOUT_MAX_S", "MEMORY_MIB_MAX", "MEMORY_MIB_MIN",
           "METADATA_ENTRIES", "METADATA_KEY_BYTES", "METADATA_TOTAL_BYTES",
           "METADATA_VALUE_BYTES", "NAME_BYTES", "PORT_MAX", "PORT_MIN", "QUERY_BYTES", "RULES",
           "RULE_BYTES", "TTL_MAX_S", "VCPUS_MAX", "VCPUS_MIN", "check_desktop_size",
           "check_env_vars", "check_metadata", "check_name", "check_network", "check_rules"]


def check_metadata(value: Mapping[str, str] | None,
                   field: str = "metadata") -> Mapping[str, str] | None:
    """A sandbox's metadata within the bounds above. Raises ValueError naming ``field``,
    the key and the limit it passes."""
    if value is None:
        return None
    if len(value) > METADATA_ENTRIES:
        raise ValueError(f"{field} has {len(value)} entries; at most {METADATA_ENTRIES} "
                         "are taken")
    total = 0
    for key, val in value.items():
        k, v = _utf8_len(key), _utf8_len(val)
        if not k:
            raise ValueError(f"{field} has an empty key")
        if k > METADATA_KEY_BYTES:
            raise ValueError(f"{field} key {_show(key)} is {k} bytes; keys are at most "
                             f"{METADATA_KEY_BYTES} bytes")
        if v > METADATA_VALUE_BYTES:
            raise ValueError(f"{field}[{_show(key)}] is {v} bytes; values are at most "
                             f"{METADATA_VALUE_BYTES} bytes")
        total += k + v
    if total > METADATA_TOTAL_BYTES:
        raise ValueError(f"{field} is {total} bytes in all (keys and values); at most "
                         f"{METADATA_TOTAL_BYTES} are taken")
    return value


def check_env_vars(value: Mapping[str, str] | None,
                   field: str = "envVars") -> Mapping[str, str] | None:
    """A sandbox's default environment: names without ``=`` or NUL, no NUL in values, at
    most ``ENV_ENTRIES`` variables and ``ENV_TOTAL_BYTES`` bytes. Raises ValueError."""
    if value is None:
        return None
    if len(value) > ENV_ENTRIES:
        raise ValueError(f"{field} has {len(value)} variables; at most {ENV_ENTRIES} are taken")
    total = 0
    for name, val in value.items():
        if not name or "=" in name or "\0" in name:
            raise ValueError(f"{field}: {_show(name)} is not a variable name")
        if "\0" in val:
            raise ValueError(f"{field}[{_show(name)}] must not contain NUL bytes")
        total += _utf8_len(name) + 1 + _utf8_len(val)
    if total > ENV_TOTAL_BYTES:
        raise ValueError(f"{field} is {total} bytes in all (NAME=value); at most "
                         f"{ENV_TOTAL_BYTES} are taken")
    return value


def check_name(value: str | None, field: str, limit: int = NAME_BYTES) -> str | None:
    """A client-given name of at most ``limit`` bytes, without NUL. Raises ValueError."""
    if value is None:
        return None
    n = _utf8_len(value)
    if n > limit:
        raise ValueError(f"{field} is {n} bytes; at most {limit} are taken")
    if "\0" in value:
        raise ValueError(f"{field} must not contain NUL bytes")
    return value


def check_network(value: object, field: str = "network") -> object:
    """An egress policy as a create sends it: a name of at most ``NAME_BYTES``, or a dict
    of at most 8 keys whose ``allow``/``deny`` lists pass ``check_rules``. The policy's
    meaning is checked where it is built (``hangar.net``). Raises ValueError."""
    if isinstance(value, str):
        return check_name(value, field)
    if isinstance(value, dict):
        if len(value) > 8:
            raise ValueError(f"{field} has {len(value)} keys; at most 8 are taken")
        for key in ("allow", "deny"):
            rules = value.get(key)
            if isinstance(rules, list):
                check_rules([r if isinstance(r, str) else "" for r in rules], f"{field}.{key}")
        egress = value.get("egress")
        if isinstance(egress, str):
            check_name(egress, f"{field}.egress")
    return value


def check_rules(value: Iterable[str] | None, field: str) -> list[str] | None:
    """A list of network rules: at most ``RULES``, each at most ``RULE_BYTES`` bytes.
    Raises ValueError."""
    if value is None:
        return None
    rules = list(value)
    if len(rules) > RULES:
        raise ValueError(f"{field} has {len(rules)} entries; at most {RULES} are taken")
    for i, rule in enumerate(rules):
        if _utf8_len(rule) > RULE_BYTES:
            raise ValueError(f"{field}[{i}] is over {RULE_BYTES} bytes")
    return rules


def check_desktop_size(value: str | None, field: str = "desktop") -> str | None:
    """A desktop's ``WIDTHxHEIGHTxDEPTH`` (the pattern checked before) of at most
    ``DESKTOP_MAX_PIXELS`` pixels. Raises ValueError naming the size and the limit."""
    if value is None:
        return None
    w, h, _ = (int(p) for p in value.split("x"))
    if w * h > DESKTOP_MAX_PIXELS:
        raise ValueError(f"{field} {w}x{h} has {w * h} pixels, more than the "
                         f"{DESKTOP_MAX_PIXELS} (4096x4096) a desktop may have: a "
                         "screenshot decodes the whole screen")
    return value
