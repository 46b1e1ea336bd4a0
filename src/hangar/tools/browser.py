"""The browser tier: the vm tier's tools plus a real Chromium, driven over DevTools.

The sandbox is a desktop sandbox (the ``desktop`` image, 2048 MiB by default;
see ``hangar.images.recipes``). ``prepare`` starts Chromium on the guest's
display ``:0`` in kiosk mode (the page fills the screen, so a screenshot is
the display's size) with its DevTools endpoint on the guest's loopback
(``127.0.0.1:9222``; the guest exposes nothing to the network), opens a
``LocalTunnel`` to it through the server's ``/sandboxes/{id}/tunnel/9222``
route, and attaches Playwright with ``connect_over_cdp``. Playwright is the
well-kept client; no browser is downloaded: the one in the guest is Debian's.

Under software emulation (TCG) Chromium needs 30-60 s before its first page on an
idle machine, minutes on a busy one; ``prepare`` waits up to ``START_TIMEOUT_S``.
The flags are the desktop image's (``hangar.images.recipes.CHROMIUM_FLAGS``),
passed again here so that an image built before a change of them gets them too.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

from hangar.errors import HangarError
from hangar.guest import paths
from hangar.images.recipes import CHROMIUM_FLAGS
from hangar.tools.backend import Backend, SandboxInfo
from hangar.tools.results import ToolResult
from hangar.tools.toolset import Handler
from hangar.tools.tunnel import LocalTunnel
from hangar.tools.vm import VmTools

DEVTOOLS_PORT = 9222
START_TIMEOUT_S = 600.0
"""Seconds ``prepare`` waits for the desktop and Chromium's DevTools endpoint (a guard
against a hang: on a busy 2-core host under TCG, Chromium's start takes minutes)."""
NAVIGATE_TIMEOUT_S = 120.0
"""The least a navigation (``browser_navigate`` without ``timeout_s``, or the page an action
led to) may take, seconds. A sandbox's own budget is the larger of this and its Chromium's
measured start (``BrowserTools.navigate_timeout_s``): both are CPU-bound work of the same
guest, and under emulation on a busy host a page's load takes minutes."""
ACTION_TIMEOUT_S = 30.0
MAX_TEXT_CHARS = 100_000

DISABLED_FEATURES = (
    # Playwright's list for the browsers it launches (chromiumSwitches in playwright-core)
    "AvoidUnnecessaryBeforeUnloadCheckSync", "DestroyProfileOnBrowserClose", "HttpsUpgrades",
    "HttpsFirstBalancedModeAutoEnable", "LensOverlay", "MediaRouter", "PaintHolding",
    "ThirdPartyStoragePartitioning", "OptimizationHints", "NetworkTimeServiceQuerying",
    "AimEnabled", "PreconnectToSearch", "Translate",
    # and background work of Chromium's own that an agent's browser has no use for
    "OptimizationGuideOnDeviceModel", "OptimizationHintsFetching",
    "OptimizationTargetPrediction", "OptimizationGuideModelDownloading",
    "AutofillServerCommunication",
)
"""Chromium features turned off in a driven browser (``--disable-features``)."""

DRIVEN_FLAGS = (
    "--disable-field-trial-config",
    "--disable-background-timer-throttling",
    "--disable-backgrounding-occluded-windows",
    "--disable-back-forward-cache",
    "--disable-breakpad",
    "--disable-component-extensions-with-background-pages",
    "--disable-default-apps",
    "--disable-extensions",
    "--disable-features=" + ",".join(DISABLED_FEATURES),
    "--allow-pre-commit-input",
    "--disable-hang-monitor",
    "--disable-ipc-flooding-protection",
    "--disable-popup-blocking",
    "--disable-prompt-on-repost",
    "--disable-renderer-backgrounding",
    "--force-color-profile=srgb",
    "--metrics-recording-only",
    "--no-service-autorun",
    "--disable-search-engine-choice-screen",
)
"""Flags for a Chromium driven over DevTools: those Playwright (1.65) gives a Chromium it
launches itself on Linux, since here the tier launches it and Playwright only attaches
(``connect_over_cdp``), less the ones ``CHROMIUM_FLAGS`` already sets and those for other
browsers or platforms. A page is never throttled as hidden, so its animation frames, which
a click's stability check waits for, keep coming. No field-trial configuration, back-forward
cache, paint holding or autofill queries: work a form's submit did on the guest's vCPUs
before its result page could load (measured: click to load 143 s with Chromium's defaults
against 65 s, side by side on one busy host). ``DISABLED_FEATURES`` also stops Chromium's
on-device model service, a utility process that otherwise starts a few minutes after launch
and probes for a Vulkan GPU the guest does not have ("Error loading backend" in
``/tmp/hangar-chromium.log``) while the guest is loading the agent's page."""

LAUNCH = r"""
import json, os, socket, subprocess, sys, time
deadline = time.monotonic() + float(sys.argv[1])
while not os.path.exists("@READY@"):
    if time.monotonic() > deadline:
        sys.exit("the desktop did not come up")
    time.sleep(0.2)
screen = json.load(open("@READY@"))
args = ["chromium", *sys.argv[3:], "--kiosk", "--window-position=0,0",
        f"--window-size={screen['width']},{screen['height']}",
        "--remote-debugging-address=127.0.0.1", f"--remote-debugging-port={sys.argv[2]}",
        "--user-data-dir=/tmp/hangar-chromium", "about:blank"]
log = open("/tmp/hangar-chromium.log", "ab")
subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                 env={**os.environ, "DISPLAY": ":0"}, start_new_session=True)
while True:
    try:
        socket.create_connection(("127.0.0.1", int(sys.argv[2])), 1).close()
        break
    except OSError:
        if time.monotonic() > deadline:
            sys.exit("Chromium's DevTools endpoint did not open; see /tmp/hangar-chromium.log")
        time.sleep(0.2)
print(json.dumps(screen))
""".replace("@READY@", paths.DESKTOP_READY)


def png_size(png: bytes) -> tuple[int, int]:
    """(width, height) in pixels from a PNG's IHDR chunk."""
    return struct.unpack(">II", png[16:24])  # type: ignore[return-value]


def _message(exc: BaseException) -> str:
    """The first line of a Playwright error's message, at most 1000 characters."""
    text = str(getattr(exc, "message", None) or exc).strip()
    return (text.splitlines() or [""])[0][:1000]


def _on_page(handler: Handler) -> Handler:
    """``handler`` for the page: a failed result when the browser is not running, and
    Playwright's errors (timeouts, net::ERR_...) as failed results with their message."""
    async def on_page(tools: BrowserTools, args: dict[str, Any],
                      time_left: float | None) -> ToolResult:
        if tools.page is None:
            return ToolResult.failure("the browser is not running")
        from playwright.async_api import Error as PlaywrightError

        try:
            return await handler(tools, args, time_left)
        except PlaywrightError as exc:
            return ToolResult.failure(_message(exc))

    return on_page


class BrowserTools(VmTools):
    """The vm tools plus ``browser_navigate``, ``browser_interact`` and
    ``browser_screenshot`` on one page of the guest's Chromium."""

    tier = "browser"

    def __init__(self, backend: Backend, sandbox: SandboxInfo) -> None:
        super().__init__(backend, sandbox)
        self.tunnel: LocalTunnel | None = None
        self._pw: Any = None
        self._browser: Any = None
        self.page: Any = None
        self.load_error: str | None = None
        """Why the last navigation failed; None once a page has loaded."""
        self.start_s: float | None = None
        """Seconds Chromium took from its launch until Playwright was attached (``prepare``)."""
        self.navigate_timeout_s = NAVIGATE_TIMEOUT_S
        """Seconds a navigation may take here: ``NAVIGATE_TIMEOUT_S`` or, when larger, this
        sandbox's measured ``start_s``."""

    async def prepare(self) -> None:
        """Work folder, Chromium, tunnel, Playwright. Raises HangarError when Chromium
        does not start; the caller deletes the sandbox."""
        await super().prepare()
        loop = asyncio.get_running_loop()
        launched = loop.time()
        r = await self.backend.exec(
            self.sid, "python3",
            args=["-c", LAUNCH, str(START_TIMEOUT_S), str(DEVTOOLS_PORT), *CHROMIUM_FLAGS,
                  *DRIVEN_FLAGS],
            timeout_s=START_TIMEOUT_S + 30)
        if r.exit_code != 0:
            raise HangarError("the browser did not start: "
                              + r.stderr.decode("utf-8", "replace").strip()[-500:])
        from playwright.async_api import async_playwright

        self.tunnel = LocalTunnel(self.backend.ws_url, self.backend.auth_headers(), self.sid,
                                  DEVTOOLS_PORT)
        port = await self.tunnel.start()
        self._pw = await async_playwright().start()
        self._browser = await self._pw.chromium.connect_over_cdp(
            f"http://127.0.0.1:{port}", timeout=START_TIMEOUT_S * 1000)
        context = self._browser.contexts[0] if self._browser.contexts \
            else await self._browser.new_context()
        self.page = context.pages[0] if context.pages else await context.new_page()
        self.start_s = loop.time() - launched
        self.navigate_timeout_s = max(NAVIGATE_TIMEOUT_S, self.start_s)

    async def close(self) -> None:
        for step in (lambda: self._browser and self._browser.close(),
                     lambda: self._pw and self._pw.stop(),
                     lambda: self.tunnel and self.tunnel.close()):
            try:
                aw = step()
                if aw:
                    await asyncio.wait_for(aw, 10)
            except Exception:
                pass
        self._browser = self._pw = self.page = self.tunnel = None

    def _not_loaded(self) -> str | None:
        """Why the current page never loaded (a failed navigation, or Chromium's own error
        page), or None."""
        if self.load_error is None and str(self.page.url).startswith("chrome-error://"):
            return "the browser shows an error page"
        return self.load_error

    async def _page_text(self) -> tuple[str, bool]:
        text = str(await self.page.evaluate(
            "() => document.body ? document.body.innerText : ''"))
        return text[:MAX_TEXT_CHARS], len(text) > MAX_TEXT_CHARS

    async def navigate(self, args: dict[str, Any], time_left: float | None) -> ToolResult:
        timeout = float(args.get("timeout_s") or self.navigate_timeout_s)
        if time_left is not None:
            timeout = max(0.1, min(timeout, time_left))
        from playwright.async_api import Error as PlaywrightError

        try:
            resp = await self.page.goto(str(args["url"]), wait_until="load",
                                        timeout=timeout * 1000)
        except PlaywrightError as exc:
            self.load_error = (f"{args['url']} did not load: "
                               + _message(exc).removeprefix("Page.goto: "))
            raise
        self.load_error = None
        status = resp.status if resp is not None else None
        title = await self.page.title()
        text, cut = await self._page_text()
        ok = status is None or status < 400
        return ToolResult(ok=ok, output=f"URL: {self.page.url}\nStatus: {status}\n"
                                        f"Title: {title}\n\n{text}",
                          error=None if ok else f"HTTP status {status}", truncated=cut,
                          data={"url": self.page.url, "status": status, "title": title})

    async def interact(self, args: dict[str, Any], time_left: float | None) -> ToolResult:
        """One action on the page. A page that never loaded fails at once, with the reason
        (no element of it will ever appear, so waiting out the timeout would tell nothing)."""
        why = self._not_loaded()
        if why is not None:
            return ToolResult.failure(f"{why}; open a page with browser_navigate first")
        page, action = self.page, args["action"]
        sel = args.get("selector")
        ms = float(args.get("timeout_s") or ACTION_TIMEOUT_S) * 1000
        has_xy = "x" in args and "y" in args
        if action == "click":
            if sel:
                await page.click(sel, timeout=ms)
            elif has_xy:
                await page.mouse.click(args["x"], args["y"])
            else:
                return ToolResult.failure("click needs a selector or x and y")
        elif action == "type":
            if "text" not in args:
                return ToolResult.failure("type needs text")
            if sel:
                await page.fill(sel, args["text"], timeout=ms)
            else:
                await page.keyboard.type(args["text"])
        elif action == "select":
            if not sel or "value" not in args:
                return ToolResult.failure("select needs a selector and a value")
            try:
                await page.select_option(sel, value=args["value"], timeout=ms)
            except Exception:
                await page.select_option(sel, label=args["value"], timeout=ms)
        elif action == "press":
            if "key" not in args:
                return ToolResult.failure("press needs a key")
            if sel:
                await page.press(sel, args["key"], timeout=ms)
            else:
                await page.keyboard.press(args["key"])
        elif action == "scroll":
            if sel:
                await page.locator(sel).first.scroll_into_view_if_needed(timeout=ms)
            else:
                if has_xy:
                    await page.mouse.move(args["x"], args["y"])
                await page.mouse.wheel(0, args.get("delta_y", 500))
        await self._settle(time_left)
        title = await page.title()
        text, cut = await self._page_text()
        return ToolResult(ok=True, output=f"URL: {page.url}\nTitle: {title}\n\n{text}",
                          truncated=cut, data={"url": page.url, "title": title})

    async def _settle(self, time_left: float | None) -> None:
        """Wait until the page an action led to has fired its ``load`` event, up to
        ``navigate_timeout_s`` (or the task's ``time_left``, when shorter).

        Event-driven: Playwright follows Chromium's ``Page.lifecycleEvent`` for the
        document the click committed (it returns from the click once a navigation it
        started has committed), and returns at once when the action navigated nowhere.
        No ``document.readyState`` polling: a renderer still laying out the new page
        answers no ``Runtime.evaluate`` either, and each such question only adds work to a
        guest whose vCPUs are already saturated. Raises Playwright's timeout error when
        the page has not loaded in time; the next action then fails at once with that
        reason.
        """
        from playwright.async_api import TimeoutError as PlaywrightTimeout

        timeout = self.navigate_timeout_s
        if time_left is not None:
            timeout = max(0.1, min(timeout, time_left))
        try:
            await self.page.wait_for_load_state("load", timeout=timeout * 1000)
        except PlaywrightTimeout:
            self.load_error = (f"{self.page.url} did not finish loading within "
                               f"{timeout:.0f} s")
            raise

    async def screenshot(self, args: dict[str, Any], time_left: float | None) -> ToolResult:
        png = await self.page.screenshot(full_page=bool(args.get("full_page")), type="png",
                                         timeout=self.navigate_timeout_s * 1000)
        w, h = png_size(png)
        return ToolResult(ok=True, output=f"screenshot {w}x{h} pixels", image=png,
                          data={"width": w, "height": h, "url": self.page.url})

    HANDLERS = {**VmTools.HANDLERS,
                "browser_navigate": _on_page(navigate),
                "browser_interact": _on_page(interact),
                "browser_screenshot": _on_page(screenshot)}

