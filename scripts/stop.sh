#!/usr/bin/env bash
# Stop the Hangar server that scripts/install.sh started. Sandboxes' VMs keep
# running (a restarted server adopts them); warm-pool VMs are ended.
set -euo pipefail
DATA=${HANGAR_DATA_DIR:-/var/lib/hangar}
PIDFILE="$DATA/hangar.pid"
running() {  # the process exists and is not a zombie waiting to be reaped
  local state
  state=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -c1) || return 1
  [ -n "$state" ] && [ "$state" != Z ]
}
if [ -f "$PIDFILE" ] && running "$(cat "$PIDFILE")"; then
  pid=$(cat "$PIDFILE")
  kill -TERM "$pid"
  for _ in $(seq 60); do running "$pid" || break; sleep 0.5; done
  echo "stopped Hangar (pid $pid)"
else
  echo "Hangar is not running"
fi
rm -f "$PIDFILE"
