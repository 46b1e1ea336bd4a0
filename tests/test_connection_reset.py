"""envd's dropped streams reset the request's own connection, found by the request, never
by address (review 29b, G5). Without a VM: a real uvicorn with ``hangar serve``'s
protocol and limits, trusting ``X-Forwarded-For`` from anyone (as
``HANGAR_FORWARDED_ALLOW_IPS=*`` does), and a bare ASGI app."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn

from conftest import free_port
from hangar.api.envd import connect
from hangar.api.http_limits import reset_connection, uvicorn_options


async def app(scope: Any, receive: Any, send: Any) -> None:
    """``/hold``: a response sent in two parts 1 s apart; ``/drop``: reset this request's
    connection, answering nothing (as envd's gateway does for a dropped stream)."""
    if scope["type"] != "http":
        return
    if scope["path"] == "/hold":
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"10")]})
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        await asyncio.sleep(1.0)
        await send({"type": "http.response.body", "body": b"-last"})
        return
    assert reset_connection(scope)
    await asyncio.sleep(0)


@pytest.fixture()
def server() -> Iterator[int]:
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None,
                            access_log=False, lifespan="off", proxy_headers=True,
                            forwarded_allow_ips="*", **uvicorn_options())
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield port
    finally:
        srv.should_exit = True
        thread.join(10)


def request(port: int, path: str, headers: str = "") -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n{headers}\r\n".encode())
    return s


def read_all(s: socket.socket, got: bytes = b"") -> bytes:
    while b"-last" not in got:
        chunk = s.recv(4096)
        if not chunk:
            break
        got += chunk
    return got


def test_a_dropped_stream_resets_its_own_connection_not_the_one_its_header_names(
        server: int, caplog: pytest.LogCaptureFixture) -> None:
    """A client names another client's connection in ``X-Forwarded-For`` (its address
    and port): the reset reaches the caller's connection only (an RST: a read error),
    the other's response completes, and uvicorn logs no app that answered nothing (no
    500)."""
    caplog.set_level(logging.INFO)
    victim = request(server, "/hold")
    first = b""
    while b"first" not in first:
        chunk = victim.recv(4096)
        assert chunk, first
        first += chunk
    assert first.startswith(b"HTTP/1.1 200")
    host, port = victim.getsockname()
    caller = request(server, "/drop", f"X-Forwarded-For: {host}:{port}\r\n")
    with pytest.raises(ConnectionResetError):
        if not caller.recv(4096):
            raise AssertionError("closed, not reset")
    assert read_all(victim, first).endswith(b"first-last")
    victim.close()
    caller.close()
    assert not [r for r in caplog.records if "without starting response" in r.getMessage()
                or "Exception in ASGI" in r.getMessage()]


def test_a_dropped_stream_without_a_connection_to_reset_ends_with_unavailable() -> None:
    """Where the request carries no connection of Hangar's protocol (another ASGI server),
    the stream ends with Connect's ``unavailable`` (its response started if it was not),
    never with no answer at all (uvicorn's 500)."""
    assert reset_connection({"type": "http", "client": ("127.0.0.1", 1)}) is False
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    for started in (False, True):
        sent.clear()
        exc = connect.Dropped("the call's sandbox is gone", started,
                              "application/connect+json")
        asyncio.run(exc.answer(send))
        if not started:
            assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
        body = sent[-1]["body"]
        flags, size = struct.unpack(">BI", body[:5])
        assert flags & 0x02 and json.loads(body[5:5 + size])["error"]["code"] == "unavailable"
