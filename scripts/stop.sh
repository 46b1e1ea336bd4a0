#!/usr/bin/env bash
# Stop the Hangar server that scripts/install.sh started. Sandboxes' VMs keep
# running (a restarted server adopts them); warm-pool VMs are ended. The pid file is
# root's (scripts/nohup-server.sh), and its pid is signalled only while it is
# `hangar serve` on this data directory.
set -euo pipefail
DATA=${HANGAR_DATA_DIR:-/var/lib/hangar}
. "$(dirname "$0")/nohup-server.sh"
if pid=$(server_pid); then
  kill -TERM "$pid"
  for _ in $(seq 60); do running "$pid" || break; sleep 0.5; done
  echo "stopped Hangar (pid $pid)"
else
  echo "Hangar is not running"
fi
rm -f "$PIDFILE"
