# The server that scripts/install.sh and scripts/release.sh start without systemd (setsid
# nohup), sourced by them and by scripts/stop.sh (deploy.sh ships it with release.sh).
# Needs DATA (the data directory) set before it is sourced.
#
# Its pid file and log live in RUN_DIR ($HANGAR_RUN_DIR, default /var/log/hangar), a
# folder of root's that no one else may write, never in the data directory: under the
# privilege split that folder is the server's, and root writing `hangar.pid` or opening
# `hangar.log` there would write wherever a link the server put in their place points
# (review 29c, H3). And root signals the pid only while it is `hangar serve` on DATA
# (`server_pid`), never a pid another process could have written or left behind.

RUN_DIR=${HANGAR_RUN_DIR:-/var/log/hangar}
PIDFILE=$RUN_DIR/hangar.pid
LOGFILE=$RUN_DIR/hangar.log

running() {  # running PID: the process exists and is not a zombie waiting to be reaped
  local state
  state=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -c1) || return 1
  [ -n "$state" ] && [ "$state" != Z ]
}

root_only() {  # root_only DIR: DIR and every folder above it are root's, writable by no
  local d perm  # one else (a sticky folder such as /tmp passes: others cannot move ours)
  d=$(readlink -f "$1") || return 1
  while :; do
    [ "$(stat -c %u "$d")" = 0 ] || return 1
    perm=$(stat -c %a "$d")
    if [ $((8#$perm & 8#022)) -ne 0 ] && [ $((8#$perm & 8#1000)) -eq 0 ]; then
      return 1
    fi
    [ "$d" = / ] && return 0
    d=$(dirname "$d")
  done
}

make_run_dir() {  # RUN_DIR made root's (0700), or exit naming why it cannot be used
  mkdir -p -m 0700 "$RUN_DIR"
  if ! root_only "$RUN_DIR"; then
    echo "$RUN_DIR (HANGAR_RUN_DIR) is not root's alone: it, or a folder above it, is" \
      "another user's or writable by others; give the server's pid file and log a folder" \
      "of root's" >&2
    exit 1
  fi
  chmod 0700 "$RUN_DIR"
}

server_pid() {  # print the pid of PIDFILE while it is `hangar serve` on DATA; else fail
  local pid
  [ -f "$PIDFILE" ] && [ ! -L "$PIDFILE" ] || return 1
  pid=$(head -c 16 "$PIDFILE")
  case "$pid" in '' | *[!0-9]*) return 1 ;; esac
  running "$pid" || return 1
  tr '\0' '\n' <"/proc/$pid/cmdline" 2>/dev/null | grep -qx serve || return 1
  tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qxF "HANGAR_DATA_DIR=$DATA" || return 1
  echo "$pid"
}

start_server() {  # start_server HANGAR: `HANGAR serve` on DATA in the background, its
  make_run_dir    # stdout and stderr appended to LOGFILE, its pid written to PIDFILE
  HANGAR_DATA_DIR=$DATA setsid nohup "$1" serve >>"$LOGFILE" 2>&1 </dev/null 9>&- &
  echo $! >"$PIDFILE"
}
