#!/usr/bin/env bash
# The host's half of a deploy (scripts/deploy.sh ships it with the wheels and runs it):
# install a release next to the previous one, switch to it, restart Hangar, wait for
# /health to report the new version, and switch back if it does not.
#
#   release.sh --stage DIR --version V [options]        (as root, on the Hangar host)
#     --stage DIR         holds wheels/ (Hangar's wheel and every dependency's) and
#                         proxy-wheels/ with requirements-proxy.lock (the secret proxy's)
#     --version V         the version the new release reports on /health
#     --id ID             release name (default: V-<UTC time>)
#     --prefix DIR        releases live in DIR/releases/<id>, DIR/current points at one
#                         (default /opt/hangar)
#     --env-file FILE     the server's HANGAR_* settings, KEY=VALUE lines
#                         (default /etc/hangar/hangar.env; may be missing)
#     --link PATH         symlink to DIR/current/venv/bin/hangar (default
#                         /usr/local/bin/hangar, which the systemd unit runs; 'none': skip)
#     --images LIST       images to build with the new release before the switch
#                         (comma-separated, default base; 'none': skip)
#     --health-timeout S  seconds to wait for /health (default 120)
#     --keep N            releases kept, the current and previous among them (default 5)
#
# Restart: with systemd running (/run/systemd/system), `systemctl restart hangar`
# (the unit's KillMode=process leaves VMs running). Without systemd, the same as
# scripts/install.sh: the server named by the pid file in $HANGAR_RUN_DIR (default
# /var/log/hangar, root's: nohup-server.sh) gets SIGTERM while it is `hangar serve` on
# the data directory, and the new one starts with setsid nohup, its log appended to
# $HANGAR_RUN_DIR/hangar.log.
# Either way sandboxes keep running and the new server adopts them.
# Exit status: 0 deployed; 1 failed before the switch (nothing changed); 2 rolled back.
set -euo pipefail

STAGE="" VERSION="" ID="" PREFIX=/opt/hangar ENV_FILE=/etc/hangar/hangar.env
LINK=/usr/local/bin/hangar IMAGES=base HEALTH_TIMEOUT=120 KEEP=5
while [ $# -gt 0 ]; do
  case "$1" in
    --stage) STAGE=$2; shift 2 ;;
    --version) VERSION=$2; shift 2 ;;
    --id) ID=$2; shift 2 ;;
    --prefix) PREFIX=$2; shift 2 ;;
    --env-file) ENV_FILE=$2; shift 2 ;;
    --link) LINK=$2; shift 2 ;;
    --images) IMAGES=$2; shift 2 ;;
    --health-timeout) HEALTH_TIMEOUT=$2; shift 2 ;;
    --keep) KEEP=$2; shift 2 ;;
    *) echo "release.sh: unknown option $1" >&2; exit 1 ;;
  esac
done
say() { printf '==> %s\n' "$*"; }
die() { printf 'release.sh: %s\n' "$*" >&2; exit 1; }
[ -n "$STAGE" ] && [ -d "$STAGE/wheels" ] || die "--stage must hold wheels/"
[ -n "$VERSION" ] || die "--version is required"
[ "$(id -u)" = 0 ] || die "run as root"
[ "$KEEP" -ge 2 ] 2>/dev/null || die "--keep must be at least 2"
ID=${ID:-$VERSION-$(date -u +%Y%m%dT%H%M%SZ)}
case "$ID" in */* | .* | "") die "bad release id: $ID" ;; esac

# The server's settings, as the service sees them.
if [ -f "$ENV_FILE" ]; then
  set -a; . "$ENV_FILE"; set +a
fi
DATA=${HANGAR_DATA_DIR:-/var/lib/hangar}
HOST=${HANGAR_HOST:-127.0.0.1}
case "$HOST" in 0.0.0.0 | "::" | "") HOST=127.0.0.1 ;; esac
PORT=${HANGAR_PORT:-8080}
export HANGAR_DATA_DIR=$DATA

SYSTEMD=0
if [ -d /run/systemd/system ]; then
  SYSTEMD=1
  systemctl cat hangar.service >/dev/null 2>&1 \
    || die "systemd runs but hangar.service is not installed: run scripts/provision-host.sh (or scripts/install.sh --service) first"
fi

mkdir -p "$PREFIX/releases"
exec 9>"$PREFIX/.deploy.lock"
flock -n 9 || die "another deploy is running on this host ($PREFIX/.deploy.lock)"

REL=$PREFIX/releases/$ID
[ ! -e "$REL" ] || die "$REL exists already"
PREV=""
if [ -L "$PREFIX/current" ]; then
  PREV=$(basename "$(readlink "$PREFIX/current")")
fi

# The nohup server's pid file and log, in a folder of root's (nohup-server.sh, shipped
# beside this script).
. "$(dirname "$0")/nohup-server.sh"

# Without systemd the pid file names the server to stop; one that answers without
# it (started by hand, or by an older install.sh) would keep the port from the new one.
if [ "$SYSTEMD" = 0 ] && ! server_pid >/dev/null \
   && python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=3)' \
        "http://$HOST:$PORT/health" 2>/dev/null; then
  die "a server answers on $HOST:$PORT but $PIDFILE does not name it: stop it first (nothing was changed)"
fi

# 1. Install next to the previous release: its own venv, from the shipped wheels only.
say "installing Hangar $VERSION into $REL"
python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || die "Hangar needs Python 3.11 or newer on this host (python3 is $(python3 -V 2>&1))"
mkdir -p "$REL"
cleanup_failed_install() { rm -rf "$REL"; }
trap cleanup_failed_install ERR
cp -r "$STAGE/wheels" "$REL/wheels"
python3 -m venv "$REL/venv"
"$REL/venv/bin/pip" install -q --disable-pip-version-check --no-index \
  --find-links "$REL/wheels" "hangar[server]==$VERSION"
"$REL/venv/bin/hangar" --help >/dev/null
# The secret proxy's own environment (mitmproxy pins older libraries than Hangar's), where
# the server looks for it: beside its venv (HANGAR_SECRET_PROXY_MITMDUMP's default).
if [ -d "$STAGE/proxy-wheels" ]; then
  python3 -m venv "$REL/.venv-proxy"
  "$REL/.venv-proxy/bin/pip" install -q --disable-pip-version-check --no-index \
    --find-links "$STAGE/proxy-wheels" -r "$STAGE/requirements-proxy.lock"
fi
# The split server's user, and its read access to the release (hangar-user.sh).
. "$(dirname "$0")/hangar-user.sh"
ensure_hangar_user
let_hangar_import "$REL/venv"
if [ -d "$REL/.venv-proxy" ]; then let_hangar_import "$REL/.venv-proxy"; fi
# What /health will report (the wheel's name carries the normalized form).
VERSION=$("$REL/venv/bin/python" -c 'import hangar; print(hangar.__version__)')
echo "$VERSION" > "$REL/version"
if [ "$IMAGES" != none ]; then
  for image in ${IMAGES//,/ }; do
    say "building image $image with the new release (cached when its recipe is unchanged)"
    "$REL/venv/bin/hangar" image build "$image" >/dev/null
  done
fi
trap - ERR

# 2. Switch and restart.
switch_to() {  # atomically point current at releases/$1
  ln -sfn "releases/$1" "$PREFIX/.current.new"
  mv -Tf "$PREFIX/.current.new" "$PREFIX/current"
}

stop_nohup() {
  local pid
  if pid=$(server_pid); then
    echo "stopping the server (pid $pid); its VMs keep running"
    kill -TERM "$pid"
    for _ in $(seq 120); do running "$pid" || break; sleep 0.5; done
    if [ "$(server_pid)" = "$pid" ]; then
      echo "server $pid did not stop in 60 s; killing it (VMs keep running)" >&2
      kill -KILL "$pid"
    fi
  fi
  rm -f "$PIDFILE"
}

restart() {
  if [ "$SYSTEMD" = 1 ]; then
    systemctl restart hangar.service
  else
    stop_nohup
    mkdir -p "$DATA"
    start_server "$PREFIX/current/venv/bin/hangar"
    echo "started the server (pid $!, log $LOGFILE)"
  fi
}

healthy() {  # wait until /health reports version $1; 0 when it does
  "$PREFIX/current/venv/bin/python" - "$HOST" "$PORT" "$1" "$HEALTH_TIMEOUT" "$PIDFILE" "$SYSTEMD" <<'EOF'
import json, os, sys, time, urllib.error, urllib.request
host, port, want, timeout, pidfile, systemd = sys.argv[1:]
url = f"http://{host}:{port}/health"
deadline = time.monotonic() + float(timeout)
seen = "no answer"
bad_since = None  # an answer that is not 200 for 10 s running fails at once
while time.monotonic() < deadline:
    if systemd == "0":
        try:
            pid = int(open(pidfile).read())
            if open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
                raise ProcessLookupError
        except (OSError, ValueError):
            print(f"the server exited; {seen}", file=sys.stderr)
            sys.exit(1)
    try:
        with urllib.request.urlopen(url, timeout=3) as r:
            got = json.load(r).get("version")
            if r.status == 200 and got == want:
                sys.exit(0)
            seen = f"{url} answered {r.status}, version {got}"
            bad_since = None
    except urllib.error.HTTPError as exc:
        seen = f"{url} answered {exc.code}"
        bad_since = bad_since or time.monotonic()
        if time.monotonic() - bad_since > 10:
            break
    except Exception as exc:
        seen = f"{url}: {getattr(exc, 'reason', exc)}"
    time.sleep(0.5)
print(f"no healthy answer: {seen}", file=sys.stderr)
sys.exit(1)
EOF
}

server_log_tail() {
  if [ "$SYSTEMD" = 1 ]; then
    journalctl -u hangar.service -n 20 --no-pager >&2 || true
  else
    tail -n 20 "$LOGFILE" >&2 || true
  fi
}

say "switching $PREFIX/current to $ID${PREV:+ (previous: $PREV)}"
switch_to "$ID"
if [ "$LINK" != none ]; then
  if [ "$(readlink "$LINK" 2>/dev/null || true)" != "$PREFIX/current/venv/bin/hangar" ]; then
    mkdir -p "$(dirname "$LINK")"
    ln -sfn "$PREFIX/current/venv/bin/hangar" "$LINK"
    say "$LINK now runs $PREFIX/current"
  fi
fi
say "restarting Hangar ($([ "$SYSTEMD" = 1 ] && echo systemctl || echo "no systemd: pid file $PIDFILE"))"
restart
if healthy "$VERSION"; then
  say "Hangar $VERSION is healthy on $HOST:$PORT"
else
  echo "release $ID failed its health check; the server's last lines:" >&2
  server_log_tail
  touch "$REL/FAILED"
  if [ -z "$PREV" ]; then
    echo "release.sh: no previous release to go back to" >&2
    exit 2
  fi
  PREV_VERSION=$(cat "$PREFIX/releases/$PREV/version" 2>/dev/null || echo unknown)
  say "rolling back to $PREV ($PREV_VERSION)"
  switch_to "$PREV"
  restart
  if healthy "$PREV_VERSION"; then
    say "rolled back: Hangar $PREV_VERSION is healthy again"
  else
    echo "release.sh: the previous release $PREV is not healthy either" >&2
    server_log_tail
  fi
  exit 2
fi

# 3. Keep the newest $KEEP releases (the current and the previous always).
ls -1dt "$PREFIX"/releases/*/ 2>/dev/null | sed 's#/$##' | tail -n +$((KEEP + 1)) | while read -r old; do
  case "$(basename "$old")" in "$ID" | "$PREV") continue ;; esac
  rm -rf "$old"
done
exit 0
