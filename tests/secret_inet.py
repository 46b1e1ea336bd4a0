"""The stand-in internet's HTTPS server of tests/test_secrets.py and bench/secret_proxy_bench.py.

``python secret_inet.py CERT KEY TOKEN PORT...``: one HTTPS server per PORT on every
address, with the certificate CERT (a test CA's, for api.example.test and
other.example.test). ``GET /`` answers 200 ``ok`` when the Authorization header is
``Bearer TOKEN`` (or Basic ``x-access-token:TOKEN``, as git sends it), else 401 ``no``; ``GET /plain`` answers 200 ``plain`` to anyone, and
``GET /echo`` 200 with the Authorization header it got (a host that reflects it);
``GET /zeros?n=N`` N zero bytes (then the header it got, once more: a body that echoes
it) to a Bearer TOKEN, and ``POST /sink`` reads its body and answers its length.
Prints ``ready`` once all listen; runs until killed.
"""

from __future__ import annotations

import base64
import ssl
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main() -> None:
    cert, key, token, ports = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:  # noqa: N802
            left, got = int(self.headers.get("Content-Length") or 0), 0
            while left:
                chunk = self.rfile.read(min(left, 1 << 16))
                if not chunk:
                    break
                left -= len(chunk)
                got += len(chunk)
            body = f"{got} {self.headers.get('Authorization') == f'Bearer {token}'}".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802
            if self.path.startswith("/zeros?n="):
                n = int(self.path.split("=", 1)[1])
                echo = (self.headers.get("Authorization") or "").encode()
                self.send_response(200)
                self.send_header("Content-Length", str(n + len(echo)))
                self.end_headers()
                block = bytes(1 << 16)
                while n:
                    self.wfile.write(block[:min(n, len(block))])
                    n -= min(n, len(block))
                self.wfile.write(echo)
                return
            if self.path == "/plain":
                code, body = 200, b"plain"
            elif self.path == "/echo":
                code, body = 200, (self.headers.get("Authorization") or "").encode()
            elif self.headers.get("Authorization") in (
                    f"Bearer {token}",
                    "Basic " + base64.b64encode(f"x-access-token:{token}".encode()).decode()):
                code, body = 200, b"ok"
            else:
                code, body = 401, b"no"
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    for port in ports:
        srv = ThreadingHTTPServer(("0.0.0.0", int(port)), Handler)
        srv.daemon_threads = True
        srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
    print("ready", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
