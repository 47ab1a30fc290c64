"""`collab bench page`: its config rules, the server's time read from a round's message, rounds and
probes sorted into quiet / beside a MAGRPO step, the side-by-side summary and table; and the whole
bench once on the tiny base: a real `collab serve`, headless Debian Chromium and gradio_client."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest

from collab_app.commands.bench_online import BenchOnlineConfig, serve_command
from collab_app.commands.bench_page import (CHROMIUM, NETWORK_LIMITS_OFF, BenchPageConfig, classify, overlap,
                                            server_seconds, step_intervals, summarize, table)

needs_chromium = pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} missing: make browser-deps")
ANY_FILE = __file__   # an existing path for configs built where Chromium is not installed


@pytest.mark.parametrize("kw, match", [({"rounds": 0}, "rounds >= 1"), ({"num_generations": 1}, "num_generations >= 2"),
                                       ({"max_new_tokens": 0}, "max_new_tokens >= 1"), ({"min_groups": 0}, "min_groups >= 1"),
                                       ({"think_s": -1}, "think_s and probe_s must be >= 0"),
                                       ({"probe_s": -0.5}, "think_s and probe_s must be >= 0"),
                                       ({"round_timeout_s": 0}, "round_timeout_s > 0")])
def test_config_rules(kw, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        BenchPageConfig(chromium=ANY_FILE, out_dir=str(tmp_path), **kw)


def test_a_previous_runs_folder_is_refused_before_anything_starts(tmp_path):
    (tmp_path / "home").mkdir()
    with pytest.raises(ValueError, match="pass another --out-dir or remove that folder"):
        BenchPageConfig(chromium=ANY_FILE, out_dir=str(tmp_path))
    BenchPageConfig(chromium=ANY_FILE, out_dir=str(tmp_path / "fresh"))


def test_a_missing_browser_says_how_to_get_one(tmp_path):
    with pytest.raises(ValueError, match="apt-get install chromium"):
        BenchPageConfig(chromium=str(tmp_path / "no-chromium"), out_dir=str(tmp_path / "out"))


def test_defaults_are_what_a_person_gets_from_serve(tmp_path):
    """G, tokens and K default to `collab serve`'s own: the bench times the app as `make run` starts it."""
    from collab_app.web.serve import ServeConfig

    serve = {f.name: f.default for f in dataclasses.fields(ServeConfig)}
    cfg = BenchPageConfig(chromium=ANY_FILE, out_dir=str(tmp_path / "out"))
    assert (cfg.num_generations, cfg.max_new_tokens, cfg.min_groups) == \
        (serve["num_generations"], serve["max_new_tokens"], serve["min_groups"])
    cmd = serve_command(dataclasses.replace(cfg, serve_args="--engine-cores -1", trainer_args="--lora-r 16"),
                        str(tmp_path), 7001, *NETWORK_LIMITS_OFF)
    assert cmd[cmd.index("--port") + 1] == "7001" and cmd[cmd.index("--tasks") + 1] == "tldr"
    assert cmd[cmd.index("--trainer-args") + 1] == "--lora-r 16" and cmd[-2:] == ["--engine-cores", "-1"]
    assert "--trainer-args" not in serve_command(cfg, str(tmp_path), 7001)     # serve's own trainer flags
    assert "--trainer-args" in serve_command(BenchOnlineConfig(), str(tmp_path), 7001)   # the rater's own
    for limit in ("--max-rounds-per-minute", "--max-rounds-per-minute-per-network", "--max-ratings-per-minute"):
        assert cmd[cmd.index(limit) + 1] == "0"


def test_server_seconds_from_the_rounds_message():
    assert server_seconds("group #12: 2 candidates in 7.3 s (turn 1). Rate them below.") == 7.3
    assert server_seconds("**group #3: 4 candidates in 12.0 s (turn 2). Rate them below.**") == 12.0
    assert server_seconds("generating 2 joint answers") is None and server_seconds(None) is None


def _step(end_unix: float, update_s: float) -> dict:
    from datetime import datetime, timezone

    return {"created_at": datetime.fromtimestamp(end_unix, timezone.utc).replace(tzinfo=None),
            "metrics": {"time/update_s": update_s}, "group_ids": [1], "step": 0}


def test_rounds_and_probes_are_sorted_by_the_steps_they_overlap():
    intervals = step_intervals([_step(120.0, 20.0), _step(200.0, 10.0)])       # [100, 120], [190, 200]
    assert intervals == [(100.0, 120.0), (190.0, 200.0)]
    assert overlap(90, 110, intervals) == 10 and overlap(121, 189, intervals) == 0
    assert overlap(95, 195, intervals) == 25
    rounds = [{"side": "page", "t_start": 90.0, "t_end": 110.0}, {"side": "api", "t_start": 121.0, "t_end": 130.0},
              {"side": "page", "t_start": 130.0, "t_end": 140.0}, {"side": "api", "t_start": 185.0, "t_end": 195.0}]
    probes = classify(rounds, [(105.0, 0.02), (150.0, 0.01), (119.99, 0.5), (160.0, None)], intervals)
    assert [r["kind"] for r in rounds] == ["beside a step", "quiet", "quiet", "beside a step"]
    assert rounds[0]["step_share"] == pytest.approx(0.5) and rounds[1]["step_share"] == 0
    assert [p["kind"] for p in probes] == ["during a step", "outside a step", "during a step", "outside a step"]


def test_summary_and_table_put_the_sides_next_to_each_other():
    rounds = []
    for k, (side, kind, first, rnd, server, tokens) in enumerate([
            ("page", "quiet", 0.4, 5.0, 4.5, 500), ("page", "quiet", 0.6, 7.0, 6.5, 700),
            ("api", "quiet", None, 4.6, 4.5, 460), ("page", "beside a step", 0.9, 9.0, 8.0, 450),
            ("api", "beside a step", None, 8.2, 8.0, 410)]):
        rounds.append({"side": side, "kind": kind, "first_s": first, "round_s": rnd, "server_s": server,
                       "rate_s": 0.1, "tokens": tokens, "step_share": 0.0 if kind == "quiet" else 0.6})
    probes = [{"t": 0, "s": 0.01, "kind": "outside a step"}, {"t": 1, "s": 0.03, "kind": "outside a step"},
              {"t": 2, "s": 0.05, "kind": "during a step"}, {"t": 3, "s": None, "kind": "during a step"}]
    s = summarize(rounds, probes)
    assert s["page"]["quiet"]["n"] == 2 and s["page"]["quiet"]["first_s"] == pytest.approx(0.5)
    assert s["page"]["quiet"]["round_s"] == pytest.approx(6.0) and s["page"]["quiet"]["tokens_per_s"] == pytest.approx(100)
    assert s["api"]["quiet"]["first_s"] is None and s["api"]["beside a step"]["tokens_per_s"] == pytest.approx(50)
    assert s["probe"]["during a step"] == {"n": 2, "median_s": 0.05, "max_s": 0.05, "unanswered": 1}
    result = {"summary": s, "steps": [{}], "startup_s": 30.0, "error": None,
              "config": {"rounds": 3, "num_generations": 2, "max_new_tokens": 256, "engine": "auto"},
              "machine": {"cpu_capability": "AVX2", "cpus": 2, "load_avg_start": [0.1, 0, 0], "load_avg_end": [1.9, 0, 0]}}
    text = table(result)
    assert "page (Chromium)" in text and "api (gradio_client)" in text and "CPU AVX2 x 2" in text
    quiet_round = next(line for line in text.splitlines() if "round, until rating opens" in line)
    assert "6.00 s" in quiet_round and "4.60 s" in quiet_round          # page's median, then api's
    assert "during a step: median 50 ms" in text and "unanswered 1" in text


@pytest.mark.slow
@pytest.mark.browser
@needs_chromium
def test_the_bench_times_rounds_in_the_page_and_through_the_api(tmp_path, tiny_model_path, monkeypatch, capsys):
    """The whole bench, once a side, on the tiny base (its text is random: what is timed and stored
    is under test, not what is written). min_groups 1: the page round's rating starts a step."""
    pytest.importorskip("playwright.sync_api")
    from collab_app.commands.bench_page import cli_main

    monkeypatch.setenv("COLLAB_MODEL", tiny_model_path)
    out = tmp_path / "bench"
    rc = cli_main(["--rounds", "1", "--engine", "transformers", "--max-new-tokens", "24", "--min-groups", "1",
                   "--probe-s", "0.2", "--out-dir", str(out), "--json"])
    res = json.loads((out / "bench_page.json").read_text())
    assert rc == 0 and res["error"] is None, res["error"]
    assert json.loads(capsys.readouterr().out)["summary"] == res["summary"]
    page, api = res["rounds"]
    assert (page["side"], api["side"]) == ("page", "api") and page["group_id"] != api["group_id"]
    for r in (page, api):
        assert 0 < r["server_s"] <= r["round_s"] + 0.05 and r["tokens"] > 0 and len(r["ratings"]) == 2
        assert r["kind"] in ("quiet", "beside a step")
    assert page["first_s"] is None or 0 < page["first_s"] <= page["round_s"]
    assert api["first_s"] is None
    assert res["probes"] and all(p["s"] is None or p["s"] > 0 for p in res["probes"])
    from collab_app.online.store import Store

    store = Store(f"sqlite:///{out}/home/collab.db")
    try:   # every rating the page and the client submitted is stored, each from its own session
        for r in (page, api):
            grp = store.group(r["group_id"])
            assert sorted(x.value for j in grp.joints for x in j.ratings) == sorted(r["ratings"])
        assert store.group(page["group_id"]).session_id != store.group(api["group_id"]).session_id
    finally:
        store.close()


def test_a_fresh_home_finds_this_machines_calibration(tmp_path, monkeypatch):
    """The calibration and the engine race are cached per machine (paths.machine_dir), not per
    COLLAB_HOME: a bench's fresh home (or a second project's) measures nothing again."""
    from collab_app.engines import calibrate

    monkeypatch.delenv("COLLAB_MACHINE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    monkeypatch.setenv("COLLAB_HOME", str(tmp_path / "one"))
    calibrate.store_entry("a key", {"dtype": "bfloat16"})
    monkeypatch.setenv("COLLAB_HOME", str(tmp_path / "two"))
    assert calibrate.cached_entry("a key") == {"dtype": "bfloat16"}
    assert calibrate.cache_path() == tmp_path / "user" / ".cache" / "collab" / "machine" / "calibration.json"
    monkeypatch.setenv("COLLAB_MACHINE_DIR", str(tmp_path / "elsewhere"))
    assert calibrate.cached_entry("a key") is None


def test_an_in_process_bench_uses_a_fresh_home(tmp_path, monkeypatch):
    """bench_online.use_home: makes the folder (never a used one) and points the process at it; a
    model already named is kept."""
    from collab_app.commands.bench_online import use_home

    monkeypatch.setenv("COLLAB_HOME", str(tmp_path / "machine"))
    monkeypatch.setenv("COLLAB_MODEL", str(tmp_path / "some-model"))
    home = use_home(str(tmp_path / "run"))
    assert home == str(tmp_path / "run") and os.environ["COLLAB_HOME"] == home
    assert os.environ["COLLAB_MODEL"] == str(tmp_path / "some-model")
    with pytest.raises(FileExistsError):
        use_home(home)
