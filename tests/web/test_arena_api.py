"""The blind arena through the OpenAI-compatible door (collab_app/web/openai_api.py): POST
/v1/arena/pairs, POST /v1/arena/votes, GET /v1/arena/leaderboard on a real AppContext (transformers
engine on the embedded model, SQLite store), with the same keys, refusals and body checks as the
door's chat completions and ratings. The arena's own rules are tests/web/test_arena_core.py's."""
from __future__ import annotations

import os
import threading

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")   # no network from tests

import pytest  # noqa: E402
from fastapi import FastAPI  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from collab_app.engines.engine_types import Sampling  # noqa: E402
from collab_app.web.openai_api import OpenAIConfig, key_id, mount_openai, openai_routes  # noqa: E402
from helpers.model_app import record_steps, make_ctx  # noqa: E402

KEY_A, KEY_B = "kA7-xQ2m_Rt9pLz4Vn8w", "kB3_Hs8e-Wq5yJc1Dg6u"     # pass context.admin_token_problem
AUTH_A, AUTH_B = {"Authorization": f"Bearer {KEY_A}"}, {"Authorization": f"Bearer {KEY_B}"}
TLDR_ROLES = ["summary", "detail"]
ROUTES = (("POST", "/v1/arena/pairs", {"task": "tldr"}), ("POST", "/v1/arena/votes", {"match_id": 1, "winner": "a"}),
          ("GET", "/v1/arena/leaderboard?task=tldr", None))


@pytest.fixture()
def ctx(engine, tmp_path):
    c = make_ctx(engine, tmp_path / "store.db", sampling=Sampling(max_new_tokens=12, temperature=0.0))
    yield c
    c.store.close()


def _train(ctx, lora_adapter, steps=2):
    record_steps(ctx.store, TLDR_ROLES, lora_adapter, steps)


def make_client(ctx, **cfg) -> TestClient:
    app = FastAPI()
    mount_openai(app, ctx, OpenAIConfig(**{"api_keys": (KEY_A, KEY_B), **cfg}))
    return TestClient(app)


def check_error(r, status: int, fragment: str, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and fragment in err["message"], err
    if code:
        assert err["code"] == code, err
    return err


def test_keys_tasks_and_bodies_are_checked(ctx):
    """Before any pair: off without keys (404), no key (401), an unknown or missing task (400),
    unknown fields (400), a task with one team state (400 nothing_to_compare); nothing stored."""
    off = TestClient(FastAPI(routes=openai_routes(ctx, OpenAIConfig())))
    client = make_client(ctx)
    for method, path, body in ROUTES:
        check_error(off.request(method, path, json=body, headers=AUTH_A), 404, "COLLAB_API_KEYS", "api_disabled")
        r = client.request(method, path, json=body)
        check_error(r, 401, "Bearer", "missing_api_key")
        assert r.headers["WWW-Authenticate"] == "Bearer"
        check_error(client.request(method, path, json=body, headers={"Authorization": "Bearer kZ9-notAkey_Qw4Lm7"}),
                    401, "invalid API key", "invalid_api_key")
    for body in ({"task": "nope"}, {"task": "custom-coding"}):
        check_error(client.post("/v1/arena/pairs", json=body, headers=AUTH_A), 400, "unknown arena task", "invalid_value")
    check_error(client.get("/v1/arena/leaderboard?task=nope", headers=AUTH_A), 400, "unknown arena task")
    assert check_error(client.get("/v1/arena/leaderboard", headers=AUTH_A), 400, "task must be")["param"] == "task"
    check_error(client.post("/v1/arena/pairs", json={"task": 3}, headers=AUTH_A), 400, "task must be")
    err = check_error(client.post("/v1/arena/pairs", json={"task": "tldr", "model": "x"}, headers=AUTH_A), 400,
                      "unknown field", "unknown_parameter")
    assert err["param"] == "model"
    check_error(client.post("/v1/arena/pairs", json={"task": "tldr", "text": 5}, headers=AUTH_A), 400, "text must be")
    check_error(client.post("/v1/arena/pairs", content=b"[1]", headers={**AUTH_A, "content-type": "application/json"}),
                400, "JSON object", "invalid_json")
    check_error(client.post("/v1/arena/pairs", json={"task": "tldr"}, headers=AUTH_A), 400, "nothing to compare",
                "nothing_to_compare")
    for body, status, fragment in (({"winner": "a"}, 400, "match_id must be"),
                                   ({"match_id": "1", "winner": "a"}, 400, "match_id must be"),
                                   ({"match_id": 1}, 400, "winner is missing"),
                                   ({"match_id": 99, "winner": "a"}, 404, "no arena match")):
        check_error(client.post("/v1/arena/votes", json=body, headers=AUTH_A), status, fragment)
    board = client.get("/v1/arena/leaderboard?task=tldr", headers=AUTH_A).json()
    assert board["object"] == "collab.arena.leaderboard" and board["votes"] == 0 and board["voters"] == {}
    assert ctx.store.arena_matches(voted=None) == []


def test_pair_vote_leaderboard(ctx, lora_adapter):
    """A pair (nothing naming a state), a bad winner (400, nothing stored), another key's vote (403),
    the vote and its reveal, a second vote refused, the board with the key as voter."""
    _train(ctx, lora_adapter, 2)
    client = make_client(ctx)
    r = client.post("/v1/arena/pairs", json={"task": "tldr"}, headers=AUTH_A)
    assert r.status_code == 200, r.text
    pair = r.json()
    assert pair["object"] == "collab.arena.pair" and pair["task"] == "tldr" and pair["roles"] == TLDR_ROLES
    assert set(pair) == {"object", "match_id", "task", "example_id", "prompt", "roles", "a", "b", "vote"}
    for side in ("a", "b"):
        assert set(pair[side]) == {"outputs", "combined"} and len(pair[side]["outputs"]) == 2
    rec = ctx.store.arena_match(pair["match_id"])
    assert rec.session_id == key_id(KEY_A) and rec.winner is None
    assert (pair["a"]["outputs"], pair["b"]["outputs"]) == (rec.outputs_a, rec.outputs_b)
    shown = repr({k: v for k, v in pair.items() if k != "vote"})
    assert rec.state_a not in shown and rec.state_b not in shown and "version" not in shown

    mid = pair["match_id"]
    for junk in ("left", "", None, 1, "ab"):
        err = check_error(client.post("/v1/arena/votes", json={"match_id": mid, "winner": junk}, headers=AUTH_A),
                          400, "'a', 'b' or 'tie'", "invalid_value")
        assert err["param"] == "winner"
    check_error(client.post("/v1/arena/votes", json={"match_id": mid, "winner": "a"}, headers=AUTH_B), 403,
                "another session", "not_entitled")
    assert ctx.store.arena_match(mid).winner is None                  # refusals store nothing

    r = client.post("/v1/arena/votes", json={"match_id": mid, "winner": "B"}, headers=AUTH_A)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "collab.arena.vote" and out["match_id"] == mid and out["winner"] == "b"
    assert (out["a"]["state"], out["b"]["state"]) == (rec.state_a, rec.state_b)
    assert {out["a"]["label"], out["b"]["label"]} <= {"base", "step 1", "step 2 (serving now)"}
    assert "do not train" in out["message"]
    check_error(client.post("/v1/arena/votes", json={"match_id": mid, "winner": "a"}, headers=AUTH_A), 400,
                "already has its vote")
    stored = ctx.store.arena_match(mid)
    assert (stored.winner, stored.voter) == ("b", key_id(KEY_A))

    board = client.get("/v1/arena/leaderboard", params={"task": "tldr"}, headers=AUTH_B).json()
    assert board["task"] == "tldr" and board["votes"] == 1 and board["voters"] == {key_id(KEY_A): 1}
    rows = {s["state"]: s for s in board["states"]}
    assert {rec.state_a, rec.state_b} <= set(rows) and "base" in rows
    assert rows[rec.state_b]["wins"] == 1 and rows[rec.state_a]["losses"] == 1
    assert rows[rec.state_b]["rating"] > rows[rec.state_a]["rating"]
    assert all(s["low"] <= s["rating"] <= s["high"] for s in board["states"])
    assert [s["serving"] for s in board["states"]].count(True) == 1


def test_pairs_count_as_the_keys_rounds(ctx, lora_adapter):
    """A pair is a round of its key (access.Limits' API quota): past the key's rounds a minute, 429
    with Retry-After and no pair stored."""
    _train(ctx, lora_adapter, 1)
    client = make_client(ctx, max_rounds_per_minute=1)
    assert client.post("/v1/arena/pairs", json={"task": "tldr"}, headers=AUTH_A).status_code == 200
    r = client.post("/v1/arena/pairs", json={"task": "tldr"}, headers=AUTH_A)
    check_error(r, 429, "", "rate_limit_exceeded")
    assert int(r.headers["Retry-After"]) >= 1
    assert len(ctx.store.arena_matches(voted=None)) == 1


def test_a_pair_runs_off_the_event_loop(ctx, monkeypatch):
    """While a pair is being written (here: held), the door answers other requests: the generation
    runs in a worker thread, as a chat completion's does."""
    from collab_app.web import arena

    started, release = threading.Event(), threading.Event()

    def held_pair(ctx_, caller, task, text="", example_id=None, rng=None):
        started.set()
        assert release.wait(30)
        return {"match_id": 7, "task": task, "example_id": "x", "prompt": "p", "roles": TLDR_ROLES,
                "a": {"outputs": ["1", "2"], "combined": "1 2"}, "b": {"outputs": ["3", "4"], "combined": "3 4"}}

    monkeypatch.setattr(arena, "arena_pair", held_pair)
    with make_client(ctx) as client:     # one event loop for every request of the block
        result = {}
        t = threading.Thread(target=lambda: result.update(
            r=client.post("/v1/arena/pairs", json={"task": "tldr"}, headers=AUTH_A)))
        t.start()
        try:
            assert started.wait(30)
            board = client.get("/v1/arena/leaderboard?task=tldr", headers=AUTH_B)   # the loop is free
            assert board.status_code == 200 and not result
        finally:
            release.set()
            t.join(30)
        assert result["r"].status_code == 200 and result["r"].json()["match_id"] == 7
