"""The FastAPI application: wiring of settings, store, engine and routes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI

from hangar import __version__
from hangar.api import (
    desktop, errors, files, health, machines, sandboxes, snapshots, tunnel, vnc, web,
)
from hangar.api.auth import load_or_create_key, require_key
from hangar.config import Settings
from hangar.core.machines import MachineManager
from hangar.core.pool import WarmPool
from hangar.core.sandboxes import SandboxManager
from hangar.core.store import Store
from hangar.engines.doctor import choose_engine
from hangar.images import resolve_image
from hangar.layout import Layout
from hangar.metrics import Metrics


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the app. Start-up resolves the default image, picks the engine
    (running the probe boots if not cached), reconciles running VMs and
    starts filling the warm pool."""
    settings = settings or Settings()
    layout = Layout(settings.data_dir)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        layout.ensure()
        app.state.api_key = settings.api_key or load_or_create_key(layout.api_key_file)
        image = resolve_image(layout, settings.default_image)
        engine = choose_engine(settings.engine, layout, image, accel=settings.accel,
                               jailer=settings.jailer)
        metrics = Metrics()
        metrics.engine.info(engine.describe())
        store = Store(layout.database)
        manager = SandboxManager(settings, layout, store, engine, metrics)
        manager.pool = WarmPool(manager, settings.pool_size, settings.pool_max_age_s)
        app.state.metrics = metrics
        app.state.manager = manager
        app.state.machines = MachineManager(manager, settings.machine_idle_s)
        await manager.start()
        manager.pool.kick()
        try:
            yield
        finally:
            await manager.close()

    app = FastAPI(
        title="Hangar",
        version=__version__,
        description="MicroVM sandboxes for AI agents. Every path but /health needs X-API-Key.",
        lifespan=lifespan,
    )
    errors.install(app)
    app.include_router(health.router)
    keyed = [Depends(require_key)]
    app.include_router(sandboxes.router, dependencies=keyed)
    app.include_router(files.router, dependencies=keyed)
    app.include_router(desktop.router, dependencies=keyed)
    app.include_router(vnc.router, dependencies=keyed)
    app.include_router(vnc.ws_router)  # authenticated by single-use ticket, not key
    app.include_router(tunnel.router)  # checks X-API-Key itself (a WebSocket route)
    web.install(app)  # the web page and noVNC: static files, no key (the page asks for it)
    app.include_router(snapshots.router, dependencies=keyed)
    app.include_router(machines.listing, dependencies=keyed)
    app.include_router(machines.router, dependencies=keyed)
    return app
