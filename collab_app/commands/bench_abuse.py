"""`collab bench abuse`: can one network steer, starve or fool a public `collab serve`?

Starts a real `collab serve` (subprocess, own COLLAB_HOME / store / adapters under --out-dir; the
TL;DR task, G=4, 128 new tokens), listening on 127.0.0.1 only, behind one trusted proxy hop
(COLLAB_TRUSTED_PROXY_HOPS=1): every client sends `X-Forwarded-For: <its network's address>`, so the
server counts each scripted client on the network the bench gives it. The server runs with serve's
own limits and the trainer flags serve gives its child on a public app (`public_trainer_flags`).

Two phases, one server:
- quiet (`--quiet-minutes`, 5): `--honest` (3) honest raters, each its own identity on its own
  network, generate a round, read it `--think-s` seconds, and rate the longest candidate best;
- attack (`--minutes`, 10): the honest raters go on, and `--attackers` (50) identities on ONE
  network, each a real concurrent client with its own session cookie, generate and rate as fast
  as the server lets them, pushing the opposite preference (the shortest candidate best).

Reported (JSON): the attacker's share of the groups the steps of the attack phase trained (by each
group's deciding rater), the honest raters' round latency per phase (target: attack <= 2 x quiet), the
bench's own client CPU, ratings accepted vs stored (target: 0 lost), and refusals per side by kind.
`targets()` judges the figures.

    collab bench abuse [--minutes 10 --quiet-minutes 5 --attackers 50 --honest 3 --json]

Limits: the clients run on the server's machine, whose cores a real attacker's clients would not
take: the honest raters run at nice +CLIENT_NICE once the server is up, the attacker's threads
under SCHED_IDLE (`idle_priority`: they run on what the server's processes leave; a real
attacker's requests still cost the server what they cost it), and the JSON gives the CPU the
clients, the server and its trainer child took per phase. IPv4 only (one address = one network);
nobody signs in. How each figure is counted: docs/BENCHES.md.
"""
from __future__ import annotations

import collections
import json
import logging
import os
import re
import shlex
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

log = logging.getLogger(__name__)

TASK = "tldr"
ATTACKER_NETWORK = "10.99.0.1"
CLIENT_NICE = 10           # the bench's clients run this much nicer than the server (module doc, Limits)
SESSION_RETRY_S = 3.0      # an identity without a session asks again this often
BACKOFF_S = 2.0            # after a refusal that names no time
MAX_WAIT_S = 30.0          # the longest wait a refusal's "try again in N s" is taken for
COOKIE = "collab_session"  # identity.COOKIE (not imported: this module loads without the web app)
SIDES = ("honest", "attacker")
REFUSALS = ("http_429", "http_403", "http_other", "queue_full", "rate_limit", "busy", "no_session",
            "session_refused", "lost_answer", "timeout", "app_error", "error")
"""what `refusal` names a failed call (module doc); `session_refused`: no cookie at an identity's start."""


@dataclass
class BenchAbuseConfig:
    minutes: float = 10.0
    """attack phase: the honest raters and the attacker's identities together (wall clock)."""
    quiet_minutes: float = 5.0
    """quiet phase before it: the honest raters alone (their baseline round latency), long enough for the trainer's steps on their groups (docs/BENCHES.md)."""
    attackers: int = 50
    """identities on the attacker's one network, each a concurrent client with its own session."""
    honest: int = 3
    """honest raters, each alone on its own network."""
    think_s: float = 3.0
    """seconds an honest rater reads a round before rating it (a person's pace); attackers never wait."""
    engine: str = "auto"
    """serving engine of the `collab serve` it starts (auto | vllm | transformers)."""
    num_generations: int = 4
    """G of the server: candidates per round."""
    max_new_tokens: int = 128
    """new tokens per agent answer."""
    min_groups: int = 4
    """K of the child trainer (serve's default)."""
    trainer_args: str = ""
    """more `collab trainer` flags for the child (one quoted string), after the public app's shares."""
    serve_args: str = ""
    """more `collab serve` flags (one quoted string), e.g. "--max-new-sessions-per-minute 5"."""
    out_dir: str = "bench-abuse"
    """where the server's home, its log and bench_abuse.json go (must not hold a home/ already)."""
    port: int = 0
    """server port (0 = a free one)."""
    round_timeout_s: float = 300.0
    """a call (generate or rate) waits at most this long for its answer (counted as a timeout)."""
    startup_timeout_s: float = 900.0
    """the server's start (model load, engine build) may take this long."""
    networks: list[str] = field(default_factory=list)
    """the honest raters' addresses (empty: 10.1.0.1, 10.2.0.1, ...); the attacker's is 10.99.0.1."""

    def __post_init__(self):
        if self.minutes <= 0 or self.quiet_minutes <= 0:
            raise ValueError(f"--minutes and --quiet-minutes must be > 0, got {self.minutes}, {self.quiet_minutes}")
        if self.attackers < 1 or self.honest < 1 or self.num_generations < 2 or self.min_groups < 1:
            raise ValueError("need attackers >= 1, honest >= 1, num_generations >= 2, min_groups >= 1")
        if self.think_s < 0 or self.round_timeout_s <= 0:
            raise ValueError("need think_s >= 0 and round_timeout_s > 0")
        if self.networks and len(self.networks) != self.honest:
            raise ValueError(f"--networks gives {len(self.networks)} addresses for {self.honest} honest raters")
        if ATTACKER_NETWORK in self.honest_networks():
            raise ValueError(f"{ATTACKER_NETWORK} is the attacker's network")

    def honest_networks(self) -> list[str]:
        return list(self.networks) or [f"10.{k + 1}.0.1" for k in range(self.honest)]


# --------------------------------------------------------------------------- the report's math

def median_ratio(quiet: list[float], attack: list[float]) -> dict:
    """Median round seconds per phase and attack / quiet (None where a phase has no round)."""
    q = statistics.median(quiet) if quiet else None
    a = statistics.median(attack) if attack else None
    return {"quiet_median_s": q, "attack_median_s": a, "quiet_rounds": len(quiet), "attack_rounds": len(attack),
            "ratio": a / q if q and a is not None else None}


def deciding_raters(ratings: list[dict]) -> dict[int, dict]:
    """{group id: the rating row (rater, session_id, ...) of the rater with the most ratings in force
    in the group (late ones left out; ties: the one with the latest rating id)}."""
    per: dict[int, dict[str, list]] = collections.defaultdict(lambda: collections.defaultdict(list))
    for r in ratings:
        if not r.get("late"):
            per[r["group_id"]][r["rater"]].append(r)
    return {gid: max(rows.values(), key=lambda rs: (len(rs), max(x["id"] for x in rs)))[-1]
            for gid, rows in per.items()}


def rater_side(row: dict | None, sides: dict[str, str]) -> str:
    """'honest' / 'attacker' / 'unknown' of a deciding rating row, by the session that sent it
    (ratings.session_id), else by the rater id (`session:<id>`), through `sides` {session id: side}."""
    if row is None:
        return "unknown"
    for key in (row.get("session_id"), str(row.get("rater") or "").removeprefix("session:")):
        if key and key in sides:
            return sides[key]
    return "unknown"


def trained_share(groups: list[dict], steps: dict[int, float], deciding: dict[int, dict],
                  sides: dict[str, str], t0: float, t1: float, generated_in_window: bool = True) -> dict:
    """Groups a step took within [t0, t1] (unix seconds; `steps` {step: its time}), generated in the
    window too unless `generated_in_window` is False, counted by their deciding rater's side;
    `attacker_share` = attacker / all of them (None when none)."""
    counts = dict.fromkeys((*SIDES, "unknown"), 0)
    for g in groups:
        if g["status"] != "trained" or g.get("trained_step") is None:
            continue
        t_step = steps.get(g["trained_step"])
        if t_step is None or not t0 <= t_step <= t1:
            continue
        if generated_in_window and not t0 <= g["created_at"] <= t1:
            continue
        counts[rater_side(deciding.get(g["id"]), sides)] += 1
    total = sum(counts.values())
    return {**counts, "total": total, "attacker_share": counts["attacker"] / total if total else None}


def ratings_kept(accepted: list[dict], stored: dict[int, float]) -> dict:
    """Accepted ratings ({id, value}: the server said saved) against the store's {id: value}:
    lost = accepted ones the store does not hold with that value."""
    lost = [a["id"] for a in accepted if a["id"] not in stored or abs(stored[a["id"]] - a["value"]) > 1e-9]
    return {"accepted": len(accepted), "stored": len(accepted) - len(lost), "lost": len(lost), "lost_ids": lost[:20]}


def targets(share: float | None, ratio: float | None, lost: int, networks: int) -> dict:
    """The abuse bench's targets: attacker share <= 1 / networks, honest median attack <= 2 x quiet, 0 lost
    (`pass` None where the run gave no figure to judge)."""
    fair = 1.0 / networks
    return {"attacker_share": {"value": share, "target": f"<= {fair:.2f} (1/{networks} networks)",
                               "pass": None if share is None else share <= fair + 1e-9},
            "honest_latency_ratio": {"value": ratio, "target": "<= 2.0 (attack median / quiet median)",
                                     "pass": None if ratio is None else ratio <= 2.0},
            "accepted_ratings_lost": {"value": lost, "target": "0", "pass": lost == 0}}


def refusal(exc: BaseException) -> tuple[str, float]:
    """(kind, seconds to wait before trying again) of a failed API call (REFUSALS)."""
    import concurrent.futures

    import httpx
    from gradio_client.exceptions import AppError
    from gradio_client.utils import QueueError, TooManyRequestsError

    if isinstance(exc, httpx.HTTPStatusError):
        code = exc.response.status_code
        retry = exc.response.headers.get("retry-after", "")
        wait = min(MAX_WAIT_S, float(retry)) if retry.isdigit() else BACKOFF_S
        return ({429: "http_429", 403: "http_403"}.get(code, "http_other"), wait)
    if isinstance(exc, TooManyRequestsError):
        return "http_429", BACKOFF_S
    if isinstance(exc, QueueError):
        return "queue_full", BACKOFF_S
    if isinstance(exc, concurrent.futures.CancelledError):
        return "lost_answer", 0.0
    if isinstance(exc, concurrent.futures.TimeoutError):
        return "timeout", 0.0
    if isinstance(exc, AppError):
        msg = str(exc)
        if "too many" in msg:
            m = re.search(r"try again in (\d+) s", msg)
            return "rate_limit", min(MAX_WAIT_S, int(m.group(1)) + 1) if m else MAX_WAIT_S
        if "no session" in msg:
            return "no_session", SESSION_RETRY_S
        if "at once" in msg or "generating" in msg or "busy" in msg:
            return "busy", BACKOFF_S
        return "app_error", BACKOFF_S
    return "error", BACKOFF_S


# --------------------------------------------------------------------------- the scripted raters

def attacker_ratings(candidates: list[dict]) -> list[int]:
    """5 for the shortest candidate (combined words; ties: the first), 1 for every other."""
    words = [len(c["combined"].split()) for c in candidates]
    best = words.index(min(words))
    return [5 if k == best else 1 for k in range(len(candidates))]


def honest_ratings(candidates: list[dict]) -> list[int]:
    """The longest candidate 5 ... the shortest 1, spread by rank (ties by index): siblings always
    differ, so every honest group carries a signal (the opposite of the attacker's)."""
    n = len(candidates)
    order = sorted(range(n), key=lambda i: (-len(candidates[i]["combined"].split()), i))
    out = [0] * n
    for rank, i in enumerate(order):
        out[i] = round(5 - 4 * rank / max(n - 1, 1))
    return out


@dataclass
class Identity:
    """One scripted client: its side, network, the session its cookie names, what it did."""
    name: str
    side: str
    network: str
    session_id: str | None = None
    client: object = None
    refused: collections.Counter = field(default_factory=collections.Counter)
    rounds: list[dict] = field(default_factory=list)
    accepted: list[dict] = field(default_factory=list)

    @property
    def groups(self) -> list[int]:
        return [r["group_id"] for r in self.rounds if r.get("group_id") is not None]


def _session_of(token: str) -> str | None:
    """The session id in a `collab_session` cookie value (identity.py: `<version>.<session id>.<times
    ...>.<mac>`, the id starting with SESSION_PREFIX); None if it holds none (the store's groups then
    name the session: `report`)."""
    from collab_app.web.identity import SESSION_PREFIX

    return next((p for p in token.split(".") if p.startswith(SESSION_PREFIX)), None)


def connect_identity(ident: Identity, url: str, stop: threading.Event, timeout_s: float) -> bool:
    """Give `ident` a session (the cookie of one HEAD request) and a gradio_client that keeps it;
    tries again every SESSION_RETRY_S while the server issues none. False when stopped first."""
    import httpx
    from gradio_client import Client

    headers = {"X-Forwarded-For": ident.network}
    while not stop.is_set():
        try:
            r = httpx.head(url, headers=headers, timeout=timeout_s)   # the cheapest request that gets a cookie
            token = r.cookies.get(COOKIE)
            if r.status_code in (429, 403):
                ident.refused["http_429" if r.status_code == 429 else "http_403"] += 1
            elif not token:
                ident.refused["session_refused"] += 1
            else:
                ident.client = Client(url, verbose=False, analytics_enabled=False, download_files=False,
                                      headers=headers, httpx_kwargs={"cookies": {COOKIE: token},
                                                                     "timeout": timeout_s})
                ident.session_id = _session_of(token)
                return True
        except Exception as e:  # noqa: BLE001 - a refused or failed start is counted, then tried again
            kind, _ = refusal(e)
            ident.refused[kind] += 1
            log.debug("%s: no client yet: %s", ident.name, e)
        stop.wait(SESSION_RETRY_S)
    return False


def call(ident: Identity, stop: threading.Event, timeout_s: float, tries: list[float] | None = None, **kw):
    """`predict` on the identity's client until it answers: refusals are counted and waited out as
    they say; None when stopped while waiting, or on a timeout / an answer lost three times.
    `tries`, when given, gets the time of each try."""
    from collab_app.commands.bench_online import API_RETRIES, predict

    lost = 0
    while True:
        if tries is not None:
            tries.append(time.time())
        try:
            return predict(ident.client, timeout_s=timeout_s, **kw)
        except Exception as e:  # noqa: BLE001 - every failure is a counted outcome
            kind, wait = refusal(e)
            ident.refused[kind] += 1
            if kind == "timeout":
                return None
            if kind == "lost_answer":
                lost += 1
                if lost > API_RETRIES:
                    return None
                continue
            if kind in ("error", "app_error"):
                log.warning("%s: %s: %s", ident.name, type(e).__name__, str(e)[:200])
            if stop.wait(wait):
                return None


def idle_priority() -> str:
    """Run the calling thread, and the threads it starts, under SCHED_IDLE (Linux: only when no
    other thread wants the core), else at nice 19; returns which."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))   # 0 = the calling thread on Linux
        return "SCHED_IDLE"
    except (AttributeError, OSError):
        os.nice(19 - os.nice(0))
        return "nice 19"


def rater_loop(ident: Identity, url: str, texts: list[str], stop: threading.Event, hard_stop: threading.Event,
               cfg: BenchAbuseConfig, t_origin: float) -> None:
    """Generate, (read,) rate every candidate; again until `stop`. A round started before `stop`
    is rated to the end unless `hard_stop` comes first (its ratings are part of accepted vs stored).
    An attacker's thread runs at idle priority (module doc, Limits)."""
    rate = honest_ratings if ident.side == "honest" else attacker_ratings
    if ident.side == "attacker":
        idle_priority()
    if not connect_identity(ident, url, stop, cfg.round_timeout_s):
        return
    k = int(ident.name.rsplit("-", 1)[-1])   # identities start on different texts
    while not stop.is_set():
        t0 = time.time()
        refused0 = sum(ident.refused.values())
        tries: list[float] = []
        out = call(ident, stop, cfg.round_timeout_s, tries, task=TASK, text=texts[k % len(texts)], api_name="/generate")
        t1 = time.time()
        k += 1
        rec = {"t_start": t0 - t_origin, "round_s": t1 - t0, "served_s": t1 - tries[-1] if tries else None,
               "refused": sum(ident.refused.values()) - refused0, "answered": out is not None}
        if out is None:
            if not stop.is_set():   # a timeout / lost answer: a round a person waited for in vain
                ident.rounds.append(rec)
            continue
        rec["group_id"] = out["group_id"]
        ident.rounds.append(rec)
        if ident.side == "honest" and cfg.think_s:
            time.sleep(cfg.think_s)   # reading, even past the end: its ratings are still given
        cands = out["candidates"]
        for c, value in zip(cands, rate(cands)):
            msg = call(ident, hard_stop, cfg.round_timeout_s, joint_sample_id=c["joint_sample_id"],
                       rating=value, api_name="/rate")
            m = re.match(r"rating saved: #(\d+)", msg or "")
            if m:
                ident.accepted.append({"id": int(m.group(1)), "value": float(value), "t": time.time() - t_origin})


# --------------------------------------------------------------------------- the server

def public_trainer_flags() -> list[str]:
    """The trainer flags `collab serve` gives its child on a public app and not on a loopback one
    (serve.trainer_argv: the rater and network shares of a step), so that the bench's loopback
    server trains as a public one does."""
    from collab_app.web.serve import ServeConfig, trainer_argv

    def pairs(argv):   # ["--a", "1", "--b"] -> [("--a", ["1"]), ("--b", [])]
        out = []
        for tok in argv:
            if tok.startswith("--"):
                out.append((tok, []))
            elif out:
                out[-1][1].append(tok)
        return out

    local = dict(pairs(trainer_argv(ServeConfig(host="127.0.0.1"), "/a", "/m")))
    extra = [(k, v) for k, v in pairs(trainer_argv(ServeConfig(host="0.0.0.0"), "/a", "/m")) if local.get(k) != v]
    return [tok for k, v in extra for tok in (k, *v)]


def serve_command(cfg: BenchAbuseConfig, home: str, port: int) -> list[str]:
    """`collab serve` on 127.0.0.1 with serve's own limits, the TL;DR task, G, tokens and K of the
    bench, a fresh store and adapters under `home`, and the public app's trainer shares."""
    trainer = shlex.join([*public_trainer_flags(), *shlex.split(cfg.trainer_args)])
    return [sys.executable, "-m", "collab_app.web.serve", "--host", "127.0.0.1", "--port", str(port),
            "--engine", cfg.engine, "--num-generations", str(cfg.num_generations),
            "--max-new-tokens", str(cfg.max_new_tokens), "--min-groups", str(cfg.min_groups), "--tasks", TASK,
            "--db", f"sqlite:///{home}/collab.db", "--adapters-dir", os.path.join(home, "adapters"),
            *(["--trainer-args", trainer] if trainer else []), *shlex.split(cfg.serve_args)]


def start_server(cfg: BenchAbuseConfig, home: str, port: int) -> subprocess.Popen:
    from collab_app.commands.bench_online import race_first, served_model

    race_first(served_model())
    cmd = serve_command(cfg, home, port)
    env = {**os.environ, "COLLAB_HOME": home, "GRADIO_ANALYTICS_ENABLED": "False", "COLLAB_MODEL": served_model(),
           "COLLAB_TRUSTED_PROXY_HOPS": "1"}
    env.pop("SPACE_ID", None)
    log.info("starting: %s", shlex.join(cmd))
    with open(os.path.join(home, "serve.log"), "w") as logf:
        return subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)


def wait_up(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    import httpx
    from gradio_client.utils import CONFIG_URL

    end = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"collab serve exited with code {proc.returncode}; see its log")
        try:
            if httpx.get(url + CONFIG_URL, timeout=10, headers={"X-Forwarded-For": "10.250.0.1"}).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > end:
            raise RuntimeError(f"collab serve did not answer within {timeout_s:.0f} s; see its log")
        time.sleep(0.5)


# --------------------------------------------------------------------------- reading the store

def read_store(db_url: str) -> dict:
    """Ratings (with their group), groups and train steps of the bench's store, read with SQL (the
    columns the bench needs; ratings.network / signed_in where the schema has them)."""
    import sqlalchemy as sa

    from collab_app.commands.bench_online import unix_time

    def when(v):
        from datetime import datetime
        return unix_time(v if isinstance(v, datetime) else datetime.fromisoformat(str(v)))

    engine = sa.create_engine(db_url)
    try:
        with engine.connect() as c:
            cols = {col["name"] for col in sa.inspect(c).get_columns("ratings")}
            extra = "".join(f", r.{x}" for x in ("network", "signed_in") if x in cols)
            ratings = [dict(r) for r in c.execute(sa.text(
                "SELECT r.id, r.value, r.rater, r.session_id, r.late, j.group_id" + extra +
                " FROM ratings r JOIN joint_samples j ON j.id = r.joint_sample_id")).mappings()]
            groups = [dict(g, created_at=when(g["created_at"])) for g in c.execute(sa.text(
                "SELECT id, status, trained_step, session_id, created_at FROM groups")).mappings()]
            steps = {s["step"]: when(s["created_at"]) for s in c.execute(sa.text(
                "SELECT step, created_at FROM train_steps")).mappings()}
    finally:
        engine.dispose()
    return {"ratings": ratings, "groups": groups, "steps": steps}


# --------------------------------------------------------------------------- the run

def _side_totals(idents: list[Identity], t_attack: float, t_end: float) -> dict:
    out = {}
    for side in SIDES:
        mine = [i for i in idents if i.side == side]
        refused = collections.Counter()
        for i in mine:
            refused.update(i.refused)
        rounds = [r for i in mine for r in i.rounds]
        out[side] = {"identities": len(mine), "with_session": sum(i.session_id is not None for i in mine),
                     "networks": sorted({i.network for i in mine}),
                     "rounds_quiet": sum(r["answered"] and r["t_start"] < t_attack for r in rounds),
                     "rounds_attack": sum(r["answered"] and t_attack <= r["t_start"] <= t_end for r in rounds),
                     "rounds_unanswered": sum(not r["answered"] for r in rounds),
                     "refused": {k: refused.get(k, 0) for k in REFUSALS},
                     "refused_total": sum(refused.values())}
    return out


def report(cfg: BenchAbuseConfig, idents: list[Identity], store: dict, t_origin: float,
           t_attack: float, t_end: float) -> dict:
    """The bench's result from what its identities did and what the store holds (module doc).
    Times: seconds from `t_origin` (the quiet phase's start)."""
    sides: dict[str, str] = {}
    group_side = {g: i.side for i in idents for g in i.groups}
    for i in idents:
        if i.session_id:
            sides[i.session_id] = i.side
    for g in store["groups"]:   # the session the store gave each group the bench generated
        if g["id"] in group_side and g.get("session_id"):
            sides.setdefault(g["session_id"], group_side[g["id"]])
    deciding = deciding_raters(store["ratings"])
    a0, a1 = t_origin + t_attack, t_origin + t_end
    # the target's figure: every group a step of the attack phase trained, by its deciding rater
    # (the quiet phase's backlog included: docs/BENCHES.md says why); also those generated then too
    share = trained_share(store["groups"], store["steps"], deciding, sides, a0, a1, generated_in_window=False)
    share_generated = trained_share(store["groups"], store["steps"], deciding, sides, a0, a1)
    quiet_share = trained_share(store["groups"], store["steps"], deciding, sides, t_origin, a0)
    honest_rounds = [r for i in idents if i.side == "honest" for r in i.rounds]
    latency = median_ratio([r["round_s"] for r in honest_rounds if r["t_start"] < t_attack],
                           [r["round_s"] for r in honest_rounds if t_attack <= r["t_start"] <= t_end])
    served = median_ratio([r["served_s"] for r in honest_rounds if r["t_start"] < t_attack and r.get("served_s")],
                          [r["served_s"] for r in honest_rounds if t_attack <= r["t_start"] <= t_end and r.get("served_s")])
    latency["served"] = {k: served[k] for k in ("quiet_median_s", "attack_median_s", "ratio")}
    stored = {r["id"]: float(r["value"]) for r in store["ratings"]}
    kept = {side: ratings_kept([a for i in idents if i.side == side for a in i.accepted], stored) for side in SIDES}
    lost = sum(k["lost"] for k in kept.values())
    per_side = _side_totals(idents, t_attack, t_end)
    for side in SIDES:
        per_side[side]["ratings"] = kept[side]
        per_side[side]["groups_trained_attack"] = share[side]
        per_side[side]["round_s_median"] = {
            phase: (statistics.median(xs) if xs else None) for phase, xs in (
                ("quiet", [r["round_s"] for i in idents if i.side == side for r in i.rounds if r["t_start"] < t_attack]),
                ("attack", [r["round_s"] for i in idents if i.side == side for r in i.rounds
                            if t_attack <= r["t_start"] <= t_end]))}
        if store["ratings"] and "network" in store["ratings"][0]:
            mine = {a["id"] for i in idents if i.side == side for a in i.accepted}
            per_side[side]["stored_networks"] = sorted({str(r["network"]) for r in store["ratings"] if r["id"] in mine})
    networks = cfg.honest + 1
    return {"config": asdict(cfg), "phases_s": {"quiet": [0.0, t_attack], "attack": [t_attack, t_end]},
            "public_trainer_flags": public_trainer_flags(),
            "attacker_share": share, "generated_in_attack": share_generated, "quiet_phase_trained": quiet_share,
            "honest_latency": latency, "ratings": {"accepted": sum(k["accepted"] for k in kept.values()),
                                                   "stored": sum(k["stored"] for k in kept.values()), "lost": lost},
            "sides": per_side, "train_steps": len(store["steps"]),
            "targets": targets(share["attacker_share"], latency["ratio"], lost, networks)}


def run(cfg: BenchAbuseConfig) -> dict:
    from collab_app.commands.bench_online import free_port, stop_server
    from tasks import load_task

    out_dir = os.path.abspath(cfg.out_dir)
    home = os.path.join(out_dir, "home")
    os.makedirs(home, exist_ok=False)   # a fresh store: the shares count this run only
    port = cfg.port or free_port()
    url = f"http://127.0.0.1:{port}/"
    texts = [ex["text"] for ex in load_task(TASK).examples("train")]
    honest = [Identity(f"honest-{k}", "honest", net) for k, net in enumerate(cfg.honest_networks())]
    attackers = [Identity(f"attacker-{k}", "attacker", ATTACKER_NETWORK) for k in range(cfg.attackers)]
    proc = start_server(cfg, home, port)
    stop, hard_stop = threading.Event(), threading.Event()
    threads: list[threading.Thread] = []
    error = startup_s = None
    cpu: dict[str, float] = {}
    server: dict[str, dict[str, float]] = {}
    t_origin = t_attack = t_end = time.time()
    try:
        t_up = time.time()
        wait_up(url, proc, cfg.startup_timeout_s)
        startup_s = time.time() - t_up
        os.nice(CLIENT_NICE)   # the clients below yield to the server (started at the bench's own priority)
        log.info("server up in %.0f s; quiet phase: %d honest raters for %.1f min", startup_s, cfg.honest,
                 cfg.quiet_minutes)
        t_origin = time.time()

        def launch(idents):
            for ident in idents:
                th = threading.Thread(target=rater_loop, args=(ident, url, texts, stop, hard_stop, cfg, t_origin),
                                      name=ident.name, daemon=True)
                th.start()
                threads.append(th)
        launch(honest)
        cpu0, server0 = time.process_time(), server_cpu(proc.pid)
        _sleep_watching(proc, 60 * cfg.quiet_minutes, honest)
        t_attack = time.time() - t_origin
        cpu["quiet"], server1 = time.process_time() - cpu0, server_cpu(proc.pid)
        server["quiet"] = {k: server1.get(k, 0.0) - server0.get(k, 0.0) for k in server1}
        log.info("attack phase: %d identities on %s beside the honest raters for %.1f min", cfg.attackers,
                 ATTACKER_NETWORK, cfg.minutes)
        cpu0 = time.process_time()
        launch(attackers)
        _sleep_watching(proc, 60 * cfg.minutes, honest + attackers)
        cpu["attack"], server2 = time.process_time() - cpu0, server_cpu(proc.pid)
        server["attack"] = {k: server2.get(k, 0.0) - server1.get(k, 0.0) for k in server2}
    except Exception as e:  # noqa: BLE001 - a dead server is a result too: report what came before
        error = f"{type(e).__name__}: {e}"
        log.error("bench stopped: %s", error)
    finally:
        t_end = time.time() - t_origin
        stop.set()
        log.info("stopping: waiting for the rounds in flight to be rated")
        deadline = time.monotonic() + cfg.round_timeout_s + 60
        for th in threads:
            th.join(max(0.1, deadline - time.monotonic()))
        hard_stop.set()   # ratings still waiting out a refusal give up
        for th in threads:
            th.join(1.0)
        stop_server(proc)
        for ident in honest + attackers:
            if ident.client is not None:
                try:
                    ident.client.close()
                except Exception:  # noqa: BLE001
                    pass
    store = read_store(f"sqlite:///{home}/collab.db")
    result = report(cfg, honest + attackers, store, t_origin, t_attack, t_end)
    # the bench's own clients (this process: every thread) in CPU seconds per phase and as a share of
    # the machine's cores over it: the load they put beside the server's
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    spans = {"quiet": t_attack, "attack": t_end - t_attack}
    result.update(startup_s=startup_s, error=error, loadavg_end=open("/proc/loadavg").read().split()[:3],
                  bench_clients_cpu={p: {"cpu_s": round(c, 1), "share_of_cores": round(c / (spans[p] * cores), 3)
                                         if spans[p] > 0 else None, "cores": cores} for p, c in cpu.items()},
                  # the server's processes over each phase, in cores used on average (a trainer that
                  # starves shows here: a step's work wants one of its cores whole)
                  server_cpu_cores={p: {k: round(v / spans[p], 3) for k, v in d.items()} if spans[p] > 0 else None
                                    for p, d in server.items()},
                  attacker_priority="SCHED_IDLE" if hasattr(os, "SCHED_IDLE") else "nice 19",
                  threads_still_running=sum(th.is_alive() for th in threads))
    with open(os.path.join(out_dir, "bench_abuse.json"), "w") as f:
        json.dump({**result, "rounds": {i.name: i.rounds for i in honest + attackers}}, f, indent=1)
    return result


def server_cpu(pid: int) -> dict[str, float]:
    """CPU seconds so far of `collab serve` (pid, its threads) and of its other processes, the
    trainer child among them: {"serve": s, "trainer": s, "other": s}; {} once it is gone."""
    import psutil

    out = {"serve": 0.0, "trainer": 0.0, "other": 0.0}
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return {}
    for p in procs:
        try:
            t = p.cpu_times()
            kind = "serve" if p.pid == pid else "trainer" if " trainer " in " ".join(p.cmdline()) + " " else "other"
        except psutil.Error:
            continue
        out[kind] += t.user + t.system
    return out


PROGRESS_S = 30.0   # a progress line this often while a phase runs


def _sleep_watching(proc: subprocess.Popen, seconds: float, idents: list[Identity] = ()) -> None:
    """Sleep `seconds`, raising if the server exits; a progress line per side every PROGRESS_S."""
    end = time.monotonic() + seconds
    shown = time.monotonic()
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"collab serve exited with code {proc.returncode}; see its log")
        time.sleep(min(1.0, max(0.0, end - time.monotonic())))
        if idents and time.monotonic() - shown >= PROGRESS_S:
            shown = time.monotonic()
            log.info("so far: %s", "; ".join(
                f"{side} {sum(len(i.rounds) for i in idents if i.side == side)} rounds, "
                f"{sum(len(i.accepted) for i in idents if i.side == side)} ratings, "
                f"{sum(sum(i.refused.values()) for i in idents if i.side == side)} refused"
                for side in SIDES))


def _clients_cpu(res: dict) -> str:
    c = res.get("bench_clients_cpu") or {}
    return " / ".join(f"{p} {c[p]['share_of_cores']:.0%}" for p in ("quiet", "attack")
                      if c.get(p, {}).get("share_of_cores") is not None) or "-"


def _fmt(v, nd=2) -> str:
    if v is None:
        return "-"
    return f"{v:.{nd}f}" if isinstance(v, float) else str(v)


def target_lines(targets: dict, fmt, width: int, none: str) -> list[str]:
    """A bench's targets as text: {name: {"value", "target", "pass" (True / False / None)}}, one
    line each after a "targets:" line, PASS / FAIL / `none` at the end."""
    verdicts = {True: "PASS", False: "FAIL", None: none}
    return ["targets:"] + [f"  {name:<24}{fmt(t['value']):>10}  {t['target']:<{width}} {verdicts[t['pass']]}"
                           for name, t in targets.items()]


def table(res: dict) -> str:
    """The result side by side: honest raters | attacker, then the targets."""
    h, a = res["sides"]["honest"], res["sides"]["attacker"]
    rows = [("identities (with a session)", f"{h['identities']} ({h['with_session']})",
             f"{a['identities']} ({a['with_session']})"),
            ("networks", ", ".join(h["networks"]), ", ".join(a["networks"])),
            ("rounds quiet / attack", f"{h['rounds_quiet']} / {h['rounds_attack']}", f"- / {a['rounds_attack']}"),
            ("rounds unanswered", h["rounds_unanswered"], a["rounds_unanswered"]),
            ("median round s quiet", _fmt(h["round_s_median"]["quiet"]), "-"),
            ("median round s attack", _fmt(h["round_s_median"]["attack"]), _fmt(a["round_s_median"]["attack"])),
            ("  served (last try) q / a", f"{_fmt(res['honest_latency']['served']['quiet_median_s'])} / "
             f"{_fmt(res['honest_latency']['served']['attack_median_s'])}", "-"),
            ("groups trained (attack)", h["groups_trained_attack"], a["groups_trained_attack"]),
            ("ratings accepted", h["ratings"]["accepted"], a["ratings"]["accepted"]),
            ("ratings stored", h["ratings"]["stored"], a["ratings"]["stored"]),
            ("ratings lost", h["ratings"]["lost"], a["ratings"]["lost"]),
            ("refused (all)", h["refused_total"], a["refused_total"])]
    rows += [(f"  {k}", h["refused"][k], a["refused"][k]) for k in REFUSALS if h["refused"][k] or a["refused"][k]]
    if "stored_networks" in h:
        rows.append(("networks stored on ratings", ", ".join(h["stored_networks"]), ", ".join(a["stored_networks"])))
    lines = [f"{'':<30}{'honest':>22}{'attacker':>22}"] + [f"{k:<30}{str(x):>22}{str(y):>22}" for k, x, y in rows]
    s = res["attacker_share"]
    g = res["generated_in_attack"]
    lines.append(f"groups the steps of the attack phase trained: {s['total']} (attacker {s['attacker']}, "
                 f"honest {s['honest']}, unknown {s['unknown']}); of them generated in it too: "
                 f"{g['total']} (attacker {g['attacker']}); train steps in all: {res['train_steps']}")
    lines += target_lines(res["targets"], lambda v: _fmt(v, 3), width=40, none="n/a (no figure)")
    c = res["config"]
    lines.append(f"(quiet {c['quiet_minutes']} min, attack {c['minutes']} min; G={c['num_generations']}, "
                 f"{c['max_new_tokens']} tokens, K={c['min_groups']}, engine {c['engine']}; trainer shares "
                 f"{' '.join(res['public_trainer_flags']) or 'none'}; server start {_fmt(res.get('startup_s'), 0)} s; "
                 f"the bench's clients used {_clients_cpu(res)} of the cores; "
                 f"load avg {' '.join(res.get('loadavg_end') or [])}"
                 + (f"; error: {res['error']}" if res.get("error") else "") + ")")
    return "\n".join(lines)


def cli_main(argv: list[str] | None = None) -> int:
    from trainer.configcli import parse_config

    cfg, other = parse_config(
        BenchAbuseConfig, argv, prog="collab bench abuse",
        description="One network with many identities rates a real `collab serve` (behind one trusted proxy "
                    "hop, loopback only) to push a preference, beside honest raters on other networks: the "
                    "attacker's share of trained groups, the honest raters' round latency against a quiet "
                    "phase, ratings accepted vs stored, refusals per side.",
        extra=lambda p: p.add_argument("--json", action="store_true", help="print the result as JSON"))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s bench-abuse %(levelname)s %(message)s",
                        stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)   # one line per gradio_client request otherwise
    res = run(cfg)
    print(json.dumps(res, indent=1) if other.json else table(res))
    print(f"wrote {os.path.join(os.path.abspath(cfg.out_dir), 'bench_abuse.json')}", file=sys.stderr)
    return 0 if res.get("error") is None else 1


if __name__ == "__main__":
    sys.exit(cli_main())
