"""The ``Idempotency-Key`` header: a repeated POST is answered with its first result.

An ASGI middleware, so it covers every POST (the SDK sends a key with each
create: sandbox, snapshot, fork, machine; and with an exec it was asked to
retry). For a POST that carries the header it:

1. reads the body and hashes method, path, query and body;
2. if the caller's API key already used this key: answers the stored
   result (with ``Idempotent-Replayed: true``) when the request is the
   same, or 422 ``idempotency_mismatch`` when it is not;
3. if a request with this key is still running (a retry that overtook a
   slow first attempt): waits for it, then does step 2 (or, if it failed,
   runs this one);
4. else runs the request and stores a successful JSON answer
   (``hangar.core.idempotency``: 24 h, keyed by a hash of the API key and
   sealed with a key derived from it: the store never holds an answer's
   secrets in clear), sealed and written in a worker thread before the
   answer's last bytes go out.

Only answers of at most ``MAX_STORED`` bytes are kept (creates, forks,
snapshots, small execs). Of a larger successful JSON answer (an exec's
output) only the fact that it was given is kept: a repeat of its key gets
409 ``conflict``, saying so, and the request is not run again, as the key
promised (Stripe and the IETF draft answer a key they cannot replay with
409 too; a new key runs the request again). Each API key keeps at most
``OWNER_ROWS`` records and ``OWNER_BYTES`` of answers, its oldest dropped
first (``hangar.core.idempotency``).

It runs inside the front door (``hangar.api.frontdoor``): the API key was
checked before this middleware reads a byte of the body, so a key that
was removed gets 401, not a stored answer.

A request without the header, or of another method, passes untouched.
Keys are 1 to 255 printable ASCII characters; others get 400.
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hangar.api.errors import render, send_error
from hangar.core.service import (
    MAX_KEY_LEN, IdempotencyStore, owner_of, request_hash, seal, seal_key, unseal,
)

MAX_BODY = 8 << 20
"""Bytes of request body the middleware holds to hash (creates and execs are far smaller)."""
MAX_STORED = 64 << 10
"""Bytes of answer kept for replay: a create's, fork's or snapshot's answer is 1 to 2 KiB,
a small exec's a few KiB. Of a larger one only that it was given is kept, and a repeat
gets 409 (review 29k K-M2: 4 MiB answers, each 30 to 130 ms of the loop and 3.6 MiB of
disk for 24 h)."""


def _header(scope: Scope, name: bytes) -> str | None:
    for k, v in scope.get("headers", []):
        if k.lower() == name:
            return str(v.decode("latin-1"))
    return None


async def _reply(send: Send, status: int, body: bytes, content_type: str,
                 extra: list[tuple[bytes, bytes]] | None = None) -> None:
    headers = [(b"content-type", content_type.encode()),
               (b"content-length", str(len(body)).encode()), *(extra or [])]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _error(send: Send, status: int, code: str, message: str) -> None:
    await send_error(send, render(status, code, message))


class IdempotencyMiddleware:
    """Wraps the app; finds its store at ``app.state.idempotency`` (set at start-up)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._running: dict[tuple[str, str], tuple[str, asyncio.Event]] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        key = _header(scope, b"idempotency-key")
        store: IdempotencyStore | None = getattr(scope["app"].state, "idempotency", None)
        if key is None or store is None:
            await self.app(scope, receive, send)
            return
        if not 1 <= len(key) <= MAX_KEY_LEN or not key.isascii() or not key.isprintable():
            await _error(send, 400, "invalid_request",
                         f"Idempotency-Key must be 1 to {MAX_KEY_LEN} printable ASCII characters")
            return
        body, more = await self._read(receive)
        if more:
            await _error(send, 413, "too_large",
                         f"a request with an Idempotency-Key may carry at most {MAX_BODY} bytes")
            return
        api_key = _header(scope, b"x-api-key") or ""
        owner, secret = owner_of(api_key), seal_key(api_key)
        fingerprint = request_hash("POST", scope["path"],
                                   scope.get("query_string", b"").decode("latin-1"), body)
        slot = (owner, key)
        while True:
            rec = store.find(owner, key)
            answer = None if rec is None or rec.request_hash != fingerprint else \
                unseal(secret, owner, key, fingerprint, rec.body)
            if rec is not None and rec.request_hash != fingerprint:
                await self._mismatch(send)
                return
            if rec is not None and not rec.kept:
                await _error(send, 409, "conflict",
                             "the request with this Idempotency-Key was answered already, "
                             f"with more than the {MAX_STORED >> 10} KiB kept for a repeat, "
                             "so its answer cannot be given again; it is not run twice: use "
                             "a new key to run it again")
                return
            if rec is not None and answer is not None:
                await _reply(send, rec.status, answer, rec.content_type,
                             [(b"idempotent-replayed", b"true")])
                return
            running = self._running.get(slot)
            if running is None:
                break
            if running[0] != fingerprint:
                await self._mismatch(send)
                return
            await running[1].wait()
        done = asyncio.Event()
        self._running[slot] = (fingerprint, done)
        try:
            await self._run(scope, body, receive, send, store, owner, key, fingerprint, secret)
        finally:
            del self._running[slot]
            done.set()

    @staticmethod
    async def _mismatch(send: Send) -> None:
        await _error(send, 422, "idempotency_mismatch",
                     "this Idempotency-Key was used with another request; use a new key for a "
                     "new request")

    @staticmethod
    async def _read(receive: Receive) -> tuple[bytes, bool]:
        """The whole request body, and whether it was over ``MAX_BODY``."""
        chunks: list[bytes] = []
        size = 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":
                break
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > MAX_BODY:
                return b"", True
            chunks.append(chunk)
            if not msg.get("more_body", False):
                break
        return b"".join(chunks), False

    async def _run(self, scope: Scope, body: bytes, receive: Receive, send: Send,
                   store: IdempotencyStore, owner: str, key: str, fingerprint: str,
                   secret: bytes) -> None:
        sent_body = False

        async def replay() -> Message:
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        status = 0
        content_type = ""
        parts: list[bytes] = []
        size = 0

        def keep(answer: bytes | None) -> None:
            """Seal and save (in a worker thread): ``answer``, or None for one not kept."""
            sealed = b"" if answer is None else seal(secret, owner, key, fingerprint, answer)
            store.save(owner, key, fingerprint, status, content_type, sealed)

        async def capture(msg: Message) -> None:
            nonlocal status, content_type, size
            if msg["type"] == "http.response.start":
                status = int(msg["status"])
                for k, v in msg.get("headers", []):
                    if k.lower() == b"content-type":
                        content_type = v.decode("latin-1")
            elif msg["type"] == "http.response.body":
                chunk = msg.get("body", b"")
                size += len(chunk)
                if size <= MAX_STORED:
                    parts.append(chunk)
                else:
                    parts.clear()
                if not msg.get("more_body", False) and 200 <= status < 300 \
                        and content_type.startswith("application/json"):
                    await asyncio.to_thread(keep, b"".join(parts) if size <= MAX_STORED
                                            else None)
            await _forward(send, msg)

        await self.app(scope, replay, capture)


async def _forward(send: Send, msg: dict[str, Any]) -> None:
    """Send to the client; a client that went away must not stop the record being kept."""
    try:
        await send(msg)
    except OSError:
        pass
