"""pytest plugin: no key, ticket or token the suite handled may reach a server's log, its
database or a backup (registered by tests/conftest.py's ``pytest_plugins``).

What it gathers, as the session runs:

* every secret a test *sent*: ``X-API-Key``, ``X-Access-Token``,
  ``E2B-Traffic-Access-Token`` and ``Authorization`` headers, and the values of
  credential query parameters (``hangar.log.QUERY_SECRETS``), from every
  httpx (and httpx2) request;
* every secret a server *gave*: in each JSON answer read whole, the values of
  fields named like a credential (``SECRET_FIELDS``) and the credential
  parameters of any URL in it (a private port's ``signed_url``, a ticket's
  ``url``);
* each test server's default key (``<data>/api-key``).

What it checks: when a test server (``conftest.Server``) stops, its log
file, its database (the raw bytes of ``hangar.db`` and its WAL, and SQLite's
text dump of it) and every ``*.db`` copy under its data directory; at the
end of the session every backup ``hangar.ops.backup.backup_database`` made
and every ``*.db`` under the session's temporary folder (``hangar backup``
run by a test writes there).
Secrets shorter than ``MIN_LEN`` characters are ignored (no real credential
is that short; tests' deliberately bad ones are). Any secret found fails the
session, naming the file and the secret's first characters only.
"""

from __future__ import annotations

import json
import re
import sqlite3
import sys
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import pytest

MIN_LEN = 16
SECRET_FIELDS = re.compile(
    r"^(token|ticket|key|api_?key|access_?token|envd_?access_?token|traffic_?access_?token|"
    r"secret|password|signature)$", re.IGNORECASE)
SECRET_HEADERS = ("x-api-key", "x-access-token", "e2b-traffic-access-token", "authorization")
SECRET_PARAMS = frozenset({"ticket", "hangar_token", "token", "access_token", "accesstoken",
                           "signature", "key", "api_key", "apikey", "x-api-key", "secret",
                           "password"})

SECRETS: set[str] = set()
FINDINGS: list[str] = []
BACKUPS: list[Path] = []
SCANNED: list[tuple[Path, Path | None]] = []  # (data dir, log)


def note(value: Any) -> None:
    """Remember ``value`` as a secret if it is long enough to be one."""
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    if isinstance(value, str):
        value = value.strip()
        if value.lower().startswith("bearer "):
            value = value[7:].strip()
        if len(value) >= MIN_LEN:
            SECRETS.add(value)


def note_url(url: str) -> None:
    try:
        query = urlsplit(url).query
    except ValueError:
        return
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name.lower() in SECRET_PARAMS:
            note(value)


def note_json(obj: Any, depth: int = 0) -> None:
    if depth > 20:
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            if isinstance(k, str) and SECRET_FIELDS.match(k):
                note(v)
            note_json(v, depth + 1)
    elif isinstance(obj, list):
        for v in obj[:1000]:
            note_json(v, depth + 1)
    elif isinstance(obj, str) and "=" in obj and "?" in obj:
        note_url(obj)


def note_exchange(request: Any, response: Any, streamed: bool) -> None:
    """Gather the secrets of one httpx request and, when read whole, its JSON answer."""
    try:
        for name in SECRET_HEADERS:
            for value in request.headers.get_list(name):
                note(value)
        note_url(str(request.url))
        if streamed or "json" not in response.headers.get("content-type", ""):
            return
        note_json(json.loads(response.content))
    except Exception:  # a guard never breaks the test it watches
        return


def _wrap_clients(module: Any) -> None:
    client, aclient = module.Client, module.AsyncClient
    if getattr(client.send, "_log_guard", False):
        return
    sync_send, async_send = client.send, aclient.send

    def send(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        response = sync_send(self, request, *args, **kwargs)
        note_exchange(request, response, bool(kwargs.get("stream")))
        return response

    async def asend(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        response = await async_send(self, request, *args, **kwargs)
        note_exchange(request, response, bool(kwargs.get("stream")))
        return response

    send._log_guard = asend._log_guard = True  # type: ignore[attr-defined]
    client.send, aclient.send = send, asend


def scan_file(path: Path, what: str) -> None:
    try:
        data = path.read_bytes()
    except OSError:
        return
    for secret in SECRETS:
        if secret.encode("utf-8", "surrogateescape") in data:
            FINDINGS.append(f"{what} {path} holds a secret the suite issued: {secret[:6]}...")


def scan_db(path: Path, what: str) -> None:
    for p in (path, path.with_name(path.name + "-wal")):
        scan_file(p, what)
    try:
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            dump = "\n".join(con.iterdump())
        finally:
            con.close()
    except sqlite3.Error:
        return
    for secret in SECRETS:
        if secret in dump:
            FINDINGS.append(f"{what} (SQL dump) {path} holds a secret the suite issued: "
                            f"{secret[:6]}...")


def scan_server(data_dir: Path, log: Path | None) -> None:
    if log is not None:
        scan_file(log, "server log")
    for db in data_dir.rglob("*.db") if data_dir.is_dir() else ():
        if "images" in db.relative_to(data_dir).parts[:1]:
            continue
        scan_db(db, "database" if db.name == "hangar.db" else "database copy")


def _wrap_server(conftest: Any) -> None:
    server = getattr(conftest, "Server", None)
    if server is None or getattr(server.kill, "_log_guard", False):
        return
    kill = server.kill

    def guarded_kill(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            note(self.key)
        except OSError:
            pass
        out = kill(self, *args, **kwargs)
        SCANNED.append((Path(self.data_dir), Path(self.log)))
        scan_server(Path(self.data_dir), Path(self.log))
        return out

    guarded_kill._log_guard = True  # type: ignore[attr-defined]
    server.kill = guarded_kill


def _wrap_backup() -> None:
    try:
        from hangar.ops import backup
    except ImportError:
        return
    original = backup.backup_database
    if getattr(original, "_log_guard", False):
        return

    def guarded(*args: Any, **kwargs: Any) -> Any:
        report = original(*args, **kwargs)
        BACKUPS.append(Path(report.path))
        return report

    guarded._log_guard = True  # type: ignore[attr-defined]
    backup.backup_database = guarded


def install() -> None:
    import httpx

    _wrap_clients(httpx)
    try:
        import httpx2
    except ImportError:
        pass
    else:
        _wrap_clients(httpx2)
    conftest = sys.modules.get("conftest")
    if conftest is not None:
        _wrap_server(conftest)
    _wrap_backup()


install()


def pytest_sessionstart(session: pytest.Session) -> None:
    install()  # conftest may have been imported after this module


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    for data_dir, log in SCANNED:
        if data_dir.exists():
            scan_server(data_dir, log)
    factory = getattr(session.config, "_tmp_path_factory", None)
    if factory is not None:  # backups made by `hangar backup` in a test's tmp_path
        try:
            base = factory.getbasetemp()
        except Exception:
            base = None
        if base is not None and base.is_dir():
            BACKUPS.extend(p for p in base.rglob("*.db") if p not in BACKUPS)
    for path in BACKUPS:
        scan_db(path, "backup")
    tr = session.config.pluginmanager.get_plugin("terminalreporter")
    if tr is not None and (SECRETS or SCANNED):
        tr.write_line(f"log guard: {len(SECRETS)} secrets checked against {len(SCANNED)} "
                      f"servers' logs and databases and {len(BACKUPS)} backups")
    if FINDINGS:
        found = sorted(set(FINDINGS))
        text = "log guard: secrets found outside their owners:\n  " + "\n  ".join(found)
        if tr is not None:
            tr.write_line(text, red=True)
        else:
            print(text, file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
