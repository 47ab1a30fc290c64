"""The app's core: a round and a piece of feedback, as plain functions with explicit arguments.

Both doors use these and nothing else to generate or to store ratings: the Gradio page
(handlers.py, wired by ui.py) and the OpenAI-compatible /v1 (openai_api.py). A door translates its
request into the arguments here and formats what comes back; every check (input, entitlement,
limits) happens here, once, and a refusal is a `UserError` whose `code` the door maps (access.py).

- `play_round(ctx, episode, caller, num_generations, sampling)`: one round of the episode's team,
  streamed as events (the candidates' texts grow as the engine writes them; candidate g's
  automatic check starts in a thread pool as soon as it is complete); the group is stored once
  all G are written and checked, before the last event. Every round counts against `ctx.limits`.
- `store_feedback(ctx, caller, form, target, answer, comment, token)`: one feedback form (stars,
  a reward in [0, 1], a ranking, a pick of the best) checked, limited and stored in one
  all-or-nothing write; the `Feedback` it returns says whether the ratings can still train the
  team, and why not (a late rating of a closed group is kept and trains nothing). Forms map onto
  the 1..5 scale as online/returns.py says.
- Episodes: `new_episode`, `start_coding` (a coding task's problem or the person's own problem and
  tests), `start_writing`, `another_round` (multi-turn): plain dicts, kept per user by a door.

No Gradio or FastAPI here, and no torch / vllm at import time (the engine and store arrive
through `ctx`, a context.AppContext).

Safe in public: a caller is server-issued (access.Caller) and only its session (or the admin
token) may rate its groups; a person's own coding problem runs only where the sandbox allows
untrusted code (`ctx.untrusted_allowed`, checked in `start_coding` and again in `play_round`); a
round's checks run on behalf of its caller's client network (tasks.sandbox.on_behalf_of: one
network holds at most a share of the sandbox's slots); and each agent's prompt is counted in
tokens against `max_model_len - max_new_tokens` before anything reaches the shared batcher or any
limit is counted, so an over-long prompt fails alone with a message.
"""
from __future__ import annotations

import logging
import math
import numbers
import queue
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterator

from collab_app.online.returns import PRIVATE_TASKS   # pure module: no heavy imports
from collab_app.web.access import WEB, Caller, UserError, check_admin
from tasks.base import Turn, check_prompts, check_reward
from tasks.coding import CustomCodingTask, HumanEvalTask

log = logging.getLogger(__name__)

RATING_MIN, RATING_MAX = 1, 5
OWN_PROBLEM = "My own coding problem"


def problem_source(task) -> str:
    """The page's label for one of a coding task's own problems (a task that `lists_problems`)."""
    return f"{task.title} problem"


SOURCES = (problem_source(HumanEvalTask), OWN_PROBLEM)
"""where a coding episode's problem comes from with the default tasks (`start_coding`; the page's
radio labels): a shipped HumanEval problem, or the person's own. Each served coding task that
`lists_problems` has its own `problem_source` label (`listed_coding_tasks`)."""


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


OWN_PROBLEM_OFF = (
    "**My own coding problem is off on this server.** Your tests are code, and this public server's "
    "sandbox cannot isolate code a person typed ({summary}): it would run with the app's own rights. To "
    "turn it on, run the app where unprivileged user namespaces are allowed (e.g. `sysctl -w "
    "kernel.unprivileged_userns_clone=1`, `kernel.apparmor_restrict_unprivileged_userns=0`, or a "
    "container started with user namespaces); or run your own copy on 127.0.0.1, which runs your problem "
    "in the best sandbox your machine has; or, if only people you trust reach this one, set "
    "`COLLAB_SANDBOX_ALLOW_WEAK=1` (with `COLLAB_SANDBOX_ALLOW_WEAK_PUBLIC=1` on a public host) and restart.")


def own_problem_off_message(ctx) -> str | None:
    """Why a person's own coding problem is refused here (markdown), or None when it is allowed
    (a strong sandbox, COLLAB_SANDBOX_ALLOW_WEAK=1, or an app that trusts its person)."""
    return None if ctx.untrusted_allowed else OWN_PROBLEM_OFF.format(summary=ctx.isolation_summary)


NO_SESSION = ("this request carries no session of this server: reload the page (or, from a script, keep the "
              "cookies the server sets, as gradio_client does). Too many new sessions from your network in "
              "the last minute also end here; wait a minute.")


# --------------------------------------------------------------------------- episodes

def new_episode() -> dict:
    """Per-session state (JSON-able: it lives in gr.State)."""
    return {"task": None, "example": None, "custom": None, "history": [], "group_id": None,
            "candidates": [], "turn": 0}


def task_choices(ctx) -> dict[str, list[str]]:
    """The app's tasks by kind (each task says its own); a person's own coding problem
    (CustomCodingTask) only where a team works on it (`own_problem_served`)."""
    own = [CustomCodingTask.name] if own_problem_served(ctx) else []
    return {"coding": [n for n, t in ctx.tasks.items() if t.kind == "coding"] + own,
            "writing": [n for n, t in ctx.tasks.items() if t.kind == "writing"]}


def listed_coding_tasks(ctx) -> list[str]:
    """The served coding tasks whose problems a person picks from (`lists_problems`), in the app's order."""
    return [n for n, t in ctx.tasks.items() if t.kind == "coding" and t.lists_problems]


def own_problem_served(ctx) -> bool:
    """Whether this app has a team for a person's own coding problem: the coding team it belongs
    to is served (`collab serve --tasks tldr` serves none, so the page must not offer it)."""
    try:
        ctx.team_for(CustomCodingTask.name)
    except KeyError:
        return False
    return True


def _not_served(ctx, what: str) -> UserError:
    return UserError(f"{what} is not served by this app (it serves {', '.join(sorted(ctx.tasks)) or 'no task'}); "
                     "pick one of those, or restart it with that task in --tasks", "not_served")


def find_example(ctx, task_name, split, example_id):
    if not example_id:
        raise UserError("pick a problem first")
    for ex in ctx.tasks[task_name].examples(split):
        if ex["id"] == example_id:
            return ex
    raise UserError(f"no example {example_id!r} in {task_name}/{split}")


def _custom_coding_task(custom: dict):
    try:
        return CustomCodingTask(custom["prompt"], custom["tests"], entry_point=custom.get("entry_point") or None)
    except (ValueError, SyntaxError) as e:
        raise UserError(f"your coding problem was not accepted: {e}") from None


def task_of(ctx, episode: dict):
    if episode["task"] == CustomCodingTask.name:
        return _custom_coding_task(episode["custom"])
    return ctx.tasks[episode["task"]]


def start_coding(ctx, source: str, split: str, example_id: str, prompt: str, tests: str,
                 entry_point: str) -> dict:
    """A new coding episode: a problem of a served coding task (`source` its `problem_source`, e.g.
    a HumanEval problem), or (`source` OWN_PROBLEM) the person's own problem + tests."""
    ep = new_episode()
    if source != OWN_PROBLEM:
        name = next((n for n in listed_coding_tasks(ctx) if problem_source(ctx.tasks[n]) == source), None)
        if name is None:
            raise _not_served(ctx, str(source).removesuffix(" problem"))
        ep["task"] = name
        ep["example"] = find_example(ctx, name, split, example_id)
        return ep
    if not own_problem_served(ctx):
        raise _not_served(ctx, "a coding problem of your own (it needs a coding team)")
    _check_own_problem_allowed(ctx)
    prompt = clean_text(prompt, "problem", ctx.max_prompt_chars)
    tests = clean_text(tests, "tests", ctx.max_prompt_chars)
    entry_point = clean_text(entry_point, "entry point", 200, required=False).strip()
    ep["task"] = CustomCodingTask.name
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


def _score(task, example, outputs, network: str | None = None, local_person: bool = False) -> tuple[Any, str | None]:
    """(Reward, None), or (None, why) when the automatic check itself failed (e.g. the sandbox
    could not start, or stayed busy): the candidate is still stored and shown, a person's rating
    is its return. Sandboxed checks run on behalf of `network` (its share of the slots) and, with
    `local_person`, for an app that trusts its person (tasks.sandbox.on_behalf_of)."""
    from tasks.sandbox import on_behalf_of

    try:
        with on_behalf_of(network, local_person=local_person):
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


def play_round(ctx, episode: dict, caller: Caller, num_generations: int, sampling, tick_s: float = 1.0,
               min_update_s: float = 0.1) -> Iterator[dict]:
    """One round of the team on the episode: `num_generations` (G) joint answers sampled with
    `sampling` (engine_types.Sampling), streamed. Yields {"kind": "progress", "message",
    "candidates"} events (candidates as in `_candidates`, without joint_sample ids): when a
    candidate is written or checked, when text grew (at most one per `min_update_s`: an engine
    may snapshot every few ms; the page asks for ctx.page_update_s, whose updates cost Gradio's
    Python in this process), and every
    `tick_s` while nothing happens (the elapsed time); and finally
    {"kind": "done", "episode": new_state, "message"}. The group (G joint answers, automatic
    rewards) is stored before "done", so every candidate in it can be rated.

    Everything about the request is checked first (task, session, prompt length); then the
    round counts against `ctx.limits` for the caller (a refusal stores and counts nothing) and
    gives its place back when it ends, however it ends (the generator's `close()` included).

    The engine call runs in the batcher's thread (engines/batcher.py: merged with other callers'
    requests, under `ctx.engine_lock`); this generator only reads its ticket's queue, because a
    door may resume a generator on a different thread (a lock must not span yields). Checks run
    in a pool of this round (sandboxed subprocesses: threads only wait on them)."""
    if not episode or not episode.get("task"):
        raise UserError("choose a task and press Generate")
    if not caller.session_id:
        raise UserError(NO_SESSION, "no_session")   # its group could never be rated, and limits need a key
    G = num_generations
    if isinstance(G, bool) or not isinstance(G, int) or G < 1:   # each door has its own upper bound
        raise UserError(f"num_generations must be a whole number >= 1, got {G!r:.20}")
    if episode["task"] in PRIVATE_TASKS:
        _check_own_problem_allowed(ctx)      # also here: not only the page hides it
    task = task_of(ctx, episode)
    example = episode["example"]
    history = [Turn(tuple(o), tuple(f)) for o, f in episode["history"]]
    prompts = check_prompts(task, task.agent_prompts(example, history))
    team = ctx.team_for(episode["task"])
    check_prompt_tokens(ctx, team, prompts, sampling, later_turn=bool(history))
    ctx.wait_for_arena_ahead(caller.key)   # the person's next arena pair, written ahead, holds their round
    ctx.limits.begin_round(caller)
    try:
        yield from _round(ctx, episode, caller, task, example, history, prompts, team, G, sampling,
                          tick_s, min_update_s)
    finally:
        ctx.limits.end_round(caller)


def warm_up(ctx, new_tokens: int = 2) -> float | None:
    """One short batch before the first person's round: G=2 answers of `new_tokens` tokens from
    the first served task's team on that task's first training example, through the batcher as a
    round runs (adapters polled, the engine lock). Returns its seconds, or None where it failed (a
    warning: the first round then shows the engine's error as any round would).

    Why: an engine does some work only the first time it meets a long prompt. vLLM eager in fp32
    (what `auto` serves under the AVX2 emulation) took 3.5 s to a person's first words in the
    first round after start-up and 0.5-0.7 s in the next; after this batch (4.8 s at start-up) the
    first round's were 0.71 s. `collab serve` runs
    it before the page opens, so start-up pays instead of the first person."""
    from dataclasses import replace

    t0 = time.monotonic()
    try:
        name = next(iter(ctx.tasks))
        task = ctx.tasks[name]
        prompts = check_prompts(task, task.agent_prompts(task.examples("train")[0], []))
        with ctx.team_settings_lock:
            sampling = replace(ctx.sampling, max_new_tokens=new_tokens)
        ticket = ctx.batcher().submit(ctx.team_for(name), prompts, 2, sampling)
        while (ev := ticket.events.get())[0] not in ("done", "error"):
            pass
        if ev[0] == "error":
            raise ev[1]
    except Exception as e:  # noqa: BLE001 - an optimisation: never a reason not to serve
        log.warning("the engine's warm-up batch failed (%s: %s); serving anyway", type(e).__name__, e)
        return None
    return time.monotonic() - t0


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
    network = f"net:{caller.network}" if caller.network else caller.key   # whose share of the sandbox's slots
    pool = ThreadPoolExecutor(G, thread_name_prefix="collab-check")   # one per candidate: checks are
    # sandboxed subprocesses (coding) or light Python (writing), G <= ctx.max_generations

    def start_check(g: int) -> None:
        outs = [done[a][g].text for a in range(len(names))]
        fut = pool.submit(_score, task, example, outs, network, ctx.trusts_its_person)
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
                        raise UserError(f"the engine refused this prompt: {ev[1]}", "engine_refused") from None
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


# --------------------------------------------------------------------------- feedback

FORMS = ("stars", "reward", "rank", "pick_best")
"""feedback forms `store_feedback` takes (online/returns.py maps each onto 1..5)."""


@dataclass(frozen=True)
class Feedback:
    """What `store_feedback` stored: one rating row per joint sample, in the group's order."""

    form: str
    rater: str
    rating_ids: list[int]
    joint_sample_ids: list[int]
    values: list[float]
    """the stored 1..5 values (a reward r is stored as 1 + 4r)."""
    group_id: int | None = None
    """the group, for the forms that name one (rank, pick_best)."""
    note: str = ""
    """what the rating will do when that is less than a person expects (anonymous on a Space with sign-in)."""
    trains: bool = True
    """whether the rating can still train the team; False: it is kept (the export has it) but no
    step will use it, and `why_not` says why."""
    late: bool = False
    """stored as a late row: its group was already trained, expired or set aside when it arrived."""
    why_not: str = ""
    """why the rating will not train the team ("" when it will)."""


def parse_rating(value: Any) -> int:
    """A 1..5 star rating: a whole number (text from a dropdown too)."""
    if isinstance(value, bool):
        raise UserError("a rating is a whole number from 1 to 5")
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise UserError(f"a rating is a whole number from 1 to 5, got {value!r:.40}") from None
    if not math.isfinite(f) or f != int(f) or not RATING_MIN <= f <= RATING_MAX:
        raise UserError(f"a rating is a whole number from 1 to 5, got {value!r:.40}")
    return int(f)


def _reward_value(value: Any) -> float:
    ok = not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)
    if not ok or not 0.0 <= value <= 1.0:
        raise UserError(f"reward must be a number in [0.0, 1.0], got {value!r:.40}")
    return float(value)


def _whole(v: Any, what: str) -> int | None:
    """A whole number (text from a page's dropdown too); None for no answer."""
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


def _id(v: Any, what: str) -> int:
    n = _whole(v, what)
    if n is None:
        raise UserError("nothing to rate yet: generate first (and wait until the candidates are stored)")
    return n


def _rating_session(ctx, caller: Caller, token: str | None) -> str | None:
    """The session whose groups this caller may rate (add_ratings checks it), or None when a
    (valid) admin token lets it rate any group. A wrong token is an error, not a fallback."""
    if token:
        check_admin(ctx, token, caller)
        return None
    if not caller.session_id:
        raise UserError("this request carries no session, so it cannot be matched to the group it "
                        "generated: rate from the page or from the gradio_client that generated it. "
                        + NO_SESSION, "no_session")
    if getattr(ctx, "require_login_to_rate", False) and caller.door == WEB and not caller.username:
        raise UserError("this app takes ratings from signed-in people only: press 'Sign in with Hugging Face' "
                        "at the top of the page, then rate again (your candidates are kept)", "login_required")
    return caller.session_id


def store_feedback(ctx, caller: Caller, form: str, target: Any, answer: Any, comment: Any = "",
                   token: str = "") -> Feedback:
    """Store one feedback form by `caller`, all or nothing:

    - "stars": `target` a joint sample id (or a list of them), `answer` its 1..5 rating (or one
      per id);
    - "reward": `target` a joint sample id, `answer` r in [0, 1]; the store holds ratings of a
      fixed set of forms on 1..5, so r is stored as stars 1 + 4r with detail {"form": "reward",
      "reward": r}, which returns.py maps back to r x the task's maximum reward;
    - "rank": `target` a group id, `answer` the rank (1 = best) of each candidate in order, a
      permutation of 1..G (one "rank" row per candidate);
    - "pick_best": `target` a group id, `answer` the best candidate, 1-based (5 for it, 1 for
      the others).

    Order of checks: the comment and the answer's form, then entitlement (only the session that
    generated the group, or the admin `token`), then `ctx.limits` (a ranking of G counts G),
    then the store, which checks entitlement again in its transaction. A refusal stores and
    counts nothing (a busy store too: code "store_busy", the budget given back); re-rating
    replaces the rater's own row (the store's rule). What was stored is then read back: the
    Feedback says whether it can still train the team (`rating_fate`), so no door says "saved"
    alone of a rating that no step will use."""
    from collab_app.online.returns import FeedbackError, pick_best_ratings, ranking_ratings
    from collab_app.online.store import MAX_COMMENT_CHARS, NotFound   # the store owns what it stores

    if form not in FORMS:
        raise UserError(f"unknown feedback form {form!r:.40}: one of {', '.join(FORMS)}")
    comment = clean_text(comment, "comment", MAX_COMMENT_CHARS, required=False)
    group_id, details = None, None
    if form in ("stars", "reward"):
        many = isinstance(target, (list, tuple))
        ids = [_id(t, "joint sample id") for t in (target if many else [target])]
        answers = list(answer) if many and isinstance(answer, (list, tuple)) else [answer]
        if not ids or len(answers) != len(ids):
            raise UserError(f"give one rating per joint sample: {len(ids)} ids, {len(answers)} ratings")
        if form == "stars":
            values = [float(parse_rating(a)) for a in answers]   # all valid before any is stored
        else:
            rewards = [_reward_value(a) for a in answers]
            values = [RATING_MIN + (RATING_MAX - RATING_MIN) * r for r in rewards]
            details = [{"form": "reward", "reward": r} for r in rewards]
        session = _rating_session(ctx, caller, token)
    else:
        gid = _id(target, "group id")
        session = _rating_session(ctx, caller, token)
        try:
            grp = ctx.store.group(gid)
        except NotFound as e:
            raise UserError(f"feedback not saved: {e}", "not_found") from None
        if session is not None and grp.session_id != session:
            raise UserError(f"feedback not saved: group #{grp.id} was generated by another session; you can "
                            "rate only the candidates your own session generated (or give the admin token)",
                            "not_entitled")
        joints = sorted(grp.joints, key=lambda j: j.joint_index)
        K, group_id, ids = len(joints), grp.id, [j.id for j in joints]
        try:
            if form == "rank":
                if isinstance(answer, (str, bytes)) or not isinstance(answer, (list, tuple)):
                    raise FeedbackError(f"a ranking is a list of {K} ranks (1 = best), one per candidate")
                ranks = [_whole(r, f"the rank of candidate {k + 1}") for k, r in enumerate(answer)]
                missing = [k + 1 for k, r in enumerate(ranks) if r is None]
                if missing:
                    raise UserError(f"candidate {', '.join(map(str, missing))} has no rank: rank all {K} candidates")
                values = ranking_ratings(ranks, K)
                details = [{"rank": r, "of": K} for r in ranks]
            else:
                b = _whole(answer, "best")   # the best candidate, 1-based
                if b is None:
                    raise UserError(f"pick the best candidate (1..{K}) first")
                values = pick_best_ratings(b - 1, K)
                details = [{"best": k == b - 1, "of": K} for k in range(K)]
        except FeedbackError as e:
            raise UserError(f"feedback not saved: {e}") from None
    rater = caller.rater or "admin"        # no session only with the admin token
    ctx.limits.take_ratings(caller, len(ids))
    kind = "stars" if form == "reward" else form
    signed_in = caller.signed_in or session is None      # a login, an API key, or the admin token
    try:
        rating_ids = ctx.store.add_ratings(list(zip(ids, values)), rater, comment, kind=kind, details=details,
                                           session_id=session, network=caller.network, signed_in=signed_in)
    except Exception as e:   # nothing stored: the caller's budget is as it was
        ctx.limits.give_back_ratings(caller, len(ids))
        refusal = _rating_not_saved(e)
        if refusal is None:
            raise
        raise refusal from None
    note = ""
    if not signed_in and getattr(ctx, "anonymous_share", 1.0) < 1.0:
        note = (f"you are not signed in: your rating is kept and shown, but ratings of everyone who did not sign in "
                f"together decide at most {ctx.anonymous_share:.0%} of each training step; sign in with Hugging "
                "Face to count in full")
    late, why_not = rating_fate(ctx, [group_id] if group_id is not None else None, ids, rating_ids)
    return Feedback(form, rater, list(rating_ids), ids, values, group_id, note, not why_not, late, why_not)


STORE_BUSY = ("the store is busy (another process holds it, or it did not answer in time); nothing was saved and "
              "your rating budget is as it was: submit again in a few seconds")


def _rating_not_saved(e: Exception) -> UserError | None:
    """The UserError for a failed rating write, or None for a fault the door reports as its own
    (a bug: a 500 with the log's traceback). A locked or unreachable store is the server's busy
    moment, not the person's mistake: code "store_busy", try again."""
    import sqlalchemy.exc

    from collab_app.online.store import NotEntitled, NotFound, StoreError

    if isinstance(e, (sqlalchemy.exc.OperationalError, sqlalchemy.exc.TimeoutError)):
        log.warning("a rating was not saved: the store is busy (%s: %s)", type(e).__name__, str(e)[:300])
        return UserError(STORE_BUSY, "store_busy", 5)
    if isinstance(e, NotEntitled):
        return UserError(f"rating not saved: {e}", "not_entitled")
    if isinstance(e, NotFound):
        return UserError(f"rating not saved: {e}", "not_found")
    if isinstance(e, (StoreError, ValueError, LookupError)):
        return UserError(f"rating not saved: {e}")
    return None


def _groups_of(ctx, joint_ids: list[int]) -> list[int]:
    """The groups these joint samples belong to (one indexed read)."""
    return ctx.store.groups_of(joint_ids)


def rating_fate(ctx, group_ids: list[int] | None, joint_ids: list[int], rating_ids: list[int]) -> tuple[bool, str]:
    """(late, why_not) for ratings just stored: whether they went in as late rows, and why they
    will not train the team ("" when they can): the group was already trained, expired or set
    aside (its rows say `late`), or it is a person's own problem that trains only while an admin
    allows it. Read back from the store, so a group closed between the person's read and the
    write is told as it is. A failed read says nothing (the rating is saved; only the note is lost)."""
    try:
        groups = [ctx.store.group(g) for g in (group_ids or _groups_of(ctx, joint_ids))]
    except Exception as e:  # noqa: BLE001 - the rating is stored; this is only what the person is told
        log.warning("rating %s saved; could not read its group back to say whether it trains (%s: %s)",
                    rating_ids, type(e).__name__, e)
        return False, ""
    mine = set(rating_ids)
    reasons, late = [], False
    for grp in groups:
        rows = [r for j in grp.joints for r in j.ratings if r.id in mine]
        if any(r.late for r in rows):
            late = True
            reasons.append(closed_reason(grp))
        elif grp.task in PRIVATE_TASKS and not custom_training_allowed(ctx):
            reasons.append(f"group #{grp.id} is your own coding problem, which trains the shared team only "
                           "while an admin allows it")
    return late, "; ".join(reasons)


def closed_reason(grp) -> str:
    """Why a trained, expired or set-aside group (a store GroupRecord) takes no more ratings into training."""
    why = getattr(grp, "status_reason", None)
    if grp.status == "trained":
        return f"group #{grp.id} was already trained at step {grp.trained_step}"
    if grp.status == "expired":
        return f"group #{grp.id} expired" + (f" ({why})" if why else " (it waited too long for its returns)")
    return f"group #{grp.id} was set aside" + (f" ({why})" if why else " (the trainer cannot use it)")


def custom_training_allowed(ctx) -> bool:
    """Whether people's own coding problems train the shared team now (an admin's switch)."""
    from collab_app.online.returns import CUSTOM_TRAINING_KEY, may_train_shared
    return may_train_shared(CustomCodingTask.name, ctx.store.get_state(CUSTOM_TRAINING_KEY))
