"""A guest's identity: hostname, machine-id and fork generation (standard library only).

Every sandbox is a distinct machine, forks included:

=============================  ================================================================
``hostname``                   the sandbox's id: set at boot from ``hangar.hostname=`` (by
                               ``hangar.guest.init``), and again by the agent's ``identity``
                               operation after a fork or restore (``/proc/sys/kernel/hostname``,
                               ``/etc/hostname``, the ``127.0.1.1`` line of ``/etc/hosts``)
``/etc/machine-id``            32 lowercase hex digits (machine-id(5)): written fresh at every
                               boot from the kernel's random pool, and replaced with one the
                               host draws after every fork or restore from a snapshot, so no
                               two copies share it (``/var/lib/dbus/machine-id`` too, when it
                               is a file of its own)
``/run/hangar/fork-generation``  a decimal number and a newline: 0 after a boot; after each fork
                               or restore from a snapshot, a number the host draws from one
                               server-wide sequence that only grows, so it grows along every
                               lineage and no two copies share it
=============================  ================================================================

The generation file is replaced by rename (write a temporary file, then
``rename``), so a program can watch ``/run/hangar`` with inotify
(``IN_MOVED_TO``) or read the file when it is about to draw random numbers:
a number other than the one it saw last means its memory was copied, and
any random state it holds in userspace (a PRNG seeded once, a UUID
generator, a TLS session cache) is shared with another machine and must be
reseeded. The kernel's own pool is reseeded by the host on every restore
(the agent's ``reseed``), so ``getrandom(2)`` and ``/dev/urandom`` need
nothing.
"""

from __future__ import annotations

import os

from hangar.guest import paths

MACHINE_ID = "/etc/machine-id"
DBUS_MACHINE_ID = "/var/lib/dbus/machine-id"
RUN_DIR = paths.RUN_DIR
GENERATION_FILE = paths.FORK_GENERATION
MACHINE_ID_HEX = 32


def valid_hostname(name: str) -> bool:
    """True for one DNS label of letters, digits and inner hyphens, 1-63 characters."""
    if not 0 < len(name) <= 63 or name.startswith("-") or name.endswith("-"):
        return False
    return all(c.isascii() and (c.isalnum() or c == "-") for c in name)


def valid_machine_id(value: str) -> bool:
    """True for 32 lowercase hex digits, not all zero (machine-id(5))."""
    return (len(value) == MACHINE_ID_HEX and all(c in "0123456789abcdef" for c in value)
            and value.strip("0") != "")


def replace_file(path: str, text: str, mode: int = 0o644) -> None:
    """Write ``text`` to ``path`` by rename, so readers see the old or the new whole file."""
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        os.write(fd, text.encode())
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def set_hostname(name: str) -> list[str]:
    """Set the kernel's hostname and /etc/hostname and /etc/hosts; returns what failed."""
    failed = []
    try:
        with open("/proc/sys/kernel/hostname", "w") as f:
            f.write(name)
    except OSError as e:
        failed.append(f"kernel hostname: {e}")
    try:
        replace_file("/etc/hostname", name + "\n")
        try:
            with open("/etc/hosts") as f:
                hosts = f.read()
        except FileNotFoundError:
            hosts = "127.0.0.1\tlocalhost\n"
        line = f"127.0.1.1\t{name}"
        if line not in hosts.splitlines():
            kept = [ln for ln in hosts.splitlines() if not ln.startswith("127.0.1.1")]
            replace_file("/etc/hosts", "\n".join(kept + [line]) + "\n")
    except OSError as e:
        failed.append(f"/etc/hostname or /etc/hosts: {e}")
    return failed


def new_machine_id() -> str:
    """32 hex digits from the kernel's pool (``/dev/urandom`` never blocks, even at boot)."""
    with open("/dev/urandom", "rb") as f:
        return f.read(16).hex()


def set_machine_id(value: str) -> None:
    """Write ``value`` to /etc/machine-id (and dbus's copy when it is a file). Raises OSError."""
    replace_file(MACHINE_ID, value + "\n", 0o444)
    if os.path.isfile(DBUS_MACHINE_ID) and not os.path.islink(DBUS_MACHINE_ID):
        replace_file(DBUS_MACHINE_ID, value + "\n", 0o444)


def write_generation(generation: int) -> None:
    """Replace ``paths.FORK_GENERATION`` with ``generation``. Raises OSError."""
    os.makedirs(RUN_DIR, exist_ok=True)
    replace_file(GENERATION_FILE, f"{generation}\n")


def read_generation() -> int:
    """The fork generation in ``paths.FORK_GENERATION``; 0 when there is none."""
    try:
        with open(GENERATION_FILE) as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):
        return 0
