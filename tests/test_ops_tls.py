"""Hangar behind Debian's nginx with TLS, the site rendered by ``hangar deploy nginx``.

A test CA signs a certificate for localhost; nginx (foreground, private
prefix, free ports) proxies to the session's real Hangar server. Through it
the SDK verifies the certificate against the test CA, creates a sandbox,
runs commands and streams one; the web page in Debian's Chromium shows a
live desktop over the proxied WebSocket.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import ssl
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import SHARED, Server, free_port
from ops_support import Nginx, TestCA, hangar_cli

vm = pytest.mark.vm
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]

pytestmark = pytest.mark.skipif(shutil.which("nginx") is None or shutil.which("openssl") is None,
                                reason="needs Debian's nginx and openssl")


class Proxy:
    def __init__(self, https_port: int, http_port: int, ca: TestCA, site: Path,
                 acme_root: Path) -> None:
        self.https = f"https://localhost:{https_port}"
        self.http = f"http://localhost:{http_port}"
        self.ca = ca
        self.site = site
        self.acme_root = acme_root
        self.tls = ssl.create_default_context(cafile=str(ca.ca))


@pytest.fixture(scope="module")
def proxy(server: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    base = tmp_path_factory.mktemp("tls")
    ca = TestCA(base / "pki")
    https_port, http_port = free_port(), free_port()
    acme = base / "acme"
    (acme / ".well-known/acme-challenge").mkdir(parents=True)
    site = base / "hangar-site.conf"
    hangar_cli("deploy", "nginx", "--domain", "localhost", "--output", str(site),
               "--upstream", f"127.0.0.1:{server.port}", "--cert", str(ca.cert),
               "--key", str(ca.key), "--acme-root", str(acme), "--https-port", str(https_port),
               "--http-port", str(http_port), "--max-json-bytes", str(8 << 20))
    nginx = Nginx(base / "nginx", site)
    t = nginx.test_config()
    assert t.returncode == 0, t.stderr
    nginx.start(https_port)
    try:
        yield Proxy(https_port, http_port, ca, site, acme)
    finally:
        nginx.stop()


@pytest.fixture
def trust_test_ca(proxy: Proxy, monkeypatch: pytest.MonkeyPatch) -> None:
    """httpx (hence the SDK) verifies against the test CA (SSL_CERT_FILE)."""
    monkeypatch.setenv("SSL_CERT_FILE", str(proxy.ca.ca))


def field(event: Any, name: str) -> Any:
    """An event's field, whether the SDK gives dicts or objects."""
    return event[name] if isinstance(event, dict) else getattr(event, name)


@pytest.fixture(scope="module")
def tls_sandbox(proxy: Proxy, server: Server) -> Iterator[str]:
    """A sandbox created through the proxy by the SDK, deleted at the end of the module."""
    from hangar.client import Hangar

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SSL_CERT_FILE", str(proxy.ca.ca))
        with Hangar(base_url=proxy.https, api_key=server.key) as h:
            sid = field(h.create(), "id")
    yield sid
    with server.client() as c:
        c.delete(f"/sandboxes/{sid}")


# -- the site file and plain HTTP ------------------------------------------------------------


def test_site_is_rendered_for_the_domain(proxy: Proxy) -> None:
    text = proxy.site.read_text()
    assert "server_name localhost;" in text and f"ssl_certificate {proxy.ca.cert};" in text
    assert "{{" not in text
    bad = hangar_cli("deploy", "nginx", "--domain", "evil;host", "--output", "-", check=False)
    assert bad.returncode == 1 and "not a host name" in bad.stderr
    bad = hangar_cli("deploy", "nginx", "--domain", "a.example", "--cert", "/x y; z",
                     "--output", "-", check=False)
    assert bad.returncode == 1 and "certificate" in bad.stderr
    bad = hangar_cli("deploy", "nginx", "--domain", "a.example", "--output",
                     "/proc/no-such-dir/site", check=False)
    assert bad.returncode == 1 and "cannot write" in bad.stderr and "Traceback" not in bad.stderr


def test_http_redirects_to_https_but_serves_acme_challenges(proxy: Proxy) -> None:
    r = httpx.get(proxy.http + "/sandboxes?x=1")
    assert r.status_code == 301
    assert r.headers["location"] == proxy.https + "/sandboxes?x=1"
    (proxy.acme_root / ".well-known/acme-challenge/token-1").write_text("proof")
    r = httpx.get(proxy.http + "/.well-known/acme-challenge/token-1")
    assert r.status_code == 200 and r.text == "proof"


def test_certificate_is_verified(proxy: Proxy, server: Server,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from hangar.client import Hangar
    from hangar.errors import Unavailable

    # Without the test CA the SDK refuses the self-signed chain...
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    with Hangar(base_url=proxy.https, api_key=server.key) as h, pytest.raises(Unavailable):
        h.health()
    # ...and with it, /health answers through the proxy, over TLS.
    r = httpx.get(proxy.https + "/health", verify=proxy.tls)
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert r.headers["strict-transport-security"].startswith("max-age=")


def test_forwarded_headers_are_trusted_from_the_proxy_only(proxy: Proxy, server: Server) -> None:
    # Through nginx (127.0.0.1, trusted): Hangar sees https and builds https URLs.
    r = httpx.get(proxy.https + "/ui", verify=proxy.tls)
    assert r.status_code == 307, r.text  # Starlette's redirect to the mount's slash
    assert r.headers["location"] == proxy.https + "/ui/"
    # From another address, the same header is ignored.
    transport = httpx.HTTPTransport(local_address="127.0.0.2")
    with httpx.Client(transport=transport) as c:
        r = c.get(server.url + "/ui", headers={"X-Forwarded-Proto": "https",
                                               "X-Forwarded-For": "203.0.113.9"})
    assert r.status_code == 307
    assert r.headers["location"].startswith("http://127.0.0.1:")


# -- the API through the proxy ---------------------------------------------------------------


@vm
def test_sdk_creates_and_execs_over_tls(proxy: Proxy, server: Server, tls_sandbox: str,
                                        trust_test_ca: None) -> None:
    from hangar.client import Hangar

    with Hangar(base_url=proxy.https, api_key=server.key) as h:
        r = h.exec(tls_sandbox, "echo hello from $(hostname); exit 3")
        assert field(r, "exit_code") == 3
        assert field(r, "stdout") == f"hello from {tls_sandbox}\n"
        assert tls_sandbox in [field(s, "id") for s in h.list()]


@vm
def test_exec_stream_is_not_buffered(proxy: Proxy, server: Server, tls_sandbox: str,
                                     trust_test_ca: None) -> None:
    """The first line arrives while the command still waits for the test's go."""
    from hangar.client import Hangar

    script = ("echo first; i=0; while [ ! -e /tmp/go ] && [ $i -lt 300 ]; do sleep 0.1; "
              "i=$((i+1)); done; [ -e /tmp/go ] && echo second-after-go || echo second-gave-up")
    with Hangar(base_url=proxy.https, api_key=server.key) as h:
        events = h.exec_stream(tls_sandbox, script, timeout=60)
        out = ""
        t0 = time.monotonic()
        for ev in events:
            if field(ev, "type") == "stdout":
                out += field(ev, "data")
                if "first" in out:
                    break
        first_after = time.monotonic() - t0
        assert "second" not in out, "the first line came only with the last: buffered"
        with server.client() as c:  # the go, straight to Hangar
            assert c.post(f"/sandboxes/{tls_sandbox}/exec",
                          json={"command": "touch /tmp/go"}).json()["exit_code"] == 0
        for ev in events:
            if field(ev, "type") == "stdout":
                out += field(ev, "data")
            elif field(ev, "type") == "exit":
                assert field(ev, "exit_code") == 0
        assert out == "first\nsecond-after-go\n", out
        assert first_after < 25, first_after


@vm
def test_file_upload_past_the_json_cap(proxy: Proxy, server: Server, tls_sandbox: str,
                                       trust_test_ca: None) -> None:
    from hangar.client import Hangar

    data = os.urandom(9 << 20)  # over the 8 MiB JSON cap and nginx's default 1 MiB
    with Hangar(base_url=proxy.https, api_key=server.key) as h:
        assert field(h.write_file(tls_sandbox, "/root/big.bin", data), "size") == len(data)
        back = h.read_file(tls_sandbox, "/root/big.bin")
    assert hashlib.sha256(back).digest() == hashlib.sha256(data).digest()
    # A JSON body over the cap is refused at the proxy, in Hangar's error shape.
    r = httpx.post(f"{proxy.https}/sandboxes/{tls_sandbox}/exec", verify=proxy.tls,
                   headers={"X-API-Key": server.key, "content-type": "application/json"},
                   content=b'{"command": "' + b"x" * (9 << 20) + b'"}')
    assert r.status_code == 413
    err = r.json()["error"]
    assert err["code"] == "too_large" and err["limit_bytes"] == 8 << 20


@vm
def test_one_client_address_holds_at_most_its_share_of_connections(proxy: Proxy) -> None:
    """Hangar does not count the connections of its trusted proxy (every client of the site
    comes from 127.0.0.1), so the site caps each client address itself (``limit_conn``, the
    figure Hangar applies to a client it sees directly; review 29e M1): one more request in
    flight than that is 503 from nginx, and the share is whole again once they end. Each
    request stays in flight at nginx, which reads its body before it calls Hangar."""
    import socket

    from hangar.api.http_limits import PER_CLIENT_MAX
    from hangar.ops.nginx import PER_CLIENT_MAX as SITE_PER_CLIENT

    assert SITE_PER_CLIENT == PER_CLIENT_MAX
    port = int(proxy.https.rsplit(":", 1)[1])
    head = (b"POST /sandboxes HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json"
            b"\r\nContent-Length: 100\r\n\r\n")  # a body that does not come

    def opened() -> ssl.SSLSocket:
        sock = proxy.tls.wrap_socket(socket.create_connection(("127.0.0.1", port), 30),
                                     server_hostname="localhost")
        sock.sendall(head)
        return sock

    held: list[ssl.SSLSocket] = []
    try:
        for _ in range(PER_CLIENT_MAX):
            held.append(opened())
        time.sleep(1)  # nginx has read every head (it answers none of them yet)
        extra = opened()
        held.append(extra)
        extra.settimeout(30)
        assert extra.recv(64).startswith(b"HTTP/1.1 503 "), "the share is not capped"
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 30
    while True:  # nginx ends the requests of the closed connections as it notices them
        r = httpx.get(proxy.https + "/health", verify=proxy.tls, timeout=30)
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert r.status_code == 200, r.text


def test_events_stream_through_the_proxy(proxy: Proxy, server: Server) -> None:
    seen: list[str] = []
    ready = threading.Event()
    done = threading.Event()

    def listen() -> None:
        with httpx.stream("GET", proxy.https + "/events", verify=proxy.tls,
                          headers={"X-API-Key": server.key, "Accept": "text/event-stream"},
                          timeout=httpx.Timeout(10, read=120)) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            ready.set()
            for line in r.iter_lines():
                if line.startswith("data:"):
                    seen.append(line)
                    done.set()
                    return

    t = threading.Thread(target=listen, daemon=True)
    t.start()
    assert ready.wait(30), "no answer from /events"
    with server.client() as c:
        r = c.post("/sandboxes", json={})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        try:
            assert done.wait(60), "no event arrived through the proxy after a create"
        finally:
            c.delete(f"/sandboxes/{sid}")
    assert seen


# -- the web page ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def desk(server: Server, base_image: Path) -> Iterator[str]:
    from hangar.images import build_image
    from hangar.layout import Layout

    build_image(Layout(SHARED), "desktop", progress=lambda m: print(f"image: {m}",
                                                                    file=sys.stderr))
    with server.client() as c:
        r = c.post("/sandboxes", json={"image": "desktop", "desktop": "1024x768x24",
                                       "memory_mib": 1024})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        try:
            assert c.get(f"/sandboxes/{sid}/display").status_code == 200
            yield sid
        finally:
            c.delete(f"/sandboxes/{sid}")


@vm
def test_web_page_shows_live_desktop_through_the_proxy(proxy: Proxy, server: Server,
                                                       desk: str) -> None:
    pytest.importorskip("playwright")
    if not Path(CHROMIUM).exists() or not Path("/usr/share/novnc/core/rfb.js").exists():
        pytest.skip("needs Debian's chromium and novnc packages")
    from playwright.sync_api import sync_playwright

    with server.client() as c:  # a window to type into
        c.post(f"/sandboxes/{desk}/exec", json={
            "command": "setsid xterm -T tlsview -geometry 80x20+10+10 -e cat >/dev/null 2>&1 "
                       "</dev/null &", "env": {"DISPLAY": ":0"}})
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_context(ignore_https_errors=True).new_page()
            sockets: list[str] = []
            page.on("websocket", lambda ws: sockets.append(ws.url))
            page.goto(proxy.https + "/")
            assert page.url == proxy.https + "/ui/"
            page.fill("#api-key", server.key)
            page.click("#key-form button[type=submit]")
            page.click(f'tr[data-id="{desk}"] button[data-action="view"]', timeout=30_000)
            page.wait_for_selector('#viewer-status[data-state="connected"]', timeout=90_000)
            canvas = "() => document.querySelector('#screen canvas').toDataURL('image/png')"
            time.sleep(3)
            before = page.evaluate(canvas)
            with server.client() as c:
                r = c.post(f"/sandboxes/{desk}/type", json={"text": "through nginx\n"})
                assert r.status_code == 200, r.text
            deadline = time.monotonic() + 60
            while page.evaluate(canvas) == before:
                assert time.monotonic() < deadline, "the page's canvas did not change"
                time.sleep(1)
            assert sockets and all(u.startswith(f"wss://localhost:{proxy.https.rsplit(':', 1)[1]}"
                                                f"/sandboxes/{desk}/vnc?ticket=")
                                   for u in sockets), sockets
        finally:
            browser.close()
