"""``hangar serve``: the REST API on this host (built by ``hangar.server``, run by uvicorn).

Also what ``hangar node join`` (``hangar.cli.cluster``) runs, once it has
put the node's settings in the environment.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from hangar.cli.common import DataDir, build_recipe, err, fail, server_settings
from hangar.cli.split_setup import host_jail, probe_as_root
from hangar.errors import ConfigError, HangarError

if TYPE_CHECKING:
    from hangar.config import Settings
    from hangar.layout import Layout
    from hangar.privileged import Client


def split_privileges(settings: "Settings", layout: "Layout") -> "Client | None":
    """Started as root, fork the root helper and drop this process to ``HANGAR_USER``
    before uvicorn reads a byte (``hangar.roothelper.split``), unless
    ``HANGAR_PRIVSEP=0``; returns the helper's client (None: no split), which the
    server's engine gets. The helper also runs Firecracker's jailer (``host_jail``).
    Exits with the reason (one line naming the fix) when that cannot be done: no such
    user, code it could not read, or an unsafe folder for the jails."""
    import os

    if settings.privsep is False or os.geteuid() != 0:
        return None  # off, or started unprivileged already
    from hangar.engines.confine import Confinement, config_from
    from hangar.roothelper import split

    from hangar.core.launch import network_manager

    jail = host_jail(settings)
    if jail is not None and settings.engine == "auto":
        probe_as_root(settings, layout)
    try:
        pid, client = split(layout, Confinement(config_from(settings)), settings.user,
                            network_manager(settings), jail)
    except (HangarError, OSError) as exc:
        fail(exc if isinstance(exc, HangarError) else ConfigError(f"privilege split: {exc}"))
    err.print(f"privileged helper: pid {pid}; this server runs as {settings.user}")
    return client


LOCK_WAIT_S = 10.0
"""Seconds a new server waits for the data directory's lock (a restart's old server and
its helper end within a second)."""
_held: list[int] = []
"""The data directory's lock, held open for the server's life (``hold_data_dir``)."""


def hold_data_dir(layout: "Layout") -> None:
    """Take ``<data>/server.lock`` (``flock``, exclusive) for this server's life, or raise
    ConfigError naming the server that holds it: a second server on one data directory
    would take the first's VMMs, folders and records for orphans and remove them. The
    descriptor is inherited by the split's helper, so the lock ends with both.

    Run as root before the split, in a folder the server owns: the lock is opened
    relative to a descriptor of ``<data>`` this process opened itself
    (``beneath.open_trusted``), never through a symlink and without blocking on a FIFO,
    and it must be a regular file with no other link, owned by root, this process's user
    or the data directory's owner (the server's); anything else is refused with the fix
    (review 29c, H2), so root never truncates, writes or reads a file the server named."""
    import errno
    import fcntl
    import os
    import time

    from hangar.privileged import beneath

    path = layout.root / "server.lock"
    refused = (f"{path} is not a lock file of Hangar's: a regular file of root's or the "
               f"server's with no other link; remove it and start again")
    try:
        dfd = beneath.open_trusted(layout.root)
    except OSError as exc:
        raise ConfigError(f"cannot open the data directory {layout.root}: "
                          f"{exc.strerror or exc}") from None
    fd = -1
    try:
        fd = os.open(path.name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                     | os.O_NOCTTY | os.O_CLOEXEC, 0o600, dir_fd=dfd)
        beneath.expect(fd, uids=(0, os.geteuid(), os.fstat(dfd).st_uid), single=True)
    except OSError as exc:
        if fd >= 0:
            os.close(fd)
        if exc.errno not in (errno.ELOOP, errno.EINVAL, errno.EPERM, errno.ENXIO):
            raise ConfigError(f"cannot open {path}: {exc.strerror or exc}") from None
        raise ConfigError(f"{refused} ({exc.strerror or exc})") from None
    finally:
        os.close(dfd)
    deadline = time.monotonic() + LOCK_WAIT_S  # a restart: the old helper ends just after
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() < deadline:
                time.sleep(0.1)
                continue
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise ConfigError(f"another Hangar server (pid {holder}) uses the data directory "
                          f"{layout.root}: stop it, or give this one its own "
                          f"HANGAR_DATA_DIR") from None
    os.ftruncate(fd, 0)  # checked above: root's own lock, or the server's
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _held.append(fd)


def serve(
    host: Annotated[Optional[str], typer.Option(help="Listen address (HANGAR_HOST).")] = None,
    port: Annotated[Optional[int], typer.Option(help="Listen port (HANGAR_PORT).")] = None,
    data_dir: DataDir = None,
    engine: Annotated[Optional[str], typer.Option(
        help="auto, firecracker or qemu (HANGAR_ENGINE).")] = None,
    accel: Annotated[Optional[str], typer.Option(help="auto, kvm or tcg (HANGAR_ACCEL).")] = None,
) -> None:
    """Run the REST API; builds the default image first if it is missing (a recipe; a
    template must have been built)."""
    settings = server_settings(data_dir, host=host, port=port, engine=engine, accel=accel)
    import asyncio

    import uvicorn

    from hangar import log
    from hangar.layout import Layout
    from hangar.server import create_app

    log.setup(settings.log_level)
    layout = Layout(settings.data_dir)
    layout.ensure()
    try:
        hold_data_dir(layout)
    except HangarError as exc:
        fail(exc)
    from hangar.core.secrets import default_key_file, load_key

    try:  # the vault's key, made while still root (hangar.core.secrets)
        load_key(settings.secrets_key_file or default_key_file())
    except HangarError as exc:
        logging.getLogger("hangar.secrets").warning("the vault has no key: %s", exc.message)
    try:
        api = create_app(settings)  # refuses a weak API key or port key (ConfigError)
        from hangar.images import RECIPES, resolve_image

        if settings.default_image in RECIPES:
            build_recipe(layout, settings.default_image)
        else:  # a template: built with `hangar template build`, never here
            resolve_image(layout, settings.default_image)
    except HangarError as exc:
        fail(exc)
    api.state.helper = split_privileges(settings, layout)  # the lifespan's engine gets it
    where = f"unix:{settings.uds}" if settings.uds else f"http://{settings.host}:{settings.port}"
    err.print(f"Hangar on {where}  (API key in {layout.api_key_file})")
    where_kw: dict[str, object] = ({"uds": str(settings.uds)} if settings.uds
                                   else {"host": settings.host, "port": settings.port,
                                         "proxy_headers": True,
                                         "forwarded_allow_ips": settings.forwarded_allow_ips})

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: object) -> None:
            # Open event streams never end by themselves, and uvicorn waits for every
            # connection before shutting down: end them first (in the loop, not here in
            # the signal handler, where the bus's lock may be held).
            try:
                asyncio.get_running_loop().call_soon_threadsafe(api.state.events.close)
            except RuntimeError:
                api.state.events.close()
            super().handle_exit(sig, frame)  # type: ignore[arg-type]

    config: dict[str, Any] = {**http_limits(), **where_kw}
    server = Server(uvicorn.Config(api, log_config=None, access_log=False, **config))
    server.run()


def http_limits() -> dict[str, object]:
    """uvicorn's limits for ``hangar serve``: request head size and read time, keep-alive,
    concurrency (``hangar.api.http_limits``) and the largest WebSocket message."""
    from hangar.api.http_limits import uvicorn_options
    from hangar.api.limits import WS_MAX_BYTES

    return {**uvicorn_options(), "ws_max_size": WS_MAX_BYTES}
