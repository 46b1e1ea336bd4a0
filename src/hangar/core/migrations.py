"""The store's database brought up to date in place, at every start (``migrate``).

Each step is idempotent and runs before the store serves anything:

``add_missing_columns``
    tables added since a data directory was made are created by ``create_all``;
    columns added since are added here (``ALTER TABLE ... ADD COLUMN``, nullable).
``move_internal_keys``
    state older servers kept in the client's ``metadata`` (a machine's user and idle
    timeout, the warm-pool mark, E2B's options) moves to its columns.
``move_e2b_lifecycle``
    E2B's lifecycle, which older servers kept in the ``e2b`` column (``on_timeout``,
    ``auto_resume``, ``timeout_s``, ``wake_ttl_s``), moves to the generic columns
    (``on_expiry``, ``auto_resume``, ``ttl_s``, ``wake_ttl_s``): a sandbox made with
    E2B's ``autoPause`` still sleeps when its time runs out.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from sqlalchemy import Engine, MetaData, inspect, text

from hangar.core.lifecycle import OnExpiry, State

log = logging.getLogger("hangar.store")

INTERNAL_KEYS = ("user_id", "idle_timeout_s", "pool", "e2b")
"""Metadata keys where Hangar once kept state of its own, before it had columns."""

E2B_LIFECYCLE = ("on_timeout", "auto_resume", "timeout_s", "wake_ttl_s")
"""Keys of the ``e2b`` column where older servers kept E2B's lifecycle."""


def migrate(engine: Engine, metadata: MetaData) -> None:
    """Every step of the module docstring, in order."""
    add_missing_columns(engine, metadata)
    move_internal_keys(engine)
    move_e2b_lifecycle(engine)


def json_object(raw: Any) -> dict[str, Any] | None:
    """A JSON column's raw value as a dict, or None when it is not one (NULL, garbage)."""
    try:
        value = json.loads(raw) if isinstance(raw, (str, bytes)) else raw
    except ValueError:
        return None
    return dict(value) if isinstance(value, dict) else None


def _positive(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    return None


def add_missing_columns(engine: Engine, metadata: MetaData) -> None:
    insp = inspect(engine)
    with engine.begin() as conn:
        for table in metadata.sorted_tables:
            have = {c["name"] for c in insp.get_columns(table.name)}
            for col in table.columns:
                if col.name not in have:
                    kind = col.type.compile(engine.dialect)
                    conn.execute(text(f'ALTER TABLE {table.name} ADD COLUMN "{col.name}" {kind}'))
                    log.info("column added", extra={"table": table.name, "column": col.name})


def move_internal_keys(engine: Engine) -> None:
    """Move state older servers kept in ``metadata`` into its columns, once.

    Only a value a server wrote moves (the client's were strings: a non-string
    idle timeout, pool mark or E2B options; a ``user_id`` only when a machine
    record names this sandbox as that user's); a client's string under one of
    these keys stays in its metadata, where it means nothing to the server.
    """
    with engine.begin() as conn:
        rows = conn.execute(text("SELECT id, metadata FROM sandboxes")).all()
        owners = {sid: user for user, sid in conn.execute(
            text("SELECT user_id, sandbox_id FROM machines")).all()}
        for sid, raw in rows:
            meta = json_object(raw)
            if meta is None or not any(k in meta for k in INTERNAL_KEYS):
                continue
            cols: dict[str, Any] = {}
            idle = meta.get("idle_timeout_s")
            if isinstance(idle, (int, float)) and not isinstance(idle, bool):
                cols["idle_timeout_s"] = float(idle) if idle > 0 else None
                del meta["idle_timeout_s"]
            if meta.get("pool") is True:
                cols["pooled"] = True
                del meta["pool"]
            if isinstance(meta.get("e2b"), dict):
                cols["e2b"] = json.dumps(meta.pop("e2b"))
            if isinstance(meta.get("user_id"), str) and owners.get(sid) == meta["user_id"]:
                cols["user_id"] = meta.pop("user_id")
            kept = {k: v for k, v in meta.items() if isinstance(v, str)}
            if not cols and kept == meta:
                continue  # only a client's strings under these keys: nothing to move
            meta = kept
            sets = ", ".join(f"{k} = :{k}" for k in cols)
            conn.execute(text(f"UPDATE sandboxes SET metadata = :metadata"
                              f"{', ' + sets if sets else ''} WHERE id = :id"),
                         {"metadata": json.dumps(meta), "id": sid, **cols})
            log.info("internal state moved out of metadata",
                     extra={"sandbox_id": sid, "columns": sorted(cols)})


def move_e2b_lifecycle(engine: Engine) -> None:
    """Move E2B's lifecycle out of the ``e2b`` column into the generic columns, once:
    ``on_timeout`` ``pause`` is ``on_expiry`` ``sleep`` (else ``delete``); ``timeout_s``
    (the create's time to live) is ``ttl_s``; a paused sandbox's armed ``wake_ttl_s``
    stays armed. A sandbox woken whose clock an older server had not restarted yet gets
    its time to live now."""
    now = time.time()
    with engine.begin() as conn:
        rows = conn.execute(text("SELECT id, e2b, state, expires_at FROM sandboxes "
                                 "WHERE e2b IS NOT NULL")).all()
        for sid, raw, state, expires_at in rows:
            opts = json_object(raw)
            if opts is None or not any(k in opts for k in E2B_LIFECYCLE):
                continue
            wake = _positive(opts.get("wake_ttl_s"))
            cols: dict[str, Any] = {
                "on_expiry": (OnExpiry.SLEEP if opts.get("on_timeout") == "pause"
                              else OnExpiry.DELETE).value,
                "auto_resume": opts.get("auto_resume") is True,
                "ttl_s": _positive(opts.get("timeout_s")), "wake_ttl_s": wake,
                "expires_at": expires_at,
                "e2b": json.dumps({k: v for k, v in opts.items() if k not in E2B_LIFECYCLE})}
            if wake is not None and state == State.RUNNING.value and expires_at is None:
                cols.update(expires_at=now + wake, wake_ttl_s=None)
            conn.execute(text("UPDATE sandboxes SET on_expiry = :on_expiry, "
                              "auto_resume = :auto_resume, ttl_s = :ttl_s, "
                              "wake_ttl_s = :wake_ttl_s, expires_at = :expires_at, "
                              "e2b = :e2b WHERE id = :id"), {"id": sid, **cols})
            log.info("E2B lifecycle moved to the generic columns",
                     extra={"sandbox_id": sid, "on_expiry": cols["on_expiry"]})
