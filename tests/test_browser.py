"""A real headless Chromium (Debian's /usr/bin/chromium, never a downloaded browser) drives the
app: load the page, generate on a HumanEval problem, rate both candidates, submit; then an empty
writing prompt shows an error and the page keeps working. Saves screenshots and prints where."""
from __future__ import annotations

import os
import shutil

import pytest

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not os.path.exists(CHROMIUM),
                       reason=f"{CHROMIUM} missing: `apt-get install chromium` (make browser-deps) to run the browser test"),
]


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    import torch

    from test_ui_api import start_app

    threads = torch.get_num_threads()
    demo, url, ctx = start_app(tmp_path_factory.mktemp("browser"))
    yield url, ctx
    demo.close()
    ctx.engine.close()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def page():
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        pg = browser.new_page(viewport={"width": 1400, "height": 1000})
        yield pg
        browser.close()


def shot(page, tmp_path, name: str) -> str:
    """Full-page screenshot under $COLLAB_SCREENSHOT_DIR (else the test's tmp dir); prints the path."""
    out_dir = os.environ.get("COLLAB_SCREENSHOT_DIR") or str(tmp_path)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    page.screenshot(path=path, full_page=True)
    print(f"screenshot: {path}")
    return path


def test_generate_and_rate_in_browser(app, page, tmp_path):
    url, ctx = app
    page.goto(url)
    page.wait_for_selector("#code-generate", timeout=60_000)
    page.locator("#rater input, #rater textarea").first.fill("browser-test")
    page.click("#code-generate")
    page.wait_for_selector("#code-status:has-text('generating 2 joint answers')", timeout=60_000)  # streamed progress
    page.wait_for_selector("#code-status:has-text('group #')", timeout=300_000)
    for i, value in ((0, "4"), (1, "2")):
        assert page.locator(f"#code-cand-{i}").inner_text().startswith(f"Candidate {i + 1}")
        page.click(f"#code-rate-{i} label:has-text('{value}')")
    card = page.locator("#code-cand-0").inner_text()
    assert "helper" in card and "main" in card and "Automatic checks" in card
    page.click("#code-submit")
    page.wait_for_selector("#code-rate-msg:has-text('rating saved')", timeout=60_000)
    assert "by browser-test" in page.inner_text("#code-rate-msg")
    ratings = ctx.store.ratings_for(rater="browser-test")
    assert sorted(r.value for r in ratings) == [2, 4]
    assert ctx.store.recent_groups(1)[0].session_id      # the browser session owns the group
    assert os.path.getsize(shot(page, tmp_path, "collab-cocode.png")) > 10_000
    # multi-turn: another round from the best candidate, with the checks' feedback in the prompts
    page.click("#code-again")
    page.wait_for_selector("#code-status:has-text('turn 2')", timeout=300_000)
    assert ctx.store.recent_groups(1)[0].turn == 1


def test_bad_input_shows_message_and_page_survives(app, page, tmp_path):
    url, ctx = app
    groups = ctx.store.stats()["groups"]
    page.get_by_role("tab", name="Co-write").click()
    page.locator("#write-text textarea").fill("   ")
    page.click("#write-generate")
    page.wait_for_selector("text=text is empty", timeout=60_000)     # Gradio's error toast
    assert ctx.store.stats()["groups"] == groups
    # still works: the Data tab lists this session's group from the first test
    page.get_by_role("tab", name="Data").click()
    page.get_by_role("button", name="Refresh").click()
    page.wait_for_selector("#data-stats:has-text('ratings')", timeout=60_000)
    page.wait_for_selector("#data-groups:has-text('HumanEval/0')", timeout=60_000)   # this session's group
    shot(page, tmp_path, "collab-data.png")


def test_chromium_is_debian_not_downloaded():
    # the test must never use a browser fetched by `playwright install`
    assert shutil.which("chromium") == CHROMIUM or os.path.exists(CHROMIUM)
