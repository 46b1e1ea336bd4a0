"""Computer use on a sandbox's desktop: screenshots, pointer and keyboard.

A sandbox created with ``desktop="WxHxD"`` runs Xvfb, openbox and x11vnc on
display :0 (``hangar.guest.desktop``). This module drives that display from
the host by running ``xdotool`` and ``scrot`` in the guest through
``SandboxManager.exec``; it holds no connection of its own.

Design and safety:

* Every command is an argv list (``exec`` with ``argv``, never a shell
  string). Text to type goes on stdin, so nothing the caller sends can
  become an option or a shell word: to ``xdotool type --file -`` when every
  character is on the US keyboard map (printable ASCII, newline, tab), else
  to ``hangar.guest.desktop type``, which binds the missing characters to
  spare keys and keeps them bound while typing through XTest (xdotool
  unbinds its spare key right after each character, and a slow client then
  loses it). Key names must match ``[A-Za-z0-9_]{1,64}`` before they reach
  xdotool.
* Coordinates are checked against the screen size of the sandbox's
  ``desktop`` geometry: x in 0..W-1 and y in 0..H-1 (pixels), else
  ``InvalidRequest`` naming the bounds.
* Input actions on one sandbox run one at a time (a lock per sandbox), so
  two ``type`` calls never interleave their characters. Screenshots do not
  take the lock.
* Before the first action after a boot, ``wait_ready`` waits (at most
  ``READY_TIMEOUT_S``) for the guest's marker ``/run/hangar/desktop-ready``;
  the agent's boot id is remembered so later actions skip the wait. If X
  has gone away (the guest supervisor is restarting it), the action waits
  for the marker again once and retries.

Key names (``key``): a space-separated sequence of combinations, each of
key names joined by ``+`` (``ctrl+shift+t``, ``ctrl+a Delete``). A name is
an X keysym (``Return``, ``Page_Down``, ``F5``, ``a``, ``plus``...;
case-sensitive, as X defines them) or one of the aliases in ``KEY_ALIASES``
(case-insensitive, e.g. ``enter`` → ``Return``, ``esc`` → ``Escape``,
``pgdn`` → ``Page_Down``, ``ctrl`` → ``ctrl``, ``cmd``/``win`` → ``super``).
An unknown name is an ``InvalidRequest`` that names it: xdotool reports
"No such key name" for it and presses nothing for that name (the other
keys of that call may already have been pressed and released).

* A guest tool's output is the guest's to write: at most the screen's
  ``shot_max_bytes`` of scrot's stdout and ``TOOL_OUTPUT_MAX`` of any other
  output are kept; past that the command is cancelled (the guest kills its
  process group) and the call fails with ``GuestError``. Scaling a
  screenshot decodes it in ``SCALER``'s own two threads, never in asyncio's
  default pool, which agent answers and volume listings share.

Errors: ``Conflict`` (409) when the sandbox has no desktop or its image
cannot run one, ``InvalidRequest`` (400) for bad coordinates, keys or
widths, ``Timeout`` (504) when the desktop does not come up, ``GuestError``
(502) when a guest tool fails or writes more than its bound.
"""

from __future__ import annotations

import asyncio
import io
import json
import re
import struct
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Literal

from hangar.core.sandboxes import SandboxManager
from hangar.engines.agent_client import ExecResult, Tunnel, exec_meta
from hangar.errors import Conflict, GuestError, HangarError, InvalidRequest, NotFound, Timeout
from hangar.guest import paths
from hangar.schemas.bounds import DESKTOP_MAX_PIXELS

VNC_PORT = 5900
"""x11vnc's port on the guest's loopback."""
READY_FILE = paths.DESKTOP_READY
ERROR_FILE = paths.DESKTOP_ERROR
MARKER_MAX = 64 << 10
"""Most bytes of the guest's ready or error marker read (a few hundred as the desktop
writes them; the guest may make either a link to ``/dev/zero``), bytes."""
DISPLAY = ":0"
READY_TIMEOUT_S = 120.0
"""Seconds an action waits for a freshly booted desktop (Xvfb under TCG takes a few)."""
POLL_S = 0.25
TYPE_DELAY_MS = 12
"""Default pause between typed characters, milliseconds (xdotool's own default)."""
MAX_TYPE_CHARS = 20_000
MAX_SCROLL = 100
MIN_SHOT_WIDTH = 16

Button = Literal["left", "middle", "right"]
Direction = Literal["up", "down", "left", "right"]
BUTTONS: dict[str, int] = {"left": 1, "middle": 2, "right": 3}
SCROLL_BUTTONS: dict[str, int] = {"up": 4, "down": 5, "left": 6, "right": 7}

KEY_ALIASES: dict[str, str] = {
    # lower-case alias → X keysym (or xdotool's modifier name)
    "enter": "Return", "return": "Return", "ret": "Return",
    "esc": "Escape", "escape": "Escape",
    "tab": "Tab", "space": "space", "spacebar": "space",
    "backspace": "BackSpace", "bksp": "BackSpace",
    "del": "Delete", "delete": "Delete", "ins": "Insert", "insert": "Insert",
    "home": "Home", "end": "End",
    "pgup": "Page_Up", "pageup": "Page_Up", "page_up": "Page_Up", "prior": "Page_Up",
    "pgdn": "Page_Down", "pagedown": "Page_Down", "page_down": "Page_Down", "next": "Page_Down",
    "up": "Up", "down": "Down", "left": "Left", "right": "Right",
    "arrowup": "Up", "arrowdown": "Down", "arrowleft": "Left", "arrowright": "Right",
    "ctrl": "ctrl", "control": "ctrl", "lctrl": "Control_L", "rctrl": "Control_R",
    "alt": "alt", "option": "alt", "lalt": "Alt_L", "ralt": "Alt_R", "altgr": "ISO_Level3_Shift",
    "shift": "shift", "lshift": "Shift_L", "rshift": "Shift_R",
    "super": "super", "win": "super", "windows": "super", "cmd": "super", "command": "super",
    "meta": "super",
    "capslock": "Caps_Lock", "numlock": "Num_Lock", "scrolllock": "Scroll_Lock",
    "printscreen": "Print", "print": "Print", "prtsc": "Print", "pause": "Pause",
    "menu": "Menu", "minus": "minus", "plus": "plus", "comma": "comma", "period": "period",
    **{f"f{n}": f"F{n}" for n in range(1, 25)},
}
"""Aliases accepted by ``key``, matched case-insensitively; other names go to X as given."""

PLAIN_KEYS = frozenset(chr(c) for c in range(0x20, 0x7F)) | {"\n", "\r", "\t"}
"""Characters on the US keyboard map of Xvfb, typed with ``xdotool type``. Others go to
``hangar.guest.desktop type``, which binds them to spare keys before typing (see there)."""
GUEST_PYTHON = ["/usr/bin/python3", "-S", "-c", "from hangar.guest.desktop import main; main()"]
GUEST_PYTHON_ENV = {"PYTHONPATH": paths.PYTHON_DIR}

KEY_NAME = re.compile(r"[A-Za-z0-9_]{1,64}")
NO_SUCH_KEY = re.compile(r"No such key name '([^']*)'")
DISPLAY_GONE = re.compile(r"open (X )?display", re.IGNORECASE)


@dataclass(frozen=True)
class Screen:
    """A desktop's geometry: ``width`` and ``height`` in pixels, ``depth`` in bits."""

    width: int
    height: int
    depth: int

    @classmethod
    def parse(cls, geometry: str) -> Screen:
        """``"1024x768x24"`` → Screen(1024, 768, 24); raises InvalidRequest."""
        m = re.fullmatch(r"(\d+)x(\d+)x(\d+)", geometry)
        if not m:
            raise InvalidRequest(f"desktop geometry must be WIDTHxHEIGHTxDEPTH, not {geometry!r}")
        return cls(int(m[1]), int(m[2]), int(m[3]))

    def check(self, x: int, y: int) -> None:
        """Raise InvalidRequest unless 0 <= x < width and 0 <= y < height (pixels)."""
        if not (0 <= x < self.width and 0 <= y < self.height):
            raise InvalidRequest(
                f"({x}, {y}) is outside the {self.width}x{self.height} screen: x must be in "
                f"0..{self.width - 1} and y in 0..{self.height - 1}",
                x=x, y=y, width=self.width, height=self.height)


@dataclass(frozen=True)
class Screenshot:
    """A PNG of the screen: ``width``/``height`` of the image in pixels (scaled or
    not), ``screen`` the desktop it was taken of, ``duration_s`` the time it took."""

    png: bytes
    width: int
    height: int
    screen: Screen
    duration_s: float


@dataclass(frozen=True)
class DisplayInfo:
    """Screen size (pixels, bits), pointer position (pixels) and whether VNC listens."""

    width: int
    height: int
    depth: int
    cursor_x: int
    cursor_y: int
    vnc: bool


MAX_SHOT_PIXELS = DESKTOP_MAX_PIXELS
"""Most pixels of a screenshot decoded to scale it (a guest's PNG whose header claimed
13,300 x 13,300 took 918 MiB and 4.4 s to scale, review 29j J-H3; it must be the screen's
size, which is at most this)."""
TOOL_OUTPUT_MAX = 64 << 10
"""Most bytes kept of a desktop tool's stderr, and of stdout but scrot's: xdotool prints a
line or two (``getmouselocation --shell``: about 40 bytes). Past it the command is cancelled
(review 29k K-H1: an xdotool replaced by ``cat /dev/zero`` grew the server 100-150 MiB/s)."""
PNG_SLACK = 1 << 20
"""Bytes allowed in scrot's PNG beyond its pixel data and framing (see ``shot_max_bytes``):
the signature, IHDR, IEND and any text chunks, a few hundred bytes as Imlib2 writes them."""
SCALE_WORKERS = 2
"""Threads that decode and scale screenshots (``SCALER``), for all desktops of a server: a
4096x4096 shot takes 1.2 s of CPU and 180 MiB to scale (review 29k K-M1), so at most two at
once (2 x 180 MiB), and six at once no longer hold every thread of asyncio's default pool."""
SCALER = ThreadPoolExecutor(SCALE_WORKERS, thread_name_prefix="hangar-screenshot")
"""The screenshots' own threads (``SCALE_WORKERS``); a scale waits here for its turn."""


def shot_max_bytes(screen: Screen) -> int:
    """Most bytes of scrot's PNG of ``screen`` kept: its pixels stored without compression
    (a filter byte a row, at most 4 bytes a pixel: Imlib2 writes 8-bit RGB or RGBA at any
    depth), plus 1/64 for zlib's and PNG's framing (stored blocks: 5 bytes in 64 KiB; IDAT
    chunks: 12 bytes in 8 KiB; 0.2 % in all) and ``PNG_SLACK``. 1024x768: 4.1 MiB;
    4096x4096: 66 MiB."""
    raw = screen.height * (1 + 4 * screen.width)
    return raw + raw // 64 + PNG_SLACK


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) in pixels from a PNG's IHDR chunk; raises GuestError if not a PNG."""
    if len(data) < 24 or data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
        raise GuestError("the screenshot is not a PNG image", size=len(data))
    w, h = struct.unpack(">II", data[16:24])
    return int(w), int(h)


def scale_png(data: bytes, width: int) -> tuple[bytes, int, int]:
    """Scale a PNG to ``width`` pixels, keeping the aspect ratio (Pillow, Lanczos).

    Returns (png, width, height); the height is rounded, at least 1 pixel.
    """
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        if im.width * im.height > MAX_SHOT_PIXELS:  # the caller checks it is the screen's
            raise GuestError(f"the screenshot is {im.width}x{im.height} pixels, more than "
                             f"{MAX_SHOT_PIXELS}")
        height = max(1, round(im.height * width / im.width))
        out = im.convert("RGB").resize((width, height), Image.Resampling.LANCZOS)
    buf = io.BytesIO()
    out.save(buf, format="PNG", compress_level=3)
    return buf.getvalue(), width, height


def parse_keys(keys: str) -> list[str]:
    """``"ctrl+shift+t Return"`` → ``["ctrl+shift+t", "Return"]`` with aliases applied.

    Raises InvalidRequest for an empty sequence, an empty name (``ctrl+``) or
    a name with characters other than letters, digits and ``_``.
    """
    combos = keys.split()
    if not combos:
        raise InvalidRequest("keys is empty: give key names like 'Return' or 'ctrl+shift+t'")
    if len(combos) > 50:
        raise InvalidRequest("at most 50 key combinations per call")
    out = []
    for combo in combos:
        names = []
        for name in combo.split("+"):
            if not name:
                raise InvalidRequest(f"empty key name in {combo!r} (use 'plus' for the + key)",
                                     keys=keys)
            if not KEY_NAME.fullmatch(name):
                raise InvalidRequest(
                    f"invalid key name {name!r}: use X keysym names such as 'Return', 'a', "
                    f"'Page_Down', 'F5', 'plus', or an alias such as 'enter', 'esc', 'pgdn'",
                    key=name)
            names.append(KEY_ALIASES.get(name.lower(), name))
        out.append("+".join(names))
    return out


SHOTS_AT_ONCE = 2
"""Screenshots of one sandbox taken (and collected, up to ``shot_max_bytes`` each) at once;
the others wait their turn. Without it a tenant's 16 at once (its exec slots) held 1 GiB of
a 4096 x 4096 desktop's PNGs (review 29l M1)."""


class Desktop:
    """Drives the desktops of one manager's sandboxes; one per server."""

    def __init__(self, manager: SandboxManager, ready_timeout_s: float = READY_TIMEOUT_S) -> None:
        self.manager = manager
        self.ready_timeout_s = ready_timeout_s
        self._ready: dict[str, tuple[str, float]] = {}  # id → (agent boot id, marker since)
        self._locks: dict[str, asyncio.Lock] = {}
        self._shots: dict[str, asyncio.Semaphore] = {}

    # -- state -------------------------------------------------------------

    def screen(self, sandbox_id: str) -> Screen:
        """The sandbox's screen; NotFound if unknown, Conflict if it has no desktop."""
        try:
            rec = self.manager.get(sandbox_id)
        except HangarError:  # gone: drop what we kept for it
            self.forget(sandbox_id)
            raise
        if not rec.desktop:
            raise Conflict(
                f"sandbox {sandbox_id} has no desktop: create one with "
                f"{{\"image\": \"desktop\", \"desktop\": \"1024x768x24\"}}",
                sandbox_id=sandbox_id)
        return Screen.parse(rec.desktop)

    async def _small(self, sandbox_id: str, path: str) -> bytes | None:
        """The guest file ``path``, at most ``MARKER_MAX`` bytes of it (the guest writes
        these markers, and may make them a link to ``/dev/zero``); None when missing."""
        data = bytearray()
        try:
            chunks = self.manager.files.read(sandbox_id, path)
            try:
                async for chunk in chunks:
                    data += chunk[:MARKER_MAX + 1 - len(data)]
                    if len(data) > MARKER_MAX:
                        break
            finally:
                close = getattr(chunks, "aclose", None)
                if close is not None:  # stop the guest's stream where the cap is
                    await close()
        except NotFound:
            return None
        return bytes(data)

    async def _marker(self, sandbox_id: str) -> dict[str, object] | None:
        data = await self._small(sandbox_id, READY_FILE)
        if data is None or len(data) > MARKER_MAX:
            return None  # a marker that large is none the desktop wrote
        try:
            value = json.loads(data)
        except (ValueError, RecursionError):  # caught between write and rename, or forged
            return None
        return value if isinstance(value, dict) else None

    async def _error(self, sandbox_id: str) -> str | None:
        data = await self._small(sandbox_id, ERROR_FILE)
        if data is None:
            return None
        return data[:MARKER_MAX].decode(errors="replace").strip()[:2000] or "unknown error"

    async def wait_ready(self, sandbox_id: str, timeout_s: float | None = None,
                         vnc: bool = False, newer_than: float | None = None,
                         ) -> dict[str, object]:
        """Wait until the guest's desktop answers (and, with ``vnc``, x11vnc listens).

        ``newer_than`` (Unix time, seconds) ignores a marker written before
        then: after X died, wait for its successor. Returns the guest's
        marker (display, width, height, depth, vnc, since). Raises Conflict
        (no desktop, or the guest cannot run one), Timeout after
        ``timeout_s`` seconds (default ``ready_timeout_s``).
        """
        self.screen(sandbox_id)
        timeout_s = self.ready_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while True:
            marker = await self._marker(sandbox_id)
            if marker is not None and newer_than is not None \
                    and float(marker.get("since", 0)) <= newer_than:  # type: ignore[arg-type]
                marker = None
            if marker is not None and (not vnc or marker.get("vnc")):
                agent = await self.manager.agent(sandbox_id)
                self._ready[sandbox_id] = (str(agent.hello.get("boot_id")),
                                           float(marker.get("since", 0)))  # type: ignore[arg-type]
                return marker
            error = await self._error(sandbox_id)
            if error is not None:
                raise Conflict(f"the desktop of sandbox {sandbox_id} cannot run: {error}",
                               sandbox_id=sandbox_id)
            if time.monotonic() >= deadline:
                what = "x11vnc" if marker is not None else "the desktop (X server)"
                raise Timeout(f"{what} of sandbox {sandbox_id} was not ready within "
                              f"{timeout_s:.0f} s", sandbox_id=sandbox_id)
            await asyncio.sleep(POLL_S)

    @asynccontextmanager
    async def vnc(self, sandbox_id: str, timeout_s: float | None = None,
                  ) -> AsyncIterator[Tunnel]:
        """A connection to the guest's VNC server (x11vnc, ``VNC_PORT`` on its loopback),
        open while the context lasts; the sandbox is busy meanwhile. Waits first (at
        most ``timeout_s`` seconds) until the desktop and x11vnc are up.

        Raises as ``wait_ready``, and NoListener when x11vnc does not listen.
        """
        await self.wait_ready(sandbox_id, timeout_s, vnc=True)
        async with self.manager.tunnel(sandbox_id, VNC_PORT) as conn:
            yield conn

    async def _ensure_ready(self, sandbox_id: str) -> None:
        agent = await self.manager.agent(sandbox_id)
        if self._ready.get(sandbox_id, ("",))[0] != str(agent.hello.get("boot_id")):
            await self.wait_ready(sandbox_id)

    def _lock(self, sandbox_id: str) -> asyncio.Lock:
        return self._locks.setdefault(sandbox_id, asyncio.Lock())

    def forget(self, sandbox_id: str) -> None:
        """Drop cached state of a sandbox (after it is deleted)."""
        self._ready.pop(sandbox_id, None)
        self._locks.pop(sandbox_id, None)
        self._shots.pop(sandbox_id, None)

    # -- running tools -----------------------------------------------------

    async def _exec(self, sandbox_id: str, meta: dict[str, object], stdin: bytes | None,
                    max_bytes: int = TOOL_OUTPUT_MAX) -> tuple[bytes, str, ExecResult]:
        """Run a command; returns its stdout, its stderr as text, and its result.

        Keeps at most ``max_bytes`` of stdout and ``TOOL_OUTPUT_MAX`` of stderr; past
        either the command is cancelled (closing the stream CANCELs it: the guest kills
        its process group) and GuestError raised, naming the stream and the bound.
        """
        kept = {"stdout": bytearray(), "stderr": bytearray()}
        caps = {"stdout": max_bytes, "stderr": TOOL_OUTPUT_MAX}
        result: ExecResult | None = None
        events = self.manager.exec_stream(sandbox_id, {**meta, "stream": True}, stdin)
        try:
            async for ev in events:
                if ev.kind == "exit":
                    result = ev.result
                    continue
                if len(kept[ev.kind]) + len(ev.data) > caps[ev.kind]:
                    argv = meta.get("argv")
                    tool = argv[0] if isinstance(argv, list) and argv else "the command"
                    raise GuestError(
                        f"{tool} wrote more than {caps[ev.kind]} bytes on {ev.kind} (the most "
                        "this call takes); the command was stopped", sandbox_id=sandbox_id,
                        stream=ev.kind, limit=caps[ev.kind])
                kept[ev.kind] += ev.data
        finally:
            await events.aclose()  # type: ignore[attr-defined]
        assert result is not None
        return bytes(kept["stdout"]), kept["stderr"].decode(errors="replace"), result

    async def _run(self, sandbox_id: str, argv: list[str], stdin: bytes | None = None,
                   timeout_s: float = 30.0, env: dict[str, str] | None = None,
                   max_bytes: int = TOOL_OUTPUT_MAX) -> tuple[bytes, str]:
        """Run ``argv`` on the display; returns its stdout (at most ``max_bytes``) and
        stderr (at most ``TOOL_OUTPUT_MAX``).

        When X has gone away (the tool cannot open the display), waits for
        the supervisor to bring up a new X server and tries once more.
        Raises GuestError with the tool's stderr when it exits non-zero, or
        when it writes more than those bounds; Timeout when it outlives
        ``timeout_s`` seconds.
        """
        await self._ensure_ready(sandbox_id)
        meta = exec_meta(argv=argv, env={"DISPLAY": DISPLAY, **(env or {})}, timeout=timeout_s)
        for attempt in (1, 2):
            out, err, r = await self._exec(sandbox_id, meta, stdin, max_bytes)
            if r.exit_code == 0 or attempt == 2 or not DISPLAY_GONE.search(err):
                break
            _, since = self._ready.pop(sandbox_id, ("", 0.0))
            await self.wait_ready(sandbox_id, newer_than=since)
        if r.timed_out:
            raise Timeout(f"{argv[0]} did not finish within {timeout_s:.0f} s",
                          sandbox_id=sandbox_id)
        if r.exit_code != 0:
            raise GuestError(f"{argv[0]} failed (exit {r.exit_code}): {err.strip()[-500:]}",
                             sandbox_id=sandbox_id)
        return out, err

    async def _xdotool(self, sandbox_id: str, *args: str, stdin: bytes | None = None,
                       timeout_s: float = 30.0) -> bytes:
        async with self._lock(sandbox_id):
            out, err = await self._run(sandbox_id, ["xdotool", *args], stdin, timeout_s)
        m = NO_SUCH_KEY.search(err)
        if m:
            raise InvalidRequest(f"unknown key name {m[1]!r}: use X keysym names such as "
                                 f"'Return', 'Page_Down', 'F5', or an alias such as 'enter'",
                                 key=m[1])
        return out

    # -- actions -----------------------------------------------------------

    async def screenshot(self, sandbox_id: str, width: int | None = None) -> Screenshot:
        """The screen as PNG, scaled to ``width`` pixels (aspect kept) if given.

        ``width`` must be in 16..screen width. Raises InvalidRequest for
        another width, Conflict for a screen of more than ``MAX_SHOT_PIXELS``
        (made before that bound), GuestError for a PNG that is not the
        screen's size or is over ``shot_max_bytes``; see the module docstring
        for the rest.
        """
        screen = self.screen(sandbox_id)
        if width is not None and not MIN_SHOT_WIDTH <= width <= screen.width:
            raise InvalidRequest(f"width must be in {MIN_SHOT_WIDTH}..{screen.width} pixels",
                                 width=width)
        if screen.width * screen.height > MAX_SHOT_PIXELS:
            raise Conflict(f"the screen of sandbox {sandbox_id} is {screen.width}x"
                           f"{screen.height}, more than the {MAX_SHOT_PIXELS} pixels a "
                           "screenshot is taken of", sandbox_id=sandbox_id)
        started = time.monotonic()
        async with self._shots.setdefault(sandbox_id, asyncio.Semaphore(SHOTS_AT_ONCE)):
            png, _ = await self._run(sandbox_id, ["scrot", "--overwrite", "--silent", "-"],
                                     timeout_s=60, max_bytes=shot_max_bytes(screen))
            w, h = png_size(png)
            if (w, h) != (screen.width, screen.height):  # the guest's: a bomb's header
                raise GuestError(f"the screenshot is {w}x{h} pixels, not the screen's "
                                 f"{screen.width}x{screen.height}", sandbox_id=sandbox_id)
            if width is not None and width != w:
                loop = asyncio.get_running_loop()
                png, w, h = await loop.run_in_executor(SCALER, scale_png, png, width)
        return Screenshot(png, w, h, screen, time.monotonic() - started)

    async def move(self, sandbox_id: str, x: int, y: int) -> None:
        """Move the pointer to (x, y), pixels."""
        self.screen(sandbox_id).check(x, y)
        await self._xdotool(sandbox_id, "mousemove", str(x), str(y))

    async def click(self, sandbox_id: str, x: int, y: int, button: Button = "left",
                    double: bool = False) -> None:
        """Move the pointer to (x, y), pixels, and click ``button`` (twice if ``double``)."""
        self.screen(sandbox_id).check(x, y)
        if button not in BUTTONS:
            raise InvalidRequest(f"button must be left, middle or right, not {button!r}")
        repeat = ["--repeat", "2", "--delay", "80"] if double else []
        await self._xdotool(sandbox_id, "mousemove", str(x), str(y),
                            "click", *repeat, str(BUTTONS[button]))

    async def drag(self, sandbox_id: str, from_x: int, from_y: int, to_x: int, to_y: int,
                   button: Button = "left") -> None:
        """Press ``button`` at (from_x, from_y), move to (to_x, to_y) and release (pixels)."""
        screen = self.screen(sandbox_id)
        screen.check(from_x, from_y)
        screen.check(to_x, to_y)
        if button not in BUTTONS:
            raise InvalidRequest(f"button must be left, middle or right, not {button!r}")
        b = str(BUTTONS[button])
        mid_x, mid_y = (from_x + to_x) // 2, (from_y + to_y) // 2
        await self._xdotool(
            sandbox_id, "mousemove", str(from_x), str(from_y), "mousedown", b, "sleep", "0.05",
            "mousemove", str(mid_x), str(mid_y), "sleep", "0.05",
            "mousemove", str(to_x), str(to_y), "sleep", "0.05", "mouseup", b)

    async def scroll(self, sandbox_id: str, direction: Direction, amount: int = 3,
                     x: int | None = None, y: int | None = None) -> None:
        """Scroll ``amount`` wheel clicks (1..100) ``direction``, at (x, y) if given (pixels)."""
        if direction not in SCROLL_BUTTONS:
            raise InvalidRequest(f"direction must be up, down, left or right, not {direction!r}")
        if not 1 <= amount <= MAX_SCROLL:
            raise InvalidRequest(f"amount must be 1..{MAX_SCROLL} wheel clicks", amount=amount)
        if (x is None) != (y is None):
            raise InvalidRequest("give both x and y, or neither")
        args: list[str] = []
        if x is not None and y is not None:
            self.screen(sandbox_id).check(x, y)
            args += ["mousemove", str(x), str(y)]
        else:
            self.screen(sandbox_id)
        args += ["click", "--repeat", str(amount), "--delay", "30",
                 str(SCROLL_BUTTONS[direction])]
        await self._xdotool(sandbox_id, *args)

    async def type(self, sandbox_id: str, text: str, delay_ms: int = TYPE_DELAY_MS) -> None:
        """Type ``text`` (any Unicode) into the focused window.

        A line break (``\\n``, ``\\r`` or ``\\r\\n``) presses Return once, a tab Tab;
        other control characters are an InvalidRequest (send them with ``key``).

        ``delay_ms`` is the pause between characters (1..1000 ms). Characters
        missing from the keyboard map are typed through a spare keycode that
        xdotool remaps for each one.
        """
        self.screen(sandbox_id)
        if not text:
            raise InvalidRequest("text is empty")
        if len(text) > MAX_TYPE_CHARS:
            raise InvalidRequest(f"text is longer than {MAX_TYPE_CHARS} characters")
        if "\0" in text:
            raise InvalidRequest("text must not contain NUL characters")
        if not 1 <= delay_ms <= 1000:
            raise InvalidRequest("delay_ms must be 1..1000 milliseconds")
        bad = next((c for c in text if (ord(c) < 0x20 and c not in "\n\r\t")
                    or 0x7F <= ord(c) < 0xA0), None)
        if bad is not None:
            raise InvalidRequest(f"text contains the control character U+{ord(bad):04X}; "
                                 f"only newline, CR and tab may be typed (use key for others)")
        text = text.replace("\r\n", "\n")
        timeout = 30.0 + len(text) * (delay_ms + 20) / 1000
        if all(c in PLAIN_KEYS for c in text):
            # xdotool types "\n" as Linefeed (ctrl+j to a terminal, justify in nano);
            # "\r" is Return.
            await self._xdotool(sandbox_id, "type", "--delay", str(delay_ms), "--file", "-",
                                stdin=text.replace("\n", "\r").encode(), timeout_s=timeout)
            return
        async with self._lock(sandbox_id):
            await self._run(sandbox_id, [*GUEST_PYTHON, "type", str(delay_ms)],
                            stdin=text.encode(), timeout_s=timeout, env=GUEST_PYTHON_ENV)

    async def key(self, sandbox_id: str, keys: str) -> list[str]:
        """Press and release key combinations (see the module docstring); returns them as
        sent to X (aliases resolved)."""
        self.screen(sandbox_id)
        combos = parse_keys(keys)
        await self._xdotool(sandbox_id, "key", "--delay", "30", *combos)
        return combos

    async def display(self, sandbox_id: str) -> DisplayInfo:
        """Screen size, pointer position and VNC readiness; GuestError when xdotool's
        answer (at most ``TOOL_OUTPUT_MAX``) is not ``X=.. Y=..`` lines."""
        screen = self.screen(sandbox_id)
        out, _ = await self._run(sandbox_id, ["xdotool", "getmouselocation", "--shell"])
        try:  # the guest's to write: not UTF-8, or "X=" and 60,000 digits, is no 500
            values = dict(line.split("=", 1) for line in out.decode().split() if "=" in line)
            x, y = int(values.get("X", -1)), int(values.get("Y", -1))
        except ValueError:
            raise GuestError(f"xdotool getmouselocation printed {out[:80]!r}",
                             sandbox_id=sandbox_id) from None
        marker = await self._marker(sandbox_id) or {}
        return DisplayInfo(screen.width, screen.height, screen.depth, x, y,
                           bool(marker.get("vnc")))
