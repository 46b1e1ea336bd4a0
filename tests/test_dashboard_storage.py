"""The dashboard's volumes and secrets, in real Chromium against a real server.

A volume made from the dashboard's form is listed and deleted there; a secret stored
from it is listed by name and hosts, its value leaves the page at once and is never
shown, and it is deleted there too. No VM is needed.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from conftest import Server

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run"]
VALUE = "dash-value-7f3a91c2e8b4d6"


def test_dashboard_makes_and_deletes_volumes_and_secrets(server: Server,
                                                         api: httpx.Client) -> None:
    pytest.importorskip("playwright")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"needs Debian's chromium ({CHROMIUM})")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.on("dialog", lambda d: d.accept())
            page.goto(server.url + "/ui/")
            page.fill("#api-key", server.key)
            page.click("#key-form button[type=submit]")

            page.fill("#volume-name", "dash-notes")
            page.fill("#volume-size", "64")
            page.click("#volume-form button[type=submit]")
            page.wait_for_selector("#volumes tr >> text=dash-notes", timeout=30_000)
            [vol] = [v for v in api.get("/volumes").json()["volumes"]
                     if v["name"] == "dash-notes"]
            assert vol["size_mib"] == 64
            assert "64 MiB" in page.inner_text(f'#volumes tr[data-id="{vol["id"]}"]')

            page.fill("#secret-name", "dash-gh")
            page.fill("#secret-value", VALUE)
            page.fill("#secret-hosts", "api.example.test, *.example.org")
            page.click("#secret-form button[type=submit]")
            row = '#secrets tr[data-name="dash-gh"]'
            page.wait_for_selector(row, timeout=30_000)
            assert page.input_value("#secret-value") == ""
            assert "api.example.test, *.example.org" in page.inner_text(row)
            assert VALUE not in page.content()
            got = api.get("/secrets/dash-gh").json()
            assert got["hosts"] == ["api.example.test", "*.example.org"] and VALUE not in str(got)

            page.click(f'{row} button[data-action="delete-secret"]')
            page.wait_for_selector(row, state="detached", timeout=30_000)
            assert api.get("/secrets/dash-gh").status_code == 404
            # A mistake is reported in the section it came from.
            page.fill("#volume-name", "dash-notes")
            page.click("#volume-form button[type=submit]")
            page.wait_for_selector('#volumes-status[data-state="error"]', timeout=30_000)
            assert "exists" in page.inner_text("#volumes-status"), page.inner_text("#volumes-status")
            page.click(f'#volumes tr[data-id="{vol["id"]}"] button[data-action="delete-volume"]')
            page.wait_for_selector(f'#volumes tr[data-id="{vol["id"]}"]', state="detached",
                                   timeout=30_000)
            assert api.get(f"/volumes/{vol['id']}").status_code == 404
        finally:
            browser.close()
            api.delete("/secrets/dash-gh")
            for v in api.get("/volumes").json()["volumes"]:
                if v["name"] == "dash-notes":
                    api.delete(f"/volumes/{v['id']}")
