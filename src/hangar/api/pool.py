"""``/pool``: how full the warm pool is."""

from __future__ import annotations

from fastapi import APIRouter, Request

from hangar.schemas import PoolStatus

router = APIRouter(tags=["operations"])


@router.get("/pool", response_model=PoolStatus,
            summary="The warm pool: size wanted, VMs ready and starting, maximum age")
async def pool(request: Request) -> PoolStatus:
    m = request.app.state.manager
    status = m.pool_status()
    if status is None:
        return PoolStatus(size=0, ready=0, starting=0, max_age_s=0.0,
                          image=m.settings.default_image)
    return PoolStatus.model_validate(status)
