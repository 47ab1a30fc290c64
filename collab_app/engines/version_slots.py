"""Version slots: a few extra engine agents that serve chosen adapter versions beside the team's own.

The team's agents serve each role's current version (hot-swap moves them). Something that needs an
*earlier* version of a role at the same time — the blind arena comparing team states
(web/arena.py) — leases a slot: slot i has one engine agent per role position k (`slot{i}_{k}`
with the prefix given), and `serve` loads a state (one (version, path) per role) into a free slot
unless a slot already holds it. Requests that name a slot's agents run on exactly those versions,
in the same batched engine call as any other agent, and hot-swap never touches them.

A slot leased by a pair in flight is never reloaded; a new state goes to the least recently used
free slot; with every slot busy `serve` waits (up to `wait_s`, then `SlotsBusy`). Loads take the
engine's lock (they wait for a running batch, as hot-swap's do). The engine must hold
`slots x largest team` agents more than the team's (web/context.py build_context sizes vLLM's
agent table so).
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

from collab_app.engines.engine_types import EngineError

DEFAULT_SLOTS = 3
"""states served at once: a pair needs 2; a third keeps a common one (the current team) resident."""


class SlotsBusy(EngineError):
    """Every slot serves a request in flight and none freed within the wait."""


class VersionSlots:
    def __init__(self, engine, lock, slots: int = DEFAULT_SLOTS, prefix: str = "arena",
                 resolve: Callable[[str, int | None, str], str] | None = None, wait_s: float = 60.0):
        """`lock`: the engine's (the app's engine_lock). `resolve(role, version, path)`: this host's
        folder for a version row's path (hot-swap's `resolve`), or None to load paths as given."""
        if slots < 1:
            raise ValueError("slots must be >= 1")
        self.engine, self.lock, self.prefix, self.resolve, self.wait_s = engine, lock, prefix, resolve, wait_s
        self._held: list[str | None] = [None] * slots     # key of the state each slot serves (None: empty)
        self._users = [0] * slots                         # leases in flight per slot
        self._used = [0.0] * slots                        # monotonic time of the last lease (LRU)
        self._cond = threading.Condition()
        self.loads = 0                                    # states loaded so far

    def agent(self, slot: int, k: int) -> str:
        return f"{self.prefix}{slot}_{k}"

    def held(self) -> list[str | None]:
        with self._cond:
            return list(self._held)

    @contextmanager
    def serve(self, states: list[tuple[str, dict[str, tuple[int | None, str | None]]]],
              roles: list[str]) -> Iterator[list[list[str]]]:
        """Lease one slot per state: `states` = [(key, {role: (version, path)})] with distinct keys
        (version None: the base model). Yields, per state, the engine agent of each of `roles`."""
        if len({k for k, _ in states}) != len(states) or len(states) > len(self._held):
            raise EngineError(f"serve takes 1..{len(self._held)} distinct states, got {[k for k, _ in states]}")
        deadline = time.monotonic() + self.wait_s
        with self._cond:
            while True:
                chosen: dict[int, int] = {}          # state index -> slot
                for n, (key, _) in enumerate(states):
                    if key in self._held:
                        chosen[n] = self._held.index(key)
                missing = [n for n in range(len(states)) if n not in chosen]
                spare = [i for i in range(len(self._held)) if self._users[i] == 0 and i not in chosen.values()]
                if len(spare) >= len(missing):
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SlotsBusy(f"all {len(self._held)} version slots serve requests in flight")
                self._cond.wait(left)
            for n in missing:
                i = min(spare, key=lambda s: self._used[s])
                spare.remove(i)
                self._held[i] = None                 # half-loaded until every role is in
                self._load(i, states[n][1], roles)
                self._held[i] = states[n][0]
                chosen[n] = i
            for i in chosen.values():
                self._users[i] += 1
                self._used[i] = time.monotonic()
        try:
            yield [[self.agent(chosen[n], k) for k in range(len(roles))] for n in range(len(states))]
        finally:
            with self._cond:
                for i in chosen.values():
                    self._users[i] -= 1
                self._cond.notify_all()

    def _load(self, slot: int, versions: dict[str, tuple[int | None, str | None]], roles: list[str]) -> None:
        self.loads += 1
        for k, role in enumerate(roles):
            name = self.agent(slot, k)
            v, path = versions.get(role, (None, None))
            if v is None:
                path = None
            elif path is not None and self.resolve is not None:
                path = self.resolve(role, v, path)
            with self.lock:   # the engine's: waits for a running batch
                like = getattr(self.engine, "register_like", None)
                if like is not None:
                    like(name, role)             # a heterogeneous team: the role's own base
                else:
                    self.engine.register_agent(name)
                self.engine.load_adapter(name, path, v)
