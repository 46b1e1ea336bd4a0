"""The FastAPI application: routes and middleware, built from the parts it is given.

``create_app`` knows no engine, store or cluster: ``hangar.server`` (server
assembly) makes those and passes the key ring, the event bus, the lifespan
that starts the core and puts it on ``app.state`` (``manager``,
``machines``, ``metrics``, ``idempotency``), and a cluster node's routing
middleware. Called with no arguments it gives the routes alone, e.g. for
the OpenAPI document (``create_app().openapi()``).

Middleware, outermost first::

    E2bHosts               E2B's host names under HANGAR_DOMAIN (api.<domain>,
                           49983-<id>.<domain>) become /e2b and /e2b/envd paths
                           (hangar.api.e2b_hosts)
    FrontDoor              authenticates from headers alone before any body is read:
                           the key here, ports and envd by their own layers below
                           (hangar.api.frontdoor)
    PortProxy              requests for exposed ports go to the guest (hangar.api.proxy)
    EnvdGateway            E2B's data plane under /e2b/envd (hangar.api.envd)
    BodyLimit              the JSON body cap (hangar.api.limits)
    IdempotencyMiddleware  a repeated Idempotency-Key gets the first answer (after the
                           front door: a removed key gets 401, not a stored answer)
    routing                the cluster's gateway, when given (inside idempotency: a
                           retried create is answered, not placed again)
    routes                 with error handlers (hangar.api.errors)
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from fastapi import Depends, FastAPI

from hangar import __version__
from hangar.api import (
    code, desktop, e2b, errors, events, files, health, machines, network, pool, ports, processes,
    pty, sandboxes, secrets, snapshots, teams, tunnel, vnc, volumes, web,
)
from hangar.api.auth import KeyRing, Throttle, require_key
from hangar.api.e2b_hosts import E2bHosts
from hangar.api.envd.gateway import EnvdGateway
from hangar.api.frontdoor import FrontDoor, install_offloop_json
from hangar.api.idempotency import IdempotencyMiddleware
from hangar.api.limits import BodyLimit
from hangar.api.proxy import PortProxy
from hangar.config import Settings
from hangar.core.service import EventBus

Lifespan = Callable[[FastAPI], AbstractAsyncContextManager[None]]


def create_app(settings: Settings | None = None, *, keys: KeyRing | None = None,
               event_bus: EventBus | None = None, lifespan: Lifespan | None = None,
               routing: Callable[..., Any] | None = None) -> FastAPI:
    """The app's routes and middleware (see the module docstring).

    ``keys``: the API key ring requests are checked against (``app.state.keys``);
    ``event_bus``: the live-event bus (``app.state.events``; a new one if None);
    ``lifespan``: starts and stops the core, setting ``app.state.manager`` and the
    rest; ``routing``: an ASGI middleware factory, called as ``routing(app,
    state=app.state)``, placed just outside the routes (a cluster node's gateway).
    """
    settings = settings or Settings()
    app = FastAPI(
        title="Hangar",
        version=__version__,
        description="MicroVM sandboxes for AI agents. Every path but /health needs X-API-Key. "
                    "A POST with an Idempotency-Key header is acted on once: a repeat within "
                    "24 h gets the first answer (409 when it was over 64 KiB, not kept), "
                    "the same key with another request 422.",
        lifespan=lifespan,
    )
    app.state.keys = keys
    app.state.throttle = Throttle()
    app.state.events = event_bus if event_bus is not None else EventBus()
    if routing is not None:  # inside idempotency: a retried create is answered, not placed again
        app.add_middleware(routing, state=app.state)  # type: ignore[arg-type]
    app.add_middleware(IdempotencyMiddleware)
    errors.install(app)
    app.add_middleware(BodyLimit, limit=settings.max_json_bytes,
                       raw=files.RAW_BODY + e2b.builds.RAW_BODY)
    app.include_router(health.router)
    keyed = [Depends(require_key)]
    app.include_router(sandboxes.router, dependencies=keyed)
    app.include_router(network.router, dependencies=keyed)
    app.include_router(files.router, dependencies=keyed)
    app.include_router(processes.router, dependencies=keyed)
    app.include_router(desktop.router, dependencies=keyed)
    app.include_router(vnc.router, dependencies=keyed)
    app.include_router(vnc.ws_router)  # authenticated by single-use ticket, not key
    app.include_router(tunnel.router)  # checks X-API-Key itself (a WebSocket route)
    app.include_router(pty.router, dependencies=keyed)
    app.include_router(pty.ws_router)  # authenticated by single-use ticket, not key
    web.install(app)  # the web page and noVNC: static files, no key (the page asks for it)
    app.include_router(snapshots.router, dependencies=keyed)
    app.include_router(volumes.router, dependencies=keyed)
    app.include_router(secrets.router, dependencies=keyed)
    app.include_router(teams.router, dependencies=keyed)
    app.include_router(machines.listing, dependencies=keyed)
    app.include_router(machines.router, dependencies=keyed)
    app.include_router(pool.router, dependencies=keyed)
    app.include_router(events.router, dependencies=keyed)
    app.include_router(ports.router, dependencies=keyed)
    app.include_router(code.router, dependencies=keyed)
    # E2B's control plane under /e2b (docs/e2b.md): E2B's error shape, not in our spec
    app.include_router(e2b.public)
    app.include_router(e2b.router, dependencies=keyed)
    # E2B's data plane (/e2b/envd) checks its own credentials and streams its bodies: outside
    # the body cap and idempotency, inside the port proxy.
    app.add_middleware(EnvdGateway)
    # Outermost: requests for exposed ports go to the guest untouched by the body cap and
    # idempotency (hangar.api.proxy checks the key or token itself).
    app.add_middleware(PortProxy)
    # Outside everything: no body is read before the sender is known (hangar.api.frontdoor).
    app.add_middleware(FrontDoor)
    # Before the front door: E2B's host names are read as the paths they stand for.
    app.add_middleware(E2bHosts)
    install_offloop_json()
    return app
