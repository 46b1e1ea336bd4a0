"""Shared FastAPI dependencies."""

from __future__ import annotations

from fastapi import Request

from hangar.core.sandboxes import SandboxManager


def manager(request: Request) -> SandboxManager:
    return request.app.state.manager
