"""Shared FastAPI dependencies.

Dependencies are ``async def`` when they do not block: FastAPI runs a plain
``def`` in a worker thread, a hand-off each way on every request.
"""

from __future__ import annotations

from fastapi import Request

from hangar.core.sandboxes import SandboxManager


async def manager(request: Request) -> SandboxManager:
    return request.app.state.manager
