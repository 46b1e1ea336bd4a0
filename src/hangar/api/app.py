"""The FastAPI application: wiring of settings, store, engine and routes."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI

from hangar import __version__
from hangar.api import (
    desktop, errors, events, files, health, machines, pool, ports, pty, sandboxes, snapshots,
    tunnel, vnc, web,
)
from hangar.api.auth import KeyRing, Throttle, require_key
from hangar.api.idempotency import IdempotencyMiddleware
from hangar.api.limits import BodyLimit
from hangar.api.proxy import PortProxy
from hangar.config import Settings
from hangar.core.events import EventBus
from hangar.core.idempotency import IdempotencyStore
from hangar.core.machines import MachineManager
from hangar.core.sandboxes import SandboxManager
from hangar.core.store import Store
from hangar.engines.confine import config_from as confine_config
from hangar.engines.doctor import choose_engine
from hangar.engines.qemu import MemoryTuning, ksm_running
from hangar.images import resolve_image
from hangar.layout import Layout
from hangar.metrics import Metrics

log = logging.getLogger("hangar.app")


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the app. Reads the API keys at once (``ConfigError`` when one is
    empty or weak: the server must not start). Start-up resolves the default
    image, picks the engine (running the probe boots if not cached),
    reconciles running VMs and starts filling the warm pool.
    ``app.state.events`` is the live-event bus (``GET /events``); POSTs with
    an ``Idempotency-Key`` go through ``IdempotencyMiddleware``; requests for
    exposed ports (``/sandboxes/{id}/ports/{port}/...`` and, with a domain,
    ``{port}-{id}.<domain>``) are forwarded to the guest by ``PortProxy``."""
    settings = settings or Settings()
    layout = Layout(settings.data_dir)
    layout.ensure()
    keys = KeyRing(layout.api_key_file, layout.api_keys_file, settings.api_key)
    keys.load()
    node = None
    if settings.etcd:  # a node of a cluster (docs/cluster.md); unset: a single host
        from hangar.cluster.node import ClusterNode

        node = ClusterNode(settings, layout)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        layout.ensure()
        image = resolve_image(layout, settings.default_image)
        engine = choose_engine(settings.engine, layout, image, accel=settings.accel,
                               jailer=settings.firecracker_jailer,
                               confine=confine_config(settings), tuning=MemoryTuning(
                                   tb_mib=settings.tcg_tb_mib, balloon=settings.balloon,
                                   ksm=settings.ksm))
        if settings.ksm and engine.name == "qemu" and not ksm_running():
            log.warning("HANGAR_KSM is on but the host's ksmd is not running: no page is "
                        "merged until an operator writes 1 to /sys/kernel/mm/ksm/run")
        metrics = Metrics()
        metrics.engine.info(engine.describe())
        store = Store(layout.database)
        if node is not None:
            config = await node.load_config()
            keys.share("cluster", config.key_hashes)
        manager = SandboxManager(settings, layout, store, engine, metrics, app.state.events,
                                 hooks=node.hooks if node is not None else None)
        app.state.idempotency = IdempotencyStore(store.engine)
        app.state.metrics = metrics
        app.state.manager = manager
        app.state.machines = MachineManager(manager, settings.machine_idle_s)
        await manager.start()
        if node is not None:
            await node.start(manager)
        try:
            yield
        finally:
            app.state.events.close()
            if node is not None:
                await node.close()
            await manager.close()

    app = FastAPI(
        title="Hangar",
        version=__version__,
        description="MicroVM sandboxes for AI agents. Every path but /health needs X-API-Key. "
                    "A POST with an Idempotency-Key header is acted on once: a repeat within "
                    "24 h gets the first answer, the same key with another request 422.",
        lifespan=lifespan,
    )
    app.state.keys = keys
    app.state.throttle = Throttle()
    app.state.events = EventBus()
    if node is not None:  # inside idempotency: a retried create is answered, not placed again
        from hangar.cluster.gateway import Gateway

        app.add_middleware(Gateway, node=node, state=app.state)
        app.state.cluster = node
    app.add_middleware(IdempotencyMiddleware)
    errors.install(app)
    app.add_middleware(BodyLimit, limit=settings.max_json_bytes, raw=files.RAW_BODY)
    app.include_router(health.router)
    keyed = [Depends(require_key)]
    app.include_router(sandboxes.router, dependencies=keyed)
    app.include_router(files.router, dependencies=keyed)
    app.include_router(desktop.router, dependencies=keyed)
    app.include_router(vnc.router, dependencies=keyed)
    app.include_router(vnc.ws_router)  # authenticated by single-use ticket, not key
    app.include_router(tunnel.router)  # checks X-API-Key itself (a WebSocket route)
    app.include_router(pty.router, dependencies=keyed)
    app.include_router(pty.ws_router)  # authenticated by single-use ticket, not key
    web.install(app)  # the web page and noVNC: static files, no key (the page asks for it)
    app.include_router(snapshots.router, dependencies=keyed)
    app.include_router(machines.listing, dependencies=keyed)
    app.include_router(machines.router, dependencies=keyed)
    app.include_router(pool.router, dependencies=keyed)
    app.include_router(events.router, dependencies=keyed)
    app.include_router(ports.router, dependencies=keyed)
    # Outermost: requests for exposed ports go to the guest untouched by the body cap and
    # idempotency (hangar.api.proxy checks the key or token itself).
    app.add_middleware(PortProxy)
    return app
