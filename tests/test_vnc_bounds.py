"""The desktop's bounds: VNC client→server messages by type (issue 20, class 5), a guest
tool's output and the screenshots' decoding (review 29k K-H1, K-M1; docs/security.md).

A viewer, even a view-only one, could declare a ClientCutText of 2 GiB and have the
proxy buffer it while waiting for its end. The proxy now relays a message as its bytes
arrive, and refuses an over-long one on its header: the connection closes at once
(1008) and the server's memory does not grow. Unit tests cover the filter in any
chunking; the VM test drives a real server's WebSocket with a raw client.

A guest's scrot or xdotool replaced by ``cat /dev/zero`` had the server keep all it
wrote (100-150 MiB/s). ``Desktop._exec`` now keeps at most the screen's PNG bound (or
64 KiB) and cancels the command past it: unit tests run it with the real agent client
against the real guest agent on a Unix socket; the VM tests replace the guest's tools.
Screenshots scale in their own two threads, never in asyncio's default pool.
"""

from __future__ import annotations

import asyncio
import io
import os
import struct
import threading
import time
import tracemalloc
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from conftest import Server
from test_agent_client import agent_socket, requests_settle
from test_desktop import (  # noqa: F401  (fixtures: the desktop image and sandbox)
    Viewer, desk, desktop_image, png_size, rfb_messages, sh, shot, vm, ws_url,
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


# -- a guest tool's output (K-H1) and the screenshots' threads (K-M1) ---------------------------


class _Calls:
    """What ``SandboxManager`` gives ``Desktop``, over a real agent client: ``exec_stream``
    nests the client's stream in a generator as ``GuestCalls.exec_stream`` does."""

    def __init__(self, client: Any, desktop: str = "1024x768x24") -> None:
        self.client = client
        self.desktop = desktop

    def get(self, sandbox_id: str) -> Any:
        return SimpleNamespace(desktop=self.desktop)

    async def agent(self, sandbox_id: str) -> Any:
        return self.client

    async def exec_stream(self, sandbox_id: str, meta: dict[str, Any],
                          stdin: bytes | None = None) -> Any:
        async for ev in self.client.exec_stream({**meta, "stream": True}, stdin):
            yield ev


async def _gone(pid: int, within: float = 5.0) -> bool:
    """Whether process ``pid`` ends within ``within`` seconds (the agent, on this loop,
    kills it)."""
    end = time.monotonic() + within
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        await asyncio.sleep(0.05)
    return False


def test_a_tools_endless_output_is_cut_at_its_bound_and_the_tool_killed(tmp_path: Path) -> None:
    """stdout past ``max_bytes`` (a screenshot's: the screen's PNG bound) or stderr past
    ``TOOL_OUTPUT_MAX``: GuestError naming the stream and the bound, at once, with the
    host's memory bounded by it; the guest's command is killed and its call ended, and
    output within the bound comes back whole."""
    from hangar.core.desktop import TOOL_OUTPUT_MAX, Desktop, Screen, shot_max_bytes
    from hangar.engines.agent_client import AgentClient, exec_meta, unix_channel
    from hangar.errors import GuestError

    bound = shot_max_bytes(Screen(1024, 768, 24))
    pidfile = tmp_path / "pid"

    def endless(redirect: str = "") -> dict[str, Any]:
        return exec_meta(argv=["/bin/sh", "-c", f"echo $$ > {pidfile}; exec cat /dev/zero"
                               + redirect], timeout=60)

    async def go() -> None:
        async with agent_socket() as path:
            client = await AgentClient.handshake(unix_channel(path), 10)
            d = Desktop(_Calls(client))  # type: ignore[arg-type]
            for meta, limit, stream, cap in ((endless(), bound, "stdout", bound),
                                             (endless(" >&2"), bound, "stderr",
                                              TOOL_OUTPUT_MAX),
                                             (endless(), None, "stdout", TOOL_OUTPUT_MAX)):
                pidfile.unlink(missing_ok=True)
                tracemalloc.start()
                t = time.monotonic()
                with pytest.raises(GuestError, match=f"more than {cap} bytes on {stream}"):
                    if limit is None:
                        await d._exec("sb-x", meta, None)
                    else:
                        await d._exec("sb-x", meta, None, limit)
                took = time.monotonic() - t
                peak = tracemalloc.get_traced_memory()[1]
                tracemalloc.stop()
                assert took < 10, took  # 60 s of the tool's timeout before, 6-10 GiB kept
                assert peak < cap + (8 << 20), peak  # the bound, a window and the frames
                assert await _gone(int(pidfile.read_text())), "the guest's command still runs"
                assert await requests_settle(client) == 1  # the call ended in the guest
            exact = exec_meta(argv=["head", "-c", str(TOOL_OUTPUT_MAX), "/dev/zero"])
            out, err, r = await d._exec("sb-x", exact, None)
            assert (len(out), err, r.exit_code) == (TOOL_OUTPUT_MAX, "", 0)
            await client.close()

    asyncio.run(go())


def test_the_screenshot_bound_holds_an_incompressible_png() -> None:
    """``shot_max_bytes`` is over any PNG of the screen: 8-bit RGBA noise stored without
    compression (the largest a PNG of it can be) fits, within a few per cent."""
    from PIL import Image

    from hangar.core.desktop import PNG_SLACK, Screen, shot_max_bytes

    w, h = 640, 480
    buf = io.BytesIO()
    Image.frombytes("RGBA", (w, h), os.urandom(w * h * 4)).save(buf, "PNG", compress_level=0)
    bound = shot_max_bytes(Screen(w, h, 24))
    assert h * (1 + 4 * w) < len(buf.getvalue()) < bound - PNG_SLACK
    assert shot_max_bytes(Screen(4096, 4096, 24)) < 80 << 20


def test_desktops_larger_than_a_screenshot_decodes_are_refused() -> None:
    """The create schema (422) and the core's create check (400, for callers without the
    schema) refuse a desktop of more than ``DESKTOP_MAX_PIXELS``; 4096x4096 and 8192x2048
    are taken. A screen made before the bound is refused a screenshot (409) before scrot
    runs."""
    from pydantic import ValidationError

    from hangar.core.admission import check_desktop
    from hangar.core.desktop import Desktop
    from hangar.errors import Conflict, InvalidRequest
    from hangar.schemas import CreateSandbox
    from hangar.schemas.bounds import DESKTOP_MAX_PIXELS

    assert DESKTOP_MAX_PIXELS == 4096 * 4096
    for ok in ("4096x4096x24", "8192x2048x16", "3840x2160x24"):
        assert CreateSandbox(desktop=ok).desktop == ok
    for bad in ("4097x4096x24", "8192x8192x24", "99999x99999x24"):
        with pytest.raises(ValidationError, match="a desktop may have"):
            CreateSandbox(desktop=bad)
        with pytest.raises(InvalidRequest):
            check_desktop(bad, None)  # type: ignore[arg-type]  (refused before the image)

    class NoExec(_Calls):
        async def exec_stream(self, *a: Any, **kw: Any) -> Any:
            raise AssertionError("scrot ran")
            yield

    with pytest.raises(Conflict, match="more than the 16777216 pixels"):
        asyncio.run(Desktop(NoExec(None, "8192x8192x24")).screenshot("sb-x"))  # type: ignore


def test_screenshots_scale_in_their_own_two_threads() -> None:
    """Six scaled screenshots at once (of six sandboxes) run two at a time in ``SCALER``'s
    threads, and asyncio's default pool answers meanwhile (review 29k K-M1: six 4096x4096
    scales held all six of its workers for seconds); six of one sandbox are taken two at a
    time (review 29l M1: sixteen held 1 GiB of a large desktop's PNGs)."""
    from PIL import Image

    import hangar.core.desktop as desktop
    from hangar.engines.agent_client.results import ExecEvent, ExecResult

    buf = io.BytesIO()
    Image.new("RGB", (1024, 768), (1, 2, 3)).save(buf, format="PNG")
    png = buf.getvalue()
    running: list[int] = []
    names: set[str] = set()
    lock = threading.Lock()

    def slow_scale(data: bytes, width: int) -> tuple[bytes, int, int]:
        with lock:
            running.append(running[-1] + 1 if running else 1)
            names.add(threading.current_thread().name)
        time.sleep(0.4)  # a 4096x4096 shot's decode, shortened
        try:
            return real(data, width)
        finally:
            with lock:
                running.append(running[-1] - 1)

    taking: list[int] = [0]

    class Shots(_Calls):
        async def exec_stream(self, sandbox_id: str, *a: Any, **kw: Any) -> Any:
            taking.append(taking[-1] + 1)
            await asyncio.sleep(0.1)
            yield ExecEvent("stdout", png)
            taking.append(taking[-1] - 1)
            yield ExecEvent("exit", result=ExecResult(0, None, False, 0.0))

    async def go() -> float:
        client = SimpleNamespace(hello={"boot_id": "b"})
        d = desktop.Desktop(Shots(client))  # type: ignore[arg-type]
        for i in range(6):
            d._ready[f"sb-{i}"] = ("b", 0.0)
        # one sandbox's six at once are taken two at a time (SHOTS_AT_ONCE: review 29l M1)
        await asyncio.gather(*(d.screenshot("sb-0") for _ in range(6)))
        assert max(taking) == desktop.SHOTS_AT_ONCE == 2
        shots = [asyncio.create_task(d.screenshot(f"sb-{i}", 512)) for i in range(6)]
        await asyncio.sleep(0.2)
        t = time.monotonic()
        assert await asyncio.to_thread(lambda: 42) == 42
        free_in = time.monotonic() - t
        assert {s.width for s in await asyncio.gather(*shots)} == {512}
        return free_in

    real = desktop.scale_png
    desktop.scale_png = slow_scale  # type: ignore[assignment]
    try:
        free_in = asyncio.run(go())
    finally:
        desktop.scale_png = real  # type: ignore[assignment]
    assert max(running) == desktop.SCALE_WORKERS == 2
    assert names and all(n.startswith("hangar-screenshot") for n in names)
    assert free_in < 0.3, free_in


def test_a_display_answer_that_is_no_position_is_a_guest_error() -> None:
    """xdotool's answer is the guest's to write: bytes that are not UTF-8, or a number of
    60,000 digits (past int's 4,300), are a GuestError (502), not a 500."""
    from hangar.core.desktop import Desktop
    from hangar.engines.agent_client.results import ExecEvent, ExecResult
    from hangar.errors import GuestError

    class Says(_Calls):
        async def exec_stream(self, *a: Any, **kw: Any) -> Any:
            yield ExecEvent("stdout", self.desktop_says)
            yield ExecEvent("exit", result=ExecResult(0, None, False, 0.0))

    for said in (b"X=\xff\xfe\nY=1\n", b"X=" + b"9" * 60_000 + b"\nY=1\n", b"X=five\n"):
        calls = Says(SimpleNamespace(hello={"boot_id": "b"}))
        calls.desktop_says = said  # type: ignore[attr-defined]
        d = Desktop(calls)  # type: ignore[arg-type]
        d._ready["sb-x"] = ("b", 0.0)
        with pytest.raises(GuestError, match="getmouselocation printed"):
            asyncio.run(d.display("sb-x"))


@vm
def test_a_guest_tool_writing_without_end_gets_a_clear_502(server: Server, api: httpx.Client,
                                                           desk: str) -> None:  # noqa: F811
    """The guest's scrot and xdotool replaced by ``head -c 200M /dev/zero``: a screenshot,
    the display and a click each answer 502 naming the bound within seconds, the server's
    peak memory grows by little more than the screen's PNG bound (4.1 MiB; 200-400 MiB
    before), and the real tools back, the desktop answers again."""
    from hangar.core.desktop import TOOL_OUTPUT_MAX, Screen, shot_max_bytes

    assert server.proc is not None
    status = Path(f"/proc/{server.proc.pid}/status")

    def peak_kib() -> int:
        return next(int(line.split()[1]) for line in status.read_text().splitlines()
                    if line.startswith("VmHWM:"))

    fake = "#!/bin/sh\nexec head -c 200M /dev/zero\n"
    assert sh(api, desk, "for t in scrot xdotool; do cp /usr/bin/$t /root/$t.real; done; "
                         f"printf '{fake}' > /root/fake && chmod +x /root/fake && "
                         "cp /root/fake /usr/bin/scrot && cp /root/fake /usr/bin/xdotool"
              )["exit_code"] == 0
    try:
        Path(f"/proc/{server.proc.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
        before = peak_kib()
        calls = (("post", "screenshot", None, shot_max_bytes(Screen(1024, 768, 24))),
                 ("get", "display", None, TOOL_OUTPUT_MAX),
                 ("post", "click", {"x": 5, "y": 5}, TOOL_OUTPUT_MAX))
        for method, path, body, cap in calls:
            t = time.monotonic()
            r = api.request(method.upper(), f"/sandboxes/{desk}/{path}", json=body)
            took = time.monotonic() - t
            assert r.status_code == 502, (path, r.status_code, r.text[:300])
            message = r.json()["error"]["message"]
            assert f"more than {cap} bytes on stdout" in message, message
            assert took < 30, (path, took)
        grew = peak_kib() - before
        assert grew < 24 << 10, f"the server's peak memory grew {grew} KiB"
    finally:
        assert sh(api, desk, "for t in scrot xdotool; do mv /root/$t.real /usr/bin/$t; done"
                  )["exit_code"] == 0
    assert png_size(shot(api, desk)) == (1024, 768)
    assert api.get(f"/sandboxes/{desk}/display").status_code == 200


def test_a_large_screenshot_answer_is_streamed_with_the_loop_free() -> None:
    """A 4096 x 4096 desktop's screenshot may be a PNG of up to ``shot_max_bytes`` (66 MiB
    of noise): its JSON answer is base64-encoded a piece at a time with a turn of the
    loop between (review 29k: about 1 s at once), and says exactly what the model says."""
    import json

    from hangar.api.desktop import INLINE_PNG_BYTES, _json_pieces
    from hangar.core.desktop import Screen, shot_max_bytes
    from hangar.schemas import ScreenshotResponse
    from loop_stalls import measured

    png = os.urandom(shot_max_bytes(Screen(4096, 4096, 24)) - (1 << 20))
    assert len(png) > INLINE_PNG_BYTES
    shot = SimpleNamespace(png=png, width=4096, height=4096, screen=Screen(4096, 4096, 24),
                           duration_s=1.23456)

    async def collect() -> list[bytes]:
        return [piece async for piece in _json_pieces(shot)]

    pieces, stalls = asyncio.run(measured(collect()))
    stalls.check_cpu(0.08)  # the loop's CPU in one turn, less garbage collections
    body = b"".join(pieces)
    want = ScreenshotResponse(image=__import__("base64").b64encode(png).decode(), width=4096,
                              height=4096, screen_width=4096, screen_height=4096,
                              duration_s=1.2346)
    assert json.loads(body) == want.model_dump()
