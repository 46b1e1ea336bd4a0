#!/usr/bin/env bash
# Install what Hangar needs on this host, build the base guest image, and start the server.
#   scripts/install.sh             install, build, start `hangar serve` in the background
#   scripts/install.sh --no-start  install and build only
#   scripts/install.sh --desktop   also build the desktop image (Xvfb, Chromium, x11vnc)
#   scripts/install.sh --dev       also build the dev image (the agent tools' vm tier)
#   scripts/install.sh --code-interpreter  also build the code-interpreter image (run_code)
#   scripts/install.sh --ci        install, build every image, do not start (what CI runs)
#   scripts/install.sh --ci --base-first  build the base image, then leave the others building
#                                  in the background and return (scripts/test.sh: the tests
#                                  begin meanwhile; $HANGAR_DATA_DIR/images-later.lock is
#                                  held until they are built, images-later.log says how)
#   scripts/install.sh --service   run Hangar as the systemd service hangar.service
#                                  (deploy/hangar.service) instead of with nohup
#   scripts/install.sh --cluster   this host is a node of a cluster (docs/cluster.md): also
#                                  installs etcd (Debian's etcd-server, etcd-client), runs
#                                  this host's etcd member and starts Hangar as a node. Reads
#                                  HANGAR_NODE_NAME, HANGAR_NODE_IP, HANGAR_CLUSTER (every
#                                  node: name=ip,name=ip,...) and, on the first host only,
#                                  HANGAR_STORE (s3://... or file:///...) for `cluster init`
# Idempotent: a second run only starts what is not running. Without --service the
# server runs with setsid nohup (pid file and log in $HANGAR_RUN_DIR, default
# /var/log/hangar, root's: scripts/nohup-server.sh; the log rotated by
# /etc/logrotate.d/hangar; scripts/stop.sh stops it); production hosts: docs/operations.md.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DATA=${HANGAR_DATA_DIR:-/var/lib/hangar}
PORT=${HANGAR_PORT:-8080}
START=1
DESKTOP=0
DEV=0
CODEINT=0
TEST_TOOLS=0
SERVICE=0
CLUSTER=0
BASE_FIRST=0
for arg in "$@"; do
  case "$arg" in
    --no-start) START=0 ;;
    --desktop) DESKTOP=1 ;;
    --dev) DEV=1 ;;
    --code-interpreter) CODEINT=1 ;;
    --ci) START=0; DESKTOP=1; DEV=1; CODEINT=1; TEST_TOOLS=1 ;;
    --service) SERVICE=1 ;;
    --cluster) CLUSTER=1 ;;
    --base-first) BASE_FIRST=1 ;;
    *) echo "unknown option: $arg" >&2; exit 2 ;;
  esac
done
say() { printf '\033[1m==> %s\033[0m\n' "$*"; }

# The user `hangar` of the split server, and its read access to the code (hangar-user.sh).
. "$ROOT/scripts/hangar-user.sh"
# The nohup server's pid file and log, in a folder of root's (nohup-server.sh).
. "$ROOT/scripts/nohup-server.sh"

if [ "$(id -u)" != 0 ]; then
  echo "run as root: Hangar uses /dev/kvm, debootstrap and mkfs to build and boot guests" >&2
  exit 1
fi

if [ "$SERVICE" = 1 ] && [ ! -d /run/systemd/system ]; then
  echo "--service needs systemd, which does not run here; run without it (nohup)" >&2
  exit 1
fi

PKGS="qemu-system-x86 qemu-utils debootstrap e2fsprogs busybox-static cpio kmod zstd xz-utils lz4 curl nftables iproute2 novnc logrotate"
# The unprivileged server's read access to the code it imports (let_hangar_read below).
PKGS="$PKGS acl"
# The agent tools' in-process tier runs commands in bubblewrap sandboxes.
PKGS="$PKGS bubblewrap"
# The dashboard's terminal: xterm.js (node-xterm's modules, libjs-xterm's stylesheet and fit
# addon), served at /xterm/ like noVNC at /novnc/.
PKGS="$PKGS node-xterm libjs-xterm"
# Templates: OCI image archives are read by skopeo and unpacked by umoci; imported images
# get a Python runtime copied from the host's python3, its programs patched by patchelf.
PKGS="$PKGS skopeo umoci patchelf python3"
# A guest's console log is capped and rotated by multilog (hangar.engines.confine).
PKGS="$PKGS daemontools"
# The guest agent's native spawn is compiled into the initramfs (hangar.images.initramfs:
# a C compiler and Python's headers; without them commands start by posix_spawn).
PKGS="$PKGS gcc libc6-dev python3-dev"
# The browser tests drive Debian's Chromium (Playwright never downloads its own); the
# operations tests run nginx, sshd and openssl, in the foreground on free ports.
# The cluster tests run three etcd members (in network namespaces, never as a service).
# The template build tests pull from a registry on loopback (the distribution project's,
# started on a free port by the tests, never as a service).
[ "$TEST_TOOLS" = 1 ] && PKGS="$PKGS chromium nginx openssh-server openssl python3-venv etcd-server etcd-client docker-registry"
[ "$CLUSTER" = 1 ] && PKGS="$PKGS etcd-server etcd-client"
missing=""
for p in $PKGS; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
  say "installing Debian packages:$missing"
  apt-get update -q
  # Test tools only: their packages must not start daemons (nginx on port 80, sshd on 22).
  NO_DAEMONS=""
  # --cluster too: etcd starts only once /etc/default/etcd names this cluster's members.
  if { [ "$TEST_TOOLS" = 1 ] || [ "$CLUSTER" = 1 ]; } && [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
    chmod 755 /usr/sbin/policy-rc.d
    NO_DAEMONS=/usr/sbin/policy-rc.d
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $missing \
    || { [ -z "$NO_DAEMONS" ] || rm -f "$NO_DAEMONS"; exit 1; }
  [ -z "$NO_DAEMONS" ] || rm -f "$NO_DAEMONS"
  # nor start at the next boot (the tests start the registry themselves)
  case "$missing" in *docker-registry*)
    systemctl disable docker-registry >/dev/null 2>&1 || true ;; esac
else
  say "Debian packages already installed"
fi

if [ ! -x .venv/bin/python ]; then
  say "creating the Python environment in .venv"
  "${PYTHON:-python3}" -m venv .venv
fi
ensure_hangar_user

say "installing Hangar and the exact Python dependencies of requirements.lock"
.venv/bin/pip install -q --disable-pip-version-check -r requirements.lock
.venv/bin/pip install -q --disable-pip-version-check --no-deps -e .
ln -sf "$ROOT/.venv/bin/hangar" /usr/local/bin/hangar
let_hangar_import "$ROOT/.venv" "$ROOT/src"

# The secret proxy (mitmproxy) pins older libraries than Hangar's own: it gets an
# environment of its own, which the server finds beside .venv (HANGAR_SECRET_PROXY_MITMDUMP).
if [ ! -x .venv-proxy/bin/python ]; then
  say "creating the secret proxy's Python environment in .venv-proxy"
  "${PYTHON:-python3}" -m venv .venv-proxy
fi
say "installing the secret proxy's exact dependencies of requirements-proxy.lock"
.venv-proxy/bin/pip install -q --disable-pip-version-check -r requirements-proxy.lock
let_hangar_import "$ROOT/.venv-proxy" "$ROOT/src"

say "fetching Firecracker and its jailer (used on hosts where KVM runs guests)"
HANGAR_DATA_DIR=$DATA PYTHON=.venv/bin/python sh scripts/fetch-firecracker.sh \
  || echo "warning: could not fetch Firecracker; Hangar will use QEMU" >&2

# Each image's template snapshot is made in the network shape its sandboxes will have:
# the test suite's servers run without guest networking, a server's TAP NIC otherwise.
if [ "$TEST_TOOLS" = 1 ]; then export HANGAR_NETWORK=off; fi
# Every image side by side, each one's lines prefixed with its name: their downloads into
# the shared .deb cache take turns (hangar.images.debian.debootstrap); the rest overlaps
# (one image's packing and template boot beside another's unpacking).
build_image() { HANGAR_DATA_DIR=$DATA .venv/bin/hangar image build "$1" 2>&1 | sed -u "s/^/[$1] /"; }
IMAGES=(base)
[ "$DESKTOP" = 1 ] && IMAGES+=(desktop)
[ "$DEV" = 1 ] && IMAGES+=(dev)
[ "$CODEINT" = 1 ] && IMAGES+=(code-interpreter)
# Side by side, and wait for them all; an argument names the log they write to.
build_images() {
  local pid failed=0 builds=()
  for name in "$@"; do build_image "$name" & builds+=($!); done
  for pid in "${builds[@]}"; do wait "$pid" || failed=1; done
  return $failed
}
if [ "$BASE_FIRST" = 1 ] && [ "${#IMAGES[@]}" -gt 1 ]; then
  # The base image first, alone: builds side by side take turns at the shared apt cache's
  # lock, and base (what the tests begin with) would wait behind the others' downloads.
  # Then the others in the background, holding an exclusive lock on images-later.lock
  # until they are all built (tests/conftest.py waits for it with a shared one; their
  # status, 0 or 1, and their lines go to images-later.status and .log).
  say "building the base guest image (cached; the first build takes several minutes)"
  build_images base || { echo "the base image build failed: see its lines above" >&2; exit 1; }
  LATER=("${IMAGES[@]:1}")
  LOCK=$DATA/images-later.lock
  mkdir -p "$DATA"
  exec 9>"$LOCK"
  flock -x 9
  rm -f "$DATA/images-later.status"
  say "building the ${LATER[*]} guest image(s) in the background (log: $DATA/images-later.log)"
  ( set +e; build_images "${LATER[@]}" > "$DATA/images-later.log" 2>&1
    echo $? > "$DATA/images-later.status" ) 9>&9 </dev/null &
  exec 9>&-
else
  say "building the ${IMAGES[*]} guest image(s) side by side (cached; the first build takes several minutes)"
  build_images "${IMAGES[@]}" || { echo "an image build failed: see its lines above" >&2; exit 1; }
fi

if [ -d /etc/logrotate.d ]; then
  sed "s#/var/log/hangar/#$RUN_DIR/#" deploy/logrotate/hangar > /etc/logrotate.d/hangar.new
  mv /etc/logrotate.d/hangar.new /etc/logrotate.d/hangar
fi

[ "$START" = 0 ] && exit 0

HEALTH_HOST=127.0.0.1
if [ "$CLUSTER" = 1 ]; then
  : "${HANGAR_NODE_NAME:?set HANGAR_NODE_NAME (the name of this node, e.g. n1)}"
  : "${HANGAR_NODE_IP:?set HANGAR_NODE_IP (the address of this host on the cluster network)}"
  : "${HANGAR_CLUSTER:?set HANGAR_CLUSTER (every node: n1=10.0.0.1,n2=10.0.0.2,n3=10.0.0.3)}"
  INITIAL=""; ETCD_URLS=""
  for member in ${HANGAR_CLUSTER//,/ }; do
    INITIAL="$INITIAL${INITIAL:+,}${member%%=*}=https://${member#*=}:2380"
    ETCD_URLS="$ETCD_URLS${ETCD_URLS:+,}https://${member#*=}:2379"
  done
  # etcd speaks TLS only, with client certificates (docs/cluster.md): the first host (the one
  # given HANGAR_STORE) makes every node's certificates; copy /etc/hangar/etcd-pki/<node>/ to
  # that host's same path before running this there.
  PKI=/etc/hangar/etcd-pki/$HANGAR_NODE_NAME
  if [ ! -f "$PKI/node.key" ]; then
    if [ -z "${HANGAR_STORE:-}" ]; then
      say "no $PKI: copy it from the first host (hangar cluster certs)"; exit 1
    fi
    .venv/bin/hangar cluster certs --nodes "$HANGAR_CLUSTER" --out /etc/hangar/etcd-pki
    say "certificates made: copy /etc/hangar/etcd-pki/<node>/ to each other host, same path"
  fi
  ETCD_OWNER=root; id etcd >/dev/null 2>&1 && ETCD_OWNER=etcd
  install -d -m 0700 -o "$ETCD_OWNER" /etc/etcd/pki
  for f in ca.crt etcd.crt etcd.key; do
    install -m 0600 -o "$ETCD_OWNER" "$PKI/$f" "/etc/etcd/pki/$f"
  done
  say "configuring this host's etcd member ${HANGAR_NODE_NAME} (peers: $INITIAL)"
  cat > /etc/default/etcd <<CONF
ETCD_NAME=$HANGAR_NODE_NAME
ETCD_DATA_DIR=/var/lib/etcd/hangar
ETCD_LISTEN_CLIENT_URLS=https://$HANGAR_NODE_IP:2379,https://127.0.0.1:2379
ETCD_ADVERTISE_CLIENT_URLS=https://$HANGAR_NODE_IP:2379
ETCD_LISTEN_PEER_URLS=https://$HANGAR_NODE_IP:2380
ETCD_INITIAL_ADVERTISE_PEER_URLS=https://$HANGAR_NODE_IP:2380
ETCD_INITIAL_CLUSTER=$INITIAL
ETCD_INITIAL_CLUSTER_STATE=new
ETCD_INITIAL_CLUSTER_TOKEN=hangar
ETCD_CLIENT_CERT_AUTH=true
ETCD_TRUSTED_CA_FILE=/etc/etcd/pki/ca.crt
ETCD_CERT_FILE=/etc/etcd/pki/etcd.crt
ETCD_KEY_FILE=/etc/etcd/pki/etcd.key
ETCD_PEER_CLIENT_CERT_AUTH=true
ETCD_PEER_TRUSTED_CA_FILE=/etc/etcd/pki/ca.crt
ETCD_PEER_CERT_FILE=/etc/etcd/pki/etcd.crt
ETCD_PEER_KEY_FILE=/etc/etcd/pki/etcd.key
ETCD_PRE_VOTE=true
CONF
  if [ -d /run/systemd/system ]; then
    systemctl enable --quiet etcd && systemctl restart etcd
  elif ! pgrep -x etcd >/dev/null; then
    set -a; . /etc/default/etcd; set +a
    setsid nohup etcd >>/var/log/etcd-hangar.log 2>&1 < /dev/null &
  fi
  say "waiting for etcd's quorum (start the other hosts' members too)"
  for _ in $(seq 240); do
    ETCDCTL_API=3 etcdctl --endpoints "$ETCD_URLS" --cacert "$PKI/ca.crt" --cert \
      "$PKI/node.crt" --key "$PKI/node.key" endpoint health >/dev/null 2>&1 && break
    sleep 1
  done
  if [ -n "${HANGAR_STORE:-}" ]; then
    .venv/bin/hangar cluster init --etcd "$ETCD_URLS" --pki "$PKI" --store "$HANGAR_STORE" \
      --key-file "$DATA/api-key" || say "the cluster exists already; its settings are kept"
  fi
  export HANGAR_ETCD=$ETCD_URLS HANGAR_ADVERTISE=$HANGAR_NODE_IP:$PORT HANGAR_HOST=$HANGAR_NODE_IP
  export HANGAR_ETCD_PKI=$PKI
  HEALTH_HOST=$HANGAR_NODE_IP
  if [ -f /etc/hangar/hangar.env ] || [ "$SERVICE" = 1 ]; then
    mkdir -p /etc/hangar
    touch /etc/hangar/hangar.env && chmod 600 /etc/hangar/hangar.env
    sed -i '/^HANGAR_\(ETCD\|ETCD_PKI\|ADVERTISE\|HOST\|NODE_NAME\)=/d' /etc/hangar/hangar.env
    printf 'HANGAR_ETCD=%s\nHANGAR_ETCD_PKI=%s\nHANGAR_ADVERTISE=%s\nHANGAR_HOST=%s\nHANGAR_NODE_NAME=%s\n' \
      "$HANGAR_ETCD" "$HANGAR_ETCD_PKI" "$HANGAR_ADVERTISE" "$HANGAR_HOST" "$HANGAR_NODE_NAME" \
      >> /etc/hangar/hangar.env
  fi
fi

if [ "$SERVICE" = 1 ]; then
  say "installing the systemd service hangar.service"
  if server_pid >/dev/null; then
    bash scripts/stop.sh  # the nohup server; its sandboxes are adopted by the service
  fi
  install -D -m 0644 deploy/hangar.service /etc/systemd/system/hangar.service
  # Firecracker's jails under the privilege split: root's folders (hangar.engines.firecracker.hostjail)
  install -d -m 0711 -o root -g root /srv/jailer
  [ -f /etc/hangar/hangar.env ] || install -D -m 0600 deploy/hangar.env /etc/hangar/hangar.env
  if [ "$DATA" != /var/lib/hangar ] || [ "$PORT" != 8080 ]; then
    mkdir -p /etc/systemd/system/hangar.service.d
    printf '[Service]\nEnvironment=HANGAR_DATA_DIR=%s HANGAR_PORT=%s\nReadWritePaths=%s\n' \
      "$DATA" "$PORT" "$DATA" > /etc/systemd/system/hangar.service.d/install.conf
  fi
  systemctl daemon-reload
  systemctl enable --quiet hangar.service
  systemctl restart hangar.service
  for _ in $(seq 240); do
    curl -fs "http://$HEALTH_HOST:$PORT/health" >/dev/null 2>&1 && break
    systemctl is-active --quiet hangar.service || { journalctl -u hangar -n 20 --no-pager; exit 1; }
    sleep 0.5
  done
elif pid=$(server_pid); then
  say "Hangar is already running (pid $pid)"
else
  say "starting Hangar on 127.0.0.1:$PORT (log: $LOGFILE)"
  HANGAR_PORT=$PORT start_server .venv/bin/hangar
  pid=$!
  for _ in $(seq 120); do
    curl -fs "http://$HEALTH_HOST:$PORT/health" >/dev/null 2>&1 && break
    running "$pid" || { tail -20 "$LOGFILE"; exit 1; }
    sleep 0.5
  done
fi
HEALTH=$(curl -fs "http://$HEALTH_HOST:$PORT/health"); echo "$HEALTH"
# Say plainly when guests run under software emulation (no usable KVM): several times slower.
if printf '%s' "$HEALTH" | grep -q '"accel":"tcg"'; then
  say "note: no usable KVM on this host: guests run under QEMU's software emulation (TCG),"
  say "several times slower than on a KVM host ('hangar status' says why; docs/performance.md)"
fi
if [ "$PORT" = 8080 ] && [ "$DATA" = /var/lib/hangar ]; then
  say "ready: try 'hangar create' (the API key is in $DATA/api-key)"
else  # clients look for the default port and folder: name this server's
  say "ready: try 'HANGAR_URL=http://127.0.0.1:$PORT HANGAR_DATA_DIR=$DATA hangar create' (the API key is in $DATA/api-key)"
fi
