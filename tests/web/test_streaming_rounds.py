"""Streaming rounds and feedback in the app's handlers, without a model: a scripted engine that
writes its answers word by word (several snapshots, as the Engine.generate_stream contract says),
optionally one snapshot at a time when the test releases it, so every intermediate state is
observed, never timed. Real store (SQLite in tmp_path), real tasks (TL;DR metrics, a person's
own coding problem in the sandbox), the real GenerationBatcher."""
from __future__ import annotations

import threading

import pytest

from collab_app.engines.engine_types import EngineError, Sampling
from collab_app.online.returns import CUSTOM_TRAINING_KEY
from collab_app.web import handlers as H
from collab_app.engines.batcher import GenerationBatcher
from collab_app.web.access import RateLimiter
from collab_app.web.context import AppContext
from tasks import load_task

from helpers.scripted import TEXT, ScriptedStreamEngine, make_ctx

# custom coding problems of this module's own must run here, whatever the sandbox level (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("people_code_runs_here")

A, B = H.Caller("session-A"), H.Caller("session-B")
TOKEN = "Q7v-mR2x_Lp9sWz4Kc"          # passes context.admin_token_problem


def until(events, pred, limit: int = 10_000):
    """Consume events until one satisfies pred; returns it (fails if the round ends first)."""
    for _ in range(limit):
        ev = next(events)
        if pred(ev):
            return ev
        assert ev["kind"] != "done", "the round ended before the expected state"
    raise AssertionError("state never reached")


# --------------------------------------------------------------------------- streaming

def test_text_streams_and_each_candidate_is_checked_when_written(tmp_path):
    eng = ScriptedStreamEngine(gated=True)
    ctx = make_ctx(tmp_path, eng)
    events = H.generate(ctx, H.start_writing(ctx, "tldr", TEXT), A, tick_s=0.05)
    eng.release()                                              # one word of every sample
    ev = until(events, lambda e: e["kind"] == "progress" and e["candidates"][0]["parts"][0]["text"])
    c0, c1 = ev["candidates"]
    assert c0["state"] == c1["state"] == "writing" and c0["joint_sample_id"] is None
    first_words = [p["text"] for p in c0["parts"]]
    assert first_words == [a.name for a in ctx.teams["tldr"].agents]   # one word so far, not the answer
    assert "writing …" in H.render_candidate(c0, 0, coding=False)

    eng.release(5)   # sample 0 of each agent is done after 5 words; sample 1 needs 7
    ev = until(events, lambda e: e["kind"] == "progress" and e["candidates"][0]["state"] == "checked")
    c0, c1 = ev["candidates"]
    assert c1["state"] == "writing" and c0["reward"]["max_total"] == ctx.tasks["tldr"].max_reward
    assert c0["joint_sample_id"] is None and ctx.store.stats()["groups"]["ready"] == 0   # not stored yet
    md = H.render_candidate(c0, 0, coding=False)
    assert "Automatic checks" in md and "rating opens when all candidates" in md

    eng.release(100)
    done = until(events, lambda e: e["kind"] == "done")
    ep = done["episode"]
    grp = ctx.store.group(ep["group_id"])
    assert [j.id for j in grp.joints] == [c["joint_sample_id"] for c in ep["candidates"]]
    assert [c["state"] for c in ep["candidates"]] == ["checked", "checked"]
    for a in range(2):   # what streamed is a prefix of what was stored
        assert grp.samples[a][0].text.startswith(first_words[a])
        assert [c["parts"][a]["text"] for c in ep["candidates"]] == [s.text for s in grp.samples[a]]
    assert grp.session_id == "session-A" and eng.calls == [2]   # one call: 2 agents x 1 example


def test_batcher_merges_sessions_and_hands_each_its_slice(tmp_path):
    eng = ScriptedStreamEngine()
    ctx = make_ctx(tmp_path, eng)
    team = ctx.teams["tldr"]
    smp = Sampling(max_new_tokens=8)
    ctx._batcher = GenerationBatcher(ctx.engine, ctx.engine_lock, max_examples=2, window_s=600,
                                      company_s=None)   # waits for both, however slow
    t1 = ctx.batcher().submit(team, ["alpha one two three four five six", "alpha b c d e f g"], 2, smp)
    t2 = ctx.batcher().submit(team, ["omega one two three four five six", "omega b c d e f g"], 2, smp)
    seen = {}
    for name, t in (("alpha", t1), ("omega", t2)):
        evs = []
        while not evs or evs[-1][0] not in ("done", "error"):
            evs.append(t.events.get(timeout=60))
        assert evs[-1][0] == "done" and len(evs) > 2           # several snapshots, then the samples
        other = "omega" if name == "alpha" else "alpha"
        for ev in evs[:-1]:                                    # only its own texts, growing
            texts = [t for row in ev[1] for t in row]
            assert all(other not in t for t in texts)
        seen[name] = [[s.text for s in row] for row in evs[-1][1]]
    assert eng.calls == [4] and ctx.batcher().batches == [2]   # one engine call for both sessions (2 x 2 agents)
    assert all(name in t for name in seen for row in seen[name] for t in row)


def test_the_batcher_waits_for_company_only_once_requests_overlap(tmp_path):
    """A lone request starts at once, however long the window (600 s here: a wait would fail the
    60 s timeouts); a request that arrives while another is open marks company, and from then on
    a batch waits its window for others (here: until a partner makes max_examples); company is
    forgotten after company_s. Observed through the engine's calls, not timed."""
    import time

    def finish(ticket):
        while True:
            kind = ticket.events.get(timeout=60)[0]
            if kind != "progress":
                return kind

    eng = ScriptedStreamEngine(gated=True)
    ctx = make_ctx(tmp_path, eng)
    team, smp = ctx.teams["tldr"], Sampling(max_new_tokens=8)
    b = GenerationBatcher(ctx.engine, ctx.engine_lock, max_examples=2, window_s=600, company_s=120)
    assert not b.in_company()
    eng.release(100)
    assert finish(b.submit(team, ["alone one two three", "x y z"], 2, smp)) == "done"
    assert eng.calls == [2] and not b.in_company()             # one person: no window before its call

    eng.gate = threading.Semaphore(1)                          # one snapshot, then the engine waits
    first = b.submit(team, ["first one two three", "x y z"], 2, smp)
    assert not b.in_company()                                  # the moment the last one said done: alone
    assert first.events.get(timeout=60)[0] == "progress"       # generating ...
    second = b.submit(team, ["second one two three", "x y z"], 2, smp)
    assert b.in_company()                                      # ... when the second arrived
    eng.release(100)
    assert finish(first) == "done" and eng.calls == [2, 2]     # the second waits for the next call,
    third = b.submit(team, ["third one two three", "x y z"], 2, smp)   # which waits for company
    assert finish(second) == finish(third) == "done"
    assert eng.calls == [2, 2, 4]                              # one call for both
    b.company_s = 0.05
    time.sleep(0.1)
    assert not b.in_company()


def test_bad_request_fails_alone(tmp_path):
    eng = ScriptedStreamEngine()
    ctx = make_ctx(tmp_path, eng)
    team, smp = ctx.teams["tldr"], Sampling(max_new_tokens=8)
    ctx._batcher = GenerationBatcher(ctx.engine, ctx.engine_lock, max_examples=2, window_s=600,
                                      company_s=None)
    bad = ctx.batcher().submit(team, ["BAD one two", "x y z"], 2, smp)
    good = ctx.batcher().submit(team, ["fine one two", "x y z"], 2, smp)
    last = {}
    for name, t in (("bad", bad), ("good", good)):
        ev = t.events.get(timeout=60)
        while ev[0] == "progress":
            ev = t.events.get(timeout=60)
        last[name] = ev
    assert last["bad"][0] == "error" and isinstance(last["bad"][1], EngineError)
    assert last["good"][0] == "done"


def test_checks_run_in_parallel(tmp_path):
    """Each candidate's check waits for the other's to start: only parallel checks both pass."""
    barrier = threading.Barrier(2, timeout=60)
    real = load_task("tldr")

    class Meeting:   # the real TL;DR task; its reward first meets the other candidate's check
        def __getattr__(self, name):
            return getattr(real, name)

        def reward(self, example, outputs):
            barrier.wait()
            return real.reward(example, outputs)

    ctx = make_ctx(tmp_path, ScriptedStreamEngine())
    ctx.tasks["tldr"] = Meeting()
    ep = H.run_generate(ctx, H.start_writing(ctx, "tldr", TEXT), A)["episode"]
    assert [c["check_error"] for c in ep["candidates"]] == [None, None]
    assert all(c["reward"] is not None for c in ep["candidates"])


def test_closed_page_stops_the_engine_call(tmp_path):
    eng = ScriptedStreamEngine(gated=True)
    ctx = make_ctx(tmp_path, eng)
    events = H.generate(ctx, H.start_writing(ctx, "tldr", TEXT), A, tick_s=0.05)
    eng.release()
    until(events, lambda e: e["kind"] == "progress" and e["candidates"][0]["parts"][0]["text"])
    events.close()                          # the person left
    eng.release(100)
    assert eng.closed.wait(60), "the batcher kept generating for nobody"
    assert ctx.store.stats()["groups"]["ready"] + ctx.store.stats()["groups"]["open"] == 0


# --------------------------------------------------------------------------- who may rate

@pytest.fixture
def rated(tmp_path):
    """A context (G=3, admin token TOKEN, public) and one stored TL;DR round of session A."""
    ctx = make_ctx(tmp_path, ScriptedStreamEngine(), G=3, admin_token=TOKEN, public=True)
    ep = H.run_generate(ctx, H.start_writing(ctx, "tldr", TEXT), A)["episode"]
    return ctx, ep


def test_only_the_generating_session_or_an_admin_rates(rated):
    ctx, ep = rated
    jid = ep["candidates"][0]["joint_sample_id"]
    assert "as session:session-A" in H.rate_candidates(ctx, ep, ["4", None, None], A)
    for caller, token, fragment in ((B, "", "another session"), (H.Caller(None), "", "carries no session"),
                                    (B, "guess", "admin token")):
        with pytest.raises(H.UserError, match=fragment):
            H.rate(ctx, jid, 5, caller, token=token)
    with pytest.raises(H.UserError, match="another session"):
        H.rate_candidates(ctx, ep, ["5", "5", "5"], B)       # a copied page state does not help
    H.rate(ctx, jid, 2, B, token=TOKEN)                        # an admin may
    rows = ctx.store.ratings_for(joint_sample_id=jid)
    assert [(r.rater, r.value, r.kind, r.session_id) for r in rows] == [
        ("session:session-A", 4, "stars", "session-A"), ("session:session-B", 2, "stars", None)]


def test_hf_login_is_the_rater_id(rated):
    ctx, ep = rated
    me = H.Caller("session-A", username="ana")
    H.rate(ctx, ep["candidates"][1]["joint_sample_id"], 5, me)
    assert ctx.store.ratings_for(rater="hf:ana")[0].session_id == "session-A"


def test_rank_and_pick_best(rated):
    ctx, ep = rated
    gid, jids = ep["group_id"], [c["joint_sample_id"] for c in ep["candidates"]]
    msg = H.rank(ctx, gid, [2, 3, 1], A, comment="third is best")
    assert "best first: candidate 3 > candidate 1 > candidate 2" in msg
    rows = ctx.store.ratings_for(group_id=gid, kind="rank")
    assert [(r.joint_sample_id, r.value, r.detail) for r in rows] == [
        (jids[0], 3.0, {"rank": 2, "of": 3}), (jids[1], 1.0, {"rank": 3, "of": 3}), (jids[2], 5.0, {"rank": 1, "of": 3})]
    assert {r.comment for r in rows} == {"third is best"}
    assert "candidate 2 is the best of 3" in H.pick_best(ctx, gid, "2", A)
    rows = ctx.store.ratings_for(group_id=gid, kind="pick_best")
    assert [(r.value, r.detail["best"]) for r in rows] == [(1.0, False), (5.0, True), (1.0, False)]
    assert ctx.store.group(gid).status == "ready"


@pytest.mark.parametrize("ranks, fragment", [
    ([1, 1, 2], "several candidates"), ([1, 2, None], "candidate 3 has no rank"), ([1, 2], "each of the 3"),
    ([1, 2, 4], "ranks go from 1"), ([0, 1, 2], "ranks go from 1"), ([1, 2, "x"], "whole number"),
    ("1,2,3", "a list of 3"),
])
def test_bad_rankings_are_refused(rated, ranks, fragment):
    ctx, ep = rated
    with pytest.raises(H.UserError, match=fragment):
        H.rank(ctx, ep["group_id"], ranks, A)
    assert ctx.store.ratings_for() == []


@pytest.mark.parametrize("call, fragment", [
    (lambda ctx, gid: H.rank(ctx, gid, [1, 2, 3], B), "another session"),
    (lambda ctx, gid: H.pick_best(ctx, gid, 1, B), "another session"),
    (lambda ctx, gid: H.pick_best(ctx, gid, 4, A), "does not exist"),
    (lambda ctx, gid: H.pick_best(ctx, gid, 0, A), "does not exist"),
    (lambda ctx, gid: H.pick_best(ctx, gid, None, A), "pick the best"),
    (lambda ctx, gid: H.pick_best(ctx, 10**9, 1, A), "no group"),
    (lambda ctx, gid: H.rank(ctx, None, [1, 2, 3], A), "nothing to rate"),
    (lambda ctx, gid: H.rank(ctx, gid, [1, 2, 3], B, token="nope"), "admin token"),
])
def test_feedback_refusals(rated, call, fragment):
    ctx, ep = rated
    with pytest.raises(H.UserError, match=fragment):
        call(ctx, ep["group_id"])
    assert ctx.store.ratings_for() == []
    H.pick_best(ctx, ep["group_id"], 1, B, token=TOKEN)        # the admin may, for any group


def test_rate_limits(tmp_path):
    ctx = make_ctx(tmp_path, ScriptedStreamEngine(), G=2, max_rounds_per_minute=1, max_ratings_per_minute=3)
    ep = H.run_generate(ctx, H.start_writing(ctx, "tldr", TEXT), A)["episode"]
    with pytest.raises(H.UserError, match="too many rounds: at most 1 per minute per session; try again in"):
        H.run_generate(ctx, H.start_writing(ctx, "tldr", TEXT), A)
    H.run_generate(ctx, H.start_writing(ctx, "tldr", TEXT), B)          # another session has its own
    H.rank(ctx, ep["group_id"], [1, 2], A)                                # counts 2
    H.rate(ctx, ep["candidates"][0]["joint_sample_id"], 4, A)           # 3 (replaces its rank rating)
    with pytest.raises(H.UserError, match="too many ratings: at most 3 per minute"):
        H.rate(ctx, ep["candidates"][0]["joint_sample_id"], 3, A)
    # everything accepted is kept: one row per candidate and rater, the latest write in force
    rows = ctx.store.ratings_for()
    assert [(r.kind, r.value, r.revision) for r in rows] == [("stars", 4.0, 1), ("rank", 1.0, 0)]


def test_rate_limiter_window():
    lim = RateLimiter(2, window_s=60.0)
    assert lim.take("a") is None and lim.take("a") is None
    wait = lim.take("a")
    assert wait is not None and 0 < wait <= 60
    assert lim.take("b", 2) is None and lim.take("c", 3) == float("inf")
    assert RateLimiter(0).take("a", 10**6) is None
    with pytest.raises(ValueError, match="0 = no limit"):
        AppContext(engine=None, store=None, tasks={}, teams={}, max_ratings_per_minute=-1)


def test_own_coding_problems_need_an_admin_to_train(rated):
    ctx, _ = rated
    assert not H.custom_training_allowed(ctx) and "kept, not trained on" in H.training_status(ctx)
    ep = H.start_coding(ctx, H.SOURCES[1], "eval", "", 'def add(a, b):\n    """Sum."""\n',
                        "assert add(1, 2) == 3\n", "")
    done = H.run_generate(ctx, ep, A)
    assert "only if an admin allows it" in done["message"]
    assert ctx.store.group(done["episode"]["group_id"]).task == "custom-coding"
    with pytest.raises(H.UserError, match="admin token"):
        H.set_custom_training(ctx, "", True)
    H.set_custom_training(ctx, TOKEN, True)
    assert ctx.store.get_state(CUSTOM_TRAINING_KEY)["allowed"] is True and H.custom_training_allowed(ctx)
    assert "train the shared team (admin allowed)" in H.training_status(ctx)
    H.set_custom_training(ctx, TOKEN, False)
    assert not H.custom_training_allowed(ctx)


def test_the_page_streams_no_faster_than_the_contexts_update_interval(tmp_path, monkeypatch):
    """The page's round asks the handler for updates at most every ctx.page_update_s (each update
    costs Gradio ~20-30 ms of Python beside the engine: docs/results "A round in the real page"),
    and a round streams in fewer updates at a longer interval (the scripted engine's snapshots
    come every 20 ms; observed as counts, not timed against a limit)."""
    import dataclasses

    import gradio as gr

    from collab_app.web import serve, ui

    with pytest.raises(ValueError, match="page_update_s must be > 0"):
        make_ctx(tmp_path, ScriptedStreamEngine(), page_update_s=0)
    with pytest.raises(ValueError, match="page_update_s must be > 0"):
        serve.ServeConfig(page_update_s=-1)
    assert '"page_update_s": cfg.page_update_s' in __import__("inspect").getsource(serve.serve)
    assert {f.name: f.default for f in dataclasses.fields(serve.ServeConfig)}["page_update_s"] == \
        {f.name: f.default for f in dataclasses.fields(AppContext)}["page_update_s"]
    seen = []
    real = H.generate

    def spy(ctx, ep, caller, **kw):
        seen.append(kw.get("min_update_s"))
        return real(ctx, ep, caller, **kw)
    monkeypatch.setattr(ui.H, "generate", spy)
    monkeypatch.setattr(ui, "_caller", lambda request: A)     # the session a page's cookie would name
    updates = {}
    for interval in (0.01, 0.3):
        ctx = make_ctx(tmp_path / str(interval), ScriptedStreamEngine(delay_s=0.02), page_update_s=interval)
        with gr.Blocks():
            panel = ui._Panel(ctx, "write", 2)
            state = gr.State()
        ep = H.start_writing(ctx, "tldr", TEXT)
        updates[interval] = len(list(panel.stream(ep, state, None)))
    assert seen == [0.01, 0.3]
    assert updates[0.3] < updates[0.01], updates


def test_each_page_update_names_every_markdown_and_never_a_picked_rating(tmp_path, monkeypatch):
    """ui._Panel.stream's update contract: after the reset, every update names each Markdown output
    with the text the page should show (Gradio rebuilds an output left alone, which costs it ~4x
    a plain value: docs/results "A round in the real page"), and a rating is only ever shown,
    never given a value, so stars picked mid-round stay picked. The last update holds the stored
    round's texts."""
    import gradio as gr

    from collab_app.web import ui

    monkeypatch.setattr(ui, "_caller", lambda request: A)
    ctx = make_ctx(tmp_path, ScriptedStreamEngine(delay_s=0.005), page_update_s=0.01)
    with gr.Blocks():
        panel = ui._Panel(ctx, "write", 2)
        state = gr.State()
    ep = H.start_writing(ctx, "tldr", TEXT)
    updates = list(panel.stream(ep, state, None))
    assert len(updates) > 3
    markdowns = set(panel.markdowns())
    for upd in updates[1:]:
        assert markdowns <= set(upd), markdowns - set(upd)
        for r in panel.ratings:
            assert r not in upd or "value" not in upd[r], upd[r]
    last = updates[-1]
    stored = last[state]
    assert stored["group_id"] and "rating saved" not in last[panel.status]
    for i, c in enumerate(stored["candidates"]):
        for a, p in enumerate(c["parts"]):
            assert last[panel.parts[i][a]] == H.render_part(p, coding=False)
        assert last[panel.heads[i]] == H.render_head(c, i) and last[panel.checks[i]] == H.render_checks(c)
    K = len(stored["candidates"])
    assert [last[r] for r in panel.ratings] == [gr.update(visible=i < K) for i in range(len(panel.ratings))]


def test_the_warm_up_runs_one_short_batch_of_the_first_task_and_never_stops_serving(tmp_path, caplog):
    from collab_app.web.core import warm_up

    eng = ScriptedStreamEngine()
    ctx = make_ctx(tmp_path, eng)
    first = next(iter(ctx.tasks))
    seen = []
    real = eng.generate_stream

    def spy(requests, n, sampling):
        seen.append(([r.agent for r in requests], n, sampling.max_new_tokens))
        return real(requests, n, sampling)
    eng.generate_stream = spy
    took = warm_up(ctx)
    assert took is not None and took >= 0
    team = [a.name for a in ctx.team_for(first).agents]
    assert seen == [(team, 2, 2)]                      # one engine call: the first task's team, G=2, 2 tokens
    assert ctx.sampling.max_new_tokens != 2            # the server's own settings are untouched
    # an engine that fails: a warning, no exception (serve goes on to open the page)
    eng.generate_stream = lambda *a: (_ for _ in ()).throw(EngineError("no kernels today"))
    assert warm_up(ctx) is None
    assert "warm-up batch failed" in caplog.text and "no kernels today" in caplog.text
