"""``/pool`` and ``/capacity``: how full the warm pool is, and the host's VMMs, starts and
memory (the operator's: 403 for a team's key)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from hangar.schemas import Capacity, MemoryStatus, PoolStatus, StartsStatus

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


@router.get("/capacity", response_model=Capacity,
            summary="VMMs against their cap; starts in progress and queued against "
                    "theirs; guest memory declared, allowed and used; the host's available "
                    "memory and headroom")
async def capacity(request: Request) -> Capacity:
    m = request.app.state.manager
    mem = m.host_memory.view()
    st = m.starts()
    return Capacity(vmms=m.capacity().vmms, vmm_limit=m.settings.max_sandboxes,
                    starts=StartsStatus(running=st.running, limit=st.limit, queued=st.queued,
                                        queue=st.queue, max_wait_s=st.max_wait_s,
                                        waited=st.waited, refused=st.refused),
                    memory=MemoryStatus(declared_mib=mem.declared, budget_mib=mem.budget,
                                        overcommit=mem.overcommit, allowed_mib=mem.allowed,
                                        used_mib=mem.used, available_mib=mem.available,
                                        headroom_mib=mem.headroom, slept=mem.slept))
