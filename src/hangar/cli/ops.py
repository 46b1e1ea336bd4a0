"""``hangar deploy nginx`` and ``hangar backup``: operator commands (typer).

Registered in ``hangar.cli.main``: ``app.add_typer(deploy_app, name="deploy")``
and ``app.command("backup")(backup)``. Both work while the server is down;
errors print one line and exit 1.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from hangar.errors import HangarError

deploy_app = typer.Typer(help="Put Hangar on a public address.", no_args_is_help=True)

SITES_AVAILABLE = Path("/etc/nginx/sites-available")
SITES_ENABLED = Path("/etc/nginx/sites-enabled")


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(1)


def _settings():  # type: ignore[no-untyped-def]
    from hangar.config import Settings

    return Settings()


@deploy_app.command("nginx")
def deploy_nginx(
    domain: Annotated[str, typer.Option(help="Public host name, e.g. hangar.example.com.")],
    output: Annotated[Optional[Path], typer.Option(
        help="Where to write the site; '-' prints it. Default: "
             "/etc/nginx/sites-available/hangar, enabled in sites-enabled.")] = None,
    upstream: Annotated[Optional[str], typer.Option(
        help="Where Hangar listens: HOST:PORT or unix:/PATH. Default: "
             "HANGAR_HOST:HANGAR_PORT.")] = None,
    cert: Annotated[Optional[str], typer.Option(
        help="Certificate chain (PEM). Default: certbot's for the domain.")] = None,
    key: Annotated[Optional[str], typer.Option(
        help="Private key (PEM). Default: certbot's for the domain.")] = None,
    acme_root: Annotated[str, typer.Option(
        help="Folder served for Let's Encrypt's HTTP-01 challenges.")] = "/var/www/html",
    https_port: Annotated[int, typer.Option(help="TLS port.")] = 443,
    http_port: Annotated[int, typer.Option(help="Plain HTTP port (redirects).")] = 80,
    max_json_bytes: Annotated[Optional[int], typer.Option(
        help="JSON body cap, bytes. Default: Hangar's (HANGAR_MAX_JSON_BYTES).")] = None,
    reload: Annotated[bool, typer.Option(
        help="After writing, check the config (nginx -t) and reload nginx.")] = False,
    address: Annotated[str, typer.Option(
        help="Listen on this one address only (e.g. 127.0.0.2). Default: every address.")] = "",
    e2b_domain: Annotated[str, typer.Option(
        help="Also serve E2B's host names *.<this> (api.<this>, <port>-<id>.<this>): "
             "Hangar's HANGAR_DOMAIN, with a wildcard certificate (docs/e2b.md).")] = "",
    e2b_cert: Annotated[Optional[str], typer.Option(
        help="Wildcard certificate chain for *.<e2b-domain> (PEM). Default: certbot's.")] = None,
    e2b_key: Annotated[Optional[str], typer.Option(
        help="Its private key (PEM). Default: certbot's for the E2B domain.")] = None,
) -> None:
    """Render the nginx site (TLS, WebSockets, unbuffered streams) for Hangar."""
    from hangar.ops import nginx

    settings = _settings()
    if upstream is None:
        host = "127.0.0.1" if settings.host in ("0.0.0.0", "::", "") else settings.host
        upstream = f"unix:{settings.uds}" if settings.uds else f"{host}:{settings.port}"
    if max_json_bytes is None:
        max_json_bytes = int(getattr(settings, "max_json_bytes", nginx.DEFAULT_JSON_LIMIT))
    try:
        site = nginx.Site(domain=domain, upstream=upstream, certificate=cert or "",
                          certificate_key=key or "", acme_root=acme_root,
                          https_port=https_port, http_port=http_port,
                          max_json_bytes=max_json_bytes, address=address,
                          e2b_domain=e2b_domain, e2b_certificate=e2b_cert or "",
                          e2b_certificate_key=e2b_key or "")
    except nginx.SiteError as exc:
        _fail(str(exc))
        return
    if output is not None and str(output) == "-":
        sys.stdout.write(nginx.render(site))
        return
    target = output or SITES_AVAILABLE / "hangar"
    try:
        nginx.write(site, target)
        typer.echo(f"wrote {target}")
        if output is None and SITES_ENABLED.is_dir():
            link = SITES_ENABLED / "hangar"
            if not link.is_symlink() or os.readlink(link) != str(target):
                link.unlink(missing_ok=True)
                link.symlink_to(target)
                typer.echo(f"enabled it: {link} -> {target}")
    except OSError as exc:
        _fail(f"cannot write {exc.filename or target}: {exc.strerror or exc} (run as root?)")
    for path in (site.certificate, site.certificate_key, site.e2b_certificate,
                 site.e2b_certificate_key):
        if path and not Path(path).exists():
            typer.echo(f"note: {path} does not exist yet; nginx will not start with this site "
                       "until it does (docs/operations.md: certbot)", err=True)
    if reload:
        if shutil.which("nginx") is None:
            _fail("nginx is not installed")
        test = subprocess.run(["nginx", "-t"], capture_output=True, text=True, check=False)
        if test.returncode != 0:
            _fail(f"nginx -t refused the configuration:\n{test.stderr.strip()}")
        subprocess.run(["nginx", "-s", "reload"], check=True)
        typer.echo("nginx reloaded")


def backup(
    dest: Annotated[Optional[Path], typer.Argument(
        help="File, or folder for hangar-<UTC time>.db. Default: <data>/backups/.")] = None,
    data_dir: Annotated[Optional[Path], typer.Option(
        help="Data directory (HANGAR_DATA_DIR).")] = None,
    keep: Annotated[Optional[int], typer.Option(
        help="Then delete all but the newest KEEP hangar-*.db in the folder.")] = None,
) -> None:
    """Back up the database while the server runs (SQLite's online backup), and the named
    volumes beside it (hangar-<time>.volumes/; a volume a sandbox writes is skipped)."""
    from hangar.layout import Layout
    from hangar.ops.backup import backup_database, prune
    from hangar.ops.volume_backup import backup_volumes

    layout = Layout(data_dir or _settings().data_dir)
    if dest is None:
        dest = layout.backups
        dest.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        report = backup_database(layout.database, dest)
        vols = backup_volumes(layout, report.path)
        removed = prune(report.path.parent, keep) if keep else []
    except HangarError as exc:
        _fail(exc.message)
        return
    rows = ", ".join(f"{n} {t}" for t, n in report.rows.items())
    typer.echo(f"{report.path}: {report.size_bytes} bytes in {report.duration_s:.2f} s ({rows})")
    if vols.folder is not None:
        typer.echo(f"{vols.folder}: {len(vols.copied)} volumes, {vols.size_bytes} bytes on disk")
    for vid, why in vols.skipped.items():
        typer.echo(f"volume {vid} not backed up: {why}", err=True)
    for p in removed:
        typer.echo(f"removed {p}")
