"""`collab bench abuse` (issue 82 item 6): the report's math without a server (deciding raters,
the attacker's share of trained groups, the latency ratio, ratings kept, the targets, how a failed
call is named), the store read back, the server's command line; and one short end-to-end run
against a real `collab serve` (slow)."""
from __future__ import annotations

import json
import time

import httpx
import pytest

from collab_app.commands import bench_abuse as B


def test_median_ratio():
    assert B.median_ratio([2.0, 4.0, 6.0], [8.0, 12.0]) == {
        "quiet_median_s": 4.0, "attack_median_s": 10.0, "quiet_rounds": 3, "attack_rounds": 2, "ratio": 2.5}
    assert B.median_ratio([], [1.0])["ratio"] is None
    assert B.median_ratio([1.0], [])["ratio"] is None


def _rating(id_, group, rater, session=None, late=False, value=5.0):
    return {"id": id_, "group_id": group, "rater": rater, "session_id": session, "late": late, "value": value}


def test_deciding_rater_has_most_ratings_in_force():
    rows = [_rating(1, 10, "session:web:a", "web:a"), _rating(2, 10, "session:web:a", "web:a"),
            _rating(3, 10, "session:web:b", "web:b"),
            # group 11: b's ratings came late (after the group closed): a decides
            _rating(4, 11, "session:web:a", "web:a"), _rating(5, 11, "session:web:b", "web:b", late=True),
            _rating(6, 11, "session:web:b", "web:b", late=True),
            # group 12: a tie goes to the rater of the latest rating
            _rating(7, 12, "session:web:a", "web:a"), _rating(8, 12, "session:web:b", "web:b")]
    d = B.deciding_raters(rows)
    assert {g: r["rater"] for g, r in d.items()} == {10: "session:web:a", 11: "session:web:a", 12: "session:web:b"}


def test_rater_side_by_session_then_rater_id():
    sides = {"web:a": "attacker", "web:h": "honest"}
    assert B.rater_side({"session_id": "web:a", "rater": "x"}, sides) == "attacker"
    assert B.rater_side({"session_id": None, "rater": "session:web:h"}, sides) == "honest"
    assert B.rater_side({"session_id": None, "rater": "hf:someone"}, sides) == "unknown"
    assert B.rater_side(None, sides) == "unknown"


def test_trained_share_counts_the_attack_window_only():
    sides = {"web:a": "attacker", "web:h": "honest"}
    deciding = {g: {"session_id": s, "rater": f"session:{s}"} for g, s in
                {1: "web:h", 2: "web:a", 3: "web:a", 4: "web:h", 5: "web:a", 6: "web:a"}.items()}
    steps = {1: 50.0, 2: 150.0, 3: 250.0}   # the attack phase is [100, 200]

    def g(id_, status, step, created):
        return {"id": id_, "status": status, "trained_step": step, "created_at": created}
    groups = [g(1, "trained", 1, 40.0),      # trained before the attack: out
              g(2, "trained", 2, 120.0),     # attacker, in
              g(3, "trained", 2, 130.0),     # attacker, in
              g(4, "trained", 2, 110.0),     # honest, in
              g(5, "ready", None, 150.0),    # not trained: out
              g(6, "trained", 3, 190.0),     # trained after the attack: out
              g(7, "trained", 2, 140.0),     # nobody rated it: unknown, in the total
              g(8, "trained", 2, 80.0)]      # a quiet-phase group a step in the window took
    s = B.trained_share(groups, steps, deciding, sides, 100.0, 200.0)
    assert (s["attacker"], s["honest"], s["unknown"], s["total"]) == (2, 1, 1, 4)
    assert s["attacker_share"] == pytest.approx(0.5)
    wide = B.trained_share(groups, steps, deciding, sides, 100.0, 200.0, generated_in_window=False)
    assert wide["total"] == 5 and wide["attacker"] == 2
    assert B.trained_share([], steps, deciding, sides, 100.0, 200.0)["attacker_share"] is None


def test_ratings_kept_finds_missing_and_changed_ratings():
    accepted = [{"id": 1, "value": 5.0}, {"id": 2, "value": 1.0}, {"id": 3, "value": 4.0}]
    assert B.ratings_kept(accepted, {1: 5.0, 2: 1.0, 3: 4.0, 9: 2.0}) == {
        "accepted": 3, "stored": 3, "lost": 0, "lost_ids": []}
    assert B.ratings_kept(accepted, {1: 5.0, 3: 2.0}) == {"accepted": 3, "stored": 1, "lost": 2, "lost_ids": [2, 3]}


def test_targets_pass_fail_and_no_figure():
    t = B.targets(0.25, 2.0, 0, 4)
    assert all(x["pass"] for x in t.values())
    assert "1/4" in t["attacker_share"]["target"]
    t = B.targets(0.26, 2.01, 1, 4)
    assert not any(x["pass"] for x in t.values())
    t = B.targets(None, None, 0, 4)
    assert t["attacker_share"]["pass"] is None and t["honest_latency_ratio"]["pass"] is None
    assert t["accepted_ratings_lost"]["pass"] is True
    assert B.targets(0.3, 1.0, 0, 3)["attacker_share"]["pass"] is True   # 1/3 with three networks


def test_refusals_are_named():
    import concurrent.futures

    from gradio_client.exceptions import AppError
    from gradio_client.utils import QueueError

    req = httpx.Request("POST", "http://127.0.0.1/gradio_api/queue/join")

    def status(code, **headers):
        return httpx.HTTPStatusError("x", request=req, response=httpx.Response(code, request=req, headers=headers))
    assert B.refusal(status(429, **{"retry-after": "7"})) == ("http_429", 7.0)
    assert B.refusal(status(403)) == ("http_403", B.BACKOFF_S)
    assert B.refusal(status(413))[0] == "http_other"
    assert B.refusal(QueueError("Queue is full!"))[0] == "queue_full"
    assert B.refusal(AppError("too many ratings: at most 240 per minute per client network; try again in 12 s")) == \
        ("rate_limit", 13)
    assert B.refusal(AppError("too many rounds: this request counts 1 and ... can never fit"))[0] == "rate_limit"
    assert B.refusal(AppError("you already have a round generating: wait"))[0] == "busy"
    assert B.refusal(AppError("the server is running as many rounds as it takes at once (8)"))[0] == "busy"
    assert B.refusal(AppError("this request carries no session of this server: reload"))[0] == "no_session"
    assert B.refusal(AppError("text too long"))[0] == "app_error"
    assert B.refusal(concurrent.futures.CancelledError())[0] == "lost_answer"
    assert B.refusal(concurrent.futures.TimeoutError())[0] == "timeout"
    assert B.refusal(httpx.ConnectError("refused"))[0] == "error"


def test_scripted_preferences():
    cands = [{"combined": "a b c d"}, {"combined": "a"}, {"combined": "a b"}, {"combined": "a"}]
    assert B.attacker_ratings(cands) == [1, 5, 1, 1]
    assert B.honest_ratings(cands) == [5, 2, 4, 1]   # longest 5 ... shortest 1, ties by index


def test_config_checks():
    assert B.BenchAbuseConfig().honest_networks() == ["10.1.0.1", "10.2.0.1", "10.3.0.1"]
    with pytest.raises(ValueError, match="must be > 0"):
        B.BenchAbuseConfig(minutes=0)
    with pytest.raises(ValueError, match="addresses for 3"):
        B.BenchAbuseConfig(networks=["10.5.0.1"])
    with pytest.raises(ValueError, match="attacker's network"):
        B.BenchAbuseConfig(honest=1, networks=[B.ATTACKER_NETWORK])


def test_server_runs_with_serves_limits_and_the_public_shares(tmp_path):
    from collab_app.web.serve import ServeConfig, trainer_argv

    flags = B.public_trainer_flags()
    assert "--max-rater-share" in flags
    public = trainer_argv(ServeConfig(host="0.0.0.0"), "/a", "/m")
    assert all(f in public for f in flags) and not set(flags) & {"--adapters-dir", "--model", "--min-groups"}
    cmd = B.serve_command(B.BenchAbuseConfig(trainer_args="--max-wait-s 30"), str(tmp_path), 8123)
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and cmd[cmd.index("--tasks") + 1] == "tldr"
    assert "--max-rounds-per-minute" not in cmd and "--max-ratings-per-minute" not in cmd   # serve's own limits
    trainer = cmd[cmd.index("--trainer-args") + 1]
    assert trainer.startswith(" ".join(flags)) and trainer.endswith("--max-wait-s 30")


def test_report_from_a_real_store(tmp_path):
    """Groups, ratings and a step written through the Store, read back by SQL, counted by side."""
    from collab_app.online.store import Store
    from helpers.store import make_group

    url = f"sqlite:///{tmp_path / 'collab.db'}"
    store = Store(url)
    honest_gid, honest_jids, *_ = make_group(store, seed=1, rewards=None)   # session "sess-1"
    store.add_ratings([(j, 5.0) for j in honest_jids], "session:sess-1", session_id="sess-1")
    gid2, jids2, *_ = make_group(store, seed=2, rewards=None)
    store.add_ratings([(j, 1.0) for j in jids2], "session:sess-1", session_id="sess-1")
    store.record_train_step(1, {}, [honest_gid])
    store.close()
    data = B.read_store(url)
    assert {r["group_id"] for r in data["ratings"]} == {honest_gid, gid2}
    assert [g["status"] for g in sorted(data["groups"], key=lambda g: g["id"])][0] == "trained"
    assert list(data["steps"]) == [1] and abs(data["steps"][1] - time.time()) < 60
    t_origin = 1000.0   # the quiet phase's start; the attack phase: 0.5 s .. 600 s after it
    for g in data["groups"]:
        g["created_at"] = t_origin + 0.2   # generated in the quiet phase
    data["steps"][1] = t_origin + 1.0      # trained in the attack phase

    honest = B.Identity("honest-0", "honest", "10.1.0.1", session_id="sess-1")
    honest.rounds = [{"t_start": 0.1, "round_s": 2.0, "answered": True, "group_id": honest_gid},
                     {"t_start": 0.6, "round_s": 3.0, "answered": True, "group_id": gid2}]
    rating_ids = sorted(r["id"] for r in data["ratings"] if r["group_id"] == honest_gid)
    honest.accepted = [{"id": i, "value": 5.0} for i in rating_ids] + [{"id": 10_000, "value": 5.0}]
    attacker = B.Identity("attacker-0", "attacker", B.ATTACKER_NETWORK)
    attacker.refused.update({"session_refused": 2, "rate_limit": 1})
    res = B.report(B.BenchAbuseConfig(), [honest, attacker], data, t_origin, 0.5, 600.0)
    assert res["attacker_share"]["honest"] == 1 and res["attacker_share"]["attacker_share"] == 0.0
    assert res["generated_in_attack"]["total"] == 0   # the one trained group was generated before the attack phase
    assert res["honest_latency"]["ratio"] == pytest.approx(1.5)
    assert res["honest_latency"]["served"]["ratio"] is None   # no round here says when its last try began
    assert res["ratings"] == {"accepted": len(rating_ids) + 1, "stored": len(rating_ids), "lost": 1}
    assert res["targets"]["accepted_ratings_lost"]["pass"] is False
    assert res["sides"]["attacker"]["refused_total"] == 3 and res["sides"]["attacker"]["with_session"] == 0
    text = B.table({**res, "startup_s": 12.0, "loadavg_end": ["1.0", "1.0", "1.0"], "error": None})
    assert "attacker_share" in text and "FAIL" in text and "session_refused" in text
    json.dumps(res)   # the JSON the bench prints


EXPECTED_KEYS = {"config", "phases_s", "public_trainer_flags", "attacker_share", "generated_in_attack",
                 "quiet_phase_trained", "honest_latency", "ratings", "sides", "train_steps", "targets",
                 "startup_s", "error", "loadavg_end", "threads_still_running"}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bench_abuse_end_to_end(tmp_path, tiny_model_path, monkeypatch, capsys):
    """`collab bench abuse --json` for a short while on the tiny base (what it writes is not under
    test: the clients, the server's refusals, the store read back and the report are): 2 honest
    raters, 5 attacker identities on one network, against a real `collab serve`."""
    from collab_app.commands.bench import cli_main

    monkeypatch.setenv("COLLAB_MODEL", tiny_model_path)
    out = tmp_path / "out"
    rc = cli_main(["abuse", "--json", "--quiet-minutes", "0.3", "--minutes", "0.5", "--attackers", "5",
                   "--honest", "2", "--engine", "transformers", "--max-new-tokens", "16", "--think-s", "0.5",
                   "--min-groups", "2", "--round-timeout-s", "120", "--out-dir", str(out)])
    res = json.loads(capsys.readouterr().out)
    log = (out / "home" / "serve.log").read_text()[-3000:]
    assert rc == 0 and res["error"] is None, log
    assert EXPECTED_KEYS <= set(res)
    assert (out / "bench_abuse.json").exists()
    h, a = res["sides"]["honest"], res["sides"]["attacker"]
    assert h["with_session"] == 2 and a["with_session"] >= 1, (h, a)
    assert h["rounds_quiet"] >= 1 and h["rounds_attack"] >= 1 and a["rounds_attack"] >= 1, (h, a, log)
    for share in (res["attacker_share"], res["generated_in_attack"]):
        assert share["total"] == share["attacker"] + share["honest"] + share["unknown"]
        assert share["attacker_share"] is None or 0.0 <= share["attacker_share"] <= 1.0
    lat = res["honest_latency"]
    assert lat["quiet_median_s"] > 0 and lat["attack_median_s"] > 0 and lat["ratio"] > 0
    r = res["ratings"]
    assert r["accepted"] >= 1 and r["stored"] + r["lost"] == r["accepted"] and 0 <= r["stored"] <= r["accepted"]
    assert r["accepted"] == h["ratings"]["accepted"] + a["ratings"]["accepted"]
    assert set(res["targets"]) == {"attacker_share", "honest_latency_ratio", "accepted_ratings_lost"}
    assert all(t["pass"] in (True, False, None) for t in res["targets"].values())
    assert res["threads_still_running"] == 0
    if "stored_networks" in a:   # the store keeps the network (issue 82 item 1): XFF was honoured
        assert a["stored_networks"] in ([], [B.ATTACKER_NETWORK])
        assert set(h["stored_networks"]) <= {"10.1.0.1", "10.2.0.1"}
