"""Shared FastAPI dependencies.

Dependencies are ``async def`` when they do not block: FastAPI runs a plain
``def`` in a worker thread, a hand-off each way on every request.
"""

from __future__ import annotations

from fastapi import Request

from hangar.core.service import PLACEMENT_SCOPE, Placement, SandboxManager


async def manager(request: Request) -> SandboxManager:
    return request.app.state.manager


async def placement(request: Request) -> Placement | None:
    """The id a cluster's gateway claimed for this request's create, or None (one host)."""
    return request.scope.get(PLACEMENT_SCOPE)
