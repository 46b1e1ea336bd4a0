#!/usr/bin/env bash
# Run Hangar's test suite against real microVMs (after scripts/install.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
