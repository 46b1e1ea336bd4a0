"""The unprivileged server's end of the privileged helper (``hangar.privileged.helper``).

``Client.call`` sends one request (a dict that ``protocol.Request`` must
accept; descriptors as ``SCM_RIGHTS``) and waits for its answer; calls from
several threads take turns. ``current()`` is the server's client, or None
when the server itself is root (no split) or is not a server at all.
"""

from __future__ import annotations

import array
import json
import socket
import threading
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from hangar.errors import EngineError, InvalidRequest
from hangar.privileged import protocol as P

_current: "Client | None" = None


def current() -> "Client | None":
    """The privileged helper's client of this process, or None (see the module docstring)."""
    return _current


def install(client: "Client | None") -> None:
    """Make ``client`` this process's (``hangar.privileged.split`` does, once)."""
    global _current
    _current = client


class Client:
    """Requests to the helper over ``sock`` (a ``SOCK_SEQPACKET`` socketpair end)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._lock = threading.Lock()

    def call(self, request: dict[str, Any], fds: Sequence[int] = ()) -> Any:
        """The result of ``request``; raises EngineError with the helper's message."""
        data = json.dumps(request, separators=(",", ":")).encode()
        try:  # refused here already, not sent: checked as the helper checks it, as JSON
            P.REQUEST.validate_json(data)
        except ValidationError as exc:
            raise EngineError(f"privileged helper: bad request: {exc.errors()[0]['msg']}"
                              ) from None
        anc = ([(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
               if fds else [])
        with self._lock:
            try:
                self.sock.sendmsg([data], anc)
                raw = self.sock.recv(P.MAX_MESSAGE)
            except OSError as exc:
                raise EngineError(f"privileged helper: {exc}") from None
        if not raw:
            raise EngineError("the privileged helper is gone")
        answer = json.loads(raw)
        if not answer.get("ok"):
            if answer.get("status") == 400:  # the request's own fault, e.g. a policy
                raise InvalidRequest(str(answer.get("error")))
            raise EngineError(f"privileged helper: {answer.get('error')}")
        return answer.get("result")
