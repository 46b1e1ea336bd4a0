#!/usr/bin/env bash
# Deploy this checkout to a Hangar host: build the wheels here, copy them over SSH,
# install them next to the previous release, restart, wait for /health, and roll
# back if it does not come. Running sandboxes keep running throughout.
#
#   scripts/deploy.sh [options] HOST     HOST: an ssh destination (root@hangar.example.com),
#                                        or 'local' for this machine, without ssh
#   -p PORT, -i KEY, -o OPTION           passed to ssh (-o may repeat)
#   --prefix DIR                         releases on the host (default /opt/hangar)
#   --env-file FILE                      the host's settings (default /etc/hangar/hangar.env)
#   --link PATH                          the command the service runs (default
#                                        /usr/local/bin/hangar; 'none' to leave it)
#   --images LIST                        images to build before the switch (default base)
#   --health-timeout S                   seconds to wait for /health (default 120)
#   --keep N                             releases kept on the host (default 5)
#
# The host needs root over SSH, python3 (3.11, with venv) and what
# scripts/provision-host.sh installs. It never reaches a package index: every
# wheel comes from here (built for this machine's Python, which must match the
# host's minor version and architecture). The host's side is scripts/release.sh;
# see it, and docs/operations.md, for the restart (systemctl, or without systemd
# the pid file of scripts/install.sh) and the layout under --prefix.
# Exit status: 0 deployed, 1 failed before the switch, 2 rolled back.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
SSH_OPTS=()
RELEASE_OPTS=()
HOST=""
while [ $# -gt 0 ]; do
  case "$1" in
    -p) SSH_OPTS+=(-p "$2"); shift 2 ;;
    -i) SSH_OPTS+=(-i "$2"); shift 2 ;;
    -o) SSH_OPTS+=(-o "$2"); shift 2 ;;
    --prefix|--env-file|--link|--images|--health-timeout|--keep)
      RELEASE_OPTS+=("$1" "$2"); shift 2 ;;
    -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
    -*) echo "deploy.sh: unknown option $1" >&2; exit 1 ;;
    *) [ -z "$HOST" ] || { echo "deploy.sh: one HOST only" >&2; exit 1; }; HOST=$1; shift ;;
  esac
done
[ -n "$HOST" ] || { echo "usage: scripts/deploy.sh [options] HOST (see scripts/deploy.sh --help)" >&2; exit 1; }
say() { printf '\033[1m==> %s\033[0m\n' "$*"; }

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
STAGE=$(mktemp -d /tmp/hangar-deploy.XXXXXX)
trap 'rm -rf "$STAGE"' EXIT

say "building Hangar's and its server dependencies' wheels (versions of requirements.lock)"
# The server's extra, at the exact versions CI tests (the lock is a constraint: only
# what hangar[server] needs is built).
"$PY" -m pip wheel -q --disable-pip-version-check --wheel-dir "$STAGE/wheels" \
  -c "$ROOT/requirements.lock" "$ROOT[server]"
say "building the secret proxy's wheels (requirements-proxy.lock: an environment of its own)"
"$PY" -m pip wheel -q --disable-pip-version-check --no-deps --wheel-dir "$STAGE/proxy-wheels" \
  -r "$ROOT/requirements-proxy.lock"
cp "$ROOT/requirements-proxy.lock" "$STAGE/requirements-proxy.lock"
WHEEL=$(cd "$STAGE/wheels" && ls hangar-*.whl)
VERSION=${WHEEL#hangar-}
VERSION=${VERSION%%-*}
ID="$VERSION-$(date -u +%Y%m%dT%H%M%SZ)"
if git -C "$ROOT" rev-parse --short HEAD >/dev/null 2>&1; then
  ID="$ID-$(git -C "$ROOT" rev-parse --short HEAD)"
  git -C "$ROOT" diff --quiet HEAD 2>/dev/null || ID="$ID-dirty"
fi
cp scripts/release.sh "$STAGE/release.sh"
cp scripts/hangar-user.sh "$STAGE/hangar-user.sh"
cp scripts/nohup-server.sh "$STAGE/nohup-server.sh"
say "release $ID ($(ls "$STAGE/wheels" | wc -l) wheels, $(du -sh "$STAGE/wheels" | cut -f1))"

REMOTE_STAGE="/tmp/hangar-release.$ID"
ARGS=(--stage "$REMOTE_STAGE" --version "$VERSION" --id "$ID" "${RELEASE_OPTS[@]}")
rc=0
if [ "$HOST" = local ]; then
  rm -rf "$REMOTE_STAGE"
  cp -r "$STAGE" "$REMOTE_STAGE"
  bash "$REMOTE_STAGE/release.sh" "${ARGS[@]}" || rc=$?
  rm -rf "$REMOTE_STAGE"
else
  say "copying it to $HOST"
  tar -C "$STAGE" -cf - wheels proxy-wheels requirements-proxy.lock release.sh hangar-user.sh nohup-server.sh \
    | ssh "${SSH_OPTS[@]}" "$HOST" "rm -rf '$REMOTE_STAGE' && mkdir -p '$REMOTE_STAGE' && tar -C '$REMOTE_STAGE' -xf -"
  QUOTED=$(printf ' %q' "${ARGS[@]}")
  ssh "${SSH_OPTS[@]}" "$HOST" \
    "bash '$REMOTE_STAGE/release.sh'$QUOTED; rc=\$?; rm -rf '$REMOTE_STAGE'; exit \$rc" || rc=$?
fi
case $rc in
  0) say "deployed $ID to $HOST" ;;
  2) echo "deploy.sh: $ID failed its health check on $HOST and was rolled back" >&2 ;;
  *) echo "deploy.sh: deploying $ID to $HOST failed (exit $rc)" >&2 ;;
esac
exit $rc
