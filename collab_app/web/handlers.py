"""What the Gradio app does, as plain functions: `(ctx, inputs..., state) -> outputs`.

No Gradio here (ui.py wires these to components), so they are tested without a browser and are
quick to import: no torch / vllm at import time (the engine and store arrive through `ctx`).

Per-user state is a plain dict (`new_episode()`), kept by the UI in `gr.State`, so one person's
work never reaches another session. Bad input raises `UserError` with a message saying what to
fix; ui.py shows it (gr.Error) and the app stays up.

Streaming (`generate`): the candidates' texts grow in the events as the engine writes them; the
automatic check of candidate g (all agents' sample g) starts as soon as it is complete, in a
thread pool, so checks overlap the rest of the generation; the group is stored once all G are
written and checked (ratings need its joint_sample ids). The UI shows a candidate's text and
score first and lets the person pick stars once it is checked; Submit appears when the group is
stored.

Feedback (collab_app/online/returns.py maps each form onto 1..5): stars per candidate
(`rate`, `rate_candidates`), "pick the best" (`pick_best`), a full ranking (`rank`). Who rates
is the server's business (`Caller`): the Gradio session, or the Hugging Face login on a Space,
never a typed name. A rating is accepted only from the session that generated the group, or
with the admin token. Per session or login, `ctx.max_rounds_per_minute`,
`ctx.max_ratings_per_minute` and `ctx.max_rounds_in_flight` (rounds generating at once). Ratings are append-only: re-rating adds a row, the trainer uses
each rater's latest (of any form). A person's own coding problem trains the shared team only
while an admin allows it (`set_custom_training`; the flag is returns.CUSTOM_TRAINING_KEY in the
store's app_state, obeyed by the trainer service).

Safe in public (issue 12):
- Admin (`check_admin`): the token, compared in constant time, with wrong guesses slowed per
  caller (context.AdminGuard); without a token admin actions are off, except for loopback
  clients when the app was started with `loopback_admin`. A token never makes anyone admin on an
  app that has none (it used to, on a local app).
- A person's own coding problem (their tests are code) is refused unless the sandbox allows
  untrusted code (`ctx.untrusted_allowed`), in `start_coding` and again in `generate`.
- `generate` counts each agent's prompt in tokens (the engine's tokenizer, chat template and
  role prompt included) against `max_model_len - max_new_tokens` before anything reaches the
  GenerationBatcher, so an over-long prompt fails alone with a message and never breaks a
  merged batch of other sessions.
- The Training tab's status and figures come from `training_view`, computed once per
  `ctx.shared_ttl_s` for every visitor, from column-limited queries (no token ids / log-probs).
- Export (`exported`) writes to a fresh temp dir outside COLLAB_HOME that is removed once the
  caller is done with the files (Gradio has copied them into its cache by then).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hmac
import html
import logging
import math
import os
import queue
import re
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterator

from collab_app.online.returns import PRIVATE_TASKS   # pure module: no heavy imports
from tasks.base import Turn, check_prompts, check_reward

log = logging.getLogger(__name__)

RATING_MIN, RATING_MAX = 1, 5
MAX_COMMENT_CHARS = 2_000
SOURCES = ("HumanEval problem", "My own coding problem")


class UserError(ValueError):
    """Bad input from a person; the message says what to fix. Shown in the UI, never a crash."""


# --------------------------------------------------------------------------- input checks

def clean_text(value: Any, what: str, limit: int, required: bool = True) -> str:
    """A person's text: a str, no NUL bytes / lone surrogates (binary junk), at most `limit`
    characters. Leading/trailing whitespace is kept out of the check but the text is returned
    as given (indentation of code matters)."""
    if value is None:
        value = ""
    if not isinstance(value, str):
        raise UserError(f"{what} must be text, got {type(value).__name__}")
    if "\x00" in value:
        raise UserError(f"{what} contains NUL bytes (binary data?): paste plain text")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise UserError(f"{what} is not valid Unicode text (binary data?): paste plain text") from None
    if len(value) > limit:
        raise UserError(f"{what} is {len(value):,} characters; the limit is {limit:,}. Shorten it.")
    if required and not value.strip():
        raise UserError(f"{what} is empty: type or paste something first")
    return value


ADMIN_OFF = ("admin actions are off: this app has no admin token. Set COLLAB_ADMIN_TOKEN in the server's "
             "environment and restart (make one with  python -c \"import secrets; print(secrets.token_urlsafe(32))\""
             "); on your own machine you may instead start `collab serve --loopback-admin`")
OWN_PROBLEM_OFF = (
    "**My own coding problem is off on this server.** Your tests are code, and this server's sandbox "
    "cannot isolate code a person typed ({summary}): it would run with the app's own rights. To turn it "
    "on, run the app where unprivileged user namespaces are allowed (e.g. `sysctl -w "
    "kernel.unprivileged_userns_clone=1`, `kernel.apparmor_restrict_unprivileged_userns=0`, or a "
    "container started with user namespaces), or, if only you and people you trust use it, set "
    "`COLLAB_SANDBOX_ALLOW_WEAK=1` and restart.")


def own_problem_off_message(ctx) -> str | None:
    """Why a person's own coding problem is refused here (markdown), or None when it is allowed."""
    return None if ctx.untrusted_allowed else OWN_PROBLEM_OFF.format(summary=ctx.isolation_summary)


def check_admin(ctx, token: str | None, caller: "Caller | None" = None) -> None:
    """Admin actions (edit team, pin / roll back adapters, pause training, export, rate any
    group). Allowed for a loopback caller when the app runs with `ctx.loopback_admin`; else the
    token must equal COLLAB_ADMIN_TOKEN (constant-time compare). Without COLLAB_ADMIN_TOKEN they
    are off. Wrong guesses lock out (context.AdminGuard, a doubling time) the caller's identity
    and client network (`Caller.guard_keys`: its server-issued session, never a shared proxy
    address) and the wrong token itself (the same guess from many sessions); the right token's
    own count never grows, so guesses from other sessions and networks never lock the admin out. An empty token is not a guess (a person pressed
    an admin button) and counts nothing."""
    if getattr(ctx, "loopback_admin", False) and caller is not None and caller.is_loopback:
        return
    if not ctx.admin_token:
        raise UserError(ADMIN_OFF)
    if not token:
        raise UserError("admin token missing: enter COLLAB_ADMIN_TOKEN's value in the 'admin token' box")
    import hashlib
    keys = list(caller.guard_keys) if caller is not None else ["anonymous"]
    attempt = "try:" + hashlib.sha256(str(token).encode()).hexdigest()[:24]
    wait = max(ctx.admin_guard.locked(k) for k in (*keys, attempt))
    if wait > 0:
        raise UserError(f"too many wrong admin tokens from your session or network: try again in {math.ceil(wait)} s")
    if not hmac.compare_digest(str(token).encode(), ctx.admin_token.encode()):
        lock = max(ctx.admin_guard.failed(k) for k in (*keys, attempt))
        more = f"; further tries refused for {math.ceil(lock)} s" if lock else ""
        raise UserError(f"admin token wrong: enter COLLAB_ADMIN_TOKEN's value in the 'admin token' box{more}")
    for k in keys:
        ctx.admin_guard.succeeded(k)


@dataclass(frozen=True)
class Caller:
    """Who acts, as the server knows it (ui.py fills it from gr.Request; never typed by a person)."""

    session_id: str | None
    """the server-issued session (identity.py: a signed cookie, `web:...`; the API's key id
    `api:...`): groups are stored under it. Never Gradio's session hash, which the client picks."""
    username: str | None = None
    """the Hugging Face login on a Space with OAuth (gr.Request.username), else None."""
    host: str | None = None
    """the client's address as uvicorn reports it (gr.Request.client.host), else None."""
    network: str | None = None
    """the client's network (identity.client_network: X-Forwarded-For only behind a trusted
    proxy); rounds and ratings are also counted per network. None: not counted (the API, tests)."""

    @property
    def is_loopback(self) -> bool:
        from collab_app.web.context import is_loopback
        return is_loopback(self.host)

    @property
    def guard_keys(self) -> tuple[str, ...]:
        """Whose wrong admin guesses count together: the caller's identity (server-issued session
        or login) and its client network (a new session does not reset that); the address only
        when neither is known. Never a shared proxy address alone: behind a Space's proxy every
        visitor has the same one, and a guesser would lock out the admin."""
        keys = tuple(k for k in (self.rater, f"net:{self.network}" if self.network else None) if k)
        return keys or ((f"host:{self.host}",) if self.host else ("anonymous",))

    @property
    def rater(self) -> str | None:
        """The rater id stored with a rating: hf:<login>, else session:<id>, else None."""
        if self.username:
            return f"hf:{self.username}"[:200]
        return f"session:{self.session_id}"[:200] if self.session_id else None

    @property
    def key(self) -> str:
        """Whose limits (rounds / ratings per minute) an action counts against."""
        return self.rater or "anonymous"


NO_SESSION = ("this request carries no session of this server: reload the page (or, from a script, keep the "
              "cookies the server sets, as gradio_client does). Too many new sessions from your network in "
              "the last minute also end here; wait a minute.")


def _limit(ctx, limiter, net_limiter, caller: Caller, what: str, per_minute: int, per_network: int,
           n: int = 1) -> None:
    """Count `n` events against the caller's network (when known), then its identity."""
    for lim, key, scope, most in ((net_limiter, f"net:{caller.network}", "client network", per_network),
                                  (limiter, caller.key, "session", per_minute)):
        if lim is None or (key.startswith("net:") and not caller.network):
            continue
        wait = lim.take(key, n)
        if wait is not None:
            more = "" if math.isinf(wait) else f"; try again in {max(1, math.ceil(wait))} s"
            raise UserError(f"too many {what}: at most {most} per minute per {scope}{more}")


# --------------------------------------------------------------------------- episodes

def new_episode() -> dict:
    """Per-session state (JSON-able: it lives in gr.State)."""
    return {"task": None, "example": None, "custom": None, "history": [], "group_id": None,
            "candidates": [], "turn": 0}


def task_choices(ctx) -> dict[str, list[str]]:
    from collab_app.web.context import CODING_TASKS
    return {"coding": [n for n in ctx.tasks if n in CODING_TASKS] + ["custom-coding"],
            "writing": [n for n in ctx.tasks if n not in CODING_TASKS]}


def list_examples(ctx, task_name: str, split: str) -> list[tuple[str, str]]:
    """(label, id) of a task split, for the problem dropdown."""
    if task_name not in ctx.tasks:
        raise UserError(f"unknown task {task_name!r}: pick one of {sorted(ctx.tasks)}")
    if split not in ("train", "eval"):
        raise UserError("split must be 'train' or 'eval'")
    out = []
    for ex in ctx.tasks[task_name].examples(split):
        label = ex.get("entry_point") or ex.get("title") or ""
        out.append((f"{ex['id']}  {label}".strip(), ex["id"]))
    return out


def example_preview(ctx, task_name: str, split: str, example_id: str) -> str:
    """Markdown of the chosen problem (prompt only: tests stay hidden, as in the paper)."""
    ex = _find_example(ctx, task_name, split, example_id)
    body = ex.get("prompt") or ex.get("text") or ""
    return f"**{ex['id']}**\n\n```python\n{body}\n```" if task_name == "humaneval" else body


def _find_example(ctx, task_name, split, example_id):
    if not example_id:
        raise UserError("pick a problem first")
    for ex in ctx.tasks[task_name].examples(split):
        if ex["id"] == example_id:
            return ex
    raise UserError(f"no example {example_id!r} in {task_name}/{split}")


def _custom_coding_task(custom: dict):
    from tasks.coding import CustomCodingTask
    try:
        return CustomCodingTask(custom["prompt"], custom["tests"], entry_point=custom.get("entry_point") or None)
    except (ValueError, SyntaxError) as e:
        raise UserError(f"your coding problem was not accepted: {e}") from None


def task_of(ctx, episode: dict):
    if episode["task"] == "custom-coding":
        return _custom_coding_task(episode["custom"])
    return ctx.tasks[episode["task"]]


def start_coding(ctx, source: str, split: str, example_id: str, prompt: str, tests: str,
                 entry_point: str) -> dict:
    """A new coding episode: a HumanEval problem, or the person's own problem + tests."""
    ep = new_episode()
    if source == SOURCES[0]:
        ep["task"] = "humaneval"
        ep["example"] = _find_example(ctx, "humaneval", split, example_id)
        return ep
    _check_own_problem_allowed(ctx)
    prompt = clean_text(prompt, "problem", ctx.max_prompt_chars)
    tests = clean_text(tests, "tests", ctx.max_prompt_chars)
    entry_point = clean_text(entry_point, "entry point", 200, required=False).strip()
    ep["task"] = "custom-coding"
    ep["custom"] = {"prompt": prompt, "tests": tests, "entry_point": entry_point}
    task = _custom_coding_task(ep["custom"])
    examples = task.examples("eval") or task.examples("train")
    ep["example"] = examples[0]
    return ep


def _check_own_problem_allowed(ctx) -> None:
    why = own_problem_off_message(ctx)
    if why:
        raise UserError(why.replace("**", ""))


def start_writing(ctx, task_name: str, text: str) -> dict:
    """A new writing episode on the person's pasted text."""
    if task_name not in task_choices(ctx)["writing"]:
        raise UserError(f"unknown writing task {task_name!r}: pick one of {task_choices(ctx)['writing']}")
    text = clean_text(text, "text", ctx.max_prompt_chars)
    ep = new_episode()
    ep["task"] = task_name
    try:
        ep["example"] = ctx.tasks[task_name].from_text(text)
    except ValueError as e:
        raise UserError(str(e)) from None
    return ep


def writing_examples(ctx, task_name: str) -> list[tuple[str, str]]:
    """(title, id) of a writing task's shipped texts (both splits), to start from one."""
    if task_name not in ctx.tasks:
        return []
    task = ctx.tasks[task_name]
    return [(f"{ex.get('title') or ex['id']} ({split})", ex["id"])
            for split in ("eval", "train") for ex in task.examples(split)]


def writing_example_text(ctx, task_name: str, example_id: str) -> str:
    for split in ("eval", "train"):
        for ex in ctx.tasks[task_name].examples(split):
            if ex["id"] == example_id:
                return ex["text"]
    raise UserError(f"no example {example_id!r} in {task_name}")


def sync_adapters(ctx) -> list:
    """Serve each agent's current adapter (an admin's pinned version, else the trainer's newest)
    before a generation, so new versions and rollbacks show without waiting for the serving
    process's hot-swap thread (collab_app.online.hotswap; the same watcher does the work here)."""
    return ctx.adapter_watcher().poll_once()


def _progress(msg: str) -> dict:
    return {"kind": "progress", "message": msg}


def _score(task, example, outputs) -> tuple[Any, str | None]:
    """(Reward, None), or (None, why) when the automatic check itself failed (e.g. the sandbox
    could not start): the candidate is still stored and shown, a person's rating is its return."""
    try:
        return check_reward(task, task.reward(example, outputs)), None
    except Exception as e:  # noqa: BLE001 - a broken checker must not lose the generation
        log.exception("automatic check failed")
        return None, f"{type(e).__name__}: {e}"[:500]


def _reward_dict(r) -> dict | None:
    return None if r is None else {"total": r.total, "max_total": r.max_total, "levels": dict(r.levels),
                                   "details": _jsonable(r.details)}


def _candidates(task, names, texts, done, checks, joint_ids=None) -> list[dict]:
    """The candidates as the page shows them, at any point of a round. state: "writing" (some
    agent still writes), "checking" (all written, automatic check running), "checked"."""
    G = len(texts[0])
    out = []
    for g in range(G):
        written = all(done[a][g] is not None for a in range(len(names)))
        r, err = checks.get(g, (None, None))
        out.append({
            "joint_sample_id": None if joint_ids is None else joint_ids[g],
            "state": "checked" if g in checks else "checking" if written else "writing",
            "parts": [{"role": task.roles[a], "agent": names[a], "text": texts[a][g],
                       "adapter_version": None if done[a][g] is None else done[a][g].adapter_version,
                       "done": done[a][g] is not None} for a in range(len(names))],
            "combined": None, "reward": _reward_dict(r), "check_error": err,
            "outputs": [texts[a][g] for a in range(len(names))],
        })
    return out


def generate(ctx, episode: dict, caller: Caller, tick_s: float = 1.0,
             min_update_s: float = 0.1) -> Iterator[dict]:
    """One round of the team on the episode, streamed. Yields {"kind": "progress", "message",
    "candidates"} events (candidates as in `_candidates`, without joint_sample ids): when a
    candidate is written or checked, when text grew (at most one per `min_update_s`: an engine
    may snapshot every few ms, a page needs no more than ~10 updates a second), and every
    `tick_s` while nothing happens (the elapsed time); and finally
    {"kind": "done", "episode": new_state, "message"}. The group (G joint answers, automatic
    rewards) is stored before "done", so every candidate in it can be rated.

    The engine call runs in the batcher's thread (merged with other sessions' requests, under
    `ctx.engine_lock`); this generator only reads its ticket's queue, because Gradio may
    resume a generator on a different thread (a lock must not span yields). Checks run in a
    pool of this round (sandboxed subprocesses: threads only wait on them)."""
    if not episode or not episode.get("task"):
        raise UserError("choose a task and press Generate")
    if not caller.session_id:
        raise UserError(NO_SESSION)           # its group could never be rated, and limits need a key
    if episode["task"] in PRIVATE_TASKS:
        _check_own_problem_allowed(ctx)      # also here: not only the page hides it
    task = task_of(ctx, episode)
    example = episode["example"]
    history = [Turn(tuple(o), tuple(f)) for o, f in episode["history"]]
    prompts = check_prompts(task, task.agent_prompts(example, history))
    team = ctx.team_for(episode["task"])
    G, sampling = ctx.num_generations, ctx.sampling
    check_prompt_tokens(ctx, team, prompts, sampling, later_turn=bool(history))
    if not ctx.round_slots.acquire(caller.key):
        raise UserError(f"you already have a round generating: wait for your round to finish (at most "
                        f"{ctx.max_rounds_in_flight} at once per session)")
    try:
        _limit(ctx, ctx.round_limiter, getattr(ctx, "round_net_limiter", None), caller, "rounds",
               ctx.max_rounds_per_minute, getattr(ctx, "max_rounds_per_minute_per_network", 0))
        yield from _round(ctx, episode, caller, task, example, history, prompts, team, G, sampling,
                          tick_s, min_update_s)
    finally:
        ctx.round_slots.release(caller.key)


def check_prompt_tokens(ctx, team, prompts: list[str], sampling, later_turn: bool = False) -> None:
    """Each agent's prompt, as the engine will see it, must fit: tokens + max_new_tokens <=
    max_model_len. Checked here, before the batcher, so that a too-long prompt fails alone with
    a message instead of failing (and restarting) a batch merged with other sessions. Engines
    without a local tokenizer are left to their own check."""
    from collab_app.engines.engine_types import Request
    reqs = [Request(a.name, p, a.role_prompt) for a, p in zip(team.agents, prompts)]
    counts = ctx.prompt_token_counts(reqs)
    if counts is None:
        return
    room = ctx.engine.max_model_len - sampling.max_new_tokens
    for agent, n in zip(team.agents, counts):
        if n > room:
            fix = ("start a new problem (each round adds the last answers and feedback to the prompt)"
                   if later_turn else "shorten your text")
            raise UserError(f"too long for this engine: the prompt for `{agent.name}` is {n:,} tokens, and "
                            f"it takes at most {room:,} ({ctx.engine.max_model_len:,} in all, minus "
                            f"{sampling.max_new_tokens:,} for the answer); {fix}")


def _round(ctx, episode, caller, task, example, history, prompts, team, G, sampling, tick_s, min_update_s):
    names = [a.name for a in team.agents]
    from collab_app.engines.engine_types import EngineError
    t0 = time.monotonic()
    ticket = ctx.batcher().submit(team, prompts, G, sampling)   # merged with other sessions' requests
    texts = [[""] * G for _ in names]
    done: list[list[Any]] = [[None] * G for _ in names]
    samples = None                           # [agent][g], once the engine finished
    checks: dict[int, tuple[Any, str | None]] = {}
    started: set[int] = set()
    check = "running tests" if "tests" in task.level_names else "scoring"
    pool = ThreadPoolExecutor(G, thread_name_prefix="collab-check")   # one per candidate: checks are
    # sandboxed subprocesses (coding) or light Python (writing), G <= ctx.max_generations

    def start_check(g: int) -> None:
        outs = [done[a][g].text for a in range(len(names))]
        fut = pool.submit(_score, task, example, outs)
        fut.add_done_callback(lambda f, g=g: None if f.cancelled() else ticket.events.put(("checked", g, f.result())))
        started.add(g)

    last_yield, grew = -math.inf, False    # grew: text changed since the last yield
    try:
        while samples is None or len(checks) < G:
            wait = tick_s if not grew else max(0.0, last_yield + min_update_s - time.monotonic())
            evs: list = []
            try:
                evs.append(ticket.events.get(timeout=wait))
                while True:
                    evs.append(ticket.events.get_nowait())
            except queue.Empty:
                pass
            milestone = False                  # a candidate written or checked, or the engine done
            for ev in evs:
                if ev[0] == "progress":
                    grew = grew or ev[1] != texts
                    texts, done = ev[1], ev[2]
                elif ev[0] == "done":
                    samples = done = ev[1]
                    texts = [[s.text for s in row] for row in samples]
                    milestone = True
                elif ev[0] == "checked":
                    checks[ev[1]] = ev[2]
                    milestone = True
                elif ev[0] == "error":
                    if isinstance(ev[1], EngineError):
                        raise UserError(f"the engine refused this prompt: {ev[1]}") from None
                    raise ev[1]
            for g in range(G):
                if g not in started and all(done[a][g] is not None for a in range(len(names))):
                    start_check(g)
                    milestone = True
            now = time.monotonic()
            if not (milestone or not evs or now - last_yield >= min_update_s):
                continue                       # text grew again within min_update_s: send it later
            last_yield, grew = now, False
            dt = now - t0
            if samples is None:
                written = sum(all(done[a][g] is not None for a in range(len(names))) for g in range(G))
                msg = (f"generating {G} joint answers (agents: {', '.join(names)}) ... {dt:.0f} s; "
                       f"{written}/{G} written, {len(checks)} checked")
            else:
                msg = f"generated in {dt:.1f} s; {check}: {len(checks)}/{G} checked ..."
            yield {"kind": "progress", "message": msg, "candidates": _candidates(task, names, texts, done, checks)}
    finally:
        ticket.cancel()                      # a closed page stops feeding (and, if alone, the engine)
        pool.shutdown(wait=False, cancel_futures=True)
    outputs = [[samples[a][g].text for a in range(len(names))] for g in range(G)]
    rewards = [checks[g][0] for g in range(G)]
    errors = [checks[g][1] for g in range(G)]
    joint = [tuple(g for _ in names) for g in range(G)]   # aligned joint actions
    combined = [task.combine(example, outs) for outs in outputs]
    group_id, joint_ids = ctx.store.add_group(
        task=episode["task"], example=example, prompts=prompts, samples=samples, joint=joint,
        auto_rewards=rewards, session_id=caller.session_id, combined=combined, auto_errors=errors,
        turn=len(history), max_reward=task.max_reward)
    candidates = _candidates(task, names, texts, samples, checks, joint_ids)
    for c, comb in zip(candidates, combined):
        c["combined"] = comb
    ep = dict(episode, group_id=group_id, candidates=candidates, turn=episode["turn"] + 1)
    note = ""
    if episode["task"] in PRIVATE_TASKS and not custom_training_allowed(ctx):
        note = " Your own problem's groups are kept but train the shared team only if an admin allows it."
    yield {"kind": "done", "episode": ep,
           "message": f"group #{group_id}: {G} candidates in {time.monotonic() - t0:.1f} s "
                      f"(turn {ep['turn']}). Rate them below.{note}"}


def run_generate(ctx, episode: dict, caller: Caller) -> dict:
    """`generate` to the end (API endpoint, tests): its "done" event."""
    for ev in generate(ctx, episode, caller):
        if ev["kind"] == "done":
            return ev
    raise RuntimeError("generate ended without a result")


def another_round(ctx, episode: dict, continue_from: int | None) -> dict:
    """Multi-turn: the chosen candidate's outputs + Task.feedback become the history of the next
    turn (the default is the candidate with the best automatic reward)."""
    cands = episode.get("candidates") or []
    if not cands:
        raise UserError("generate a first round before asking for another one")
    if continue_from is None:
        continue_from = max(range(len(cands)), key=lambda i: (cands[i]["reward"] or {}).get("total", -math.inf))
    if not 0 <= continue_from < len(cands):
        raise UserError(f"candidate {continue_from + 1} does not exist (1..{len(cands)})")
    task = task_of(ctx, episode)
    outs = cands[continue_from]["outputs"]
    feedback = task.feedback(episode["example"], outs)
    history = list(episode["history"]) + [[list(outs), list(feedback)]]
    return dict(episode, history=history, candidates=[], group_id=None)


def _jsonable(x, depth=0):
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x if not isinstance(x, str) else x[:2000]
    if depth > 3:
        return str(x)[:500]
    if isinstance(x, dict):
        return {str(k): _jsonable(v, depth + 1) for k, v in list(x.items())[:50]}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v, depth + 1) for v in list(x)[:50]]
    return str(x)[:500]


# --------------------------------------------------------------------------- rendering

def _version(v) -> str:
    return "base model" if v is None else f"adapter v{v}"


def render_candidate(cand: dict, index: int, coding: bool) -> str:
    """Markdown of one candidate: who wrote which part, adapter versions, automatic checks; while
    it is still being written or checked, the text so far and that state."""
    r, state = cand["reward"], cand.get("state", "checked")
    if state == "writing":
        score = "writing …"
    elif state == "checking":
        score = "written; automatic check running …"
    else:
        score = "automatic check failed" if r is None else f"{r['total']:.2f} / {r['max_total']:.1f}"
    sub = (f"joint sample #{cand['joint_sample_id']}" if cand.get("joint_sample_id") is not None
           else "rating opens when all candidates are written and checked" if state == "checked"
           else "")
    lines = [f"### Candidate {index + 1} — {score}", f"<sub>{sub}</sub>" if sub else "", ""]
    for part in cand["parts"]:
        who = f"**{part['role']}** · agent `{part['agent']}`"
        if part.get("done", True):
            lines.append(f"{who} · {_version(part['adapter_version'])}")
        else:
            lines.append(f"{who} · writing …")
        if coding:
            # the agent's raw answer (markdown fences included): a fence longer than any run of
            # backticks inside it keeps it one verbatim code block
            fence = "`" * max(3, 1 + max((len(m) for m in re.findall(r"`+", part["text"])), default=0))
            lines += [fence + "python", part["text"], fence]
        else:
            quoted = html.escape(part["text"]).strip() or "(empty)"
            lines += ["> " + q for q in quoted.splitlines()]
        lines.append("")
    if state != "checked":
        return "\n".join(lines)
    if r is None:
        lines.append(f"**Automatic checks** failed: {html.escape(cand.get('check_error') or '?')} "
                     "(your rating is this candidate's only reward)")
        return "\n".join(lines)
    lines.append("**Automatic checks**: " + " · ".join(
        f"{k} {v:+.2f}" for k, v in r["levels"].items()))
    lines += [f"- {html.escape(x)}" for x in check_summary(r.get("details") or {})]
    return "\n".join(lines)


def check_summary(details: dict, limit: int = 400) -> list[str]:
    """Readable lines from a Reward's details: tests passed, the first failing test and its
    error, syntax errors, where scoring stopped; other truthy entries as `key: value`."""
    d = dict(details)
    out = []
    if "tests_total" in d:
        out.append(f"tests passed: {d.pop('tests_passed', '?')}/{d.pop('tests_total')}")
    ff = d.pop("first_failure", None)
    if isinstance(ff, dict):
        out.append(f"first failing test: {str(ff.get('test', '')).strip()[:limit]} -> "
                   f"{str(ff.get('error', '')).strip()[:limit]}")
    for key, label in (("stopped_at", "scoring stopped at"), ("syntax_error", "syntax error"),
                       ("setup_error", "failed before any test ran"), ("killed_by", "killed by")):
        v = d.pop(key, None)
        if v:
            out.append(f"{label}: {str(v).strip()[:limit]}")
    if d.pop("timed_out", False):
        out.append("timed out")
    d.pop("harness_ok", None)
    for k, v in d.items():
        if v in (None, False, "", [], {}):
            continue
        text = v if isinstance(v, str) else repr(v)
        out.append(f"{k}: {text[:limit]}{' …' if len(text) > limit else ''}")
    return out


# --------------------------------------------------------------------------- rating

def parse_rating(value: Any) -> int:
    if isinstance(value, bool):
        raise UserError("a rating is a whole number from 1 to 5")
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise UserError(f"a rating is a whole number from 1 to 5, got {value!r:.40}") from None
    if not math.isfinite(f) or f != int(f) or not RATING_MIN <= f <= RATING_MAX:
        raise UserError(f"a rating is a whole number from 1 to 5, got {value!r:.40}")
    return int(f)


def _rating_session(ctx, caller: Caller, token: str | None) -> str | None:
    """The session whose groups this caller may rate (add_ratings checks it), or None when a
    (valid) admin token lets it rate any group. A wrong token is an error, not a fallback."""
    if token:
        check_admin(ctx, token, caller)   # a wrong token is an error, never a fallback to the session
        return None
    if not caller.session_id:
        raise UserError("this request carries no session, so it cannot be matched to the group it "
                        "generated: rate from the page or from the gradio_client that generated it. "
                        + NO_SESSION)
    return caller.session_id


def _store_ratings(ctx, caller: Caller, token, items: list[tuple[int, float]], comment: Any, kind: str,
                   details: list | None = None) -> list[int]:
    """Checks (comment, entitlement, rater id, rate limit), then one all-or-nothing store write."""
    comment = clean_text(comment, "comment", MAX_COMMENT_CHARS, required=False)
    session = _rating_session(ctx, caller, token)
    rater = caller.rater or "admin"        # no session only with the admin token
    _limit(ctx, ctx.rating_limiter, getattr(ctx, "rating_net_limiter", None), caller, "ratings",
           ctx.max_ratings_per_minute, getattr(ctx, "max_ratings_per_minute_per_network", 0), len(items))
    from collab_app.online.store import NotEntitled
    try:
        return ctx.store.add_ratings(items, rater, comment, kind=kind, details=details, session_id=session)
    except NotEntitled as e:
        raise UserError(f"rating not saved: {e}") from None
    except (ValueError, LookupError, KeyError) as e:
        raise UserError(f"rating not saved: {e}") from None


def _joint_id(joint_sample_id: Any) -> int:
    if isinstance(joint_sample_id, bool):
        raise UserError("joint sample id must be a number")
    try:
        return int(joint_sample_id)
    except (TypeError, ValueError):
        raise UserError(f"joint sample id must be a number, got {joint_sample_id!r:.40}") from None


def rate(ctx, joint_sample_id: Any, value: Any, caller: Caller, comment: str = "", token: str = "") -> int:
    """Store one 1-5 rating of a joint sample this caller's session generated (or any, with the
    admin token); returns its id. Bad value / unknown sample / other session -> UserError."""
    value = parse_rating(value)
    return _store_ratings(ctx, caller, token, [(_joint_id(joint_sample_id), value)], comment, "stars")[0]


def rate_candidates(ctx, episode: dict, values: list, caller: Caller, comment: str = "") -> str:
    """The UI's Submit: rate this session's candidates (None = not rated), all in one write.
    Returns the message."""
    cands = _stored_candidates(episode)
    chosen = [(i, v) for i, v in enumerate(values[:len(cands)]) if v not in (None, "")]
    if not chosen:
        raise UserError("pick 1-5 for at least one candidate, then Submit")
    parsed = [(i, parse_rating(v)) for i, v in chosen]   # all valid before any is stored
    ids = _store_ratings(ctx, caller, "", [(cands[i]["joint_sample_id"], v) for i, v in parsed], comment, "stars")
    return "rating saved: " + ", ".join(f"#{rid} (candidate {i + 1}: {v}/5)"
                                         for rid, (i, v) in zip(ids, parsed)) + f" as {caller.rater}"


def _stored_candidates(episode: dict) -> list[dict]:
    cands = (episode or {}).get("candidates") or []
    if not cands or any(c.get("joint_sample_id") is None for c in cands):
        raise UserError("nothing to rate yet: generate first (and wait until the candidates are stored)")
    return cands


def _group_for_feedback(ctx, group_id: Any, caller: Caller, token: str):
    from collab_app.online.store import NotFound
    if group_id in (None, ""):
        raise UserError("nothing to rate yet: generate first (and wait until the candidates are stored)")
    session = _rating_session(ctx, caller, token)
    try:
        grp = ctx.store.group(_joint_id(group_id))
    except NotFound as e:
        raise UserError(f"feedback not saved: {e}") from None
    if session is not None and grp.session_id != session:
        raise UserError(f"feedback not saved: group #{grp.id} was generated by another session; you can "
                        "rate only the candidates your own session generated (or give the admin token)")
    return grp


def _int_or_none(v: Any, what: str) -> int | None:
    if v in (None, ""):
        return None
    if isinstance(v, bool):
        raise UserError(f"{what} must be a whole number")
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise UserError(f"{what} must be a whole number, got {v!r:.40}") from None
    if not math.isfinite(f) or f != int(f):
        raise UserError(f"{what} must be a whole number, got {v!r:.40}")
    return int(f)


def rank(ctx, group_id: Any, ranks: Any, caller: Caller, comment: str = "", token: str = "") -> str:
    """A full ranking of a group's candidates: `ranks[k]` = the rank (1 = best) of candidate
    k + 1, a permutation of 1..G. Stored as one "rank" rating per candidate (returns.py maps
    rank r of G to 5 - 4 (r - 1) / (G - 1)). Duplicates, missing, out of range -> UserError."""
    from collab_app.online.returns import FeedbackError, ranking_ratings
    grp = _group_for_feedback(ctx, group_id, caller, token)
    K = len(grp.joints)
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, (list, tuple)):
        raise UserError(f"a ranking is a list of {K} ranks (1 = best), one per candidate")
    parsed = [_int_or_none(r, f"the rank of candidate {k + 1}") for k, r in enumerate(ranks)]
    missing = [k + 1 for k, r in enumerate(parsed) if r is None]
    if missing:
        raise UserError(f"candidate {', '.join(map(str, missing))} has no rank: rank all {K} candidates")
    try:
        values = ranking_ratings(parsed, K)
    except FeedbackError as e:
        raise UserError(f"ranking not saved: {e}") from None
    ids = _store_ratings(ctx, caller, token, [(j.id, v) for j, v in zip(grp.joints, values)], comment, "rank",
                         [{"rank": r, "of": K} for r in parsed])
    order = sorted(range(K), key=lambda k: parsed[k])
    return (f"ranking saved: #{ids[0]}..#{ids[-1]} (best first: "
            f"{' > '.join(f'candidate {k + 1}' for k in order)}) as {caller.rater or 'admin'}")


def pick_best(ctx, group_id: Any, best: Any, caller: Caller, comment: str = "", token: str = "") -> str:
    """"Pick the best": candidate `best` (1-based) of a group is the best one. Stored as one
    "pick_best" rating per candidate (best 5, the others 1; returns.py)."""
    from collab_app.online.returns import FeedbackError, pick_best_ratings
    grp = _group_for_feedback(ctx, group_id, caller, token)
    K = len(grp.joints)
    b = _int_or_none(best, "the best candidate")
    if b is None:
        raise UserError(f"pick the best candidate (1..{K}) first")
    try:
        values = pick_best_ratings(b - 1, K)
    except FeedbackError as e:
        raise UserError(f"pick not saved: {e}") from None
    ids = _store_ratings(ctx, caller, token, [(j.id, v) for j, v in zip(grp.joints, values)], comment,
                         "pick_best", [{"best": k == b - 1, "of": K} for k in range(K)])
    return f"pick saved: #{ids[0]}..#{ids[-1]} (candidate {b} is the best of {K}) as {caller.rater or 'admin'}"


def custom_training_allowed(ctx) -> bool:
    from collab_app.online.returns import CUSTOM_TRAINING_KEY, may_train_shared
    return may_train_shared(PRIVATE_TASKS[0], ctx.store.get_state(CUSTOM_TRAINING_KEY))


def set_custom_training(ctx, token: str, allowed: bool, caller: Caller | None = None) -> str:
    """Admin: whether groups of people's own coding problems ("custom-coding") train the shared
    team (their tests are the reward, so a person could steer it). Stored in app_state under
    returns.CUSTOM_TRAINING_KEY; the trainer service reads it before choosing groups."""
    check_admin(ctx, token, caller)
    from collab_app.online.returns import CUSTOM_TRAINING_KEY
    ctx.store.set_state(CUSTOM_TRAINING_KEY, {"allowed": bool(allowed), "by": "app", "at": time.time()})
    ctx.shared_views.clear()
    return ("people's own coding problems now train the shared team" if allowed
            else "people's own coding problems no longer train the shared team (they are still stored)")


# --------------------------------------------------------------------------- team tab

def team_overview(ctx) -> str:
    """Markdown: base model, engine, G, sampling, and per task its agents with roles, role
    prompts and the adapter version each serves (pinned marked)."""
    eng, smp = ctx.engine, ctx.sampling
    current = ctx.store.current_adapter_versions()
    pinned = {a for a in ctx.agent_names() if any(v.pinned for v in ctx.store.adapter_versions(a))}
    lines = [f"**base model** `{os.path.basename(str(getattr(eng, 'model_path', '?')).rstrip('/'))}` · "
             f"**engine** `{getattr(eng, 'name', type(eng).__name__)}` · **G** = {ctx.num_generations} · "
             f"temperature {smp.temperature} · top-p {smp.top_p} · max new tokens {smp.max_new_tokens}", "",
             "| task | agent (role) | role prompt | serving | newest stored |", "|---|---|---|---|---|"]
    for task_name, team in ctx.teams.items():
        for agent in team.agents:
            served = ctx.engine.adapter_version(agent.name)
            cur = current.get(agent.name)
            prompt = html.escape(agent.role_prompt.strip().replace("\n", " ")[:120]) or "—"
            pin = " (pinned)" if agent.name in pinned else ""
            newest = f"v{cur[0]}{pin}" if cur else "none yet"
            lines.append(f"| {task_name} | `{agent.name}` | {prompt} | {_version(served)} | {newest} |")
    return "\n".join(lines)


def agent_choices(ctx) -> list[str]:
    return ctx.agent_names()


def _agent(ctx, name: str):
    for team in ctx.teams.values():
        for a in team.agents:
            if a.name == name:
                return a
    raise UserError(f"unknown agent {name!r}: pick one of {ctx.agent_names()}")


def role_prompt(ctx, agent: str) -> str:
    return _agent(ctx, agent).role_prompt if agent else ""


def set_role_prompt(ctx, token: str, agent: str, prompt: str, caller: Caller | None = None) -> str:
    """Admin: change an agent's role (system) prompt in every team it belongs to. Takes effect
    on the next generation; in memory only (serve's settings decide the prompt at start)."""
    check_admin(ctx, token, caller)
    _agent(ctx, agent)
    prompt = clean_text(prompt, "role prompt", ctx.max_prompt_chars, required=False)
    with ctx.team_settings_lock:
        for team in ctx.teams.values():
            team.agents = [dataclasses.replace(a, role_prompt=prompt) if a.name == agent else a
                           for a in team.agents]
    return f"role prompt of `{agent}` saved ({len(prompt)} characters)"


def set_generation_settings(ctx, token: str, num_generations: Any, temperature: Any, top_p: Any,
                            max_new_tokens: Any, caller: Caller | None = None) -> str:
    """Admin: G and sampling for the next generations (every session)."""
    check_admin(ctx, token, caller)
    from collab_app.engines.engine_types import EngineError, Sampling
    try:
        G = int(num_generations)
        sampling = Sampling(max_new_tokens=int(max_new_tokens), temperature=float(temperature),
                            top_p=float(top_p), seed=ctx.sampling.seed)
    except (TypeError, ValueError, EngineError) as e:
        raise UserError(f"generation settings not applied: {e}") from None
    if not 2 <= G <= ctx.max_generations:
        raise UserError(f"number of generations must be 2..{ctx.max_generations} (MAGRPO needs >= 2 "
                        "siblings; the page lays out at most that many)")
    if sampling.max_new_tokens > 4096:
        raise UserError("max new tokens must be at most 4096")
    with ctx.team_settings_lock:
        ctx.num_generations, ctx.sampling = G, sampling
    return (f"applied: G = {G}, temperature {sampling.temperature}, top-p {sampling.top_p}, "
            f"max new tokens {sampling.max_new_tokens}")


def adapter_table(ctx, agent: str) -> list[list]:
    """Rows (newest first): version, step, created, pinned, serving now, path."""
    if not agent:
        return []
    served = ctx.engine.adapter_version(agent)
    rows = []
    for v in reversed(ctx.store.adapter_versions(agent)):
        rows.append([v.version, v.step if v.step is not None else "", v.created_at.strftime("%Y-%m-%d %H:%M:%S"),
                     "yes" if v.pinned else "", "yes" if v.version == served else "", v.path])
    return rows


ADAPTER_HEADERS = ["version", "step", "created (UTC)", "pinned", "serving", "path"]


def _pin(ctx, agent: str, version: int | None) -> str:
    """Record the pin, then load it now unless a round is generating: a batch holds
    `ctx.engine_lock` for its whole stream and finishes on the versions it started with, so an
    admin would wait for it (with a full queue, for every round in it). The store's pin is what
    counts: the next batch loads it before it starts (GenerationBatcher polls the watcher first).
    Returns the served-version clause of the admin's message."""
    try:
        ctx.store.pin_adapter(agent, version)
    except (ValueError, LookupError) as e:
        raise UserError(str(e)) from None
    lock = ctx.engine_lock
    if not lock.acquire(blocking=False):
        return (f"a round is generating now on {_version(ctx.engine.adapter_version(agent))}: "
                "the next round is served by the new choice")
    try:
        sync_adapters(ctx)
    finally:
        lock.release()
    return f"now serving {_version(ctx.engine.adapter_version(agent))}"


def pin_adapter(ctx, token: str, agent: str, version: Any, caller: Caller | None = None) -> str:
    """Admin: serve `version` of `agent` from now on, whatever the trainer writes next."""
    check_admin(ctx, token, caller)
    _agent(ctx, agent)
    try:
        v = int(version)
    except (TypeError, ValueError):
        raise UserError("enter the version number to pin") from None
    return f"`{agent}` pinned to adapter v{v}; " + _pin(ctx, agent, v)


def roll_back(ctx, token: str, agent: str, caller: Caller | None = None) -> str:
    """Admin: pin the version before the one served now."""
    check_admin(ctx, token, caller)
    _agent(ctx, agent)
    served = ctx.engine.adapter_version(agent)
    older = [v.version for v in ctx.store.adapter_versions(agent) if served is None or v.version < served]
    if served is None or not older:
        raise UserError(f"`{agent}` serves {_version(served)}: there is no older version to roll back to")
    served_now = _pin(ctx, agent, max(older))
    return (f"`{agent}` rolled back to adapter v{max(older)} (pinned; unpin to follow the trainer again); "
            + served_now)


def unpin_adapter(ctx, token: str, agent: str, caller: Caller | None = None) -> str:
    check_admin(ctx, token, caller)
    _agent(ctx, agent)
    return f"`{agent}` follows the trainer's newest version again; " + _pin(ctx, agent, None)


# --------------------------------------------------------------------------- training tab

def training_status(ctx) -> str:
    """Markdown: the trainer service's state (from its heartbeat row in the store), the pause
    flag, groups waiting, and the last step's return."""
    from collab_app.online.service import is_paused, read_status
    st = read_status(ctx.store)
    counts = ctx.store.stats()["groups"]
    steps = ctx.store.train_steps(last=1)
    if st.get("state") == "not started":
        state = "no trainer service has reported to this store yet (`collab serve` starts one; or `collab trainer`)"
    elif not st["alive"] and st.get("state") != "stopped":
        ago = time.time() - float(st.get("heartbeat") or 0)
        state = f"not running (no heartbeat for {ago:.0f} s; last state: {st.get('state', '?')})"
    else:
        state = str(st.get("state", "?"))
        if st.get("step") is not None:
            state += f" · step {st['step']}"
        if st.get("task"):
            state += f" · task {st['task']}"
        if st.get("message"):
            state += f" · {html.escape(str(st['message']))[:200]}"
    last = ""
    if steps:
        m = steps[-1]["metrics"]
        last = (f"\n\n**last step** {steps[-1]['step']} at {steps[-1]['created_at']:%H:%M:%S} UTC: "
                f"return {m.get('return_mean', math.nan):.3f} over {m.get('groups', '?')} groups, "
                f"zero-variance {m.get('zero_variance_frac', math.nan):.0%}")
    own = ("train the shared team (admin allowed)" if custom_training_allowed(ctx)
           else "kept, not trained on (an admin may allow it)")
    return (f"**trainer**: {state}{' · pause requested' if is_paused(ctx.store) else ''}\n\n"
            f"**people's own coding problems**: {own}\n\n"
            f"**groups waiting**: {counts['ready']} ready, {counts['open']} still collecting ratings · "
            f"{counts['trained']} trained · {counts['expired']} expired{last}")


def set_training_paused(ctx, token: str, paused: bool, caller: Caller | None = None) -> str:
    """Admin: ask the trainer service to pause (after its current step) or resume; the flag is
    in the store, so an external `collab trainer` on the same store obeys it too."""
    check_admin(ctx, token, caller)
    from collab_app.online.service import set_paused
    set_paused(ctx.store, bool(paused), by="app")
    ctx.shared_views.clear()
    return ("pause requested: the trainer stops after its current step" if paused
            else "resume requested: the trainer continues with the next ready groups")


def human_vs_auto(ctx, n_groups: int = 200) -> list[tuple[float, float]]:
    """(automatic total, human score on the same scale) for rated joint samples of recent groups.
    Reads only those columns (`Store.rated_joints`): no texts, token ids or log-probs."""
    from collab_app.online.returns import human_score
    pairs = []
    for auto, max_reward, ratings in ctx.store.rated_joints(n_groups):
        if auto is not None and ratings:
            h = human_score(list(ratings), max_reward)
            if h is not None:
                pairs.append((auto, h))
    return pairs


def training_view(ctx, render: Any = None) -> tuple:
    """What the Training tab shows, (status markdown, levels figure, signal figure), the same
    for every visitor: computed at most once per `ctx.shared_ttl_s` (ctx.shared_views), however
    many pages poll. `render(fig)` turns a figure into what is sent (ui.py: gr.Plot's own
    postprocess, so the PNG is also encoded once); None keeps the matplotlib figures."""
    def compute():
        figs = training_figures(ctx)
        if render is not None:
            figs = tuple(None if f is None else render(f) for f in figs)
        return (training_status(ctx), *figs)
    return ctx.shared_views.get(("training", render), compute)


def training_figures(ctx, last: int = 500):
    """Two matplotlib figures (None where there is nothing to plot yet):
    - return and each reward level over steps (collab_app.web.plots.summary_figure, as `collab train`);
    - learning signal: the fraction of zero-variance groups per step (advantage 0: nothing to
      learn from) and human vs automatic reward of the rated joint answers."""
    from matplotlib.figure import Figure   # no pyplot: no global backend, thread-safe enough

    from collab_app.web.plots import summary_figure
    steps = ctx.store.train_steps(last=last)
    records = [{**s["metrics"], "step": s["step"], "kind": "train"} for s in steps]
    levels = summary_figure(records, smooth=3) if records else None
    pairs = human_vs_auto(ctx)
    if not records and not pairs:
        return levels, None
    fig = Figure(figsize=(9, 3.0), layout="constrained")
    ax1, ax2 = fig.subplots(1, 2)
    zv = [(r["step"], r["zero_variance_frac"]) for r in records
          if isinstance(r.get("zero_variance_frac"), (int, float)) and not math.isnan(r["zero_variance_frac"])]
    if zv:
        ax1.plot([p[0] for p in zv], [p[1] for p in zv], marker=".", color="tab:red")
    ax1.set(title="zero-variance groups (no learning signal)", xlabel="step", ylim=(-0.05, 1.05))
    if pairs:
        ax2.scatter([p[0] for p in pairs], [p[1] for p in pairs], s=14, alpha=0.6)
        hi = max(max(p) for p in pairs) or 1.0
        ax2.plot([0, hi], [0, hi], ls="--", color="grey", lw=0.8)
    ax2.set(title=f"human vs automatic reward ({len(pairs)} rated)", xlabel="automatic total",
            ylabel="human score (same scale)")
    return levels, fig


# --------------------------------------------------------------------------- data tab

def stats_dict(ctx) -> dict:
    return ctx.store.stats()


def data_stats(ctx) -> str:
    s = ctx.store.stats()
    g = s["groups"]
    return (f"**groups** {sum(g.values())} ({', '.join(f'{k} {v}' for k, v in g.items())}) · "
            f"**joint answers** {s['joint_samples']} · **samples** {s['samples']} · "
            f"**ratings** {s['ratings']} by {s['raters']} raters · **adapter versions** "
            f"{s['adapter_versions']} · **train steps** {s['train_steps']}")


GROUP_HEADERS = ["group", "created (UTC)", "task", "example", "turn", "status", "auto totals", "ratings"]


def recent_groups_table(ctx, session_id: str | None, all_sessions: bool = False, token: str = "",
                        n: int = 30, caller: Caller | None = None) -> list[list]:
    """Rows of the newest groups: this session's only, unless an admin asks for everyone's."""
    if all_sessions:
        check_admin(ctx, token, caller)
        groups = ctx.store.recent_groups(n)
    elif session_id is None:
        return []
    else:
        groups = ctx.store.recent_groups(n, session_id=session_id)
    rows = []
    for g in groups:
        autos = ", ".join("—" if j.auto_total is None else f"{j.auto_total:.2f}" for j in g.joints)
        rows.append([g.id, g.created_at.strftime("%Y-%m-%d %H:%M:%S"), g.task, g.example_id, g.turn,
                     g.status, autos, sum(len(j.ratings) for j in g.joints)])
    return rows


@contextlib.contextmanager
def exported(ctx, token: str, formats: list[str], caller: Caller | None = None,
             tmp_root: str | None = None) -> Iterator[list[str]]:
    """Admin: everything in the store (every session's groups) as files for download, written to
    a fresh temp dir (under `tmp_root`, default the system temp dir, where Gradio accepts files
    to copy into its own cache) that is removed when the block ends. Never under COLLAB_HOME:
    Gradio does not serve it, and allowing it would serve the database too.

        with H.exported(ctx, token, ["jsonl"]) as files: ...   # files exist in here
    """
    check_admin(ctx, token, caller)
    if not formats:
        raise UserError("pick at least one export format")
    from collab_app.online.export import export
    tmp = tempfile.mkdtemp(prefix="collab-export-", dir=tmp_root)
    if os.path.realpath(tmp).startswith(os.path.realpath(ctx.home) + os.sep):
        shutil.rmtree(tmp, ignore_errors=True)   # TMPDIR inside COLLAB_HOME: refuse, never serve from there
        raise UserError("export refused: the temp dir is inside COLLAB_HOME; point TMPDIR elsewhere")
    try:
        try:
            paths = export(ctx.store, os.path.join(tmp, "export"), list(formats))   # {format: path, "meta": path}
        except ValueError as e:
            raise UserError(f"export failed: {e}") from None
        files = []
        for p in paths.values():   # gr.File serves files; a `datasets` folder is zipped
            p = str(p)
            if os.path.isdir(p):
                p = shutil.make_archive(p, "zip", p)
            files.append(p)
        yield files
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
