#!/usr/bin/env bash
# Stop the Hangar server that scripts/install.sh started. Sandboxes' VMs keep
# running (a restarted server adopts them); warm-pool VMs are ended.
set -euo pipefail
DATA=${HANGAR_DATA_DIR:-/var/lib/hangar}
PIDFILE="$DATA/hangar.pid"
if [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
  pid=$(cat "$PIDFILE")
  kill -TERM "$pid"
  for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
  echo "stopped Hangar (pid $pid)"
else
  echo "Hangar is not running"
fi
rm -f "$PIDFILE"
