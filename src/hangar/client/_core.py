"""What the sync and async clients share, with no I/O of its own.

Configuration (``resolve_config``), the retry contract (``RetryPolicy``,
``retry_delay``), per-call timeouts (``Timeouts``), the mapping of error
responses and transport failures onto ``hangar.errors``, and request bodies.
The clients in ``_async/`` (and ``_sync/``, generated from them) only send
what this module decides and sleep where it says.
"""

from __future__ import annotations

import base64
import logging
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from hangar import __version__
from hangar.errors import (
    BY_CODE, Busy, HangarError, LimitExceeded, QuotaExceeded, RequestTimeout, Unavailable,
)
from hangar.layout import Layout

log = logging.getLogger("hangar.client")

DEFAULT_URL = "http://127.0.0.1:8080"
USER_AGENT = f"hangar-sdk/{__version__}"


@dataclass(frozen=True)
class RetryPolicy:
    """When and how a call that is safe to repeat is tried again.

    Safe calls are reads (GET), deletes, file writes (PUT) and creates
    (sandbox, snapshot, fork, machine), which carry an ``Idempotency-Key``
    that the server honours; ``exec`` only when the caller passes
    ``retry=True``. Whether a failure is retried is the error class's
    ``retryable`` flag (``hangar.errors``), never a status code: a
    connection error (``Unavailable``), a timeout (``Timeout``), ``Busy``
    and ``LimitExceeded`` are; everything else is raised at once. An error
    that carries the server's ``Retry-After`` (``Busy``, ``LimitExceeded``)
    is retried after it (at most ``max_retry_after`` seconds; a longer wait
    is raised to the caller); the others after each of ``delays`` in turn
    (seconds; the default, 1 s then 3 s, gives three attempts in all).
    Delays come from the contract agent platforms kept with their earlier
    client.
    """

    delays: tuple[float, ...] = (1.0, 3.0)
    max_retry_after: float = 60.0

    @property
    def attempts(self) -> int:
        """Attempts in all (the first one plus one per delay)."""
        return len(self.delays) + 1


NO_RETRY = RetryPolicy(delays=())


@dataclass(frozen=True)
class Timeouts:
    """Default per-call timeouts, seconds (every method also takes ``request_timeout``).

    A timeout bounds how long the server may take to start answering and
    then between two chunks of the answer (httpx's read timeout); connecting
    is bounded by ``connect``.

    * ``control``: reads, deletes, TTLs, desktop input (30 s).
    * ``lifecycle``: create, snapshot, restore, fork, machine get, sleep and
      wake (120 s: a cold boot under software emulation can take most of
      the server's own 60 s boot timeout, and a create waits for it).
    * ``screenshot``: 45 s, from the agent platforms' contract.
    * ``exec_margin``: added to the command's own timeout (default 60 s).
    * ``transfer`` and ``transfer_rate``: file transfers get ``transfer``
      plus one second per ``transfer_rate`` bytes written.
    * ``events``: the longest silence on the live-event stream before it is
      reconnected (the server sends a keep-alive every 15 s).
    """

    connect: float = 10.0
    control: float = 30.0
    lifecycle: float = 120.0
    screenshot: float = 45.0
    exec_margin: float = 30.0
    transfer: float = 60.0
    transfer_rate: float = float(1 << 20)
    events: float = 45.0
    health: float = 10.0

    def exec(self, command_timeout: float | None) -> float:
        """The timeout of an exec call whose command may run ``command_timeout`` seconds."""
        return (60.0 if command_timeout is None else command_timeout) + self.exec_margin

    def upload(self, size: int) -> float:
        """The timeout of a file write of ``size`` bytes."""
        return self.transfer + size / self.transfer_rate


@dataclass
class Config:
    """A client's resolved configuration."""

    base_url: str
    api_key: str
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    timeouts: Timeouts = field(default_factory=Timeouts)
    team: str | None = None
    """An operator key's team to act for (``X-Hangar-Team``), or None."""

    def headers(self, idempotency_key: str | None = None,
                extra: Mapping[str, str] | None = None) -> dict[str, str]:
        h = {"X-API-Key": self.api_key, "User-Agent": USER_AGENT}
        if self.team:
            h["X-Hangar-Team"] = self.team
        if idempotency_key is not None:
            h["Idempotency-Key"] = idempotency_key
        if extra:
            h.update(extra)
        return h

    def url(self, path: str) -> str:
        return self.base_url + path

    def timeout(self, seconds: float) -> httpx.Timeout:
        return httpx.Timeout(seconds, connect=min(seconds, self.timeouts.connect))


def resolve_config(base_url: str | None, api_key: str | None, retry: RetryPolicy | None = None,
                   timeouts: Timeouts | None = None, team: str | None = None) -> Config:
    """URL and key from the arguments, ``HANGAR_URL``/``HANGAR_API_KEY``, or the
    server's key file (``$HANGAR_DATA_DIR/api-key``, default /var/lib/hangar); the team
    an operator's key acts for from ``team`` or ``HANGAR_TEAM`` (none: its own view)."""
    url = base_url or os.environ.get("HANGAR_URL") or DEFAULT_URL
    key = api_key or os.environ.get("HANGAR_API_KEY")
    if not key:
        path = Layout.from_env().api_key_file
        try:
            key = path.read_text().strip()
        except OSError:
            key = ""
    return Config(url.rstrip("/"), key, retry or RetryPolicy(), timeouts or Timeouts(),
                  team or os.environ.get("HANGAR_TEAM") or None)


def new_idempotency_key() -> str:
    """A fresh key for one logical create, reused by all its attempts."""
    return str(uuid.uuid4())


# -- errors -----------------------------------------------------------------------------------


def error_for(resp: httpx.Response) -> HangarError:
    """The ``hangar.errors`` instance matching an error response (status >= 400): Hangar's
    ``{"error": {"code", "message", ...}}``, or the ``{"code": <status>, "message"}`` of
    the ``/e2b`` routes (its class then follows the status)."""
    try:
        body = resp.json()
        err = body.get("error", {})
        if not isinstance(err, dict):
            err = {}
        if not err and isinstance(body.get("message"), str):  # E2B's shape
            err = {"message": body["message"]}
    except (ValueError, AttributeError):
        err = {}
    code = str(err.get("code", ""))
    message = str(err.get("message") or f"HTTP {resp.status_code}")
    context = {k: v for k, v in err.items() if k not in ("code", "message", "retry_after")}
    if resp.status_code == 429 and code == QuotaExceeded.code:
        return QuotaExceeded(message, **context)
    if resp.status_code == 429:
        return LimitExceeded(message, retry_after=retry_after(resp), **context)
    if resp.status_code == 409 and code == Busy.code:
        return Busy(message, retry_after=retry_after(resp), **context)
    # The code names the class; the status only stands in when the code is unknown (a
    # proxy's own answer, an older server). One class may answer with several statuses
    # (``invalid_request``: 400, or 422 from request validation).
    cls = BY_CODE.get(code)
    if cls is None and resp.status_code == 502:
        cls = Unavailable  # a gateway's own 502: it could not reach Hangar (Hangar says guest_error)
    if cls is None:
        cls = next((c for c in BY_CODE.values() if c.status == resp.status_code), HangarError)
    try:
        exc = cls(message, **context)
    except TypeError:  # context names an argument of the class
        exc = cls(message)
    exc.status = resp.status_code
    return exc


def stream_error(code: str | None, message: str | None) -> HangarError:
    """The error an ``error`` line of an exec stream stands for."""
    cls = BY_CODE.get(code or "", HangarError)
    try:
        return cls(message or "the call failed midway")
    except TypeError:
        return HangarError(message or "the call failed midway")


def retry_after(resp: httpx.Response) -> float:
    """``Retry-After`` in seconds (RFC 9110 delay-seconds; 1 when absent or a date)."""
    try:
        return max(0.0, float(resp.headers.get("Retry-After", "1")))
    except ValueError:
        return 1.0


def transport_error(url: str, exc: httpx.TransportError, timeout_s: float) -> HangarError:
    """The error for a request that got no answer.

    Whether the server may have acted follows from the failure: a
    connection that could not be made (or a pool slot never free) means
    nothing was sent; a timeout or broken connection after sending means
    the outcome is unknown.
    """
    never_sent = isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout,
                                  httpx.UnsupportedProtocol))
    detail = str(exc) or type(exc).__name__
    if isinstance(exc, httpx.TimeoutException):
        if never_sent:
            return RequestTimeout(f"could not connect to Hangar at {url} within {timeout_s:g} s; "
                                  "nothing was sent", outcome_unknown=False, timeout_s=timeout_s)
        return RequestTimeout(f"Hangar at {url} did not answer within {timeout_s:g} s; the "
                              "outcome is unknown: the server may have acted on the request",
                              outcome_unknown=True, timeout_s=timeout_s)
    if never_sent:
        return Unavailable(f"cannot reach Hangar at {url}: {detail}; is `hangar serve` running, "
                           "and is HANGAR_URL right?", outcome_unknown=False)
    return Unavailable(f"the connection to Hangar at {url} broke ({detail}); the outcome is "
                       "unknown: the server may have acted on the request", outcome_unknown=True)


def retry_delay(policy: RetryPolicy, attempt: int, error: HangarError) -> float | None:
    """Seconds to wait before attempt ``attempt + 1`` of a safe call, or None to give up.

    ``attempt`` counts from 0; ``error`` is what the attempt raised (mapped
    by ``error_for`` or ``transport_error``). The decision reads the class's
    ``retryable`` flag; the wait is the error's ``retry_after`` when the
    server sent one, else the policy's delay for this attempt.
    """
    if attempt >= len(policy.delays) or not error.retryable:
        return None
    wait = getattr(error, "retry_after", None)
    if wait is None:
        return policy.delays[attempt]
    return float(wait) if wait <= policy.max_retry_after else None


# -- bodies -----------------------------------------------------------------------------------


def drop_none(**fields: Any) -> dict[str, Any]:
    """The fields whose value is not None (the server applies its defaults to the rest)."""
    return {k: v for k, v in fields.items() if v is not None}


def exec_body(command: str, args: list[str] | None, env: Mapping[str, str] | None,
              cwd: str | None, stdin: str | bytes | None, timeout: float | None,
              max_output: int | None, show_command: bool) -> dict[str, Any]:
    """The JSON body of an exec (see ``hangar.schemas.ExecRequest``)."""
    body: dict[str, Any] = {"command": command}
    if args is not None:
        body["args"] = list(args)
    if env:
        body["env"] = dict(env)
    if cwd:
        body["cwd"] = cwd
    if isinstance(stdin, bytes):
        body["stdin_b64"] = base64.b64encode(stdin).decode()
    elif stdin is not None:
        body["stdin"] = stdin
    if timeout is not None:
        body["timeout"] = timeout
    if max_output is not None:
        body["max_output"] = max_output
    if show_command:
        body["show_command"] = True
    return body



# -- WebSockets -------------------------------------------------------------------------------


def ws_url(base_url: str, path: str, offset: int | None = None) -> str:
    """The ``ws(s)://`` URL of ``path`` (which may hold a query) on the server at
    ``base_url``, with ``offset=`` appended when given."""
    scheme, _, rest = base_url.partition("://")
    url = ("wss" if scheme == "https" else "ws") + "://" + rest + path
    if offset is not None:
        url += ("&" if "?" in url else "?") + f"offset={int(offset)}"
    return url


def ws_error(url: str, exc: BaseException) -> HangarError:
    """The ``hangar.errors`` instance for a WebSocket that was refused or broke.

    A refused upgrade carries Hangar's HTTP error (``websockets``'
    ``InvalidStatus``); a closed connection becomes ``Unavailable`` with the
    close code and reason in its context.
    """
    if isinstance(exc, HangarError):
        return exc
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    if isinstance(status, int):
        headers = getattr(response, "headers", None)
        raw = list(headers.raw_items()) if headers is not None and hasattr(
            headers, "raw_items") else []
        return error_for(httpx.Response(status, content=getattr(response, "body", b"") or b"",
                                        headers=raw))
    rcvd = getattr(exc, "rcvd", None)
    if rcvd is not None:
        return Unavailable(f"the WebSocket to {url} was closed: {rcvd.code} {rcvd.reason}",
                           outcome_unknown=True, close_code=rcvd.code)
    detail = str(exc) or type(exc).__name__
    return Unavailable(f"the WebSocket to {url} failed: {detail}", outcome_unknown=True)
