"""`collab bench online`'s pieces without a server: the scripted raters' preferences, the windows
and the two-curve plot, the team states read back from a store, the held-out scoring of those
states on a real engine, and the summary of both curves. (The whole bench against a real
`collab serve` is what tests/e2e/test_serve_learns.py drives.)"""
from __future__ import annotations

import time

import pytest

from collab_app.commands.bench_online import (BenchOnlineConfig, held_out, outcome, plot, preference, spread,
                                              team_states, windows)


def test_preferences():
    short, long = preference("short"), preference("long")
    assert short("word " * 10) == 5 and short("word " * 60) == 3 and short("word " * 200) == 1
    assert long("word " * 10) == 1 and long("word " * 60) == 3 and long("word " * 200) == 5
    word = preference("word:summary")
    assert word("In summary, the council agreed.") == 5 and word("The summaryless text") == 1
    assert preference("nodigits")("twelve km") == 5 and preference("nodigits")("12 km") == 1
    wide = preference("short:30-130")
    assert wide("word " * 30) == 5 and wide("word " * 80) == 3 and wide("word " * 95) == 2 and wide("word " * 130) == 1
    assert short("word " * 95) == 1   # the default scale's floor, which the wide one moves out of reach
    with pytest.raises(ValueError, match="short, short:LO-HI, long, word:WORD or nodigits"):
        BenchOnlineConfig(raters=["longer"])
    with pytest.raises(ValueError, match="needs LO < HI"):
        preference("short:90-30")


@pytest.mark.parametrize("kw", [{"eval_points": 1}, {"eval_points": -1}, {"eval_examples": 0}, {"eval_samples": -1}])
def test_held_out_settings_are_checked(kw):
    with pytest.raises(ValueError, match="--eval-points must be 0"):
        BenchOnlineConfig(**kw)


def test_spread_keeps_first_and_last():
    assert spread(3, 6) == [0, 1, 2]
    assert spread(10, 2) == [0, 9]
    assert spread(11, 6) == [0, 2, 4, 6, 8, 10]
    assert spread(0, 6) == []


def _rounds():
    return [{"round": k, "rater": "short" if k % 2 == 0 else "nodigits", "t_start": 10.0 * k,
             "rated_at": 10.0 * k + 5, "mean_rating": float(k), "auto_mean": 1.0, "words": [10, 20],
             "versions": {"summary": k // 3, "detail": k // 3}} for k in range(8)]


def test_windows_outcome_and_plot(tmp_path):
    per = windows(_rounds(), 2)
    assert list(per) == ["short", "nodigits"]
    assert [w["rounds"] for w in per["short"]] == [[0, 2], [4, 6]]
    assert [w["mean_rating"] for w in per["short"]] == [1.0, 5.0]
    assert per["nodigits"][-1]["max_version"] == 2
    held = [{"t": 0.0, "greedy": {"auto": 2.0, "words": 40.0}, "sampled": {"auto": 1.6, "words": 50.0}},
            {"t": 60.0, "greedy": {"auto": 1.9, "words": 30.0}, "sampled": {"auto": 0.8, "words": 20.0}}]
    out = outcome(per, held)
    assert out["rating"]["short"] == {"first": 1.0, "last": 5.0, "change": 4.0}
    assert out["held_out"]["greedy"]["kept"] == pytest.approx(0.95)
    assert out["held_out"]["sampled"]["kept"] == pytest.approx(0.5)
    assert out["held_out"]["sampled"]["words_last"] == 20.0
    assert "held_out" not in outcome(per, [])
    plot({"windows": per, "rounds": _rounds(), "steps": [], "held_out": held, "config": {"window": 2}},
         str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_team_states_one_per_step_from_the_store(tmp_path):
    from collab_app.online.store import Store

    url = f"sqlite:///{tmp_path}/c.db"
    store = Store(url)
    for agent in ("summary", "detail"):
        store.record_adapter_version(agent, 0, f"/a/{agent}/v0", step=0)
    t_start = time.time()
    store.record_adapter_version("summary", 1, "/a/summary/v1", step=1)
    store.record_adapter_version("detail", 1, "/a/detail/v1", step=1)
    store.record_adapter_version("summary", 2, "/a/summary/v2", step=2)   # a step that moved one agent only
    states = team_states(url, ["summary", "detail"], t_start)
    assert [s["step"] for s in states] == [0, 1, 2]
    assert states[0]["t"] == 0.0 and states[0]["versions"] == {"summary": (0, "/a/summary/v0"), "detail": (0, "/a/detail/v0")}
    assert states[1]["versions"] == {"summary": (1, "/a/summary/v1"), "detail": (1, "/a/detail/v1")}
    assert states[2]["versions"] == {"summary": (2, "/a/summary/v2"), "detail": (1, "/a/detail/v1")}
    assert states[0]["t"] <= states[1]["t"] <= states[2]["t"]


def test_held_out_scores_states_on_a_real_engine():
    """Two states serving the same (base) weights score the same: greedy is repeatable and the
    sampled answers carry a fixed seed, so a change between states is the versions' doing."""
    from tasks import load_task

    cfg = BenchOnlineConfig(engine="transformers", eval_examples=1, eval_samples=2, max_new_tokens=12)
    base = {r: (0, None) for r in load_task("tldr").roles}
    rows = held_out(cfg, [{"t": 0.0, "step": 0, "versions": base}, {"t": 30.0, "step": 3, "versions": base}])
    assert [r["step"] for r in rows] == [0, 3] and rows[1]["versions"] == {"summary": 0, "detail": 0}
    for r in rows:
        assert 0.0 <= r["greedy"]["auto"] <= 3.0 and 0.0 <= r["sampled"]["auto"] <= 3.0
        assert r["greedy"]["words"] > 0
    assert rows[0]["greedy"] == rows[1]["greedy"]
    assert rows[0]["sampled"] == rows[1]["sampled"]


class _Job:
    def __init__(self, outcome):
        self.outcome = outcome

    def result(self, timeout=None):
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome


class _Client:
    """gradio_client.Client's submit, scripted: each call takes the next outcome."""

    def __init__(self, outcomes):
        self.outcomes, self.calls = list(outcomes), []

    def submit(self, **kw):
        self.calls.append(kw)
        return _Job(self.outcomes.pop(0))


def test_api_call_asks_again_for_an_answer_the_client_lost_and_waits_out_limits():
    from concurrent.futures import CancelledError

    from gradio_client.exceptions import AppError

    from collab_app.commands.bench_online import API_RETRIES, api_call

    client = _Client([CancelledError(), AppError("too many ratings: try again in 0 s"), "rating saved"])
    t0 = time.monotonic()
    assert api_call(client, joint_sample_id=3, rating=5, api_name="/rate") == "rating saved"
    assert time.monotonic() - t0 >= 1.0                        # the limit's "0 s" + 1
    assert client.calls == [{"joint_sample_id": 3, "rating": 5, "api_name": "/rate"}] * 3
    lost = _Client([CancelledError()] * (API_RETRIES + 1))
    with pytest.raises(CancelledError):
        api_call(lost, api_name="/generate")                   # not forever
    assert len(lost.calls) == API_RETRIES + 1
    with pytest.raises(AppError, match="no such joint answer"):  # other errors are the caller's
        api_call(_Client([AppError("no such joint answer")]), api_name="/rate")


def test_start_server_runs_serves_flags_under_another_launcher_with_more_environment(tmp_path, monkeypatch):
    """docs/results scripts wrap `collab serve` in timers: the launcher replaces `python -m
    collab_app.web.serve` and keeps every serve flag; `env` adds to the server's environment over
    the bench's own (its home, the served model); the output goes to home/serve.log."""
    import json
    import sys

    from collab_app.commands.bench_online import serve_command, start_server, stop_server

    monkeypatch.setenv("COLLAB_MODEL", str(tmp_path / "a-model"))
    cfg = BenchOnlineConfig()
    show = ("import json, os, sys; print(json.dumps([sys.argv[1:], os.environ['COLLAB_HOME'], "
            "os.environ['COLLAB_MODEL'], os.environ['EXTRA']]))")
    proc = start_server(cfg, str(tmp_path), 4321, "--x", launcher=[sys.executable, "-c", show, "timers"],
                        env={"EXTRA": "on"})
    proc.wait(60)
    stop_server(proc)
    args, home, model, extra = json.loads((tmp_path / "serve.log").read_text())
    assert args == ["timers", *serve_command(cfg, str(tmp_path), 4321, "--x")[3:]]
    assert "--port" in args and "--x" in args and args[0] == "timers"
    assert (home, model, extra) == (str(tmp_path), str(tmp_path / "a-model"), "on")
