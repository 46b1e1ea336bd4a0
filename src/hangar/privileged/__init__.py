"""The typed bottom of the privilege split: the root helper's protocol and its client.

Under ``HANGAR_PRIVSEP`` ``hangar serve`` forks a small root helper
(``hangar.roothelper``, beside the server) and drops to an unprivileged user;
the server then reaches root only through a ``client.Client``, handed to the
engines and the network manager that need it. ``protocol`` holds the request
table (one strict model per request), ``client`` one typed method per request,
and ``split`` the two steps of the split that need no helper (the data
directory handed over, root dropped). This package imports nothing of
Hangar's but its errors and layout. docs/security.md ("Class 9") shows the
two processes and the table.
"""

from hangar.privileged.client import Client

__all__ = ["Client"]
