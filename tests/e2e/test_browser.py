"""A real headless Chromium (Debian's /usr/bin/chromium, never a downloaded browser) drives the
app: load the page, generate on a HumanEval problem and see the candidates' text in the page
while they are being written, rate both candidates, submit, pick the best, rank them; then an empty writing
prompt shows an error and the page keeps working; a round that fails inside ends with a message.
Saves screenshots and prints where.

Seeing text "while it is written" is observed, not timed: the app's real engine is wrapped so
that its first round stops after the first snapshot that has text (`HeldStream`) until the test
has found that text in the page; only then may the round end."""
from __future__ import annotations

import os
import shutil
import threading

import pytest

from helpers.browser import CHROMIUM, chromium_page

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not os.path.exists(CHROMIUM),
                       reason=f"{CHROMIUM} missing: `apt-get install chromium` (make browser-deps) to run the browser test"),
]


class HeldStream:
    """The real engine, except that its first round is held after the first snapshot with text
    until `go` is set: that snapshot is the engine's own when it streams, else (an engine that
    yields only its final result) the first half of each final text, marked not done."""

    def __init__(self, engine):
        self._engine, self.go, self.held, self.holding = engine, threading.Event(), None, threading.Event()

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def generate_stream(self, requests, n, sampling):
        from collab_app.engines import stream
        from collab_app.engines.engine_types import Progress

        for p in stream(self._engine, requests, n, sampling):
            if not self.go.is_set() and any(t.strip() for row in p.texts for t in row):
                partial = p if not p.finished else Progress(
                    [[t[:max(1, len(t) // 2)] for t in row] for row in p.texts], [[None] * len(row) for row in p.done])
                self.held = partial.texts
                self.holding.set()
                yield partial
                self.go.wait(600)   # a failing test sets it too (fixture teardown); never a timing
                if partial is p:
                    continue
            yield p


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    import torch

    from helpers.launch import start_app

    threads = torch.get_num_threads()
    demo, url, ctx = start_app(tmp_path_factory.mktemp("browser"), wrap_engine=HeldStream)
    yield url, ctx
    ctx.engine.go.set()
    demo.close()
    ctx.engine.close()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def page():
    with chromium_page() as pg:
        yield pg


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
    assert page.locator("#rater").count() == 0                  # no typed rater name any more
    page.click("#code-generate")
    page.wait_for_selector("#code-status:has-text('generating 2 joint answers')", timeout=60_000)  # streamed progress
    # the round is held mid-stream (HeldStream): the partial text must be in the page now
    assert ctx.engine.holding.wait(300), "the engine never produced text"
    held = ctx.engine.held
    first = next(line.strip() for row in held for t in row for line in t.splitlines() if line.strip())[:12]
    page.wait_for_function("([sel, want]) => document.querySelector(sel).innerText.includes(want)",
                           arg=["#code-cand-0, #code-cand-1", first], timeout=60_000)
    assert "group #" not in page.inner_text("#code-status")     # the round has not ended
    assert "writing" in page.inner_text("#code-cand-0") + page.inner_text("#code-cand-1")
    assert not page.locator("#code-submit").is_visible()        # ratings open only once stored
    shot(page, tmp_path, "collab-cocode-streaming.png")
    ctx.engine.go.set()
    page.wait_for_selector("#code-status:has-text('group #')", timeout=300_000)
    for i, value in ((0, "4"), (1, "2")):
        assert page.locator(f"#code-cand-{i}").inner_text().startswith(f"Candidate {i + 1}")
        page.click(f"#code-rate-{i} label:has-text('{value}')")
    card = page.locator("#code-cand-0").inner_text()
    assert "helper" in card and "main" in card and "Automatic checks" in card
    # the checks' lines (test code, error messages: `[`, `(`, `_`, `*` ...) read in the page as the
    # store holds them, not as Markdown (handlers.md_literal); HTML folds runs of white space
    from collab_app.web.handlers import check_summary

    (group,) = ctx.store.recent_groups(1)
    shown = " ".join(" ".join(page.inner_text(f"#code-cand-{i}-checks").split()) for i in range(2))
    for joint in group.joints:
        for line in check_summary(joint.auto_details or {}):
            assert " ".join(line.split()) in shown, f"{line!r} is not shown as it is in {shown!r}"
    page.click("#code-submit")
    page.wait_for_selector("#code-rate-msg:has-text('rating saved')", timeout=60_000)
    session = ctx.store.recent_groups(1)[0].session_id   # the browser session owns the group
    assert session and f"as session:{session}" in page.inner_text("#code-rate-msg")
    ratings = ctx.store.ratings_for(rater=f"session:{session}")
    assert sorted(r.value for r in ratings) == [2, 4] and {r.kind for r in ratings} == {"stars"}
    page.click("#code-best label:has-text('candidate 2')")
    page.click("#code-pick")
    page.wait_for_selector("#code-rate-msg:has-text('candidate 2 is the best of 2')", timeout=60_000)
    picks = ctx.store.ratings_for(rater=f"session:{session}", kind="pick_best")
    assert [r.value for r in picks] == [1, 5]
    for i, r in ((0, 2), (1, 1)):   # rank: candidate 2 first
        page.click(f"#code-rank-{i} input")
        page.click(f"li.item[aria-label='{r}']")
    page.click("#code-rank")
    page.wait_for_selector("#code-rate-msg:has-text('best first: candidate 2 > candidate 1')", timeout=60_000)
    ranks = ctx.store.ratings_for(rater=f"session:{session}", kind="rank")
    assert [(r.value, r.detail["rank"]) for r in ranks] == [(1, 2), (5, 1)]
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
    # still works: opening the Data tab lists this session's group from the first test (made after
    # the page loaded: the tab refreshes when selected), and so does its Refresh button
    page.get_by_role("tab", name="Data").click()
    page.wait_for_selector("#data-groups:has-text('HumanEval/0')", timeout=60_000)   # this session's group
    page.wait_for_selector("#data-stats:has-text('ratings')", timeout=60_000)
    page.get_by_role("button", name="Refresh").click()
    page.wait_for_selector("#data-groups:has-text('HumanEval/0')", timeout=60_000)
    shot(page, tmp_path, "collab-data.png")


def test_a_round_that_fails_ends_on_the_page_with_a_message(app, page, tmp_path, monkeypatch):
    """An unexpected error inside a round (here: no team for the task, as `--tasks tldr` gave the
    Co-code tab's own problem) ends the round on the page with a message, not "starting ..." for
    good; the page works on once the fault is gone."""
    from helpers.model_app import TEXT

    url, ctx = app
    page.goto(url)
    page.get_by_role("tab", name="Co-write").click()
    page.locator("#write-text textarea").fill(TEXT)
    with monkeypatch.context() as m:
        m.setattr(ctx, "teams", {})
        page.click("#write-generate")
        page.wait_for_selector("#write-status:has-text('Round failed')", timeout=60_000)
    status = page.inner_text("#write-status")
    assert "this round failed on the server (KeyError" in status and "starting" not in status
    shot(page, tmp_path, "collab-round-failed.png")
    ctx.engine.go.set()                                   # the held first round, when run alone
    page.click("#write-generate")
    page.wait_for_selector("#write-status:has-text('group #')", timeout=300_000)


def test_check_lines_read_as_text_in_gradios_markdown(page):
    """The checks' Markdown (handlers.render_checks) in Gradio's own renderer, in the browser: a
    failing test's code and error read as the sandbox wrote them (`__index__` was bold "index")."""
    import gradio as gr

    from collab_app.web.handlers import check_summary, render_checks
    from collab_app.web.ui import wait_until_served
    from helpers.launch import free_port

    details = {"tests_passed": 0, "tests_total": 3,
               "first_failure": {"test": "assert f([1, 2], *args) == {'k': 1}  # [x](y) `c` <b>b</b> & #1",
                                 "error": "TypeError: have an __index__ method; a*b*c, 2**3, ~x~ | y"},
               "syntax_error": "line 1: def f(_x_, __y__):", "ratio": 0.34782608695652173}
    with gr.Blocks() as demo:
        gr.Markdown(render_checks({"reward": {"levels": {"tests": 0.0}, "details": details}}), elem_id="checks")
    demo.launch(server_name="127.0.0.1", server_port=free_port(), prevent_thread_lock=True, _frontend=False)
    try:
        wait_until_served(demo.local_url)
        page.goto(demo.local_url)
        page.wait_for_selector("#checks:has-text('Automatic checks')", timeout=60_000)
        shown = " ".join(page.inner_text("#checks").split())
        assert page.locator("#checks b, #checks strong").count() == 1   # the heading's only
        for line in check_summary(details):
            assert " ".join(line.split()) in shown, f"{line!r} is not shown as it is in {shown!r}"
        assert "ratio: 0.348" in shown
    finally:
        demo.close()


def test_chromium_is_debian_not_downloaded():
    # the test must never use a browser fetched by `playwright install`
    assert shutil.which("chromium") == CHROMIUM or os.path.exists(CHROMIUM)
