"""The split of ``hangar serve`` into an unprivileged server and a small root helper.

``split.split`` (called by ``hangar serve`` with ``HANGAR_PRIVSEP=1`` as root)
forks the helper (``helper``: keeps root, answers the request table of
``protocol`` over an inherited socketpair) and drops the server to the
``hangar`` user; the server then reaches root only through ``client``.
docs/security.md ("Class 9") shows the two processes and the table.
"""

from hangar.privileged.client import Client, current, install

__all__ = ["Client", "current", "install"]
