"""A real headless Chromium (Debian's /usr/bin/chromium, never a downloaded browser) votes in the
Arena tab of the real app (embedded model, transformers, two recorded training steps of the TL;DR
team): a pair arrives unlabelled, ONE click on a vote button stores the vote, reveals which team
states wrote A and B and streams the next pair; a few more votes, then the Training tab shows the
leaderboard and people's rating per step.

It measures (a) the vote click to the next pair's last words (the pair's "done" in the page) and
(b) a Co-write round on the same app, same text and sampling (the issue's target: the next pair
is ready in under a round's time), and prints both. The person reads each pair for READ_S before
voting, as a person does: meanwhile the next pair is written ahead (web/arena.py `write_ahead`). Screenshots: arena-tab.png (after a vote,
labels shown) and arena-leaderboard.png, under $COLLAB_SCREENSHOT_DIR (docs/results keeps the
ones its README shows), else the test's tmp dir."""
from __future__ import annotations

import os
import re
import statistics
import time

import pytest

from helpers.browser import CHROMIUM, chromium_page
MAX_NEW = 24
STEPS = 2
READ_S = 6.0   # a person reads both answers before voting (the next pair is written meanwhile)

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.skipif(not os.path.exists(CHROMIUM),
                       reason=f"{CHROMIUM} missing: `apt-get install chromium` (make browser-deps) to run the browser test"),
]


@pytest.fixture(scope="module")
def app(tmp_path_factory, lora_adapter):
    import torch

    from helpers.launch import start_app
    from helpers.model_app import record_steps

    threads = torch.get_num_threads()
    demo, url, ctx = start_app(tmp_path_factory.mktemp("arena"), max_new_tokens=MAX_NEW)
    roles = [a.name for a in ctx.team_for("tldr").agents]
    record_steps(ctx.store, roles, lora_adapter, STEPS)   # as the trainer records its steps
    yield url, ctx
    demo.close()
    ctx.engine.close()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def page():
    with chromium_page() as pg:
        yield pg


def shot(page, tmp_path, name: str, clip_ids: tuple[str, ...] = ()) -> str:
    """Screenshot under $COLLAB_SCREENSHOT_DIR (else the test's tmp dir): the whole page, or the box
    around the elements `clip_ids`. Prints the path."""
    out_dir = os.environ.get("COLLAB_SCREENSHOT_DIR") or str(tmp_path)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    clip = None
    if clip_ids:
        boxes = [page.locator(f"#{i}").bounding_box() for i in clip_ids]
        scroll = page.evaluate("() => [window.scrollX, window.scrollY]")
        x0, y0 = min(b["x"] for b in boxes) - 8, min(b["y"] for b in boxes) - 8
        x1, y1 = max(b["x"] + b["width"] for b in boxes) + 8, max(b["y"] + b["height"] for b in boxes) + 8
        clip = {"x": max(0, x0 + scroll[0]), "y": max(0, y0 + scroll[1]), "width": x1 - x0, "height": y1 - y0}
    page.screenshot(path=path, full_page=True, clip=clip)
    print(f"screenshot: {path}")
    return path


STATUS = "() => document.querySelector('#arena-status').innerText"


def _pair_done(page, after: int | None = None, timeout_ms: int = 300_000) -> int:
    """Wait until the status line says a pair (a newer one than `after`) is ready; its number."""
    page.wait_for_function(
        "(after) => { const m = document.querySelector('#arena-status').innerText"
        ".match(/pair #(\\d+) in .*which answer is better/); return m && (after === null || +m[1] > after); }",
        arg=after, timeout=timeout_ms)
    return int(re.search(r"pair #(\d+)", page.evaluate(STATUS)).group(1))


def _votes_on(page) -> bool:
    return all(page.locator(f"#arena-vote-{w}").is_enabled() for w in ("a", "tie", "b"))


def test_one_click_votes_reveals_and_brings_the_next_pair(app, page, tmp_path):
    from helpers.model_app import TEXT

    url, ctx = app
    page.goto(url)
    page.get_by_role("tab", name="Arena").click()
    page.click("#arena-task input")
    page.click("li.item[aria-label='tldr: summary + detail']")
    page.locator("#arena-text textarea").fill(TEXT)
    assert not _votes_on(page)                                     # no pair yet: nothing to vote on
    page.click("#arena-new")
    first = _pair_done(page)
    assert _votes_on(page)
    rec = ctx.store.arena_match(first)
    shown = page.inner_text("#arena-col-a") + page.inner_text("#arena-col-b") + page.inner_text("#arena-status")
    for label in ("serving now", "step 1", "step 2", rec.state_a, rec.state_b):
        assert label not in shown, f"{label!r} shown before the vote"
    assert "bicycle" in page.inner_text("#arena-prompt")

    # ONE click: the vote is stored, the labels appear, the next pair streams in; five votes in a row
    reveal_s, next_s, engine_s, last = [], [], [], first
    for k, w in enumerate(("a", "b", "a", "tie", "a")):
        time.sleep(READ_S)
        t0 = time.monotonic()
        page.click(f"#arena-vote-{w}")
        page.wait_for_selector(f"#arena-result:has-text('pair #{last}: A was')", timeout=60_000)
        reveal_s.append(time.monotonic() - t0)
        nxt = _pair_done(page, after=last)
        next_s.append(time.monotonic() - t0)
        engine_s.append(float(re.search(r"pair #\d+ in ([\d.]+) s", page.evaluate(STATUS)).group(1)))
        assert ctx.store.arena_match(last).winner == w and _votes_on(page)
        again = ctx.store.arena_match(nxt)
        assert again.example == rec.example and again.winner is None     # the same own text, not yet voted
        for side, combined in (("a", again.combined_a), ("b", again.combined_b)):
            # plain words only: Markdown turns the rest of an answer (brackets, "1.", "*") into markup
            for word in re.findall(r"[A-Za-z]{3,}", combined)[:3]:
                page.wait_for_function("([sel, w]) => document.querySelector(sel).innerText.includes(w)",
                                       arg=[f"#arena-{side}", word], timeout=10_000)
        if k == 0:
            result = page.inner_text("#arena-result")
            assert "Vote saved" in result and "serving now" in result
            assert os.path.getsize(shot(page, tmp_path, "arena-tab.png")) > 10_000
        last = nxt
    assert len(ctx.store.arena_matches("tldr")) == 5

    # Co-write rounds on the same app, same text and sampling
    page.get_by_role("tab", name="Co-write").click()
    page.locator("#write-text textarea").fill(TEXT)
    round_s = []
    for n in (1, 2):
        t0 = time.monotonic()
        page.click("#write-generate")
        page.wait_for_selector(f"#write-status:has-text('group #{n}:')", timeout=300_000)
        round_s.append(time.monotonic() - t0)
    fmt = lambda xs: f"median {statistics.median(xs):.1f} s ({', '.join(f'{x:.1f}' for x in xs)})"   # noqa: E731
    print(f"\narena, max_new_tokens {MAX_NEW}, {os.cpu_count()} cores, {READ_S:.0f} s reading each pair: "
          f"vote click -> labels shown {fmt(reveal_s)}; "
          f"-> next pair complete {fmt(next_s)} (its engine call {fmt(engine_s)}); "
          f"a Co-write round (G=2, same text) {fmt(round_s)}")

    # the leaderboard
    page.get_by_role("tab", name="Training").click()
    page.wait_for_selector("#train-arena-votes:has-text('5 votes from 1 voter')", timeout=120_000)
    page.wait_for_selector("#train-arena-board:has-text('step 2')", timeout=60_000)
    page.wait_for_selector("#train-arena-plot img", timeout=60_000)
    board = page.inner_text("#train-arena-board")
    assert "base" in board and "step 2" in board
    assert os.path.getsize(shot(page, tmp_path, "arena-leaderboard.png",
                                ("train-curves", "train-arena-votes", "train-arena-board"))) > 10_000
