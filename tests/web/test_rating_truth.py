"""The person is told the truth about a rating: one that will never train (its group already
trained, expired or set aside: the store keeps it as a `late` row) is not answered with a bare
"rating saved", on the page or from /v1; and a store that is busy during a rating says so,
stores nothing and spends none of the person's rating budget.

Scripted engine (no model), real store (SQLite), real tasks, the real batcher; /v1 through
Starlette's TestClient."""
from __future__ import annotations

import pytest
import sqlalchemy.exc
from fastapi import FastAPI
from fastapi.testclient import TestClient

from collab_app.online.returns import ReturnRule
from collab_app.web import core
from collab_app.web import handlers as H
from collab_app.web.access import api_caller
from collab_app.web.openai_api import OpenAIConfig, key_id, mount_openai
from helpers.scripted import TEXT, ScriptedStreamEngine, make_ctx

A = H.Caller("session-A")
KEY = "kA7-xQ2m_Rt9pLz4Vn8w"          # passes context.admin_token_problem
AUTH = {"Authorization": f"Bearer {KEY}"}


def round_of(ctx, caller=A) -> dict:
    """One stored round of TL;DR: its episode (group id, candidates with joint sample ids)."""
    return H.run_generate(ctx, H.start_writing(ctx, "tldr", TEXT), caller)["episode"]


def late_rows(ctx, group_id: int) -> list[bool]:
    return [r.late for j in ctx.store.group(group_id).joints for r in j.ratings]


@pytest.fixture
def ctx(tmp_path):
    return make_ctx(tmp_path, ScriptedStreamEngine())


# --------------------------------------------------------------------------- the page

def test_a_rating_of_a_trained_group_says_it_will_not_train(ctx):
    ep = round_of(ctx)
    ctx.store.mark_trained([ep["group_id"]], step=3)       # trained on its automatic returns meanwhile
    msg = H.rate_candidates(ctx, ep, ["4", "2"], A)
    assert late_rows(ctx, ep["group_id"]) == [True, True]
    assert msg.startswith(f"rating saved, but it will not train the team (group #{ep['group_id']} was already "
                          "trained at step 3; your rating is kept for the export)")
    fresh = round_of(ctx)
    assert H.rate_candidates(ctx, fresh, ["4", "2"], A).startswith("rating saved: #")   # an open group: as before
    assert late_rows(ctx, fresh["group_id"]) == [False, False]


def test_expired_and_set_aside_groups_say_why(ctx):
    expired = round_of(ctx)
    assert expired["group_id"] in ctx.store.expire_groups(ReturnRule(mode="human", human_timeout_s=0))
    fb = core.store_feedback(ctx, A, "pick_best", expired["group_id"], 1)
    assert (fb.trains, fb.late) == (False, True)
    assert fb.why_not.startswith(f"group #{expired['group_id']} expired (")
    aside = round_of(ctx)
    ctx.store.set_aside([aside["group_id"]], "its step failed twice: ValueError: bad shapes")
    msg = H.rank(ctx, aside["group_id"], [2, 1], A)
    assert msg.startswith(f"ranking saved, but it will not train the team (group #{aside['group_id']} was set "
                          "aside (its step failed twice: ValueError: bad shapes); your ranking is kept")
    assert late_rows(ctx, aside["group_id"]) == [True, True]


def test_one_star_rating_of_a_closed_group_through_the_api_endpoint_message(ctx):
    ep = round_of(ctx)
    ctx.store.mark_trained([ep["group_id"]], step=1)
    jid = ep["candidates"][0]["joint_sample_id"]
    assert H.rate_saved(ctx, jid, 5, A).startswith("rating saved, but it will not train the team (group #")
    assert H.rate(ctx, jid, 4, A) > 0                      # the id, as before


def test_own_problem_ratings_say_they_train_only_when_an_admin_allows(ctx):
    ep = H.start_coding(ctx, H.SOURCES[1], "eval", "", "def add(a, b):\n    '''Sum.'''\n",
                        "assert add(1, 2) == 3", "")
    done = H.run_generate(ctx, ep, A)["episode"]
    fb = core.store_feedback(ctx, A, "pick_best", done["group_id"], 1)
    assert not fb.trains and not fb.late and "only while an admin allows it" in fb.why_not


# --------------------------------------------------------------------------- /v1

def test_v1_answers_say_whether_a_rating_trains(ctx):
    app = FastAPI()
    mount_openai(app, ctx, OpenAIConfig(api_keys=(KEY,)))
    client = TestClient(app)
    caller = api_caller(key_id(KEY))
    ep = round_of(ctx, caller)
    jid = ep["candidates"][0]["joint_sample_id"]
    r = client.post("/v1/ratings", json={"joint_sample_id": jid, "rating": 4}, headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.json()["trains"] is True and r.json()["late"] is False and r.json()["notes"] == []
    ctx.store.mark_trained([ep["group_id"]], step=7)
    r = client.post("/v1/ratings", json={"group_id": ep["group_id"], "best": 2}, headers=AUTH)
    body = r.json()
    assert r.status_code == 200 and body["trains"] is False and body["late"] is True
    assert body["notes"] == [f"saved, but it will not train the team: group #{ep['group_id']} was already trained "
                             "at step 7; your rating is kept for the export"]


# --------------------------------------------------------------------------- a busy store

def locked(*a, **k):
    raise sqlalchemy.exc.OperationalError("INSERT INTO ratings ...", {}, Exception("database is locked"))


def test_a_busy_store_stores_nothing_spends_no_budget_and_says_try_again(tmp_path, monkeypatch):
    ctx = make_ctx(tmp_path, ScriptedStreamEngine(), max_ratings_per_minute=2)
    ep = round_of(ctx)
    real = ctx.store.add_ratings
    monkeypatch.setattr(ctx.store, "add_ratings", locked)
    for _ in range(3):                                     # more attempts than the budget allows
        with pytest.raises(H.UserError, match="the store is busy.*nothing was saved.*submit again") as e:
            H.rate_candidates(ctx, ep, ["4", "2"], A)
        assert e.value.code == "store_busy" and e.value.retry_after
    monkeypatch.setattr(ctx.store, "add_ratings", real)
    assert H.rate_candidates(ctx, ep, ["4", "2"], A).startswith("rating saved: #")   # the whole budget is there
    assert ctx.store.stats()["ratings"] == 2


def test_v1_answers_a_busy_store_with_503_and_retry_after(ctx, monkeypatch):
    app = FastAPI()
    mount_openai(app, ctx, OpenAIConfig(api_keys=(KEY,), max_ratings_per_minute=1))
    client = TestClient(app)
    ep = round_of(ctx, api_caller(key_id(KEY)))
    jid = ep["candidates"][0]["joint_sample_id"]
    real = ctx.store.add_ratings
    monkeypatch.setattr(ctx.store, "add_ratings", locked)
    r = client.post("/v1/ratings", json={"joint_sample_id": jid, "rating": 4}, headers=AUTH)
    assert r.status_code == 503 and r.headers["Retry-After"] == "5", r.text
    assert r.json()["error"]["code"] == "store_busy" and "nothing was saved" in r.json()["error"]["message"]
    monkeypatch.setattr(ctx.store, "add_ratings", real)
    r = client.post("/v1/ratings", json={"joint_sample_id": jid, "rating": 4}, headers=AUTH)
    assert r.status_code == 200, r.text                    # the one rating a minute was not spent
