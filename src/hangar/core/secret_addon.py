"""The secret-injecting proxy's mitmproxy addon (runs in mitmdump, never in the server).

Loaded by ``mitmdump -s`` in the proxy's own virtual environment (mitmproxy pins older
libraries than Hangar's): it imports the standard library and mitmproxy only, never
``hangar`` (``hangar.core.secret_proxy`` starts it and is its only peer).

Its peer talks to it over two pipes, whose descriptors are in the environment:

- ``HANGAR_PROXY_CONTROL_FD`` (in): JSON lines. The first, read before the proxy serves,
  is ``{"secrets": {placeholder: {"name", "value", "hosts"}}, "rules": {...},
  "egress_match": path, "max_connections": n}`` (``hangar/net/egress_match.py``: ``decide`` and
  ``host_matches``, the one matcher of every egress proxy; without it the proxy does
  not start); later lines replace ``secrets`` or ``rules``. End of file (the server is
  gone) ends the proxy.
- ``HANGAR_PROXY_EVENTS_FD`` (out): JSON lines: ``{"event": "ready"}``, then
  ``secret.refused`` (secret name, host, reason) and ``egress.denied`` (domain,
  address, port, reason). Never a value or a header.

Rules for each request (docs/security.md, "Secrets and the vault"):

1. Every upstream connection is checked with ``egress_match.decide`` (loaded by path)
   against the sandbox's rules, on the address the guest connected to and the name it
   asked for (TLS SNI, else the HTTP Host): refused, it never opens.
Every decision is made on the request's headers (``requestheaders``); bodies are then
streamed both ways, never held whole: a request's body as it comes, an answer's body
too, rewritten on the way (rule 3) only when its request carried a secret.

2. A placeholder in a header value (or inside an ``Authorization: Basic`` header's
   base64) is replaced by its secret only when the request is
   HTTPS (so the upstream's certificate, verified, proves the name), its SNI and Host
   name the same host, and that host is one of the secret's hosts. Anywhere else (another
   host, plain HTTP, the URL) the request is answered 403 with one line of reason, and
   nothing is sent upstream.
3. The secret's value in the answer's headers or body goes back to the guest as its
   placeholder again: the request is sent with ``Accept-Encoding: identity`` and the
   body rewritten as it streams (``_Swap``, holding at most a value's length); an answer
   that comes compressed anyway is not passed on (the connection is closed).

Anything that is not HTTP (a WebSocket after its 101, which mitmproxy relays as raw TCP
under ``websocket=false``; a stream that does not look like HTTP) passes through
unmodified, chunk by chunk, nothing of it kept (``_flowless_tcp``): secrets go only into
HTTP request headers, never into WebSocket messages or raw TCP bytes.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import importlib.util
import json
import os
import signal
import socket
import threading
from typing import Any

from mitmproxy import http

CONTROL_FD = "HANGAR_PROXY_CONTROL_FD"
EVENTS_FD = "HANGAR_PROXY_EVENTS_FD"
PREFIX = b"hangar-secret-"
PLACEHOLDER_LEN = len(PREFIX) + 32
REFUSED_BODY_MAX = 64 << 10
"""Largest request body read before a refusal is answered 403 (a larger one: closed)."""


def _basic(key: bytes, value: bytes) -> bytes | None:
    """The decoded credentials of an ``Authorization: Basic`` header that holds a
    placeholder (``user:placeholder``, as git and many clients send a token), else None."""
    if key.lower() not in (b"authorization", b"proxy-authorization") \
            or value[:6].lower() != b"basic ":
        return None
    try:
        inner = base64.b64decode(value[6:].strip(), validate=True)
    except (ValueError, binascii.Error):
        return None
    return inner if PREFIX in inner else None


class SecretProxy:
    def __init__(self) -> None:
        self.secrets: dict[bytes, dict[str, Any]] = {}
        self.rules: dict[str, Any] = {}
        self.match: Any = None  # hangar/net/egress_match.py, loaded by path (_apply)
        self.names: dict[str, str] = {}
        self.max_connections = 0
        """Client connections served at once (0: no cap); more are closed at once."""
        self.clients: set[str] = set()
        self._out = os.fdopen(int(os.environ[EVENTS_FD]), "w", buffering=1)
        self._lock = threading.Lock()
        self._control = os.fdopen(int(os.environ[CONTROL_FD]), "r")
        first = self._control.readline()
        if not first:
            raise SystemExit("no configuration on the control pipe")
        self._apply(json.loads(first))
        threading.Thread(target=self._follow, name="hangar-control", daemon=True).start()

    # -- the server's side -----------------------------------------------------------------

    def _apply(self, msg: dict[str, Any]) -> None:
        path = msg.get("egress_match")
        if isinstance(path, str) and path:
            spec = importlib.util.spec_from_file_location("hangar_egress_match", path)
            if spec is None or spec.loader is None:
                raise SystemExit(f"cannot load {path}")
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            self.match = mod
        if self.match is None:  # without the one matcher there is no deciding: no proxy
            raise SystemExit("the first control line names no egress_match file")
        if isinstance(msg.get("secrets"), dict):
            self.secrets = {k.encode(): v for k, v in msg["secrets"].items()
                            if isinstance(v, dict) and len(k) == PLACEHOLDER_LEN}
        if isinstance(msg.get("rules"), dict):
            self.rules = msg["rules"]
        if isinstance(msg.get("max_connections"), int):
            self.max_connections = msg["max_connections"]

    def _follow(self) -> None:
        for line in self._control:
            try:
                self._apply(json.loads(line))
            except (ValueError, TypeError, AttributeError):
                self.emit("proxy.error", reason="bad control line")
        os.kill(os.getpid(), signal.SIGTERM)  # the server is gone: so is this proxy

    def emit(self, event: str, **data: Any) -> None:
        with self._lock:
            try:
                self._out.write(json.dumps({"event": event, **data}) + "\n")
            except OSError:
                pass

    # -- mitmproxy's hooks -----------------------------------------------------------------

    def running(self) -> None:
        self.emit("ready")

    def client_connected(self, client: Any) -> None:
        """The guest's connections are capped (``max_connections``): one more is closed."""
        if self.max_connections and len(self.clients) >= self.max_connections:
            client.error = "too many connections from the sandbox"
            self.emit("proxy.busy")
            return
        self.clients.add(client.id)

    def client_disconnected(self, client: Any) -> None:
        self.names.pop(client.id, None)
        self.clients.discard(client.id)

    async def server_connect(self, data: Any) -> None:
        """Rule 1: refuse an upstream connection the sandbox's rules do not allow. A name
        allowed by a domain rule at an address the host did not resolve for the guest is
        resolved here: the connection goes on only when the name leads to that address
        and that address passes the domain guard's rebinding guard (``admits``: a public
        name that resolves to a private address opens nothing under ``internet``)."""
        address = data.server.address
        if not address:
            return
        ip, port = str(address[0]), int(address[1])
        name = data.server.sni or self.names.get(data.client.id)
        ok, reason = self._decide(self.rules, ip, port, name)
        if not ok and reason == "unresolved_address" and name:
            try:
                infos = await asyncio.get_running_loop().getaddrinfo(
                    name, port, family=socket.AF_INET, type=socket.SOCK_STREAM)
            except OSError:
                infos = []
            if ip in {i[4][0] for i in infos} and self._admits(ip):
                ok, reason = self._decide({**self.rules, "resolved": {ip: [name.lower()]}},
                                          ip, port, name)
        if not ok:
            data.server.error = f"refused by the sandbox's egress rules ({reason})"
            self.emit("egress.denied", domain=(name or "")[:253], address=ip, port=port,
                      reason=str(reason)[:64])

    def _admits(self, ip: str) -> bool:
        try:
            return bool(self.match.admits(self.rules, ip))
        except Exception:  # an older matcher, a rule it cannot read: closed, not open
            return False

    def _decide(self, rules: dict, ip: str, port: int, name: str | None) -> tuple[bool, str]:
        try:
            ok, reason = self.match.decide(rules, ip=ip, port=port, name=name or None)
            return bool(ok), str(reason)
        except Exception:  # a rule the matcher cannot read: closed, not open
            return False, "rule_error"

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        """Rule 2, on the request's headers alone: put secrets in the place of their
        placeholders, or refuse; the body is then streamed, never held."""
        req = flow.request
        sni = (flow.client_conn.sni or "").lower().rstrip(".")
        host = (req.host_header or "").lower()
        host = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
        host = host.strip("[]").rstrip(".")
        self.names[flow.client_conn.id] = sni or host
        if PREFIX in req.url.encode("utf-8", "surrogateescape"):
            return self._refuse(flow, self._named(req.url.encode()), host or sni,
                                "a secret's placeholder may go only in a header")
        fields = list(req.headers.fields)
        used: list[dict[str, Any]] = []
        encoded: list[tuple[bytes, bytes]] = []  # (Basic credentials as sent, as given)
        for i, (key, value) in enumerate(fields):
            basic = _basic(key, value)  # HTTP Basic: the placeholder is inside base64
            if basic is not None:
                value = basic
            if PREFIX not in value:
                continue
            for ph in self._found(value):
                sec = self.secrets.get(ph)
                name = str(sec.get("name", "?")) if sec else "?"
                if sec is None or not isinstance(sec.get("value"), str):
                    return self._refuse(flow, name, sni or host,
                                        "no such secret (deleted, or not this sandbox's)")
                if req.scheme != "https" or not sni:
                    return self._refuse(flow, name, host,
                                        "secrets are sent only over HTTPS")
                if host and host != sni:
                    return self._refuse(flow, name, sni, "the Host header and the TLS "
                                                         "server name differ")
                if not self.match.host_matches(sni, list(sec.get("hosts", ()))):
                    return self._refuse(flow, name, sni,
                                        f"{sni} is not one of the secret's hosts")
                value = value.replace(ph, sec["value"].encode())
                used.append(sec)
            if basic is not None:  # its base64 is ours: an echo of it is turned back too
                sent = base64.b64encode(value)
                fields[i] = (key, b"Basic " + sent)
                encoded.append((sent, base64.b64encode(basic)))
            else:
                fields[i] = (key, value)
        if used:
            # an answer is rewritten as it streams (rule 3): ask for it uncompressed
            fields = [(k, v) for k, v in fields if k.lower() != b"accept-encoding"]
            fields.append((b"accept-encoding", b"identity"))
            req.headers.fields = tuple(fields)
            flow.metadata["hangar_secrets"] = used
            flow.metadata["hangar_encoded"] = encoded
        req.stream = True

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        """Rule 3, streamed: an answer to a request that carried a secret has the value
        replaced by its placeholder in its headers, and in its body as it passes (holding
        at most a value's length of it); any other answer streams through untouched."""
        resp = flow.response
        if resp is None or flow.metadata.get("hangar_refused"):
            return
        used = flow.metadata.get("hangar_secrets")
        if not used:
            resp.stream = True
            return
        back = [(s["value"].encode(), ph) for ph, s in self.secrets.items()
                if s in used and s.get("value")]
        # HTTP Basic credentials the proxy base64-encoded with a value inside: echoed as sent
        back += flow.metadata.get("hangar_encoded", [])
        fields = list(resp.headers.fields)
        for i, (key, value) in enumerate(fields):
            for real, ph in back:
                value = value.replace(real, ph)
            fields[i] = (key, value)
        resp.headers.fields = tuple(fields)
        if resp.status_code < 200 or resp.status_code in (204, 304) \
                or flow.request.method == "HEAD":  # no body (a 101 is a WebSocket's)
            resp.stream = True
            return
        encoding = resp.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):  # asked for identity: not rewritable, not sent
            name = str(used[0].get("name", "?"))
            self.emit("secret.refused", secret=name[:64], host=(flow.request.host or "")[:253],
                      reason="the answer came compressed although identity was asked: "
                             "not passed on")
            flow.kill()
            return
        # the body's length may change (a value and its placeholder differ): no declared
        # length, chunked for HTTP/1.1 (HTTP/2 frames itself)
        resp.headers.pop("content-length", None)
        if resp.http_version == "HTTP/1.1":
            resp.headers["transfer-encoding"] = "chunked"
        resp.stream = _Swap(back)

    # -- WebSocket and raw TCP: relayed as they come, nothing kept ----------------------------

    @staticmethod
    def load(loader: Any) -> None:
        """Before the proxy serves: its raw TCP layers keep no flow (``_flowless_tcp``)."""
        _flowless_tcp()

    @staticmethod
    def tcp_message(flow: Any) -> None:
        """A backstop: raw TCP has no flow here (``_flowless_tcp``), so this hook is not
        called; should a TCP flow appear all the same, its chunks are not kept in
        ``flow.messages`` (the layer sends the chunk it holds itself)."""
        flow.messages.clear()

    @staticmethod
    def websocket_message(flow: Any) -> None:
        """A backstop, should ``websocket`` be turned on again: a finished message is not
        kept in ``flow.websocket.messages`` once relayed. That layer still assembles and
        inflates each message whole, hence ``websocket=false``."""
        if flow.websocket is not None:
            flow.websocket.messages.clear()

    # -- helpers -----------------------------------------------------------------------------

    @staticmethod
    def _found(value: bytes) -> list[bytes]:
        out, at = [], value.find(PREFIX)
        while at >= 0:
            out.append(value[at:at + PLACEHOLDER_LEN])
            at = value.find(PREFIX, at + 1)
        return out

    def _named(self, raw: bytes) -> str:
        for ph in self._found(raw):
            sec = self.secrets.get(ph)
            if sec:
                return str(sec.get("name", "?"))
        return "?"

    def _refuse(self, flow: http.HTTPFlow, name: str, host: str, reason: str) -> None:
        """Answer 403 with one line of reason, nothing sent upstream. mitmproxy reads a
        request's body before it answers one it did not send: a body that may be larger
        than ``REFUSED_BODY_MAX`` (or of unknown size: chunked, or any HTTP/2 request that
        declares no length, whose DATA frames mitmproxy reads up to its 4 GiB limit,
        review 29j J-H4) is not read, the connection (or stream) is closed instead."""
        self.emit("secret.refused", secret=name[:64], host=host[:253], reason=reason[:120])
        flow.metadata["hangar_refused"] = True
        length = flow.request.headers.get("content-length", "")
        chunked = "chunked" in flow.request.headers.get("transfer-encoding", "").lower()
        unknown = not length and not flow.request.http_version.startswith("HTTP/1")
        if chunked or unknown or (length and (not length.isdigit()
                                              or int(length) > REFUSED_BODY_MAX)):
            flow.kill()
            return
        flow.response = http.Response.make(
            403, f"hangar: secret {name} refused: {reason}\n".encode(),
            {"Content-Type": "text/plain; charset=utf-8", "Connection": "close"})


class _Swap:
    """A streamed body's filter (mitmproxy's ``stream`` callable): each real value becomes
    its placeholder again. Holds back the last ``longest value - 1`` bytes of each chunk, in
    case a value spans two chunks; an empty chunk (the end) gives what was held."""

    def __init__(self, pairs: list[tuple[bytes, bytes]]) -> None:
        # longest value first: one value may hold another (review 29j L1)
        self.pairs = sorted(pairs, key=lambda pair: len(pair[0]), reverse=True)
        self.keep = max((len(real) for real, _ in pairs), default=1) - 1
        self.held = b""

    def _swap(self, data: bytes) -> bytes:
        for real, ph in self.pairs:
            data = data.replace(real, ph)
        return data

    def __call__(self, data: bytes) -> list[bytes]:
        # a list, never an empty bytes: mitmproxy sends each item as a chunk, and an
        # empty chunk ends a chunked body
        if not data:
            out, self.held = self._swap(self.held), b""
            return [out] if out else []
        buf = self._swap(self.held + data)
        if self.keep > 0:
            buf, self.held = buf[:-self.keep], buf[-self.keep:]
        return [buf] if buf else []


def _flowless_tcp() -> None:
    """Make each of mitmproxy's raw TCP layers one without a flow, as it makes for the
    hosts it is told to ignore (``TCPLayer(context, ignore=True)``): such a layer sends
    each chunk on as it is read, under the proxy's write backpressure, and calls no hook.

    Raw TCP here is a WebSocket after its 101 (``websocket=false``: mitmproxy's
    ``HttpStream.flow_done`` makes the layer) and a stream to port 80 or 443 that is not
    HTTP, or TLS whose ALPN is not (its ``next_layer``). With a flow, mitmproxy 11 keeps
    every chunk in ``flow.messages`` for the connection's life, and each chunk is a
    blocking ``tcp_message`` hook, during which the layer queues whatever the connection
    reads next (``Layer._paused_event_queue``): the reader does not wait for hooks, so
    that queue has no bound (review 29k K-H2; measured: +152 MiB for 256 MiB sent at once,
    even with the chunks dropped from ``flow.messages``). Both places name the class when
    they make the layer, so its constructor is the one place that covers them."""
    from mitmproxy.proxy.layers import tcp

    init = tcp.TCPLayer.__init__
    if getattr(init, "hangar_flowless", False):
        return

    def flowless(self: Any, context: Any, ignore: bool = False) -> None:
        init(self, context, ignore=True)

    flowless.hangar_flowless = True  # type: ignore[attr-defined]
    tcp.TCPLayer.__init__ = flowless  # type: ignore[method-assign]


addons = [SecretProxy()]
