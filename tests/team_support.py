"""What the team test modules share: the CLI on a server's data directory, clients by key,
and keys of teams (issue 32); each module's server is ``conftest.own_server``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx

from conftest import SRC, Server


def cli(data_dir: Path, *args: str, url: str | None = None, key: str | None = None,
        width: int | None = None) -> str:
    """``hangar ARGS`` on ``data_dir`` (and the server at ``url`` with ``key``; tables
    ``width`` columns wide when given): its stdout, stripped; the test fails on a non-zero
    exit."""
    env = {**os.environ, "PYTHONPATH": str(SRC), "HANGAR_DATA_DIR": str(data_dir)}
    if width is not None:
        env["COLUMNS"] = str(width)
    if url is not None:
        env |= {"HANGAR_URL": url, "HANGAR_API_KEY": key or ""}
    r = subprocess.run([sys.executable, "-m", "hangar.cli", *args], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def client(server: Server, key: str) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"X-API-Key": key}, timeout=300)


def team_keys(server: Server, keys: dict[str, str | None]) -> dict[str, httpx.Client]:
    """A client for each key made of ``{label: team}`` (``hangar key add LABEL-key --team
    TEAM``; None: an operator key; a label ending ``-e2b`` makes an E2B-shaped key)."""
    out = {}
    for label, team in keys.items():
        args = ["key", "add", f"{label}-key"] + (["--team", team] if team else [])
        out[label] = client(server, cli(server.data_dir, *args,
                                        *(["--e2b"] if label.endswith("-e2b") else [])))
    return out
