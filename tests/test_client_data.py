"""Client data never steers the server (issue 20, class 2), through a real server.

- Bounds: every client-set string has one bound (``hangar.schemas.bounds``) and a
  request over it gets 400 naming the field and the limit, in Hangar's API and E2B's.
- Metadata is opaque: a sandbox whose metadata holds the keys the server once read
  as its own state (``idle_timeout_s``, ``user_id``, ``pool``, ``e2b``), values at
  the bound and odd Unicode is expired, paused and reaped like one without.
- One damaged row, written straight into the store's database, stops no other
  sandbox's expiry.
- Tombstones are purged after ``HANGAR_PURGE_RETENTION_S``.
- Rows of older servers, whose state lived in metadata, are moved to columns.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from conftest import Server, Waits, cleanup, free_port, make_data_dir, wait_for

from hangar.schemas.bounds import (
    METADATA_ENTRIES, METADATA_KEY_BYTES, METADATA_TOTAL_BYTES, METADATA_VALUE_BYTES,
)

RETENTION_S = 4

HOSTILE = {
    "idle_timeout_s": "1",
    "user_id": "alice",
    "pool": "true",
    "e2b": json.dumps({"on_timeout": "pause", "envs": {"LD_PRELOAD": "/x"}}),
    "hangar.task": "x" * METADATA_VALUE_BYTES,
    "k" * METADATA_KEY_BYTES: "v",
    "\u202eevil\u0000key": "\U0001f600\u0301\ufeff\u200b",
    "expires_at": "0",
    "state": "deleted",
}


@pytest.fixture(scope="module")
def own(base_image: Path) -> Iterator[Server]:
    """A server of this module's own: its database is damaged on purpose below."""
    d = make_data_dir(base_image)
    srv = Server(d, free_port(), {"HANGAR_PURGE_RETENTION_S": str(RETENTION_S)})
    srv.start()
    yield srv
    leaked = cleanup(srv)
    shutil.rmtree(d, ignore_errors=True)
    assert not leaked, leaked


def _error(r: httpx.Response) -> str:
    body = r.json()
    return body["error"]["message"] if "error" in body else body["message"]


# -- bounds -----------------------------------------------------------------------------------

@pytest.mark.parametrize("metadata, named", [
    ({"big": "x" * 1_000_000}, f"at most {METADATA_VALUE_BYTES} bytes"),
    ({"k" * (METADATA_KEY_BYTES + 1): "v"}, f"at most {METADATA_KEY_BYTES} bytes"),
    ({"": "v"}, "empty key"),
    ({f"k{i}": "v" * METADATA_VALUE_BYTES for i in range(17)},
     f"at most {METADATA_TOTAL_BYTES} are taken"),
    ({f"k{i}": "v" for i in range(METADATA_ENTRIES + 1)}, f"at most {METADATA_ENTRIES}"),
])
def test_metadata_over_a_bound_is_400_naming_it(own: Server, metadata: dict[str, str],
                                                named: str) -> None:
    with own.client() as c:
        for path in ("/sandboxes", "/e2b/sandboxes"):
            body = {"metadata": metadata, "timeout": 5}
            if path.startswith("/e2b"):
                body["templateID"] = "base"
            r = c.post(path, json=body)
            # Hangar answers a body that fails its schema 422 invalid_request; E2B 400.
            assert r.status_code == (400 if path.startswith("/e2b") else 422), (path, r.text)
            assert "metadata" in _error(r) and named in _error(r), (path, _error(r)[:300])
        assert c.get("/sandboxes").json()["sandboxes"] == []


def test_other_client_strings_are_bounded(own: Server) -> None:
    with own.client() as c:
        cases = [
            ("/sandboxes", {"network": {"egress": "none", "allow": ["1" * 300]}},
             "network.allow[0] is over 256 bytes"),
            ("/sandboxes", {"network": "x" * 300}, "network is 300 bytes"),
            ("/e2b/sandboxes", {"templateID": "base", "envVars": {"A=B": "1"}},
             "envVars: 'A=B' is not a variable name"),
            ("/e2b/sandboxes", {"templateID": "base",
                                "envVars": {f"V{i}": "1" for i in range(257)}},
             "at most 256 are taken"),
            ("/e2b/sandboxes", {"templateID": "base",
                                "envVars": {"V": "x" * 300_000}}, "at most 262144"),
            ("/e2b/sandboxes", {"templateID": "base",
                                "network": {"allowOut": ["1.1.1.1"] * 257}},
             "network.allowOut has 257 entries"),
            ("/e2b/sandboxes", {"templateID": "t" * 300}, "templateID"),
        ]
        for path, body, named in cases:
            r = c.post(path, json=body)
            assert r.status_code == (400 if path.startswith("/e2b") else 422), r.text[:300]
            assert named in _error(r), (named, _error(r)[:300])
        r = c.get("/e2b/v2/sandboxes", params={"metadata": "a=" + "b" * 9000})
        assert r.status_code == 400 and "at most 8192" in _error(r), r.text[:300]


# -- metadata is opaque -----------------------------------------------------------------------

def test_hostile_metadata_changes_nothing(own: Server, waits: Waits) -> None:
    with own.client() as c:
        r = c.post("/sandboxes", json={"metadata": HOSTILE, "timeout": 600})
        assert r.status_code == 201, r.text
        hostile = r.json()
        assert hostile["metadata"] == HOSTILE  # stored and shown as given
        r = c.post("/sandboxes", json={"timeout": 3})
        assert r.status_code == 201, r.text
        plain = r.json()["id"]
        # The plain one expires on time while the other lives on...
        wait_for(lambda: c.get(f"/sandboxes/{plain}").status_code == 410, waits.vm(1.0),
                 "the plain sandbox's expiry")
        # ... never asleep for its "idle_timeout_s", nor anyone's machine.
        time.sleep(2)
        r = c.get(f"/sandboxes/{hostile['id']}")
        assert r.status_code == 200, r.text[:500]
        got = r.json()
        assert got["state"] == "running" and got["metadata"] == HOSTILE, got
        assert c.get("/machines/alice").status_code == 404
        # Its own TTL ends it like any other.
        assert c.post(f"/sandboxes/{hostile['id']}/timeout", json={"timeout": 2}).status_code \
            == 200
        wait_for(lambda: c.get(f"/sandboxes/{hostile['id']}").status_code == 410, 15,
                 "the hostile sandbox's expiry")


def test_hostile_metadata_is_paused_and_reaped_like_any(own: Server, waits: Waits) -> None:
    with own.client() as c:
        r = c.post("/e2b/sandboxes", json={"templateID": "base", "timeout": 600,
                                           "metadata": HOSTILE})
        assert r.status_code == 201, r.text
        sid = r.json()["sandboxID"]
        try:
            assert c.post(f"/e2b/sandboxes/{sid}/pause").status_code == 204
            wait_for(lambda: c.get(f"/sandboxes/{sid}").json()["state"] == "sleeping",
                     waits.vm(3.0), "the pause")
            r = c.post(f"/e2b/sandboxes/{sid}/connect", json={"timeout": 600})
            assert r.status_code == 201, r.text  # woken from its pause
            assert c.get(f"/e2b/sandboxes/{sid}").json()["metadata"] == HOSTILE
        finally:
            assert c.delete(f"/sandboxes/{sid}").status_code == 204
        assert c.get(f"/sandboxes/{sid}").status_code == 404


# -- one damaged row stops nothing ------------------------------------------------------------

def _poison(db: Path) -> list[str]:
    """Rows a damaged or forged database could hold, oldest of all (first in every pass)."""
    con = sqlite3.connect(db)
    try:
        cols = [r[1] for r in con.execute("PRAGMA table_info(sandboxes)")]
        base = {c: None for c in cols}
        base.update(state="running", desired_state="running", image="base", image_digest="",
                    engine="qemu", accel="", vcpus=1, memory_mib=256, disk_mib=2048,
                    created_at=0.0, updated_at=0.0, last_active_at=0.0, metadata="{}")
        rows = [
            {**base, "id": "sb-badbadbad001", "expires_at": "soon"},
            {**base, "id": "sb-badbadbad002", "metadata": "{not json", "expires_at": 1.0},
            {**base, "id": "sb-badbadbad003", "desired_state": "dancing", "expires_at": 1.0},
            {**base, "id": "sb-badbadbad004", "idle_timeout_s": "x", "user_id": "bob"},
        ]
        for row in rows:
            con.execute(f"INSERT INTO sandboxes ({', '.join(row)}) VALUES "
                        f"({', '.join('?' for _ in row)})", list(row.values()))
        con.commit()
    finally:
        con.close()
    return [r["id"] for r in rows]


def test_a_damaged_row_stops_no_other_expiry(own: Server, waits: Waits) -> None:
    bad = _poison(own.data_dir / "hangar.db")
    with own.client() as c:
        r = c.post("/sandboxes", json={"timeout": 3})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        created = time.monotonic()
        wait_for(lambda: c.get(f"/sandboxes/{sid}").status_code == 410, 15,
                 "the expiry beside damaged rows")
        assert time.monotonic() - created < 15
        assert httpx.get(own.url + "/health").status_code == 200
        assert c.get("/sandboxes").status_code == 200
    log = own.log.read_text()
    for b in bad[1:3]:  # unreadable rows: logged once each, not once per pass
        assert log.count(b) == 1, (b, log.count(b))


# -- tombstones are purged ----------------------------------------------------------------------

def test_tombstones_are_purged_after_the_retention(own: Server, waits: Waits) -> None:
    with own.client() as c:
        r = c.post("/sandboxes", json={"timeout": 1})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        wait_for(lambda: c.get(f"/sandboxes/{sid}").status_code == 410, waits.vm(1.0),
                 "the expiry")
        wait_for(lambda: c.get(f"/sandboxes/{sid}").status_code == 404, RETENTION_S + 10,
                 "the purge")
    con = sqlite3.connect(own.data_dir / "hangar.db")
    try:
        assert con.execute("SELECT count(*) FROM sandboxes WHERE id = ?", (sid,)).fetchone() \
            == (0,)
        assert con.execute("SELECT count(*) FROM sandboxes WHERE state IN "
                           "('deleted', 'expired')").fetchone() == (0,)
    finally:
        con.close()


# -- old rows move -------------------------------------------------------------------------------

def test_state_an_older_server_kept_in_metadata_moves_to_columns(tmp_path: Path) -> None:
    from hangar.core.lifecycle import OnExpiry
    from hangar.core.store import MachineRecord, Store

    db = tmp_path / "hangar.db"
    store = Store(db)
    store.add(MachineRecord(user_id="bob", sandbox_id="sb-000000000001", idle_timeout_s=60,
                            created_at=1.0))
    store.engine.dispose()
    con = sqlite3.connect(db)
    old = {"idle_timeout_s": 60.0, "user_id": "bob", "pool": True, "team": "a",
           "e2b": {"template": "base", "on_timeout": "pause"}}
    forged = {"idle_timeout_s": "1", "user_id": "alice", "pool": "true", "e2b": "x"}
    for sid, meta in (("sb-000000000001", old), ("sb-000000000002", forged)):
        con.execute("INSERT INTO sandboxes (id, state, desired_state, image, image_digest, "
                    "engine, accel, vcpus, memory_mib, disk_mib, created_at, updated_at, "
                    "last_active_at, metadata) VALUES (?, 'sleeping', 'running', 'base', '', "
                    "'qemu', '', 1, 256, 2048, 1, 1, 1, ?)", (sid, json.dumps(meta)))
    con.commit()
    con.close()
    store = Store(db)
    a, b = store.get("sb-000000000001"), store.get("sb-000000000002")
    assert a is not None and b is not None
    assert (a.user_id, a.idle_timeout_s, bool(a.pooled), a.e2b, a.on_expiry) == (
        "bob", 60.0, True, {"template": "base"}, OnExpiry.SLEEP)
    assert a.metadata_ == {"team": "a"}
    assert (b.user_id, b.idle_timeout_s, bool(b.pooled), b.e2b) == (None, None, False, None)
    assert b.metadata_ == forged
