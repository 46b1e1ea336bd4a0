"""The sandbox commands on the ``hangar`` app itself (through the SDK): ``create``, ``ls``,
``exec``, ``shell``, ``rm``, ``ttl``, ``network``, ``events``. ``hangar.cli.main`` registers
them."""

from __future__ import annotations

import os
import shlex
import sys
import time
from typing import Annotated, Any, Optional

import typer
from rich.table import Table

from hangar.cli.common import err, out, sdk
from hangar.errors import Gone, NotFound


def create(
    image: Annotated[Optional[str], typer.Option(help="Template name.")] = None,
    desktop: Annotated[Optional[str], typer.Option(
        help="Start a desktop, WIDTHxHEIGHTxDEPTH, e.g. 1280x800x24 (image 'desktop').")] = None,
    vcpus: Annotated[Optional[int], typer.Option()] = None,
    memory: Annotated[Optional[int], typer.Option(help="Memory, MiB.")] = None,
    disk: Annotated[Optional[int], typer.Option(help="Disk, MiB.")] = None,
    timeout: Annotated[Optional[float], typer.Option(help="Time to live, seconds.")] = None,
    volume: Annotated[Optional[list[str]], typer.Option(
        "--volume", "-v", help="Mount a named volume: PATH=VOLUME, or PATH=VOLUME:ro for a "
                               "read-only mount (repeatable, at most 4).")] = None,
    egress: Annotated[Optional[str], typer.Option(
        help="Egress mode: none, internet (default), open.")] = None,
    allow: Annotated[Optional[list[str]], typer.Option(
        help="Egress allow entry: CIDR, domain (*.example.com), optionally :PORT "
             "(repeatable).")] = None,
    deny: Annotated[Optional[list[str]], typer.Option(
        help="Egress deny entry, same forms (repeatable); --deny 0.0.0.0/0 makes --allow "
             "an allowlist.")] = None,
    secret: Annotated[Optional[list[str]], typer.Option(
        "--secret", "-s", help="Give it a vault secret: ENV=NAME (its commands see a "
                               "placeholder in ENV; repeatable).")] = None,
) -> None:
    """Create a sandbox and print its id."""
    from hangar.cli.secret import parse_secrets
    from hangar.cli.volume import parse_mounts
    network = None
    if egress or allow or deny:
        network = {"egress": egress or "internet", "allow": allow or [], "deny": deny or []}
    with sdk() as h:
        sb = h.create(image, vcpus=vcpus, memory_mib=memory, disk_mib=disk, timeout=timeout,
                      desktop=desktop, volumes=parse_mounts(volume or []) or None,
                      network=network,
                      secrets=parse_secrets(secret or []) or None)
    out.print(sb.id)


def ls() -> None:
    """List sandboxes."""
    with sdk() as h:
        boxes = h.list()
    teams = any(b.team for b in boxes)  # an operator's list of a shared server: whose is it
    table = Table("id", "state", "image", "vcpus", "memory (MiB)", "accel",
                  *(("team",) if teams else ()))
    for b in boxes:
        table.add_row(b.id, b.state, b.image, str(b.vcpus), str(b.memory_mib), b.accel,
                      *((b.team or "-",) if teams else ()))
    out.print(table)


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


def ttl(sandbox_id: str,
        seconds: Annotated[float, typer.Argument(help="Seconds from now; 0: never.")]) -> None:
    """Set a sandbox's time to live, counted from now."""
    with sdk() as h:
        sb = h.set_timeout(sandbox_id, seconds)
    out.print(f"{sb.id} expires "
              + (time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(sb.expires_at))
                 if sb.expires_at else "never"))


def network(
    sandbox_id: str,
    allow: Annotated[Optional[list[str]], typer.Option(
        help="Add an allow entry (repeatable): CIDR, domain (*.example.com), optionally "
             ":PORT.")] = None,
    deny: Annotated[Optional[list[str]], typer.Option(
        help="Add a deny entry (repeatable), same forms.")] = None,
    remove: Annotated[Optional[list[str]], typer.Option(
        help="Remove an entry from both lists (repeatable).")] = None,
    clear: Annotated[bool, typer.Option(help="Empty both lists first.")] = False,
    egress: Annotated[Optional[str], typer.Option(help="internet or open.")] = None,
) -> None:
    """Show a sandbox's egress rules, or change them while it runs (new connections see
    the change within a second). Entries are added to the lists as they are (--clear
    first to replace them), so a change never drops a deny entry unasked."""
    with sdk() as h:
        rules = h.get(sandbox_id).network
        if allow is None and deny is None and remove is None and egress is None and not clear:
            if rules is None:
                out.print(f"{sandbox_id}: no network")
                return
        else:
            now: dict[str, Any] = dict(rules or {})
            lists: dict[str, list[str]] = {
                key: [] if clear else [str(e) for e in now.get(key) or []]
                for key in ("allow", "deny")}
            for key, added in (("allow", allow), ("deny", deny)):
                lists[key] += [e for e in added or [] if e not in lists[key]]
            for e in remove or []:
                if not any(e in lists[key] for key in lists):
                    err.print(f"{e}: in neither list, nothing removed")
            for key in lists:
                lists[key] = [e for e in lists[key] if e not in (remove or [])]
            rules = h.update_network(sandbox_id, allow=lists["allow"], deny=lists["deny"],
                                     egress=egress).model_dump()
    out.print(f"egress {rules.get('egress')}")
    for key in ("allow", "deny"):
        out.print(f"{key}: {', '.join(rules.get(key) or []) or '-'}")


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
