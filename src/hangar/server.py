"""Server assembly: the one place that builds Hangar's application from its parts.

``create_app(settings)`` is what ``hangar serve`` runs (``hangar.cli.serve``).
It sits above ``hangar.api`` and ``hangar.core`` and wires them:

At once (so a bad configuration stops ``hangar serve`` before it listens):

1. the data directory's layout, and the API keys (``ConfigError`` when one
   is empty or weak);
2. with ``HANGAR_ETCD``, the cluster node (``hangar.cluster.node``;
   docs/cluster.md), whose gateway becomes the routes' innermost middleware;
3. the FastAPI app from ``hangar.api.app.create_app``: routes and
   middleware, given the keys, the event bus, the lifespan below and the
   gateway.

At start-up (the app's lifespan, before the first request is served):

4. the default image is resolved and the engine chosen
   (``hangar.engines.doctor.choose_engine``; the probe boots run when no
   cached result fits), with its confinement and QEMU's memory tuning, and
   the root helper's client of a split server (``app.state.helper``, which
   ``hangar serve`` sets after ``hangar.roothelper.split``; the engine hands it
   on to the network manager); a QEMU host with ``HANGAR_KSM`` on but ksmd
   stopped is warned about;
5. metrics, the store, the cluster's shared key hashes (a node), the
   ``SandboxManager`` (with the node's hooks), the idempotency store and
   the ``MachineManager`` go on ``app.state`` (``manager``, ``machines``,
   ``metrics``, ``idempotency``);
6. the manager starts (recovery, the reconcile loop, the warm pool), then
   the node; then what start-up made is frozen out of the garbage collector's
   generations (``gc.freeze``), so full collections scan only what requests make.

At shutdown: the event bus closes (open streams end), then the node, then
the manager (background work stops; sandboxes keep running).
"""

from __future__ import annotations

import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

from fastapi import FastAPI

from hangar.api.app import create_app as create_api
from hangar.api.auth import KeyRing
from hangar.core.secrets import default_key_file, load_key
from hangar.config import Settings
from hangar.core.events import EventBus
from hangar.core.idempotency import IdempotencyStore
from hangar.core.machines import MachineManager
from hangar.core.ports import PortKey
from hangar.core.sandboxes import SandboxManager
from hangar.core.store import Store
from hangar.engines.base import Engine
from hangar.engines.confine import config_from as confine_config
from hangar.engines.doctor import choose_engine
from hangar.engines.qemu import ksm_running, tuning_from
from hangar.images import resolve_image
from hangar.errors import ConfigError
from hangar.layout import Layout
from hangar.metrics import Metrics
from hangar.privileged import Client

log = logging.getLogger("hangar.app")

__all__ = ["create_app", "pick_engine"]


def pick_engine(settings: Settings, layout: Layout, helper: Client | None = None) -> Engine:
    """The engine this server runs VMs with (``HANGAR_ENGINE``; ``auto`` probes), for the
    default image; ``helper``: the root helper's client of a server split from root.
    Warns when ``HANGAR_KSM`` is on for QEMU but the host's ksmd is not running. Raises
    ImageError (no default image), EngineError (no usable engine)."""
    image = resolve_image(layout, settings.default_image)
    engine = choose_engine(settings.engine, layout, image, accel=settings.accel,
                           jailer=settings.firecracker_jailer,
                           confine=confine_config(settings), tuning=tuning_from(settings),
                           helper=helper)
    if settings.ksm and engine.name == "qemu" and not ksm_running():
        log.warning("HANGAR_KSM is on but the host's ksmd is not running: no page is "
                    "merged until an operator writes 1 to /sys/kernel/mm/ksm/run")
    return engine


def create_app(settings: Settings | None = None) -> FastAPI:
    """Hangar's whole application for ``settings`` (default: from the environment); see
    the module docstring for what is built when. Raises ConfigError (an empty or weak
    API key, a port key file under 32 bytes)."""
    settings = settings or Settings()
    layout = Layout(settings.data_dir)
    layout.ensure()
    keys = KeyRing(layout.api_key_file, layout.api_keys_file, settings.api_key)
    keys.load()
    PortKey(layout.port_key_file).check()  # an empty or short port key: ConfigError
    # read now, while a split server is still root (`hangar serve` made it first): it keeps
    # the key in memory and its user needs no access to the file (hangar.core.secrets). A
    # key that is missing or unreadable leaves the vault to try again when used.
    try:
        secret_key = load_key(settings.secrets_key_file or default_key_file(), create=False)
    except ConfigError as exc:
        log.warning("the vault has no key: %s", exc.message)
        secret_key = None
    events = EventBus()
    node: Any = None
    gateway = None
    if settings.etcd:  # a node of a cluster (docs/cluster.md); unset: a single host
        from hangar.cluster.gateway import Gateway
        from hangar.cluster.node import ClusterNode

        node = ClusterNode(settings, layout)
        gateway = partial(Gateway, node=node)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        layout.ensure()
        engine = pick_engine(settings, layout, getattr(app.state, "helper", None))
        metrics = Metrics()
        metrics.engine.info(engine.describe())
        store = Store(layout.database)
        if node is not None:
            config = await node.load_config()
            keys.share("cluster", config.key_hashes)
            node.directory.on_keys(lambda ks: keys.share_team_keys(  # teams' keys, in etcd
                [(n, k.sha256, k.team) for n, k in ks.items()]))
        manager = SandboxManager(settings, layout, store, engine, metrics, events,
                                 hooks=node.hooks if node is not None else None,
                                 secret_key=secret_key)
        app.state.idempotency = IdempotencyStore(store.engine)
        app.state.metrics = metrics
        app.state.manager = manager
        app.state.machines = MachineManager(manager, settings.machine_idle_s)
        await manager.start()
        if node is not None:
            await node.start(manager)
        # What start-up made (modules, the app, the routes: most of the heap) lives as long
        # as the server: out of the collector's way, a full collection scans only what
        # requests make (under load one over the whole heap held the loop 85-340 ms).
        gc.freeze()
        try:
            yield
        finally:
            events.close()
            if node is not None:
                await node.close()
            await manager.close()

    app = create_api(settings, keys=keys, event_bus=events, lifespan=lifespan, routing=gateway)
    if node is not None:
        app.state.cluster = node
    return app
