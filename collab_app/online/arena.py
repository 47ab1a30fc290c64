"""Team states for the blind arena: which adapter versions of a task's agents answered together.

A *team state* is one adapter version per agent of a task's team (None: the base model). The
states a task has had are read from the store's adapter-version rows: the untrained `base` (which
also stands for the trainer's version 0, a fresh LoRA that writes what the base model writes),
then one state per training step that wrote a new version of some agent (the other agents keep
theirs), labelled by that step. The state being served (`current_state`: pinned versions win, as hot-swap
serves them) is one of them, or a combination no step produced (an admin pinned an old version of
one agent only), labelled by its versions.

The arena compares a few of them at a time (`arena_states`): base, the one being served, the newest
and earlier steps spread evenly in between, so a long history does not dilute the votes over
hundreds of states; votes already given to a state keep it on the board. A state whose adapter
folder is gone (pruned by `keep_versions`) cannot be served and is left out.

The key of a state (`state_key`) is what the store keeps with each vote ("base", or
"detail:v3,summary:v4"), so the board of a task can be recomputed from the votes alone.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

BASE = "base"


def state_key(versions: dict[str, int | None]) -> str:
    """'base' when every agent is the base model, else 'agent:vN,...' in agent-name order (base
    agents as 'agent:base')."""
    if all(v is None for v in versions.values()):
        return BASE
    return ",".join(f"{a}:{'base' if v is None else f'v{v}'}" for a, v in sorted(versions.items()))


@dataclass(frozen=True)
class TeamState:
    key: str
    versions: dict[str, int | None]          # agent -> adapter version (None: base model)
    step: int | None = None                  # the training step that made it (None: base / unknown)
    label: str = ""                          # what a person reads: "base", "step 7", "summary v3 · detail v1"
    paths: dict[str, str | None] = field(default_factory=dict)   # agent -> adapter folder (None: base)

    @property
    def is_base(self) -> bool:
        return self.key == BASE


def _label(versions: dict[str, int | None], step: int | None) -> str:
    if all(v is None for v in versions.values()):
        return "base"
    if step is not None:
        return f"step {step}"
    return " · ".join(f"{a} {'base' if v is None else f'v{v}'}" for a, v in versions.items())


def _base(agents: list[str]) -> TeamState:
    versions = {a: None for a in agents}
    return TeamState(BASE, versions, None, "base", {a: None for a in agents})


def _rows(store, agents: list[str]) -> list:
    return sorted((r for a in agents for r in store.adapter_versions(a)), key=lambda r: (r.created_at, r.version))


def _start(rows) -> int:
    """How many rows lead without a step: the team's start (the trainer's version 0 of each agent,
    recorded one agent at a time before any step). It is no state of its own: it is where training
    starts from (a fresh LoRA writes what the base model writes), so `base` stands for it."""
    n = 0
    while n < len(rows) and rows[n].step is None:
        n += 1
    return n


def team_states(store, agents: list[str]) -> list[TeamState]:
    """The states `agents` have had, oldest first: base, then one per step (or per version row
    without a step after the first step) that changed some agent's version. Versions before an
    agent's first row are the base model; the start rows (`_start`) carry into later states but
    make none."""
    rows = _rows(store, agents)
    versions: dict[str, int | None] = {a: None for a in agents}
    paths: dict[str, str | None] = {a: None for a in agents}
    states = [_base(agents)]
    i = _start(rows)
    for r in rows[:i]:
        versions[r.agent], paths[r.agent] = r.version, r.path
    while i < len(rows):
        step = rows[i].step
        j = i + 1
        while step is not None and j < len(rows) and rows[j].step == step:   # one step's versions together
            j += 1
        for r in rows[i:j]:
            versions[r.agent], paths[r.agent] = r.version, r.path
        v = dict(versions)
        states.append(TeamState(state_key(v), v, step, _label(v, step), dict(paths)))
        i = j
    seen, out = set(), []
    for s in states:                  # a state reached again (a version row per agent without steps) keeps its first label
        if s.key not in seen:
            seen.add(s.key)
            out.append(s)
    return out


def current_state(store, agents: list[str], states: list[TeamState] | None = None) -> TeamState:
    """The state being served: each agent's pinned version, else its newest (as hot-swap serves);
    the team's start (no step yet) is `base`."""
    current = store.current_adapter_versions()
    versions = {a: current[a][0] if a in current else None for a in agents}
    key = state_key(versions)
    states = states if states is not None else team_states(store, agents)
    for s in states:
        if s.key == key:
            return s
    rows = _rows(store, agents)
    start = {a: None for a in agents} | {r.agent: r.version for r in rows[:_start(rows)]}
    if state_key(start) == key:
        return states[0]
    return TeamState(key, versions, None, _label(versions, None),
                     {a: current[a][1] if a in current else None for a in agents})


def servable(state: TeamState, resolve=None) -> bool:
    """Every adapter folder of the state exists here (`resolve(agent, version, path)` maps a row's
    path to this host's, as hot-swap does)."""
    for agent, v in state.versions.items():
        if v is None:
            continue
        path = state.paths.get(agent)
        if path is None:
            return False
        if resolve is not None:
            path = resolve(agent, v, path)
        if not os.path.isdir(path):
            return False
    return True


def arena_states(states: list[TeamState], current: TeamState, voted: set[str] | frozenset = frozenset(),
                 max_states: int = 6) -> list[TeamState]:
    """The states the arena asks about, oldest first: base, `current`, the newest, every state that
    already has votes (`voted` keys), and earlier states spread evenly in between, up to
    `max_states` (the voted ones may exceed it: a state on the board stays there)."""
    if max_states < 2:
        raise ValueError("max_states must be >= 2 (a pair)")
    by_key = {s.key: s for s in states}
    if current.key not in by_key:
        by_key[current.key] = current
        states = states + [current]
    keep = {states[0].key, current.key, states[-1].key} | {k for k in voted if k in by_key}
    rest = [s for s in states if s.key not in keep]
    room = max_states - len(keep)
    if room > 0 and rest:
        # evenly spaced over the history, newest first when rounding
        picks = {rest[round((len(rest) - 1) * (k + 1) / room) if room > 1 else len(rest) - 1].key
                 for k in range(min(room, len(rest)))} if room < len(rest) else {s.key for s in rest}
        keep |= picks
    return [s for s in states if s.key in keep]
