"""The ``hangar`` command line (typer + rich): ``app`` is the console entry point.

    main         the ``hangar`` app: where every command and group is registered
    sandbox      ``create``, ``ls``, ``exec``, ``shell``, ``rm``, ``ttl``, ``events``
    files        ``hangar files``: copy in and out, list, remove, mkdir
    machine      ``hangar machine``: per-user machines
    snapshot     ``hangar snapshot``: snapshots, restores, forks
    ports        ``hangar port``: exposed guest ports
    desktop      ``hangar desktop``: screenshots, pointer, keyboard, live view
    image        ``hangar image``: guest image builds on this host
    host         ``hangar doctor`` and ``hangar bench boot``: what this host offers
    mcp          ``hangar mcp``: the agent tools over MCP
    serve        ``hangar serve``; status: ``hangar status``
    key          ``hangar key``: the server's API keys on this host's disk
    team         ``hangar team``: teams and their limits, through the SDK
    template     ``hangar template``: users' own guest images
    cluster      ``hangar cluster`` and ``hangar node``: etcd, cluster nodes
    ops          ``hangar deploy nginx`` and ``hangar backup``
    shell        ``hangar shell``: a sandbox's terminal in the local one
    events_view  ``hangar events``: live events as a person reads them

``python -m hangar.cli`` runs it too.
"""

from hangar.cli.main import app

__all__ = ["app"]
