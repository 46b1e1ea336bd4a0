"""The SDK's retry, timeout and idempotency contract, against a real server and a stopped one.

A stopped server is a port nothing listens on; a lost answer is made by a
TCP proxy (``tcpproxy.py``) that closes the client's connection once the
server has answered.
"""

from __future__ import annotations

import hashlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from conftest import Server, free_port
from tcpproxy import TcpProxy

from hangar.client import Hangar, RetryPolicy
from hangar.client._core import error_for, retry_delay
from hangar.errors import (
    Busy, HangarError, IdempotencyMismatch, InvalidRequest, LimitExceeded, NotFound,
    RequestTimeout, Timeout, Unavailable,
)

FAST = RetryPolicy(delays=(0.05, 0.1))


class Recorder:
    """An httpx client whose request hook notes when each attempt is sent, and its headers."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.keys: list[str | None] = []
        self.http = httpx.Client(event_hooks={"request": [self._note]})

    def _note(self, request: httpx.Request) -> None:
        self.times.append(time.monotonic())
        self.keys.append(request.headers.get("Idempotency-Key"))

    def client(self, url: str, key: str = "k", **kw: object) -> Hangar:
        return Hangar(url, key, http_client=self.http, **kw)  # type: ignore[arg-type]


@pytest.fixture
def rec() -> Iterator[Recorder]:
    r = Recorder()
    yield r
    r.http.close()


def test_get_on_a_stopped_server_makes_three_attempts_1s_and_3s_apart(rec: Recorder) -> None:
    h = rec.client(f"http://127.0.0.1:{free_port()}")
    started = time.monotonic()
    with pytest.raises(Unavailable) as info:
        h.get("sb-000000000000")
    assert len(rec.times) == 3
    gaps = [b - a for a, b in zip(rec.times, rec.times[1:])]
    assert 0.95 <= gaps[0] <= 1.6 and 2.95 <= gaps[1] <= 3.6, gaps
    assert time.monotonic() - started < 5.5
    assert info.value.retryable and not info.value.outcome_unknown
    assert "cannot reach Hangar" in info.value.message


def test_exec_is_tried_once_unless_asked_and_creates_reuse_their_key(rec: Recorder) -> None:
    h = rec.client(f"http://127.0.0.1:{free_port()}", retry=FAST)
    with pytest.raises(Unavailable):
        h.exec("sb-000000000000", "true")
    assert len(rec.times) == 1 and rec.keys == [None]
    with pytest.raises(Unavailable):
        h.exec("sb-000000000000", "true", retry=True)
    assert len(rec.times) == 4
    assert rec.keys[1] is not None and rec.keys[1:] == [rec.keys[1]] * 3
    with pytest.raises(Unavailable):
        h.create()
    assert len(rec.times) == 7
    assert rec.keys[4] not in (None, rec.keys[1]) and rec.keys[4:] == [rec.keys[4]] * 3
    with pytest.raises(Unavailable):
        h.set_timeout("sb-000000000000", 60)  # not safe to repeat: one attempt
    assert len(rec.times) == 8


def test_client_errors_are_raised_at_once(server: Server, rec: Recorder) -> None:
    h = rec.client(server.url, server.key)
    with pytest.raises(NotFound):
        h.get("sb-000000000000")
    assert len(rec.times) == 1
    with pytest.raises(InvalidRequest) as bad:
        h.create(memory_mib=1)  # 422: never retried, nothing booted
    assert len(rec.times) == 2
    # The class is the code's, whatever the status: not IdempotencyMismatch (also a 422).
    assert type(bad.value) is InvalidRequest and bad.value.code == "invalid_request"
    assert bad.value.status == 422 and "memory_mib" in bad.value.message
    with pytest.raises(HangarError) as info:
        rec.client(server.url, "wrong-key").list()
    assert info.value.status == 401 and len(rec.times) == 3


def test_a_timeout_says_whether_the_outcome_is_unknown(rec: Recorder) -> None:
    silent = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                held.append(silent.accept()[0])  # never answers
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    try:
        h = rec.client(f"http://127.0.0.1:{silent.getsockname()[1]}")
        with pytest.raises(RequestTimeout) as info:
            h.restore("sb-000000000000", "snap-x", request_timeout=0.5)
        assert info.value.outcome_unknown and "outcome is unknown" in info.value.message
        assert len(rec.times) == 1
    finally:
        stop.set()
        silent.close()
        for s in held:
            s.close()


def test_retry_decisions_read_the_error_class() -> None:
    p = RetryPolicy()

    def resp(status: int, code: str | None = None, **headers: str) -> httpx.Response:
        body = {"error": {"code": code, "message": "m"}} if code else None
        return httpx.Response(status, headers=headers, json=body)

    unavailable = Unavailable("x")
    assert retry_delay(p, 0, unavailable) == 1.0
    assert retry_delay(p, 1, unavailable) == 3.0
    assert retry_delay(p, 2, unavailable) is None
    # Each answer is mapped to its class first; the class's flag decides, and the
    # server's Retry-After, when the class carries one, is the wait.
    retried = {
        resp(409, "busy", **{"Retry-After": "2"}): (Busy, 2.0),
        resp(429, "limit_exceeded", **{"Retry-After": "7"}): (LimitExceeded, 7.0),
        resp(504, "timeout"): (Timeout, 1.0),
        resp(503): (Unavailable, 1.0),  # a proxy's own answers, no Hangar body
        resp(502): (Unavailable, 1.0),
        resp(504): (Timeout, 1.0),
    }
    for r, (cls, wait) in retried.items():
        error = error_for(r)
        assert type(error) is cls and error.retryable, (r, error)
        assert retry_delay(p, 0, error) == wait, r
    assert retry_delay(p, 0, error_for(resp(429, "limit_exceeded",
                                            **{"Retry-After": "3600"}))) is None
    for r in (resp(400, "invalid_request"), resp(401, "unauthorized"), resp(404, "not_found"),
              resp(409, "conflict"), resp(409, "image_missing"), resp(410, "gone"),
              resp(422, "idempotency_mismatch"), resp(502, "guest_error"),
              resp(500, "engine_error"), resp(500)):
        error = error_for(r)
        assert not error.retryable and retry_delay(p, 0, error) is None, (r, error)
    assert retry_delay(p, 0, InvalidRequest("x")) is None


@pytest.mark.vm
def test_busy_is_retried_after_its_retry_after(server: Server, rec: Recorder) -> None:
    """A snapshot asked for while a command runs is Busy (409, retryable); the SDK waits
    the server's Retry-After and tries again until the command has ended."""
    with Hangar(server.url, server.key) as direct:
        sb = direct.create()
        try:
            started, ended = threading.Event(), threading.Event()

            def command() -> None:
                for ev in direct.exec_stream(sb.id, "echo go; sleep 3", timeout=60):
                    if ev.type == "stdout":
                        started.set()
                ended.set()

            threading.Thread(target=command, daemon=True).start()
            assert started.wait(120), "the command never started"
            with pytest.raises(Busy) as info:  # without retries, raised at once
                rec.client(server.url, server.key, retry=RetryPolicy(delays=())).snapshot(sb.id)
            assert info.value.retryable and len(rec.times) == 1
            h = rec.client(server.url, server.key, retry=RetryPolicy(delays=(1.0,) * 20))
            snap = h.snapshot(sb.id)
            assert len(rec.times) >= 3, rec.times  # Busy, Busy (at least once), the snapshot
            gaps = [b - a for a, b in zip(rec.times[1:], rec.times[2:])]
            assert all(g >= info.value.retry_after - 0.05 for g in gaps), gaps
            direct.delete_snapshot(snap.id)
        finally:
            direct.delete(sb.id)


@pytest.mark.vm
def test_a_create_whose_answer_is_lost_makes_one_sandbox(server: Server, rec: Recorder) -> None:
    proxy = TcpProxy(server.port)
    direct = Hangar(server.url, server.key)
    made: set[str] = set()
    try:
        before = {s.id for s in direct.list()}
        h = rec.client(proxy.url, server.key)
        proxy.drop_next_answer()
        sb = h.create(metadata={"case": "lost-answer"})
        made.add(sb.id)
        assert proxy.dropped == 1 and len(rec.times) == 2
        key = rec.keys[0]
        assert key is not None and rec.keys == [key, key]
        assert {s.id for s in direct.list()} - before == {sb.id}
        # The same key again: the first result, nothing new.
        again = direct.create(metadata={"case": "lost-answer"}, idempotency_key=key)
        assert again.id == sb.id
        # The same key with another body: 422, nothing new.
        with pytest.raises(IdempotencyMismatch) as info:
            direct.create(metadata={"case": "other"}, idempotency_key=key)
        assert info.value.status == 422
        # Two calls racing with one new key: one sandbox, both get it.
        race_key = f"race-{time.time_ns()}"
        got: list[str] = []

        def one() -> None:
            with Hangar(server.url, server.key) as c:
                got.append(c.create(metadata={"case": "race"}, idempotency_key=race_key).id)

        threads = [threading.Thread(target=one) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        made.update(got)
        assert len(got) == 2 and got[0] == got[1]
        assert {s.id for s in direct.list()} - before == {sb.id, got[0]}
        # Keys are stored per API key as its SHA-256, never the key itself.
        db = b"".join(f.read_bytes() for f in server.data_dir.glob("hangar.db*"))
        assert server.key.encode() not in db
        assert hashlib.sha256(server.key.encode()).hexdigest().encode() in db
        # A delete whose answer is lost: the retry finds it gone, which is success.
        proxy.drop_next_answer()
        h.delete(sb.id)
        assert proxy.dropped == 2
        made.discard(sb.id)
        with pytest.raises(NotFound):
            direct.get(sb.id)
    finally:
        for sid in made:
            try:
                direct.delete(sid)
            except NotFound:
                pass
        direct.close()
        proxy.close()


def test_idempotency_records_are_per_api_key_and_expire(tmp_path: Path) -> None:
    from sqlalchemy import create_engine

    from hangar.core.idempotency import IdempotencyStore, owner_of, request_hash

    store = IdempotencyStore(create_engine(f"sqlite:///{tmp_path / 'db'}"), ttl_s=0.3)
    alice, bob = owner_of("key-a"), owner_of("key-b")
    h = request_hash("POST", "/sandboxes", "", b"{}")
    assert h != request_hash("POST", "/sandboxes", "", b"{} ")
    assert h != request_hash("POST", "/sandboxes/", "", b"{}")
    store.save(alice, "k1", h, 201, "application/json", b'{"id": "sb-1"}')
    rec = store.find(alice, "k1")
    assert rec is not None and rec.status == 201 and rec.body == b'{"id": "sb-1"}'
    assert store.find(bob, "k1") is None
    time.sleep(0.4)
    assert store.find(alice, "k1") is None  # past its time to live
    store.save(alice, "k1", h, 201, "application/json", b'{"id": "sb-2"}')  # reusable then
    found = store.find(alice, "k1")
    assert found is not None and found.body == b'{"id": "sb-2"}'


def test_idempotency_records_are_bounded_per_api_key(tmp_path: Path) -> None:
    """Each API key keeps its latest records within ``max_rows`` and ``max_bytes``; past
    either, its oldest go (to three quarters of both) and other keys keep theirs; a record
    of an answer not kept holds no body (review 29k K-M2)."""
    from sqlalchemy import create_engine

    from hangar.core.idempotency import OWNER_BYTES, OWNER_ROWS, IdempotencyStore, owner_of

    assert (OWNER_ROWS, OWNER_BYTES) == (10_000, 16 << 20)
    store = IdempotencyStore(create_engine(f"sqlite:///{tmp_path / 'db'}"), max_rows=8,
                             max_bytes=4000)
    alice, bob, carol = owner_of("key-a"), owner_of("key-b"), owner_of("key-c")
    store.save(bob, "b0", "h", 201, "application/json", b"x" * 100)
    for i in range(9):  # the ninth is one row too many: down to six
        store.save(alice, f"r{i}", "h", 201, "application/json", b"x" * 10)
    assert [k for k in (f"r{i}" for i in range(9)) if store.find(alice, k)] == [
        f"r{i}" for i in range(3, 9)]
    for i in range(5):  # the fifth makes 5000 bytes: down to 3000
        store.save(carol, f"c{i}", "h", 201, "application/json", b"y" * 1000)
    assert [k for k in (f"c{i}" for i in range(5)) if store.find(carol, k)] == [
        "c2", "c3", "c4"]
    store.save(alice, "large", "h", 200, "application/json", b"")
    rec = store.find(alice, "large")
    assert rec is not None and not rec.kept and rec.status == 200
    found = store.find(bob, "b0")
    assert found is not None and found.kept

