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
  only (``HANGAR_FORWARDED_ALLOW_IPS``).

Placeholders are ``{{name}}``; nginx's own ``$variables`` pass through.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

TEMPLATE = "nginx-site.conf"
DEFAULT_JSON_LIMIT = 8 << 20
"""Hangar's JSON body cap in bytes when the settings do not say (``max_json_bytes``)."""

_LABEL = r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)"
_DOMAIN = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*$")
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
    ``max_json_bytes`` is bytes.
    """

    domain: str
    upstream: str = "127.0.0.1:8080"
    certificate: str = ""
    certificate_key: str = ""
    acme_root: str = "/var/www/html"
    https_port: int = 443
    http_port: int = 80
    max_json_bytes: int = DEFAULT_JSON_LIMIT

    def __post_init__(self) -> None:
        if not _DOMAIN.match(self.domain):
            raise SiteError(f"not a host name: {self.domain!r}")
        if not _UPSTREAM.match(self.upstream):
            raise SiteError(f"upstream must be HOST:PORT or unix:/PATH, not {self.upstream!r}")
        if not self.certificate:
            object.__setattr__(self, "certificate",
                               f"/etc/letsencrypt/live/{self.domain}/fullchain.pem")
        if not self.certificate_key:
            object.__setattr__(self, "certificate_key",
                               f"/etc/letsencrypt/live/{self.domain}/privkey.pem")
        for name in ("certificate", "certificate_key", "acme_root"):
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


def template_text() -> str:
    """The template shipped in the package."""
    return resources.files("hangar.ops").joinpath("templates", TEMPLATE).read_text()


def render(site: Site, template: str | None = None) -> str:
    """The site config for ``site``; raises SiteError for a placeholder it cannot fill."""
    values = {k: str(v) for k, v in asdict(site).items()}
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

    return _PLACEHOLDER.sub(fill, template if template is not None else template_text())


def write(site: Site, path: Path) -> Path:
    """Render ``site`` into ``path`` atomically (mode 0644); returns ``path``."""
    text = render(site)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.chmod(0o644)
    tmp.replace(path)
    return path
