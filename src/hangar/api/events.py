"""``/events``: live events as Server-Sent Events, and events published by agent platforms.

``GET /events`` answers ``text/event-stream`` (the WHATWG HTML "Server-sent
events" format): first ``retry: 1000`` (reconnect after 1 s), then one
message per event::

    id: 3f9c0a1b:42
    data: {"id": "3f9c0a1b:42", "time": 1700000000.123, "kind": "exec.finished",
           "sandbox_id": "sb-…", "data": {"exit_code": 0, "duration_s": 1.2, ...}}

(on one line), and a ``: keep-alive`` comment after 15 s without one. A
client that reconnects with ``Last-Event-ID`` first gets the events it
missed from the server's ring of recent ones (``hangar.core.events``); a
client that leaves during that replay ends it quietly (no log line per
event written into a closed connection).
``kind`` (comma-separated kinds or prefixes, e.g. ``exec,sandbox.created``)
and ``sandbox_id`` filter. The stream ends when the server shuts down.

``POST /events`` takes an event of an agent platform (kinds under
``agent.`` only, ``data`` at most 16 KiB of JSON) and publishes it to every
listener, so ``hangar events`` can show what agents do beside what the
sandboxes do.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import StreamingResponse

from hangar.core.service import Event as BusEvent, EventBus, acting
from hangar.errors import InvalidRequest
from hangar.schemas import MAX_EVENT_DATA, Event, PublishEvent

router = APIRouter(tags=["events"])

KEEPALIVE_S = 15.0
"""Seconds without an event before a keep-alive comment (below common proxies' 30-60 s)."""


KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
RESERVED = {"id", "time", "kind", "sandbox_id", "team"}


def bus(request: Request) -> EventBus:
    events: EventBus = request.app.state.events
    return events


def wire(b: EventBus, ev: BusEvent) -> Event:
    return Event(id=b.wire_id(ev), time=ev.time, kind=ev.kind, sandbox_id=ev.sandbox_id,
                 data=ev.data, team=ev.team)


@router.get(
    "/events", response_class=StreamingResponse,
    summary="Live events (Server-Sent Events); Last-Event-ID resumes after a reconnect",
    responses={200: {"content": {"text/event-stream": {}}, "description": (
        "`id: <id>` and `data: <Event as JSON>` per event; `: keep-alive` comments.")}},
)
async def stream(
    request: Request,
    kind: Annotated[str | None, Query(max_length=1000, description=(
        "Comma-separated kinds or prefixes, e.g. 'exec,sandbox.created'."))] = None,
    sandbox_id: Annotated[str | None, Query(max_length=64)] = None,
    last_event_id: Annotated[str | None, Header(max_length=200)] = None,
) -> StreamingResponse:
    b = bus(request)
    kinds = [k.strip() for k in (kind or "").split(",") if k.strip()]
    after = b.resume_after(last_event_id)
    team = acting()  # a team's key: its team's events only (hangar.core.teams)
    if sandbox_id is not None:
        request.app.state.manager.teams.check(sandbox_id)

    async def body() -> AsyncIterator[bytes]:
        yield b"retry: 1000\n\n"
        async for ev in b.subscribe(after, kinds, sandbox_id, idle=KEEPALIVE_S, team=team):
            if ev is None:
                yield b": keep-alive\n\n"
                continue
            data = wire(b, ev).model_dump_json()
            yield f"id: {b.wire_id(ev)}\ndata: {data}\n\n".encode()
            # A replay yields the ring's events without waiting: let the loop see a client
            # that went away, or every write after it logs asyncio's warning (one per event).
            await asyncio.sleep(0)

    return StreamingResponse(body(), media_type="text/event-stream", headers={
        "Cache-Control": "no-store", "X-Accel-Buffering": "no"})


@router.post("/events", response_model=Event, status_code=201,
             summary="Publish an agent platform's event (kinds under 'agent.')")
async def publish(body: PublishEvent, request: Request) -> Event:
    for key in body.data:
        if not KEY.match(key) or key in RESERVED:
            raise InvalidRequest(f"event data key {key[:80]!r} is not allowed: use a name of "
                                 "letters, digits and _, other than id, time, kind, sandbox_id, "
                                 "team")
    size = len(json.dumps(body.data, separators=(",", ":")))
    if size > MAX_EVENT_DATA:
        raise InvalidRequest(f"event data is {size} bytes of JSON; at most {MAX_EVENT_DATA}",
                             size=size)
    if body.sandbox_id is not None:  # a team's key: about its own sandboxes only (404)
        request.app.state.manager.teams.check(body.sandbox_id)
    b = bus(request)
    return wire(b, b.publish(body.kind, body.sandbox_id, **body.data))
