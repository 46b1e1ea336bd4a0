#!/usr/bin/env bash
# Prepare a fresh Debian 12 or Ubuntu 24.04 KVM host for Hangar, idempotently:
# a second run changes nothing. Run it as root from a checkout (it installs files
# from deploy/ and renders the nginx site with src/).
#
#   scripts/provision-host.sh [options]
#     --dry-run         print the plan, change nothing
#     --domain NAME     also set up https://NAME: nginx site (hangar deploy nginx),
#                       and with --email a Let's Encrypt certificate (certbot, webroot)
#     --email ADDR      the Let's Encrypt account's address (needs --domain)
#     --e2b-domain NAME also serve E2B's SDKs configured with E2B_DOMAIN=NAME alone
#                       (needs --domain): HANGAR_DOMAIN=NAME in hangar.env, and the
#                       nginx site for api.NAME and <port>-<id>.NAME with a wildcard
#                       certificate for *.NAME: yours (--e2b-cert, --e2b-key), or
#                       Let's Encrypt's by a DNS-01 challenge (--email with
#                       --dns-plugin and --dns-credentials). Wildcard DNS
#                       (*.NAME and NAME -> this host) is yours to add
#     --e2b-cert FILE, --e2b-key FILE   a certificate chain and key for *.NAME
#     --dns-plugin NAME certbot's DNS plugin (e.g. cloudflare: package
#                       python3-certbot-dns-cloudflare), --dns-credentials FILE its file
#     --no-deploy       do not install Hangar itself (scripts/deploy.sh local) when
#                       no release is installed yet
#     --root DIR        write every file under DIR instead of /, and leave the running
#                       system alone (packages, modules, sysctls, services): for
#                       building an image of a host, and for tests
#
# Steps: the OS; KVM (/dev/kvm) and the kvm, tun and vhost_vsock modules, loaded now
# and at boot; packages; net.ipv4.ip_forward and fs.protected_hardlinks now and at
# boot; nftables enabled at boot; the guests' bridge (Hangar's own, made at each start); the data folder;
# /etc/hangar/hangar.env; the systemd unit, enabled; logrotate; nginx and the
# certificate; Hangar itself. Each line says ok, changed, would (--dry-run) or skip.
# `hangar doctor` prints the same items as a checklist.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
DRY=0 ROOT=/ DOMAIN="" EMAIL="" DEPLOY=1
E2B_DOMAIN="" E2B_CERT="" E2B_KEY="" DNS_PLUGIN="" DNS_CREDENTIALS=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1; shift ;;
    --root) ROOT=$(realpath -m "$2"); shift 2 ;;
    --domain) DOMAIN=$2; shift 2 ;;
    --email) EMAIL=$2; shift 2 ;;
    --no-deploy) DEPLOY=0; shift ;;
    --e2b-domain) E2B_DOMAIN=$2; shift 2 ;;
    --e2b-cert) E2B_CERT=$2; shift 2 ;;
    --e2b-key) E2B_KEY=$2; shift 2 ;;
    --dns-plugin) DNS_PLUGIN=$2; shift 2 ;;
    --dns-credentials) DNS_CREDENTIALS=$2; shift 2 ;;
    -h|--help) sed -n '2,32p' "$0"; exit 0 ;;
    *) echo "provision-host.sh: unknown option $1" >&2; exit 1 ;;
  esac
done
[ -z "$EMAIL" ] || [ -n "$DOMAIN" ] || { echo "provision-host.sh: --email needs --domain" >&2; exit 1; }
if [ -n "$DOMAIN" ] && ! printf '%s' "$DOMAIN" | grep -Eq '^[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$'; then
  echo "provision-host.sh: not a host name: $DOMAIN" >&2; exit 1
fi
if [ -n "$E2B_DOMAIN" ]; then
  [ -n "$DOMAIN" ] || { echo "provision-host.sh: --e2b-domain needs --domain" >&2; exit 1; }
  printf '%s' "$E2B_DOMAIN" | grep -Eq '^[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$' \
    || { echo "provision-host.sh: not a host name: $E2B_DOMAIN" >&2; exit 1; }
  { [ -n "$E2B_CERT" ] && [ -n "$E2B_KEY" ]; } || { [ -z "$E2B_CERT" ] && [ -z "$E2B_KEY" ]; } \
    || { echo "provision-host.sh: give --e2b-cert and --e2b-key together" >&2; exit 1; }
  { [ -n "$DNS_PLUGIN" ] && [ -n "$DNS_CREDENTIALS" ]; } || { [ -z "$DNS_PLUGIN" ] && [ -z "$DNS_CREDENTIALS" ]; } \
    || { echo "provision-host.sh: give --dns-plugin and --dns-credentials together" >&2; exit 1; }
  [ -z "$DNS_PLUGIN" ] || printf '%s' "$DNS_PLUGIN" | grep -Eq '^[a-z0-9-]{1,40}$' \
    || { echo "provision-host.sh: not a certbot DNS plugin name: $DNS_PLUGIN" >&2; exit 1; }
elif [ -n "$E2B_CERT$E2B_KEY$DNS_PLUGIN$DNS_CREDENTIALS" ]; then
  echo "provision-host.sh: --e2b-cert, --e2b-key, --dns-plugin and --dns-credentials need --e2b-domain" >&2; exit 1
fi
[ "$(id -u)" = 0 ] || { echo "provision-host.sh: run as root" >&2; exit 1; }
LIVE=1; [ "$ROOT" = / ] || LIVE=0
R=${ROOT%/}   # prefix for paths: "" for /
DATA=/var/lib/hangar
UNIT_DIR=/etc/systemd/system
SYSTEMD=0; [ -d /run/systemd/system ] && SYSTEMD=1
CHANGES=0

step() { printf '\n\033[1m%s\033[0m\n' "$*"; }
ok() { printf '  [ok] %s\n' "$*"; }
skip() { printf '  [skip] %s\n' "$*"; }
warn() { printf '  [warn] %s\n' "$*"; }
act() {  # act DESCRIPTION COMMAND...: make one change (or, with --dry-run, say it)
  local what=$1; shift
  CHANGES=$((CHANGES + 1))
  if [ "$DRY" = 1 ]; then printf '  [would] %s\n' "$what"; return 0; fi
  "$@"
  printf '  [changed] %s\n' "$what"
}
live() {  # live DESCRIPTION COMMAND...: a change to the running system, not under --root
  if [ "$LIVE" = 0 ]; then skip "$1 (--root: the running system is left alone)"; return 0; fi
  act "$@"
}
put_file() {  # put_file DEST MODE SOURCE DESCRIPTION: DEST gets SOURCE's content and MODE
  local dest=$R$1 mode=$2 src=$3 what=$4
  if [ -f "$dest" ] && cmp -s "$src" "$dest" && [ "$(stat -c %a "$dest")" = "${mode#0}" ]; then
    ok "$1 ($what)"
  else
    act "write $1 ($what)" install -D -m "$mode" "$src" "$dest"
  fi
}
put_text() {  # put_text DEST MODE DESCRIPTION <<< content
  local tmp; tmp=$(mktemp); cat > "$tmp"
  put_file "$1" "$2" "$tmp" "$3"
  rm -f "$tmp"
}
put_link() {  # put_link LINK TARGET DESCRIPTION
  local link=$R$1
  if [ -L "$link" ] && [ "$(readlink "$link")" = "$2" ]; then
    ok "$1 -> $2 ($3)"
  else
    act "link $1 -> $2 ($3)" sh -c 'mkdir -p "$(dirname "$1")" && ln -sfn "$2" "$1"' sh "$link" "$2"
  fi
}
put_dir() {  # put_dir DIR MODE DESCRIPTION
  if [ -d "$R$1" ] && [ "$(stat -c %a "$R$1")" = "${2#0}" ]; then
    ok "$1 ($3)"
  else
    act "make $1 ($3)" install -d -m "$2" "$R$1"
  fi
}
env_value() {  # env_value KEY DEFAULT: KEY's value in /etc/hangar/hangar.env
  local v
  v=$(sed -n "s/^$1=//p" "$R/etc/hangar/hangar.env" 2>/dev/null | tail -1)
  echo "${v:-$2}"
}
have_pkg() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }

[ "$DRY" = 1 ] && echo "Plan for this host (--dry-run: nothing is changed):"
[ "$LIVE" = 0 ] && echo "Files go under $ROOT; the running system is left alone."

# -- the OS ---------------------------------------------------------------------
step "Operating system"
. /etc/os-release
case "$ID:$VERSION_ID" in
  debian:12 | ubuntu:24.04) ok "$PRETTY_NAME" ;;
  *) warn "$PRETTY_NAME: tested on Debian 12 and Ubuntu 24.04 only; going on" ;;
esac
[ "$(uname -m)" = x86_64 ] && ok "x86_64" || warn "$(uname -m): Hangar's images and VMMs are x86_64"

# -- KVM and kernel modules -------------------------------------------------------
step "KVM and kernel modules (kvm, tun, vhost_vsock)"
KVM_MOD=kvm_intel
grep -qw svm /proc/cpuinfo && KVM_MOD=kvm_amd
MODULES="kvm $KVM_MOD tun vhost_vsock"
CAN_LOAD=1
if [ ! -e /proc/modules ]; then
  CAN_LOAD=0
  skip "this kernel cannot load modules (no /proc/modules): its drivers are built in or absent"
fi
for m in $MODULES; do
  if [ -d "/sys/module/$m" ]; then
    ok "module $m is loaded"
  elif [ "$CAN_LOAD" = 1 ]; then
    live "load module $m" modprobe "$m"
  fi
done
if [ -r /dev/kvm ] && [ -w /dev/kvm ]; then
  ok "/dev/kvm opens read-write"
else
  warn "/dev/kvm is not usable: enable VT-x/AMD-V (or nested virtualization); guests will run under TCG, many times slower"
fi
[ -e /dev/net/tun ] && ok "/dev/net/tun exists" || warn "/dev/net/tun is missing: guests get no TAP NIC"
[ -e /dev/vhost-vsock ] && ok "/dev/vhost-vsock exists" \
  || warn "/dev/vhost-vsock is missing: Firecracker cannot run here (QEMU can)"
printf '%s\n' "# Loaded at boot for Hangar (scripts/provision-host.sh)." $MODULES \
  | put_text /etc/modules-load.d/hangar.conf 0644 "modules at boot"

# -- packages -------------------------------------------------------------------
step "Packages"
PKGS="qemu-system-x86 qemu-utils debootstrap e2fsprogs busybox-static cpio kmod zstd xz-utils lz4
      curl ca-certificates openssl nftables iproute2 novnc python3 python3-venv acl logrotate nginx
      skopeo umoci patchelf daemontools"
[ -n "$EMAIL" ] && PKGS="$PKGS certbot"
[ -n "$EMAIL" ] && [ -n "$DNS_PLUGIN" ] && PKGS="$PKGS python3-certbot-dns-$DNS_PLUGIN"
missing=""
for p in $PKGS; do have_pkg "$p" || missing="$missing $p"; done
if [ -z "$missing" ]; then
  ok "installed: $(echo $PKGS)"
else
  live "install$missing" sh -c "apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends$missing"
fi

# -- forwarding -------------------------------------------------------------------
step "IP forwarding (guests' NAT)"
printf '%s\n' "# Guests reach the network through NAT on this host (Hangar)." "net.ipv4.ip_forward = 1" \
  "# Root acts in folders the server and VMMs write: no hard links to others' files (Hangar)." \
  "fs.protected_hardlinks = 1" \
  | put_text /etc/sysctl.d/60-hangar.conf 0644 "forwarding and hard-link protection at boot"
if [ "$(cat /proc/sys/net/ipv4/ip_forward)" = 1 ]; then
  ok "net.ipv4.ip_forward is 1 now"
else
  live "set net.ipv4.ip_forward = 1 now" sysctl -q -w net.ipv4.ip_forward=1
fi
if [ "$(cat /proc/sys/fs/protected_hardlinks)" = 1 ]; then
  ok "fs.protected_hardlinks is 1 now"
else
  live "set fs.protected_hardlinks = 1 now" sysctl -q -w fs.protected_hardlinks=1
fi

# -- nftables -------------------------------------------------------------------
step "nftables"
command -v nft >/dev/null && ok "nft $(nft --version | awk '{print $2}')" || warn "nft is missing (package nftables)"
# Enabled at boot, not started now: nftables.service begins with "flush ruleset",
# which would drop the rules of a running Hangar (the unit starts after it at boot).
put_link "$UNIT_DIR/sysinit.target.wants/nftables.service" /lib/systemd/system/nftables.service \
  "nftables at boot"

# -- the bridge -------------------------------------------------------------------
step "The guests' bridge"
BRIDGE=$(env_value HANGAR_NET_BRIDGE hgbr0)
ok "$BRIDGE is Hangar's: each start makes it with its address, sysctls and nftables tables, so it is back after every boot once the service is enabled (below)"
if command -v NetworkManager >/dev/null || [ -d "$R/etc/NetworkManager" ]; then
  printf '%s\n' "# Hangar owns its bridge and TAP devices." "[keyfile]" \
    "unmanaged-devices=interface-name:$BRIDGE;interface-name:hgt*" \
    | put_text /etc/NetworkManager/conf.d/90-hangar.conf 0644 "NetworkManager leaves them alone"
fi
[ -d "/sys/class/net/$BRIDGE" ] && ok "$BRIDGE exists now" || ok "$BRIDGE does not exist yet (made when Hangar starts)"

# -- data, settings, service ------------------------------------------------------
step "Data folder, settings and the service"
ok "the service runs as root, without a user of its own (deploy/hangar.service says why)"
put_dir "$DATA" 0700 "the data folder"
if [ -f "$R/etc/hangar/hangar.env" ]; then
  ok "/etc/hangar/hangar.env exists (never overwritten)"
else
  act "write /etc/hangar/hangar.env (settings, mode 0600)" install -D -m 0600 deploy/hangar.env "$R/etc/hangar/hangar.env"
fi
UNIT_BEFORE=$(cat "$R$UNIT_DIR/hangar.service" 2>/dev/null || true)
put_file "$UNIT_DIR/hangar.service" 0644 deploy/hangar.service "the systemd unit"
put_link "$UNIT_DIR/multi-user.target.wants/hangar.service" "$UNIT_DIR/hangar.service" "Hangar at boot"
if [ "$SYSTEMD" = 1 ] && [ "$(cat "$R$UNIT_DIR/hangar.service" 2>/dev/null || true)" != "$UNIT_BEFORE" ]; then
  live "reload systemd's units" systemctl daemon-reload
fi
if [ -n "$E2B_DOMAIN" ]; then
  if [ "$(env_value HANGAR_DOMAIN "")" = "$E2B_DOMAIN" ]; then
    ok "HANGAR_DOMAIN=$E2B_DOMAIN in /etc/hangar/hangar.env (E2B's api.$E2B_DOMAIN and sandbox hosts)"
  else
    act "set HANGAR_DOMAIN=$E2B_DOMAIN in /etc/hangar/hangar.env (E2B's api.$E2B_DOMAIN and sandbox hosts)" \
      sh -c 'sed -i "/^HANGAR_DOMAIN=/d" "$1" && echo "HANGAR_DOMAIN=$2" >> "$1"' sh \
      "$R/etc/hangar/hangar.env" "$E2B_DOMAIN"
    if [ "$SYSTEMD" = 1 ]; then
      live "restart Hangar if it runs (it reads HANGAR_DOMAIN at start)" systemctl try-restart hangar.service
    fi
  fi
fi
sed "s#/var/log/hangar/#${HANGAR_RUN_DIR:-/var/log/hangar}/#" deploy/logrotate/hangar | put_text /etc/logrotate.d/hangar 0644 "file log rotation"

# -- nginx and the certificate ----------------------------------------------------
step "nginx and TLS"
if [ -z "$DOMAIN" ]; then
  skip "no --domain: Hangar stays on 127.0.0.1 (run again with --domain NAME for https://NAME)"
else
  CERT=/etc/letsencrypt/live/$DOMAIN/fullchain.pem
  put_dir /var/www/html 0755 "served for Let's Encrypt's challenges"
  if [ -f "$R$CERT" ]; then
    ok "certificate $CERT"
  elif [ -n "$EMAIL" ]; then
    # Debian's default site answers on port 80 from /var/www/html until ours exists.
    live "get a Let's Encrypt certificate for $DOMAIN (certbot, webroot)" \
      certbot certonly --webroot -w /var/www/html -d "$DOMAIN" -m "$EMAIL" --agree-tos -n \
      --deploy-hook "systemctl reload nginx"
  else
    warn "no certificate at $CERT: run again with --email ADDR, or put yours there"
  fi
  E2B_READY=1
  if [ -n "$E2B_DOMAIN" ]; then
    # A wildcard certificate needs a DNS-01 challenge: certbot's DNS plugin for your DNS host.
    if [ -z "$E2B_CERT" ]; then
      E2B_CERT=/etc/letsencrypt/live/$E2B_DOMAIN/fullchain.pem
      E2B_KEY=/etc/letsencrypt/live/$E2B_DOMAIN/privkey.pem
      if [ -f "$R$E2B_CERT" ]; then
        ok "certificate $E2B_CERT (*.$E2B_DOMAIN)"
      elif [ -n "$EMAIL" ] && [ -n "$DNS_PLUGIN" ]; then
        live "get a Let's Encrypt certificate for *.$E2B_DOMAIN and $E2B_DOMAIN (certbot, DNS-01 by $DNS_PLUGIN)" \
          certbot certonly "--dns-$DNS_PLUGIN" "--dns-$DNS_PLUGIN-credentials" "$DNS_CREDENTIALS" \
          -d "*.$E2B_DOMAIN" -d "$E2B_DOMAIN" --cert-name "$E2B_DOMAIN" -m "$EMAIL" --agree-tos -n \
          --deploy-hook "systemctl reload nginx"
      else
        warn "no certificate at $E2B_CERT: run again with --email, --dns-plugin and --dns-credentials, or give yours (--e2b-cert, --e2b-key)"
      fi
    elif [ -f "$E2B_CERT" ] && [ -f "$E2B_KEY" ]; then
      ok "certificate $E2B_CERT (*.$E2B_DOMAIN, yours)"
    else
      warn "$E2B_CERT or $E2B_KEY does not exist"
    fi
    [ -f "$R$E2B_CERT" ] || [ -f "$E2B_CERT" ] || E2B_READY=0
    if [ "$LIVE" = 1 ] && command -v getent >/dev/null; then
      if getent ahostsv4 "api.$E2B_DOMAIN" >/dev/null; then
        ok "api.$E2B_DOMAIN resolves ($(getent ahostsv4 "api.$E2B_DOMAIN" | awk 'NR==1{print $1}'))"
      else
        warn "api.$E2B_DOMAIN does not resolve: add DNS records *.$E2B_DOMAIN and $E2B_DOMAIN naming this host"
      fi
    fi
  fi
  if { [ ! -f "$R$CERT" ] || [ "$E2B_READY" = 0 ]; } && [ "$LIVE" = 1 ] && [ "$DRY" = 0 ]; then
    # An enabled site without its certificate would stop every nginx reload.
    skip "the site for $DOMAIN waits for its certificates: run again once $CERT${E2B_DOMAIN:+ and $E2B_CERT} exist"
  else
    SITE_TMP=$(mktemp)
    HOST=$(env_value HANGAR_HOST 127.0.0.1); PORT=$(env_value HANGAR_PORT 8080)
    case "$HOST" in 0.0.0.0 | "::") HOST=127.0.0.1 ;; esac
    PYTHONPATH="$REPO/src" python3 -c '
import sys
from pathlib import Path
from hangar.ops.nginx import Site, render
domain, upstream, limit, out, e2b, e2b_cert, e2b_key = sys.argv[1:]
Path(out).write_text(render(Site(domain=domain, upstream=upstream, max_json_bytes=int(limit),
                                 e2b_domain=e2b, e2b_certificate=e2b_cert,
                                 e2b_certificate_key=e2b_key)))
' "$DOMAIN" "$HOST:$PORT" "$(env_value HANGAR_MAX_JSON_BYTES 8388608)" "$SITE_TMP" \
      "$E2B_DOMAIN" "$E2B_CERT" "$E2B_KEY"
    SITE_BEFORE=$(cat "$R/etc/nginx/sites-available/hangar" 2>/dev/null || true)
    put_file /etc/nginx/sites-available/hangar 0644 "$SITE_TMP" "the site for https://$DOMAIN${E2B_DOMAIN:+ and *.$E2B_DOMAIN} (hangar deploy nginx)"
    rm -f "$SITE_TMP"
    put_link /etc/nginx/sites-enabled/hangar /etc/nginx/sites-available/hangar "site enabled"
    if [ "$LIVE" = 1 ] && [ "$DRY" = 0 ] \
       && [ "$(cat /etc/nginx/sites-available/hangar)" != "$SITE_BEFORE" ]; then
      if nginx -t -q; then
        live "reload nginx" systemctl reload-or-restart nginx
      else
        warn "nginx -t refuses the configuration; nginx was not reloaded"
      fi
    fi
  fi
fi

# -- Hangar itself ----------------------------------------------------------------
step "Hangar"
if [ -L "$R/opt/hangar/current" ]; then
  ok "release $(basename "$(readlink "$R/opt/hangar/current")") is installed (update: scripts/deploy.sh)"
elif [ -e "$R/usr/local/bin/hangar" ]; then
  ok "/usr/local/bin/hangar runs $(readlink -f "$R/usr/local/bin/hangar") (scripts/install.sh)"
elif [ "$DEPLOY" = 0 ]; then
  skip "--no-deploy: install it with scripts/deploy.sh"
else
  live "install Hangar from this checkout and start it (scripts/deploy.sh local)" bash scripts/deploy.sh local
fi

echo
if [ "$CHANGES" = 1 ]; then NOUN=change; else NOUN=changes; fi
if [ "$DRY" = 1 ]; then
  echo "$CHANGES $NOUN planned."
else
  echo "$CHANGES $NOUN made."
  if [ "$LIVE" = 1 ] && command -v hangar >/dev/null; then echo "Check the host: hangar doctor"; fi
fi
exit 0
