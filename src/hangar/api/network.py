"""``PATCH /sandboxes/{id}/network``: change a running sandbox's egress rules.

The work is ``SandboxService.network.change`` (``hangar.core.network``: what may
change and when it takes effect); ``GET /sandboxes/{id}`` shows the rules as ``network``.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends

from hangar.api.deps import manager
from hangar.core.service import SandboxManager
from hangar.schemas import NetworkRules, NetworkRulesUpdate

router = APIRouter(prefix="/sandboxes", tags=["sandboxes"])
Manager = Annotated[SandboxManager, Depends(manager)]


@router.patch("/{sandbox_id}/network", response_model=NetworkRules,
              summary="Replace a sandbox's egress allow/deny rules; new connections see "
                      "them within a second",
              responses={409: {"description": "The sandbox has no NIC, or the change would "
                                              "add or remove one (egress 'none')"}})
async def update_network(sandbox_id: str, body: NetworkRulesUpdate, m: Manager) -> NetworkRules:
    stored = await m.network.change(sandbox_id, allow=body.allow, deny=body.deny,
                                    egress=body.egress)
    return NetworkRules.model_validate(stored)
