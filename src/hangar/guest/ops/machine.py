"""The operations on the guest as a machine: ``hello``, ``set_time``, ``reseed``, ``identity``.

The host calls the last three after a restore or a fork, so that the copy
has the right time, a fresh random pool and a name, machine-id and fork
generation of its own (``hangar.guest.identity``).
"""

from __future__ import annotations

import base64
import fcntl
import os
import struct
import time
from typing import TYPE_CHECKING, Any

from hangar.guest import identity as ident
from hangar.guest.ops.common import AgentView, OpError, os_error

if TYPE_CHECKING:
    from hangar.guest.channel import Channel

RNDADDENTROPY = 0x40085203  # _IOW('R', 0x03, int[2]), linux/random.h
RNDRESEEDCRNG = 0x5207  # _IO('R', 0x07)


async def hello(agent: AgentView, meta: dict[str, Any], ch: Channel) -> dict[str, Any]:
    """The agent's HELLO meta again (``hangar.guest.agent``): a liveness probe."""
    return agent.hello_meta()


async def set_time(agent: AgentView, meta: dict[str, Any], ch: Channel) -> dict[str, Any]:
    """Set the wall clock to ``unix_ns`` (int, ns since the epoch); ``{skew_s}``: by how much
    it moved (s). Used after a restore, whose clock stood still while it was saved."""
    ns = meta.get("unix_ns")
    if not isinstance(ns, int):
        raise OpError("invalid", "unix_ns must be an integer")
    before = time.time_ns()
    try:
        time.clock_settime_ns(time.CLOCK_REALTIME, ns)
    except OSError as exc:
        raise os_error(exc, "CLOCK_REALTIME") from None
    return {"skew_s": (ns - before) / 1e9}


async def reseed(agent: AgentView, meta: dict[str, Any], ch: Channel) -> dict[str, Any]:
    """Mix ``seed`` (base64 bytes from the host) into the kernel's pool and reseed its CRNG;
    ``{bytes, reseeded}`` (false: mixed in only). Used after every restore."""
    try:
        seed = base64.b64decode(meta.get("seed", ""), validate=True)
    except (ValueError, TypeError):
        raise OpError("invalid", "seed must be base64") from None
    reseeded = False
    with open("/dev/random", "wb") as f:
        try:
            # Credit the seed and reseed the kernel's CRNG now: a plain
            # write only mixes it in, and clones of one snapshot would
            # keep drawing the same stream until the next periodic reseed.
            fcntl.ioctl(f, RNDADDENTROPY, struct.pack("ii", len(seed) * 8, len(seed)) + seed)
            fcntl.ioctl(f, RNDRESEEDCRNG)
            reseeded = True
        except OSError:
            f.write(seed)
    return {"bytes": len(seed), "reseeded": reseeded}


async def identity(agent: AgentView, meta: dict[str, Any], ch: Channel) -> dict[str, Any]:
    """Make this guest a machine of its own after a fork or restore.

    meta: ``hostname`` (the sandbox id), ``machine_id`` (32 lowercase hex
    digits) and ``generation`` (a non-negative integer), each optional;
    see ``hangar.guest.identity``. Returns the three as they now are.
    """
    hostname = meta.get("hostname")
    machine_id = meta.get("machine_id")
    generation = meta.get("generation")
    if hostname is not None and not (isinstance(hostname, str)
                                     and ident.valid_hostname(hostname)):
        raise OpError("invalid", "hostname must be one DNS label (letters, digits, '-')")
    if machine_id is not None and not (isinstance(machine_id, str)
                                       and ident.valid_machine_id(machine_id)):
        raise OpError("invalid", "machine_id must be 32 lowercase hex digits")
    if generation is not None and (not isinstance(generation, int)
                                   or isinstance(generation, bool) or generation < 0):
        raise OpError("invalid", "generation must be a non-negative integer")
    try:
        if hostname is not None:
            failed = ident.set_hostname(hostname)
            if failed:
                raise OpError("io_error", "; ".join(failed))
        if machine_id is not None:
            ident.set_machine_id(machine_id)
        if generation is not None:
            ident.write_generation(generation)
            agent.generation = generation
    except OSError as exc:
        raise os_error(exc, "the guest's identity files") from None
    try:
        with open(ident.MACHINE_ID) as f:
            current_id = f.read().strip()
    except OSError:
        current_id = None
    return {"hostname": os.uname().nodename, "machine_id": current_id,
            "generation": agent.generation}
