"""A sandbox's egress rules at run time: domain guarding and ``PATCH /sandboxes/{id}/network``.

``NetworkRules`` sits between the launcher (``hangar.core.launch``) and the
network (``hangar.net``): when a sandbox's NIC is attached it starts the
domain guard (``hangar.net.egress.EgressGuard``) for a policy with domain
entries, when it is released it stops it, and ``change`` replaces a
sandbox's ``allow``/``deny`` lists while it runs.

What ``change`` may do:

* ``allow`` and ``deny`` (each optional: an omitted list is kept), any
  entry ``hangar.net.policy`` takes; ``egress`` between ``internet`` and
  ``open``. Turning a NIC on or off (``none``) is refused (``Conflict``,
  409): that needs a new VM.
* The record is updated first (a sandbox that sleeps, or restarts, gets the
  new rules on its next attach); then, when its NIC is attached here, the
  kernel's rules are replaced in one nft transaction and the guard's rules
  at once, so new connections (and DNS queries) see them within
  milliseconds. Established flows are not cut.

Denials are published as ``egress.denied`` events (sandbox id, domain or
address, port, reason, via) and counted in ``hangar_egress_denied_total``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from hangar.core.context import Context
from hangar.errors import Conflict, InvalidRequest
from hangar.net import NetAttachment, Policy
from hangar.net.egress import EgressGuard

log = logging.getLogger("hangar.network")


class NetworkRules:
    """Live egress rules of this server's sandboxes (see the module docstring)."""

    def __init__(self, ctx: Context, net: Any) -> None:
        self.ctx = ctx
        self.net = net
        self.guard: EgressGuard | None = None
        if net is not None:
            self.guard = EgressGuard(
                net, publish=ctx.publish,
                per_sandbox=ctx.settings.egress_max_flows_per_sandbox,
                on_denied=lambda via, reason: ctx.metrics.egress_denied.labels(
                    via, reason).inc())
        self._lock = asyncio.Lock()

    async def attached(self, sandbox_id: str, nic: NetAttachment | None,
                       policy: dict[str, Any] | None) -> None:
        """A NIC was attached: guard it when its policy has domain entries. Raises what
        the redirect raises (the launch then fails and cleans up)."""
        if self.guard is None or nic is None or nic.kind != "tap" or not policy:
            return
        pol = Policy.parse(policy)
        if pol.has_domains:
            await self.guard.enable(sandbox_id, nic.ip, pol)

    async def adopt(self, records: list[Any]) -> None:
        """Guard again the adopted sandboxes (a restarted server) whose policy has domain
        entries: their redirects are pointed at this process's forwarder and proxy."""
        if self.guard is None or self.net.mode != "tap":
            return
        leases = self.net.leases()
        for rec in records:
            ip = leases.get(rec.id)
            if ip is None or not rec.network:
                continue
            try:
                pol = Policy.parse(rec.network)
                if pol.has_domains:
                    await self.guard.enable(rec.id, ip, pol)
                    log.info("egress guard restored", extra={"sandbox_id": rec.id, "ip": ip})
            except Exception as exc:  # one sandbox must not keep the server down
                log.warning("egress guard not restored", extra={"sandbox_id": rec.id,
                                                                "error": str(exc)})

    async def released(self, sandbox_id: str) -> None:
        """The NIC is going: stop guarding it (its rules go with the release)."""
        if self.guard is not None:
            await self.guard.disable(sandbox_id)

    def rules(self, sandbox_id: str) -> dict[str, Any] | None:
        """The live rule dict (``hangar.net.egress_match``) of a guarded sandbox, or None."""
        return None if self.guard is None else self.guard.rules(sandbox_id)

    async def change(self, sandbox_id: str, *, allow: list[str] | None = None,
                     deny: list[str] | None = None, egress: str | None = None
                     ) -> dict[str, Any]:
        """Replace the sandbox's rules; returns the policy as stored. Raises NotFound/Gone
        (no such sandbox), Conflict (no NIC, or a change to or from ``none``),
        InvalidRequest (a bad entry, or rules this server cannot enforce), EngineError."""
        async with self._lock:
            rec = self.ctx.record(sandbox_id)
            if not rec.network:
                raise Conflict(f"sandbox {sandbox_id} has no network (egress 'none'); a NIC "
                               "cannot be added to a running sandbox", sandbox_id=sandbox_id)
            if egress == "none":
                raise Conflict("egress 'none' would remove the sandbox's NIC; create a new "
                               "sandbox for that", sandbox_id=sandbox_id)
            if self.net is None:
                raise InvalidRequest("guest networking is off on this server")
            wanted = {"egress": egress or rec.network.get("egress", "internet"),
                      "allow": rec.network.get("allow", []) if allow is None else allow,
                      "deny": rec.network.get("deny", []) if deny is None else deny}
            pol = self.net.check(wanted)  # InvalidRequest: bad entry or not enforceable
            stored = pol.model_dump(mode="json")
            self.ctx.store.update(sandbox_id, network=stored)
            ip = self._ip(sandbox_id)
            if ip is not None:
                await self.net.set_rules_async(sandbox_id, pol)
                if self.guard is not None:
                    await self.guard.update(sandbox_id, ip, pol)
            log.info("egress rules changed", extra={"sandbox_id": sandbox_id,
                                                    "entries": len(pol.allow) + len(pol.deny),
                                                    "live": ip is not None})
            return stored

    def _ip(self, sandbox_id: str) -> str | None:
        """The guest address when this server holds the sandbox's TAP lease."""
        if self.net is None or self.net.mode != "tap":
            return None
        return self.net.leases().get(sandbox_id)

    async def close(self) -> None:
        """Stop the guard's forwarder and proxy."""
        if self.guard is not None:
            await self.guard.close()
