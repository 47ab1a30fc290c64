"""A round that breaks ends on the page with a message, and the page offers only what the server
serves. Seen in the real page with `collab serve --tasks tldr`: the Co-code tab offered "My own
coding problem", Generate raised KeyError (no team for 'custom-coding') inside the round and the
page said "starting ..." for good. Also: the hot-swap poll before a batch must not fail the
rounds waiting in it when one store read fails.

Scripted engine (no model), real store, real tasks, the real batcher."""
from __future__ import annotations

import logging

import pytest

from collab_app.engines.engine_types import Sampling
from collab_app.engines.team import Agent, Team
from collab_app.online.store import Store
from collab_app.web import core
from collab_app.web import handlers as H
from collab_app.web.context import AppContext
from helpers.scripted import TEXT, ScriptedStreamEngine, make_ctx
from tasks import load_task

A = H.Caller("session-A")


def tldr_only(tmp_path, **kw) -> AppContext:
    """The app `collab serve --tasks tldr` builds: one writing task, no coding team."""
    engine = ScriptedStreamEngine()
    task = load_task("tldr")
    team = Team([Agent(role) for role in task.roles])
    for a in team.agents:
        engine.register_agent(a.name)
    return AppContext(engine=engine, store=Store(f"sqlite:///{tmp_path}/store.db"), tasks={"tldr": task},
                      teams={"tldr": team}, num_generations=2, sampling=Sampling(max_new_tokens=16),
                      home=str(tmp_path), **kw)


# --------------------------------------------------------------------------- what the page offers

def test_an_app_without_a_coding_team_offers_no_coding_problem(tmp_path):
    ctx = tldr_only(tmp_path)
    assert ctx.untrusted_allowed                          # a local app: the sandbox would allow it ...
    assert H.task_choices(ctx) == {"coding": [], "writing": ["tldr"]}   # ... but no team works on it
    assert not H.own_problem_served(ctx)
    with pytest.raises(H.UserError, match="not served by this app.*serves tldr.*--tasks") as e:
        H.start_coding(ctx, H.SOURCES[1], "eval", "", "def f(x):\n    '''x'''\n", "assert f(1) == 1", "")
    assert e.value.code == "not_served"
    with pytest.raises(H.UserError, match="HumanEval is not served"):
        H.start_coding(ctx, H.SOURCES[0], "eval", "HumanEval/0", "", "", "")
    full = make_ctx(tmp_path / "full", ScriptedStreamEngine())
    assert "custom-coding" in H.task_choices(full)["coding"] and H.own_problem_served(full)


def test_the_page_has_no_co_code_tab_without_a_coding_team(tmp_path):
    from collab_app.web import ui

    ctx = tldr_only(tmp_path)
    assert ui.served_kinds(ctx) == {"coding": False, "writing": True}
    demo = ui.build_app(ctx)
    labels = {getattr(b, "label", None) for b in demo.blocks.values()}
    assert "Co-write" in labels and "Co-code" not in labels
    assert not any(getattr(b, "elem_id", None) == "code-generate" for b in demo.blocks.values())
    full = ui.build_app(make_ctx(tmp_path / "full", ScriptedStreamEngine()))
    assert "Co-code" in {getattr(b, "label", None) for b in full.blocks.values()}


# --------------------------------------------------------------------------- a round that breaks

def test_an_unexpected_error_in_a_round_ends_it_with_a_message_and_a_traceback_in_the_log(tmp_path, caplog):
    ctx = tldr_only(tmp_path)
    ep = core.new_episode() | {"task": "custom-coding", "custom": {"prompt": "def f(x):\n    '''x'''\n",
                                                                  "tests": "assert f(1) == 1", "entry_point": ""}}
    ep["example"] = core.task_of(ctx, ep).examples("eval")[0]   # what the old page let a person start
    with caplog.at_level(logging.ERROR, logger="collab_app.web.handlers"):
        events = list(H.round_events(ctx, ep, A))
    assert [e["kind"] for e in events] == ["failed"]
    msg = events[0]["message"]
    assert msg.startswith("this round failed on the server (KeyError: \"no team for task 'custom-coding'")
    ref = msg.rsplit(" ", 1)[-1]
    assert ref.startswith("round-")
    (rec,) = [r for r in caplog.records if ref in r.getMessage()]
    assert rec.exc_info and rec.exc_info[0] is KeyError            # the traceback is in the log
    assert ctx.limits.held(A) == 0


def test_on_a_public_app_the_message_names_the_error_not_its_text(tmp_path):
    ctx = tldr_only(tmp_path, public=True)
    ctx.teams = {}                                         # any bug inside the round
    ep = H.start_writing(ctx, "tldr", TEXT)
    (ev,) = list(H.round_events(ctx, ep, A))
    assert ev["kind"] == "failed" and not ev["user_error"]
    assert "(KeyError)" in ev["message"] and "no team" not in ev["message"]


def test_a_refusal_in_a_round_ends_it_with_its_own_message(tmp_path):
    ctx = tldr_only(tmp_path)
    ep = H.start_writing(ctx, "tldr", TEXT + " BAD")       # the scripted engine refuses it
    events = list(H.round_events(ctx, ep, A))
    assert events[-1]["kind"] == "failed" and events[-1]["user_error"]
    assert "the engine refused this prompt" in events[-1]["message"]
    assert ctx.limits.held(A) == 0                         # the round's place was given back


def test_the_page_ends_a_failed_round_with_the_message_in_its_status(tmp_path, monkeypatch):
    import gradio as gr

    from collab_app.web import ui

    monkeypatch.setattr(ui, "_caller", lambda request: A)
    ctx = tldr_only(tmp_path)
    with gr.Blocks():
        panel = ui._Panel(ctx, "write", 2)
        state = gr.State()
    ctx.teams = {}
    updates = list(panel.stream(H.start_writing(ctx, "tldr", TEXT), state, None))
    assert updates[0][panel.status] == "*starting ...*"
    last = updates[-1][panel.status]
    assert last.startswith("**Round failed**: this round failed on the server \\(KeyError") and "round\\-" in last
    assert state not in updates[-1]                        # the person's episode is left as it was


# --------------------------------------------------------------------------- the hot-swap poll

def test_a_failed_store_read_before_a_batch_does_not_fail_the_round(tmp_path, caplog):
    import sqlalchemy.exc

    ctx = make_ctx(tmp_path, ScriptedStreamEngine())
    real, calls = ctx.store.current_adapter_versions, []

    def flaky():
        calls.append(1)
        if len(calls) <= 2:
            raise sqlalchemy.exc.OperationalError("SELECT ...", {}, Exception("database is locked"))
        return real()
    ctx.store.current_adapter_versions = flaky
    with caplog.at_level(logging.INFO, logger="collab_app.online.hotswap"):
        for _ in range(3):
            done = H.run_generate(ctx, H.start_writing(ctx, "tldr", TEXT), A)
            assert done["episode"]["group_id"]
    assert len(calls) >= 3
    warned = [r for r in caplog.records if "cannot read the adapter versions" in r.getMessage()]
    assert len(warned) == 1 and "database is locked" in warned[0].getMessage()   # once per run of failures
    assert any("answers again after 2 failed read(s)" in r.getMessage() for r in caplog.records)
