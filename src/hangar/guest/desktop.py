"""The guest's desktop: Xvfb, a window manager and x11vnc, kept running.

Standard library only. PID 1 (``hangar.guest.init``) calls ``start`` with
the kernel command line once the agent runs. Without ``hangar.desktop=``
it does nothing. With ``hangar.desktop=WIDTHxHEIGHTxDEPTH`` (pixels, bits;
``CreateOptions.desktop`` on the host) it spawns a supervisor (this
module's ``main`` with the argument ``WxHxD``) in its own session; PID 1 reaps
it like any orphan and never waits for it, so boot and agent are not
delayed. The supervisor starts, in order, and restarts when one exits (a
backoff of 0.5 s doubling to 10 s, reset after 30 s of running):

``Xvfb :0 -screen 0 WxHxD -nolisten tcp -noreset``
    the X server, a framebuffer in memory. When it exits the window
    manager and x11vnc lose their display, so all three are restarted.
``openbox``
    the window manager (focus, stacking, decorations).
``x11vnc -localhost -rfbport 5900 -shared -forever -nopw ...``
    the VNC server on display :0.

Files (all in /run, a tmpfs)::

    /run/hangar/desktop-ready   JSON {display, width, height, depth, vnc_port,
                                vnc (bool), since}; written (atomically) once X
                                answers a connection set-up, rewritten with
                                ``vnc: true`` once x11vnc listens; removed
                                while X is down
    /run/hangar/desktop-error   one line: why the desktop cannot run (a bad
                                geometry, Xvfb missing from the image)
    /run/hangar/desktop.log     the supervisor's log; xvfb.log, openbox.log
                                and x11vnc.log hold each program's output
    /run/hangar/keymap-bound    keycodes ``type_text`` has bound to characters

"X answers" means a connection to its Unix socket (/tmp/.X11-unix/X0) got
a successful reply to an X11 connection set-up (``x_answers``); no X
client tools are needed for that.

The same ``main`` with ``type DELAY_MS`` types the UTF-8 text on its stdin
(``type_text``: characters missing from the keyboard map are bound to spare
keycodes first; the host's ``hangar.core.desktop`` uses it for text that
``xdotool type`` would garble).

Security model: the guest is the boundary and everything in it runs as
root. X listens on its Unix socket only (``-nolisten tcp``), without an
X authority cookie: any process in the guest may use the display, exactly
as any process in the guest may run commands. x11vnc has no password
(``-nopw``) and listens on 127.0.0.1:5900 only (``-localhost``); the guest
has no network, so the one way in is the agent's ``connect`` tunnel, which
only the host opens. The host (``hangar.api.vnc``) authenticates viewers
with single-use tickets, checks the browser's Origin, and enforces
view-only viewers itself, so a VNC password would add nothing but a secret
to keep in sync; none exists.
"""

from __future__ import annotations

import os
import sys
import time

from hangar.guest import paths

try:
    import _signal as signal  # the C module: ``signal`` would import enum (slow under TCG)
except ImportError:  # pragma: no cover
    import signal  # type: ignore[no-redef]
TYPE_CHECKING = False  # not typing's: PID 1 imports this module, and typing costs ~0.3 s under TCG
if TYPE_CHECKING:
    from collections.abc import Mapping

RUN_DIR = paths.RUN_DIR
READY_FILE = paths.DESKTOP_READY
ERROR_FILE = paths.DESKTOP_ERROR
LOG_FILE = paths.DESKTOP_LOG
DISPLAY = ":0"
X_SOCKET = "/tmp/.X11-unix/X0"
X_LOCK = "/tmp/.X0-lock"
VNC_PORT = 5900
PYTHON_DIR = paths.PYTHON_DIR
CMDLINE_KEY = "hangar.desktop"
PYTHON_MAIN = ["/usr/bin/python3", "-S", "-c", "from hangar.guest.desktop import main; main()"]
"""How this module's ``main`` is run in the guest (PYTHONPATH=PYTHON_DIR); ``-c`` rather
than ``-m``, whose runpy machinery imports collections, functools and more."""

MIN_SIDE, MAX_SIDE = 64, 8192
"""Screen width and height limits, pixels."""
DEPTHS = (16, 24)
X_START_TIMEOUT_S = 60.0
"""Seconds Xvfb gets to answer before it is killed and started again (TCG is slow)."""
BACKOFF_FIRST_S, BACKOFF_MAX_S, BACKOFF_RESET_S = 0.5, 10.0, 30.0

ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": paths.HOME,
    "USER": "root",
    "LANG": "C.UTF-8",
    "DISPLAY": DISPLAY,
    "XDG_RUNTIME_DIR": paths.XDG_RUNTIME_DIR,
}


def parse_geometry(value: str) -> tuple[int, int, int]:
    """``"1024x768x24"`` → (1024, 768, 24): width and height in pixels, depth in bits.

    Raises ValueError for anything else, or sizes outside 64..8192, or a
    depth other than 16 or 24.
    """
    parts = value.split("x")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"desktop geometry must be WIDTHxHEIGHTxDEPTH, not {value!r}")
    w, h, d = (int(p) for p in parts)
    if not (MIN_SIDE <= w <= MAX_SIDE and MIN_SIDE <= h <= MAX_SIDE):
        raise ValueError(f"desktop size {w}x{h} is outside {MIN_SIDE}..{MAX_SIDE} pixels")
    if d not in DEPTHS:
        raise ValueError(f"desktop depth must be 16 or 24 bits, not {d}")
    return w, h, d


def _geometry_arg(cmdline: Mapping[str, str] | str) -> str | None:
    if isinstance(cmdline, str):
        for word in cmdline.split():
            key, _, value = word.partition("=")
            if key == CMDLINE_KEY:
                return value
        return None
    return cmdline.get(CMDLINE_KEY)


def start(cmdline: Mapping[str, str] | str) -> int | None:
    """Spawn the desktop supervisor if the kernel command line asks for a desktop.

    ``cmdline`` is the parsed ``key=value`` words of /proc/cmdline (as
    ``hangar.guest.init.parse_cmdline`` returns) or its raw text. Returns
    the supervisor's pid, or None when no desktop is wanted or it could not
    be spawned. Never raises: PID 1 must not die of a desktop problem. The
    child gets an empty signal mask and default dispositions (PID 1 blocks
    its signals, and Python ignores SIGPIPE).
    """
    try:
        geometry = _geometry_arg(cmdline)
        if not geometry:
            return None
        os.makedirs(RUN_DIR, exist_ok=True)
        flags = os.O_WRONLY | os.O_NOCTTY | os.O_CREAT | os.O_APPEND
        sigdef = [s for s in range(1, 32) if s not in (9, 19)]  # all but SIGKILL, SIGSTOP
        pid = os.posix_spawn(
            "/usr/bin/python3",
            [*PYTHON_MAIN, geometry],
            dict(ENV, PYTHONPATH=PYTHON_DIR),
            file_actions=[
                (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
                (os.POSIX_SPAWN_OPEN, 1, LOG_FILE, flags, 0o600),
                (os.POSIX_SPAWN_DUP2, 1, 2),
            ],
            setsid=True, setsigmask=(), setsigdef=sigdef,
        )
        return pid
    except Exception as e:  # noqa: BLE001 -- see docstring
        try:
            os.write(1, f"hangar-init: cannot start the desktop: {e!r}\n".encode())
        except OSError:
            pass
        return None


# ---------------------------------------------------------------------------------------------
# the supervisor (its own process)


def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} hangar-desktop: {msg}", flush=True)


def x_answers(path: str = X_SOCKET, timeout: float = 2.0) -> bool:
    """True when the X server on ``path`` accepts an X11 connection set-up.

    Sends the 12-byte set-up request (little-endian, protocol 11.0, no
    authorization) and reads the first byte of the reply: 1 is Success
    (0 Failed, 2 Authenticate).
    """
    import _socket  # not socket, which imports enum

    s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall(b"l\0" + (11).to_bytes(2, "little") + bytes(8))
        reply = s.recv(8)
    except OSError:
        return False
    finally:
        s.close()
    return len(reply) >= 1 and reply[0] == 1


def vnc_listening(port: int = VNC_PORT) -> bool:
    """True when a TCP socket listens on 127.0.0.1:``port`` (from /proc/net/tcp)."""
    want = f"0100007F:{port:04X}"
    try:
        with open("/proc/net/tcp") as f:
            next(f)
            for line in f:
                fields = line.split()
                if len(fields) > 3 and fields[1] == want and fields[3] == "0A":  # LISTEN
                    return True
    except (OSError, StopIteration):
        pass
    return False


def to_json(d: dict[str, object]) -> str:
    """JSON of a flat dict of ASCII strings, numbers and booleans (the json module
    imports ``re``, which costs a noticeable fraction of a second under TCG)."""
    def value(v: object) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'
    return "{" + ", ".join(f'"{k}": {value(v)}' for k, v in d.items()) + "}"


def write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class Program:
    """One supervised program: its argv, process and restart schedule.

    Spawned with ``os.posix_spawnp`` (not subprocess, whose imports cost
    seconds under TCG) in its own session, stdin /dev/null, output appended
    to /run/hangar/<name>.log, SIGPIPE and SIGXFSZ back to their defaults
    (Python ignores them), working directory /.
    """

    def __init__(self, name: str, argv: list[str]) -> None:
        self.name = name
        self.argv = argv
        self.pid: int | None = None
        self.started_at = 0.0
        self.failures = 0
        self.next_start = 0.0

    def start(self) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOCTTY
        self.pid = os.posix_spawnp(
            self.argv[0], self.argv, ENV,
            file_actions=[(os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
                          (os.POSIX_SPAWN_OPEN, 1, f"{RUN_DIR}/{self.name}.log", flags, 0o600),
                          (os.POSIX_SPAWN_DUP2, 1, 2)],
            setsid=True, setsigmask=(), setsigdef=(signal.SIGPIPE, signal.SIGXFSZ))
        self.started_at = time.monotonic()
        log(f"{self.name} started (pid {self.pid})")

    def _reap(self) -> int | None:
        """The exit status if the process has ended (reaping it), else None."""
        if self.pid is None:
            return None
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            return -1
        return os.waitstatus_to_exitcode(status) if pid else None

    def running(self) -> bool:
        return self.pid is not None and self._reap() is None

    def ended(self) -> bool:
        """True once when the program has exited since it was started; schedules its restart."""
        code = self._reap()
        if code is None:
            return False
        log(f"{self.name} (pid {self.pid}) exited with {code}")
        self.pid = None
        if time.monotonic() - self.started_at >= BACKOFF_RESET_S:
            self.failures = 0
        delay = min(BACKOFF_FIRST_S * 2 ** self.failures, BACKOFF_MAX_S)
        self.failures += 1
        self.next_start = time.monotonic() + delay
        return True

    def stop(self) -> None:
        """SIGTERM its process group, SIGKILL after 3 s, and reap it."""
        if self.pid is None:
            return
        for sig, grace in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 3.0)):
            try:
                os.killpg(self.pid, sig)
            except OSError:
                pass
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline:
                if self._reap() is not None:
                    self.pid = None
                    return
                time.sleep(0.05)
        self.pid = None


def programs(width: int, height: int, depth: int) -> tuple[Program, Program, Program]:
    xvfb = Program("xvfb", [
        "Xvfb", DISPLAY, "-screen", "0", f"{width}x{height}x{depth}",
        "-nolisten", "tcp", "-noreset", "-dpi", "96", "+extension", "RANDR",
    ])
    wm = Program("openbox", ["openbox", "--sm-disable"])
    vnc = Program("x11vnc", [
        "x11vnc", "-display", DISPLAY, "-rfbport", str(VNC_PORT), "-localhost", "-noipv6",
        "-shared", "-dontdisconnect", "-forever", "-nopw", "-norc", "-quiet",
        "-xkb",              # map keysyms through the XKB keyboard (correct for US and others)
        "-noxrecord",        # no XRECORD tricks for scrolling (Xvfb lacks it)
        "-wait", "20", "-defer", "20",  # ms between screen polls / before sending updates
    ])
    return xvfb, wm, vnc


def supervise(geometry: str) -> None:
    """Run the desktop until killed; see the module docstring."""
    try:
        width, height, depth = parse_geometry(geometry)
    except ValueError as e:
        write_atomic(ERROR_FILE, f"{e}\n")
        log(str(e))
        sys.exit(2)
    missing = [p for p in ("Xvfb", "openbox", "x11vnc")
               if not any(os.access(os.path.join(d, p), os.X_OK)
                          for d in ENV["PATH"].split(":"))]
    if missing:
        msg = (f"this image has no {', '.join(missing)}: create the sandbox from the "
               f"'desktop' image")
        write_atomic(ERROR_FILE, msg + "\n")
        log(msg)
        sys.exit(2)
    remove(ERROR_FILE)
    os.makedirs(ENV["XDG_RUNTIME_DIR"], mode=0o700, exist_ok=True)

    xvfb, wm, vnc = programs(width, height, depth)
    stopping = False

    def on_term(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    marker = {"display": DISPLAY, "width": width, "height": height, "depth": depth,
              "vnc_port": VNC_PORT, "vnc": False, "since": 0.0}
    x_up = False
    x_deadline = 0.0

    while not stopping:
        now = time.monotonic()
        if xvfb.ended() or (not x_up and xvfb.running() and now > x_deadline):
            if xvfb.running():  # started but never answered
                log(f"Xvfb did not answer within {X_START_TIMEOUT_S:.0f} s; restarting it")
                xvfb.stop()
                xvfb.next_start = now + BACKOFF_FIRST_S
            remove(READY_FILE)
            x_up = False
            wm.stop()
            vnc.stop()
        if xvfb.pid is None and now >= xvfb.next_start:
            remove(X_LOCK)
            remove(X_SOCKET)
            xvfb.start()
            x_deadline = time.monotonic() + X_START_TIMEOUT_S
        if not x_up and xvfb.running() and x_answers():
            x_up = True
            marker.update(vnc=False, since=time.time())
            write_atomic(READY_FILE, to_json(marker))
            log(f"X answers on {DISPLAY} ({width}x{height}x{depth})")
        if x_up:
            for prog in (wm, vnc):
                if prog.ended() and prog is vnc and marker["vnc"]:
                    marker["vnc"] = False
                    write_atomic(READY_FILE, to_json(marker))
                if prog.pid is None and time.monotonic() >= prog.next_start:
                    prog.start()
            if not marker["vnc"] and vnc.running() and vnc_listening():
                marker["vnc"] = True
                write_atomic(READY_FILE, to_json(marker))
                log(f"x11vnc listens on 127.0.0.1:{VNC_PORT}")
        time.sleep(0.1 if not (x_up and marker["vnc"]) else 0.5)

    remove(READY_FILE)
    for prog in (vnc, wm, xvfb):
        prog.stop()
    log("stopped")


# ---------------------------------------------------------------------------------------------
# typing any Unicode text (``main`` with ``type DELAY_MS``, the text on stdin)

KEYMAP_STATE = paths.KEYMAP_BOUND
"""Keycodes this module has bound, oldest first (one decimal per line)."""
SHIFT_L = 0xFFE1
CONTROL_KEYSYMS = {"\n": 0xFF0D, "\r": 0xFF0D, "\t": 0xFF09}


def char_keysym(ch: str) -> int:
    """The X keysym that types ``ch``: Latin-1 keysyms equal their code point, other
    characters use the Unicode keysym 0x01000000 + code point; newline and CR are Return,
    tab is Tab. Raises ValueError for other control characters."""
    if ch in CONTROL_KEYSYMS:
        return CONTROL_KEYSYMS[ch]
    cp = ord(ch)
    if cp < 0x20 or 0x7F <= cp < 0xA0:
        raise ValueError(f"cannot type control character U+{cp:04X}")
    return cp if cp <= 0xFF else 0x01000000 | cp


def type_text(text: str, delay_ms: int, display: str = DISPLAY) -> None:
    """Type ``text`` on ``display`` through XTest, ``delay_ms`` between characters.

    Why not ``xdotool type``: for a character missing from the keyboard map
    xdotool binds it to a spare keycode, sends the key and unbinds it at
    once, so a client that reads the new mapping a moment later (any client
    under TCG) sees nothing and drops the character. Here every missing
    character of the text is bound first (spare keycodes, those without any
    keysym, highest first) and stays bound: a client always finds it, now
    or later. Bindings are recorded in ``KEYMAP_STATE`` and reused; when no
    spare keycode is left the oldest of them are rebound, after a pause of
    0.5 s so that clients have handled the keys typed with them. Characters
    on the map are typed with their keycode, with Shift when they are at
    the second level. Raises ValueError for control characters other than
    newline, CR and tab, OSError when the display cannot be opened.
    """
    import ctypes
    from ctypes import POINTER, byref, c_char_p, c_int, c_uint, c_ulong, c_void_p

    syms_wanted = [char_keysym(ch) for ch in text]
    x11 = ctypes.CDLL("libX11.so.6")
    xtst = ctypes.CDLL("libXtst.so.6")
    x11.XOpenDisplay.argtypes = [c_char_p]
    x11.XOpenDisplay.restype = c_void_p
    x11.XDisplayKeycodes.argtypes = [c_void_p, POINTER(c_int), POINTER(c_int)]
    x11.XGetKeyboardMapping.argtypes = [c_void_p, ctypes.c_ubyte, c_int, POINTER(c_int)]
    x11.XGetKeyboardMapping.restype = POINTER(c_ulong)
    x11.XChangeKeyboardMapping.argtypes = [c_void_p, c_int, c_int, POINTER(c_ulong), c_int]
    x11.XSync.argtypes = [c_void_p, c_int]
    x11.XFlush.argtypes = [c_void_p]
    x11.XFree.argtypes = [c_void_p]
    x11.XCloseDisplay.argtypes = [c_void_p]
    xtst.XTestFakeKeyEvent.argtypes = [c_void_p, c_uint, c_int, c_ulong]

    dpy = x11.XOpenDisplay(display.encode())
    if not dpy:
        raise OSError(f"cannot open display {display}")
    try:
        lo, hi = c_int(), c_int()
        x11.XDisplayKeycodes(dpy, byref(lo), byref(hi))
        per = c_int()
        raw = x11.XGetKeyboardMapping(dpy, lo.value, hi.value - lo.value + 1, byref(per))
        table = {kc: [raw[(kc - lo.value) * per.value + i] for i in range(per.value)]
                 for kc in range(lo.value, hi.value + 1)}
        x11.XFree(raw)
        where: dict[int, tuple[int, bool]] = {}  # keysym → (keycode, shift)
        for level in (0, 1):  # unshifted first, then lowest keycode
            for kc in sorted(table):
                sym = table[kc][level] if len(table[kc]) > level else 0
                if sym and sym not in where:
                    where[sym] = (kc, level == 1)
        try:
            with open(KEYMAP_STATE) as f:
                ours = [int(line) for line in f if line.strip()]
        except (OSError, ValueError):
            ours = []
        ours = [kc for kc in ours if kc in table and any(table[kc])]
        spare = [kc for kc in sorted(table, reverse=True) if not any(table[kc])]
        shift_kc = where.get(SHIFT_L, (50, False))[0]
        delay = max(delay_ms, 1) / 1000

        def bind(sym: int, needed: set[int]) -> None:
            if spare:
                kc = spare.pop(0)
            else:
                reusable = [k for k in ours if table[k][0] not in needed]
                if not reusable:
                    raise ValueError("the text needs more distinct characters than the "
                                     "keyboard has spare keys")
                kc = reusable[0]
                ours.remove(kc)
                time.sleep(0.5)  # let clients finish with the keys typed on it
                where.pop(table[kc][0], None)
            pair = (c_ulong * 2)(sym, sym)
            x11.XChangeKeyboardMapping(dpy, kc, 2, pair, 1)
            table[kc] = [sym, sym]
            where[sym] = (kc, False)
            ours.append(kc)

        needed = set(syms_wanted)
        changed = False
        for sym in syms_wanted:
            if sym not in where:
                bind(sym, needed)
                changed = True
        if changed:
            x11.XSync(dpy, 0)
            write_atomic(KEYMAP_STATE, "".join(f"{kc}\n" for kc in ours))
        for sym in syms_wanted:
            kc, shift = where[sym]
            if shift:
                xtst.XTestFakeKeyEvent(dpy, shift_kc, 1, 0)
            xtst.XTestFakeKeyEvent(dpy, kc, 1, 0)
            xtst.XTestFakeKeyEvent(dpy, kc, 0, 0)
            if shift:
                xtst.XTestFakeKeyEvent(dpy, shift_kc, 0, 0)
            x11.XFlush(dpy)
            time.sleep(delay)
        x11.XSync(dpy, 0)
    finally:
        x11.XCloseDisplay(dpy)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 2 and args[0] == "type":
        try:
            type_text(sys.stdin.buffer.read().decode("utf-8"), int(args[1]))
        except (ValueError, OSError) as e:
            print(f"hangar-desktop: {e}", file=sys.stderr)
            sys.exit(1)
        return
    if len(args) != 1:
        print("usage: hangar.guest.desktop WIDTHxHEIGHTxDEPTH\n"
              "       hangar.guest.desktop type DELAY_MS < text", file=sys.stderr)
        sys.exit(2)
    log(f"starting a {args[0]} desktop")
    supervise(args[0])


if __name__ == "__main__":
    main()
