#!/usr/bin/env bash
# Run Hangar's test suite against real microVMs. First makes sure that what the
# tests need is installed and built (scripts/install.sh --ci: idempotent, quick
# when nothing is missing). Takes pytest's options, e.g. scripts/test.sh -x -k exec.
#
# Tests run on HANGAR_TEST_WORKERS parallel workers (default 2; each its own server),
# a module (or a group of modules that share host state) whole on one worker: see
# tests/schedule.py. Pass -n 0 to run them one after another in this process.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${HANGAR_TEST_NO_INSTALL:-}" ]; then
  bash scripts/install.sh --ci
fi
workers=(-n "${HANGAR_TEST_WORKERS:-2}" --dist loadscope --no-loadscope-reorder)
for arg in "$@"; do
  case "$arg" in -n|-n[0-9]*|--numprocesses|--numprocesses=*) workers=() ;; esac
done
exec .venv/bin/python -m pytest -p no:cacheprovider "${workers[@]}" "$@"
