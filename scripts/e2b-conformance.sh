#!/usr/bin/env bash
# E2B conformance: run E2B's own Python SDK tests, unmodified, against a real Hangar server.
#
#   scripts/e2b-conformance.sh [--urls] E2B_SOURCE [pytest options...]
#
# E2B_SOURCE is a checkout of e2b-dev/E2B, its packages/python-sdk, or that folder's tests/
# (the folder holding conftest.py and sync/). The SDK itself is not taken from it: the
# Python in $E2B_PYTHON (default python3) must have the `e2b` package of the same version
# (packages/python-sdk/package.json), pytest, pytest-asyncio, pytest-timeout and
# pytest-dotenv, as that checkout's dev group pins them. Nothing of E2B's is copied here.
#
# E2B_SOURCE may also be e2b-dev/code-interpreter's python/ folder (or a checkout holding
# it): its tests then run against the `code-interpreter` image (E2B's
# code-interpreter-v1), with the `e2b-code-interpreter` package in $E2B_PYTHON (plus
# pytest-xdist and matplotlib: its pytest.ini runs 2 workers). Its default selection is
# tests/sync; run tests/charts with `-o asyncio_mode=auto` and tests/test_execute_timeout.py
# the same way. Before the tests, one sandbox of that image is made and deleted, so that its
# template snapshot exists (the first boot takes minutes under emulation: longer than the
# tests wait for a create). docs/e2b.md has the figures.
#
# It starts a Hangar server of its own (a root server on a free port, a fresh data
# directory whose images are the host's built ones, $HANGAR_IMAGES, default
# /var/lib/hangar/images; no warm pool), makes an E2B key with `hangar key add --e2b`, runs
# tests/sync/{sandbox_sync,api_sync,volume_sync,secret_sync} (or the test paths given after
# E2B_SOURCE) with the pytest options given there (e.g. `-n 3`, `-x -k test_run`), and
# prints one JSON line:
#   {"passed": N, "failed": N, "skipped": N, "errors": N, "total": N, "e2b": "2.45.1", ...}
# (with "e2b_code_interpreter": its version for that suite)
# By default the tests see only E2B_DOMAIN and E2B_API_KEY, as SDK 2.63 and later want
# (E2B_API_URL and E2B_SANDBOX_URL deprecated): the server runs with HANGAR_DOMAIN set
# to a name of the run's own under .test, and tests/e2b_site.py puts before it a local
# CA with a wildcard certificate, a wildcard DNS server and nginx on a loopback address
# of the run's own (ports 53 and 443: root, Debian's nginx and dnspython); pytest runs in
# a mount namespace of its own (unshare) whose /etc/resolv.conf names that DNS server,
# with SSL_CERT_FILE naming the CA. Nothing of the host's changes. With --urls the tests
# see E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY instead (plain http, no site; get_host
# URLs then do not resolve).
# The per-test report (JUnit XML) is left in $E2B_CONFORMANCE_REPORT (default
# /tmp/e2b-conformance-<pid>.xml); $E2B_COMMIT names the E2B commit when E2B_SOURCE is not
# a git checkout. Afterwards, pass or fail, every sandbox is deleted, the site (nginx, DNS
# server, CA files) and the server are stopped by their pids, VMMs of the server's data
# directory are ended and the directory is removed.
# Runs the whole selection with -n 3 in 7 (quiet) to 20 minutes (load 9-17) on a 2-core host
# under emulation.
#
# Template tests (tests/sync/template_sync and the like) build FROM Docker Hub's ubuntu:22.04
# (and name ubuntu:24.04), which a host without the internet cannot fetch. When the selection
# holds a template test folder or file (E2B_REGISTRY=1: always; E2B_REGISTRY=0: never), a
# local registry stands in for Docker Hub: Debian's docker-registry on a free loopback port
# (storage in $DATA/registry), a stand-in image pushed to it (skopeo) as library/ubuntu:22.04
# and library/ubuntu:24.04, and the server started with
# HANGAR_REGISTRY_MIRRORS=docker.io=127.0.0.1:<port> and HANGAR_REGISTRY_INSECURE=<same>.
# That needs root (debootstrap; a server that pulls). The stand-in is not Ubuntu: it is
# Debian bookworm's minbase (debootstrap --variant=minbase from the host's own apt source of
# bookworm, read from /etc/apt/sources.list*, in a mount namespace of its own), less /dev's
# nodes and apt's lists and packages, as a one-layer docker-archive (tests/oci_support.py's
# docker_archive). It is kept in $E2B_STANDIN (default
# /var/cache/hangar-e2b-standin/bookworm.tar, root's) and made only when that file is
# missing (about a minute; delete it to make it again). Pulled images are built into
# $HANGAR_IMAGES as reg-ubuntu-<tag>-<hash>, like templates built there; a later run whose
# stand-in is unchanged reuses them. The registry is stopped by its pid with the server.
# tests/sync/template_sync alone (E2B 2.45.1): 75 tests in 2.5 minutes, once the stand-in is
# made (under a minute more on the first run).
set -euo pipefail

MODE=domain
if [ "${1:-}" = --urls ]; then
  MODE=urls
  shift
fi
if [ $# -lt 1 ]; then
  sed -n '2,63p' "$0" >&2
  exit 2
fi
REPO=$(cd "$(dirname "$0")/.." && pwd)
SRC_ARG=$1
shift
if [ -d "$SRC_ARG/packages/python-sdk/tests/sync" ]; then
  TESTS=$(cd "$SRC_ARG/packages/python-sdk/tests" && pwd)
elif [ -d "$SRC_ARG/python/e2b_code_interpreter" ] && [ -d "$SRC_ARG/python/tests/sync" ]; then
  TESTS=$(cd "$SRC_ARG/python/tests" && pwd)
elif [ -d "$SRC_ARG/tests/sync" ]; then
  TESTS=$(cd "$SRC_ARG/tests" && pwd)
elif [ -d "$SRC_ARG/sync" ]; then
  TESTS=$(cd "$SRC_ARG" && pwd)
else
  echo "no E2B Python SDK tests (tests/sync) under $SRC_ARG" >&2
  exit 2
fi
SDK_DIR=$(dirname "$TESTS")
SUITE=e2b
SAFE_PATH=()
if [ -d "$SDK_DIR/e2b_code_interpreter" ]; then
  # -P: the installed e2b-code-interpreter, not the checkout's copy in the working folder
  SUITE=code-interpreter SAFE_PATH=(-P)
fi
E2B_PYTHON=${E2B_PYTHON:-python3}
HANGAR_PYTHON=${HANGAR_PYTHON:-$REPO/.venv/bin/python}
IMAGES=${HANGAR_IMAGES:-/var/lib/hangar/images}
REPORT=${E2B_CONFORMANCE_REPORT:-/tmp/e2b-conformance-$$.xml}
[ -x "$HANGAR_PYTHON" ] || { echo "no Hangar Python at $HANGAR_PYTHON (HANGAR_PYTHON)" >&2; exit 2; }
[ -e "$IMAGES/base" ] || { echo "no built base image in $IMAGES (HANGAR_IMAGES)" >&2; exit 2; }
SDK_VERSION=$("$E2B_PYTHON" -c 'import importlib.metadata as m; print(m.version("e2b"))') || {
  echo "$E2B_PYTHON has no e2b package (E2B_PYTHON)" >&2; exit 2; }
CI_VERSION=
if [ "$SUITE" = code-interpreter ]; then
  CI_VERSION=$("$E2B_PYTHON" -c 'import importlib.metadata as m; print(m.version("e2b-code-interpreter"))') || {
    echo "$E2B_PYTHON has no e2b-code-interpreter package (E2B_PYTHON)" >&2; exit 2; }
  [ -e "$IMAGES/code-interpreter" ] || { echo "no built code-interpreter image in $IMAGES" >&2; exit 2; }
fi

# The four folders (tests/sync for the code interpreter's) unless a test path (a file or
# folder of SDK_DIR, or a node id) is given.
named=
for a in "$@"; do
  case "$a" in -*) ;; *) [ -e "$SDK_DIR/${a%%::*}" ] && named=1 ;; esac
done
if [ -z "$named" ] && [ "$SUITE" = code-interpreter ]; then
  set -- tests/sync "$@"
elif [ -z "$named" ]; then
  set -- tests/sync/sandbox_sync tests/sync/api_sync tests/sync/volume_sync tests/sync/secret_sync "$@"
fi

# The registry standing in for Docker Hub: for a selection with template tests, or as
# E2B_REGISTRY says.
REGISTRY=${E2B_REGISTRY:-}
if [ -z "$REGISTRY" ]; then
  REGISTRY=0
  for a in "$@"; do
    case "$a" in -*) continue ;; esac
    [ -e "$SDK_DIR/${a%%::*}" ] || continue
    [ -n "$(find "$SDK_DIR/${a%%::*}" -path '*/template_*' -name 'test_*.py' -print -quit)" ] \
      && REGISTRY=1
  done
fi
STANDIN=${E2B_STANDIN:-/var/cache/hangar-e2b-standin/bookworm.tar}
if [ "$REGISTRY" = 1 ]; then
  [ "$(id -u)" = 0 ] || {
    echo "template tests pull FROM images: run as root (or E2B_REGISTRY=0)" >&2; exit 2; }
  for t in docker-registry skopeo unshare; do
    command -v "$t" >/dev/null || {
      echo "template tests need $t (Debian's docker-registry, skopeo; or E2B_REGISTRY=0)" >&2
      exit 2; }
  done
  [ -f "$STANDIN" ] || command -v debootstrap >/dev/null || {
    echo "no stand-in image at $STANDIN and no debootstrap to make it (E2B_STANDIN)" >&2; exit 2; }
fi

DATA=$(mktemp -d /tmp/hangar-e2b-XXXXXX)
ln -s "$IMAGES" "$DATA/images"
for f in engine-probe.json firecracker-probe.json; do
  [ -f "$IMAGES/../$f" ] && cp "$IMAGES/../$f" "$DATA/$f"
done
PORT=$("$HANGAR_PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
URL=http://127.0.0.1:$PORT
export HANGAR_DATA_DIR=$DATA HANGAR_PORT=$PORT HANGAR_POOL_SIZE=0 HANGAR_PRIVSEP=0
SERVER_PID=
SITE_PID=
REGISTRY_PID=
if [ "$MODE" = domain ]; then
  [ "$(id -u)" = 0 ] || { echo "E2B_DOMAIN mode binds ports 53 and 443 and unshares mounts: run as root (or --urls)" >&2; exit 2; }
  command -v nginx >/dev/null && command -v unshare >/dev/null || {
    echo "E2B_DOMAIN mode needs Debian's nginx and unshare (or --urls)" >&2; exit 2; }
  DOMAIN=hangar-e2b-$(basename "$DATA" | sed 's/.*-//' | tr 'A-Z' 'a-z').test
  export HANGAR_DOMAIN=$DOMAIN
fi

cleanup() {
  set +e
  if [ "${E2B_CONFORMANCE_KEEP_LOG:-}" ] && [ -f "$DATA/server.log" ]; then
    cp "$DATA/server.log" "$E2B_CONFORMANCE_KEEP_LOG"
  fi
  if [ -n "$SITE_PID" ] && kill -0 "$SITE_PID" 2>/dev/null; then
    # The site ends its nginx by pid, stops its DNS server and deletes its CA files.
    kill -TERM "$SITE_PID"
    for _ in $(seq 1 150); do kill -0 "$SITE_PID" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$SITE_PID" 2>/dev/null; then
      kill -KILL "$SITE_PID"
      # Its nginx (a session of its own) by the pid nginx wrote.
      local nginx_pid
      nginx_pid=$(cat "$DATA/site/nginx/nginx.pid" 2>/dev/null)
      [ -n "$nginx_pid" ] && kill -TERM "$nginx_pid" 2>/dev/null
    fi
    wait "$SITE_PID" 2>/dev/null
  fi
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    local key
    key=$(cat "$DATA/api-key" 2>/dev/null)
    "$HANGAR_PYTHON" - "$URL" "$key" <<'EOF'
import sys, httpx
url, key = sys.argv[1], sys.argv[2]
try:
    with httpx.Client(base_url=url, headers={"X-API-Key": key}, timeout=120) as c:
        for sb in c.get("/sandboxes").json().get("sandboxes", []):
            c.delete(f"/sandboxes/{sb['id']}")
except httpx.TransportError:
    pass  # not listening yet, or gone: nothing was made through it
EOF
    kill -TERM "$SERVER_PID"
    for _ in $(seq 1 150); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$SERVER_PID" 2>/dev/null && kill -KILL "$SERVER_PID"
    wait "$SERVER_PID" 2>/dev/null
  fi
  if [ -n "$REGISTRY_PID" ] && kill -0 "$REGISTRY_PID" 2>/dev/null; then
    kill -TERM "$REGISTRY_PID"
    for _ in $(seq 1 100); do kill -0 "$REGISTRY_PID" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$REGISTRY_PID" 2>/dev/null && kill -KILL "$REGISTRY_PID"
    wait "$REGISTRY_PID" 2>/dev/null
  fi
  # VMMs the server left behind: only those of this run's data directory.
  for p in /proc/[0-9]*; do
    { tr '\0' ' ' <"$p/cmdline"; } 2>/dev/null \
      | grep -qE "^[^ ]*(qemu-system|firecracker)[^ ]* .*$DATA" && kill -KILL "${p#/proc/}" 2>/dev/null
  done
  # never through a mount (debootstrap's are in a namespace of its own, gone with it)
  if grep -q " $DATA/" /proc/self/mountinfo; then
    echo "mounts left under $DATA: not removed" >&2
  else
    rm -rf "$DATA"
  fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

standin() {
  # The stand-in image, made once into $STANDIN (see the header).
  local mirror tree
  mirror=$("$HANGAR_PYTHON" - bookworm <<'EOF'
import glob, re, sys
suite = sys.argv[1]
def sources():
    """(URI, suites) of each deb source: one-line *.list entries, then deb822 *.sources."""
    for path in ["/etc/apt/sources.list", *sorted(glob.glob("/etc/apt/sources.list.d/*.list"))]:
        try:
            lines = open(path).read().splitlines()
        except OSError:
            continue
        for ln in lines:
            w = re.sub(r"\[[^]]*\]", " ", ln.split("#", 1)[0]).split()
            if len(w) >= 3 and w[0] == "deb":
                yield w[1], [w[2]]
    for path in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):
        try:
            text = open(path).read()
        except OSError:
            continue
        for para in re.split(r"\n\s*\n", text):
            f = {}
            for ln in para.splitlines():
                if ln and not ln.startswith(("#", " ", "\t")) and ":" in ln:
                    k, v = ln.split(":", 1)
                    f[k.strip().lower()] = v.split()
            if "deb" in f.get("types", []) and f.get("enabled", ["yes"]) != ["no"]:
                for uri in f.get("uris", []):
                    yield uri, f.get("suites", [])
uri = next((u for u, suites in sources() if suite in suites), None)
if uri is None:
    sys.exit(f"no apt source of suite {suite} in /etc/apt/sources.list*")
print(uri)
EOF
  ) || return 1
  tree=$DATA/standin/root
  mkdir -p "$DATA/standin"
  echo "making the stand-in image (debootstrap --variant=minbase bookworm from $mirror)" >&2
  unshare --mount --propagation private -- debootstrap --variant=minbase bookworm \
    "$tree" "$mirror" >"$DATA/standin/debootstrap.log" 2>&1 || {
    tail -20 "$DATA/standin/debootstrap.log" >&2; return 1; }
  for f in usr/bin/bash usr/bin/setpriv etc/skel/.bashrc; do
    [ -e "$tree/$f" ] || { echo "the stand-in has no /$f" >&2; return 1; }
  done
  grep -q " $tree/" /proc/self/mountinfo && { echo "mounts left under $tree" >&2; return 1; }
  # as Docker Hub's images are: no device nodes, no apt lists or downloaded packages
  find "$tree/dev" "$tree/var/lib/apt/lists" "$tree/var/cache/apt" -xdev -mindepth 1 \
    \( -type f -o -type l -o -type c -o -type b -o -type p \) -delete || return 1
  install -d -m 0700 "$(dirname "$STANDIN")" || return 1
  "$HANGAR_PYTHON" - "$REPO/tests" "$tree" "$STANDIN.tmp-$$" <<'EOF' || return 1
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from oci_support import docker_archive
docker_archive(Path(sys.argv[2]), Path(sys.argv[3]), cmd=["/bin/bash"],
               env=["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"])
EOF
  mv "$STANDIN.tmp-$$" "$STANDIN" || return 1
  rm -rf "$DATA/standin"
}

if [ "$REGISTRY" = 1 ]; then
  [ -f "$STANDIN" ] || standin || {
    rm -f "$STANDIN.tmp-$$"; echo "the stand-in image was not made" >&2; exit 1; }
  REG=127.0.0.1:$("$HANGAR_PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  mkdir -p "$DATA/registry"
  cat >"$DATA/registry/config.yml" <<EOF
version: 0.1
log:
  level: error
storage:
  filesystem:
    rootdirectory: $DATA/registry/data
http:
  addr: $REG
EOF
  docker-registry serve "$DATA/registry/config.yml" >"$DATA/registry/registry.log" 2>&1 &
  REGISTRY_PID=$!
  for _ in $(seq 1 150); do
    kill -0 "$REGISTRY_PID" 2>/dev/null || { tail -20 "$DATA/registry/registry.log" >&2; exit 1; }
    curl -fs "http://$REG/v2/" >/dev/null 2>&1 && break
    sleep 0.2
  done
  curl -fs "http://$REG/v2/" >/dev/null || { echo "the registry did not start" >&2; exit 1; }
  skopeo --insecure-policy copy --quiet --dest-tls-verify=false \
    "docker-archive:$STANDIN" "docker://$REG/library/ubuntu:22.04" >&2
  skopeo --insecure-policy copy --quiet --src-tls-verify=false --dest-tls-verify=false \
    "docker://$REG/library/ubuntu:22.04" "docker://$REG/library/ubuntu:24.04" >&2
  export HANGAR_REGISTRY_MIRRORS=docker.io=$REG HANGAR_REGISTRY_INSECURE=$REG
fi

PYTHONPATH=$REPO/src "$HANGAR_PYTHON" -m hangar.cli serve >"$DATA/server.log" 2>&1 &
SERVER_PID=$!
for _ in $(seq 1 300); do
  kill -0 "$SERVER_PID" 2>/dev/null || { tail -30 "$DATA/server.log" >&2; exit 1; }
  curl -fs "$URL/health" >/dev/null 2>&1 && break
  sleep 0.2
done
curl -fs "$URL/health" >/dev/null || { echo "server did not start" >&2; tail -30 "$DATA/server.log" >&2; exit 1; }
KEY=$(PYTHONPATH=$REPO/src "$HANGAR_PYTHON" -m hangar.cli key add "e2b-conformance" --e2b)
if [ "$MODE" = domain ]; then
  PYTHONPATH=$REPO/src "$HANGAR_PYTHON" "$REPO/tests/e2b_site.py" --domain "$DOMAIN" \
    --upstream "127.0.0.1:$PORT" --folder "$DATA/site" --ready "$DATA/site.json" \
    >"$DATA/site.log" 2>&1 &
  SITE_PID=$!
  for _ in $(seq 1 300); do
    [ -f "$DATA/site.json" ] && break
    kill -0 "$SITE_PID" 2>/dev/null || { tail -30 "$DATA/site.log" >&2; exit 1; }
    sleep 0.2
  done
  [ -f "$DATA/site.json" ] || { echo "the E2B_DOMAIN site did not start" >&2; exit 1; }
  read -r CA RESOLV < <("$HANGAR_PYTHON" -c 'import json, sys; d = json.load(open(sys.argv[1])); print(d["ca"], d["resolv"])' "$DATA/site.json")
fi

if [ "$SUITE" = code-interpreter ]; then
  # the template's first boot, before the tests: they wait at most a minute for a create
  "$HANGAR_PYTHON" - "$URL" "$(cat "$DATA/api-key")" <<'EOF' || { echo "the code-interpreter template did not start" >&2; exit 1; }
import sys, httpx
url, key = sys.argv[1], sys.argv[2]
with httpx.Client(base_url=url, headers={"X-API-Key": key}, timeout=1800) as c:
    r = c.post("/sandboxes", json={"image": "code-interpreter"})
    r.raise_for_status()
    c.delete(f"/sandboxes/{r.json()['id']}").raise_for_status()
EOF
fi
rc=0
(
  cd "$SDK_DIR"
  unset E2B_API_URL E2B_SANDBOX_URL E2B_DOMAIN E2B_DEBUG PYTHONPATH
  unset http_proxy https_proxy all_proxy no_proxy HTTP_PROXY HTTPS_PROXY ALL_PROXY NO_PROXY
  PYTEST=("$E2B_PYTHON" "${SAFE_PATH[@]}" -m pytest -p no:cacheprovider -q -rfE --junitxml="$REPORT" "$@")
  if [ "$MODE" = domain ]; then
    # A mount namespace of pytest's own whose /etc/resolv.conf names the site's DNS.
    E2B_DOMAIN=$DOMAIN E2B_API_KEY=$KEY SSL_CERT_FILE=$CA NODE_EXTRA_CA_CERTS=$CA \
      unshare --mount --propagation private -- sh -c \
      'mount --bind "$0" /etc/resolv.conf && exec "$@"' "$RESOLV" "${PYTEST[@]}"
  else
    E2B_API_URL="$URL/e2b" E2B_SANDBOX_URL="$URL/e2b/envd" E2B_API_KEY="$KEY" "${PYTEST[@]}"
  fi
) >&2 || rc=$?
[ -f "$REPORT" ] || { echo "pytest wrote no report (exit $rc)" >&2; exit 1; }
"$HANGAR_PYTHON" - "$REPORT" "$SDK_VERSION" "$SDK_DIR" "$MODE" "$CI_VERSION" <<'EOF'
import json, os, subprocess, sys, xml.etree.ElementTree as ET
report, version, sdk_dir, mode, ci_version = sys.argv[1:6]
counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
for case in ET.parse(report).getroot().iter("testcase"):
    kinds = {child.tag for child in case}
    if "failure" in kinds:
        counts["failed"] += 1
    elif "error" in kinds:
        counts["errors"] += 1
    elif "skipped" in kinds:
        counts["skipped"] += 1
    else:
        counts["passed"] += 1
commit = os.environ.get("E2B_COMMIT") or subprocess.run(
    ["git", "-C", sdk_dir, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or None
extra = {"e2b_code_interpreter": ci_version} if ci_version else {}
print(json.dumps({**counts, "total": sum(counts.values()), "e2b": version, **extra,
                  "commit": commit, "mode": mode, "report": report}))
EOF
exit $([ "$rc" -le 1 ] && echo 0 || echo "$rc")
