"""Benchmark: desktop latency through Hangar's API beside the same work done in the guest.

Prints one JSON object. Boots one ``desktop`` sandbox (1024x768x24) on a
private ``hangar serve`` and measures, each figure twice:

* ``screenshot_s``: ``POST /screenshot?format=png`` (HTTP → API →
  orchestrator → agent exec of scrot → PNG back), against ``scrot`` timed
  inside the guest by a shell loop (``date +%s%N`` around each run);
* ``input_to_pixel_s``: ``POST /type`` of one character into a focused
  xterm, then screenshots through the API until the PNG changes, against
  the same loop run inside the guest (``xdotool type``, then ``scrot`` until
  its output changes);
* ``vnc_key_to_update_s`` (no guest counterpart): a KeyEvent sent by an RFB
  viewer through the WebSocket proxy until the first non-empty
  FramebufferUpdate arrives.

``ratio`` is hangar / guest: above 1 means the API path is slower.

    .venv/bin/python bench/desktop_bench.py [--shots 15] [--inputs 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import struct
import time

import httpx
from benchlib import SHARED, api_key, pct, start_server, stop_server

from hangar.images import build_image
from hangar.layout import Layout
W, H = 1024, 768


def pair(hangar: list[float], guest: list[float]) -> dict[str, float]:
    h, g = pct(hangar, 0.5), pct(guest, 0.5)
    return {"hangar_p50": round(h, 4), "guest_p50": round(g, 4), "ratio": round(h / g, 3),
            "hangar_p95": round(pct(hangar, 0.95), 4), "guest_p95": round(pct(guest, 0.95), 4)}


def guest(c: httpx.Client, sid: str, script: str, timeout: float = 600) -> str:
    r = c.post(f"/sandboxes/{sid}/exec", json={"command": script, "timeout": timeout,
                                              "env": {"DISPLAY": ":0"}}).raise_for_status()
    body = r.json()
    if body["exit_code"] != 0:
        raise RuntimeError(f"guest script failed: {body['stderr']}")
    return body["stdout"]


def shot(c: httpx.Client, sid: str) -> bytes:
    return c.post(f"/sandboxes/{sid}/screenshot",
                  params={"format": "png"}).raise_for_status().content


def open_terminal(c: httpx.Client, sid: str) -> None:
    guest(c, sid, "setsid xterm -T bench -geometry 80x24+0+0 -e cat >/dev/null 2>&1 </dev/null &")
    for _ in range(120):
        out = c.post(f"/sandboxes/{sid}/exec", json={
            "command": "xdotool search --name '^bench$' windowactivate --sync",
            "env": {"DISPLAY": ":0"}}).json()
        if out["exit_code"] == 0:
            time.sleep(2)
            return
        time.sleep(1)
    raise RuntimeError("the benchmark's terminal did not appear")


async def vnc_latency(url: str, ticket_path: str, n: int) -> list[float]:
    import websockets

    async with websockets.connect(url.replace("http://", "ws://") + ticket_path,
                                  subprotocols=["binary"], max_size=None) as ws:
        buf = bytearray()

        async def read(k: int) -> bytes:
            while len(buf) < k:
                buf.extend(await ws.recv())
            out = bytes(buf[:k])
            del buf[:k]
            return out

        await read(12)
        await ws.send(b"RFB 003.008\n")
        await read((await read(1))[0])
        await ws.send(b"\x01")
        await read(4)
        await ws.send(b"\x01")
        init = await read(24)
        await read(struct.unpack(">I", init[20:24])[0])
        await ws.send(struct.pack(">BxHi", 2, 1, 16))  # ZRLE
        await ws.send(struct.pack(">BBHHHH", 3, 0, 0, 0, W, H))
        await asyncio.sleep(3)
        out = []
        for i in range(n):
            while True:  # drain what came before
                try:
                    buf.extend(await asyncio.wait_for(ws.recv(), 0.5))
                except TimeoutError:
                    break
            buf.clear()
            await ws.send(struct.pack(">BBHHHH", 3, 1, 0, 0, W, H))
            t = time.perf_counter()
            for down in (1, 0):
                await ws.send(struct.pack(">BBxxI", 4, down, ord("a") + i % 26))
            data = await asyncio.wait_for(ws.recv(), 60)  # first bytes of the update
            out.append(time.perf_counter() - t)
            assert data[0] == 0, "expected a FramebufferUpdate"
        return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shots", type=int, default=15, help="screenshots per side")
    ap.add_argument("--inputs", type=int, default=8, help="input-to-pixel trials per side")
    a = ap.parse_args()
    layout = Layout(SHARED)
    layout.ensure()
    build_image(layout, "desktop")
    proc, d, url = start_server()
    try:
        key = api_key(d)
        with httpx.Client(base_url=url, headers={"X-API-Key": key}, timeout=600) as c:
            t = time.perf_counter()
            sb = c.post("/sandboxes", json={"image": "desktop", "desktop": f"{W}x{H}x24",
                                            "memory_mib": 1024}).raise_for_status().json()
            sid = sb["id"]
            c.get(f"/sandboxes/{sid}/display").raise_for_status()
            ready_s = time.perf_counter() - t
            try:
                open_terminal(c, sid)
                shot(c, sid)  # warm up
                api_shots = []
                for _ in range(a.shots):
                    t = time.perf_counter()
                    png = shot(c, sid)
                    api_shots.append(time.perf_counter() - t)
                guest_shots = [int(x) / 1e9 for x in guest(c, sid, (
                    f"for i in $(seq {a.shots}); do s=$(date +%s%N); scrot -o - >/dev/null; "
                    f"e=$(date +%s%N); echo $((e - s)); done")).split()]

                api_input = []
                for i in range(a.inputs):
                    base = shot(c, sid)
                    t = time.perf_counter()
                    c.post(f"/sandboxes/{sid}/type",
                           json={"text": chr(ord("a") + i)}).raise_for_status()
                    while shot(c, sid) == base:
                        pass
                    api_input.append(time.perf_counter() - t)
                guest_input = [int(x) / 1e9 for x in guest(c, sid, (
                    f"for i in $(seq {a.inputs}); do b=$(scrot -o - | md5sum); "
                    f"s=$(date +%s%N); xdotool type q; "
                    f"while [ \"$(scrot -o - | md5sum)\" = \"$b\" ]; do :; done; "
                    f"e=$(date +%s%N); echo $((e - s)); done")).split()]

                tickets = [c.post(f"/sandboxes/{sid}/vnc/tickets", json={})
                           .raise_for_status().json()["url"]]
                vnc = asyncio.run(vnc_latency(url, tickets[0], a.inputs))
            finally:
                c.delete(f"/sandboxes/{sid}")
        out = {
            "accel": sb["accel"],
            "screen": f"{W}x{H}x24",
            "screenshot_png_bytes": len(png),
            "create_to_desktop_ready_s": round(ready_s, 2),
            "screenshot_s": pair(api_shots, guest_shots),
            "input_to_pixel_s": pair(api_input, guest_input),
            "vnc_key_to_update_s": {"p50": round(pct(vnc, 0.5), 4),
                                    "p95": round(pct(vnc, 0.95), 4)},
            "runs": {"shots": a.shots, "inputs": a.inputs},
            "note": "ratio = hangar / guest; guest figures are timed inside the VM",
        }
        print(json.dumps(out, indent=2))
    finally:
        stop_server(proc, d)


if __name__ == "__main__":
    main()
