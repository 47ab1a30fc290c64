"""`collab bench arena`'s pieces without a server: the scripted voter's decision, the report from votes
and team states stored in a real SQLite store (board, separation, Kendall's tau, targets that pass and
that fail), the table and the plot; and, marked slow, a tiny run against a real `collab serve`."""
from __future__ import annotations

import json
import random

import pytest

from collab_app.commands import bench_arena as A
from collab_app.commands.bench_online import preference

ROLES = ["summary", "detail"]
VOTER = "api:0123456789abcdef"


def test_the_voter_votes_its_preference():
    short = preference("short")
    few, many = "word " * 20, "word " * 80
    assert A.decide(short, few, many) == {"winner": "a", "score_a": 5, "score_b": 2, "noisy": False}
    assert A.decide(short, many, few)["winner"] == "b"
    assert A.decide(short, few, "word " * 25)["winner"] == "tie"       # the same 1..5 score: a tie
    exact = preference("short", exact=True)                             # the voter's: not rounded, not flat
    assert A.decide(exact, "word " * 12, "word " * 20)["winner"] == "a"
    assert A.decide(exact, "word " * 95, "word " * 120)["winner"] == "a"
    assert A.decide(exact, "word " * 20, "word " * 20)["winner"] == "tie"
    assert A.decide(preference("word:council"), "the Council met", "a meeting")["winner"] == "a"
    rng = random.Random(0)
    noisy = [A.decide(short, few, many, noise=1.0, rng=rng) for _ in range(40)]
    assert all(v["noisy"] and v["winner"] in ("a", "b") for v in noisy)
    assert {v["winner"] for v in noisy} == {"a", "b"}                    # a coin flip, never a tie
    assert not any(A.decide(short, few, many, noise=0.0, rng=rng)["noisy"] for _ in range(20))


def test_config_checks():
    for kw, fragment in (({"preference": "longer"}, "short, short:LO-HI"), ({"noise": 1.5}, "probability"),
                         ({"versions": 0}, "versions >= 1"), ({"vote_minutes": 0}, "must be > 0"),
                         ({"separate_within": 1}, "separate_within >= 2")):
        with pytest.raises(ValueError, match=fragment):
            A.BenchArenaConfig(**kw)
    key = A.make_key()
    from collab_app.web.access import admin_token_problem

    assert admin_token_problem(key) is None and "," not in key and len(key) >= 40


def _trained_store(tmp_path, steps: int = 5):
    """A store with version 0 of each role (no step: what the trainer writes at its start) and
    `steps` training steps that each wrote a version of both roles."""
    from collab_app.online.store import Store

    store = Store(f"sqlite:///{tmp_path / 'collab.db'}")
    for role in ROLES:
        store.record_adapter_version(role, 0, f"/a/{role}/v0", step=None)
    for step in range(1, steps + 1):
        for role in ROLES:
            store.record_adapter_version(role, step, f"/a/{role}/v{step}", step=step)
    return store


def _vote(store, a: str, b: str, winner: str, session: str = VOTER) -> None:
    mid = store.add_arena_match("tldr", {"id": "ex", "text": "t"}, ["p1", "p2"], a, b, {}, {}, ["x", "y"],
                                ["z", "w"], combined_a="x y", combined_b="z w", session_id=session)
    store.add_arena_vote(mid, winner, session, session_id=session)


def _states(store):
    from collab_app.online.arena import team_states

    return [s.key for s in team_states(store, ROLES)]


def _report(store, cfg=None, **kw):
    votes, history = A.read_arena(store, "tldr", ROLES)
    return A.report(cfg or A.BenchArenaConfig(board_rounds=50), votes, history, **kw)


def test_report_from_stored_votes(tmp_path):
    """A voter who always prefers the later step: the board in step order (tau 1), base and newest
    separated within a few head-to-head votes, both targets pass; version 0 (no step: the trainer's
    start) is base, not a state of its own."""
    store = _trained_store(tmp_path)
    keys = _states(store)
    base, *steps = keys
    assert base == "base" and len(steps) == 5 and "detail:v0,summary:v0" not in keys
    trained = [base] + steps
    for _ in range(3):                                   # every neighbour pair, then base vs newest
        for older, newer in zip(trained, trained[1:]):
            _vote(store, older, newer, "b")
            _vote(store, newer, older, "a")
    for _ in range(6):
        _vote(store, base, steps[-1], "b")
    records = [{"pair_s": s, "winner": w, "noisy": False} for s, w in ((2.0, "a"), (4.0, "b"), (3.0, "tie"))]
    res = _report(store, records=records, machine={"cpu_model": "test"})
    store.close()

    assert res["votes"] == 3 * 2 * 5 + 6 and res["voters"] == {VOTER: res["votes"]}
    assert res["versions_trained"] == 5 and res["newest"] == steps[-1]
    assert [r["state"] for r in res["board"] if r["state"] in trained] == trained[::-1]   # newest first
    assert {r["state"] for r in res["board"]} == set(trained)
    assert res["tau"]["value"] == pytest.approx(1.0) and res["tau"]["order"] == trained
    bn = res["separation"]["base_newest"]
    assert (bn["x"], bn["y"], bn["head_to_head_votes"]) == (base, steps[-1], 6) and 2 <= bn["head_to_head"] <= 6
    assert bn["involving_votes"] == 6 + 6 + 6 and bn["involving"] is not None   # base's, newest's, and theirs
    top = res["separation"]["top_two"]
    assert (top["x"], top["y"]) == (steps[-1], steps[-2]) and "board" not in top
    t = res["targets"]
    assert t["separate_base_newest"]["pass"] is True and t["separate_base_newest"]["value"] == bn["board"]
    assert t["kendall_tau"]["pass"] is True and t["kendall_tau"]["states"] == 6
    assert res["voter"] == {"votes": 3, "a": 1, "b": 1, "tie": 1, "noisy": 0, "pair_s_median": 3.0}
    assert all(r["low"] <= r["rating"] <= r["high"] for r in res["board"])
    json.dumps(res)
    text = A.table({**res, "phases_s": {"train": 100.0, "vote": 50.0}})
    assert "separate_base_newest" in text and "PASS" in text and "FAIL" not in text
    A.plot(res, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_targets_can_fail(tmp_path):
    """A voter who prefers the older state (tau < 0: FAIL) and who ties base and newest 40 times (never
    separated in the 46 votes involving them: FAIL); with too few votes a target says nothing (None)."""
    store = _trained_store(tmp_path)
    base, *steps = _states(store)
    trained = [base] + steps
    for _ in range(3):
        for older, newer in zip(trained, trained[1:]):
            _vote(store, older, newer, "a")
    for _ in range(40):
        _vote(store, base, steps[-1], "tie")
    res = _report(store, A.BenchArenaConfig(board_rounds=30, board_replay=True))
    assert res["tau"]["value"] < 0 and res["targets"]["kendall_tau"]["pass"] is False
    sep = res["targets"]["separate_base_newest"]
    assert sep == {"value": None, "votes": res["votes"], "target": "<= 40 votes of the board", "pass": False}
    assert res["separation"]["base_newest"]["board_votes"] == res["votes"]   # --board-replay: the whole board too
    assert "FAIL" in A.table(res)
    store.close()

    few = _trained_store(tmp_path / "few", steps=2)
    b, s1, s2 = _states(few)
    _vote(few, b, s2, "tie")
    _vote(few, s1, s2, "b")
    res = _report(few)
    few.close()
    assert res["targets"]["kendall_tau"]["pass"] is None and res["targets"]["kendall_tau"]["states"] == 3
    assert res["targets"]["separate_base_newest"]["pass"] is None     # 2 votes involving them: too few to say
    empty = A.report(A.BenchArenaConfig(), [], [])
    assert empty["board"] == [] and empty["targets"]["kendall_tau"]["pass"] is None
    assert empty["separation"] == {"base_newest": None, "top_two": None}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bench_arena_end_to_end(tmp_path, tiny_model_path, monkeypatch, capsys):
    """`collab bench arena --json` on the tiny base (what it learns is not under test: the two
    phases, the /v1/arena calls, the store read back and the report are): one trained state, a few
    votes through a real `collab serve`."""
    from collab_app.commands.bench import cli_main

    monkeypatch.setenv("COLLAB_MODEL", tiny_model_path)
    out = tmp_path / "out"
    rc = cli_main(["arena", "--json", "--versions", "1", "--votes", "4", "--train-minutes", "3", "--vote-minutes", "2",
                   "--engine", "transformers", "--max-new-tokens", "16", "--board-rounds", "30",
                   "--round-timeout-s", "120", "--out-dir", str(out),
                   # weighted returns: the tiny base's answers all get the same stars, the checks differ
                   "--trainer-args", "--max-wait-s 0 --human-timeout-s 3600"])
    res = json.loads(capsys.readouterr().out)
    log = (out / "home" / "serve.log").read_text()[-3000:]
    assert rc == 0 and res["error"] is None, log
    assert res["versions_trained"] >= 1 and res["rater"]["rounds"] >= 1
    assert res["voter"]["votes"] == res["votes"] == 4 and len(res["voters"]) == 1
    assert res["server_board"]["votes"] == 4 and res["server_board"]["object"] == "collab.arena.leaderboard"
    assert {r["state"] for r in res["board"]} <= {s["state"] for s in res["states"]}
    assert set(res["targets"]) == {"separate_base_newest", "kendall_tau"}
    assert all(t["pass"] in (True, False, None) for t in res["targets"].values())
    assert res["machine"]["cpu_capability"] and res["voter"]["pair_s_median"] > 0
    assert (out / "bench_arena.json").exists() and (out / "bench_arena.png").exists()
