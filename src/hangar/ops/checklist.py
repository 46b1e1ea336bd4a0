"""Is this host ready to run Hangar as a service? A checklist, item by item.

``host_checklist`` looks at the host (read-only: it changes nothing) and
returns one ``Check`` per item, each with the fix when it is not ready.
``hangar doctor`` prints it after the engine report; scripts/provision-host.sh
makes every item ready. The items:

==============  ===========================================================
kvm             /dev/kvm opens read-write (else guests run under TCG)
tun             /dev/net/tun opens (TAP devices for guest NICs)
vhost_vsock     /dev/vhost-vsock exists (Firecracker's vsock)
modules         kvm, tun and vhost_vsock are loaded at boot (modules-load.d)
ip_forward      net.ipv4.ip_forward is 1 now and in sysctl.d
hardlinks       fs.protected_hardlinks is 1 (a split server and confined VMMs write
                folders that root acts in)
nftables        the nft command, and nftables.service enabled at boot
bridge          the guests' bridge exists (Hangar makes it when it starts)
data_dir        the data directory exists, mode 0700, with free space
image           the default guest image is built
service         the systemd unit is installed, enabled and running
secret_proxy    the secret proxy's mitmdump (.venv-proxy) is installed
server          /health answers at HANGAR_HOST:HANGAR_PORT
nginx           a site rendered by ``hangar deploy nginx`` is enabled
certificate     that site's certificate exists and is not about to expire
logrotate       the file log rotates (hosts without systemd)
==============  ===========================================================

``root`` prefixes every configuration file looked at (/etc/...), so that a
tree made by ``provision-host.sh --root DIR`` can be checked; devices,
sysctls and the network are always the running host's.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hangar.layout import ImagePaths, Layout

OK, NOT_READY, NOT_APPLICABLE = "ok", "not ready", "n/a"
MODULES = ("kvm", "tun", "vhost_vsock")
MODULES_FILE = "etc/modules-load.d/hangar.conf"
SYSCTL_FILE = "etc/sysctl.d/60-hangar.conf"
UNIT_FILE = "etc/systemd/system/hangar.service"
ENV_FILE = "etc/hangar/hangar.env"
LOGROTATE_FILE = "etc/logrotate.d/hangar"


def nohup_log() -> Path:
    """The log of a server started without systemd (scripts/nohup-server.sh): in
    ``HANGAR_RUN_DIR`` (default /var/log/hangar), a folder of root's, never the data
    directory (the split server's)."""
    return Path(os.environ.get("HANGAR_RUN_DIR") or "/var/log/hangar") / "hangar.log"
SITE_MARK = "Rendered by `hangar deploy nginx"
MIN_FREE_BYTES = 20 << 30
CERT_DAYS = 14
PROTECTED_HARDLINKS = Path("/proc/sys/fs/protected_hardlinks")
"""The kernel's hard-link protection (1, the default): no hard link to a file one cannot
write."""
PROVISION = "scripts/provision-host.sh"


@dataclass(frozen=True)
class Check:
    """One item: ``status`` is ``ok``, ``not ready`` or ``n/a``; ``fix`` says what to do."""

    name: str
    status: str
    detail: str
    fix: str = ""

    @property
    def ready(self) -> bool:
        return self.status != NOT_READY

    def lines(self) -> list[str]:
        mark = {OK: "ok", NOT_READY: "!!", NOT_APPLICABLE: "--"}[self.status]
        out = [f"  [{mark}] {self.name}: {self.detail}"]
        if self.fix and self.status == NOT_READY:
            out.append(f"       fix: {self.fix}")
        return out


def _opens(path: str, flags: int = os.O_RDWR) -> str | None:
    """None when ``path`` opens with ``flags``, else why not."""
    try:
        os.close(os.open(path, flags))
        return None
    except OSError as exc:
        return exc.strerror or str(exc)


def _systemd_runs() -> bool:
    return Path("/run/systemd/system").is_dir()


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def check_kvm() -> Check:
    why = _opens("/dev/kvm")
    if why is None:
        return Check("kvm", OK, "/dev/kvm opens read-write")
    return Check("kvm", NOT_READY, f"/dev/kvm: {why}; guests run under TCG, many times slower",
                 "enable VT-x/AMD-V in the firmware (or nested virtualization for a cloud VM), "
                 "then modprobe kvm_intel (or kvm_amd)")


def check_tun() -> Check:
    why = _opens("/dev/net/tun")
    if why is None:
        return Check("tun", OK, "/dev/net/tun opens (TAP devices for guest NICs)")
    return Check("tun", NOT_READY, f"/dev/net/tun: {why}; guests get no TAP NIC",
                 "modprobe tun (and list it in /etc/modules-load.d/hangar.conf)")


def check_vhost_vsock() -> Check:
    if Path("/dev/vhost-vsock").exists():
        return Check("vhost_vsock", OK, "/dev/vhost-vsock exists")
    return Check("vhost_vsock", NOT_READY,
                 "/dev/vhost-vsock is missing; Firecracker needs it for the agent channel",
                 "modprobe vhost_vsock (and list it in /etc/modules-load.d/hangar.conf)")


def check_modules(root: Path) -> Check:
    listed = set(_read(root / MODULES_FILE).split())
    missing = [m for m in MODULES if m not in listed]
    if not missing:
        return Check("modules", OK, f"{', '.join(MODULES)} load at boot ({'/' + MODULES_FILE})")
    return Check("modules", NOT_READY, f"not loaded at boot: {', '.join(missing)}",
                 f"{PROVISION}, or list them in /{MODULES_FILE}")


def _persisted_sysctl(root: Path, key: str) -> str | None:
    """The value ``key`` gets at boot from sysctl.d files under ``root`` (last one wins)."""
    files: dict[str, Path] = {}
    for d in ("usr/lib/sysctl.d", "lib/sysctl.d", "run/sysctl.d", "etc/sysctl.d"):
        for p in sorted((root / d).glob("*.conf")):
            files[p.name] = p  # a later directory overrides a file of the same name
    value = None
    for name in sorted(files):
        for line in _read(files[name]).splitlines():
            k, _, v = line.partition("=")
            if k.strip() == key:
                value = v.strip()
    for line in _read(root / "etc/sysctl.conf").splitlines():
        k, _, v = line.partition("=")
        if k.strip() == key:
            value = v.strip()
    return value


def check_ip_forward(root: Path) -> Check:
    live = _read(Path("/proc/sys/net/ipv4/ip_forward")).strip()
    boot = _persisted_sysctl(root, "net.ipv4.ip_forward")
    detail = f"now {live or '?'}, at boot {boot or 'not set (0)'}"
    if boot == "1":
        return Check("ip_forward", OK, detail)
    return Check("ip_forward", NOT_READY, detail + "; guests lose NAT after a reboot until "
                 "Hangar starts", f"{PROVISION}, or write net.ipv4.ip_forward=1 to "
                 f"/{SYSCTL_FILE} and run sysctl --system")


def check_hardlinks(sysctl: Path = PROTECTED_HARDLINKS) -> Check:
    """``fs.protected_hardlinks`` is 1: no hard link to a file one cannot write."""
    if _read(sysctl).strip() == "1":
        return Check("hardlinks", OK, "fs.protected_hardlinks is 1")
    return Check("hardlinks", NOT_READY, "fs.protected_hardlinks is not 1: root may act on a "
                 "hard link the server or a VMM made to a file of root's (a split server "
                 "refuses to start)", f"{PROVISION}, or sysctl -w fs.protected_hardlinks=1 and "
                 f"the same in /{SYSCTL_FILE}")


def check_nftables(root: Path) -> Check:
    if shutil.which("nft") is None:
        return Check("nftables", NOT_READY, "the nft command is missing",
                     "apt-get install nftables")
    wants = root / "etc/systemd/system/sysinit.target.wants/nftables.service"
    if wants.exists() or wants.is_symlink():
        return Check("nftables", OK, "nft present, nftables.service enabled at boot")
    if not (_systemd_runs() or (root / "etc/systemd/system").is_dir()):
        return Check("nftables", NOT_APPLICABLE, "nft present; no systemd to enable it under")
    return Check("nftables", NOT_READY, "nftables.service is not enabled at boot",
                 "systemctl enable nftables")


def check_bridge(bridge: str) -> Check:
    if Path(f"/sys/class/net/{bridge}/bridge").is_dir():
        return Check("bridge", OK, f"{bridge} exists")
    return Check("bridge", NOT_APPLICABLE,
                 f"{bridge} does not exist yet: Hangar makes it (with its address and rules) "
                 "each time it starts with TAP networking, at boot once the service is enabled")


def check_data_dir(data_dir: Path) -> Check:
    if not data_dir.is_dir():
        return Check("data_dir", NOT_READY, f"{data_dir} does not exist",
                     f"{PROVISION} (or mkdir -m 0700 {data_dir})")
    mode = data_dir.stat().st_mode & 0o777
    free = shutil.disk_usage(data_dir).free
    detail = f"{data_dir}, mode {mode:04o}, {free / 2**30:.0f} GiB free"
    if mode & 0o077:
        return Check("data_dir", NOT_READY, detail + " (it holds the API key)",
                     f"chmod 0700 {data_dir}")
    if free < MIN_FREE_BYTES:
        return Check("data_dir", NOT_READY, detail + f" (below {MIN_FREE_BYTES >> 30} GiB: "
                     "images, disks and snapshots live here)",
                     "free space, or move HANGAR_DATA_DIR to a larger disk")
    return Check("data_dir", OK, detail)


def check_image(data_dir: Path, name: str) -> Check:
    link = Layout(data_dir).image_dir(name)
    if ImagePaths(link).manifest.is_file():
        return Check("image", OK, f"{name} is built ({os.path.realpath(link)})")
    return Check("image", NOT_READY, f"the {name} image is not built",
                 f"hangar image build {name} (a few minutes; the server also builds it at start)")


def check_secret_proxy(mitmdump: Path) -> Check:
    """The secret proxy's ``mitmdump`` (its own environment, ``.venv-proxy``)."""
    if mitmdump.is_file() and os.access(mitmdump, os.X_OK):
        return Check("secret_proxy", OK, f"{mitmdump} (sandboxes with secrets get a proxy)")
    return Check("secret_proxy", NOT_READY, f"{mitmdump} is missing: sandboxes with secrets "
                 "cannot start", "scripts/install.sh makes .venv-proxy (or set "
                 "HANGAR_SECRET_PROXY_MITMDUMP)")


def check_service(root: Path) -> Check:
    unit = root / UNIT_FILE
    if not _systemd_runs() and not unit.exists():
        return Check("service", NOT_APPLICABLE, "no systemd here: scripts/install.sh runs "
                     "Hangar with nohup (scripts/stop.sh stops it)")
    if not unit.exists():
        return Check("service", NOT_READY, f"/{UNIT_FILE} is not installed",
                     "scripts/install.sh --service, or " + PROVISION)
    enabled = root / "etc/systemd/system/multi-user.target.wants/hangar.service"
    if not (enabled.exists() or enabled.is_symlink()):
        return Check("service", NOT_READY, "hangar.service is installed but not enabled at boot",
                     "systemctl enable hangar")
    if not _systemd_runs() or root != Path("/"):
        return Check("service", OK, "hangar.service is installed and enabled")
    state = subprocess.run(["systemctl", "is-active", "hangar"], capture_output=True, text=True,
                           check=False).stdout.strip()
    if state == "active":
        return Check("service", OK, "hangar.service is enabled and active")
    return Check("service", NOT_READY, f"hangar.service is {state or 'unknown'}",
                 "systemctl start hangar; journalctl -u hangar says why it stopped")


def check_server(host: str, port: int) -> Check:
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}/health"
    try:
        with urllib.request.urlopen(url, timeout=3) as r:  # noqa: S310 (local URL)
            return Check("server", OK, f"{url} answers {r.status}")
    except Exception as exc:  # noqa: BLE001 (any failure is the answer)
        return Check("server", NOT_READY, f"{url}: {getattr(exc, 'reason', exc)}",
                     "start Hangar: systemctl start hangar (or scripts/install.sh)")


def _under(root: Path, p: Path) -> Path:
    """``p``, with an absolute symlink target taken inside ``root``."""
    if p.is_symlink() and os.readlink(p).startswith("/"):
        return root / os.readlink(p).lstrip("/")
    return p


def _hangar_sites(root: Path) -> list[Path]:
    sites = []
    for d in ("etc/nginx/sites-enabled", "etc/nginx/conf.d"):
        for p in sorted((root / d).glob("*")):
            if SITE_MARK in _read(_under(root, p)):
                sites.append(_under(root, p))
    return sites


def check_nginx(root: Path) -> tuple[Check, Check]:
    sites = _hangar_sites(root)
    if not sites:
        nginx = Check("nginx", NOT_APPLICABLE if shutil.which("nginx") is None else NOT_READY,
                      "no site rendered by `hangar deploy nginx` is enabled; Hangar is reachable "
                      "on its own address only", "hangar deploy nginx --domain NAME "
                      "(docs/operations.md: TLS with certbot)")
        return nginx, Check("certificate", NOT_APPLICABLE, "no TLS site")
    text = _read(sites[0])
    m = re.search(r"^\s*ssl_certificate\s+(\S+);", text, re.M)
    cert = Path(m.group(1)) if m else None
    nginx = Check("nginx", OK, f"{sites[0]} is enabled")
    if cert is None:
        return nginx, Check("certificate", NOT_READY, f"{sites[0]} names no certificate",
                            "render it again with hangar deploy nginx")
    cert_path = root / str(cert).lstrip("/")
    if not cert_path.exists():
        return nginx, Check("certificate", NOT_READY, f"{cert} does not exist",
                            "certbot certonly --webroot (docs/operations.md)")
    days = _days_left(cert_path)
    if days is None:
        return nginx, Check("certificate", OK, f"{cert} exists")
    if days < CERT_DAYS:
        return nginx, Check("certificate", NOT_READY, f"{cert} expires in {days:.0f} days",
                            "certbot renew (its timer should have; see journalctl -u certbot)")
    return nginx, Check("certificate", OK, f"{cert}, {days:.0f} days left")


def _days_left(cert: Path) -> float | None:
    """Days until the PEM certificate expires (openssl x509), or None if unknown."""
    if shutil.which("openssl") is None:
        return None
    out = subprocess.run(["openssl", "x509", "-noout", "-enddate", "-in", str(cert)],
                         capture_output=True, text=True, check=False)
    m = re.search(r"notAfter=(.+)", out.stdout)
    if out.returncode != 0 or not m:
        return None
    try:
        end = time.mktime(time.strptime(m.group(1).strip(), "%b %d %H:%M:%S %Y %Z"))
    except ValueError:
        return None
    return (end - time.mktime(time.gmtime())) / 86400


def check_logrotate(root: Path, data_dir: Path) -> Check:
    if _systemd_runs() and root == Path("/"):
        return Check("logrotate", NOT_APPLICABLE, "logs go to the journal (journalctl -u hangar)")
    text = _read(root / LOGROTATE_FILE)
    log = nohup_log()
    if str(log) in text:
        return Check("logrotate", OK, f"{log} rotates (/{LOGROTATE_FILE})")
    return Check("logrotate", NOT_READY, f"nothing rotates {log}",
                 "scripts/install.sh installs /etc/logrotate.d/hangar (deploy/logrotate/hangar)")


def host_checklist(*, data_dir: Path, image: str = "base", bridge: str = "hgbr0",
                   host: str = "127.0.0.1", port: int = 8080, root: Path = Path("/"),
                   server: bool = True, mitmdump: Path | None = None) -> list[Check]:
    """Every item of the module docstring, in that order. Changes nothing.

    ``server`` False skips the /health probe (a network call of up to 3 s);
    ``mitmdump`` (the secret proxy's) is checked when given.
    """
    checks: list[Callable[[], Check | tuple[Check, ...]]] = [
        check_kvm, check_tun, check_vhost_vsock,
        lambda: check_modules(root), lambda: check_ip_forward(root), check_hardlinks,
        lambda: check_nftables(root), lambda: check_bridge(bridge),
        lambda: check_data_dir(data_dir), lambda: check_image(data_dir, image),
        lambda: check_service(root),
    ]
    if mitmdump is not None:
        checks.append(lambda: check_secret_proxy(mitmdump))
    if server:
        checks.append(lambda: check_server(host, port))
    checks += [lambda: check_nginx(root), lambda: check_logrotate(root, data_dir)]
    out: list[Check] = []
    for fn in checks:
        r = fn()
        out.extend(r if isinstance(r, tuple) else (r,))
    return out


def lines(checks: list[Check]) -> list[str]:
    """The checklist as ``hangar doctor`` prints it."""
    ready = sum(c.ready for c in checks)
    out = [f"host readiness ({ready}/{len(checks)} ready):"]
    for c in checks:
        out.extend(c.lines())
    return out
