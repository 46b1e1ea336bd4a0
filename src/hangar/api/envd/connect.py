"""Connect RPC, the server side: codecs, envelopes, errors, and the three call kinds.

A call is ``POST /<package>.<Service>/<Method>``. Codecs, by content type:

===========================  =====================================================
``application/json``         unary, the proto3 JSON mapping (E2B's Python SDK)
``application/proto``        unary, binary protobuf
``application/connect+json`` streams (server or client), enveloped JSON
``application/connect+proto`` streams, enveloped binary protobuf
===========================  =====================================================

An envelope is a flags byte (``0x01`` compressed, ``0x02`` end of stream)
and a big-endian u32 length, then the message. A stream's answer is always
HTTP 200 and ends with an end-of-stream envelope holding a JSON object,
``{}`` or ``{"error": {"code", "message"}}``; a unary error is an HTTP
status of its code with the JSON body ``{"code", "message"}``. Compression:
``gzip`` and ``identity`` are read; answers are never compressed.

Bounds: a message is at most its method's ``Method.max_message`` bytes as sent and
again once inflated (``hangar.api.inflate``: incremental, never ``gzip.decompress``):
``MAX_MESSAGE`` (16 MiB) for the two that carry a process's input, ``START_MESSAGE``
(1 MiB) for a process's start and ``SMALL_MESSAGE`` (64 KiB) for the rest, which carry
paths and selectors. A binary message's values are not counted before it is parsed, so
the size is what bounds them: 1 MiB of empty ``args`` parses into about 16 MiB. A
JSON message holds at most ``hangar.json_items.MAX_ITEMS`` values, counted before it
is parsed (a parse builds every value first); past any of them the call ends with
``resource_exhausted`` naming the limit (HTTP 429 for a unary call, Connect's status
for that code). A message over ``OFFLOOP_BYTES``
is inflated and decoded in a worker thread, never on the event loop. An answer whose
items the guest sets (a ListDir's entries, a poll's events, a process table) is encoded
as JSON a slice of them at a time, with turns of the loop between (``Codec.encode_async``).

``Connect-Timeout-Ms`` gives the call's deadline (``Call.deadline``); a
unary handler that overruns it ends with ``deadline_exceeded``. Server
streams send the method's keep-alive message when the stream was quiet
for the ``Keepalive-Ping-Interval`` seconds the client asked for, and stop
(the handler's generator is closed) when the client goes away.
"""

from __future__ import annotations

import asyncio
import json
import logging
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message
from starlette.types import Receive, Send

from hangar import errors, json_items
from hangar.turns import Turns
from hangar.api.inflate import OFFLOOP_BYTES, inflate_whole

log = logging.getLogger("hangar.envd")

MAX_MESSAGE = 16 << 20
"""Largest request message taken, bytes: a chunk of a process's input (``SendInput``,
``StreamInput``)."""
START_MESSAGE = 1 << 20
"""Largest ``Start`` message, bytes: its command, arguments and environment go to the
guest in one agent frame, whose metadata is at most 1 MiB
(``hangar.guest.protocol.MAX_META``)."""
SMALL_MESSAGE = 64 << 10
"""Largest message of every other method, bytes: paths (4 KiB each on Linux), selectors,
sizes."""
KEEPALIVE_MIN_S = 1.0
"""Shortest keep-alive interval honoured, seconds."""
YIELD_EVERY = 64
"""Messages of one request body parsed between two turns of the event loop (64 empty
JSON envelopes take about 1.5 ms here; a 256 KiB chunk may hold 37,000)."""
ENCODE_ONLOOP = 32
"""An answer of at most this many items (elements of its repeated message fields, such as
a ListDir's entries) is encoded as JSON in one go; a larger one a slice of them at a time
(``Codec.encode_async``): ``json_format`` is pure Python, 30-60 us an entry of a ListDir,
and 10,000 entries with metadata held the loop 1.3-1.6 s in one go (review 29k K-H3)."""
ENCODE_SLICE = 8 << 10
"""Weight of the items of a large answer converted to JSON between two turns of the loop:
an item weighs its binary size plus ``ITEM_WEIGHT`` (converting one costs 20 us or so, and
more with each of its values, which take at least two bytes each), so a slice holds at
most about 4,000 values or 256 items: 80 ListDir entries with two metadata pairs each
(about 60 us each), 5 ms here."""
ITEM_WEIGHT = 32
"""An item's weight beyond its binary size (``ENCODE_SLICE``)."""

STATUS = {
    "canceled": 499, "unknown": 500, "invalid_argument": 400, "deadline_exceeded": 504,
    "not_found": 404, "already_exists": 409, "permission_denied": 403,
    "resource_exhausted": 429, "failed_precondition": 400, "aborted": 409,
    "out_of_range": 400, "unimplemented": 501, "internal": 500, "unavailable": 503,
    "data_loss": 500, "unauthenticated": 401,
}
"""Connect's codes and the HTTP status of each in a unary answer."""


class RpcError(Exception):
    """Ends a call with a Connect error: ``code`` one of ``STATUS``'s keys."""

    def __init__(self, code: str, message: str) -> None:
        assert code in STATUS, code
        super().__init__(message)
        self.code = code
        self.message = message

    def wire(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}


class Dropped(Exception):
    """Ends a server stream by dropping its connection, with no end-of-stream message: what
    a client of E2B's envd sees when the sandbox is killed during the call (the SDK then
    probes ``/health``, a 502, and raises its ``TimeoutException``). ``started``: whether
    the stream's response had started; ``ctype``: its content type (for ``answer``)."""

    def __init__(self, reason: str, started: bool = False, ctype: str = "") -> None:
        super().__init__(reason)
        self.started, self.ctype = started, ctype

    async def answer(self, send: Send) -> None:
        """Where the connection cannot be reset (another ASGI server, a Unix socket): end
        the stream with Connect's ``unavailable`` instead, starting its response first if
        it had not started, so the client reads the call's end, never a 500."""
        if not self.started:
            await _start(send, 200, self.ctype)
        await send({"type": "http.response.body",
                    "body": end_of_stream(RpcError("unavailable", str(self)))})


_CODES: tuple[tuple[type[errors.HangarError], str], ...] = (
    (errors.DiskFull, "resource_exhausted"), (errors.InvalidRequest, "invalid_argument"), (errors.Unauthorized, "unauthenticated"),
    (errors.NotFound, "not_found"), (errors.Gone, "not_found"),
    (errors.Busy, "unavailable"), (errors.Conflict, "failed_precondition"),
    (errors.TooLarge, "resource_exhausted"), (errors.LimitExceeded, "resource_exhausted"),
    (errors.Timeout, "deadline_exceeded"),
)


def rpc_error(exc: errors.HangarError) -> RpcError:
    """The Connect error of one of Hangar's errors (its message kept)."""
    for cls, code in _CODES:
        if isinstance(exc, cls):
            return RpcError(code, exc.message)
    return RpcError("internal", exc.message)


@dataclass
class Call:
    """One call as a handler sees it."""

    headers: dict[str, str]
    """Request headers, names lower-case (the last of repeated ones)."""
    timeout_s: float | None
    """``Connect-Timeout-Ms`` in seconds; None without one."""
    started: float = field(default_factory=time.monotonic)
    context: Any = None
    """What the gateway adds: the sandbox, the manager (``hangar.api.envd.gateway``)."""

    @property
    def deadline(self) -> float | None:
        """``time.monotonic()`` at which the call's time is up, or None."""
        return None if self.timeout_s is None else self.started + self.timeout_s

    def remaining(self) -> float | None:
        d = self.deadline
        return None if d is None else max(0.0, d - time.monotonic())


Unary = Callable[[Message, Call], Awaitable[Message]]
ServerStream = Callable[[Message, Call], AsyncIterator[Message]]
ClientStream = Callable[[AsyncIterator[Message], Call], Awaitable[Message]]


@dataclass(frozen=True)
class Method:
    """One RPC: ``kind`` is ``unary``, ``server`` (server stream) or ``client``."""

    kind: str
    request: type[Message]
    response: type[Message]
    handler: Callable[..., Any]
    keepalive: Callable[[], Message] | None = None
    """A server stream's keep-alive message."""
    max_message: int = SMALL_MESSAGE
    """Largest request message, bytes, as sent and once inflated."""


class Codec:
    """``json`` or ``proto``."""

    def __init__(self, name: str) -> None:
        self.name = name

    def decode(self, data: bytes | bytearray, cls: type[Message]) -> Message:
        try:
            if self.name == "proto":
                return cls.FromString(data)
            if json_items.too_many(data):  # parsed whole before unknown fields are dropped
                raise RpcError("resource_exhausted", f"a JSON message with more than "
                               f"{json_items.MAX_ITEMS} values, the limit: send fewer, or "
                               "send application/proto")
            return json_format.Parse(data or b"{}", cls(), ignore_unknown_fields=True)
        except (DecodeError, json_format.ParseError, UnicodeDecodeError, ValueError,
                RecursionError) as exc:
            raise RpcError("invalid_argument",
                           f"the request is not a {cls.DESCRIPTOR.name} message: "
                           f"{str(exc)[:200]}") from None

    async def decode_async(self, data: bytes | bytearray, cls: type[Message]) -> Message:
        """``decode``, in a worker thread for a message over ``OFFLOOP_BYTES``."""
        if len(data) <= OFFLOOP_BYTES:
            return self.decode(data, cls)
        return await asyncio.to_thread(self.decode, data, cls)

    def encode(self, msg: Message) -> bytes:
        if self.name == "proto":
            return msg.SerializeToString()
        return json.dumps(json_format.MessageToDict(msg), separators=(",", ":")).encode()

    async def encode_async(self, msg: Message) -> bytes:
        """``encode``'s bytes, with turns of the loop while a JSON answer of more than
        ``ENCODE_ONLOOP`` items is made: the items of its repeated message fields (not
        maps) are converted ``ENCODE_SLICE`` of weight at a time. Binary protobuf is encoded
        in C in one go (10,000 ListDir entries: about 5 ms)."""
        if self.name == "proto":
            return self.encode(msg)
        sliced = {f.name for f in msg.DESCRIPTOR.fields if f.is_repeated
                  and f.type == f.TYPE_MESSAGE and not f.message_type.GetOptions().map_entry}
        if sum(len(getattr(msg, name)) for name in sliced) <= ENCODE_ONLOOP:
            return self.encode(msg)
        fields = msg.ListFields()
        rest = type(msg)()  # the other fields, converted in one go
        for f, value in fields:
            if f.name in sliced:
                continue
            if f.is_repeated:
                getattr(rest, f.name).MergeFrom(value)
            elif f.type == f.TYPE_MESSAGE:
                getattr(rest, f.name).SetInParent()  # set, even when empty
                getattr(rest, f.name).CopyFrom(value)
            else:
                setattr(rest, f.name, value)
        small = json_format.MessageToDict(rest)
        parts = []
        for f, value in fields:
            text = await _json_items(value) if f.name in sliced else \
                json.dumps(small[f.json_name], separators=(",", ":"))
            parts.append(f"{json.dumps(f.json_name)}:{text}")
        return ("{" + ",".join(parts) + "}").encode()


async def _json_items(items: Any) -> str:
    """The JSON array of the messages ``items``, ``ENCODE_SLICE`` of weight converted between
    two turns of the loop."""
    turns = Turns(ENCODE_SLICE)
    pieces: list[str] = []
    part: list[Any] = []
    for item in items:
        part.append(json_format.MessageToDict(item))
        if await turns.tick(item.ByteSize() + ITEM_WEIGHT):
            pieces.append(json.dumps(part, separators=(",", ":"))[1:-1])
            part = []
    if part:
        pieces.append(json.dumps(part, separators=(",", ":"))[1:-1])
    return "[" + ",".join(pieces) + "]"


CODECS = {"json": Codec("json"), "proto": Codec("proto")}


def _codec(content_type: str, stream: bool) -> Codec:
    ctype = content_type.partition(";")[0].strip().lower()
    prefix = "application/connect+" if stream else "application/"
    name = ctype[len(prefix):] if ctype.startswith(prefix) else ""
    codec = CODECS.get(name)
    if codec is None:
        want = "application/connect+json or +proto" if stream else \
            "application/json or application/proto"
        raise RpcError("invalid_argument" if ctype else "unknown",
                       f"content type {ctype or '(none)'} is not served here: send {want}")
    return codec


async def _inflate(data: bytes | bytearray, encoding: str, limit: int) -> bytes | bytearray:
    """``data`` inflated by ``encoding``: at most ``limit`` bytes, off the loop when
    large. Raises RpcError (resource_exhausted past the limit, invalid_argument when broken,
    unimplemented for another encoding)."""
    if encoding in ("", "identity"):
        return data
    if encoding == "gzip":
        try:
            return await inflate_whole(data, limit, "the gzip message")
        except errors.TooLarge as exc:
            raise RpcError("resource_exhausted", exc.message) from None
        except errors.InvalidRequest as exc:
            raise RpcError("invalid_argument", exc.message) from None
    raise RpcError("unimplemented", f"compression {encoding[:32]} is not served: use gzip "
                                    "or none")


def envelope(data: bytes, end: bool = False) -> bytes:
    return struct.pack(">BI", 0x02 if end else 0x00, len(data)) + data


def end_of_stream(error: RpcError | None = None) -> bytes:
    body = {"error": error.wire()} if error is not None else {}
    return envelope(json.dumps(body).encode(), end=True)


class Body:
    """The request body as it arrives (ASGI ``receive``), with its envelopes parsed."""

    def __init__(self, receive: Receive, limit: int) -> None:
        self._receive = receive
        self.limit = limit
        """Largest message, bytes (``Method.max_message``)."""
        self._buf = bytearray()
        self.done = False
        self.disconnected = False

    async def _more(self) -> bool:
        if self.done:
            return False
        msg = await self._receive()
        if msg["type"] == "http.disconnect":
            self.done = self.disconnected = True
            return False
        self._buf += msg.get("body", b"")
        if len(self._buf) > self.limit + 5:
            raise self.too_large()
        if not msg.get("more_body", False):
            self.done = True
        return True

    def too_large(self) -> RpcError:
        return RpcError("resource_exhausted", f"a message over {self.limit} bytes, the "
                                              "limit of this method")

    async def whole(self) -> bytearray:
        """The whole body (held once: not copied)."""
        while await self._more():
            pass
        return self._buf

    async def envelopes(self, encoding: str) -> AsyncIterator[bytes | bytearray]:
        """Each enveloped message's bytes until the body ends. Gives the event loop a turn
        every ``YIELD_EVERY`` messages: one received chunk may hold tens of thousands of
        tiny envelopes, none of which awaits anything."""
        turns = Turns(YIELD_EVERY)
        while True:
            await turns.tick()
            while len(self._buf) < 5 and await self._more():
                pass
            if len(self._buf) < 5:
                if self._buf:
                    raise RpcError("invalid_argument", "the body ends inside an envelope")
                return
            flags, size = struct.unpack(">BI", self._buf[:5])
            if size > self.limit:
                raise self.too_large()
            while len(self._buf) < 5 + size and await self._more():
                pass
            if len(self._buf) < 5 + size:
                raise RpcError("invalid_argument", "the body ends inside a message")
            data = self._buf[5:5 + size]  # one copy, not two
            del self._buf[:5 + size]
            if flags & 0x02:
                return  # a client's end-of-stream: nothing after it counts
            yield await _inflate(data, encoding, self.limit) if flags & 0x01 else data


async def _start(send: Send, status: int, ctype: str) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", ctype.encode()),
                            (b"cache-control", b"no-store")]})


async def unary_error(send: Send, error: RpcError) -> None:
    """Answer a call (unary, or one not yet parsed) with a Connect error body."""
    await _start(send, STATUS[error.code], "application/json")
    await send({"type": "http.response.body", "body": json.dumps(error.wire()).encode()})


def _timeout(headers: dict[str, str]) -> float | None:
    raw = headers.get("connect-timeout-ms")
    if not raw:
        return None
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 10:
        raise RpcError("invalid_argument", f"Connect-Timeout-Ms {raw[:20]!r} is not a number "
                                           "of milliseconds (at most 10 digits)")
    return int(raw) / 1000


def _keepalive_s(headers: dict[str, str]) -> float | None:
    raw = headers.get("keepalive-ping-interval", "")
    try:
        return max(KEEPALIVE_MIN_S, float(raw)) if raw else None
    except ValueError:
        return None


def new_call(headers: dict[str, str]) -> Call:
    """The ``Call`` of a request's headers. Raises RpcError for a bad timeout."""
    if headers.get("connect-protocol-version", "1") != "1":
        raise RpcError("invalid_argument", "Connect-Protocol-Version must be 1")
    return Call(headers=headers, timeout_s=_timeout(headers))


async def serve(method: Method, call: Call, receive: Receive, send: Send) -> None:
    """Run ``method`` for one HTTP request whose headers made ``call``."""
    stream = method.kind != "unary"
    ctype = call.headers.get("content-type", "")
    try:
        codec = _codec(ctype, stream)
    except RpcError as exc:
        await unary_error(send, exc)
        return
    if method.kind == "unary":
        await _unary(method, call, codec, receive, send)
    elif method.kind == "server":
        await _server_stream(method, call, codec, receive, send)
    else:
        await _client_stream(method, call, codec, receive, send)


async def _unary(method: Method, call: Call, codec: Codec, receive: Receive,
                 send: Send) -> None:
    try:
        data = await _inflate(await Body(receive, method.max_message).whole(),
                              call.headers.get("content-encoding", ""), method.max_message)
        req = await codec.decode_async(data, method.request)
        coro = method.handler(req, call)
        remaining = call.remaining()
        try:
            res = await (asyncio.wait_for(coro, remaining) if remaining is not None else coro)
        except asyncio.TimeoutError:
            raise RpcError("deadline_exceeded", f"the call took longer than its timeout "
                                                f"({call.timeout_s:g} s)") from None
        out = await codec.encode_async(res)
    except RpcError as exc:
        await unary_error(send, exc)
        return
    except errors.HangarError as exc:
        await unary_error(send, rpc_error(exc))
        return
    except Exception as exc:  # a bug or a guest value no encoder takes: never a bare 500
        log.exception("envd call failed", extra={"method": method.request.DESCRIPTOR.name})
        await unary_error(send, RpcError("internal", f"the call failed: {type(exc).__name__}"))
        return
    await _start(send, 200, f"application/{codec.name}")
    await send({"type": "http.response.body", "body": out})


async def _first(body: Body, call: Call, codec: Codec, cls: type[Message]) -> Message:
    async for data in body.envelopes(call.headers.get("connect-content-encoding", "")):
        return await codec.decode_async(data, cls)
    raise RpcError("invalid_argument", "the stream carries no request message")


async def _disconnect(receive: Receive, body: Body) -> None:
    """Returns once the client went away (its body was read before)."""
    if body.disconnected:
        return
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


async def _server_stream(method: Method, call: Call, codec: Codec, receive: Receive,
                         send: Send) -> None:
    body = Body(receive, method.max_message)
    ctype = f"application/connect+{codec.name}"
    try:
        req = await _first(body, call, codec, method.request)
        await body.whole()
    except RpcError as exc:
        await _start(send, 200, ctype)
        await send({"type": "http.response.body", "body": end_of_stream(exc)})
        return
    gen = method.handler(req, call)
    gone = asyncio.ensure_future(_disconnect(receive, body))
    interval = _keepalive_s(call.headers) if method.keepalive else None
    started = dropped = False
    error: RpcError | None = None
    nxt: asyncio.Future[Message] | None = None
    try:
        while True:
            if nxt is None:
                nxt = asyncio.ensure_future(gen.__anext__())
            done, _ = await asyncio.wait({nxt, gone}, timeout=interval,
                                         return_when=asyncio.FIRST_COMPLETED)
            if gone in done:
                return
            if not done:  # quiet for the interval: a keep-alive
                msg = method.keepalive()  # type: ignore[misc]
            else:
                try:
                    msg = nxt.result()
                except StopAsyncIteration:
                    break
                finally:
                    nxt = None
            if not started:
                await _start(send, 200, ctype)
                started = True
            await send({"type": "http.response.body",
                        "body": envelope(await codec.encode_async(msg)), "more_body": True})
    except RpcError as exc:
        error = exc
    except errors.HangarError as exc:
        error = rpc_error(exc)
    except Dropped as exc:
        log.info("envd stream dropped", extra={"method": method.request.DESCRIPTOR.name,
                                               "reason": str(exc)})
        dropped = True
    except Exception as exc:
        log.exception("envd stream failed", extra={"method": method.request.DESCRIPTOR.name})
        error = RpcError("internal", f"the call failed: {type(exc).__name__}")
    finally:
        gone.cancel()
        if nxt is not None:
            nxt.cancel()
            try:
                await nxt
            except BaseException:
                pass
        await gen.aclose()
    if dropped:  # no end of stream: the gateway resets the connection (``Dropped``)
        raise Dropped("the call's sandbox is gone", started, ctype)
    if not started:
        await _start(send, 200, ctype)
    await send({"type": "http.response.body", "body": end_of_stream(error)})


async def _client_stream(method: Method, call: Call, codec: Codec, receive: Receive,
                         send: Send) -> None:
    body = Body(receive, method.max_message)
    ctype = f"application/connect+{codec.name}"
    encoding = call.headers.get("connect-content-encoding", "")

    async def requests() -> AsyncIterator[Message]:
        async for data in body.envelopes(encoding):
            yield await codec.decode_async(data, method.request)

    try:
        coro = method.handler(requests(), call)
        remaining = call.remaining()
        try:
            res = await (asyncio.wait_for(coro, remaining) if remaining is not None else coro)
        except asyncio.TimeoutError:
            raise RpcError("deadline_exceeded", f"the stream lasted longer than its timeout "
                                                f"({call.timeout_s:g} s)") from None
        out = envelope(await codec.encode_async(res)) + end_of_stream()
    except RpcError as exc:
        out = end_of_stream(exc)
    except errors.HangarError as exc:
        out = end_of_stream(rpc_error(exc))
    except Exception as exc:  # as in _unary
        log.exception("envd stream failed", extra={"method": method.request.DESCRIPTOR.name})
        out = end_of_stream(RpcError("internal", f"the call failed: {type(exc).__name__}"))
    await _start(send, 200, ctype)
    await send({"type": "http.response.body", "body": out})
