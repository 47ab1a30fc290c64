"""`collab bench arena`: does the blind arena rank the team's states in the order they learned?

Starts a real `collab serve` (bench_online.start_server: a subprocess with its own COLLAB_HOME,
store and adapters under --out-dir; the TL;DR task, G=4, 48 new tokens, K=2, an API key of its
own), then two phases against it:

1. train: a scripted rater with a hidden preference (bench_online's `preference()`, default
   `short`) generates rounds and rates every candidate through the app's API (gradio_client, one
   session) until the child trainer has made --versions steps that wrote adapter versions (the
   store's version rows), or --train-minutes passed;
2. vote: a scripted voter with the SAME preference asks blind pairs and votes through /v1/arena
   (POST /v1/arena/pairs, POST /v1/arena/votes with the server's key) until --votes votes or
   --vote-minutes: it scores both sides' combined text with the preference and votes for the
   higher, a tie when equal; with probability --noise its vote is a coin flip between a and b.

Reported (JSON with --json, a table otherwise; bench_arena.json and bench_arena.png, rating vs step
with intervals, under --out-dir): the final board from the stored votes (leaderboard.standings, as
the server's), `votes_to_separate` for (base, newest) and for the board's top two, replaying in
order the votes of the pairs involving them (and their head-to-head votes alone), Kendall's tau between the states' step order and the board, votes,
voters, seconds per pair, the machine; the issue's targets as pass / fail fields. What each field
means: docs/BENCHES.md "collab bench arena".

    collab bench arena [--versions 5 --votes 120 --preference short --noise 0 --json]
"""
from __future__ import annotations

import json
import logging
import os
import random
import secrets
import statistics
import sys
import time
from dataclasses import asdict, dataclass

from collab_app.commands.bench_online import (TEXTS_TASK, api_call, connect, free_port, preference, start_server,
                                              stop_server)

log = logging.getLogger(__name__)

MIN_TAU_STATES = 5
"""Kendall's tau is judged only over at least this many states with votes (the issue: >= 5 versions)."""
MAX_ERRORS = 5
"""phase 2 stops after this many refusals or failures in a row that say nothing about waiting."""
NOTHING_YET_WAIT_S = 10.0
"""how long the voter waits when the server has nothing to compare yet (one team state)."""


@dataclass
class BenchArenaConfig:
    versions: int = 40
    """phase 1 ends once the child trainer has made this many steps that wrote adapter versions (team states besides base), or at --train-minutes; the arena asks about 6 of them, spread over the history."""
    votes: int = 120
    """phase 2 ends after this many arena votes (or at --vote-minutes)."""
    preference: str = "short"
    """the hidden preference of both the rater and the voter: short | short:LO-HI | long | word:W | nodigits (bench online; the voter compares it unrounded)."""
    noise: float = 0.0
    """probability that a vote is a coin flip between a and b instead of the preference's verdict."""
    train_minutes: float = 15.0
    """phase 1's time budget (rating rounds), whether or not --versions steps were made."""
    vote_minutes: float = 13.0
    """phase 2's time budget (asking pairs and voting)."""
    engine: str = "auto"
    """serving engine of the `collab serve` it starts (auto | vllm | transformers)."""
    num_generations: int = 4
    """G of the server: candidates per round in phase 1."""
    max_new_tokens: int = 64
    """new tokens per agent answer (rounds and arena pairs)."""
    min_groups: int = 2
    """K of the child trainer: a step per K rated groups."""
    trainer_args: str = "--max-wait-s 0 --human-timeout-s 3600 --learning-rate 1e-3 --return-mode human_first"
    """more `collab trainer` flags for the server's child trainer (one quoted string); the default learns the rater's preference within the phase (bench online's human_first run: 1e-4 moved nothing in 18 steps here)."""
    serve_args: str = ""
    """more `collab serve` flags (one quoted string)."""
    out_dir: str = "bench-arena"
    """where the server's home, its log, bench_arena.json and bench_arena.png go (must not hold a home/ already)."""
    port: int = 0
    """server port (0 = a free one)."""
    round_timeout_s: float = 600.0
    """a round, pair or vote that takes longer ends its phase (results so far are kept)."""
    board_rounds: int = 200
    """bootstrap resamples of the final board and of each replay (leaderboard.standings' rounds)."""
    separate_within: int = 40
    """target: base and newest separate within this many votes of pairs involving either (replayed in order)."""
    tau_min: float = 0.8
    """target: Kendall's tau between step order and board, over at least 5 states with votes."""
    board_replay: bool = False
    """also replay the whole board's votes in order for the top two (base and newest always are: the separation target; each n refits every state)."""
    seed: int = 0
    """seed of the voter's noise."""

    def __post_init__(self):
        preference(self.preference)   # raises with the valid forms
        if self.versions < 1 or self.votes < 1 or self.num_generations < 2 or self.min_groups < 1:
            raise ValueError("need versions >= 1, votes >= 1, num_generations >= 2, min_groups >= 1")
        if not 0.0 <= self.noise <= 1.0:
            raise ValueError(f"noise is a probability in [0, 1], got {self.noise}")
        if self.train_minutes <= 0 or self.vote_minutes <= 0 or self.round_timeout_s <= 0:
            raise ValueError("train_minutes, vote_minutes and round_timeout_s must be > 0")
        if self.board_rounds < 1 or self.separate_within < 2:
            raise ValueError("board_rounds must be >= 1 and separate_within >= 2")


# --------------------------------------------------------------------------- the scripted voter

def decide(score, combined_a: str, combined_b: str, noise: float = 0.0, rng: random.Random | None = None) -> dict:
    """The voter's vote on a pair: the side whose combined text `score` (a preference: text -> 1..5,
    the voter's unrounded and unflattened: `preference(spec, exact=True)`) rates higher, "tie" when equal; with probability `noise` a coin flip between "a" and "b" instead.
    {"winner", "score_a", "score_b", "noisy"}."""
    sa, sb = score(combined_a), score(combined_b)
    rng = rng or random.Random()
    if noise and rng.random() < noise:
        return {"winner": rng.choice(("a", "b")), "score_a": sa, "score_b": sb, "noisy": True}
    return {"winner": "a" if sa > sb else "b" if sb > sa else "tie", "score_a": sa, "score_b": sb, "noisy": False}


def make_key() -> str:
    """An API key the server accepts (access.admin_token_problem: token_urlsafe passes but for a
    few in a million; then another)."""
    from collab_app.web.access import admin_token_problem

    while True:
        key = secrets.token_urlsafe(32)
        if not admin_token_problem(key) and "," not in key:
            return key


def _retry_after(r) -> float:
    try:
        return max(1.0, float(r.headers.get("Retry-After", "5")))
    except ValueError:
        return 5.0


def _post(http, path: str, body: dict, deadline: float):
    """POST until an answer that is not "wait" (429 / 503 with Retry-After), or the deadline: the
    last response (None if the deadline came first)."""
    while time.monotonic() < deadline:
        r = http.post(path, json=body)
        if r.status_code in (429, 503):
            time.sleep(min(_retry_after(r), max(0.0, deadline - time.monotonic())))
            continue
        return r
    return None


def _error(r) -> str:
    try:
        err = r.json()["error"]
        return f"{r.status_code} {err.get('code')}: {err.get('message')}"
    except Exception:  # noqa: BLE001
        return f"{r.status_code}: {r.text[:300]}"


def run_voter(cfg: BenchArenaConfig, url: str, key: str, proc, deadline: float, records: list[dict]) -> None:
    """Phase 2: pairs and votes through /v1/arena until cfg.votes or `deadline`; one record per
    vote appended to `records` (kept if the server fails midway)."""
    import httpx

    score = preference(cfg.preference, exact=True)   # the rater's preference, not rounded or flattened to stars
    rng = random.Random(cfg.seed)
    errors = 0
    with httpx.Client(base_url=url.rstrip("/"), headers={"Authorization": f"Bearer {key}"},
                      timeout=cfg.round_timeout_s) as http:
        while len(records) < cfg.votes and time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"collab serve exited with code {proc.returncode}; see its log")
            t0 = time.monotonic()
            r = _post(http, "/v1/arena/pairs", {"task": TEXTS_TASK}, deadline)
            if r is None:
                break
            if r.status_code != 200:
                if r.status_code == 400 and "nothing_to_compare" in r.text:
                    log.info("nothing to compare yet: waiting %.0f s for a trained state", NOTHING_YET_WAIT_S)
                    time.sleep(NOTHING_YET_WAIT_S)
                    continue
                errors += 1
                log.warning("pair refused (%d in a row): %s", errors, _error(r))
                if errors >= MAX_ERRORS:
                    raise RuntimeError(f"{errors} pairs refused in a row, the last: {_error(r)}")
                time.sleep(1.0)
                continue
            pair_s = time.monotonic() - t0
            pair = r.json()
            vote = decide(score, pair["a"]["combined"], pair["b"]["combined"], cfg.noise, rng)
            v = _post(http, "/v1/arena/votes", {"match_id": pair["match_id"], "winner": vote["winner"]},
                      time.monotonic() + cfg.round_timeout_s)
            if v is None or v.status_code != 200:
                errors += 1
                log.warning("vote refused (%d in a row): %s", errors, "timed out" if v is None else _error(v))
                if errors >= MAX_ERRORS:
                    raise RuntimeError(f"{errors} votes refused in a row")
                continue
            errors = 0
            reveal = v.json()
            records.append({"match_id": pair["match_id"], "example_id": pair["example_id"], "pair_s": pair_s,
                            **vote, "words_a": len(pair["a"]["combined"].split()),
                            "words_b": len(pair["b"]["combined"].split()),
                            "a": reveal["a"]["state"], "b": reveal["b"]["state"],
                            "label_a": reveal["a"]["label"], "label_b": reveal["b"]["label"]})
            log.info("vote %d: %s (%s %d vs %s %d words) in %.1f s", len(records), vote["winner"],
                     reveal["a"]["label"], records[-1]["words_a"], reveal["b"]["label"], records[-1]["words_b"], pair_s)


def server_board(url: str, key: str, timeout_s: float = 120.0) -> dict | None:
    """GET /v1/arena/leaderboard as the server computes it (None when it does not answer)."""
    import httpx

    try:
        r = httpx.get(url.rstrip("/") + "/v1/arena/leaderboard", params={"task": TEXTS_TASK},
                      headers={"Authorization": f"Bearer {key}"}, timeout=timeout_s)
        return r.json() if r.status_code == 200 else {"error": _error(r)}
    except httpx.HTTPError as e:
        return {"error": f"{type(e).__name__}: {e}"}


# --------------------------------------------------------------------------- phase 1: the rater

def trained_states(store, roles: list[str]) -> list:
    """The team states that training steps made (online/arena.py team_states with a step), oldest first."""
    from collab_app.online.arena import team_states

    return [s for s in team_states(store, roles) if s.step is not None]


def run_rater(cfg: BenchArenaConfig, url: str, proc, store, roles: list[str], deadline: float,
              rounds: list[dict]) -> None:
    """Phase 1: one scripted rater (one server session) generates a round on a TL;DR train text and
    rates every candidate by the preference, until cfg.versions trained states or `deadline`."""
    from tasks import load_task

    texts = [ex["text"] for ex in load_task(TEXTS_TASK).examples("train")]
    score = preference(cfg.preference)
    client = connect(url, proc)
    t_start = time.monotonic()
    try:
        while time.monotonic() < deadline:
            made = len(trained_states(store, roles))
            if made >= cfg.versions:
                break
            k = len(rounds)
            t0 = time.monotonic()
            out = api_call(client, timeout_s=cfg.round_timeout_s, task=TEXTS_TASK, text=texts[k % len(texts)],
                           api_name="/generate")
            gen_s = time.monotonic() - t0
            ratings = []
            for c in out["candidates"]:
                r = score(c["combined"])
                api_call(client, timeout_s=cfg.round_timeout_s, joint_sample_id=c["joint_sample_id"], rating=r,
                         api_name="/rate")
                ratings.append(r)
            rounds.append({"round": k, "t": t0 - t_start, "generate_s": gen_s, "group_id": out["group_id"],
                           "ratings": ratings, "words": [len(c["combined"].split()) for c in out["candidates"]],
                           "states_before": made})
            log.info("round %d: %.1f s, ratings %s, %d trained state(s) so far", k, gen_s, ratings, made)
    finally:
        try:
            client.close()
        except Exception:  # noqa: BLE001
            pass


# --------------------------------------------------------------------------- the report

def read_arena(store, task: str, roles: list[str]) -> tuple[list, list]:
    """(the task's stored votes as leaderboard.Vote, oldest first; the team's states, oldest first)."""
    from collab_app.online.arena import team_states
    from collab_app.online.leaderboard import Vote

    votes = [Vote(m.state_a, m.state_b, m.winner, m.voter or "") for m in store.arena_matches(task)]
    return votes, team_states(store, roles)


def separation(votes: list, x: str, y: str, rounds: int, board_replay: bool = False) -> dict:
    """votes_to_separate for x and y, replaying in order (None where they never separate):
    `involving` the votes of every pair with x or y on a side (what informs their two ratings),
    `head_to_head` the votes of the pairs x vs y only, and with `board_replay` every vote of the
    board (`board`). Each with its number of votes (`*_votes`)."""
    from collab_app.online.leaderboard import votes_to_separate

    def replay(sub: list) -> int | None:
        seen = {s for v in sub for s in (v.a, v.b)}
        return votes_to_separate(sub, x, y, rounds=rounds) if {x, y} <= seen else None

    involving = [v for v in votes if x in (v.a, v.b) or y in (v.a, v.b)]
    h2h = [v for v in involving if {v.a, v.b} == {x, y}]
    out = {"x": x, "y": y, "involving_votes": len(involving), "involving": replay(involving),
           "head_to_head_votes": len(h2h), "head_to_head": replay(h2h)}
    if board_replay:
        out.update(board_votes=len(votes), board=replay(list(votes)))
    return out


def _separation_target(sep: dict | None, within: int) -> dict:
    """On the board's votes in the order they were cast (`separation`'s `board`: the arena as it
    runs, its pair rule deciding which pairs are asked): pass when the two were apart within
    `within` votes; fail when later, or never although there were that many; None: fewer votes
    than that and not apart yet (too few to say)."""
    n = None if sep is None else sep.get("board")
    had = 0 if sep is None else sep.get("board_votes", 0)
    verdict = (n <= within) if n is not None else (False if had >= within else None)
    return {"value": n, "votes": had, "target": f"<= {within} votes of the board", "pass": verdict}


def report(cfg: BenchArenaConfig, votes: list, history: list, records: list[dict] = (), rounds: list[dict] = (),
           machine: dict | None = None, server: dict | None = None) -> dict:
    """The bench's result from the stored votes and the team's states (read_arena), the voter's
    records and the rater's rounds: the board, separation, tau and the targets (module doc)."""
    from collab_app.online.leaderboard import kendall_tau, per_voter, standings

    age = {s.key: i for i, s in enumerate(history)}
    by_key = {s.key: s for s in history}
    voted = list(dict.fromkeys(s for v in votes for s in (v.a, v.b)))
    keys = sorted(voted, key=lambda k: (age.get(k, len(age)), k))          # age order, unknown ones last
    board = standings(votes, keys, rounds=cfg.board_rounds) if votes else []
    rows = [{"state": st.state, "label": by_key[st.state].label if st.state in by_key else st.state,
             "step": by_key[st.state].step if st.state in by_key else None, "age": age.get(st.state),
             "rating": st.rating, "low": st.low, "high": st.high, "votes": st.votes, "wins": st.wins,
             "losses": st.losses, "ties": st.ties} for st in board]
    trained = [s for s in history if s.step is not None]
    on_board = [s.key for s in trained if s.key in voted]   # a state trained after the last vote has none
    newest = on_board[-1] if on_board else None
    base_newest = (separation(votes, "base", newest, cfg.board_rounds, board_replay=True)   # the target's
                   if newest and {"base", newest} <= set(voted) else None)
    top_two = (separation(votes, rows[0]["state"], rows[1]["state"], cfg.board_rounds, cfg.board_replay)
               if len(rows) >= 2 else None)
    # the states' step order: base, then the states training steps made, by step (a state without a
    # step, e.g. an admin's pin of one agent's old version, has no place in it and is left out)
    order = [s.key for s in history if (s.is_base or s.step is not None) and s.key in voted]
    tau = kendall_tau(order, board) if len(order) >= 2 else None
    tau_target = {"value": tau, "states": len(order), "target": f">= {cfg.tau_min} over >= {MIN_TAU_STATES} states",
                  "pass": None if tau is None or len(order) < MIN_TAU_STATES else tau >= cfg.tau_min}
    pair_s = [r["pair_s"] for r in records]
    winners = [r["winner"] for r in records]
    return {
        "config": asdict(cfg), "machine": machine or {},
        "states": [{"state": s.key, "label": s.label, "step": s.step, "versions": s.versions} for s in history],
        "versions_trained": len(trained), "newest": newest,
        "board": rows, "votes": len(votes), "voters": per_voter(votes),
        "separation": {"base_newest": base_newest, "top_two": top_two},
        "tau": {"value": tau, "order": order},
        "targets": {"separate_base_newest": _separation_target(base_newest, cfg.separate_within),
                    "kendall_tau": tau_target},
        "voter": {"votes": len(records), "a": winners.count("a"), "b": winners.count("b"), "tie": winners.count("tie"),
                  "noisy": sum(bool(r.get("noisy")) for r in records),
                  "pair_s_median": statistics.median(pair_s) if pair_s else None},
        "rater": {"rounds": len(rounds),
                  "generate_s_median": statistics.median(r["generate_s"] for r in rounds) if rounds else None,
                  "mean_rating_first": statistics.fmean(rounds[0]["ratings"]) if rounds else None,
                  "mean_rating_last": statistics.fmean(rounds[-1]["ratings"]) if rounds else None},
        **(server or {}),
    }


def machine_info() -> dict:
    """What the numbers were measured on: torch's CPU capability, the CPU's name, cores, load average now."""
    import torch

    from collab_app.cpu.machine import cpu_model

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu_model": cpu_model(), "cores": cores,
            "loadavg_start": open("/proc/loadavg").read().split()[:3] if os.path.exists("/proc/loadavg") else None}


def plot(result: dict, path: str) -> None:
    """Rating vs step with the bootstrap intervals, one point per state on the board (base at step 0;
    states without a step, e.g. an admin's pin of one agent, in grey between base and step 1)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(result["board"], key=lambda r: (r["age"] is None, r["age"] or 0))
    stepless = [r["state"] for r in rows if r["step"] is None and r["state"] != "base"]   # between base and step 1
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in rows:
        x = (0 if r["state"] == "base" else r["step"] if r["step"] is not None
             else (stepless.index(r["state"]) + 1) / (len(stepless) + 1))
        ax.errorbar([x], [r["rating"]], yerr=[[r["rating"] - r["low"]], [r["high"] - r["rating"]]], fmt="o",
                    capsize=4, color="C0" if r["step"] is not None or r["state"] == "base" else "grey")
        ax.annotate(f"{r['label']} ({r['votes']})", (x, r["rating"]), textcoords="offset points", xytext=(6, 4),
                    fontsize="small")
    tau = result["tau"]["value"]
    ax.set(xlabel="training step (base = 0)", ylabel="arena rating (Bradley-Terry, 95% bootstrap)",
           title=f"collab bench arena: {result['votes']} votes, preference {result['config']['preference']}, "
                 f"tau {'-' if tau is None else f'{tau:.2f}'}")
    ax.axhline(1000, color="lightgrey", lw=0.8, zorder=0)
    ax.xaxis.get_major_locator().set_params(integer=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _fmt(v, nd=2) -> str:
    if v is None:
        return "-"
    return f"{v:.{nd}f}" if isinstance(v, float) else str(v)


def table(res: dict) -> str:
    """The board, then separation, tau and the targets, then the run's facts."""
    from collab_app.commands.bench_abuse import target_lines

    lines = [f"{'state':<34}{'step':>5}{'rating':>9}{'low':>8}{'high':>8}{'votes':>7}{'W-L-T':>10}"]
    for r in res["board"]:
        lines.append(f"{r['label'][:33]:<34}{_fmt(r['step']):>5}{r['rating']:>9.0f}{r['low']:>8.0f}{r['high']:>8.0f}"
                     f"{r['votes']:>7}{r['wins']:>4}-{r['losses']}-{r['ties']}")
    for name, sep in res["separation"].items():
        if sep is None:
            lines.append(f"{name}: - (no votes on both)")
            continue
        extra = f"; whole board {_fmt(sep['board'])} of {sep['board_votes']}" if "board" in sep else ""
        lines.append(f"{name} ({sep['x']} vs {sep['y']}): separated after {_fmt(sep['involving'])} of "
                     f"{sep['involving_votes']} votes involving them; head to head {_fmt(sep['head_to_head'])} of "
                     f"{sep['head_to_head_votes']}{extra}")
    lines.append(f"Kendall's tau (step order vs board, {len(res['tau']['order'])} states): {_fmt(res['tau']['value'])}")
    lines += target_lines(res["targets"], lambda v: _fmt(v, 2), width=36, none="n/a (too little data)")
    v, m, c = res["voter"], res["machine"], res["config"]
    lines.append(f"({res['versions_trained']} trained states; rater {res['rater']['rounds']} rounds, "
                 f"{_fmt(res['rater']['generate_s_median'], 1)} s each; voter {v['votes']} votes (a {v['a']}, b {v['b']}, "
                 f"tie {v['tie']}, noisy {v['noisy']}), {_fmt(v['pair_s_median'], 1)} s per pair; voters "
                 f"{len(res['voters'])}; preference {c['preference']}, noise {c['noise']}; G={c['num_generations']}, "
                 f"{c['max_new_tokens']} tokens, K={c['min_groups']}, engine {c['engine']}; phases "
                 f"{_fmt(res.get('phases_s', {}).get('train'), 0)} s + {_fmt(res.get('phases_s', {}).get('vote'), 0)} s; "
                 f"CPU {m.get('cpu_model')} ({m.get('cpu_capability')}, {m.get('cores')} cores), load avg at start "
                 f"{' '.join(m.get('loadavg_start') or [])}" + (f"; error: {res['error']}" if res.get("error") else "") + ")")
    return "\n".join(lines)


# --------------------------------------------------------------------------- the run

def run(cfg: BenchArenaConfig) -> dict:
    from collab_app.online.store import Store
    from tasks import load_task

    machine = machine_info()
    out_dir = os.path.abspath(cfg.out_dir)
    home = os.path.join(out_dir, "home")
    os.makedirs(home, exist_ok=False)   # a fresh store and adapters: the states start at base
    db_url = f"sqlite:///{home}/collab.db"
    roles = list(load_task(TEXTS_TASK).roles)
    key = make_key()
    port = cfg.port or free_port()
    url = f"http://127.0.0.1:{port}/"
    proc = start_server(cfg, home, port, "--api-max-rounds-per-minute", "0", "--api-max-ratings-per-minute", "0",
                        env={"COLLAB_API_KEYS": key})
    rounds: list[dict] = []
    records: list[dict] = []
    error, startup_s, phases, board_now, store = None, None, {}, None, None
    try:
        t0 = time.monotonic()
        connect(url, proc).close()
        startup_s = time.monotonic() - t0
        store = Store(db_url)
        t1 = time.monotonic()
        try:
            run_rater(cfg, url, proc, store, roles, t1 + 60 * cfg.train_minutes, rounds)
        finally:
            phases["train"] = time.monotonic() - t1
        made = len(trained_states(store, roles))
        log.info("phase 1 done: %d rounds, %d trained state(s) in %.0f s", len(rounds), made, phases["train"])
        if made == 0:
            raise RuntimeError(f"no training step wrote a version in {cfg.train_minutes} min: nothing to compare")
        t2 = time.monotonic()
        try:
            run_voter(cfg, url, key, proc, t2 + 60 * cfg.vote_minutes, records)
        finally:
            phases["vote"] = time.monotonic() - t2
        board_now = server_board(url, key)
    except Exception as e:  # noqa: BLE001 - a dead or hung server is a result too: report what came before
        error = f"{type(e).__name__}: {e}"
        log.error("bench stopped: %s", error)
    finally:
        stop_server(proc)
        if store is not None:
            store.close()
    store = Store(db_url)
    try:
        votes, history = read_arena(store, TEXTS_TASK, roles)
    finally:
        store.close()
    result = report(cfg, votes, history, records, rounds, machine,
                    {"startup_s": startup_s, "phases_s": phases, "error": error, "server_board": board_now,
                     "loadavg_end": open("/proc/loadavg").read().split()[:3]})
    with open(os.path.join(out_dir, "bench_arena.json"), "w") as f:
        json.dump({**result, "records": records, "rounds": rounds}, f, indent=1)
    plot(result, os.path.join(out_dir, "bench_arena.png"))
    return result


def cli_main(argv: list[str] | None = None) -> int:
    from trainer.configcli import parse_config

    cfg, other = parse_config(
        BenchArenaConfig, argv, prog="collab bench arena",
        description="A scripted rater with a hidden preference trains a real `collab serve` for --versions steps, "
                    "then a scripted voter with the same preference votes blind pairs through /v1/arena: the "
                    "board, votes to separate two states, Kendall's tau of step order vs board (JSON + PNG).",
        extra=lambda p: p.add_argument("--json", action="store_true", help="print the result as JSON"))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s bench-arena %(levelname)s %(message)s",
                        stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)   # one line per request otherwise
    res = run(cfg)
    print(json.dumps(res, indent=1) if other.json else table(res))
    print(f"wrote {os.path.join(os.path.abspath(cfg.out_dir), 'bench_arena.json')} and bench_arena.png",
          file=sys.stderr)
    return 0 if res.get("error") is None else 1


if __name__ == "__main__":
    sys.exit(cli_main())
