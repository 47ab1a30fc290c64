"""The blind arena's core on the embedded model (transformers engine, real SQLite store): a pair is two
team states served side by side in one engine call, stored before the vote; one vote per pair, by
its own session; labels only after it; the board from the stored votes."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest

from collab_app.engines.engine_types import Request, Sampling
from collab_app.online.arena import state_key, team_states
from collab_app.web.access import Caller, UserError
from collab_app.web.arena import arena_board, arena_pair, arena_round, arena_vote, task_states
from helpers.model_app import record_steps, make_ctx

ME = Caller("web:me", host="10.0.0.1", network="10.0.0.0/24")
OTHER = Caller("web:other", host="10.0.1.1", network="10.0.1.0/24")
TLDR_ROLES = ["summary", "detail"]


@pytest.fixture()
def ctx(engine, tmp_path):
    c = make_ctx(engine, tmp_path / "store.db", sampling=Sampling(max_new_tokens=12, temperature=0.0))
    yield c
    c.store.close()


def _train(ctx, lora_adapter, steps=2):
    record_steps(ctx.store, TLDR_ROLES, lora_adapter, steps)


def test_nothing_to_compare_before_the_first_step(ctx):
    with pytest.raises(UserError, match="nothing to compare") as e:
        arena_pair(ctx, ME, "tldr")
    assert e.value.code == "nothing_to_compare"
    assert ctx.store.arena_matches(voted=None) == []


def test_states_follow_the_steps(ctx, lora_adapter):
    _train(ctx, lora_adapter, 2)
    states = team_states(ctx.store, TLDR_ROLES)
    assert [s.label for s in states] == ["base", "step 1", "step 2"]
    assert states[2].key == state_key({"summary": 2, "detail": 2}) == "detail:v2,summary:v2"
    ctx.store.pin_adapter("summary", 1)            # a rollback of one role: a state no step made
    asked, current = task_states(ctx, "tldr")
    assert current.versions == {"summary": 1, "detail": 2}
    assert current.key in [s.key for s in asked] and "base" in [s.key for s in asked]


def test_a_pair_serves_each_state_exactly_and_hides_which(ctx, lora_adapter, engine):
    _train(ctx, lora_adapter, 2)
    match = arena_pair(ctx, ME, "tldr", rng=random.Random(3))
    rec = ctx.store.arena_match(match["match_id"])
    assert rec.state_a != rec.state_b and rec.winner is None and rec.session_id == ME.session_id
    # nothing the voter sees names a state or a version
    shown = repr(match)
    for key in (rec.state_a, rec.state_b):
        assert key not in shown
    assert "version" not in shown and "step" not in shown.lower().replace("steps", "")
    # each side is what its versions write (greedy): the slot served exactly the state stored
    task = ctx.tasks["tldr"]
    for versions, outputs in ((rec.versions_a, rec.outputs_a), (rec.versions_b, rec.outputs_b)):
        for role, prompt, text in zip(TLDR_ROLES, rec.prompts, outputs):
            v = versions[role]
            engine.register_agent("probe")
            engine.load_adapter("probe", None if v is None else lora_adapter(v), v)
            want = engine.generate([Request("probe", prompt)], 1, Sampling(max_new_tokens=12, temperature=0.0))[0][0]
            assert text == want.text, (role, v)
    assert rec.combined_a == task.combine(rec.example, rec.outputs_a)


def test_one_vote_by_its_own_session_then_the_labels(ctx, lora_adapter):
    _train(ctx, lora_adapter, 1)
    match = arena_pair(ctx, ME, "tldr", rng=random.Random(0))
    with pytest.raises(UserError) as e:
        arena_vote(ctx, OTHER, match["match_id"], "a")
    assert e.value.code == "not_entitled"
    for junk in ("left", "", None, 1, "ab"):
        with pytest.raises(UserError, match="'a', 'b' or 'tie'"):
            arena_vote(ctx, ME, match["match_id"], junk)
    out = arena_vote(ctx, ME, match["match_id"], "B")
    assert out["winner"] == "b" and {out["a"]["label"], out["b"]["label"]} <= {"base", "step 1 (serving now)"}
    assert "do not train" in out["message"]
    with pytest.raises(UserError, match="already has its vote"):
        arena_vote(ctx, ME, match["match_id"], "a")
    rec = ctx.store.arena_match(match["match_id"])
    assert (rec.winner, rec.voter, rec.network, rec.signed_in) == ("b", "session:web:me", ME.network, False)


def test_votes_count_against_the_rating_limits(engine, tmp_path, lora_adapter):
    ctx = make_ctx(engine, tmp_path / "s.db", sampling=Sampling(max_new_tokens=4, temperature=0.8),
                   max_ratings_per_minute=1, max_rounds_per_minute=0)
    _train(ctx, lora_adapter, 1)
    first, second = (arena_pair(ctx, ME, "tldr") for _ in range(2))
    arena_vote(ctx, ME, first["match_id"], "tie")
    with pytest.raises(UserError) as e:
        arena_vote(ctx, ME, second["match_id"], "a")
    assert e.value.code == "rate_limit_exceeded"
    assert ctx.store.arena_match(second["match_id"]).winner is None     # a refusal stores nothing


def test_a_round_counts_and_streams(ctx, lora_adapter):
    _train(ctx, lora_adapter, 1)
    ctx.limits.begin_round(ME)                      # ME already has a round in flight (limit 1)
    with pytest.raises(UserError):
        next(arena_round(ctx, ME, "tldr"))
    ctx.limits.end_round(ME)
    events = list(arena_round(ctx, ME, "tldr", text="The council met and agreed to test bicycle lanes for six "
                                                    "months before deciding whether to keep them."))
    assert events[-1]["kind"] == "done" and "bicycle" in events[-1]["match"]["prompt"]
    with pytest.raises(UserError, match="own text on writing tasks"):
        next(arena_round(ctx, ME, "humaneval", text="write fizzbuzz"))
    with pytest.raises(UserError, match="unknown arena task"):
        next(arena_round(ctx, ME, "nope"))


def test_the_board_is_the_stored_votes(ctx, lora_adapter):
    _train(ctx, lora_adapter, 1)
    for _ in range(6):
        m = arena_pair(ctx, ME, "tldr")
        rec = ctx.store.arena_match(m["match_id"])
        arena_vote(ctx, ME, m["match_id"], "a" if rec.state_a != "base" else "b")   # always the trained state
    board = arena_board(ctx, "tldr", rounds=50)
    assert board["votes"] == 6 and board["voters"] == {"session:web:me": 6}
    top, bottom = board["states"][0], board["states"][-1]
    assert top["label"].startswith("step 1") and top["serving"] and top["wins"] == 6
    assert bottom["label"] == "base" and bottom["losses"] == 6 and top["rating"] > bottom["rating"]


def test_hostile_input_is_refused_before_any_work(ctx, lora_adapter):
    """A huge text, an unknown held-out id, a forged pair id: a clear error, nothing generated or stored."""
    _train(ctx, lora_adapter, 1)
    with pytest.raises(UserError, match="the limit is"):
        next(arena_round(ctx, ME, "tldr", text="word " * (ctx.max_prompt_chars // 4)))
    with pytest.raises(UserError, match="no example 'nope'"):
        next(arena_round(ctx, ME, "tldr", example_id="nope"))
    with pytest.raises(UserError):
        next(arena_round(ctx, Caller(None), "tldr"))          # no server-issued session
    for forged in (10**9, -1, "1; drop table", True, 2.5):
        with pytest.raises(UserError):
            arena_vote(ctx, ME, forged, "a")
    assert ctx.store.arena_matches(voted=None) == [] and ctx.limits.held(ME) == 0


def test_the_trainers_version_0_is_base_not_states_of_their_own(ctx, lora_adapter):
    """The trainer records each agent's version 0 (a fresh LoRA) one at a time before any step: no
    "summary v0 · detail base" states taking the arena's places; base stands for them."""
    for role in TLDR_ROLES:
        ctx.store.record_adapter_version(role, 0, lora_adapter(7, 0.0))      # no step
    asked, current = task_states(ctx, "tldr")
    assert [s.key for s in asked] == ["base"] and current.key == "base"
    with pytest.raises(UserError, match="nothing to compare"):
        arena_pair(ctx, ME, "tldr")
    ctx.store.record_adapter_version("summary", 1, lora_adapter(1), step=1)   # a step that moved one agent
    states = team_states(ctx.store, TLDR_ROLES)
    assert [(s.label, s.versions) for s in states] == [("base", {"summary": None, "detail": None}),
                                                       ("step 1", {"summary": 1, "detail": 0})]
