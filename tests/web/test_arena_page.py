"""The Arena tab's handlers (handlers.arena_*) on the embedded model (transformers engine, real
SQLite store): a new pair shows two answers and nothing that names a team state; one vote stores
it, reveals the labels and the next pair streams on the same task; the vote buttons are on only
while a pair waits for its vote; a vote without a pair is a message; the Training tab's leaderboard
with and without votes; the page wires the arena into the generate group."""
from __future__ import annotations

import random

import pytest

from collab_app.engines.engine_types import Sampling
from collab_app.web import handlers as H
from collab_app.web.access import Caller
from collab_app.web.arena import arena_vote, state_labels
from helpers.model_app import record_steps, TEXT, make_ctx

ME = Caller("web:me", host="10.0.0.1", network="10.0.0.0/24")
OTHER = Caller("web:other", host="10.0.1.1", network="10.0.1.0/24")
TLDR_ROLES = ["summary", "detail"]


@pytest.fixture()
def ctx(engine, tmp_path):
    c = make_ctx(engine, tmp_path / "store.db", sampling=Sampling(max_new_tokens=8, temperature=0.0))
    yield c
    c.store.close()


def _train(ctx, lora_adapter, steps=1):
    record_steps(ctx.store, TLDR_ROLES, lora_adapter, steps)


def _names_a_state(text: str, rec) -> list[str]:
    """What in `text` would name a pair's team states before the vote."""
    return [w for w in (rec.state_a, rec.state_b, "serving now", "adapter v", "base model", "step 1", "(base)")
            if w in text]


def test_nothing_to_compare_is_a_message_not_an_exception(ctx):
    views = list(H.arena_pair_events(ctx, ME, "tldr"))
    assert [v["kind"] for v in views] == ["start", "failed"]
    assert "No pair" in views[-1]["status"] and "nothing to compare yet" in views[-1]["status"]
    assert not any(v["can_vote"] for v in views) and views[-1]["state"]["match_id"] is None
    assert ctx.store.arena_matches(voted=None) == []


def test_a_new_pair_shows_two_answers_and_no_labels(ctx, lora_adapter):
    _train(ctx, lora_adapter)
    views = list(H.arena_pair_events(ctx, ME, "tldr", "", None, min_update_s=0.0, rng=random.Random(1)))
    kinds = [v["kind"] for v in views]
    assert kinds[0] == "start" and kinds[-1] == "done" and "progress" in kinds
    start, done = views[0], views[-1]
    example = ctx.tasks["tldr"].examples("eval")
    shown_id = start["state"]["example_id"]
    assert shown_id in {ex["id"] for ex in example} and "held-out example" in start["prompt"]
    # voting opens only once the pair is stored
    assert [v["can_vote"] for v in views] == [False] * (len(views) - 1) + [True]
    rec = ctx.store.arena_match(done["state"]["match_id"])
    assert rec.session_id == ME.session_id and rec.example_id == shown_id and rec.winner is None
    # each column is its side's combined answer, rendered as the Co-write tab renders answers
    assert done["a"] == H.render_text(rec.combined_a, False) and done["b"] == H.render_text(rec.combined_b, False)
    assert done["a"].strip() and done["b"].strip()
    for v in views:     # nothing the page shows before the vote names a state or a version
        shown = v["status"] + (v["prompt"] or "") + "".join(
            line for line in (v["a"] + v["b"]).splitlines() if not line.startswith(">"))   # the model's own words aside
        assert _names_a_state(shown, rec) == [], (v["kind"], shown)
    # a pair answering the task's held-out texts asks another one than the pair before
    for seed in range(6):
        gen = H.arena_pair_events(ctx, ME, "tldr", "", done["state"], rng=random.Random(seed))
        assert next(gen)["state"]["example_id"] != shown_id
        gen.close()


def test_a_vote_reveals_the_labels_then_the_next_pair_streams(ctx, lora_adapter):
    _train(ctx, lora_adapter)
    views = list(H.arena_pair_events(ctx, ME, "tldr", TEXT, None, min_update_s=0.0))
    first = views[-1]
    mid = first["state"]["match_id"]
    assert first["kind"] == "done" and "your text" in views[0]["prompt"] and "bicycle" in views[0]["prompt"]
    # another session's vote on my pair: refused, said so, my pair still open to my vote
    refused = H.arena_vote_view(ctx, OTHER, first["state"], "a")
    assert refused["result"].startswith("**Vote not saved**") and refused["can_vote"] and not refused["voted"]
    assert list(H.arena_next_events(ctx, OTHER, refused["state"])) == []      # no next pair on a refused vote
    out = H.arena_vote_view(ctx, ME, first["state"], "a")
    rec = ctx.store.arena_match(mid)
    labels = state_labels(ctx, "tldr")
    assert rec.winner == "a" and out["voted"] and not out["can_vote"] and out["state"]["voted"]
    assert f"A was {H.md_literal(labels[rec.state_a])}, B was {H.md_literal(labels[rec.state_b])}" in out["result"]
    assert "serving now" in out["result"] and "base" in out["result"]
    # one click: the next pair at once, on the same task and the same own text, streamed
    nxt = list(H.arena_next_events(ctx, ME, out["state"], min_update_s=0.0))
    kinds = [v["kind"] for v in nxt]
    assert kinds[0] == "start" and kinds[-1] == "done" and "progress" in kinds
    assert not nxt[0]["can_vote"] and nxt[0]["state"]["match_id"] is None and "bicycle" in nxt[0]["prompt"]
    assert nxt[-1]["can_vote"] and nxt[-1]["state"]["match_id"] not in (None, mid)
    again = ctx.store.arena_match(nxt[-1]["state"]["match_id"])
    assert again.task == "tldr" and again.example == rec.example and again.winner is None
    # the voted pair takes no second vote (and starts nothing)
    twice = H.arena_vote_view(ctx, ME, out["state"], "b")
    assert "has its vote already" in twice["result"] and not twice["voted"]
    assert ctx.store.arena_match(mid).winner == "a"


def test_vote_buttons_without_a_pair_give_a_message(ctx):
    for state in (None, H.arena_new_state()):
        for w in ("a", "tie", "b"):
            out = H.arena_vote_view(ctx, ME, state, w)
            assert out["result"].startswith("**No vote**") and "New pair" in out["result"]
            assert not out["can_vote"] and not out["voted"] and out["state"]["match_id"] is None
            assert list(H.arena_next_events(ctx, ME, out["state"])) == []


def _voted_pairs(ctx, votes):
    """Stored pairs between base and step 1 with their votes (who, winner: 'trained' or 'base'),
    through the store and arena_vote as a page's pair would be (no generation: the board is the votes)."""
    ex = ctx.tasks["tldr"].examples("eval")[0]
    trained = state_labels(ctx, "tldr")
    step1 = next(k for k in trained if k != "base")
    for who, winner in votes:
        mid = ctx.store.add_arena_match("tldr", ex, ["p", "p"], step1, "base", {r: 1 for r in TLDR_ROLES},
                                        {r: None for r in TLDR_ROLES}, ["x", "y"], ["z", "w"],
                                        session_id=who.session_id)
        arena_vote(ctx, who, mid, "a" if winner == "trained" else "b")


def test_the_leaderboard_without_and_with_votes(ctx, lora_adapter, tmp_path):
    _train(ctx, lora_adapter)
    renders = []

    def render(fig):
        renders.append(fig)
        return fig
    text, rows, fig = H.arena_board_view(ctx, render)
    assert text == H.ARENA_NO_VOTES and "vote in the **Arena** tab" in text.replace("Vote", "vote")
    assert rows == [] and fig is None and renders == []
    ctx.shared_views.clear()
    _voted_pairs(ctx, [(ME, "trained")] * 4 + [(OTHER, "trained"), (OTHER, "base")])
    text, rows, fig = H.arena_board_view(ctx, render)
    assert "**tldr**: 6 votes from 2 voters (votes per voter, most first: 4, 2)" in text
    assert "**humaneval**: no votes yet" in text
    assert "session:" not in text                                   # who voted is not shown to everyone
    assert [r[:2] for r in rows] == [["tldr", "step 1"], ["tldr", "base"]]
    top, base = rows
    assert top[4] == 6 and top[5] == "5 / 1 / 0" and top[6] == "✓" and base[5] == "1 / 5 / 0" and base[6] == ""
    lo, hi = (float(x) for x in top[3].split(" – "))
    assert lo <= top[2] <= hi and top[2] > base[2]
    assert renders == [fig] and fig is not None
    (ax,) = [a for a in fig.axes if a.get_visible()]
    assert ax.get_xlabel().startswith("training step") and "6 votes" in ax.get_title()
    fig.savefig(tmp_path / "board.png")
    assert (tmp_path / "board.png").stat().st_size > 5_000
    # one computation per TTL for every visitor
    assert H.arena_board_view(ctx, render)[2] is fig and len(renders) == 1


def test_the_page_wires_the_arena_into_the_generate_group(ctx):
    import gradio as gr

    from collab_app.web import ui

    demo = ui.build_app(ctx)
    tabs = [b.label for _, b in sorted(demo.blocks.items()) if isinstance(b, gr.Tab)]
    assert tabs == ["Co-code", "Co-write", "Arena", "Team", "Training", "Data"]
    fns = {f.name: f for f in demo.fns.values()}
    for name in ("on_new", "on_next"):
        assert fns[name].concurrency_id == ui.GENERATE and fns[name].concurrency_limit == ctx.generate_concurrency
    assert fns["vote"].concurrency_id != ui.GENERATE
    votes = [b for b in demo.blocks.values() if (getattr(b, "elem_id", None) or "").startswith("arena-vote-")]
    assert sorted(b.value for b in votes) == ["A is better", "B is better", "Tie"]
    assert not any(b.interactive for b in votes)                  # on only once a pair is shown
    board = next(b for b in demo.blocks.values() if getattr(b, "elem_id", None) == "train-arena-board")
    assert board.headers == H.ARENA_BOARD_HEADERS


def test_the_next_pair_is_written_while_the_person_reads(ctx, lora_adapter):
    """Once a pair is shown, the next one on the same task is written in the background: the vote's
    next pair is the one written ahead, there at once; it counted as a round of the person's; a
    pair asked another way (another task) does not take it."""
    import time

    _train(ctx, lora_adapter)
    first = list(H.arena_pair_events(ctx, ME, "tldr", "", None, min_update_s=0.0, rng=random.Random(2)))[-1]
    ahead = ctx.arena_ahead[ME.key]
    assert ahead.finished.wait(120) and ahead.done is not None and ahead.example_id != first["state"]["example_id"]
    written = ahead.done["match"]["match_id"]
    voted = H.arena_vote_view(ctx, ME, first["state"], "a")
    t0 = time.monotonic()
    views = list(H.arena_next_events(ctx, ME, voted["state"], min_update_s=0.0))
    assert time.monotonic() - t0 < 1.0 and views[-1]["kind"] == "done"
    assert views[-1]["state"]["match_id"] == written and views[-1]["state"]["example_id"] == ahead.example_id
    assert ctx.arena_ahead[ME.key] is not ahead                          # the one after is on its way
    ctx.arena_ahead[ME.key].finished.wait(120)
    # another task: the pair written ahead for tldr is dropped (stored, unvoted), a fresh one is asked
    views = list(H.arena_pair_events(ctx, ME, "humaneval", "", None, min_update_s=0.0))
    assert views[-1]["kind"] == "failed" and "nothing to compare" in views[-1]["status"]
    assert len(ctx.store.arena_matches("tldr", voted=None)) == 3
