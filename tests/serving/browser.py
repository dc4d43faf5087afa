"""The dashboard in a real browser: Debian's chromium driven by Playwright, every console error kept.

    with dashboard_page(url) as (page, errors):
        ...                 # the page is open at url + "/dashboard"
    assert not errors
"""
from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def dashboard_page(url: str, **page_options: Any) -> Iterator[tuple[Any, list[str]]]:
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium")
    assert chromium, "chromium is not installed: scripts/system-packages.sh installs it"
    errors: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page(**page_options)
            page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(url + "/dashboard")
            yield page, errors
        finally:
            browser.close()
