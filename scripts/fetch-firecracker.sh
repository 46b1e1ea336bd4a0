#!/bin/sh
# Fetch firecracker and jailer v1.12.1 into $HANGAR_DATA_DIR/bin (default
# /var/lib/hangar/bin), or into the directory given as $1. Idempotent.
# See src/hangar/engines/firecracker/binaries.py for where they come from.
set -eu
here=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}
if [ $# -gt 0 ]; then set -- --dir "$1"; fi
PYTHONPATH="$here/src${PYTHONPATH:+:$PYTHONPATH}" exec "$python" -m hangar.engines.firecracker "$@"
