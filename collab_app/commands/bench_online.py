"""`collab bench online`: does the team learn what its raters want?

Starts a real `collab serve` (subprocess, own COLLAB_HOME / store / adapters under --out-dir),
then scripted raters, each with a declared preference that the automatic reward does not hold,
generate rounds and rate every candidate through the public API (gradio_client; one Client per
rater = one server session, the one that generated the group), for --minutes. Reported (JSON +
PNG): mean rating per window of rounds per rater, the adapter versions served per round, the
time from a group's ratings to the train step that contains it and to the first round served
from that step's version, and after the run the held-out automatic score of the versions served.

    collab bench online [--minutes 20 --raters short word:summary --num-generations 4 ...]

Preferences (`--raters`, `preference()`): `short`, `short:LO-HI`, `long`, `word:W`, `nodigits`.
The return mode is the child trainer's (`--trainer-args "--return-mode ..."`). Also here: the
helpers other benches use to run a server (`start_server`, `use_home`, `seed_home`, `settle`,
`predict`). Each preference, the curves and the limits: docs/BENCHES.md.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

log = logging.getLogger(__name__)

TEXTS_TASK = "tldr"


@dataclass
class BenchOnlineConfig:
    minutes: float = 20.0
    """how long the raters rate (wall clock, after the server is up)."""
    raters: list[str] = field(default_factory=lambda: ["short"])
    """one scripted rater per entry: short | short:LO-HI | long | word:W | nodigits (module doc)."""
    engine: str = "auto"
    """serving engine of the `collab serve` it starts (auto | vllm | transformers)."""
    num_generations: int = 4
    """G of the server: candidates per round."""
    max_new_tokens: int = 64
    """new tokens per agent answer."""
    min_groups: int = 2
    """K of the child trainer: a step per K rated groups."""
    window: int = 5
    """rounds per window in the mean-rating curve."""
    think_s: float = 0.0
    """seconds a rater reads a round before rating it (a person's pace; 0 = at once, rounds back to back)."""
    trainer_args: str = "--max-wait-s 0 --human-timeout-s 3600"
    """more `collab trainer` flags for the server's child trainer (one quoted string)."""
    serve_args: str = ""
    """more `collab serve` flags (one quoted string), e.g. "--engine-cores -1"."""
    out_dir: str = "bench-online"
    """where the server's home, the JSON, the PNG and the server log go."""
    port: int = 0
    """server port (0 = a free one)."""
    round_timeout_s: float = 600.0
    """a round (generate or rate) that takes longer ends the run as "hung" (results so far are kept)."""
    eval_points: int = 6
    """team states (versions served) to score on held-out texts after the run, spread over it (0 = off)."""
    eval_examples: int = 5
    """held-out TL;DR texts per scored state: the first N of the eval split (5 texts; the raters rate the 15 of the train split)."""
    eval_samples: int = 4
    """besides the greedy answer, joint answers sampled per held-out text at the server's temperature 0.8 (what a person sees)."""

    def __post_init__(self):
        for r in self.raters:
            preference(r)   # raises with the valid forms
        if self.minutes <= 0 or self.window < 1 or self.num_generations < 2 or self.min_groups < 1 or self.think_s < 0:
            raise ValueError("need minutes > 0, window >= 1, num_generations >= 2, min_groups >= 1, think_s >= 0")
        if self.eval_points < 0 or self.eval_points == 1 or self.eval_examples < 1 or self.eval_samples < 0:
            raise ValueError(f"--eval-points must be 0 (off) or >= 2 (the first and the last state at least), "
                             f"--eval-examples >= 1 and --eval-samples >= 0; got {self.eval_points}, "
                             f"{self.eval_examples}, {self.eval_samples}")


def _by_words(lo: int, hi: int, fewer_is_better: bool, exact: bool = False):
    """1..5 linear in the combined text's words between lo and hi, rounded, flat outside; `exact`:
    the same line neither rounded nor flattened (a score for comparing two answers, not stars)."""
    def rate(text: str) -> float:
        x = (len(text.split()) - lo) / (hi - lo)
        r = 5 - 4 * x if fewer_is_better else 1 + 4 * x
        return r if exact else int(round(max(1.0, min(5.0, r))))
    return rate


def preference(spec: str, exact: bool = False):
    """The rating function (combined text -> 1..5) of a rater spec; `exact`: the word-count ones
    neither rounded nor flattened at 1 and 5 (a voter comparing two answers tells 12 words from 20
    where a rater gives both 5 stars)."""
    if spec == "short":
        spec = "short:30-90"
    if re.fullmatch(r"short:\d+-\d+", spec):
        lo, hi = map(int, spec[6:].split("-"))
        if hi <= lo:
            raise ValueError(f"rater preference {spec!r}: short:LO-HI needs LO < HI words")
        return _by_words(lo, hi, fewer_is_better=True, exact=exact)
    if spec == "long":
        return _by_words(30, 90, fewer_is_better=False, exact=exact)
    if spec.startswith("word:") and re.fullmatch(r"word:\w+", spec):
        word = re.compile(rf"\b{re.escape(spec[5:])}\b", re.I)
        return lambda text: 5 if word.search(text) else 1
    if spec == "nodigits":
        return lambda text: 1 if re.search(r"\d", text) else 5
    raise ValueError(f"unknown rater preference {spec!r}: use short, short:LO-HI, long, word:WORD or nodigits")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(cfg, home: str, port: int, *extra: str) -> list[str]:
    """`collab serve` as a person starts it, on the TL;DR task, with a fresh store and adapters
    under `home`. A scripted rater rates at once: the per-session limits meant for people are off;
    `extra` (more serve flags) comes before cfg.serve_args. `cfg`: a bench config with engine,
    num_generations, max_new_tokens, min_groups, trainer_args ("" = serve's own trainer flags)
    and serve_args (BenchOnlineConfig, bench_page.BenchPageConfig)."""
    return [sys.executable, "-m", "collab_app.web.serve", "--port", str(port), "--engine", cfg.engine,
            "--num-generations", str(cfg.num_generations), "--max-new-tokens", str(cfg.max_new_tokens),
            "--min-groups", str(cfg.min_groups), "--tasks", TEXTS_TASK,
            "--db", f"sqlite:///{home}/collab.db", "--adapters-dir", os.path.join(home, "adapters"),
            "--max-rounds-per-minute", "0", "--max-ratings-per-minute", "0", *extra,
            *(["--trainer-args", cfg.trainer_args] if cfg.trainer_args else []), *shlex.split(cfg.serve_args)]


def race_first(model_path: str) -> None:
    """This machine's engine race for the served model, run now where it is missing (cached per
    machine: paths.machine_dir): the bench's server then starts as a person's later starts do, and
    no background race runs beside what the bench measures (serve.race_in_background)."""
    from collab_app.engines.choose import auto_choice

    auto_choice(model_path, measure=True)


def use_home(home: str) -> str:
    """For a bench that builds the app in its own process (the result scripts): make `home`
    (it must not exist) and point this process at it (COLLAB_HOME, and COLLAB_MODEL = the embedded
    model unless already set). Returns its absolute path."""
    home = os.path.abspath(home)
    os.makedirs(home)
    os.environ["COLLAB_MODEL"] = served_model()
    os.environ["COLLAB_HOME"] = home
    return home


def served_model() -> str:
    """The model a bench serves: COLLAB_MODEL where set, else the embedded model's folder."""
    from collab_app.engines.model import ensure_model

    return os.environ.get("COLLAB_MODEL") or ensure_model(None)


def start_server(cfg, home: str, port: int, *extra: str, launcher: list[str] | None = None,
                 env: dict[str, str] | None = None) -> subprocess.Popen:
    """serve_command's server, in its own session (stop_server ends it and its trainer child),
    logging to home/serve.log, on the embedded model unless COLLAB_MODEL names another, raced first
    (race_first). `launcher` replaces `python -m collab_app.web.serve` (a
    result script that wraps serve with timers); `env` adds to the server's environment."""
    race_first(served_model())
    cmd = serve_command(cfg, home, port, *extra)
    if launcher:
        cmd = [*launcher, *cmd[3:]]   # the serve flags after `python -m collab_app.web.serve`
    env = {**os.environ, "COLLAB_HOME": home, "GRADIO_ANALYTICS_ENABLED": "False",
           "COLLAB_MODEL": served_model(), **(env or {})}
    log.info("starting: %s", shlex.join(cmd))
    with open(os.path.join(home, "serve.log"), "w") as logf:   # the child keeps its own copy of the file
        return subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()   # serve stops its trainer child on SIGTERM
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:   # e.g. a hung generate holds the engine lock
            os.killpg(proc.pid, signal.SIGKILL)   # its own session: serve and the trainer child
            proc.wait()


def connect(url: str, proc: subprocess.Popen, timeout: float = 600):
    from gradio_client import Client

    end = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"collab serve exited with code {proc.returncode}; see its log")
        try:
            return Client(url, verbose=False, analytics_enabled=False, download_files=False)
        except Exception:  # noqa: BLE001 - not up yet
            if time.monotonic() > end:
                raise
            time.sleep(0.5)   # a server's start is ~10-40 s: a coarser poll only adds to every start


API_RETRIES = 2   # api_call: tries again after the client lost an answer, at most this often
SETTLE_S = 2.0    # settle: the longest wait for the client to read the server's close of its stream


def settle(client, timeout_s: float = SETTLE_S) -> bool:
    """Wait (at most `timeout_s`) until gradio_client has read the end of the session's event
    stream, when it is about to end; True if nothing is left to wait for.

    Why (gradio 6.31 / gradio_client 2.7.2, protocol sse_v3): the server sends `process_completed`
    and, when the session has no other event pending, `close_stream` right after it. The answer
    reaches the caller at the first; the client's reader thread ends only at the second. An event
    submitted in between finds the reader still open, does not open its own, and is then cancelled
    on the client side when that reader ends (`concurrent.futures.CancelledError`; the server still
    runs it). A caller that submits at once after an answer, as scripts do, hits it now and then:
    the e2e learning test lost a /rate this way once in ~60 rounds. So before a submit: while the
    client's stream is open with none of its events pending, the close is on its way: wait for it.
    The attributes read are gradio_client's own (no public API says this); if they are gone, this
    waits for nothing."""
    lock = getattr(client, "pending_lock", None)
    if lock is None:
        return True
    end = time.monotonic() + timeout_s
    while True:
        with lock:
            ending = getattr(client, "stream_open", False) and not getattr(client, "pending_event_ids", True)
        if not ending:
            return True
        if time.monotonic() >= end:
            return False
        time.sleep(0.005)


def predict(client, *args, timeout_s: float | None = None, **kw):
    """`client.predict(*args, **kw)` (its errors too) without gradio_client's stream race (`settle`)."""
    settle(client)
    return client.submit(*args, **kw).result(timeout=timeout_s)


def api_call(client, timeout_s: float | None = None, **kw):
    """`predict(client, **kw)` for a scripted caller of the app's API (the bench's
    raters, the e2e tests), with two things a person's page does on its own:
    - the server's per-session limits (rounds / ratings per minute): wait as its error says;
    - an answer gradio_client lost (concurrent.futures.CancelledError): `settle` avoids the race
      that loses one; should one be lost anyway, it is tried again, at most API_RETRIES times: both
      calls a rater makes are safe to repeat (a re-rating replaces the rater's rating of that joint
      answer; a second /generate is a new round, the lost one stays unrated as a closed page
      leaves it)."""
    from concurrent.futures import CancelledError

    from gradio_client.exceptions import AppError

    lost = 0
    while True:
        try:
            return predict(client, timeout_s=timeout_s, **kw)
        except AppError as e:
            wait = re.search(r"too many .* try again in (\d+) s", str(e))
            if not wait:
                raise
            time.sleep(int(wait.group(1)) + 1)
        except CancelledError:
            lost += 1
            if lost > API_RETRIES:
                raise
            log.warning("the API client lost the answer to %s (%d of %d); trying again",
                        kw.get("api_name"), lost, API_RETRIES)


def run_raters(cfg: BenchOnlineConfig, url: str, proc: subprocess.Popen, rounds: list[dict]) -> float:
    """Raters take turns (one round each, round robin) until the time is up; one record per round
    appended to `rounds` (kept if the server fails midway). Returns the start time."""
    from tasks import load_task

    # the train split only: the eval split is held out for the automatic score of the versions (held_out)
    texts = [ex["text"] for ex in load_task(TEXTS_TASK).examples("train")]
    clients = [connect(url, proc) for _ in cfg.raters]
    prefs = [preference(r) for r in cfg.raters]
    t_start = time.time()

    def call(client, **kw):
        return api_call(client, timeout_s=cfg.round_timeout_s, **kw)
    end = time.monotonic() + 60 * cfg.minutes
    k = 0
    while time.monotonic() < end:
        i = k % len(cfg.raters)
        t0 = time.time()
        out = call(clients[i], task=TEXTS_TASK, text=texts[k % len(texts)], api_name="/generate")
        t1 = time.time()
        time.sleep(cfg.think_s)   # reading the candidates
        ratings = []
        for c in out["candidates"]:
            r = prefs[i](c["combined"])
            call(clients[i], joint_sample_id=c["joint_sample_id"], rating=r, api_name="/rate")
            ratings.append(r)
        versions = {}
        for c in out["candidates"]:
            for p in c["parts"]:
                versions[p["agent"]] = max(versions.get(p["agent"], -1), p["adapter_version"] or 0)
        rounds.append({"round": k, "rater": cfg.raters[i], "group_id": out["group_id"], "t_start": t0 - t_start,
                       "generate_s": t1 - t0, "rated_at": time.time() - t_start, "ratings": ratings,
                       "mean_rating": statistics.fmean(ratings), "versions": versions,
                       "auto_mean": statistics.fmean([c["reward"]["total"] for c in out["candidates"]
                                                      if c.get("reward")] or [float("nan")]),
                       "words": [len(c["combined"].split()) for c in out["candidates"]]})
        log.info("round %d (%s): %.1f s, ratings %s, versions %s", k, cfg.raters[i], t1 - t0, ratings, versions)
        k += 1
    return t_start


def unix_time(dt) -> float:
    """A store timestamp (naive = UTC) as unix time."""
    from datetime import timezone

    return (dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)).timestamp()


def latencies(rounds: list[dict], db_url: str, t_start: float) -> tuple[list[dict], list[dict]]:
    """Per rated group: seconds from its last rating to the train step that took it, and to the
    first round served from a version at least that step's."""
    from collab_app.online.store import Store

    store = Store(db_url)
    steps = store.train_steps()
    rated = {r["group_id"]: r for r in rounds}
    out = []
    for st in steps:
        m = st["metrics"]
        produced = {k.split("/")[0]: v for k, v in m.items() if k.endswith("/version")}
        t_step = unix_time(st["created_at"]) - t_start
        for gid in st["group_ids"]:
            if gid not in rated:
                continue
            r = rated[gid]
            served = next((q["t_start"] for q in rounds if q["t_start"] >= t_step and
                           any(q["versions"].get(a, 0) >= v for a, v in produced.items() if v)), None)
            out.append({"group_id": gid, "step": st["step"], "versions": produced,
                        "rating_to_step_s": t_step - r["rated_at"],
                        "rating_to_served_s": None if served is None else served - r["rated_at"]})
    return out, [{"step": s["step"], "t": unix_time(s["created_at"]) - t_start, "groups": len(s["group_ids"]),
                  "update_s": s["metrics"].get("time/update_s"), "paused_s": s["metrics"].get("time/paused_s"),
                  "wide_s": s["metrics"].get("time/wide_s"), "pause_credit_s": s["metrics"].get("time/pause_credit_s")} for s in steps]


def team_states(db_url: str, agents: list[str], t_start: float) -> list[dict]:
    """The team's states over the run, oldest first: {"t": seconds from the raters' start, "step",
    "versions": {agent: (version, path)}}, one per train step that wrote versions (the agents of one
    step form one state), from the store's version rows. Version 0 (written before the raters start)
    is at t = 0."""
    from collab_app.online.store import Store

    store = Store(db_url)
    rows = sorted((max(0.0, unix_time(v.created_at) - t_start), v.step, a, v.version, v.path)
                  for a in agents for v in store.adapter_versions(a))
    states: list[dict] = []
    current: dict = {}
    for t, step, agent, version, path in rows:
        current[agent] = (version, path)
        if len(current) < len(agents):
            continue   # a state needs every agent's version
        if states and step is not None and states[-1]["step"] == step:
            states[-1].update(t=t, versions=dict(current))   # the same step's other agent
        else:
            states.append({"t": t, "step": step, "versions": dict(current)})
    return states


def spread(n: int, k: int) -> list[int]:
    """k indices out of range(n), evenly spread, first and last included (all of them when n <= k)."""
    if n <= k:
        return list(range(n))
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


def held_out(cfg: BenchOnlineConfig, states: list[dict], engine=None) -> list[dict]:
    """The automatic TL;DR score of each state's versions on held-out texts (module doc): the greedy
    joint answer per text, and `eval_samples` sampled joint answers per text (aligned: sample g of
    each agent forms joint answer g, as the server's candidates do), seeded where the engine honours
    a per-request seed (the transformers engine; vLLM on CPU keeps only its engine-wide seed)."""
    from collab_app.commands.evaluate import generate_joint
    from collab_app.engines.choose import make_engine
    from collab_app.engines.engine_types import Sampling
    from collab_app.engines.model import ensure_model
    from tasks import load_task
    from tasks.base import check_prompts, check_reward

    task = load_task(TEXTS_TASK)
    examples = task.examples("eval")[:cfg.eval_examples]
    roles = list(task.roles)
    own = engine is None
    engine = engine or make_engine(cfg.engine, model=ensure_model(None), num_agents=len(roles))
    prompts = [check_prompts(task, task.agent_prompts(ex, [])) for ex in examples]

    def joint(texts, g):   # the joint answer g of every example: (example, outputs)
        return [(ex, [texts[e][a][g] for a in range(len(roles))]) for e, ex in enumerate(examples)]

    def score(pairs) -> dict:
        rewards = [check_reward(task, task.reward(ex, o)) for ex, o in pairs]
        return {"auto": statistics.fmean(r.total for r in rewards),
                "words": statistics.fmean(len(task.combine(ex, o).split()) for ex, o in pairs)}

    results = []
    try:
        for role in roles:
            engine.register_agent(role)
        for st in states:
            for role in roles:
                version, path = st["versions"][role]
                engine.load_adapter(role, path, version)
            greedy = generate_joint(engine, roles, prompts, Sampling(max_new_tokens=cfg.max_new_tokens,
                                                                     temperature=0.0, seed=0))
            row = {"t": st["t"], "step": st["step"], "versions": {r: v for r, (v, _) in st["versions"].items()},
                   "greedy": score(joint(greedy, 0))}
            if cfg.eval_samples:
                sampled = generate_joint(engine, roles, prompts, Sampling(
                    max_new_tokens=cfg.max_new_tokens, temperature=0.8, seed=0), n=cfg.eval_samples)
                row["sampled"] = score([p for g in range(cfg.eval_samples) for p in joint(sampled, g)])
            log.info("held-out: versions %s at %.1f min: %s", row["versions"], st["t"] / 60,
                     {k: row[k] for k in ("greedy", "sampled") if k in row})
            results.append(row)
    finally:
        if own:
            engine.close()
    return results


def windows(rounds: list[dict], size: int) -> dict[str, list[dict]]:
    per: dict[str, list[dict]] = {}
    for spec in dict.fromkeys(r["rater"] for r in rounds):
        mine = [r for r in rounds if r["rater"] == spec]
        per[spec] = [{"rounds": [w[0]["round"], w[-1]["round"]], "t_end": w[-1]["rated_at"],
                      "mean_rating": statistics.fmean(x["mean_rating"] for x in w),
                      "auto_mean": statistics.fmean(x["auto_mean"] for x in w),
                      "mean_words": statistics.fmean(statistics.fmean(x["words"]) for x in w),
                      "max_version": max(max(x["versions"].values(), default=0) for x in w)}
                     for w in (mine[i:i + size] for i in range(0, len(mine), size))]
    return per


def outcome(per: dict[str, list[dict]], held: list[dict]) -> dict:
    """The two curves' ends: per rater, the mean rating of its first and last window and the change;
    the held-out automatic score (greedy, sampled) of the first and the last scored state, and the
    last as a share of the first (issue target: rating +1.5 while the held-out score keeps >= 90%)."""
    out: dict = {"rating": {spec: {"first": ws[0]["mean_rating"], "last": ws[-1]["mean_rating"],
                                   "change": ws[-1]["mean_rating"] - ws[0]["mean_rating"]}
                            for spec, ws in per.items() if ws}}
    if held:
        out["held_out"] = {}
        for kind in ("greedy", "sampled"):
            if kind in held[0]:
                a, b = held[0][kind]["auto"], held[-1][kind]["auto"]
                out["held_out"][kind] = {"first": a, "last": b, "kept": b / a if a else None,
                                         "words_first": held[0][kind]["words"], "words_last": held[-1][kind]["words"]}
    return out


def plot(result: dict, path: str) -> None:
    """Top: mean rating per window per rater and the adapter version served. Bottom: the automatic
    TL;DR score, held-out (greedy and sampled, per scored state) and of the rated candidates (per
    window), against the same minutes."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for spec, ws in result["windows"].items():
        ax.plot([w["t_end"] / 60 for w in ws], [w["mean_rating"] for w in ws], marker="o", label=f"rater {spec}")
    ax.set(ylabel=f"mean rating per window of {result['config']['window']} rounds", ylim=(1, 5))
    ax2 = ax.twinx()
    rs = result["rounds"]
    ax2.step([r["t_start"] / 60 for r in rs], [max(r["versions"].values(), default=0) for r in rs],
             where="post", color="grey", alpha=0.6, label="adapter version served")
    ax2.set_ylabel("adapter version served")
    ax.legend(loc="upper left")
    ax2.legend(loc="lower right")
    ax.set_title(f"collab bench online: {len(rs)} rounds, {len(result['steps'])} MAGRPO steps")
    ho = result.get("held_out") or []
    for kind, style in (("greedy", "s-"), ("sampled", "D-")):
        pts = [(h["t"] / 60, h[kind]["auto"]) for h in ho if kind in h]
        if pts:
            bx.plot(*zip(*pts), style, label=f"held-out texts, {kind}")
    for spec, ws in result["windows"].items():
        bx.plot([w["t_end"] / 60 for w in ws], [w["auto_mean"] for w in ws], ":", alpha=0.7,
                label=f"rated candidates ({spec})")
    bx.set(xlabel="minutes", ylabel="automatic TL;DR score (of 3)", ylim=(0, 3))
    bx.legend(loc="lower left", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(cfg: BenchOnlineConfig) -> dict:
    out_dir = os.path.abspath(cfg.out_dir)
    home = os.path.join(out_dir, "home")
    os.makedirs(home, exist_ok=False)   # a fresh store and adapters: the curve starts at version 0
    port = cfg.port or free_port()
    proc = start_server(cfg, home, port)
    rounds: list[dict] = []
    error = None
    try:
        t_up = time.time()
        connect(f"http://127.0.0.1:{port}/", proc)
        startup_s = time.time() - t_up
        t_start = time.time()
        try:
            t_start = run_raters(cfg, f"http://127.0.0.1:{port}/", proc, rounds)
        except Exception as e:  # noqa: BLE001 - a hung or dead server is a result too: keep what came before
            error = f"{type(e).__name__}: {e} after {len(rounds)} rounds"
            log.error("raters stopped: %s", error)
    finally:
        stop_server(proc)
    db_url = f"sqlite:///{home}/collab.db"
    loadavg_end = open("/proc/loadavg").read().split()[:3]   # of the rating run, before the held-out scoring
    lat, steps = latencies(rounds, db_url, t_start)
    held = []
    if cfg.eval_points:
        from tasks import load_task

        states = team_states(db_url, list(load_task(TEXTS_TASK).roles), t_start)
        held = held_out(cfg, [states[i] for i in spread(len(states), cfg.eval_points)])
    per = windows(rounds, cfg.window)
    result = {"config": asdict(cfg), "startup_s": startup_s, "error": error, "loadavg_end": loadavg_end,
              "rounds": rounds, "windows": per, "steps": steps, "latency": lat, "held_out": held,
              "summary": {"rounds": len(rounds), "steps": len(steps),
                          "versions_served": sorted({max(r["versions"].values(), default=0) for r in rounds}),
                          "generate_s_median": statistics.median(r["generate_s"] for r in rounds) if rounds else None,
                          "rating_to_served_s_median": statistics.median(
                              [x["rating_to_served_s"] for x in lat if x["rating_to_served_s"] is not None] or [0]),
                          **outcome(per, held)}}
    with open(os.path.join(out_dir, "bench_online.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(result, os.path.join(out_dir, "bench_online.png"))
    return result


def cli_main(argv: list[str] | None = None) -> int:
    from trainer.configcli import parse_config

    cfg, _ = parse_config(BenchOnlineConfig, argv, prog="collab bench online",
                          description="Scripted raters with declared preferences rate a running `collab serve`; "
                                      "reports whether the team learns them (JSON + PNG).")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s bench-online %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)   # one line per gradio_client request otherwise
    res = run(cfg)
    print(json.dumps({"summary": res["summary"], "windows": res["windows"], "held_out": res["held_out"]}, indent=1))
    print(f"wrote {os.path.join(os.path.abspath(cfg.out_dir), 'bench_online.json')} and bench_online.png")
    return 0


if __name__ == "__main__":
    sys.exit(cli_main())
