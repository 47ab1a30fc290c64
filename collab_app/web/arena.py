"""The blind arena's core: two team states answer one prompt side by side, unlabelled; a person votes.

Both doors call these (the page's Arena tab, /v1/arena); every check and limit is here, as in
core.py for rounds and ratings.

- `arena_round(ctx, caller, task, text, example_id)`: picks a pair of team states (online/arena.py:
  which states; online/leaderboard.py `choose_pair`: which pair is informative), writes one joint
  answer of each in ONE engine call, streamed, and stores the pair before the last event (what was
  shown is the server's record, never the voter's word). It counts as a round against
  `ctx.limits` (per identity and per network). The sides' order is random; nothing in what the
  person sees names a state.
- `arena_vote(ctx, caller, match_id, winner)`: the one vote on a pair, by the session it was made
  for (or an admin), counted against the ratings' limits (per identity, per network, everyone
  together); only then are the labels revealed.
- `arena_board(ctx, task)`: the Bradley–Terry leaderboard of the task's states from its stored
  votes, with bootstrap intervals, votes per state and per voter.

How an old state is served beside the current one: engines/version_slots.py `VersionSlots`
(`ctx.arena_slots()`) loads each side's adapter versions into extra engine agents; both sides of a
pair run on slots, in one engine call, so hot-swap of the shared team's agents never changes a pair
halfway.
Votes are evaluation only: they never become returns (a design choice the docs explain).
"""
from __future__ import annotations

import logging
import random
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

from collab_app.online.arena import TeamState, arena_states, current_state, servable, team_states
from collab_app.online.returns import PRIVATE_TASKS
from collab_app.web.access import Caller, UserError
from collab_app.web.core import NO_SESSION, _rating_not_saved, _rating_session, clean_text

log = logging.getLogger(__name__)

MAX_STATES = 6
"""states of a task the arena asks about (online/arena.py `arena_states`)."""
SIDES = ("a", "b")


@contextmanager
def _slots(ctx, sides, roles):
    from collab_app.engines.engine_types import EngineError
    from collab_app.engines.version_slots import SlotsBusy

    want = [(s.key, {r: (s.versions.get(r), s.paths.get(r)) for r in roles}) for s in sides]
    try:
        lease = ctx.arena_slots().serve(want, roles)
        agents = lease.__enter__()
    except SlotsBusy as e:
        raise UserError(f"the arena is busy: {e}; try again in a few seconds", "busy", 5) from None
    except EngineError as e:
        raise UserError(f"the arena cannot serve these team states on this engine: {e}", "engine_refused") from None
    try:
        yield agents
    finally:
        lease.__exit__(None, None, None)


def arena_tasks(ctx) -> list[str]:
    """The tasks the arena compares states of: every served task but a person's own problems."""
    return [t for t in ctx.tasks if t not in PRIVATE_TASKS]


def _check_task(ctx, task_name: str):
    if task_name not in arena_tasks(ctx):
        raise UserError(f"unknown arena task {task_name!r}: pick one of {arena_tasks(ctx)}")
    return ctx.tasks[task_name]


def _votes(ctx, task_name: str):
    from collab_app.online.leaderboard import Vote

    return [Vote(m.state_a, m.state_b, m.winner, m.voter or "") for m in ctx.store.arena_matches(task_name)]


def _history(ctx, task_name: str) -> tuple[list[TeamState], TeamState]:
    """(every state the task's team has had, oldest first; the one being served): one read of the
    version rows."""
    roles = [a.name for a in ctx.team_for(task_name).agents]
    history = team_states(ctx.store, roles)
    return history, current_state(ctx.store, roles, history)


def task_states(ctx, task_name: str, votes=None, history=None) -> tuple[list[TeamState], TeamState]:
    """(the states the arena asks about, oldest first; the one being served) for a task's team
    (`history`: `_history`'s answer when the caller has it)."""
    history, current = history or _history(ctx, task_name)
    votes = _votes(ctx, task_name) if votes is None else votes
    voted = {k for v in votes for k in (v.a, v.b)}
    resolve = ctx.adapter_watcher().resolve
    ok = [s for s in history if servable(s, resolve)]
    if current.key not in {s.key for s in ok} and servable(current, resolve):
        ok.append(current)
    if not ok:
        return [], current
    return arena_states(ok, current if servable(current, resolve) else ok[-1], voted, MAX_STATES), current


def _example(ctx, task, text: str, example_id: str | None, rng: random.Random) -> dict:
    if text and text.strip():
        if task.kind != "writing":
            raise UserError("the arena takes your own text on writing tasks; on a coding task it asks one of the task's "
                            "problems (leave the text empty)")
        try:
            return task.from_text(clean_text(text, "text", ctx.max_prompt_chars))
        except ValueError as e:
            raise UserError(str(e)) from None
    pool = task.examples("eval") or task.examples("train")
    if example_id:
        for ex in pool:
            if ex["id"] == example_id:
                return ex
        raise UserError(f"no example {example_id!r} in {task.name}'s held-out split")
    return rng.choice(pool)


def choose_states(ctx, task_name: str, rng: random.Random) -> tuple[TeamState, TeamState]:
    """The next pair for `task_name` (online/leaderboard.py `choose_pair` over the task's states and
    its board), in the random order shown as a, b."""
    from collab_app.online.leaderboard import choose_pair, standings

    votes = _votes(ctx, task_name)
    states, _ = task_states(ctx, task_name, votes)
    if len(states) < 2:
        raise UserError(f"nothing to compare yet: the {task_name} team has one state ({states[0].label if states else 'base'})."
                        " Rate some rounds; once the trainer has made a step, the arena compares it with the base team",
                        "nothing_to_compare")
    keys = [s.key for s in states]
    board = standings([v for v in votes if v.a in keys and v.b in keys], keys, rounds=50) if votes else None
    a, b = choose_pair(keys, board, rng)
    by_key = {s.key: s for s in states}
    return by_key[a], by_key[b]


def public_match(match, task) -> dict:
    """What a voter sees of a pair before voting: no state, no version."""
    return {"match_id": match.id, "task": match.task, "example_id": match.example_id,
            "prompt": _shown_prompt(match.example), "roles": list(task.roles),
            "a": {"outputs": list(match.outputs_a), "combined": match.combined_a},
            "b": {"outputs": list(match.outputs_b), "combined": match.combined_b}}


def _shown_prompt(example: dict) -> str:
    for key in ("text", "prompt", "post", "document"):
        if isinstance(example.get(key), str):
            return example[key]
    return str(example.get("id", ""))


def arena_round(ctx, caller: Caller, task_name: str, text: str = "", example_id: str | None = None,
                rng: random.Random | None = None, min_update_s: float = 0.1) -> Iterator[dict]:
    """One blind pair, streamed: {"kind": "progress", "message", "a": [text per role], "b": [...]}
    events while the two sides write, then {"kind": "done", "match": public_match(...), "message"}
    once the pair is stored. Counts as a round of `caller` (ctx.limits)."""
    if not caller.session_id:
        raise UserError(NO_SESSION, "no_session")
    task = _check_task(ctx, task_name)
    rng = rng or random.Random()
    example = _example(ctx, task, text, example_id, rng)
    sides = choose_states(ctx, task_name, rng)
    from collab_app.engines.team import Agent, Team
    from collab_app.web.core import check_prompt_tokens
    from tasks.base import check_prompts

    team = ctx.team_for(task_name)
    roles = [a.name for a in team.agents]
    prompts = check_prompts(task, task.agent_prompts(example, []))
    with ctx.team_settings_lock:
        sampling = ctx.sampling
    check_prompt_tokens(ctx, team, prompts, sampling)
    ctx.limits.begin_round(caller)
    try:
        with _slots(ctx, sides, roles) as agents:
            pair = Team([Agent(name, a.role_prompt) for names in agents for name, a in zip(names, team.agents)])
            yield from _write(ctx, caller, task, task_name, example, prompts, sides, pair, len(roles), sampling, min_update_s)
    finally:
        ctx.limits.end_round(caller)


def _write(ctx, caller, task, task_name, example, prompts, sides, pair, n_roles, sampling, min_update_s):
    from collab_app.engines.engine_types import EngineError, sampling_meta

    t0 = time.monotonic()
    ticket = ctx.batcher().submit(pair, prompts + prompts, 1, sampling)   # side a's roles, then side b's
    last, samples = 0.0, None
    try:
        while samples is None:
            ev = ticket.events.get()
            if ev[0] == "error":
                if isinstance(ev[1], EngineError):
                    raise UserError(f"the engine refused this prompt: {ev[1]}", "engine_refused") from None
                raise ev[1]
            if ev[0] == "done":
                samples = ev[1]
                break
            now = time.monotonic()
            if now - last >= min_update_s:
                last = now
                texts = [row[0] for row in ev[1]]
                yield {"kind": "progress", "message": f"two teams are writing ... {now - t0:.0f} s",
                       "a": texts[:n_roles], "b": texts[n_roles:]}
    finally:
        ticket.cancel()
    outs = [[row[0].text for row in samples[:n_roles]], [row[0].text for row in samples[n_roles:]]]
    served = [{role: row[0].adapter_version for role, row in zip(task.roles, part)}
              for part in (samples[:n_roles], samples[n_roles:])]
    from collab_app.online.arena import state_key

    keys = [state_key(v) for v in served]
    if keys[0] == keys[1]:   # cannot happen with distinct states in slots; never store a pair of one state
        raise UserError("the two sides came out of the same team state; ask for another pair", "busy", 1)
    try:
        match_id = ctx.store.add_arena_match(
            task_name, example, prompts, keys[0], keys[1], served[0], served[1], outs[0], outs[1],
            combined_a=task.combine(example, outs[0]), combined_b=task.combine(example, outs[1]),
            sampling=sampling_meta(sampling) | {"max_new_tokens": sampling.max_new_tokens},
            session_id=caller.session_id)
    except Exception as e:
        refusal = _rating_not_saved(e)
        if refusal is None:
            raise
        raise UserError(f"the pair was written but not stored, so it cannot be voted on: {refusal}", refusal.code,
                        refusal.retry_after) from None
    match = ctx.store.arena_match(match_id)
    yield {"kind": "done", "match": public_match(match, task),
           "message": f"pair #{match_id} in {time.monotonic() - t0:.1f} s: which answer is better?"}


def arena_pair(ctx, caller: Caller, task_name: str, text: str = "", example_id: str | None = None,
               rng: random.Random | None = None) -> dict:
    """`arena_round` to its end: the public pair (for /v1 and scripts)."""
    last = None
    for last in arena_round(ctx, caller, task_name, text, example_id, rng):
        pass
    return last["match"]


class Ahead:
    """The next pair of one person, written in the background while they read the current one
    (`write_ahead`), so that a vote's next pair is there at once. A real round of theirs: it counts
    against their limits (per identity and network; while it writes, their rounds in flight too)."""

    def __init__(self, task: str, text: str, example_id: str | None):
        self.task, self.text, self.example_id = task, text, example_id
        self.progress: dict | None = None       # the latest progress event
        self.done: dict | None = None           # the final event
        self.error: BaseException | None = None
        self.started = time.monotonic()
        self.finished = threading.Event()


AHEAD_WAIT_S = 120.0
"""longest wait for a pair written ahead another way to finish before a new one starts."""
MAX_AHEAD = 1000
"""people whose next pair is kept at once (the oldest dropped beyond: a pair is already stored)."""


def write_ahead(ctx, caller: Caller, task_name: str, text: str, example_id: str | None,
                rng: random.Random | None = None) -> Ahead | None:
    """Start writing `caller`'s next pair in a background thread (none if one is already kept for
    them). Returns it, or None when one was there."""
    aheads = ctx.arena_ahead
    with ctx.team_settings_lock:
        if caller.key in aheads:
            return None
        ahead = aheads[caller.key] = Ahead(task_name, text or "", example_id)
        while len(aheads) > MAX_AHEAD:
            aheads.pop(next(iter(aheads)))

    def run():
        try:
            for ev in arena_round(ctx, caller, task_name, text, example_id, rng):
                if ev["kind"] == "done":
                    ahead.done = ev
                else:
                    ahead.progress = ev
        except BaseException as e:  # noqa: BLE001 - told to whoever takes it (a limit, a busy store)
            ahead.error = e
        finally:
            ahead.finished.set()

    threading.Thread(target=run, name="collab-arena-ahead", daemon=True).start()
    return ahead


def take_ahead(ctx, caller: Caller, task_name: str, text: str) -> Ahead | None:
    """`caller`'s pair written ahead for this task and text (own text, or "" for held-out ones), or
    None. One asked another way is dropped (its pair is stored, unvoted), after it has finished: it
    holds the caller's round in flight until then."""
    with ctx.team_settings_lock:
        ahead = ctx.arena_ahead.pop(caller.key, None)
    if ahead is None:
        return None
    if ahead.task == task_name and ahead.text == (text or ""):
        return ahead
    ahead.finished.wait(AHEAD_WAIT_S)
    return None


def _reveal(state_key_: str, versions: dict, labels: dict[str, str]) -> dict:
    return {"state": state_key_, "label": labels.get(state_key_, state_key_), "versions": versions}


def state_labels(ctx, task_name: str, history=None) -> dict[str, str]:
    """state key -> label ("base", "step 7"), "(serving now)" after the current one."""
    history, current = history or _history(ctx, task_name)
    labels = {s.key: s.label for s in history}
    labels[current.key] = f"{current.label} (serving now)"
    return labels


def arena_vote(ctx, caller: Caller, match_id: Any, winner: Any, token: str = "") -> dict:
    """Store the one vote on a pair: `winner` "a", "b" or "tie". Returns {"match_id", "winner",
    "a": {"state", "label", "versions"}, "b": ..., "message"}: the labels, shown only now."""
    from collab_app.web.core import _id

    mid = _id(match_id, "pair id")
    w = str(winner).strip().lower() if isinstance(winner, str) else None
    if w not in ("a", "b", "tie"):
        raise UserError(f"a vote is 'a', 'b' or 'tie', got {winner!r:.20}")
    session = _rating_session(ctx, caller, token)
    voter = caller.rater or "admin"
    ctx.limits.take_ratings(caller, 1)
    signed_in = caller.signed_in or session is None
    try:
        m = ctx.store.add_arena_vote(mid, w, voter, session_id=session, network=caller.network, signed_in=signed_in)
    except Exception as e:   # nothing stored: the caller's budget is as it was
        ctx.limits.give_back_ratings(caller, 1)
        refusal = _rating_not_saved(e)
        if refusal is None:
            raise
        raise UserError(str(refusal).replace("rating not saved", "vote not saved"), refusal.code,
                        refusal.retry_after) from None
    labels = state_labels(ctx, m.task)
    a, b = _reveal(m.state_a, m.versions_a, labels), _reveal(m.state_b, m.versions_b, labels)
    said = {"a": f"you preferred A ({a['label']}) over B ({b['label']})",
            "b": f"you preferred B ({b['label']}) over A ({a['label']})",
            "tie": f"a tie between A ({a['label']}) and B ({b['label']})"}[w]
    return {"match_id": m.id, "winner": w, "a": a, "b": b,
            "message": f"vote saved: {said}. Votes grade the team states on the leaderboard; they do not train the team."}


def arena_board(ctx, task_name: str, rounds: int = 200) -> dict:
    """The task's leaderboard: {"task", "votes", "voters": {voter: n}, "states": [{"state", "label",
    "step", "serving", "rating", "low", "high", "votes", "wins", "losses", "ties"}, best first]}.
    States: those the arena asks about and every state with votes."""
    from collab_app.online.leaderboard import per_voter, standings

    _check_task(ctx, task_name)
    votes = _votes(ctx, task_name)
    known = _history(ctx, task_name)
    states, current = task_states(ctx, task_name, votes, known)
    keys = list(dict.fromkeys([s.key for s in states] + [k for v in votes for k in (v.a, v.b)]))
    labels = state_labels(ctx, task_name, known)
    steps = {s.key: s.step for s in known[0]}   # a state with votes that is no longer asked keeps its step
    board = standings(votes, keys, rounds=rounds) if keys else []
    rows = [{"state": st.state, "label": labels.get(st.state, st.state), "step": steps.get(st.state),
             "serving": st.state == current.key, "rating": st.rating, "low": st.low, "high": st.high,
             "votes": st.votes, "wins": st.wins, "losses": st.losses, "ties": st.ties} for st in board]
    return {"task": task_name, "votes": len(votes), "voters": per_voter(votes), "states": rows}
