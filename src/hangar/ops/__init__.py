"""Running Hangar on a real host: the operator's tools.

* ``hangar.ops.nginx``: renders the nginx site (TLS, WebSockets, streams)
  from ``templates/nginx-site.conf``;
* ``hangar.ops.backup``: online backups of the SQLite store;
* ``hangar.ops.checklist``: the host's readiness, item by item, with the fix
  for each item that is not ready (printed by ``hangar doctor``).

The ``hangar deploy nginx`` and ``hangar backup`` commands that use them are
in ``hangar.cli.ops``.

The unit file, logrotate file, provisioning and deploy scripts live beside
the package (``deploy/``, ``scripts/``); docs/operations.md ties them together.
Everything here uses the standard library only, and never imports the API or
the core, so that these commands work while the server is down.
"""
