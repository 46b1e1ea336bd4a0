"""Live events: the flat client's calls (``/events``): publish an agent platform's event,
and follow the server's events (Server-Sent Events), reconnecting without a gap.

Mixed into ``AsyncHangar``; its methods run on the flat client (``self``). Source of
``hangar/client/_sync/events.py``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
from httpx_sse import EventSource

from hangar.client import _core
from hangar.client._async._compat import sleep
from hangar.client._async.mixin import flat_client as _client
from hangar.errors import HangarError, Unavailable
from hangar.schemas import Event


class AsyncEventCalls:
    """The flat client's event methods (mixed into ``AsyncHangar``)."""

    async def publish_event(self, kind: str, sandbox_id: str | None = None, *,
                            request_timeout: float | None = None, retry: bool | None = None,
                            **data: Any) -> Event:
        """``POST /events``: publish an agent platform's event to every listener.

        ``kind`` must start with ``agent.`` (e.g. ``agent.tool.started``);
        ``data`` holds JSON fields (at most 16 KiB), never secrets or file
        contents. Raises InvalidRequest for another kind or too much data.
        """
        c = _client(self)
        body = {"kind": kind, "sandbox_id": sandbox_id, "data": data}
        t = c._t(request_timeout, c.config.timeouts.control)
        return Event.model_validate(await c._json("POST", "/events", json=body, timeout=t,
                                                  retry=bool(retry)))

    async def events(self, *, kinds: Sequence[str] = (), sandbox_id: str | None = None,
                     last_event_id: str | None = None, reconnect: bool = True,
                     request_timeout: float | None = None) -> AsyncIterator[Event]:
        """``GET /events`` (Server-Sent Events): yield live events as they happen, forever.

        ``kinds`` filters by kind or prefix (``exec`` matches
        ``exec.finished``); ``sandbox_id`` by sandbox. With
        ``last_event_id`` the server first replays what came after it (from
        its ring of recent events). When the connection breaks, the
        iterator reconnects with the last id it yielded, so nothing is
        missed, waiting the retry policy's delays; it raises once a
        reconnect has failed as many times in a row as the policy allows,
        or at once when ``reconnect`` is false. ``request_timeout`` is the
        longest silence before reconnecting (default 45 s; the server sends
        a keep-alive every 15 s). Stop by leaving the loop (and closing the
        iterator).
        """
        c = _client(self)
        last = last_event_id
        params: dict[str, Any] = {}
        if kinds:
            params["kind"] = ",".join(kinds)
        if sandbox_id:
            params["sandbox_id"] = sandbox_id
        t = c._t(request_timeout, c.config.timeouts.events)
        policy = c.config.retry
        failures = 0
        while True:
            headers = {"Accept": "text/event-stream", "Cache-Control": "no-store"}
            if last is not None:
                headers["Last-Event-ID"] = last
            error: HangarError
            try:
                resp = await c._send("GET", "/events", params=params, headers=headers,
                                     timeout=t, retry=False, stream=True)
            except HangarError as exc:
                if not (reconnect and exc.retryable):
                    raise
                error = exc
            else:
                try:
                    async for sse in EventSource(resp).aiter_sse():
                        if not sse.data or sse.event not in ("", "message"):
                            continue
                        ev = Event.model_validate_json(sse.data)
                        last = ev.id
                        failures = 0
                        yield ev
                    error = Unavailable(f"the event stream of {c.base_url} ended")
                except httpx.TransportError as exc:
                    error = Unavailable(f"the event stream of {c.base_url} broke: "
                                        f"{exc or type(exc).__name__}")
                finally:
                    await resp.aclose()
                if not reconnect:
                    raise error
            if failures >= len(policy.delays):
                raise error
            delay = policy.delays[failures]
            failures += 1
            _core.log.warning("event stream: reconnecting in %g s: %s", delay, error.message)
            await sleep(delay)
