"""The agent table both engines keep: agent -> (adapter handle, served version).

A handle is whatever the backend serves an agent's adapter by (a peft adapter name, a vLLM
`LoRARequest`, a TeamLoRA key on vLLM's CPU path); None = the base model. Not thread-safe by itself: the
engines call it under their own lock.
"""
from __future__ import annotations

from collab_app.engines.engine_types import EngineError


class AgentTable:
    def __init__(self, max_agents: int | None = None, why_limit: str = ""):
        self.max_agents = max_agents        # None = no limit
        self.why_limit = why_limit          # how to lift the limit, for the error
        self._rows: dict[str, tuple[object | None, int | None]] = {}

    def __contains__(self, agent: str) -> bool:
        return agent in self._rows

    def __iter__(self):
        return iter(self._rows)

    def register(self, agent: str) -> None:
        """Make `agent` known (base model until an adapter is set)."""
        if agent not in self._rows and self.max_agents is not None and len(self._rows) >= self.max_agents:
            raise EngineError(f"this engine holds at most {self.max_agents} agents ({sorted(self._rows)} known); "
                              f"{self.why_limit or 'start it with a larger num_agents'}")
        self._rows.setdefault(agent, (None, None))

    def _row(self, agent: str):
        if agent not in self._rows:
            raise EngineError(f"unknown agent {agent!r}; known: {sorted(self._rows)}")
        return self._rows[agent]

    def version(self, agent: str) -> int | None:
        return self._row(agent)[1]

    def handle(self, agent: str):
        return self._row(agent)[0]

    def served(self, agent: str) -> tuple[object | None, int | None]:
        """(handle, version) of `agent`: what a batch starting now runs on."""
        return self._row(agent)

    def handles(self) -> list:
        return [h for h, _ in self._rows.values() if h is not None]

    def set(self, agent: str, handle, version: int | None):
        """Serve `handle` as `agent`'s `version` (None, None = base); returns the old handle,
        which the caller releases in its backend."""
        self.register(agent)
        old = self._rows[agent][0]
        self._rows[agent] = (handle, version if handle is not None else None)
        return old
