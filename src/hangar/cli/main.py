"""The ``hangar`` app (typer + rich): its commands, and the groups of the other modules.

Server side: ``hangar serve``, ``hangar image build|ls|gc``, ``hangar template
build|import|ls|rm`` (``hangar.cli.template``), ``hangar doctor``,
``hangar key``, ``hangar mcp`` (the agent tools of ``hangar.tools`` over MCP).
Client side (talks to a server at ``HANGAR_URL`` with ``HANGAR_API_KEY`` or
the key file), through the public SDK (``hangar.client``) only: ``create``,
``ls``, ``exec``, ``shell``, ``rm``, ``ttl``, ``status``, ``events``, ``files``,
``snapshot``, ``machine``, ``desktop``, ``port``.
Errors print one line and exit 1; ``exec`` exits with the command's code.
"""

from __future__ import annotations

import os
import shlex
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Column, Table

from hangar.client import MachineInfo
from hangar.cli import ops as ops_cli
from hangar.cli.cluster import cluster_app, node_app
from hangar.cli.common import (
    DataDir, build_recipe, err, fail, out, pinned_images, sdk, server_settings,
)
from hangar.cli.key import app as key_app
from hangar.cli.serve import serve
from hangar.cli.status import status
from hangar.cli.template import app as template_app
from hangar.errors import Gone, HangarError, NotFound

app = typer.Typer(help="Hangar: microVM sandboxes for AI agents.", no_args_is_help=True,
                  pretty_exceptions_enable=False)
image_app = typer.Typer(help="Build, list and collect guest images.", no_args_is_help=True)
files_app = typer.Typer(help="Copy files in and out of a sandbox.", no_args_is_help=True)
machine_app = typer.Typer(help="Per-user machines that sleep when idle.", no_args_is_help=True)
snapshot_app = typer.Typer(help="Snapshots of running sandboxes.", no_args_is_help=True)
port_app = typer.Typer(help="Guest TCP ports reached over HTTP and WebSockets.",
                       no_args_is_help=True)
bench_app = typer.Typer(help="Measure this host: boots and their phases.", no_args_is_help=True)
desktop_app = typer.Typer(help="Screenshots, mouse and keyboard of a desktop sandbox.",
                          no_args_is_help=True)
app.add_typer(image_app, name="image")
app.add_typer(files_app, name="files")
app.add_typer(machine_app, name="machine")
app.add_typer(snapshot_app, name="snapshot")
app.add_typer(desktop_app, name="desktop")
app.add_typer(port_app, name="port")
app.add_typer(bench_app, name="bench")
app.add_typer(key_app, name="key")
app.add_typer(template_app, name="template")
app.add_typer(cluster_app, name="cluster")
app.add_typer(node_app, name="node")
app.add_typer(ops_cli.deploy_app, name="deploy")
app.command("backup")(ops_cli.backup)
app.command()(serve)
app.command()(status)
@image_app.command("build")
def image_build(
    recipe: Annotated[str, typer.Argument(help="Recipe name.")] = "base",
    force: Annotated[bool, typer.Option(
        help="Make a new build even if one of this recipe exists (a new id; the old "
             "build stays for what was made from it).")] = False,
    snapshot: Annotated[bool, typer.Option(
        help="Then boot it and save its template snapshot, which creates restore "
             "(else the server makes it on the first create).")] = True,
    data_dir: DataDir = None,
) -> None:
    """Build a guest image from a recipe (reused while the recipe is unchanged).

    Prints the build's id (NAME-DIGEST, the digest covering its bytes) and directory.
    """
    from hangar.layout import Layout

    layout = Layout(server_settings(data_dir).data_dir)
    layout.ensure()
    try:
        img = build_recipe(layout, recipe, force, snapshot=snapshot)
    except HangarError as exc:
        fail(exc)
    out.print(f"{img.id} {img.dir}")


@image_app.command("ls")
def image_ls(data_dir: DataDir = None) -> None:
    """List built images."""
    from hangar.images import list_images
    from hangar.layout import Layout

    import time

    table = Table("rootfs (MiB)", "kernel", "built", "state")
    table.columns.insert(0, Column("id", no_wrap=True, overflow="fold"))
    for i in list_images(Layout(server_settings(data_dir).data_dir)):
        state = "current" if i.current else ("stale" if i.stale else "")
        table.add_row(i.id, f"{i.rootfs_bytes / 2**20:.0f}", i.kernel_version,
                      time.strftime("%Y-%m-%d %H:%M", time.localtime(i.built_at)), state)
    out.print(table)


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

    layout = Layout(server_settings(data_dir).data_dir)
    try:
        result = collect(layout, pinned_images(layout), dry_run=dry_run)
    except HangarError as exc:
        fail(exc)
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
    with sdk() as h:
        sb = h.create(image, vcpus=vcpus, memory_mib=memory, disk_mib=disk, timeout=timeout,
                      desktop=desktop)
    out.print(sb.id)


@app.command("ls")
def ls() -> None:
    """List sandboxes."""
    with sdk() as h:
        boxes = h.list()
    table = Table("id", "state", "image", "vcpus", "memory (MiB)", "accel")
    for b in boxes:
        table.add_row(b.id, b.state, b.image, str(b.vcpus), str(b.memory_mib), b.accel)
    out.print(table)


@app.command("exec", context_settings={"allow_interspersed_args": False})
def exec_(
    sandbox_id: str,
    command: Annotated[list[str], typer.Argument(help="Command; one argument is a shell string.")],
    timeout: Annotated[Optional[float], typer.Option(help="Seconds.")] = None,
    cwd: Annotated[Optional[str], typer.Option()] = None,
    show: Annotated[bool, typer.Option(
        "--show-command", help="Let live events (hangar events) show the command.")] = False,
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
    with sdk() as h:
        for ev in h.exec_stream(sandbox_id, cmd, cwd=cwd, timeout=timeout, stdin=stdin,
                                show_command=show):
            if ev.type in ("stdout", "stderr"):
                stream = sys.stdout.buffer if ev.type == "stdout" else sys.stderr.buffer
                stream.write(ev.payload)
                stream.flush()
            elif ev.type == "exit":
                if ev.timed_out:
                    err.print("[yellow]command timed out[/yellow]")
                code = ev.exit_code if ev.exit_code is not None else 1
    raise typer.Exit(code)


@app.command(context_settings={"allow_interspersed_args": False})
def shell(
    sandbox_id: str,
    command: Annotated[Optional[list[str]], typer.Argument(
        help="Run this instead of a login shell; one argument is a shell string.")] = None,
    cwd: Annotated[Optional[str], typer.Option()] = None,
) -> None:
    """Open an interactive terminal in the sandbox; exits with the shell's exit code."""
    from hangar.cli import shell as cli_shell

    if command and command[0] == "--":
        command = command[1:]
    cmd = None if not command else command[0] if len(command) == 1 else shlex.join(command)
    with sdk() as h:
        code = cli_shell.run(h, sandbox_id, cmd, cwd)
    raise typer.Exit(code)


@app.command()
def rm(sandbox_ids: Annotated[list[str], typer.Argument()]) -> None:
    """Delete sandboxes. One that expired or is already deleted is where rm would leave it:
    that is said, and is no failure."""
    with sdk() as h:
        for sid in sandbox_ids:
            try:
                h.delete(sid)
            except Gone:
                out.print(f"{sid} had already expired; nothing to delete")
            except NotFound:
                out.print(f"no sandbox {sid} (already deleted, or never made); nothing to delete")
            else:
                out.print(f"deleted {sid}")


@app.command()
def ttl(sandbox_id: str,
        seconds: Annotated[float, typer.Argument(help="Seconds from now; 0: never.")]) -> None:
    """Set a sandbox's time to live, counted from now."""
    with sdk() as h:
        sb = h.set_timeout(sandbox_id, seconds)
    out.print(f"{sb.id} expires "
              + (time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(sb.expires_at))
                 if sb.expires_at else "never"))


@app.command()
def events(
    kind: Annotated[Optional[list[str]], typer.Option(
        "--kind", "-k", help="Only these kinds or prefixes (repeatable), e.g. exec, agent.")] = None,
    sandbox: Annotated[Optional[str], typer.Option(help="Only this sandbox.")] = None,
    since: Annotated[Optional[str], typer.Option(
        help="Replay what came after this event id first.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object a line.")] = False,
) -> None:
    """Follow what the server does, live: one line per event (Ctrl-C to stop).

    On a terminal, agent tasks and running commands stay at the bottom with
    their elapsed time.
    """
    from hangar.cli.events_view import EventView

    view = EventView()
    live = None
    if out.is_terminal and not as_json:
        from rich.live import Live
        from rich.text import Text

        live = Live(get_renderable=lambda: Text("\n".join(view.blocks()), style="bold"),
                    console=out, refresh_per_second=2, transient=True)
        live.start()
    try:
        with sdk() as h:
            for ev in h.events(kinds=kind or (), sandbox_id=sandbox, last_event_id=since):
                if as_json:
                    print(ev.model_dump_json(), flush=True)
                    continue
                line = view.line(ev)
                if live is not None:
                    live.console.print(line, highlight=False, markup=False)
                else:
                    print(line, flush=True)
    except KeyboardInterrupt:
        pass
    finally:
        if live is not None:
            live.stop()


@files_app.command("put")
def files_put(sandbox_id: str, local: Path, remote: str,
              mode: Annotated[Optional[str], typer.Option(help="Octal mode, e.g. 755.")] = None) -> None:
    """Copy a local file into the sandbox."""
    try:
        data = local.read_bytes()
    except OSError as exc:
        err.print(f"[red]error:[/red] cannot read {local}: {exc.strerror or exc}")
        raise typer.Exit(1) from None
    with sdk() as h:
        r = h.write_file(sandbox_id, remote, data, int(mode, 8) if mode else 0o644)
    out.print(f"{r.path}: {r.size} bytes")


@files_app.command("get")
def files_get(sandbox_id: str, remote: str,
              local: Annotated[Optional[Path], typer.Argument(help="Default: stdout.")] = None) -> None:
    """Copy a file out of the sandbox (to stdout when no local path is given)."""
    with sdk() as h:
        data = h.read_file(sandbox_id, remote)
    if local is None or str(local) == "-":
        sys.stdout.buffer.write(data)
    else:
        local.write_bytes(data)


@files_app.command("ls")
def files_ls(sandbox_id: str,
             path: Annotated[str, typer.Argument(help="Directory in the guest.")] = "/root") -> None:
    """List a directory in the sandbox."""
    with sdk() as h:
        entries = h.list_files(sandbox_id, path)
    table = Table("name", "type", "size", "mode")
    for e in entries:
        table.add_row(e.name, e.type, str(e.size), oct(e.mode))
    out.print(table)


@files_app.command("rm")
def files_rm(sandbox_id: str, path: str,
             recursive: Annotated[bool, typer.Option("-r", "--recursive")] = False) -> None:
    """Remove a file (or, with -r, a directory) in the sandbox."""
    with sdk() as h:
        h.remove_file(sandbox_id, path, recursive)


@files_app.command("mkdir")
def files_mkdir(sandbox_id: str, path: str) -> None:
    """Create a directory (and its parents) in the sandbox."""
    with sdk() as h:
        h.make_dir(sandbox_id, path)


def _machine_table(machines: list[MachineInfo]) -> None:
    table = Table("user", "sandbox", "state", "desired", "idle timeout (s)")
    for m in machines:
        table.add_row(m.user_id, m.sandbox_id, m.state, m.desired_state,
                      f"{m.idle_timeout_s:.0f}")
    out.print(table)


@machine_app.command("get")
def machine_get(user_id: str,
                idle: Annotated[Optional[float], typer.Option(help="Idle seconds before sleep.")] = None,
                ) -> None:
    """Get the user's machine, creating it if there is none."""
    with sdk() as h:
        _machine_table([h.get_or_create_machine(user_id, idle_timeout=idle)])


@machine_app.command("ls")
def machine_ls() -> None:
    """List users' machines."""
    with sdk() as h:
        _machine_table(h.list_machines())


@machine_app.command("show")
def machine_show(user_id: str) -> None:
    """Show the machine's state without changing it."""
    with sdk() as h:
        _machine_table([h.get_machine(user_id)])


@machine_app.command("sleep")
def machine_sleep(user_id: str) -> None:
    """Snapshot the machine and stop its VM."""
    with sdk() as h:
        _machine_table([h.sleep_machine(user_id)])


@machine_app.command("wake")
def machine_wake(user_id: str) -> None:
    """Restore the machine from its sleep snapshot."""
    with sdk() as h:
        _machine_table([h.wake_machine(user_id)])


@machine_app.command("rm")
def machine_rm(user_id: str) -> None:
    """Remove the machine and everything it held."""
    with sdk() as h:
        h.delete_machine(user_id)
    out.print(f"removed the machine of {user_id}")


@snapshot_app.command("create")
def snapshot_create(sandbox_id: str) -> None:
    """Snapshot a running sandbox and print the snapshot's id."""
    with sdk() as h:
        snap = h.snapshot(sandbox_id)
    out.print(f"{snap.id} ({snap.size_bytes / 2**20:.1f} MiB)")


@snapshot_app.command("ls")
def snapshot_ls(sandbox: Annotated[Optional[str], typer.Option(help="Only this sandbox's.")] = None,
                ) -> None:
    """List snapshots."""
    with sdk() as h:
        snaps = h.list_snapshots(sandbox)
    table = Table("id", "sandbox", "size (MiB)", "memory (MiB)")
    for s in snaps:
        table.add_row(s.id, s.sandbox_id, f"{s.size_bytes / 2**20:.1f}", str(s.memory_mib))
    out.print(table)


@snapshot_app.command("restore")
def snapshot_restore(sandbox_id: str, snapshot_id: str) -> None:
    """Bring a sandbox back to one of its snapshots."""
    with sdk() as h:
        h.restore(sandbox_id, snapshot_id)
    out.print(f"{sandbox_id} restored to {snapshot_id}")


@snapshot_app.command("fork")
def snapshot_fork(snapshot_id: str) -> None:
    """Start a new sandbox from a snapshot and print its id."""
    with sdk() as h:
        sb = h.fork(snapshot_id)
    out.print(sb.id)


@snapshot_app.command("rm")
def snapshot_rm(snapshot_id: str) -> None:
    """Delete a snapshot."""
    with sdk() as h:
        h.delete_snapshot(snapshot_id)
    out.print(f"deleted {snapshot_id}")


@port_app.command("expose")
def port_expose(sandbox_id: str, port: int,
                public: Annotated[bool, typer.Option(
                    "--public", help="Open to anyone with the URL (default: private).")] = False,
                signed: Annotated[bool, typer.Option(
                    "--signed", help="Print a URL with a token (private ports), for a browser.")]
                = False,
                ttl: Annotated[Optional[float], typer.Option(
                    help="Seconds the signed URL works (server default 3600).")] = None) -> None:
    """Expose a guest TCP port and print its URL."""
    with sdk() as h:
        info = h.expose(sandbox_id, port, public, token_ttl=ttl)
    out.print(info.signed_url if signed and info.signed_url else info.url, soft_wrap=True)


@port_app.command("ls")
def port_ls(sandbox_id: str) -> None:
    """List a sandbox's exposed ports."""
    with sdk() as h:
        ports = h.ports(sandbox_id)
    table = Table("port", "public")
    table.columns.append(Column("url", no_wrap=True, overflow="fold"))
    for p in ports:
        table.add_row(str(p.port), "yes" if p.public else "no", p.url)
    out.print(table)


@port_app.command("close")
def port_close(sandbox_id: str, port: int) -> None:
    """Stop exposing a port (its URLs answer 404)."""
    with sdk() as h:
        h.close_port(sandbox_id, port)
    out.print(f"closed port {port} of {sandbox_id}")


@app.command()
def doctor(data_dir: DataDir = None) -> None:
    """Say what this host offers (KVM, VMMs and their versions) and which engine auto picks."""
    from hangar.engines.doctor import diagnose
    from hangar.images import resolve_image
    from hangar.layout import Layout
    from hangar.net import doctor_lines

    settings = server_settings(data_dir)
    layout = Layout(settings.data_dir)
    try:
        image = resolve_image(layout, "base")
    except HangarError:
        image = None
    from hangar.engines.confine import config_from

    for line in diagnose(layout, image, confine=config_from(settings),
                         jailer_mode=settings.firecracker_jailer).lines():
        print(line)
    for line in doctor_lines(settings.network, user_open=settings.net_user_open,
                             bridge=settings.net_bridge, pool=settings.net_pool):
        print(line)
    from hangar.ops.checklist import host_checklist, lines

    for line in lines(host_checklist(data_dir=layout.root, image=settings.default_image,
                                     bridge=settings.net_bridge, host=settings.host,
                                     port=settings.port)):
        print(line)


@bench_app.command("boot")
def bench_boot(
    runs: Annotated[int, typer.Option(min=1, max=50, help="Boots, one after the other.")] = 3,
    image: Annotated[Optional[str], typer.Option(help="Image (default: the server's).")] = None,
    memory_mib: Annotated[int, typer.Option(min=128, help="Guest memory, MiB.")] = 512,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    data_dir: DataDir = None,
) -> None:
    """Boot guests straight on the engine (no server) and print each boot's phases.

    The phases are those every boot logs (vmm, kernel, initramfs, init, agent;
    seconds), plus the time to the first command's result.
    """
    import asyncio
    import json as json_

    from hangar.engines.bootbench import bench_boot as run_bench
    from hangar.engines.confine import config_from as confine_config
    from hangar.engines.doctor import choose_engine
    from hangar.engines.qemu import MemoryTuning
    from hangar.images import resolve_image
    from hangar.layout import Layout

    settings = server_settings(data_dir)
    layout = Layout(settings.data_dir)
    try:
        img = resolve_image(layout, image or settings.default_image)
        engine = choose_engine(settings.engine, layout, img, accel=settings.accel,
                               jailer=settings.firecracker_jailer,
                               confine=confine_config(settings), tuning=MemoryTuning(
                                   tb_mib=settings.tcg_tb_mib, balloon=settings.balloon,
                                   ksm=settings.ksm))
        report = asyncio.run(run_bench(engine, img, runs, memory_mib))
    except HangarError as exc:
        fail(exc)
    if as_json:
        print(json_.dumps(report, indent=2))
        return
    from rich.table import Table

    eng = report["engine"]
    table = Table(title=f"{runs} boots of {report['image']}, {memory_mib} MiB, "
                        f"{eng['engine']} ({eng['accel']}); seconds")
    cols = list(report["median"])
    table.add_column("run")
    for c in cols:
        table.add_column(c, justify="right")
    for n, r in enumerate(report["runs"], 1):
        table.add_row(str(n), *(f"{r.get(c, 0):.2f}" for c in cols))
    table.add_row("median", *(f"{report['median'][c]:.2f}" for c in cols), style="bold")
    out.print(table)


@app.command()
def mcp(
    tier: Annotated[str, typer.Option(help="Tool tier: in-process, vm or browser.")] = "vm",
    transport: Annotated[str, typer.Option(help="stdio, or http (streamable HTTP at /mcp).")]
    = "stdio",
    host: Annotated[str, typer.Option(help="Address for http; beyond loopback set "
                                           "HANGAR_MCP_TOKEN.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port for http.")] = 8765,
    user_id: Annotated[str, typer.Option("--user", help="User id the tasks are made for.")]
    = "mcp",
    name: Annotated[str, typer.Option(help="Task name shown in events.")] = "MCP session",
    max_tool_calls: Annotated[Optional[int], typer.Option(help="Cost guard: tool calls per "
                                                                "session.")] = 200,
    max_wall_s: Annotated[Optional[float], typer.Option(help="Cost guard: seconds per "
                                                             "session.")] = 3600.0,
    idle_timeout: Annotated[float, typer.Option(help="http: seconds before an idle session "
                                                     "(and its VM) ends.")] = 1800.0,
) -> None:
    """Serve the agent tools over MCP: one task (one sandbox) per session, released when the
    session closes. Talks to the Hangar server at HANGAR_URL with HANGAR_API_KEY or the key
    file."""
    import asyncio

    from hangar.tools.definitions import check_tier
    from hangar.tools.limits import Limits
    from hangar.tools import mcp_server

    try:
        check_tier(tier)
    except ValueError as exc:
        err.print(f"error: {exc}")
        raise typer.Exit(2) from None
    limits = Limits(max_tool_calls=max_tool_calls, max_wall_s=max_wall_s, max_tokens=None)
    if transport == "stdio":
        asyncio.run(mcp_server.serve_stdio(tier, user_id, name, limits=limits))
    elif transport == "http":
        import uvicorn

        try:
            app_ = mcp_server.http_app(tier, user_id, name, host=host, idle_timeout_s=idle_timeout,
                                       limits=limits)
        except ValueError as exc:
            err.print(f"error: {exc}")
            raise typer.Exit(2) from None
        uvicorn.run(app_, host=host, port=port, log_level="warning")
    else:
        err.print(f"error: unknown transport {transport!r}; choose stdio or http")
        raise typer.Exit(2)


@desktop_app.command("screenshot")
def desktop_screenshot(sandbox_id: str, out_file: Path,
                       width: Annotated[Optional[int], typer.Option(help="Scale to pixels.")] = None,
                       ) -> None:
    """Save a PNG screenshot of the sandbox's desktop."""
    with sdk() as h:
        png = h.screenshot(sandbox_id, width)
    out_file.write_bytes(png)
    out.print(f"{out_file}: {len(png)} bytes")


@desktop_app.command("click")
def desktop_click(sandbox_id: str, x: int, y: int,
                  button: Annotated[str, typer.Option(help="left, middle or right")] = "left",
                  double: bool = False) -> None:
    """Click at (x, y), pixels."""
    if button not in ("left", "middle", "right"):
        err.print("[red]error:[/red] button must be left, middle or right")
        raise typer.Exit(2)
    with sdk() as h:
        h.click(sandbox_id, x, y, button, double)  # type: ignore[arg-type]


@desktop_app.command("move")
def desktop_move(sandbox_id: str, x: int, y: int) -> None:
    """Move the pointer to (x, y), pixels."""
    with sdk() as h:
        h.move(sandbox_id, x, y)


@desktop_app.command("drag")
def desktop_drag(sandbox_id: str, from_x: int, from_y: int, to_x: int, to_y: int) -> None:
    """Drag with the left button from one point to another, pixels."""
    with sdk() as h:
        h.drag(sandbox_id, from_x, from_y, to_x, to_y)


@desktop_app.command("type")
def desktop_type(sandbox_id: str, text: str) -> None:
    """Type text (any Unicode) into the focused window."""
    with sdk() as h:
        h.type(sandbox_id, text)


@desktop_app.command("key")
def desktop_key(sandbox_id: str, keys: str) -> None:
    """Press a key or combination, e.g. ctrl+shift+t or enter."""
    with sdk() as h:
        h.key(sandbox_id, keys)


@desktop_app.command("scroll")
def desktop_scroll(sandbox_id: str, direction: str, amount: int = 3) -> None:
    """Scroll up, down, left or right by wheel clicks."""
    if direction not in ("up", "down", "left", "right"):
        err.print("[red]error:[/red] direction must be up, down, left or right")
        raise typer.Exit(2)
    with sdk() as h:
        h.scroll(sandbox_id, direction, amount)  # type: ignore[arg-type]


@desktop_app.command("show")
def desktop_show(sandbox_id: str) -> None:
    """Screen size and cursor position."""
    with sdk() as h:
        d = h.display(sandbox_id)
    out.print(f"{d.width}x{d.height}x{d.depth}, cursor at ({d.cursor_x}, {d.cursor_y})")


@desktop_app.command("vnc")
def desktop_vnc(sandbox_id: str, view_only: bool = False) -> None:
    """Print a single-use ticket URL (valid 30 s) for the live view's WebSocket."""
    with sdk() as h:
        t = h.vnc_ticket(sandbox_id, view_only)
    out.print(h.base_url + t.url)
