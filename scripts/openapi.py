#!/usr/bin/env python3
"""Write Hangar's REST contract, ``docs/openapi.json``, from the FastAPI app.

    .venv/bin/python scripts/openapi.py           # regenerate docs/openapi.json
    .venv/bin/python scripts/openapi.py --check   # exit 1 when the file is stale

The app is built but never started: no engine is chosen, no VM boots and no
server listens. Building it needs a data folder (the app reads its API keys
at once), so a throwaway one is made and removed. ``tests/test_openapi.py``
fails when the app and the file differ.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "docs" / "openapi.json"


def build_app(data_dir: Path) -> Any:
    """The FastAPI application as ``hangar serve`` builds it, not started.

    The one place that knows how the app is assembled: repoint it when the
    assembly moves. ``data_dir`` is an empty folder the app may write its key
    file into. Settings from the environment are overridden where they could
    change the app's shape (a cluster node adds its gateway) or stop it from
    being built (a weak ``HANGAR_API_KEY``).
    """
    from hangar.server import create_app
    from hangar.config import Settings

    return create_app(Settings(data_dir=data_dir, api_key=None, etcd=None))


def build_spec() -> dict[str, Any]:
    """The OpenAPI document of the app (a JSON-ready dict)."""
    with tempfile.TemporaryDirectory(prefix="hangar-openapi-") as d:
        return build_app(Path(d)).openapi()


def render(spec: dict[str, Any]) -> str:
    """The file's text: two-space indents, keys in the app's order, a final newline."""
    return json.dumps(spec, indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="do not write; exit 1 when the file differs from the app")
    parser.add_argument("--output", type=Path, default=SPEC, help=f"default {SPEC}")
    args = parser.parse_args(argv)
    text = render(build_spec())
    if args.check:
        current = args.output.read_text() if args.output.exists() else ""
        if current != text:
            print(f"{args.output} differs from the app: run "
                  "`.venv/bin/python scripts/openapi.py` and commit it", file=sys.stderr)
            return 1
        return 0
    args.output.write_text(text)
    print(f"wrote {args.output} ({len(text)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
