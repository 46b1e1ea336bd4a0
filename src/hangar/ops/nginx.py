"""The nginx site that puts TLS in front of Hangar: rendered from a template.

The template (``templates/nginx-site.conf``, shipped in the package) holds
what Hangar needs from a reverse proxy:

* TLS with the certificate's paths, and HTTP redirected to HTTPS except for
  Let's Encrypt's HTTP-01 challenges (served from ``acme_root``);
* WebSocket upgrades on every path (the live desktop's
  ``/sandboxes/{id}/vnc`` and any later one), with an hour's idle timeout;
* no buffering and 25 h read timeouts for exec (a command may run 24 h) and
  its NDJSON stream, and for ``/events`` (Server-Sent Events);
* ``client_max_body_size`` equal to Hangar's JSON body cap
  (``HANGAR_MAX_JSON_BYTES``), answered with Hangar's JSON error shape, and
  no cap (nor spooling to disk) on file uploads, which Hangar streams into
  the guest;
* ``X-Forwarded-For``/``-Proto``/``-Host`` set from the connection, never
  passed on from the client, for Hangar to trust from the proxy's address
  only (``HANGAR_FORWARDED_ALLOW_IPS``);
* with ``e2b_domain`` (Hangar's ``HANGAR_DOMAIN``), a second site
  (``templates/nginx-site-e2b.conf``) for ``*.<e2b_domain>``: E2B's
  ``api.<domain>`` and ``<port>-<id>.<domain>`` names, served with a wildcard
  certificate, streamed both ways without a body cap.

Placeholders are ``{{name}}``; nginx's own ``$variables`` pass through.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

TEMPLATE = "nginx-site.conf"
E2B_TEMPLATE = "nginx-site-e2b.conf"
DEFAULT_JSON_LIMIT = 8 << 20
"""Hangar's JSON body cap in bytes when the settings do not say (``max_json_bytes``)."""

_LABEL = r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)"
_DOMAIN = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*$")
_ADDRESS = re.compile(r"^([0-9]{1,3}(\.[0-9]{1,3}){3}|\[[0-9A-Fa-f:.]+\])$")
_UPSTREAM = re.compile(r"^(unix:/[^\s;{}]+|[A-Za-z0-9.-]+:\d{1,5}|\[[0-9A-Fa-f:.]+\]:\d{1,5})$")
_PATH = re.compile(r"^/[^\s;{}'\"\\]*$")
_PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")


class SiteError(ValueError):
    """A value that cannot go into the site config; the message names it."""


@dataclass(frozen=True)
class Site:
    """What the site config is rendered from.

    ``domain``: the public host name. ``upstream``: where Hangar listens,
    ``host:port`` or ``unix:/path``. ``certificate``/``certificate_key``:
    PEM files (default: certbot's for ``domain``). Ports are TCP ports;
    ``max_json_bytes`` is bytes. ``address``: the one address nginx listens on
    (``127.0.0.2``, ``[::1]``); empty: every IPv4 and IPv6 address.
    ``e2b_domain``: Hangar's ``HANGAR_DOMAIN``, whose ``*.<e2b_domain>`` names
    (E2B's ``api.`` and sandbox hosts) get a site of their own, with
    ``e2b_certificate``/``e2b_certificate_key`` (a wildcard certificate; default:
    certbot's for ``e2b_domain``); empty: none.
    """

    domain: str
    upstream: str = "127.0.0.1:8080"
    certificate: str = ""
    certificate_key: str = ""
    acme_root: str = "/var/www/html"
    https_port: int = 443
    http_port: int = 80
    max_json_bytes: int = DEFAULT_JSON_LIMIT
    address: str = ""
    e2b_domain: str = ""
    e2b_certificate: str = ""
    e2b_certificate_key: str = ""

    def __post_init__(self) -> None:
        if not _DOMAIN.match(self.domain):
            raise SiteError(f"not a host name: {self.domain!r}")
        if self.address and not _ADDRESS.match(self.address):
            raise SiteError(f"address must be an IPv4 address or [IPv6], not {self.address!r}")
        if self.e2b_domain:
            if not _DOMAIN.match(self.e2b_domain):
                raise SiteError(f"not a host name: {self.e2b_domain!r}")
            live = f"/etc/letsencrypt/live/{self.e2b_domain}"
            if not self.e2b_certificate:
                object.__setattr__(self, "e2b_certificate", f"{live}/fullchain.pem")
            if not self.e2b_certificate_key:
                object.__setattr__(self, "e2b_certificate_key", f"{live}/privkey.pem")
        if not _UPSTREAM.match(self.upstream):
            raise SiteError(f"upstream must be HOST:PORT or unix:/PATH, not {self.upstream!r}")
        if not self.certificate:
            object.__setattr__(self, "certificate",
                               f"/etc/letsencrypt/live/{self.domain}/fullchain.pem")
        if not self.certificate_key:
            object.__setattr__(self, "certificate_key",
                               f"/etc/letsencrypt/live/{self.domain}/privkey.pem")
        for name in ("certificate", "certificate_key", "acme_root", "e2b_certificate",
                     "e2b_certificate_key"):
            if name.startswith("e2b_") and not self.e2b_domain:
                continue
            if not _PATH.match(getattr(self, name)):
                raise SiteError(f"{name} must be an absolute path without spaces, quotes or "
                                f"';{{}}': {getattr(self, name)!r}")
        for name in ("https_port", "http_port"):
            if not 1 <= getattr(self, name) <= 65535:
                raise SiteError(f"{name} must be 1..65535, not {getattr(self, name)}")
        if self.https_port == self.http_port:
            raise SiteError("the HTTP and HTTPS ports must differ")
        if self.max_json_bytes < 1024:
            raise SiteError(f"max_json_bytes must be at least 1024, not {self.max_json_bytes}")


def template_text(name: str = TEMPLATE) -> str:
    """A template shipped in the package (``TEMPLATE``, ``E2B_TEMPLATE``)."""
    return resources.files("hangar.ops").joinpath("templates", name).read_text()


PER_CLIENT_MAX = 256
"""Connections one client address holds at once through the site (``limit_conn``): the
figure Hangar allows a client it sees directly (``hangar.api.http_limits.PER_CLIENT_MAX``),
which it cannot apply to the clients of its trusted proxy (review 29e M1)."""


def _listen(address: str, port: int, ssl: str) -> str:
    if address:
        return f"listen {address}:{port}{ssl};"
    return f"listen {port}{ssl};\n    listen [::]:{port}{ssl};"


def render(site: Site, template: str | None = None) -> str:
    """The site config for ``site`` (with E2B's site after it when ``site.e2b_domain``);
    raises SiteError for a placeholder it cannot fill."""
    values = {k: str(v) for k, v in asdict(site).items()}
    values["listen_http"] = _listen(site.address, site.http_port, "")
    # HTTP/2 where TLS offers it (as E2B's edge does): a stream cut upstream (a sandbox
    # killed under a running command) is then a reset stream for the client, which E2B's
    # SDK reads as a transport failure and confirms by its health probe; over HTTP/1.1
    # nginx ends such a response with a plain close. WebSockets still take HTTP/1.1.
    values["listen_https"] = _listen(site.address, site.https_port, " ssl http2")
    values["per_client"] = str(PER_CLIENT_MAX)
    values["slug"] = re.sub(r"[^a-z0-9]", "_", site.domain.lower())
    values["https_suffix"] = "" if site.https_port == 443 else f":{site.https_port}"
    values["api_timeout"] = "600s"
    values["stream_timeout"] = "25h"
    values["websocket_timeout"] = "1h"

    def fill(m: re.Match[str]) -> str:
        try:
            return values[m.group(1)]
        except KeyError:
            raise SiteError(f"the template names an unknown value {{{{{m.group(1)}}}}}") from None

    text = template if template is not None else template_text()
    if site.e2b_domain and template is None:
        text += template_text(E2B_TEMPLATE)
    return _PLACEHOLDER.sub(fill, text)


def write(site: Site, path: Path) -> Path:
    """Render ``site`` into ``path`` atomically (mode 0644); returns ``path``."""
    text = render(site)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.chmod(0o644)
    tmp.replace(path)
    return path
