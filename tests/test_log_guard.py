"""The log guard (tests/log_guard.py) itself: it finds a secret it gathered in a log, a
database and its SQL dump, and ignores what is too short to be a credential."""

from __future__ import annotations

import secrets
import sqlite3
from pathlib import Path

import httpx

import log_guard


def test_the_guard_gathers_and_finds(tmp_path: Path) -> None:
    token = "123." + secrets.token_urlsafe(32)
    ticket = secrets.token_urlsafe(32)
    key = "hk_" + secrets.token_urlsafe(32)

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"signed_url": f"http://h/p?hangar_token={token}",
                                         "ticket": ticket, "short": {"token": "abc"}})

    with httpx.Client(transport=httpx.MockTransport(answer), headers={"X-API-Key": key}) as c:
        c.get("http://h/x")
    assert {token, ticket, key} <= log_guard.SECRETS and "abc" not in log_guard.SECRETS
    before = list(log_guard.FINDINGS)
    try:
        (tmp_path / "server.log").write_text(f'{{"event": "GET /p?hangar_token={token}"}}\n')
        db = tmp_path / "hangar.db"
        with sqlite3.connect(db) as con:
            con.execute("CREATE TABLE t (v TEXT)")
            con.execute("INSERT INTO t VALUES (?)", (ticket,))
        log_guard.scan_server(tmp_path, tmp_path / "server.log")
        found = log_guard.FINDINGS[len(before):]
        assert any("server log" in f and token[:6] in f for f in found), found
        assert any("database" in f and ticket[:6] in f for f in found), found
        assert not any(key[:6] in f for f in found), found
    finally:
        log_guard.FINDINGS[:] = before
        log_guard.SECRETS -= {token, ticket, key}
