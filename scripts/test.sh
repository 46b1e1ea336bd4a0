#!/usr/bin/env bash
# Run Hangar's test suite against real microVMs. First makes sure that what the
# tests need is installed and built (scripts/install.sh --ci: idempotent, quick
# when nothing is missing). Takes pytest's options, e.g. scripts/test.sh -x -k exec.
#
# Tests run on HANGAR_TEST_WORKERS parallel workers (default 3; each its own server),
# a module (or a group of modules that share host state) whole on one worker: see
# tests/schedule.py. Pass -n 0 to run them one after another in this process.
set -euo pipefail
cd "$(dirname "$0")/.."
#
# The images other than base build in the background while the tests begin (install.sh
# --base-first); a test that needs one waits for them (tests/conftest.py), and so does this
# script before it ends: a failed background build fails the run.
DATA=${HANGAR_DATA_DIR:-/var/lib/hangar}
LATER=0
if [ -z "${HANGAR_TEST_NO_INSTALL:-}" ]; then
  bash scripts/install.sh --ci --base-first
  LATER=1
fi
workers=(-n "${HANGAR_TEST_WORKERS:-3}" --dist loadscope --no-loadscope-reorder)
for arg in "$@"; do
  case "$arg" in -n|-n[0-9]*|--numprocesses|--numprocesses=*) workers=() ;; esac
done
rc=0
.venv/bin/python -m pytest -p no:cacheprovider "${workers[@]}" "$@" || rc=$?
if [ "$LATER" = 1 ] && [ -e "$DATA/images-later.lock" ]; then
  flock -s "$DATA/images-later.lock" true
  if [ "$(cat "$DATA/images-later.status" 2>/dev/null)" != 0 ]; then
    echo "an image built in the background failed: $DATA/images-later.log says why:" >&2
    tail -n 40 "$DATA/images-later.log" >&2
    [ "$rc" != 0 ] || rc=1
  fi
fi
exit "$rc"
