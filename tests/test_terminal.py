"""Terminals, file watching and the dashboard, on one real desktop VM and real Chromium.

One 1024x768 desktop sandbox (the ``desktop`` image has nano, and a screen
for the dashboard's live view) serves the module; the dashboard test, which
deletes it from the page, runs last. ``hangar shell`` runs on a pseudo-terminal
that the test owns (``os.openpty``), through a TCP proxy the test can cut.
Without a VM: the agent's pty and watch operations on this host.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import select
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from conftest import SHARED, SRC, Server, Waits
from tcpproxy import TcpProxy

from hangar.client import Hangar
from hangar.errors import NotFound, Unavailable

W, H = 1024, 768
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
vm = pytest.mark.vm
STEP_S = 30.0
"""How long the desktop guest may take to show a terminal's new size, output made while
detached, or a hang-up after the grace, seconds: set from this machine's measured create by
``desk`` (20 creates, never under the 30 s of a quiet machine)."""


@pytest.fixture(scope="session")
def desktop_build(base_image: Path) -> Path:
    """The desktop image in the shared cache (built the first time: minutes)."""
    from hangar.images import build_image
    from hangar.layout import Layout

    return build_image(Layout(SHARED), "desktop",
                       progress=lambda m: print(f"image: {m}", file=sys.stderr)).dir


@pytest.fixture(scope="module")
def sdk(server: Server) -> Iterator[Hangar]:
    with Hangar(server.url, server.key) as h:
        yield h


@pytest.fixture(scope="module")
def desk(sdk: Hangar, desktop_build: Path, waits: Waits) -> Iterator[str]:
    global STEP_S
    STEP_S = waits.vm(20, floor=30)
    sb = sdk.create("desktop", desktop=f"{W}x{H}x24", memory_mib=1024, timeout=1800)
    try:
        yield sb.id
    finally:
        try:
            sdk.delete(sb.id)
        except NotFound:
            pass  # the dashboard test deleted it


# -- hangar shell, on a pseudo-terminal of the test's own ------------------------------------------


class Pty:
    """``hangar shell`` as a user runs it: on a terminal, with a size, reading keys."""

    def __init__(self, argv: list[str], env: dict[str, str], cols: int = 80, rows: int = 24):
        self.master, slave = os.openpty()
        self.resize(cols, rows, fd=slave)
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env,
                                     start_new_session=True,
                                     preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
        os.close(slave)
        self.seen = b""

    def resize(self, cols: int, rows: int, fd: int | None = None) -> None:
        fcntl.ioctl(self.master if fd is None else fd, termios.TIOCSWINSZ,
                    struct.pack("HHHH", rows, cols, 0, 0))

    def write(self, data: str | bytes) -> None:
        os.write(self.master, data.encode() if isinstance(data, str) else data)

    def expect(self, marker: str | bytes, timeout: float = 60) -> bytes:
        """Output up to ``marker`` (what came after it stays for the next call)."""
        want = marker.encode() if isinstance(marker, str) else marker
        deadline = time.monotonic() + timeout
        while want not in self.seen:
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None and not select.select(
                    [self.master], [], [], 0)[0]:
                pytest.fail(f"{want!r} did not appear; the terminal shows {self.seen[-800:]!r}")
            if select.select([self.master], [], [], min(left, 0.5))[0]:
                try:
                    self.seen += os.read(self.master, 1 << 16)
                except OSError:  # EIO: the program closed the terminal
                    pass
        i = self.seen.index(want) + len(want)
        out, self.seen = self.seen[:i], self.seen[i:]
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.master)


@vm
def test_hangar_shell_tty_resize_nano_reconnect_and_exit_code(server: Server, sdk: Hangar,
                                                             desk: str) -> None:
    proxy = TcpProxy(server.port)
    env = {**os.environ, "HANGAR_URL": proxy.url, "HANGAR_API_KEY": server.key,
           "PYTHONPATH": str(SRC), "TERM": "xterm-256color"}
    t = Pty([sys.executable, "-m", "hangar.cli", "shell", desk], env, cols=80, rows=24)
    try:
        t.expect("# ")  # bash's prompt
        t.write("tty; stty size\r")
        assert b"/dev/pts/" in t.expect("24 80")
        t.resize(100, 40)  # SIGWINCH to hangar shell: it sends the new size
        deadline = time.monotonic() + STEP_S
        while b"40 100" not in t.expect("# "):
            assert time.monotonic() < deadline, "the new size never reached the guest"
            t.write("stty size\r")
        # A full-screen program: nano draws on the alternate screen and saves what is typed.
        t.write("nano /root/from-nano.txt\r")
        assert b"\x1b[?1049h" in t.expect("GNU nano")
        t.expect("^X")  # its shortcut bar is drawn
        t.write("typed in nano")
        t.write(b"\x0f")  # ctrl+o: write out
        t.expect("File Name to Write")
        t.write("\r")
        t.expect("Wrote")
        t.write(b"\x18")  # ctrl+x: exit
        t.expect("# ")
        assert sdk.read_file(desk, "/root/from-nano.txt") == b"typed in nano\n"
        # The connection drops while a command runs: its output comes after the reattach.
        t.write("sleep 0.5; echo after-the-cut-$((6*7))\r")
        t.expect("sleep 0.5")
        proxy.cut()
        t.expect("after-the-cut-42", timeout=60)
        assert proxy.connections >= 2  # it connected again
        t.write("exit 3\r")
        assert t.proc.wait(60) == 3
    finally:
        t.close()
        proxy.close()


@vm
def test_hangar_shell_without_a_terminal_takes_stdin_from_a_file_or_dev_null(
        server: Server, desk: str, tmp_path: Path) -> None:
    env = {**os.environ, "HANGAR_URL": server.url, "HANGAR_API_KEY": server.key,
           "PYTHONPATH": str(SRC)}
    cmd = [sys.executable, "-m", "hangar.cli", "shell", desk, "--"]
    with open(os.devnull) as null:  # cron, CI, nohup: nothing to read, no terminal
        r = subprocess.run([*cmd, "stty size; exit 4"], stdin=null, env=env,
                           capture_output=True, timeout=120)
    assert r.returncode == 4, r.stderr
    assert b"24 80" in r.stdout and b"Traceback" not in r.stderr
    script = tmp_path / "input"
    script.write_text("read line; echo got-$line; exit 5\nhello\n")
    with open(script) as f:  # a regular file: read whole, then end of input
        r = subprocess.run([*cmd, "sh"], stdin=f, env=env, capture_output=True, timeout=120)
    assert r.returncode == 5 and b"got-hello" in r.stdout, (r.stdout, r.stderr)


# -- the SDK's terminal --------------------------------------------------------------------------


@vm
def test_sdk_terminal_reattach_takeover_and_replay(sdk: Hangar, desk: str) -> None:
    term = sdk.terminal(desk, cols=100, rows=30)
    sid = term.session_id
    term.send("echo ready-$((1+1))\n")
    term.read_until("ready-2")
    term.send("sleep 1; echo produced-while-away-$((7*6))\n")
    term.read_until("sleep 1")
    seen = term.offset
    term.close()  # no viewer now; the program goes on
    deadline = time.monotonic() + STEP_S
    while sdk.pty_get(desk, sid).output_bytes < seen + len("produced-while-away-42"):
        assert time.monotonic() < deadline, "no output while detached"
        time.sleep(0.2)
    info = sdk.pty_get(desk, sid)
    assert info.state == "running" and not info.attached
    term.reattach()  # from the last byte received
    assert term.offset == seen and term.dropped == 0
    term.read_until("produced-while-away-42")
    # A second viewer takes over; the first one's connection is closed.
    other = sdk.pty_attach(desk, sid, offset=0)  # replays the session from its first byte
    assert other.read_until("ready-2")
    with pytest.raises(Unavailable):
        while True:
            term.recv(timeout=10)
    other.send("exit 4\n")
    assert other.wait(30) == 4
    with pytest.raises(NotFound):  # ended and its exit code delivered: gone
        sdk.pty_get(desk, sid)
    # A command instead of a shell; the exit code of a signal.
    cmd = sdk.terminal(desk, "echo $TERM $COLUMNS; kill -TERM $$", cols=33, rows=7)
    assert cmd.read_until("xterm-256color")
    assert cmd.wait(30) == 128 + 15


@vm
def test_terminal_grace_period_and_limits(sdk: Hangar, desk: str) -> None:
    s = sdk.pty_open(desk, "sleep 600", grace=1)
    deadline = time.monotonic() + STEP_S
    while any(x.id == s.id for x in sdk.pty_list(desk)):
        assert time.monotonic() < deadline, "a session without a viewer outlived its grace"
        time.sleep(0.5)
    r = sdk.exec(desk, "pgrep -x sleep || echo none")
    assert r.stdout.strip() == "none", r.stdout  # its program was hung up too
    from hangar.errors import InvalidRequest, LimitExceeded

    with pytest.raises(InvalidRequest, match="command not found"):
        sdk.pty_open(desk, "no-such-program", args=[])
    opened = [sdk.pty_open(desk, "sleep 600", grace=600) for _ in range(16)]
    try:
        with pytest.raises(LimitExceeded):
            sdk.pty_open(desk)
    finally:
        for s in opened:
            sdk.pty_close(desk, s.id)
    assert sdk.pty_list(desk) == []


@vm
def test_terminal_websocket_refuses_hostile_clients(server: Server, sdk: Hangar,
                                                    desk: str) -> None:
    import websockets

    base = server.url.replace("http://", "ws://")
    s = sdk.pty_open(desk, grace=60)
    path = f"/sandboxes/{desk}/pty/{s.id}"

    async def status(url: str, **kw: object) -> int:
        try:
            async with websockets.connect(url, **kw):  # type: ignore[arg-type]
                return 101
        except websockets.exceptions.InvalidStatus as e:
            return e.response.status_code

    def ticket() -> str:
        return sdk.pty_ticket(desk, s.id).ticket

    assert asyncio.run(status(base + path)) == 401
    assert asyncio.run(status(base + path + "?ticket=forged")) == 401
    t = ticket()
    assert asyncio.run(status(f"{base}/sandboxes/sb-000000000000/pty/{s.id}?ticket={t}")) == 401
    t = ticket()  # a ticket of this session does not open another one
    assert asyncio.run(status(f"{base}/sandboxes/{desk}/pty/pty-00?ticket={t}")) == 401
    vnc = sdk.vnc_ticket(desk).ticket  # nor does a desktop ticket
    assert asyncio.run(status(f"{base}{path}?ticket={vnc}")) == 401
    assert asyncio.run(status(f"{base}{path}?ticket={ticket()}",
                              origin="http://evil.example")) == 403
    assert asyncio.run(status(f"{base}{path}?ticket={ticket()}&offset=-1")) == 400
    r = httpx.post(f"{server.url}{path}/tickets")
    assert r.status_code == 401

    async def hostile(url: str) -> list[int]:
        codes = []
        for frame in (os.urandom(1 << 20), "x" * (1 << 17), "{not json", json.dumps(
                {"type": "resize", "cols": 0, "rows": 10**9})):
            async with websockets.connect(url(), max_size=None) as ws:
                await ws.recv()  # attached
                await ws.send(frame)
                try:
                    while True:
                        await asyncio.wait_for(ws.recv(), 30)
                except websockets.ConnectionClosed as e:
                    codes.append(e.rcvd.code if e.rcvd else 0)
        return codes

    codes = asyncio.run(hostile(lambda: f"{base}{path}?ticket={ticket()}"))
    assert codes == [1009, 1009, 1003, 1003], codes
    # The session and the server are unharmed.
    term = sdk.pty_attach(desk, s.id)
    term.send("echo still-$((2*3))\n")
    term.read_until("still-6")
    term.kill()
    assert sdk.health().status == "ok"


# -- file watching -------------------------------------------------------------------------------


@vm
def test_watch_reports_create_modify_delete_in_order_within_a_second(sdk: Hangar,
                                                                     desk: str) -> None:
    sdk.make_dir(desk, "/root/watched/sub")
    with sdk.watch_files(desk, "/root/watched", recursive=True) as w:
        seen: list[tuple[str, str, float]] = []
        a, b = "/root/watched/a.txt", "/root/watched/sub/b.txt"
        steps = [(f"echo one > {a}", [("create", a), ("modify", a)]),
                 (f"echo two >> {a}", [("modify", a)]),
                 (f"mv {a} {b}", [("move", b)]),
                 (f"rm {b}", [("delete", b)])]
        events = iter(w)
        for command, expected in steps:
            sdk.exec(desk, command)
            done = time.monotonic()  # the change has certainly happened by now
            for kind, path in expected:
                ev = next(events)
                took = time.monotonic() - done
                seen.append((ev.type, ev.path, round(took, 3)))
                assert (ev.type, ev.path) == (kind, path), seen
                assert took < 1.0, seen
            if ev.type == "move":
                assert ev.old_path == a
    # Server-Sent Events by default; a missing path is a 404 before any stream.
    r = sdk.list_files(desk, "/root/watched")
    assert [e.name for e in r] == ["sub"]
    with httpx.Client(base_url=sdk.base_url, headers={"X-API-Key": sdk.config.api_key},
                      timeout=60) as c:
        with c.stream("GET", f"/sandboxes/{desk}/files/watch",
                      params={"path": "/root/watched"}) as s:
            assert s.headers["content-type"].startswith("text/event-stream")
            sdk.exec(desk, "touch /root/watched/c")
            for line in s.iter_lines():
                if line.startswith("data: "):
                    assert json.loads(line[6:])["path"] == "/root/watched/c"
                    break
        r = c.get(f"/sandboxes/{desk}/files/watch", params={"path": "/root/no-such"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


# -- the agent's operations on this host (no VM) -------------------------------------------------


@pytest.fixture
def agent_sock(tmp_path: Path) -> Iterator[Path]:
    sock = tmp_path / "agent.sock"
    proc = subprocess.Popen([sys.executable, "-m", "hangar.guest.agent", "--listen", str(sock)],
                            env={**os.environ, "PYTHONPATH": str(SRC)},
                            stderr=subprocess.DEVNULL)
    try:
        yield sock
    finally:
        proc.kill()
        proc.wait()


def test_agent_pty_sizes_signals_hang_up_and_backlog(agent_sock: Path) -> None:
    from hangar.engines.agent_client import AgentClient
    from hangar.errors import InvalidRequest

    async def body() -> None:
        c = await AgentClient.connect(agent_sock, 20)
        try:
            p = await c.open_pty({"shell": "stty size; read x; echo got-$x; exit 9",
                                  "cols": 120, "rows": 50})
            out = b""
            while b"50 120" not in out:
                out += await asyncio.wait_for(p.read(), 10)
            await p.write(b"abc\n")
            while (chunk := await asyncio.wait_for(p.read(), 10)):
                out += chunk
            assert b"got-abc" in out and p.exit is not None and p.exit.exit_code == 9
            # A hang-up ends even a program that ignores SIGHUP (SIGKILL after 2 s).
            p = await c.open_pty({"shell": "trap '' HUP; echo armed; sleep 60"})
            while b"armed" not in await asyncio.wait_for(p.read(), 10):
                pass
            await p.hang_up()
            while await asyncio.wait_for(p.read(), 10):
                pass
            assert p.exit is not None and p.exit.exit_code == 128 + 9
            # Input for a program that never reads is bounded: once the pty's buffer is
            # full (raw mode: the line discipline discards nothing), what waits is dropped
            # after 5 s without a byte read, and so is the rest; the writer is let go.
            p = await c.open_pty({"shell": "stty raw -echo; echo ready; sleep 30"})
            while b"ready" not in await asyncio.wait_for(p.read(), 10):
                pass
            await asyncio.wait_for(p.write(b"x" * (4 << 20)), 30)
            await p.kill(15)
            while await asyncio.wait_for(p.read(), 10):
                pass
            assert p.exit is not None and p.exit.input_dropped >= 1 << 20
            for bad in ({"cols": 0}, {"rows": 5000}, {"cols": "80"}, {"argv": ["no-such"]},
                        {"shell": "true", "cwd": "/etc/hostname"}):
                with pytest.raises(InvalidRequest):
                    await c.open_pty(bad)
        finally:
            await c.close()

    asyncio.run(body())


def test_agent_watch_moves_folders_and_the_end(agent_sock: Path, tmp_path: Path) -> None:
    from hangar.engines.agent_client import AgentClient
    from hangar.errors import NotFound as Missing

    root = tmp_path / "w"
    (root / "old").mkdir(parents=True)

    async def body() -> list[tuple[str, str]]:
        c = await AgentClient.connect(agent_sock, 20)
        try:
            with pytest.raises(Missing):
                await c.open_watch(str(tmp_path / "none"), False)
            w = await c.open_watch(str(root), True)
            got: list[tuple[str, str]] = []

            async def until(n: int) -> None:
                while len(got) < n:
                    batch = await asyncio.wait_for(w.next(), 10)
                    assert batch is not None
                    got.extend((e["type"], e["path"].removeprefix(str(root))) for e in batch)

            (root / "old").rename(root / "new")
            await until(1)
            (root / "new" / "deep").mkdir()
            await until(2)
            (root / "new" / "deep" / "f").write_text("x")
            await until(4)
            (root / "new" / "deep" / "f").unlink()
            await until(5)
            import shutil

            shutil.rmtree(root)
            while (batch := await asyncio.wait_for(w.next(), 10)) is not None:
                got += [(e["type"], e["path"].removeprefix(str(root))) for e in batch]
            assert w.ended == "deleted"
            return got
        finally:
            await c.close()

    got = asyncio.run(body())
    assert got[:5] == [("move", "/new"), ("create", "/new/deep"), ("create", "/new/deep/f"),
                       ("modify", "/new/deep/f"), ("delete", "/new/deep/f")], got
    assert got[-1] == ("delete", ""), got


# -- the dashboard, in Chromium (last: it deletes the module's sandbox) ------------------------

SHOT_ENV = "HANGAR_DASHBOARD_SCREENSHOT"
"""When set, the dashboard test saves a screenshot there (docs/dashboard.png is made so)."""


@vm
def test_dashboard_lists_opens_terminal_and_desktop_and_deletes(server: Server, sdk: Hangar,
                                                                desk: str) -> None:
    pytest.importorskip("playwright")
    for need in (CHROMIUM, "/usr/share/novnc/core/rfb.js", "/usr/share/nodejs/xterm/lib"):
        if not Path(need).exists():
            pytest.skip(f"needs Debian's chromium, novnc and node-xterm ({need})")
    from playwright.sync_api import sync_playwright

    key = server.key
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            urls: list[str] = []
            page.on("websocket", lambda ws: urls.append(ws.url))
            page.on("request", lambda r: urls.append(r.url))
            page.on("dialog", lambda d: d.accept())
            # An exposed (private) port shows as a link carrying its signed URL.
            exposed = sdk.expose(desk, 3000)
            page.goto(server.url + "/ui/")
            page.fill("#api-key", key)
            page.click("#key-form button[type=submit]")
            row = f'tr[data-id="{desk}"]'
            page.wait_for_selector(row, timeout=30_000)
            assert "desktop" in page.inner_text(row) and "1024 MiB" in page.inner_text(row)
            # An agent task shows with its tier, from the live event stream.
            sdk.publish_event("agent.task.started", desk, task_id="t-dash", name="Dash Runner",
                              tier="vm")
            page.wait_for_selector('#tasks tr[data-task="t-dash"] >> text=vm', timeout=30_000)
            # The terminal: a shell over the PTY WebSocket, typed into like a user.
            page.click(f'{row} button[data-action="terminal"]')
            page.wait_for_selector('#terminal-status[data-state="connected"]', timeout=60_000)
            page.wait_for_function(
                "() => document.querySelector('#terminal .xterm-rows').textContent.includes('#')",
                timeout=60_000)
            page.click("#terminal")
            page.keyboard.type("echo hi")
            page.keyboard.press("Enter")
            page.wait_for_function("""() => [...document.querySelectorAll(
                '#terminal .xterm-rows > div')].some(r => r.textContent.trim() === 'hi')""",
                timeout=30_000)
            links = page.eval_on_selector_all("#ports a", "as => as.map(a => a.href)")
            assert len(links) == 1 and links[0].startswith(exposed.url), links
            assert "hangar_token=" in links[0] and key not in links[0], links
            shot = os.environ.get(SHOT_ENV)
            if shot:
                page.screenshot(path=shot, full_page=True)
            # The live desktop: noVNC draws the guest's screen.
            page.click(f'{row} button[data-action="view"]')
            page.wait_for_selector('#viewer-status[data-state="connected"]', timeout=90_000)
            page.wait_for_selector("#screen canvas", timeout=30_000)
            sdk.publish_event("agent.task.ended", desk, task_id="t-dash", reason="done")
            page.wait_for_selector('#tasks tr[data-task="t-dash"]', state="detached",
                                   timeout=30_000)
            # Delete from the page: the sandbox goes, and so does its row; a terminal and
            # a file watch still open on it end.
            left = sdk.terminal(desk)
            watch = sdk.watch_files(desk, "/root").open()
            page.click(f'{row} button[data-action="delete"]')
            page.wait_for_selector(row, state="detached", timeout=120_000)
            with pytest.raises(NotFound):
                sdk.get(desk)
            assert left.wait(60) is None  # no exit code: the guest went away
            assert list(watch) == []
            assert page.evaluate("() => sessionStorage.getItem('hangar.apiKey')") == key
            assert all(key not in u for u in urls) and any("/pty/" in u for u in urls)
        finally:
            browser.close()
