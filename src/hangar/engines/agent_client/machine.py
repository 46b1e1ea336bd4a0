"""The calls on the guest as a machine, host side: ``hello``, ``set_time``, ``reseed``, ``identity``.

``MachineCalls`` adds one typed method per operation to a ``Connection`` (the
guest's side: ``hangar.guest.ops.machine``): a liveness probe (``ping``), and
what makes a restored or forked guest a machine of its own: the host's time
(``set_time``), fresh entropy (``reseed``), and a name, machine-id and fork
generation (``set_identity``). Their answers are read here: ``ClockSet``,
``Reseeded``, ``Identity``; an answer that is something else is one
``GuestError``.

Each call keeps to ``deadlines.control_s`` unless it takes a deadline of its
own (else ``Timeout``, and ``on_unanswered`` is called).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

from hangar.engines.agent_client.connection import Connection
from hangar.engines.agent_client.results import int_or_none
from hangar.errors import GuestError

MAX_TEXT = 256
"""Characters kept of a host name or machine-id the guest sends."""


@dataclass(frozen=True)
class ClockSet:
    """The answer to ``set_time``: by how much the guest's clock moved (seconds; negative
    when it was ahead of the time sent)."""

    skew_s: float


@dataclass(frozen=True)
class Reseeded:
    """The answer to ``reseed``: seed ``bytes`` taken, and whether the kernel's CRNG was
    ``reseeded`` (false: the seed was only mixed into its pool)."""

    bytes: int
    reseeded: bool


@dataclass(frozen=True)
class Identity:
    """The guest's identity as it now is: its ``hostname``, ``machine_id`` (32 hex digits,
    None when it has none) and fork ``generation``."""

    hostname: str
    machine_id: str | None
    generation: int


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError("not a number")
    return float(value)


class MachineCalls(Connection):
    """The calls on the guest as a machine (see the module docstring); a mixin of
    ``AgentClient``."""

    async def ping(self, deadline_s: float | None = None) -> dict[str, Any]:
        """Ask the agent ``hello`` again (a liveness probe); its HELLO meta (protocol,
        boot id, ...). The agent must answer within ``deadline_s`` seconds (default
        ``deadlines.control_s``). Raises Timeout, GuestError."""
        return await self.call("hello", deadline_s=deadline_s)

    async def set_time(self, unix_ns: int) -> ClockSet:
        """Set the guest's wall clock to ``unix_ns`` (nanoseconds since the epoch); by how
        much it moved. Raises InvalidRequest, GuestError (the guest may not set its
        clock), Timeout."""
        meta = await self.call("set_time", unix_ns=unix_ns)
        try:
            return ClockSet(_number(meta.get("skew_s")))
        except TypeError:
            raise GuestError("the guest agent sent a malformed set_time answer") from None

    async def reseed(self, seed: bytes) -> Reseeded:
        """Mix ``seed`` into the guest kernel's entropy pool and reseed its CRNG. Raises
        InvalidRequest, GuestError, Timeout."""
        meta = await self.call("reseed", seed=base64.b64encode(seed).decode())
        taken = int_or_none(meta.get("bytes"))
        if taken is None or not isinstance(meta.get("reseeded"), bool):
            raise GuestError("the guest agent sent a malformed reseed answer")
        return Reseeded(taken, meta["reseeded"])

    async def set_identity(self, hostname: str | None = None, machine_id: str | None = None,
                           generation: int | None = None) -> Identity:
        """Give the guest a ``hostname`` (one DNS label), a ``machine_id`` (32 lowercase
        hex digits) and a fork ``generation`` (>= 0); each left as it is when None. The
        three as they now are. Raises InvalidRequest (a bad value), GuestError (the
        guest could not write them), Timeout."""
        given: dict[str, Any] = {"hostname": hostname, "machine_id": machine_id,
                                 "generation": generation}
        meta = await self.call("identity", **{k: v for k, v in given.items() if v is not None})
        hostname_now, machine_now = meta.get("hostname"), meta.get("machine_id")
        generation_now = int_or_none(meta.get("generation"))
        if not isinstance(hostname_now, str) or generation_now is None \
                or not (machine_now is None or isinstance(machine_now, str)):
            raise GuestError("the guest agent sent a malformed identity answer")
        return Identity(hostname_now[:MAX_TEXT],
                        None if machine_now is None else machine_now[:MAX_TEXT],
                        generation_now)
