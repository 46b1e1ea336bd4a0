"""Guest ports other than envd's, reached by header: ``E2b-Sandbox-Port: <port>``.

E2B's SDKs reach a sandbox's other ports (the code interpreter's 49999,
a user's server) through the same URL, naming the port in a header. The
request, admitted by the gateway (access token or key), is forwarded by
Hangar's port proxy (``hangar.api.proxy.forward_admitted``: HTTP and
WebSockets, streamed both ways) to ``127.0.0.1:<port>`` in the guest, with
the path after ``/e2b/envd``. No exposure is needed (the credential is the
sandbox's own); ``sandbox.get_host(port)`` URLs, which carry none, go
through the port proxy's host routing, which opens them as E2B does
(``hangar.core.e2b.url_exposure``). Both pass the guest the ``Host`` of the
create's ``network.maskRequestHost`` when it set one (``hangar.core.e2b.request_host``).
"""

from __future__ import annotations

from typing import Any

from starlette.types import Receive, Scope, Send

from hangar.api import proxy
from hangar.api.envd.versions import PREFIX
from hangar.core.service import SandboxManager, e2b


def guest_path(scope: Scope, rest_path: str) -> bytes:
    """The path the guest gets: the request's as sent (``raw_path``, not percent-decoded)
    after ``/e2b/envd``. Admission checks this same value (review 29e L2: a check of the
    decoded path and a use of the raw one differ where a guest's server decodes ``%2F``)."""
    raw = scope.get("raw_path") or scope.get("path", "").encode("utf-8", "surrogateescape")
    path = raw[len(PREFIX):] if raw.startswith(PREFIX.encode()) else rest_path.encode()
    return path or b"/"


async def forward(scope: Scope, receive: Receive, send: Send, manager: SandboxManager,
                  state: Any, sandbox_id: str, port: int, rest_path: str) -> None:
    """Forward one admitted request to ``port`` of ``sandbox_id`` (at ``guest_path``)."""
    target = proxy.Target(sandbox_id, port, guest_path(scope, rest_path), None,
                          own_origin=False)
    await proxy.forward_admitted(scope, receive, send, target, manager, state,
                                 e2b.request_host(manager, sandbox_id, port))
