"""The port token cookie's name, without a VM (review 29d D-M3; against a real server and
guest: ``test_security_tokens.py``'s
``test_over_https_a_host_routed_port_keeps_its_token_in_a_host_cookie``).

Every ``{port}-{id}.<domain>`` is one site, so a page of one sandbox's port can toss
``hangar_port_token`` cookies for the whole domain. Over HTTPS a host-routed port keeps its
token in ``__Host-hangar_port_token`` (which browsers let no other host set) and the proxy
reads no unprefixed one there; path-routed ports and plain HTTP keep the unprefixed name.
Here ``Exchange.admit`` runs over a stand-in for the ports' store that knows one token.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from hangar.api.proxy.exchange import Exchange, Refused
from hangar.api.proxy.origin import filter_headers
from hangar.api.proxy.routing import Target, guest_headers, split_cookies, token_cookie

GOOD = "4102444800.goodtoken"
HOST = Target("sb-0123456789ab", 3000, b"/", None)
PATH = Target("sb-0123456789ab", 3000, b"/", "/sandboxes/sb-0123456789ab/ports/3000")
TOSSED = "; ".join(f"hangar_port_token=1.tossed{i}" for i in range(10))


def scope(scheme: str, cookie: str) -> dict[str, Any]:
    return {"type": "http", "scheme": scheme, "method": "GET", "query_string": b"",
            "headers": [(b"host", b"3000-sb-0123456789ab.hangar.test"),
                        (b"cookie", cookie.encode())]}


def admitted(scheme: str, target: Target, cookie: str) -> bool:
    exposure = SimpleNamespace(public=False)
    ports = SimpleNamespace(get=lambda sid, port: exposure,
                            allows=lambda exp, token: token == GOOD)
    exchange = Exchange(scope(scheme, cookie), None, None, target,  # type: ignore[arg-type]
                        SimpleNamespace(ports=ports), SimpleNamespace())  # type: ignore[arg-type]
    try:
        exchange.admit()
    except Refused as refused:
        assert refused.answer[0] == 401, refused.answer
        return False
    return True


@pytest.mark.parametrize("scheme", ["https", "wss"])
def test_over_https_a_host_routed_port_reads_only_its_host_cookie(scheme: str) -> None:
    assert admitted(scheme, HOST, f"{TOSSED}; __Host-hangar_port_token={GOOD}")
    assert not admitted(scheme, HOST, TOSSED)
    assert not admitted(scheme, HOST, f"hangar_port_token={GOOD}")
    assert not admitted(scheme, HOST, f"__host-hangar_port_token={GOOD}")  # another name


@pytest.mark.parametrize("scheme, target", [("http", HOST), ("ws", HOST), ("https", PATH),
                                            ("http", PATH)])
def test_path_routed_and_plain_http_keep_the_unprefixed_cookie(scheme: str,
                                                               target: Target) -> None:
    assert admitted(scheme, target, f"hangar_port_token=1.tossed; hangar_port_token={GOOD}")
    assert not admitted(scheme, target, f"__Host-hangar_port_token={GOOD}")


@pytest.mark.parametrize("scheme, target", [("https", HOST), ("http", HOST), ("https", PATH)])
def test_the_guest_gets_neither_name(scheme: str, target: Target) -> None:
    s = scope(scheme, f"a=1; hangar_port_token={GOOD}; __Host-hangar_port_token={GOOD}; b=2")
    cookie, _ = split_cookies(s, target)
    assert cookie == b"a=1; b=2"
    sent = dict(guest_headers(s, target, cookie))
    assert sent[b"cookie"] == b"a=1; b=2"


def test_the_proxy_names_its_cookie_by_the_request() -> None:
    _, host_https = token_cookie(GOOD, 4102444800, HOST, "https")
    assert host_https.startswith(f"__Host-hangar_port_token={GOOD}; Path=/; Max-Age=".encode())
    assert host_https.endswith(b"; HttpOnly; SameSite=Lax; Secure")
    _, host_http = token_cookie(GOOD, 4102444800, HOST, "http")
    assert host_http.startswith(f"hangar_port_token={GOOD}; Path=/; ".encode())
    assert not host_http.endswith(b"Secure")
    _, path_https = token_cookie(GOOD, 4102444800, PATH, "https")
    assert path_https.startswith(f"hangar_port_token={GOOD}; Path={PATH.prefix}/; ".encode())


@pytest.mark.parametrize("target", [HOST, PATH])
def test_a_guest_sets_neither_name(target: Target) -> None:
    answer = [(b"set-cookie", b"__Host-hangar_port_token=1.x; Path=/; Secure"),
              (b"set-cookie", b"__HOST-Hangar_Port_Token=1.x; Path=/; Secure"),
              (b"set-cookie", b"hangar_port_token=1.x; Path=/"),
              (b"set-cookie", b"own=1; Path=/")]
    kept = [v.partition(b"=")[0] for k, v in filter_headers(answer, target, False)
            if k == b"set-cookie"]
    assert kept == [b"own"]
