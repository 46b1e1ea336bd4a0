"""Hangar's records as E2B's bodies: states, times, sandboxes, egress policies.

States: E2B knows ``running`` and ``paused``, named by the E2B column of the one
table of public state names (``hangar.core.lifecycle.PUBLIC``). A Hangar sandbox
asleep (``sleeping``), or on its way there (``snapshotting`` with desired state
``sleeping``), is ``paused``; one that is ``running``, ``unresponsive``,
``creating``, ``waking``, ``restoring`` or taking a snapshot it will run on
from is ``running``. ``stopping``, ``failed`` and ended ones are not E2B
sandboxes: they are not listed, and a call naming one is a 404 that says
which state it is in.
"""

from __future__ import annotations

import ipaddress
from datetime import UTC, datetime
from typing import Any, Literal

from hangar.api.e2b.models import (
    Lifecycle, ListedSandbox, NetworkConfig, Sandbox, SandboxDetail, SandboxMetric,
)
from hangar.core.service import (
    Face, OnExpiry, SandboxManager, SandboxView, e2b, public_name,
)
from hangar.core.service import user_metadata as core_user_metadata
from hangar.errors import InvalidRequest, NotFound

CLIENT_ID = "hangar"
"""E2B's deprecated ``clientID``: always this."""
NEVER = "9999-12-31T23:59:59Z"
"""``endAt`` of a sandbox with no time limit (E2B's field is required)."""

E2BState = Literal["running", "paused"]


def state_of(rec: SandboxView) -> E2BState | None:
    """``running``, ``paused``, or None for a sandbox E2B would not show."""
    name = public_name(rec.state, Face.E2B, rec.desired_state)
    return "paused" if name == "paused" else "running" if name == "running" else None


def visible(rec: SandboxView) -> SandboxView:
    """``rec`` when E2B shows it. Raises NotFound for one that is failed or stopping,
    saying so."""
    if state_of(rec) is None:
        why = f": {rec.error}" if rec.error else ""
        raise NotFound(f"sandbox {rec.id} is {rec.state.value}{why}", sandbox_id=rec.id)
    return rec


def shown(m: SandboxManager, sandbox_id: str) -> SandboxView:
    """The record of a sandbox E2B shows. Raises NotFound (also for one that is failed,
    stopping or gone, saying so), Gone."""
    return visible(e2b.sandbox(m, sandbox_id))


def rfc3339(t: float | None) -> str:
    """Unix seconds as an RFC 3339 UTC time; None as ``NEVER``."""
    if t is None:
        return NEVER
    return datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")


def user_metadata(rec: SandboxView) -> dict[str, str]:
    """The client's metadata of ``rec`` (``hangar.core.views.user_metadata``)."""
    return core_user_metadata(rec)


def template_names(rec: SandboxView) -> tuple[str, str | None]:
    """(``templateID``, ``alias``): the Hangar image, and the name the client asked for."""
    opts = e2b.options(rec)
    return rec.image, (opts.template if opts is not None else None)


def created(m: SandboxManager, rec: SandboxView) -> Sandbox:
    """What a create, connect, resume or fork answers: how the SDK reaches envd."""
    template, alias = template_names(rec)
    # Two capabilities, two values: the envd access token opens everything of the
    # sandbox; the traffic token its user ports only (``hangar.core.e2b.traffic_admits``).
    return Sandbox(templateID=template, sandboxID=rec.id, alias=alias, clientID=CLIENT_ID,
                   envdVersion=e2b.ENVD_VERSION, envdAccessToken=e2b.access_token(m, rec.id),
                   trafficAccessToken=e2b.traffic_token(m, rec.id), domain=m.settings.domain)


def listed(rec: SandboxView) -> ListedSandbox:
    template, alias = template_names(rec)
    return ListedSandbox(
        templateID=template, alias=alias, sandboxID=rec.id, clientID=CLIENT_ID,
        startedAt=rfc3339(rec.created_at), endAt=rfc3339(rec.expires_at),
        cpuCount=rec.vcpus, memoryMB=rec.memory_mib, diskSizeMB=rec.disk_mib,
        metadata=user_metadata(rec), state=state_of(rec) or "running",
        envdVersion=e2b.ENVD_VERSION)


def network_of(rec: SandboxView) -> tuple[bool | None, dict[str, Any] | None]:
    """(``allowInternetAccess``, E2B's ``network``) of the record's egress policy."""
    policy = rec.network
    if not policy:
        return False, None
    egress = policy.get("egress", "internet")
    net: dict[str, Any] = {}
    if policy.get("allow"):
        net["allowOut"] = list(policy["allow"])
    if policy.get("deny"):
        net["denyOut"] = list(policy["deny"])
    internet = egress != "none" and "0.0.0.0/0" not in (policy.get("deny") or [])
    return internet, net or None


def detail(m: SandboxManager, rec: SandboxView) -> SandboxDetail:
    internet, net = network_of(rec)
    return SandboxDetail(
        **listed(rec).model_dump(), envdAccessToken=e2b.access_token(m, rec.id),
        domain=m.settings.domain, allowInternetAccess=internet, network=net,
        lifecycle=Lifecycle(autoResume=True, onTimeout="pause"
                            if rec.on_expiry == OnExpiry.SLEEP else "kill"))


def metric(sample: e2b.Metric) -> SandboxMetric:
    return SandboxMetric(
        timestamp=rfc3339(sample.at), timestampUnix=int(sample.at), cpuCount=sample.cpus,
        cpuUsedPct=sample.cpu_pct, memUsed=sample.mem_used, memTotal=sample.mem_total,
        memCache=sample.mem_cache, diskUsed=sample.disk_used, diskTotal=sample.disk_total)


def _net(entry: str) -> ipaddress.IPv4Network | None:
    try:
        return ipaddress.IPv4Network(entry.strip(), strict=False)
    except ValueError:
        return None


def e2b_rules(allow: list[str], deny: list[str]) -> tuple[list[str], list[str]]:
    """Hangar's allow/deny for E2B's ``allowOut``/``denyOut`` (CIDRs, addresses, domains;
    ``hangar.net.policy`` checks them). E2B lets an allowed entry beat a denied one, Hangar
    the most specific: a denied CIDR inside (or equal to) an allowed one is left out."""
    wide = [n for n in map(_net, allow) if n is not None]
    return list(allow), [d for d in deny if (n := _net(d)) is None
                         or not any(n.subnet_of(w) for w in wide)]


def policy(allow_internet: bool | None, net: NetworkConfig | None) -> dict[str, Any] | None:
    """Hangar's egress policy for E2B's ``allow_internet_access`` and ``network``; None
    takes the server's default. Raises InvalidRequest for what Hangar cannot enforce."""
    if net is not None:
        for name in ("egressProxy", "rules"):
            if getattr(net, name):
                raise InvalidRequest(f"network.{name} is not supported by Hangar (egress "
                                     "rules are allowOut/denyOut lists)", field=name)
    allow = list(net.allowOut or []) if net else []
    deny = list(net.denyOut or []) if net else []
    if allow_internet is False and "0.0.0.0/0" not in deny:
        deny.append("0.0.0.0/0")
    if allow_internet is not False and not allow and not deny:
        return None  # E2B's default (older SDKs send allow_internet_access: true always)
    allow, deny = e2b_rules(allow, deny)
    return {"egress": "internet", "allow": allow, "deny": deny}
