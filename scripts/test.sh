#!/usr/bin/env bash
# Run Hangar's test suite against real microVMs. First makes sure that what the
# tests need is installed and built (scripts/install.sh --ci: idempotent, quick
# when nothing is missing). Takes pytest's options, e.g. scripts/test.sh -x -k exec.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${HANGAR_TEST_NO_INSTALL:-}" ]; then
  bash scripts/install.sh --ci
fi
exec .venv/bin/python -m pytest -p no:cacheprovider "$@"
