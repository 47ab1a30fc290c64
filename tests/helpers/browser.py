"""The headless Chromium the browser tests drive: Debian's /usr/bin/chromium (never a downloaded
browser), one page per test module."""
from __future__ import annotations

from contextlib import contextmanager

import pytest

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]


@contextmanager
def chromium_page(width: int = 1400, height: int = 1000):
    """A page of a fresh headless Chromium (playwright), closed with the block."""
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            yield browser.new_page(viewport={"width": width, "height": height})
        finally:
            browser.close()
