"""The ``hangar`` command line (typer + rich).

Server side: ``hangar serve``, ``hangar image build|ls|gc``. Client side
(talks to a server at ``HANGAR_URL`` with ``HANGAR_API_KEY`` or the key
file): ``create``, ``ls``, ``exec``, ``files put|get|ls``, ``rm``.
Errors print one line and exit 1; ``exec`` exits with the command's code.
"""

from __future__ import annotations

import base64
import os
import shlex
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Column, Table

from hangar.errors import HangarError
from hangar.ops import cli as ops_cli

app = typer.Typer(help="Hangar: microVM sandboxes for AI agents.", no_args_is_help=True,
                  pretty_exceptions_enable=False)
image_app = typer.Typer(help="Build, list and collect guest images.", no_args_is_help=True)
files_app = typer.Typer(help="Copy files in and out of a sandbox.", no_args_is_help=True)
machine_app = typer.Typer(help="Per-user machines that sleep when idle.", no_args_is_help=True)
snapshot_app = typer.Typer(help="Snapshots of running sandboxes.", no_args_is_help=True)
desktop_app = typer.Typer(help="Screenshots, mouse and keyboard of a desktop sandbox.",
                          no_args_is_help=True)
app.add_typer(image_app, name="image")
app.add_typer(files_app, name="files")
app.add_typer(machine_app, name="machine")
app.add_typer(snapshot_app, name="snapshot")
app.add_typer(desktop_app, name="desktop")
app.add_typer(ops_cli.deploy_app, name="deploy")
app.command("backup")(ops_cli.backup)
out = Console()
err = Console(stderr=True)

DataDir = Annotated[Optional[Path], typer.Option(help="Data directory (HANGAR_DATA_DIR).")]


def _settings(data_dir: Path | None = None, **overrides: object):  # type: ignore[no-untyped-def]
    from hangar.config import Settings

    if data_dir is not None:
        overrides["data_dir"] = data_dir
    return Settings(**{k: v for k, v in overrides.items() if v is not None})


def _client():  # type: ignore[no-untyped-def]
    from hangar.client import Hangar

    return Hangar()


def _fail(exc: HangarError) -> None:
    err.print(f"[red]error:[/red] {exc.message}")
    raise typer.Exit(1)


def _build(layout, name: str, force: bool = False):  # type: ignore[no-untyped-def]
    from hangar.images import build_image

    with err.status(f"building image {name}") as status:
        def progress(msg: str) -> None:
            status.update(f"image {name}: {msg}")
            err.print(f"[dim]image {name}:[/dim] {msg}")

        return build_image(layout, name, force=force, progress=progress)


@app.command()
def serve(
    host: Annotated[Optional[str], typer.Option(help="Listen address (HANGAR_HOST).")] = None,
    port: Annotated[Optional[int], typer.Option(help="Listen port (HANGAR_PORT).")] = None,
    data_dir: DataDir = None,
    engine: Annotated[Optional[str], typer.Option(
        help="auto, firecracker or qemu (HANGAR_ENGINE).")] = None,
    accel: Annotated[Optional[str], typer.Option(help="auto, kvm or tcg (HANGAR_ACCEL).")] = None,
) -> None:
    """Run the REST API; builds the default image first if it is missing."""
    import uvicorn

    from hangar import log
    from hangar.api.app import create_app
    from hangar.layout import Layout

    settings = _settings(data_dir, host=host, port=port, engine=engine, accel=accel)
    log.setup(settings.log_level)
    layout = Layout(settings.data_dir)
    layout.ensure()
    try:
        _build(layout, settings.default_image)
    except HangarError as exc:
        _fail(exc)
    where = f"unix:{settings.uds}" if settings.uds else f"http://{settings.host}:{settings.port}"
    err.print(f"Hangar on {where}  (API key in {layout.api_key_file})")
    if settings.uds:
        uvicorn.run(create_app(settings), uds=str(settings.uds), log_config=None,
                    access_log=False)
    else:
        uvicorn.run(create_app(settings), host=settings.host, port=settings.port,
                    log_config=None, access_log=False, proxy_headers=True,
                    forwarded_allow_ips=settings.forwarded_allow_ips)


@image_app.command("build")
def image_build(
    recipe: Annotated[str, typer.Argument(help="Recipe name.")] = "base",
    force: Annotated[bool, typer.Option(
        help="Make a new build even if one of this recipe exists (a new id; the old "
             "build stays for what was made from it).")] = False,
    data_dir: DataDir = None,
) -> None:
    """Build a guest image from a recipe (reused while the recipe is unchanged).

    Prints the build's id (NAME-DIGEST, the digest covering its bytes) and directory.
    """
    from hangar.layout import Layout

    layout = Layout(_settings(data_dir).data_dir)
    layout.ensure()
    try:
        img = _build(layout, recipe, force)
    except HangarError as exc:
        _fail(exc)
    out.print(f"{img.id} {img.dir}")


@image_app.command("ls")
def image_ls(data_dir: DataDir = None) -> None:
    """List built images."""
    from hangar.images import list_images
    from hangar.layout import Layout

    import time

    table = Table("rootfs (MiB)", "kernel", "built", "state")
    table.columns.insert(0, Column("id", no_wrap=True, overflow="fold"))
    for i in list_images(Layout(_settings(data_dir).data_dir)):
        state = "current" if i.current else ("stale" if i.stale else "")
        table.add_row(i.id, f"{i.rootfs_bytes / 2**20:.0f}", i.kernel_version,
                      time.strftime("%Y-%m-%d %H:%M", time.localtime(i.built_at)), state)
    out.print(table)


def _pinned_images(layout) -> set[str]:  # type: ignore[no-untyped-def]
    """Image ids that sandboxes, snapshots and machines in the data dir's store pin."""
    if not layout.database.exists():
        return set()
    from hangar.core.states import GONE, State
    from hangar.core.store import MachineRecord, SandboxRecord, SnapshotRecord, Store
    from hangar.images import image_id

    store = Store(layout.database)
    try:
        pins: set[str] = set()

        def pin(name: str, digest: str) -> None:  # a record without a digest pins the name
            pins.add(image_id(name, digest) if digest else name)

        for rec in store.all():
            if State(rec.state) not in GONE:
                pin(rec.image, rec.image_digest)
        for snap in store.list(SnapshotRecord):
            pin(snap.image, snap.image_digest)
        for m in store.list(MachineRecord):
            found = store.find(SandboxRecord, m.sandbox_id)
            if found is not None:
                pin(found.image, found.image_digest)
        return pins
    finally:
        store.engine.dispose()


@image_app.command("gc")
def image_gc(
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Only list the builds that would be removed.")] = False,
    data_dir: DataDir = None,
) -> None:
    """Remove image builds that nothing uses: never the current build of a recipe, one a
    sandbox, snapshot or machine of this data dir was made from, or one a VM has open."""
    from hangar.images.gc import collect
    from hangar.layout import Layout

    layout = Layout(_settings(data_dir).data_dir)
    try:
        result = collect(layout, _pinned_images(layout), dry_run=dry_run)
    except HangarError as exc:
        _fail(exc)
    verb = "would remove" if dry_run else "removed"
    for i in result.removed:
        out.print(f"{verb} {i.id} ({i.bytes_on_disk / 2**20:.0f} MiB)")
    for k in result.kept:
        out.print(f"kept {k.image.id} ({k.reason})")
    for d in result.leftovers:
        out.print(f"{verb} leftover {d.name}")
    out.print(f"{verb} {len(result.removed)} build(s), "
              f"{result.freed_bytes / 2**20:.0f} MiB")


@app.command()
def create(
    image: Annotated[Optional[str], typer.Option(help="Template name.")] = None,
    desktop: Annotated[Optional[str], typer.Option(
        help="Start a desktop, WIDTHxHEIGHTxDEPTH, e.g. 1280x800x24 (image 'desktop').")] = None,
    vcpus: Annotated[Optional[int], typer.Option()] = None,
    memory: Annotated[Optional[int], typer.Option(help="Memory, MiB.")] = None,
    disk: Annotated[Optional[int], typer.Option(help="Disk, MiB.")] = None,
    timeout: Annotated[Optional[float], typer.Option(help="Time to live, seconds.")] = None,
) -> None:
    """Create a sandbox and print its id."""
    try:
        with _client() as h:
            sb = h.create(image, vcpus=vcpus, memory_mib=memory, disk_mib=disk, timeout=timeout,
                          desktop=desktop)
    except HangarError as exc:
        _fail(exc)
    out.print(sb["id"])


@app.command("ls")
def ls() -> None:
    """List sandboxes."""
    try:
        with _client() as h:
            boxes = h.list()
    except HangarError as exc:
        _fail(exc)
    table = Table("id", "state", "image", "vcpus", "memory (MiB)", "accel")
    for b in boxes:
        table.add_row(b["id"], b["state"], b["image"], str(b["vcpus"]), str(b["memory_mib"]),
                      b["accel"])
    out.print(table)


@app.command("exec", context_settings={"allow_interspersed_args": False})
def exec_(
    sandbox_id: str,
    command: Annotated[list[str], typer.Argument(help="Command; one argument is a shell string.")],
    timeout: Annotated[Optional[float], typer.Option(help="Seconds.")] = None,
    cwd: Annotated[Optional[str], typer.Option()] = None,
) -> None:
    """Run a command, streaming its output; exits with the command's exit code."""
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        err.print("[red]error:[/red] no command given")
        raise typer.Exit(2)
    cmd = command[0] if len(command) == 1 else shlex.join(command)
    stdin = None if sys.stdin.isatty() or os.environ.get("HANGAR_NO_STDIN") else sys.stdin.buffer.read()
    code = 1
    try:
        with _client() as h:
            for ev in h.exec_stream(sandbox_id, cmd, cwd=cwd, timeout=timeout, stdin=stdin):
                if ev["type"] in ("stdout", "stderr"):
                    stream = sys.stdout.buffer if ev["type"] == "stdout" else sys.stderr.buffer
                    data = ev["data"].encode() if "data" in ev else base64.b64decode(ev["data_b64"])
                    stream.write(data)
                    stream.flush()
                elif ev["type"] == "exit":
                    if ev.get("timed_out"):
                        err.print("[yellow]command timed out[/yellow]")
                    code = ev["exit_code"] if ev["exit_code"] is not None else 1
    except HangarError as exc:
        _fail(exc)
    raise typer.Exit(code)


@app.command()
def rm(sandbox_ids: Annotated[list[str], typer.Argument()]) -> None:
    """Delete sandboxes."""
    try:
        with _client() as h:
            for sid in sandbox_ids:
                h.delete(sid)
                out.print(f"deleted {sid}")
    except HangarError as exc:
        _fail(exc)


@files_app.command("put")
def files_put(sandbox_id: str, local: Path, remote: str,
              mode: Annotated[Optional[str], typer.Option(help="Octal mode, e.g. 755.")] = None) -> None:
    """Copy a local file into the sandbox."""
    try:
        data = local.read_bytes()
    except OSError as exc:
        err.print(f"[red]error:[/red] cannot read {local}: {exc.strerror or exc}")
        raise typer.Exit(1) from None
    try:
        with _client() as h:
            r = h.write_file(sandbox_id, remote, data, int(mode, 8) if mode else 0o644)
    except HangarError as exc:
        _fail(exc)
    out.print(f"{r['path']}: {r['size']} bytes")


@files_app.command("get")
def files_get(sandbox_id: str, remote: str,
              local: Annotated[Optional[Path], typer.Argument(help="Default: stdout.")] = None) -> None:
    """Copy a file out of the sandbox (to stdout when no local path is given)."""
    try:
        with _client() as h:
            data = h.read_file(sandbox_id, remote)
    except HangarError as exc:
        _fail(exc)
    if local is None or str(local) == "-":
        sys.stdout.buffer.write(data)
    else:
        local.write_bytes(data)


@files_app.command("ls")
def files_ls(sandbox_id: str,
             path: Annotated[str, typer.Argument(help="Directory in the guest.")] = "/root") -> None:
    """List a directory in the sandbox."""
    try:
        with _client() as h:
            entries = h.list_files(sandbox_id, path)
    except HangarError as exc:
        _fail(exc)
    table = Table("name", "type", "size", "mode")
    for e in entries:
        table.add_row(e["name"], e["type"], str(e["size"]), oct(e["mode"]))
    out.print(table)


def _machine_row(m: dict) -> None:  # type: ignore[type-arg]
    table = Table("user", "sandbox", "state", "desired", "idle timeout (s)")
    table.add_row(m["user_id"], m["sandbox_id"], m["state"], m["desired_state"],
                  f"{m['idle_timeout_s']:.0f}")
    out.print(table)


def _api(method: str, path: str, **kw: object) -> dict:  # type: ignore[type-arg]
    """One REST call; errors print one line and exit 1. Returns the JSON body ({} if none)."""
    try:
        with _client() as h:
            resp = h._call(method, path, **kw)
    except HangarError as exc:
        _fail(exc)
        raise  # unreachable
    return resp.json() if resp.content else {}


def _machine_call(method: str, user_id: str, suffix: str = "", **kw: object) -> dict:  # type: ignore[type-arg]
    return _api(method, f"/machines/{user_id}{suffix}", **kw)


@machine_app.command("get")
def machine_get(user_id: str,
                idle: Annotated[Optional[float], typer.Option(help="Idle seconds before sleep.")] = None,
                ) -> None:
    """Get the user's machine, creating it if there is none."""
    body = {"idle_timeout": idle} if idle else {}
    _machine_row(_machine_call("POST", user_id, json=body))


@machine_app.command("ls")
def machine_ls() -> None:
    """List users' machines."""
    machines = _api("GET", "/machines")["machines"]
    table = Table("user", "sandbox", "state", "desired", "idle timeout (s)")
    for m in machines:
        table.add_row(m["user_id"], m["sandbox_id"], m["state"], m["desired_state"],
                      f"{m['idle_timeout_s']:.0f}")
    out.print(table)


@machine_app.command("show")
def machine_show(user_id: str) -> None:
    """Show the machine's state without changing it."""
    _machine_row(_machine_call("GET", user_id))


@machine_app.command("sleep")
def machine_sleep(user_id: str) -> None:
    """Snapshot the machine and stop its VM."""
    _machine_row(_machine_call("POST", user_id, "/snapshot"))


@machine_app.command("wake")
def machine_wake(user_id: str) -> None:
    """Restore the machine from its sleep snapshot."""
    _machine_row(_machine_call("POST", user_id, "/wake"))


@machine_app.command("rm")
def machine_rm(user_id: str) -> None:
    """Remove the machine and everything it held."""
    _api("DELETE", f"/machines/{user_id}")
    out.print(f"removed the machine of {user_id}")


@snapshot_app.command("create")
def snapshot_create(sandbox_id: str) -> None:
    """Snapshot a running sandbox and print the snapshot's id."""
    snap = _api("POST", f"/sandboxes/{sandbox_id}/snapshot")
    out.print(f"{snap['id']} ({snap['size_bytes'] / 2**20:.1f} MiB)")


@snapshot_app.command("ls")
def snapshot_ls() -> None:
    """List snapshots."""
    snaps = _api("GET", "/snapshots")["snapshots"]
    table = Table("id", "sandbox", "size (MiB)", "memory (MiB)")
    for s in snaps:
        table.add_row(s["id"], s["sandbox_id"], f"{s['size_bytes'] / 2**20:.1f}",
                      str(s["memory_mib"]))
    out.print(table)


@snapshot_app.command("restore")
def snapshot_restore(sandbox_id: str, snapshot_id: str) -> None:
    """Bring a sandbox back to one of its snapshots."""
    _api("POST", f"/sandboxes/{sandbox_id}/restore", json={"snapshot_id": snapshot_id})
    out.print(f"{sandbox_id} restored to {snapshot_id}")


@snapshot_app.command("fork")
def snapshot_fork(snapshot_id: str) -> None:
    """Start a new sandbox from a snapshot and print its id."""
    sb = _api("POST", f"/snapshots/{snapshot_id}/sandboxes")
    out.print(sb["id"])


@snapshot_app.command("rm")
def snapshot_rm(snapshot_id: str) -> None:
    """Delete a snapshot."""
    _api("DELETE", f"/snapshots/{snapshot_id}")
    out.print(f"deleted {snapshot_id}")


@app.command()
def doctor(data_dir: DataDir = None) -> None:
    """Say what this host offers (KVM, VMMs and their versions) and which engine auto picks."""
    from hangar.engines.doctor import diagnose
    from hangar.images import resolve_image
    from hangar.layout import Layout

    layout = Layout(_settings(data_dir).data_dir)
    try:
        image = resolve_image(layout, "base")
    except HangarError:
        image = None
    for line in diagnose(layout, image).lines():
        print(line)
    from hangar.ops.checklist import host_checklist, lines

    s = _settings(data_dir)
    for line in lines(host_checklist(data_dir=layout.root, image=s.default_image,
                                     bridge=s.net_bridge, host=s.host, port=s.port)):
        print(line)


@desktop_app.command("screenshot")
def desktop_screenshot(sandbox_id: str, out_file: Path,
                       width: Annotated[Optional[int], typer.Option(help="Scale to pixels.")] = None,
                       ) -> None:
    """Save a PNG screenshot of the sandbox's desktop."""
    try:
        with _client() as h:
            png = h.screenshot(sandbox_id, width)
    except HangarError as exc:
        _fail(exc)
    out_file.write_bytes(png)
    out.print(f"{out_file}: {len(png)} bytes")


@desktop_app.command("click")
def desktop_click(sandbox_id: str, x: int, y: int,
                  button: Annotated[str, typer.Option(help="left, middle or right")] = "left",
                  double: bool = False) -> None:
    """Click at (x, y), pixels."""
    _api("POST", f"/sandboxes/{sandbox_id}/click",
         json={"x": x, "y": y, "button": button, "double": double})


@desktop_app.command("type")
def desktop_type(sandbox_id: str, text: str) -> None:
    """Type text (any Unicode) into the focused window."""
    _api("POST", f"/sandboxes/{sandbox_id}/type", json={"text": text})


@desktop_app.command("key")
def desktop_key(sandbox_id: str, keys: str) -> None:
    """Press a key or combination, e.g. ctrl+shift+t or enter."""
    _api("POST", f"/sandboxes/{sandbox_id}/key", json={"keys": keys})


@desktop_app.command("scroll")
def desktop_scroll(sandbox_id: str, direction: str, amount: int = 3) -> None:
    """Scroll up, down, left or right by wheel clicks."""
    _api("POST", f"/sandboxes/{sandbox_id}/scroll",
         json={"direction": direction, "amount": amount})


@desktop_app.command("show")
def desktop_show(sandbox_id: str) -> None:
    """Screen size and cursor position."""
    d = _api("GET", f"/sandboxes/{sandbox_id}/display")
    out.print(f"{d['width']}x{d['height']}x{d['depth']}, cursor at ({d['cursor_x']}, "
              f"{d['cursor_y']})")


if __name__ == "__main__":
    app()
