"""A small web app that tests run inside a guest (standard library only: the base image
has python3 and nothing else).

``python3 guest_webapp.py PORT`` serves, on 0.0.0.0:PORT:

* ``GET /headers``: what the app saw, as JSON (path, query, headers; names as sent);
* ``POST /echo``: the request body's length and SHA-256 (a length or chunked), as JSON;
* ``GET /stream``: a chunked answer: ``first`` at once, then ``last`` only once the file
  /tmp/release-stream exists (so a test can tell streaming from buffering without timing);
* ``GET /redirect``: 302 to the absolute path ``/headers``;
* ``GET /cut``: promises 100 bytes, sends 10 and hangs up;
* ``GET /until-close``: an answer delimited by the connection's close (no length, not
  chunked: what HTTP/1.0 servers stream): ``first`` at once, then nothing until it is ended;
* ``GET /tiny?n=N``: a chunked answer of N chunks of one byte ``x`` each, written 64 KiB at
  a time (a hostile answer: one parser event per 6 bytes);
* ``GET /continues``: 20 ``100 Continue`` answers, then a 200;
* ``GET /ws``: a WebSocket (RFC 6455) that echoes every message with its type, answers a
  text message ``close`` with a close frame of code 4001, and a text message ``flood N [M]``
  with N binary messages of M MiB (default 1), the i-th (from 0) every byte i % 256. With
  ``?frag=N`` its answer is followed, in the same write, by a text message ``done`` in
  N + 2 fragments (N of them empty).
"""

import base64
import hashlib
import json
import os
import socket
import socketserver
import struct
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # quiet
        pass

    def _json(self, obj, status=200):
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        path, _, query = self.path.partition("?")
        if path == "/headers":
            self._json({"path": path, "query": query,
                        "headers": [[k.lower(), v] for k, v in self.headers.items()],
                        "names": list(self.headers.keys())})  # as they came
        elif path == "/stream":
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self._chunk(b"first\n")
            while not os.path.exists("/tmp/release-stream"):
                time.sleep(0.05)
            self._chunk(b"last\n")
            self.wfile.write(b"0\r\n\r\n")
        elif path == "/until-close":
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(b"first\n")
            self.wfile.flush()
            while True:
                time.sleep(1)
        elif path == "/cut":  # promises 100 bytes, sends 10, hangs up
            self.send_response(200)
            self.send_header("Content-Length", "100")
            self.end_headers()
            self.wfile.write(b"0123456789")
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True
        elif path == "/tiny":
            n = int(query.partition("n=")[2] or "0")
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            left = n
            while left:
                k = min(left, 10_000)
                self.wfile.write(b"1\r\nx\r\n" * k)
                left -= k
            self.wfile.write(b"0\r\n\r\n")
        elif path == "/continues":
            self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n" * 20)
            self._json({"after": "continues"})
        elif path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "/headers")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif path == "/ws" and self.headers.get("Upgrade", "").lower() == "websocket":
            self._websocket()
        else:
            self._json({"error": "no such path"}, 404)

    def do_POST(self):
        h = hashlib.sha256()
        n = 0
        for chunk in self._body():
            h.update(chunk)
            n += len(chunk)
        self._json({"length": n, "sha256": h.hexdigest(),
                    "chunked": "chunked" in self.headers.get("Transfer-Encoding", "")})

    def _body(self):
        if "chunked" in self.headers.get("Transfer-Encoding", ""):
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                if size == 0:
                    self.rfile.readline()
                    return
                yield self.rfile.read(size)
                self.rfile.readline()
        left = int(self.headers.get("Content-Length", "0"))
        while left:
            chunk = self.rfile.read(min(left, 1 << 16))
            if not chunk:
                return
            left -= len(chunk)
            yield chunk

    def _chunk(self, data):
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    # -- WebSocket -------------------------------------------------------------------

    def _websocket(self):
        key = self.headers["Sec-WebSocket-Key"]
        accept = base64.b64encode(hashlib.sha1((key + GUID).encode()).digest()).decode()
        self.send_response(101)
        self.send_header("Upgrade", "websocket")
        self.send_header("Connection", "Upgrade")
        self.send_header("Sec-WebSocket-Accept", accept)
        protocols = [p.strip() for p in self.headers.get("Sec-WebSocket-Protocol", "").split(",")]
        if "echo.v1" in protocols:
            self.send_header("Sec-WebSocket-Protocol", "echo.v1")
        self.end_headers()
        frag = int(self.path.partition("frag=")[2] or "0")
        if frag:  # "done" in frag + 2 fragments, in the answer's own write
            self.wfile.write(b"\x01\x00" + b"\x00\x00" * frag + b"\x80\x04done")
        self.wfile.flush()
        message, kind = b"", None
        while True:
            frame = self._read_frame()
            if frame is None:
                return
            fin, opcode, payload = frame
            if opcode == 8:  # close: answer and end
                self._send_frame(8, payload[:2])
                return
            if opcode == 9:
                self._send_frame(10, payload)
                continue
            if opcode in (1, 2):
                kind, message = opcode, payload
            elif opcode == 0:
                message += payload
            if not fin:
                continue
            if kind == 1 and message.startswith(b"flood "):
                words = message.split()
                mib = int(words[2]) if len(words) > 2 else 1
                for i in range(int(words[1])):
                    self._send_frame(2, bytes([i % 256]) * (mib << 20))
                continue
            if kind == 1 and message == b"close":
                self._send_frame(8, struct.pack("!H", 4001) + b"asked to")
                continue
            prefix = b"text:" if kind == 1 else b"binary:"
            self._send_frame(kind, prefix + message)

    def _read_exact(self, n):
        data = b""
        while len(data) < n:
            chunk = self.rfile.read(n - len(data))
            if not chunk:
                return None
            data += chunk
        return data

    def _read_frame(self):
        head = self._read_exact(2)
        if head is None:
            return None
        fin, opcode = head[0] >> 7, head[0] & 0x0F
        masked, n = head[1] >> 7, head[1] & 0x7F
        if n == 126:
            n = struct.unpack("!H", self._read_exact(2))[0]
        elif n == 127:
            n = struct.unpack("!Q", self._read_exact(8))[0]
        mask = self._read_exact(4) if masked else b"\0\0\0\0"
        payload = self._read_exact(n) if n else b""
        if payload is None:
            return None
        if n:  # unmask as one big integer: fast enough under TCG
            key = (mask * (n // 4 + 1))[:n]
            payload = (int.from_bytes(payload, "big") ^ int.from_bytes(key, "big")).to_bytes(
                n, "big")
        return fin, opcode, payload

    def _send_frame(self, opcode, payload):
        n = len(payload)
        if n < 126:
            head = struct.pack("!BB", 0x80 | opcode, n)
        elif n < 1 << 16:
            head = struct.pack("!BBH", 0x80 | opcode, 126, n)
        else:
            head = struct.pack("!BBQ", 0x80 | opcode, 127, n)
        self.wfile.write(head + payload)
        self.wfile.flush()


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


if __name__ == "__main__":
    socketserver.TCPServer.allow_reuse_address = True
    Server(("0.0.0.0", int(sys.argv[1])), Handler).serve_forever()
