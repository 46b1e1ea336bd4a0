#!/usr/bin/env python3
"""Generate the blocking SDK (hangar/client/_sync/) from the asyncio one (_async/).

    .venv/bin/python scripts/gen_sync.py           # rewrite the generated files
    .venv/bin/python scripts/gen_sync.py --check   # exit 1 and name the stale ones

``unasync`` (python-trio) rewrites tokens: ``async``/``await`` go, ``async
for``/``with`` become plain, ``__aenter__`` becomes ``__enter__``, and the
names below are swapped. ``_compat.py`` differs by design (asyncio tasks
versus threads) and is written by hand on both sides.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import unasync

ROOT = Path(__file__).resolve().parents[1]
ASYNC = ROOT / "src/hangar/client/_async"
SYNC = ROOT / "src/hangar/client/_sync"
FILES = ["client.py", "code.py", "desktop.py", "events.py", "files.py", "machines.py",
         "mixin.py", "monitor.py", "objects.py", "ports.py", "processes.py", "secrets.py",
         "snapshots.py", "streams.py", "teams.py", "templates.py", "terminals.py",
         "volumes.py"]
REPLACEMENTS = {
    "_async": "_sync",
    "AsyncHangar": "Hangar",
    "AsyncSandbox": "Sandbox",
    "AsyncMachine": "Machine",
    "AsyncFiles": "Files",
    "AsyncProcessCalls": "ProcessCalls",
    "AsyncVolumeCalls": "VolumeCalls",
    "AsyncSecretCalls": "SecretCalls",
    "AsyncMachineCalls": "MachineCalls",
    "AsyncDesktopCalls": "DesktopCalls",
    "AsyncCodeCalls": "CodeCalls",
    "AsyncFileCalls": "FileCalls",
    "AsyncSnapshotCalls": "SnapshotCalls",
    "AsyncPortCalls": "PortCalls",
    "AsyncTerminalCalls": "TerminalCalls",
    "AsyncEventCalls": "EventCalls",
    "AsyncTemplateCalls": "TemplateCalls",
    "AsyncTeamCalls": "TeamCalls",
    "AsyncProcesses": "Processes",
    "AsyncDesktop": "Desktop",
    "AsyncHealthMonitor": "HealthMonitor",
    "AsyncTerminal": "Terminal",
    "AsyncFileWatch": "FileWatch",
    "anext": "next",
    "AsyncClient": "Client",
    "aiter_sse": "iter_sse",
    "aiter_lines": "iter_lines",
    "aread": "read",
    "aclose": "close",
}
HEADER = "# Generated from hangar/client/_async/{name} by scripts/gen_sync.py: do not edit.\n"


def generate(out_dir: Path) -> dict[str, str]:
    """Generate every file into ``out_dir``; return name -> text."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "_async"
        src.mkdir()
        for name in FILES:
            (src / name).write_text((ASYNC / name).read_text())
        rule = unasync.Rule(str(src) + "/", str(Path(tmp) / "_sync") + "/", REPLACEMENTS)
        unasync.unasync_files([str(src / n) for n in FILES], [rule])
        texts = {n: HEADER.format(name=n) + (Path(tmp) / "_sync" / n).read_text() for n in FILES}
    out_dir.mkdir(parents=True, exist_ok=True)
    return texts


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true", help="only say whether the files are current")
    a = ap.parse_args()
    texts = generate(SYNC)
    stale = [n for n, t in texts.items()
             if not (SYNC / n).exists() or (SYNC / n).read_text() != t]
    if a.check:
        for n in stale:
            print(f"stale: src/hangar/client/_sync/{n} (run scripts/gen_sync.py)", file=sys.stderr)
        return 1 if stale else 0
    for n in stale:
        (SYNC / n).write_text(texts[n])
        print(f"wrote src/hangar/client/_sync/{n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
