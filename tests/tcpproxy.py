"""A TCP proxy on 127.0.0.1 for tests of what the network does to the SDK.

``TcpProxy(target_port)`` forwards every connection to the target.
``drop_next_answer()`` makes it close the client's connection as soon as
the server starts answering the next request: the server has acted, the
client never hears of it (a lost response). ``cut()`` closes every open
connection at once (a network blip). Threads only; ``close()`` ends all.
"""

from __future__ import annotations

import socket
import threading


class TcpProxy:
    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._drop = threading.Event()
        self.dropped = 0
        self.connections = 0
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def drop_next_answer(self) -> None:
        self._drop.set()

    def cut(self) -> None:
        """Close every open connection (both sides)."""
        with self._lock:
            socks = list(self._open)
            self._open.clear()
        for s in socks:
            _close(s)

    def close(self) -> None:
        self._closed = True
        _close(self._listener)
        self.cut()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                _close(client)
                continue
            with self._lock:
                self.connections += 1
                self._open.update((client, upstream))
            threading.Thread(target=self._pump, args=(client, upstream, False),
                             daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True),
                             daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, answers: bool) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if answers and self._drop.is_set():
                    self._drop.clear()
                    self.dropped += 1
                    break  # the server answered; the client never hears it
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                self._open.discard(src)
                self._open.discard(dst)
            _close(src)
            _close(dst)


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        s.close()
    except OSError:
        pass
