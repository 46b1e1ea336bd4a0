"""Benchmark: exposed ports through Hangar's proxy beside the same requests made in the guest.

Prints one JSON object. Boots one ``base`` sandbox on a private ``hangar
serve``, starts ``python3 -m http.server`` (a 16 MiB file) and the tests'
``guest_webapp.py`` (JSON and a WebSocket echo) in it, exposes both, and
measures, each figure twice:

* ``get_s``: a small GET (``/headers``) through the path-routed URL, against
  the same GET made inside the guest to 127.0.0.1 (Python's urllib, timed by
  the guest);
* ``download_mib_s``: the 16 MiB file, through the proxy against inside the
  guest (throughput: ``ratio`` is guest / hangar);
* ``ws_echo_s`` (no guest counterpart): one WebSocket message through the
  proxy and its echo back.

``ratio`` above 1 means the path through Hangar is slower. The guest side
runs under the same accelerator (TCG here), so it is the floor the proxy
adds to. Bulk bytes are bound by the agent channel itself: under TCG a
16 MiB download through the proxy (about 10 MiB/s) is as fast as reading
the same file with ``GET /sandboxes/{id}/files``.

    .venv/bin/python bench/ports_bench.py [--gets 40] [--downloads 3] [--echoes 40]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import httpx
from benchlib import api_key, pct, start_server, stop_server
from websockets.sync.client import connect as ws_connect

APP = Path(__file__).resolve().parents[1] / "tests" / "guest_webapp.py"
IN_GUEST = r"""
import json, sys, time, urllib.request
gets, downloads = int(sys.argv[1]), int(sys.argv[2])
t_get, t_dl = [], []
for _ in range(gets):
    t = time.perf_counter()
    urllib.request.urlopen("http://127.0.0.1:3001/headers").read()
    t_get.append(time.perf_counter() - t)
for _ in range(downloads):
    t = time.perf_counter()
    n = len(urllib.request.urlopen("http://127.0.0.1:3000/blob").read())
    t_dl.append(n / 2**20 / (time.perf_counter() - t))
print(json.dumps({"get": t_get, "download": t_dl}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gets", type=int, default=40)
    ap.add_argument("--downloads", type=int, default=3)
    ap.add_argument("--echoes", type=int, default=40)
    args = ap.parse_args()
    proc, data_dir, url = start_server()
    key = api_key(data_dir)
    c = httpx.Client(base_url=url, headers={"X-API-Key": key}, timeout=600)
    try:
        sid = c.post("/sandboxes", json={}).raise_for_status().json()["id"]

        def sh(command: str, timeout: float = 300) -> str:
            r = c.post(f"/sandboxes/{sid}/exec", json={"command": command, "timeout": timeout})
            return str(r.raise_for_status().json()["stdout"])

        c.put(f"/sandboxes/{sid}/files", params={"path": "/root/app.py"},
              content=APP.read_bytes()).raise_for_status()
        c.put(f"/sandboxes/{sid}/files", params={"path": "/root/in_guest.py"},
              content=IN_GUEST.encode()).raise_for_status()
        sh("mkdir -p /srv && head -c 16777216 /dev/urandom > /srv/blob")
        sh("cd /srv && setsid python3 -m http.server 3000 >/dev/null 2>&1 </dev/null &")
        sh("setsid python3 /root/app.py 3001 >/dev/null 2>&1 </dev/null &")
        for port in (3000, 3001):
            c.post(f"/sandboxes/{sid}/ports", json={"port": port}).raise_for_status()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            ok = [c.get(f"/sandboxes/{sid}/ports/{p}/").status_code < 500 for p in (3000, 3001)]
            if all(ok):
                break
            time.sleep(0.5)

        gets = []
        for _ in range(args.gets):
            t = time.perf_counter()
            c.get(f"/sandboxes/{sid}/ports/3001/headers").raise_for_status()
            gets.append(time.perf_counter() - t)
        downloads = []
        for _ in range(args.downloads):
            t = time.perf_counter()
            n = len(c.get(f"/sandboxes/{sid}/ports/3000/blob").raise_for_status().content)
            downloads.append(n / 2**20 / (time.perf_counter() - t))
        echoes = []
        ws_url = url.replace("http://", "ws://") + f"/sandboxes/{sid}/ports/3001/ws"
        with ws_connect(ws_url, additional_headers={"X-API-Key": key}) as ws:
            for i in range(args.echoes):
                t = time.perf_counter()
                ws.send(f"m{i}")
                ws.recv()
                echoes.append(time.perf_counter() - t)
        guest = json.loads(sh(f"python3 /root/in_guest.py {args.gets} {args.downloads}",
                              timeout=900))

        def latency(h: list[float], g: list[float]) -> dict[str, float]:
            hp, gp = pct(h, 0.5), pct(g, 0.5)
            return {"hangar_p50": round(hp, 4), "hangar_p95": round(pct(h, 0.95), 4),
                    "guest_p50": round(gp, 4), "ratio": round(hp / gp, 3)}

        hd, gd = pct(downloads, 0.5), pct(guest["download"], 0.5)
        print(json.dumps({
            "get_s": latency(gets, guest["get"]),
            "download_mib_s": {"hangar_p50": round(hd, 2), "guest_p50": round(gd, 2),
                               "ratio": round(gd / hd, 3)},
            "ws_echo_s": {"hangar_p50": round(pct(echoes, 0.5), 4),
                          "hangar_p95": round(pct(echoes, 0.95), 4)},
        }, indent=2))
        c.delete(f"/sandboxes/{sid}")
    finally:
        c.close()
        stop_server(proc, data_dir)


if __name__ == "__main__":
    main()
