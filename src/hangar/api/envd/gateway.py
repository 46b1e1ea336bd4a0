"""The data plane's front: an ASGI middleware that takes every request under ``PREFIX``.

Flow of a request to ``/e2b/envd/<rest>``::

    E2b-Sandbox-Id: <id>        required: which sandbox (Hangar's id as is)
    E2b-Sandbox-Port: <port>    49983 (envd, the default) or a guest port
        │ X-Access-Token | X-API-Key | a /files signature, else 401 (before any body
        │   is read; ``hangar.api.envd.tokens``); the traffic token
        │   (E2B-Traffic-Access-Token) for user ports only (``e2b.traffic_admits``).
        │   Checked before the sandbox is looked up: a missing sandbox and a wrong
        │   token get the same 401, so the unauthenticated learn nothing of ids
        │ then: no sandbox, or one that is gone → 502 "... was not found" (the SDK's
        │   SandboxNotRunningException), as E2B's proxy answers; a paused one made
        │   without auto_resume → 502 too (``is_running()`` is False; connect wakes it),
        │   one made with it is woken by the call, unless it was paused keeping its
        │   filesystem alone (``sleeps_cold``: 502, only connect resumes it)
        ├── port ≠ 49983 → the guest's port (``hangar.api.envd.ports``)
        ├── POST /process.Process/<M>, /filesystem.Filesystem/<M> → Connect RPC
        │     (``hangar.api.envd.connect``; one module per RPC or small group)
        └── /health, /files, /envs, /metrics; /init and the freeze routes refused
              (``hangar.api.envd.rest``)

The SDK's signed file URLs (``download_url``, ``upload_url``) lose the
prefix under ``E2B_SANDBOX_URL`` (it joins ``/files`` to the URL) and carry
no header: ``/files`` at the server's root with a ``signature`` parameter is
taken too, its sandbox found by the signature (which binds the sandbox's
token; one hash per live sandbox).

Each sandbox has at most ``Settings.envd_max_requests_per_sandbox`` (128)
envd requests in flight (calls, streams, file transfers; port forwarding has
the port caps of ``hangar.core.ports``); one more is refused 429
``resource_exhausted`` before it is read, so one sandbox's client cannot
hold the server's connections from the others.

It sits outside the body cap and idempotency (as the port proxy does):
uploads are streamed to the guest, and no RPC is a keyed create. Errors of
RPCs are Connect errors; those of REST routes E2B's ``{"code", "message"}``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs

from starlette.types import ASGIApp, Receive, Scope, Send

from hangar.api.auth import authenticate
from hangar.api.http_limits import reset_connection
from hangar.api.envd import connect, fs_entries, fs_watch, ports, process_io, process_run, rest
from hangar.api.envd.connect import RpcError
from hangar.api.envd.tokens import EXPIRED, signature_ok, signer, token_ok
from hangar.api.envd.versions import ENVD_PORT, PREFIX
from hangar.api.envd.fs_entries import Listings
from hangar.api.envd.fs_watch import Watchers
from hangar.core.service import (
    Face, SandboxManager, SandboxView, State, e2b, e2b_user, public_name,
)
from hangar.errors import Gone, HangarError, NotFound, Unauthorized
from hangar.schemas.bounds import PORT_MAX, PORT_MIN

RPC_RE = re.compile(r"^/((?:process\.Process|filesystem\.Filesystem)/[A-Za-z]+)$")
SIGNED_FIELD_MAX = 4096
"""Longest path and username of a file URL found by its signature, characters."""
SIGNER_CANDIDATES_MAX = 5000
"""Most sandboxes tried for a file URL's signer (past it the URL must name its sandbox)."""
METHODS: dict[str, connect.Method] = {
    **process_run.METHODS, **process_io.METHODS, **fs_entries.METHODS, **fs_watch.METHODS,
}
"""Every RPC served, by ``<package>.<Service>/<Method>``."""


@dataclass
class Envd:
    """What a handler gets as ``Call.context``: ``user`` is the user the call runs as
    (``root``, or E2B's default user ``user``: ``hangar.core.e2b_user.user_for``)."""

    manager: SandboxManager
    sandbox_id: str
    user: str
    watchers: Watchers
    listings: Listings = field(default_factory=Listings)
    """The server's turns for ListDir answers (``listings_of``)."""
    options: e2b.Options | None = None
    """The sandbox's E2B options, read once as the call was admitted (None: a sandbox made
    through Hangar's own API): its default environment and working folder."""

    @property
    def home(self) -> str:
        """Where the call's relative paths start: its user's home."""
        return e2b_user.home(self.user)

    @property
    def workdir(self) -> str:
        """Where the call's commands run when they name no folder: the template's
        ``WORKDIR``, else the user's home."""
        return (self.options.workdir if self.options is not None else None) or self.home


class Refusal(Exception):
    """An answer before the request reaches a handler: ``status`` and Connect ``code``."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def _user(opts: e2b.Options | None, sandbox_id: str, headers: dict[str, str],
          query_user: str | None) -> str:
    """The user a call runs as: the one it names (Basic auth ``user:``, or ``username=``),
    else the sandbox's default (``hangar.core.e2b_user.user_for``); an unknown one is a 401."""
    user = query_user or ""
    auth = headers.get("authorization", "")
    if auth.lower().startswith("basic "):
        try:
            user = base64.b64decode(auth[6:].strip(), validate=True).decode().partition(":")[0]
        except (binascii.Error, UnicodeDecodeError):
            raise Refusal(400, "invalid_argument", "the Authorization header is not Basic "
                                                   "base64 of 'user:'") from None
    try:
        return e2b_user.user_for(opts, user, sandbox_id)
    except Unauthorized as exc:
        raise Refusal(401, "unauthenticated", exc.message) from None


def listings_of(app_state: Any) -> Listings:
    """The server's turns for building ListDir answers (made on first use)."""
    if getattr(app_state, "envd_listings", None) is None:
        app_state.envd_listings = Listings()
    return app_state.envd_listings


def watchers_of(app_state: Any) -> Watchers:
    """The server's polled file watchers (made on first use)."""
    if getattr(app_state, "envd_watchers", None) is None:
        app_state.envd_watchers = Watchers()
    return app_state.envd_watchers


@contextmanager
def _slot(state: Any, manager: SandboxManager, sandbox_id: str) -> Iterator[None]:
    """One of ``sandbox_id``'s envd requests in flight while the context lasts: checked and
    counted with no wait between, given back however the request ends. Raises Refusal (429
    resource_exhausted) past ``Settings.envd_max_requests_per_sandbox``."""
    inflight: dict[str, int] | None = getattr(state, "envd_inflight", None)
    if inflight is None:
        inflight = state.envd_inflight = {}
    cap = manager.settings.envd_max_requests_per_sandbox
    if inflight.get(sandbox_id, 0) >= cap:
        raise Refusal(429, "resource_exhausted",
                      f"sandbox {sandbox_id} has {cap} envd requests in flight, the most "
                      "allowed (HANGAR_ENVD_MAX_REQUESTS_PER_SANDBOX): end a stream first")
    inflight[sandbox_id] = inflight.get(sandbox_id, 0) + 1
    try:
        yield
    finally:
        left = inflight[sandbox_id] - 1
        if left:
            inflight[sandbox_id] = left
        else:
            del inflight[sandbox_id]


class EnvdGateway:
    """ASGI middleware: requests under ``PREFIX`` are served here; others go to ``app``.
    Finds the manager and key ring in ``scope["app"].state``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        signed = path == "/files" and scope["type"] == "http" and \
            b"signature=" in bytes(scope.get("query_string", b""))
        if scope["type"] not in ("http", "websocket") or not (
                signed or path == PREFIX or path.startswith(PREFIX + "/")):
            await self.app(scope, receive, send)
            return
        state = scope["app"].state
        rest_path = "/files" if signed else path[len(PREFIX):] or "/"
        m = RPC_RE.match(rest_path)
        try:
            manager: SandboxManager | None = getattr(state, "manager", None)
            if manager is None:
                raise Refusal(503, "unavailable", "the server is starting")
            headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                       for k, v in scope.get("headers", ())}
            query = {k: v[-1] for k, v in parse_qs(
                bytes(scope.get("query_string", b"")).decode("latin-1")).items()}
            if signed and "e2b-sandbox-id" not in headers:
                headers["e2b-sandbox-id"] = await self._signer(manager, scope, query)
            sandbox_id, port = self._target(headers)
            by_signature = self._admit(
                scope, state, manager, sandbox_id, port, headers, query,
                rest_path if m is None else None,
                rest_path if port == ENVD_PORT else
                ports.guest_path(scope, rest_path).decode("latin-1"))
            opts = e2b.options(self._exists(manager, sandbox_id))  # the call's one read
            if port != ENVD_PORT:
                await ports.forward(scope, receive, send, manager, state, sandbox_id, port,
                                    rest_path)
                return
            if scope["type"] != "http":
                raise Refusal(404, "not_found", "envd serves no WebSocket")
            # a signed file URL runs as the user it was signed for, whatever else is sent
            envd = Envd(manager, sandbox_id, _user(opts, sandbox_id,
                                                   {} if by_signature else headers,
                                                   query.get("username")),
                        watchers_of(state), listings_of(state), options=opts)
            with _slot(state, manager, sandbox_id):
                if m is not None:
                    await self._rpc(m.group(1), scope, headers, envd, receive, send)
                else:
                    await rest.serve(scope, receive, send, rest_path, query, headers, envd)
        except Refusal as r:
            if scope["type"] != "http":
                await send({"type": "websocket.close", "code": 1008})
            elif m is not None:
                await connect.unary_error(send, RpcError(r.code, r.message))
            else:
                await rest.error(send, r.status, r.message)

    @staticmethod
    async def _signer(manager: SandboxManager, scope: Scope, query: dict[str, str]) -> str:
        """The sandbox whose token signed this file URL (one without ``E2b-Sandbox-Id``: the
        SDK's ``download_url``/``upload_url`` under ``E2B_SANDBOX_URL`` drop the prefix and
        name no sandbox, so the signature, which binds the sandbox's token, names it).

        Anonymous, so bounded (REVIEW29c H4): the path and user at most
        ``SIGNED_FIELD_MAX`` characters (400), the candidates the visible sandboxes' ids
        alone (no record read), at most ``SIGNER_CANDIDATES_MAX`` of them (400: name the
        sandbox), hashed in a worker thread past a few dozen."""
        op = "read" if scope.get("method") == "GET" else "write"
        exp = query.get("signature_expiration", "")
        if exp and (not (exp.isascii() and exp.isdigit()) or len(exp) > 12):
            raise Refusal(401, "unauthenticated", "signature_expiration is not a Unix time")
        if exp and int(exp) < time.time():
            raise Refusal(401, "unauthenticated", EXPIRED)  # whichever sandbox signed it
        path, user = query.get("path", ""), query.get("username", "")
        if len(path) > SIGNED_FIELD_MAX or len(user) > SIGNED_FIELD_MAX:
            raise Refusal(400, "invalid_argument", f"a signed file URL's path and username "
                                                   f"are at most {SIGNED_FIELD_MAX} characters")
        ids = manager.ids()
        if len(ids) > SIGNER_CANDIDATES_MAX:
            raise Refusal(400, "invalid_argument", f"more than {SIGNER_CANDIDATES_MAX} "
                          "sandboxes could have signed this file URL: name its sandbox in "
                          "the E2b-Sandbox-Id header (or use the sandbox's own host)")
        args = (manager, ids, query.get("signature", ""), path, op, user,
                int(exp) if exp else None)
        found = await asyncio.to_thread(signer, *args) if len(ids) > 32 else signer(*args)
        if found is None:
            raise Refusal(401, "unauthenticated", "the signature matches no sandbox's file "
                                                  "URL (or it has expired)")
        return found

    @staticmethod
    def _target(headers: dict[str, str]) -> tuple[str, int]:
        sandbox_id = headers.get("e2b-sandbox-id", "")
        if not sandbox_id:
            raise Refusal(400, "invalid_argument",
                          "the E2b-Sandbox-Id header is missing: it names the sandbox (E2B's "
                          "SDK sends it with E2B_SANDBOX_URL set)")
        raw_port = headers.get("e2b-sandbox-port", str(ENVD_PORT))
        if not (raw_port.isascii() and raw_port.isdigit()) \
                or not PORT_MIN <= int(raw_port) <= PORT_MAX:
            raise Refusal(400, "invalid_argument", f"E2b-Sandbox-Port {raw_port[:16]!r} is not "
                                                   f"a port ({PORT_MIN}..{PORT_MAX})")
        return sandbox_id, int(raw_port)

    @staticmethod
    def _exists(manager: SandboxManager, sandbox_id: str) -> SandboxView:
        """The sandbox; raises Refusal (502, as E2B's proxy answers) when it is unknown or
        gone; asked only once the request is admitted (a token is derived from the id
        alone)."""
        try:
            rec = manager.get(sandbox_id)
        except (NotFound, Gone):
            raise Refusal(502, "unavailable",
                          f"The sandbox {sandbox_id[:64]} was not found") from None
        if rec.state == State.STOPPING:  # being deleted: gone for E2B already
            raise Refusal(502, "unavailable", f"The sandbox {sandbox_id} was not found")
        try:
            cold = rec.state == State.SLEEPING and manager.sleeps_cold(sandbox_id)
        except (NotFound, Gone):
            raise Refusal(502, "unavailable",
                          f"The sandbox {sandbox_id} was not found") from None
        if cold:
            raise Refusal(502, "unavailable",
                          f"The sandbox {sandbox_id} is paused with its filesystem alone: "
                          "connect to it to resume it (traffic does not)")
        # on its way to sleep (a snapshot for a pause) it is paused for E2B already, as
        # its get_info says: is_running() is False from the moment the pause is asked
        if public_name(rec.state, Face.E2B, rec.desired_state) == "paused" \
                and not rec.auto_resume:
            raise Refusal(502, "unavailable",
                          f"The sandbox {sandbox_id} is paused: connect to it to resume it "
                          "(it was created without auto_resume)")
        return rec

    @staticmethod
    def _admit(scope: Scope, state: Any, manager: SandboxManager, sandbox_id: str, port: int,
               headers: dict[str, str], query: dict[str, str], rest_path: str | None,
               guest_path: str) -> bool:
        """True when a file URL's signature admitted the request (it then runs as the user
        it was signed for), False for another credential. Raises Refusal (401) unless the
        request carries a credential for the sandbox:
        its envd access token in ``X-Access-Token``, a Hangar key, a file URL's signature
        (for envd's ``/files`` alone, never another port's),
        or, for a user port (and the code interpreter's context routes, which E2B's code
        interpreter SDK calls with it alone: ``e2b.traffic_admits``), its traffic token in
        ``E2B-Traffic-Access-Token``. The sandbox need not exist: tokens derive from the id,
        so an unknown id is refused as a wrong token is."""
        if token_ok(manager, sandbox_id, headers.get("x-access-token")):
            return False
        traffic = port != ENVD_PORT and e2b.traffic_admits(port, str(scope.get("method", "")),
                                                           guest_path)
        if traffic and e2b.check_traffic_token(manager, sandbox_id,
                                               headers.get("e2b-traffic-access-token")):
            return False
        key = headers.get("x-api-key")
        if key:
            client = scope.get("client")
            try:
                authenticate(state, key, client[0] if client else "unknown")
                return False
            except HangarError as exc:
                raise Refusal(401 if exc.status == 401 else exc.status,
                              "unauthenticated" if exc.status == 401 else "resource_exhausted",
                              exc.message) from None
        sig = query.get("signature")
        # envd's own /files alone: a file URL is no credential for the guest's other ports
        # (the code interpreter's, a private sandbox's user ports: REVIEW29d D-M4)
        if rest_path == "/files" and sig and port == ENVD_PORT \
                and scope.get("method") in ("GET", "POST"):
            op = "read" if scope["method"] == "GET" else "write"
            why = signature_ok(manager, sandbox_id, sig, query.get("path", ""), op,
                               query.get("username", ""), query.get("signature_expiration"))
            if why is None:
                return True
            raise Refusal(401, "unauthenticated", why)
        if traffic:
            raise Refusal(401, "unauthenticated",
                          "missing or wrong token: send the sandbox's trafficAccessToken in "
                          "E2B-Traffic-Access-Token, its envdAccessToken in X-Access-Token, "
                          "or a Hangar X-API-Key")
        raise Refusal(401, "unauthenticated",
                      "missing or wrong X-Access-Token: send the sandbox's envdAccessToken "
                      "(E2B's SDK does), or a Hangar X-API-Key")

    @staticmethod
    async def _rpc(name: str, scope: Scope, headers: dict[str, str], envd: Envd,
                   receive: Receive, send: Send) -> None:
        method = METHODS.get(name)
        if method is None:
            raise Refusal(501, "unimplemented", f"{name} is not an envd RPC Hangar serves")
        if scope.get("method") != "POST":
            raise Refusal(405, "unimplemented", f"{name} is called with POST")
        try:
            call = connect.new_call(headers)
        except RpcError as exc:
            raise Refusal(400, exc.code, exc.message) from None
        call.context = envd
        try:
            await connect.serve(method, call, receive, send)
        except connect.Dropped as exc:
            # the connection is reset, as E2B's edge does when the sandbox behind a call
            # is gone: the SDK reads a transport error, probes /health (502) and says so
            if reset_connection(scope):
                await asyncio.sleep(0)  # its connection_lost first: uvicorn then sees a
                # client gone, not an app that returned without an answer (a 500)
            else:
                await exc.answer(send)
