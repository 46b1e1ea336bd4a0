"""The ``hangar`` command line (typer + rich): ``app`` is the console entry point.

    main         the ``hangar`` app: server and client commands, and where the
                 groups below are added
    key          ``hangar key``: the server's API keys on this host's disk
    template     ``hangar template``: users' own guest images
    cluster      ``hangar cluster`` and ``hangar node``: etcd, cluster nodes
    ops          ``hangar deploy nginx`` and ``hangar backup``
    shell        ``hangar shell``: a sandbox's terminal in the local one
    events_view  ``hangar events``: live events as a person reads them

``python -m hangar.cli`` runs it too.
"""

from hangar.cli.main import app

__all__ = ["app"]
