"""The Gradio page's door: what the app's page does, as plain functions `(ctx, inputs..., state) -> outputs`.

A round and feedback are the core's (core.py: `play_round`, `store_feedback`); the functions here
translate the page's inputs into them and format what comes back (messages, markdown), and hold
the page's other tabs: rendering candidates, the Arena tab (web/arena.py's blind pairs and votes
as page views), the Team tab (role prompts, generation settings, adapter pins and roll-back), the
Training tab (status, figures and the arena's leaderboard), the Data tab and export.
Who acts and what they may do is access.py's (`Caller`, `check_admin`, `Limits`).

No Gradio here (ui.py wires these to components), so they are tested without a browser and are
quick to import: no torch / vllm at import time (the engine and store arrive through `ctx`).
Per-user state is a plain dict (`new_episode()`), kept by the UI in `gr.State`, so one person's
work never reaches another session. Bad input raises `UserError` with a message saying what to
fix; ui.py shows it (gr.Error) and the app stays up.

Feedback forms (online/returns.py maps each onto 1..5): stars per candidate (`rate`,
`rate_candidates`), "pick the best" (`pick_best`), a full ranking (`rank`). A rating is accepted
only from the session that generated the group, or with the admin token; re-rating replaces the
rater's own rating. A person's own coding problem trains the shared team only while an admin
allows it (`set_custom_training`). A rating that will not train is answered "saved, but it will
not train the team (why)", never a bare "saved".

A round on the page is `round_events`: it ends in "done" or in a "failed" event with a message
(an unexpected error also leaves its traceback in the log), never in an exception the page would
swallow; an arena pair likewise ends in "done" or "failed" (`arena_pair_events`), and a vote
that is not stored is a message (`arena_vote_view`). The Training tab's status and figures come
from `training_view`, computed once per `ctx.shared_ttl_s` for every visitor from column-limited
queries (the leaderboard likewise: `arena_board_view`); admins see the set-aside and expired
groups with why (`closed_groups_table`) and put chosen ones back (`put_back_groups`).
Export (`exported`) writes to a fresh temp dir outside COLLAB_HOME, removed once the caller is
done with the files.
"""
from __future__ import annotations

import contextlib
import dataclasses
import html
import logging
import math
import os
import re
import shutil
import tempfile
import time
from typing import Any, Iterator

from collab_app.web.access import Caller, UserError, check_admin
# the page calls these through this module (H.start_coding, ...): one name per thing for ui.py
from collab_app.web.core import (OWN_PROBLEM, SOURCES, another_round, clean_text,  # noqa: F401
                                 custom_training_allowed, find_example, listed_coding_tasks, new_episode,
                                 own_problem_off_message, own_problem_served, play_round, problem_source,
                                 start_coding, start_writing, store_feedback, task_choices)
from collab_app.web.arena import arena_board, arena_round, arena_tasks, arena_vote, take_ahead, write_ahead

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- problems and rounds

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
    ex = find_example(ctx, task_name, split, example_id)
    body = ex.get("prompt") or ex.get("text") or ""
    return f"**{ex['id']}**\n\n```python\n{body}\n```" if ctx.tasks[task_name].kind == "coding" else body


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


def generate(ctx, episode: dict, caller: Caller, tick_s: float = 1.0, min_update_s: float = 0.1) -> Iterator[dict]:
    """The page's Generate: `core.play_round` with the app's G and sampling (the Team tab's)."""
    with ctx.team_settings_lock:
        G, sampling = ctx.num_generations, ctx.sampling
    return play_round(ctx, episode, caller, G, sampling, tick_s=tick_s, min_update_s=min_update_s)


ROUND_FAILED = ("this round failed on the server ({what}). Try again; if it fails again, tell the server's admin: "
                "its log has the details under {ref}")


def round_events(ctx, episode: dict, caller: Caller, min_update_s: float = 0.1) -> Iterator[dict]:
    """The page's round: `generate`'s events, ending in "done" or in one {"kind": "failed",
    "message", "user_error"} event instead of an exception: a refusal (UserError) with its own
    message; any other error logged with its traceback under a reference the message gives (its
    text shown only where the app trusts its person: an error's text can name server paths).
    So a round that breaks ends on the page with a message, never "starting ..." for good."""
    try:
        yield from generate(ctx, episode, caller, min_update_s=min_update_s)
    except UserError as e:
        yield {"kind": "failed", "message": str(e), "user_error": True}
    except Exception as e:  # noqa: BLE001 - the person is told; the log has the traceback
        ref = f"round-{os.urandom(4).hex()}"
        log.exception("%s: a round failed (task %r, caller %s)", ref, (episode or {}).get("task"), caller.key)
        what = type(e).__name__ + (f": {str(e)[:300]}" if ctx.trusts_its_person else "")
        yield {"kind": "failed", "message": ROUND_FAILED.format(what=what, ref=ref), "user_error": False}


def run_generate(ctx, episode: dict, caller: Caller) -> dict:
    """`generate` to the end (the page's API endpoint, tests): its "done" event."""
    for ev in generate(ctx, episode, caller):
        if ev["kind"] == "done":
            return ev
    raise RuntimeError("generate ended without a result")


# --------------------------------------------------------------------------- rendering

def _version(v) -> str:
    return "base model" if v is None else f"adapter v{v}"


def render_candidate(cand: dict, index: int, coding: bool) -> str:
    """Markdown of one candidate: who wrote which part, adapter versions, automatic checks; while
    it is still being written or checked, the text so far and that state. The page shows the same
    pieces side by side (`render_head`, one `render_part` per agent, `render_checks`)."""
    return "\n".join([render_head(cand, index), ""] + [render_part(p, coding) for p in cand["parts"]]
                     + [render_checks(cand)]).rstrip("\n")


def render_head(cand: dict, index: int) -> str:
    """A candidate's title: its number and automatic score (or that it is still written / checked)."""
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
    return "\n".join([f"### Candidate {index + 1} — {score}", f"<sub>{sub}</sub>" if sub else ""])


def render_part(part: dict, coding: bool) -> str:
    """One agent's part of a candidate: its role, agent and adapter version, then its text."""
    who = f"**{part['role']}** · agent `{part['agent']}`"
    lines = [f"{who} · {_version(part['adapter_version'])}" if part.get("done", True) else f"{who} · writing …"]
    return "\n".join(lines + [render_text(part["text"], coding)]) + "\n"


def render_text(text: str, coding: bool) -> str:
    """An answer's text as the page shows it: code as one verbatim Python block (the agent's raw
    answer, markdown fences included: a fence longer than any run of backticks inside it keeps it
    one block), prose as a quote with its HTML escaped."""
    if coding:
        fence = "`" * max(3, 1 + max((len(m) for m in re.findall(r"`+", text)), default=0))
        return "\n".join([fence + "python", text, fence])
    quoted = html.escape(text).strip() or "(empty)"
    return "\n".join("> " + q for q in quoted.splitlines())


# CommonMark's backslash escapes for the ASCII punctuation that marks anything up; `&` and `;`
# are left to html.escape (an entity must stay whole)
_MD_PUNCT = re.compile(r"([\\`*_{}\[\]()#+\-.!|~<>])")


def md_literal(text: str) -> str:
    """`text` shown as it is inside Gradio's Markdown: no HTML, no emphasis, links or code spans
    (a test's `__index__` or `a*b*c` is not markup). For the checks' lines: test code and error
    messages. The agents' parts are not passed through it: an answer's own Markdown is shown."""
    return _MD_PUNCT.sub(r"\\\1", html.escape(text, quote=False))


def render_checks(cand: dict) -> str:
    """A checked candidate's automatic checks: each reward level and what the check found."""
    r = cand["reward"]
    if cand.get("state", "checked") != "checked":
        return ""
    if r is None:
        return (f"**Automatic checks** failed: {md_literal(cand.get('check_error') or '?')} "
                "(your rating is this candidate's only reward)")
    lines = ["**Automatic checks**: " + " · ".join(f"{k} {v:+.2f}" for k, v in r["levels"].items())]
    lines += [f"- {md_literal(x)}" for x in check_summary(r.get("details") or {})]
    return "\n".join(lines)


def _number(v: float) -> str:
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"


def check_summary(details: dict, limit: int = 400) -> list[str]:
    """Readable lines from a Reward's details: tests passed, the first failing test and its
    error, syntax errors, where scoring stopped; other truthy entries as `key: value` (a float
    to 3 significant digits: a writing metric's 1.3064516129032258 reads as 1.31)."""
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
        text = v if isinstance(v, str) else _number(v) if isinstance(v, float) else repr(v)
        out.append(f"{k}: {text[:limit]}{' …' if len(text) > limit else ''}")
    return out


# --------------------------------------------------------------------------- rating

def rate(ctx, joint_sample_id: Any, value: Any, caller: Caller, comment: str = "", token: str = "") -> int:
    """Store one 1-5 rating of a joint sample this caller's session generated (or any, with the
    admin token); returns its id. Bad value / unknown sample / other session -> UserError."""
    return store_feedback(ctx, caller, "stars", joint_sample_id, value, comment, token).rating_ids[0]


def rate_candidates(ctx, episode: dict, values: list, caller: Caller, comment: str = "") -> str:
    """The page's Submit: rate this session's candidates (None = not rated), all in one write.
    Returns the message."""
    cands = (episode or {}).get("candidates") or []
    if not cands or any(c.get("joint_sample_id") is None for c in cands):
        raise UserError("nothing to rate yet: generate first (and wait until the candidates are stored)")
    chosen = [(i, v) for i, v in enumerate(values[:len(cands)]) if v not in (None, "")]
    if not chosen:
        raise UserError("pick 1-5 for at least one candidate, then Submit")
    fb = store_feedback(ctx, caller, "stars", [cands[i]["joint_sample_id"] for i, _ in chosen],
                        [v for _, v in chosen], comment)
    return _saved(fb, "rating") + ": " + ", ".join(f"#{rid} (candidate {i + 1}: {v:g}/5)"
                                         for rid, (i, _), v in zip(fb.rating_ids, chosen, fb.values)) + \
        f" as {fb.rater}" + _note(fb)


def _note(fb) -> str:
    return f". Note: {fb.note}" if fb.note else ""


def _saved(fb, what: str) -> str:
    """"<what> saved", and first of all when the feedback will not train the team: why."""
    if fb.trains:
        return f"{what} saved"
    return (f"{what} saved, but it will not train the team ({fb.why_not}; your {what} is kept for the "
            "export)")


def rate_saved(ctx, joint_sample_id: Any, value: Any, caller: Caller, comment: str = "", token: str = "") -> str:
    """`rate`, answered as a message: "rating saved: #id", saying so when it will not train."""
    fb = store_feedback(ctx, caller, "stars", joint_sample_id, value, comment, token)
    return f"{_saved(fb, 'rating')}: #{fb.rating_ids[0]}" + _note(fb)


def rank(ctx, group_id: Any, ranks: Any, caller: Caller, comment: str = "", token: str = "") -> str:
    """A full ranking of a group's candidates: `ranks[k]` = the rank (1 = best) of candidate
    k + 1, a permutation of 1..G (core.store_feedback's "rank" form). Returns the message."""
    fb = store_feedback(ctx, caller, "rank", group_id, ranks, comment, token)
    order = sorted(range(len(fb.values)), key=lambda k: -fb.values[k])
    return (f"{_saved(fb, 'ranking')}: #{fb.rating_ids[0]}..#{fb.rating_ids[-1]} (best first: "
            f"{' > '.join(f'candidate {k + 1}' for k in order)}) as {fb.rater}" + _note(fb))


def pick_best(ctx, group_id: Any, best: Any, caller: Caller, comment: str = "", token: str = "") -> str:
    """"Pick the best": candidate `best` (1-based) of a group is the best one (core.store_feedback's
    "pick_best" form). Returns the message."""
    fb = store_feedback(ctx, caller, "pick_best", group_id, best, comment, token)
    b = fb.values.index(max(fb.values)) + 1
    return (f"{_saved(fb, 'pick')}: #{fb.rating_ids[0]}..#{fb.rating_ids[-1]} (candidate {b} is the best of "
            f"{len(fb.values)}) as {fb.rater}" + _note(fb))


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
    prompts, the base each agent runs on and the adapter version it serves (pinned marked); a
    heterogeneous team (engines/team.py TeamEngine) also gets one line per base: its agents and
    the memory of its weights."""
    eng, smp = ctx.engine, ctx.sampling
    name = lambda path: os.path.basename(str(path).rstrip("/"))   # noqa: E731 - a folder's last part
    default = getattr(eng, "model_path", "?")
    current = ctx.store.current_adapter_versions()
    pinned = {a for a in ctx.agent_names() if any(v.pinned for v in ctx.store.adapter_versions(a))}
    lines = [f"**base model** `{os.path.basename(str(getattr(eng, 'model_path', '?')).rstrip('/'))}` · "
             f"**engine** `{getattr(eng, 'name', type(eng).__name__)}` · **G** = {ctx.num_generations} · "
             f"temperature {smp.temperature} · top-p {smp.top_p} · max new tokens {smp.max_new_tokens}", "",
             "| task | agent (role) | base model | role prompt | serving | newest stored |", "|---|---|---|---|---|---|"]
    for task_name, team in ctx.teams.items():
        for agent in team.agents:
            served = ctx.engine.adapter_version(agent.name)
            cur = current.get(agent.name)
            prompt = html.escape(agent.role_prompt.strip().replace("\n", " ")[:120]) or "—"
            pin = " (pinned)" if agent.name in pinned else ""
            newest = f"v{cur[0]}{pin}" if cur else "none yet"
            base = eng.model_of(agent.name) if hasattr(eng, "model_of") else (agent.model or default)
            lines.append(f"| {task_name} | `{agent.name}` | `{name(base)}` | {prompt} | {_version(served)} | {newest} |")
    if hasattr(eng, "memory"):
        lines += ["", "| base model | agents | weights in memory |", "|---|---|---|"]
        for base, m in eng.memory().items():
            lines.append(f"| `{name(base)}` | {', '.join(m['agents']) or '—'} | "
                         f"{m['weights_bytes'] / 2**20:,.0f} MiB ({m['how']}) |")
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
    """Rows (newest first): version, step, created, pinned, serving now, folder. The folder's name
    only: the table is shown to every visitor, and the server's paths (its home, its user name)
    are nobody else's business; the admin has them on the server."""
    if not agent:
        return []
    served = ctx.engine.adapter_version(agent)
    rows = []
    for v in reversed(ctx.store.adapter_versions(agent)):
        rows.append([v.version, v.step if v.step is not None else "", v.created_at.strftime("%Y-%m-%d %H:%M:%S"),
                     "yes" if v.pinned else "", "yes" if v.version == served else "",
                     os.path.basename(str(v.path).rstrip("/"))])
    return rows


ADAPTER_HEADERS = ["version", "step", "created (UTC)", "pinned", "serving", "folder"]


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
    flag, groups waiting (and those that never train: a single answer, or set aside after their
    step failed; those held back by the rater cap), and the last step's return."""
    from collab_app.online.service import is_paused, read_status
    st = read_status(ctx.store)
    stats = ctx.store.stats()
    counts = stats["groups"]
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
    child = trainer_process_line(ctx)
    if child:
        state += f" · **{md_literal(child)}**"
    return (f"**trainer**: {state}{' · pause requested' if is_paused(ctx.store) else ''}\n\n"
            f"**people's own coding problems**: {own}\n\n"
            f"**groups waiting**: {counts['ready']} ready, {counts['open']} still collecting ratings · "
            f"{counts['trained']} trained · {counts['expired']} expired{_untrainable(stats)}{last}")


def trainer_process_line(ctx) -> str:
    """Why the trainer child `collab serve` supervises is not training, when it is not ("trainer
    crashed 3 times in a row (exit code 1), restarting in 8 s; last error: ..."): its heartbeat
    alone says only "not running". "" when there is none or it runs well (serve.ChildTrainer.describe)."""
    child = getattr(ctx, "trainer_child", None)
    if child is None:
        return ""
    try:
        return child.describe() or ""
    except Exception:  # noqa: BLE001 - a status line must never break the tab
        log.exception("the trainer child's status could not be read")
        return ""


def _untrainable(stats: dict) -> str:
    """' · N never train (...)' when some groups cannot: a group of one answer has no sibling to
    compare with; a set-aside group made its step fail twice. Plus the rater cap's held groups."""
    out = ""
    n, single = stats["groups"].get("untrainable", 0), stats.get("single_sample_groups", 0)
    if n:
        out += (f" · {n} never train ({single} with a single answer: no sibling to compare; "
                f"{max(n - single, 0)} set aside after their step failed)")
    if stats.get("groups_held_by_rater_cap"):
        out += (f" · {stats['groups_held_by_rater_cap']} waiting for other raters (one rater supplies at most "
                f"{stats.get('rater_share') or 0:.0%} of a step)")
    return out


def set_training_paused(ctx, token: str, paused: bool, caller: Caller | None = None) -> str:
    """Admin: ask the trainer service to pause (after its current step) or resume; the flag is
    in the store, so an external `collab trainer` on the same store obeys it too."""
    check_admin(ctx, token, caller)
    from collab_app.online.service import set_paused
    set_paused(ctx.store, bool(paused), by="app")
    ctx.shared_views.clear()
    return ("pause requested: the trainer stops after its current step" if paused
            else "resume requested: the trainer continues with the next ready groups")


CLOSED_HEADERS = ["group", "created (UTC)", "task", "status", "why", "ratings"]


def closed_groups_table(ctx, token: str, caller: Caller | None = None, limit: int = 50) -> list[list]:
    """Admin: the newest groups that will not train as they stand, set aside ("untrainable") or
    expired, each with why (Store.closed_groups), so an admin can judge which to put back. Admin
    only: a group's reason can name its task's inner workings, and putting back is theirs."""
    check_admin(ctx, token, caller)
    return [[g["id"], g["created_at"].strftime("%Y-%m-%d %H:%M:%S") if g.get("created_at") else "", g["task"],
             "set aside" if g["status"] == "untrainable" else g["status"], g.get("reason") or "(not recorded)",
             g.get("ratings", 0)] for g in ctx.store.closed_groups(limit)]


def _group_ids(value: Any) -> list[int]:
    """Group ids from the page (text such as "12, 15 17" or "#12") or a list of them."""
    parts = re.findall(r"[^\s,;#]+", value) if isinstance(value, str) else list(value or [])
    ids = []
    for p in parts:
        n = _whole_id(p)
        if n is None:
            raise UserError(f"{str(p)[:40]!r} is not a group id: give the numbers from the table, e.g. 12, 15")
        ids.append(n)
    if not ids:
        raise UserError("give the ids of the groups to put back (the first column of the table), e.g. 12, 15")
    return list(dict.fromkeys(ids))


def _whole_id(v: Any) -> int | None:
    if isinstance(v, bool):
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return int(f) if math.isfinite(f) and f == int(f) and 1 <= f < 2 ** 62 else None


def put_back_groups(ctx, token: str, group_ids: Any, caller: Caller | None = None) -> str:
    """Admin: put set-aside or expired groups back into training (Store.put_back: open again,
    trained once they have their returns). For groups closed by a fault now mended (a full
    disk, a broken step); a group of a single answer stays out, and one still without returns
    expires again."""
    check_admin(ctx, token, caller)
    ids = _group_ids(group_ids)
    n = ctx.store.put_back(ids)
    ctx.shared_views.clear()
    msg = (f"{n} of {len(ids)} group{'s' if len(ids) != 1 else ''} put back: open again, they train once they "
           "have their returns")
    if n < len(ids):
        msg += (f"; {len(ids) - n} not put back (not set aside or expired, unknown, or of a single answer, "
                "which can never train)")
    return msg


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


# --------------------------------------------------------------------------- arena tab

def arena_new_state() -> dict:
    """The Arena tab's per-user state (gr.State): the pair shown (its match id, None before the
    first), the task and own text it was asked with (the pair after a vote is asked the same way),
    its held-out example, and whether it has its vote."""
    return {"match_id": None, "task": None, "text": "", "example_id": None, "voted": False}


def arena_task_choices(ctx) -> list[tuple[str, str]]:
    """(label, name) of the tasks the arena compares team states on (web/arena.py `arena_tasks`)."""
    return [(f"{n}: {' + '.join(ctx.tasks[n].roles)}", n) for n in arena_tasks(ctx)]


def _arena_prompt(task, example: dict | None, text: str) -> str:
    """What both sides answer, shown above them: the person's own text, or the held-out example
    (a coding problem's prompt only, never its tests)."""
    coding = getattr(task, "kind", "") == "coding"
    if example is None:
        return "**your text**\n\n" + render_text(text.strip(), False)
    body = example.get("prompt") if coding else example.get("text")
    body = body if isinstance(body, str) else str(example.get("prompt") or example.get("text") or "")
    what = "problem" if coding else "text"
    return f"**the {what}** (held-out example `{md_literal(str(example['id']))}`)\n\n" + render_text(body, coding)


def _arena_side(texts: list[str], roles: list[str], coding: bool) -> str:
    """One side while it is written: each role's text so far under its role's name (no agent, no
    version: nothing names the team state before the vote)."""
    return "\n\n".join(f"**{role}** · writing …\n\n{render_text(t, coding)}" for role, t in zip(roles, texts))


def _arena_view(status: str, a: str = "", b: str = "", prompt: str | None = None, can_vote: bool = False,
                state: dict | None = None, kind: str = "progress") -> dict:
    """One update of the Arena tab: `status` line, the answers `a` and `b` (Markdown), the prompt
    (None: as it is), whether the vote buttons are on, the new per-user state (None: as it is)."""
    return {"kind": kind, "status": status, "a": a, "b": b, "prompt": prompt, "can_vote": can_vote, "state": state}


def _held_out(task, avoid: str | None, rng) -> dict | None:
    """A held-out example of `task` other than `avoid` where the task has more."""
    pool = task.examples("eval") or task.examples("train")
    others = [ex for ex in pool if ex["id"] != avoid] or pool
    return rng.choice(others) if others else None


def arena_pair_events(ctx, caller: Caller, task_name: str, text: str = "", state: dict | None = None,
                      min_update_s: float = 0.1, rng=None) -> Iterator[dict]:
    """The Arena tab's "New pair": web/arena.py `arena_round` as page views (`_arena_view`): a
    "start" view (the prompt, empty sides, voting off), "progress" views while both sides write,
    then "done" (each side's combined answer, voting on, the state naming the pair) or "failed"
    (why, in the status line, as `round_events` ends a round: "nothing to compare yet", a limit,
    a bad text; never an exception). Without own text the pair answers one of the task's held-out
    examples, another than the pair before (`state`) where the task has more.

    Written ahead: once a pair is shown, the person's next pair on the same task and text is
    written in the background while they read (web/arena.py `write_ahead`); the next "New pair"
    or vote takes it (`take_ahead`), finished or still writing, instead of starting from nothing."""
    import random

    rng = rng or random.Random()
    prev = state or {}
    text = text or ""
    task = ctx.tasks.get(task_name) if task_name else None
    new = dict(arena_new_state(), task=task_name, text=text)
    coding = getattr(task, "kind", "") == "coding"
    ahead = take_ahead(ctx, caller, task_name, text) if task is not None and caller.session_id else None
    example = None
    if task is not None and not text.strip():
        if ahead is not None:
            example = next((ex for ex in task.examples("eval") or task.examples("train")
                            if ex["id"] == ahead.example_id), None)
        example = example or _held_out(task, prev.get("example_id"), rng)
        new["example_id"] = example["id"] if example else None
    prompt = _arena_prompt(task, example, text) if task is not None and (example or text.strip()) else ""
    yield _arena_view("*two versions of the team are starting ...*", prompt=prompt, state=new, kind="start")
    try:
        roles = list(task.roles) if task is not None else []
        for ev in _ahead_events(ahead, min_update_s) or arena_round(ctx, caller, task_name, text, new["example_id"],
                                                                    rng=rng, min_update_s=min_update_s):
            if ev["kind"] == "progress":
                yield _arena_view(f"*{ev['message']}*", _arena_side(ev["a"], roles, coding),
                                  _arena_side(ev["b"], roles, coding))
                continue
            m = ev["match"]
            done = dict(new, match_id=m["match_id"])
            yield _arena_view(f"**{ev['message']}**", render_text(m["a"]["combined"], coding),
                              render_text(m["b"]["combined"], coding), can_vote=True, state=done, kind="done")
            following = None if text.strip() else _held_out(task, new["example_id"], rng)
            write_ahead(ctx, caller, task_name, text, following["id"] if following else None, rng)
    except UserError as e:
        yield _arena_view("**No pair**: " + md_literal(str(e)), state=new, kind="failed")
    except Exception as e:  # noqa: BLE001 - the person is told; the log has the traceback
        ref = f"arena-{os.urandom(4).hex()}"
        log.exception("%s: an arena pair failed (task %r, caller %s)", ref, task_name, caller.key)
        what = type(e).__name__ + (f": {str(e)[:300]}" if ctx.trusts_its_person else "")
        yield _arena_view("**Pair failed**: " + md_literal(ROUND_FAILED.format(what=what, ref=ref)), state=new,
                          kind="failed")


def _ahead_events(ahead, min_update_s: float) -> list | Iterator[dict] | None:
    """The events of a pair written ahead, as `arena_round` yields them (its latest progress while it
    still writes, then "done"), or None to write one now: none was written ahead, or it failed (a
    limit, a busy store: the fresh round says so again, with the present state of things)."""
    if ahead is None:
        return None
    if ahead.finished.is_set() and ahead.done is None:
        return None

    def events():
        shown = None
        while not ahead.finished.wait(min_update_s):
            if ahead.progress is not None and ahead.progress is not shown:
                shown = ahead.progress
                yield shown
        if ahead.done is None:
            raise ahead.error if isinstance(ahead.error, Exception) else UserError("the pair could not be written; "
                                                                                  "press New pair")
        yield ahead.done
    return events()


ARENA_CHOICES = {"a": "A is better", "b": "B is better", "tie": "a tie"}


def arena_vote_view(ctx, caller: Caller, state: dict | None, winner: str) -> dict:
    """The Arena tab's vote buttons: store the one vote on the pair shown (web/arena.py
    `arena_vote`) and reveal which team states wrote A and B. Returns {"result" (Markdown),
    "state" (voted: the page then asks the next pair, `arena_next_events`), "can_vote", "voted"}.
    No pair, a pair already voted, a refused vote (a limit, another session's pair): a message in
    the result line, the state unchanged, never an exception."""
    st = dict(state or arena_new_state())
    if st.get("match_id") is None:
        return {"result": "**No vote**: there is no pair to vote on yet: pick a task and press **New pair**",
                "state": st, "can_vote": False, "voted": False}
    if st.get("voted"):
        return {"result": "**No vote**: this pair has its vote already; press **New pair** for another",
                "state": st, "can_vote": False, "voted": False}
    try:
        out = arena_vote(ctx, caller, st["match_id"], winner)
    except UserError as e:
        return {"result": "**Vote not saved**: " + md_literal(str(e)), "state": st, "can_vote": True, "voted": False}
    st["voted"] = True
    a, b = md_literal(out["a"]["label"]), md_literal(out["b"]["label"])
    return {"result": (f"**Vote saved** ({ARENA_CHOICES[out['winner']]}) on pair #{out['match_id']}: "
                       f"**A was {a}, B was {b}**. The next pair is written below. Votes grade the team states "
                       "on the leaderboard (Training tab); they do not train the team."),
            "state": st, "can_vote": False, "voted": True}


def arena_next_events(ctx, caller: Caller, state: dict | None, min_update_s: float = 0.1, rng=None) -> Iterator[dict]:
    """After a stored vote, the next pair at once (`arena_pair_events`) on the same task: the same
    own text if the voted pair had one, else another held-out example. Nothing (no event) when the
    vote was not stored: the pair shown stays, to vote on again."""
    st = state or {}
    if not (st.get("voted") and st.get("task")):
        return
    yield from arena_pair_events(ctx, caller, st["task"], st.get("text") or "", st, min_update_s, rng)


ARENA_BOARD_HEADERS = ["task", "team state", "rating", "95% interval", "votes", "W / L / T", "serving now"]
ARENA_NO_VOTES = ("**No votes yet.** Vote in the **Arena** tab: two versions of the team (e.g. the base model "
                  "and a trained step) answer the same prompt unlabelled, you pick the better answer, and the "
                  "votes rank the team's states here: a learning curve graded by people.")


def arena_board_view(ctx, render: Any = None, rounds: int = 200) -> tuple:
    """The Training tab's leaderboard, (Markdown, table rows, rating figure or None), the same for
    every visitor: computed at most once per `ctx.shared_ttl_s` (ctx.shared_views), as
    `training_view`. `render(fig)` turns the figure into what is sent (ui.py: gr.Plot's own
    postprocess); None keeps the matplotlib figure."""
    def compute():
        boards = arena_boards(ctx, rounds)
        fig = None
        if any(b["votes"] for b in boards):
            from collab_app.web.plots import arena_rating_figure
            fig = arena_rating_figure(boards)
            if render is not None:
                fig = render(fig)
        return arena_board_text(boards), arena_board_rows(boards), fig
    return ctx.shared_views.get(("arena_board", render, rounds), compute)


def arena_boards(ctx, rounds: int = 200) -> list[dict]:
    """web/arena.py `arena_board` of every arena task; a task whose board cannot be read (its team
    gone) is logged and left out: the Training tab never breaks on it."""
    boards = []
    for name in arena_tasks(ctx):
        try:
            boards.append(arena_board(ctx, name, rounds=rounds))
        except Exception:  # noqa: BLE001 - one task's board must not take the tab down
            log.exception("the arena board of %r could not be computed", name)
    return boards


def arena_board_text(boards: list[dict], top: int = 5) -> str:
    """"N votes from M voters" per task, with the votes of the `top` most active voters (counts
    only: the board is shown to everyone, and who voted is nobody else's business); how to get
    votes where there are none."""
    voted = [b for b in boards if b["votes"]]
    if not voted:
        return ARENA_NO_VOTES
    lines = []
    for b in voted:
        counts = list(b["voters"].values())
        n, m = b["votes"], len(counts)
        most = ", ".join(str(c) for c in counts[:top]) + (" …" if m > top else "")
        lines.append(f"**{b['task']}**: {n} vote{'s' if n != 1 else ''} from {m} voter{'s' if m != 1 else ''} "
                     f"(votes per voter, most first: {most})")
    for b in boards:
        if not b["votes"]:
            lines.append(f"**{b['task']}**: no votes yet (vote in the **Arena** tab)")
    return "\n\n".join(lines)


def _plain_label(row: dict) -> str:
    return row["label"].replace(" (serving now)", "")


def arena_board_rows(boards: list[dict]) -> list[list]:
    """Table rows (ARENA_BOARD_HEADERS), best first per task, for the tasks with votes."""
    rows = []
    for b in boards:
        if not b["votes"]:
            continue
        for s in b["states"]:
            rows.append([b["task"], _plain_label(s), round(s["rating"]), f"{s['low']:.0f} – {s['high']:.0f}",
                         s["votes"], f"{s['wins']} / {s['losses']} / {s['ties']}", "✓" if s["serving"] else ""])
    return rows


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
