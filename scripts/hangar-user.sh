# The user the HTTP server runs as, sourced by scripts/install.sh and scripts/release.sh
# (which deploy.sh ships with it): `hangar serve` started as root splits, its HTTP
# server running as `hangar` and a small root helper doing what needs root
# (docs/security.md, class 9; HANGAR_PRIVSEP=0 turns that off).

# A system user with no login and no home.
ensure_hangar_user() {
  if ! getent passwd hangar >/dev/null; then
    useradd --system --user-group --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin hangar
  fi
}

# Once dropped, the server still imports code: Hangar's sources or its venv's packages,
# and its Python's standard library. Where the user `hangar` cannot reach one of them (a
# checkout or a Python under /root), it alone gets an ACL entry: search (x) on each
# folder above that it cannot enter, read on the tree itself if needed. Nothing is
# widened for other users; the data directory is handed over by the server itself.
as_hangar() { setpriv --reuid=hangar --regid=hangar --clear-groups -- "$@"; }
let_hangar_read() {
  local target dir="" part
  target=$(readlink -f "$1")
  for part in $(echo "${target#/}" | tr / ' '); do
    dir="$dir/$part"
    [ "$dir" = "$target" ] && break
    as_hangar test -x "$dir" || acl_add -m u:hangar:x "$dir"
  done
  if [ -n "$(as_hangar find "$target" ! -readable -print -quit 2>&1)" ]; then
    acl_add -R -m u:hangar:rX "$target"
  fi
}
acl_add() {
  command -v setfacl >/dev/null || {
    echo "the user hangar cannot read ${*: -1}: install the acl package (setfacl)" >&2
    return 1
  }
  setfacl "$@"
}

# Everything the server imports, for a Python environment (a venv) and, optionally,
# a source folder on its PYTHONPATH.
let_hangar_import() {
  local venv=$1 stdlib
  stdlib=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
  for code in "$venv" "$stdlib" "${@:2}"; do
    let_hangar_read "$code"
  done
}
