"""VNC client→server messages are bounded by type (issue 20, class 5; docs/security.md).

A viewer, even a view-only one, could declare a ClientCutText of 2 GiB and have the
proxy buffer it while waiting for its end. The proxy now relays a message as its bytes
arrive, and refuses an over-long one on its header: the connection closes at once
(1008) and the server's memory does not grow. Unit tests cover the filter in any
chunking; the VM test drives a real server's WebSocket with a raw client.
"""

from __future__ import annotations

import asyncio
import struct

import pytest

from test_desktop import (  # noqa: F401  (fixtures: the desktop image and sandbox)
    Viewer, desk, desktop_image, rfb_messages, vm, ws_url,
)


def _after_handshake(view_only: bool):  # type: ignore[no-untyped-def]
    from hangar.api.vnc import RfbClientFilter

    f = RfbClientFilter(view_only)
    assert f.feed(b"RFB 003.008\n\x01\x00") == b"RFB 003.008\n\x01\x01"
    return f


@pytest.mark.parametrize("view_only", [True, False])
def test_huge_cut_text_is_refused_on_its_header(view_only: bool) -> None:
    from hangar.api.vnc import RfbViolation

    f = _after_handshake(view_only)
    with pytest.raises(RfbViolation, match="ClientCutText of 2147483647 bytes"):
        f.feed(struct.pack(">BxxxI", 6, 0x7FFFFFFF))
    f = _after_handshake(view_only)
    with pytest.raises(RfbViolation, match="SetEncodings with 65535"):
        f.feed(struct.pack(">BxH", 2, 0xFFFF))


@pytest.mark.parametrize("view_only", [True, False])
def test_messages_are_relayed_as_they_come_never_held(view_only: bool) -> None:
    f = _after_handshake(view_only)
    text = b"x" * (1 << 20)  # the largest cut text allowed
    msg = struct.pack(">BxxxI", 6, len(text)) + text
    out = b""
    for i in range(0, len(msg), 4096):
        out += f.feed(msg[i:i + 4096])
        assert len(f.buf) == 0, "nothing is held between feeds"
    assert out == (b"" if view_only else msg)
    # what follows still parses: an update request passes for everyone
    m = rfb_messages()
    assert f.feed(m["update_request"]) == m["update_request"]


@vm
def test_a_message_of_many_pointer_events_leaves_the_loop_free() -> None:
    """A viewer's 4 MiB message of 6-byte PointerEvents is filtered 16 KiB at a time with a
    turn of the loop between (review 29i I-H3: 1.4 s of the loop in one go), and every
    event still reaches the VNC server, in order."""
    from hangar.api.vnc import RfbClientFilter, _proxy

    events = b"".join(struct.pack(">BBHH", 5, 0, i % 800, i % 600) for i in range(700_000))
    handshake = b"RFB 003.008\n\x01\x00"

    class Ws:
        def __init__(self) -> None:
            self.sent = [handshake, events]
            self.client_state = self.application_state = None

        async def receive(self) -> dict[str, object]:
            if self.sent:
                return {"type": "websocket.receive", "bytes": self.sent.pop(0)}
            await asyncio.sleep(3600)
            return {"type": "websocket.disconnect"}

        async def send_bytes(self, data: bytes) -> None:
            pass

        async def close(self, **kw: object) -> None:
            pass

    class Far:
        def __init__(self) -> None:
            self.got = bytearray()

        async def write(self, data: bytes) -> None:
            self.got += data
            if len(self.got) >= len(handshake) + len(events):
                done.set()

        async def read(self) -> bytes:
            await done.wait()
            return b""

        async def close(self) -> None:
            pass

    done = asyncio.Event()

    from loop_stalls import measured

    far = Far()
    _, stalls = asyncio.run(measured(asyncio.wait_for(_proxy(
        Ws(), far, RfbClientFilter(False), "sb-x"), 60)))  # type: ignore[arg-type]
    assert bytes(far.got) == b"RFB 003.008\n\x01\x01" + events
    stalls.check(0.3)  # 1.5 s before


def test_a_view_only_viewer_cannot_make_the_server_buffer(server, api, desk) -> None:  # noqa: F811
    websockets = pytest.importorskip("websockets")

    def rss_kib() -> int:
        with open(f"/proc/{server.proc.pid}/status") as fh:
            return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:"))

    async def run(url: str) -> tuple[int | None, str, float]:
        async with websockets.connect(url, subprotocols=["binary"], max_size=None,
                                      origin=server.url) as ws:
            assert await Viewer(ws).handshake() == (1024, 768)
            loop = asyncio.get_running_loop()
            sent = loop.time()
            await ws.send(struct.pack(">BxxxI", 6, 0x7FFFFFFF))  # 2 GiB of cut text, declared
            try:
                for _ in range(256):  # then up to 32 MiB of it, if the server lets us
                    await ws.send(b"x" * (1 << 17))
            except websockets.exceptions.ConnectionClosed:
                pass
            await asyncio.wait_for(ws.wait_closed(), 30)
            return ws.close_code, ws.close_reason, loop.time() - sent

    before = rss_kib()
    code, reason, took = asyncio.run(run(ws_url(server, api, desk, view_only=True)))
    assert code == 1008 and "ClientCutText" in reason
    assert took < 10
    assert rss_kib() - before < 16 << 10, "the server's memory grew"
    # The desktop is still served: a new viewer connects.

    async def again(url: str) -> tuple[int, int]:
        async with websockets.connect(url, subprotocols=["binary"], origin=server.url) as ws:
            return await Viewer(ws).handshake()

    assert asyncio.run(again(ws_url(server, api, desk))) == (1024, 768)
