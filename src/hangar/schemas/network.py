"""Wire schemas of a running sandbox's egress rules (``PATCH /sandboxes/{id}/network``)."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, field_validator

from hangar.schemas.base import Model, RequestBody
from hangar.schemas.bounds import RULE_BYTES, RULES, check_rules


class NetworkRulesUpdate(RequestBody):
    """Body of ``PATCH /sandboxes/{id}/network``: new ``allow``/``deny`` lists (an omitted
    list is kept), and optionally ``egress`` between ``internet`` and ``open``.

    Entries: IPv4 CIDRs or addresses (``10.1.2.0/24``), domains (``example.com``,
    ``*.example.com``: names below it), each optionally with one port (``host:443``,
    ``10.0.0.0/8:22``). The most specific entry wins, deny on a tie; see docs/networking.md.
    """

    model_config = ConfigDict(extra="forbid")

    allow: list[str] | None = Field(None, max_length=RULES, description=(
        f"Entries reachable although the mode blocks them (at most {RULES}, each at most "
        f"{RULE_BYTES} bytes)."))
    deny: list[str] | None = Field(None, max_length=RULES, description=(
        "Entries unreachable although the mode allows them."))
    egress: Literal["none", "internet", "open"] | None = Field(None, description=(
        "A new mode, 'internet' or 'open'; 'none' (no NIC) cannot be set or left on a "
        "sandbox (409)."))

    _rules = field_validator("allow", "deny")(classmethod(
        lambda cls, v, info: check_rules(v, info.field_name)))


class NetworkRules(Model):
    """A sandbox's egress policy as stored (what ``GET /sandboxes/{id}`` shows as
    ``network``)."""

    egress: str
    allow: list[str] = Field(default_factory=list)
    deny: list[str] = Field(default_factory=list)
