"""A team: N >= 1 agents (roles), each with its own LoRA adapter, generating together.

Homogeneous team (every `Agent.model` None): all agents share one engine and one base model, one
adapter each. Heterogeneous team: an agent with `model` set gets its own engine on that base
(`Team.make_engines`). Either way `Team.generate` makes ONE batched call per engine for a whole
batch of examples, and hands back samples indexed [example][agent][g].
"""
from __future__ import annotations

from dataclasses import dataclass

from typing import Iterator

from collab_app.engines.engine_types import Engine, EngineError, Request, Sample, Sampling


@dataclass(frozen=True)
class Agent:
    name: str                 # the role, e.g. "helper" / "main"; also the engine's agent key
    role_prompt: str = ""     # system prompt for this role (may be empty)
    adapter: str | None = None  # peft adapter directory to serve at start (None = base model)
    model: str | None = None  # own base model (HF id / folder) -> heterogeneous team


class Team:
    def __init__(self, agents: list[Agent] | None = None):
        agents = list(agents) if agents is not None else [Agent("helper"), Agent("main")]
        if not agents:
            raise EngineError("a team needs at least one agent")
        names = [a.name for a in agents]
        if len(set(names)) != len(names):
            raise EngineError(f"agent names must be unique, got {names}")
        self.agents = agents

    @property
    def num_agents(self) -> int:
        return len(self.agents)

    def make_engines(self, kind: str = "auto", **kw) -> dict[str, Engine]:
        """One engine per distinct base model, agent name -> engine; agents registered and their
        start adapters (version 0) loaded. `kw` goes to `make_engine`."""
        from collab_app.engines import make_engine

        by_model: dict[str | None, Engine] = {}
        engines = {}
        for a in self.agents:
            if a.model not in by_model:
                sharing = sum(b.model == a.model for b in self.agents)
                by_model[a.model] = make_engine(kind, a.model, **({"num_agents": sharing} | kw))
            eng = engines[a.name] = by_model[a.model]
            eng.register_agent(a.name)
            if a.adapter:
                eng.load_adapter(a.name, a.adapter, 0)
        return engines

    def generate(self, engines: Engine | dict[str, Engine], prompts: list[list[str]], n: int,
                 sampling: Sampling) -> list[list[list[Sample]]]:
        """prompts[e][i] = agent i's prompt for example e. Returns samples[e][i][g] (g < n)."""
        last = None
        for last in self.generate_stream(engines, prompts, n, sampling):
            pass
        return last.done  # type: ignore[union-attr, return-value]

    def generate_stream(self, engines: Engine | dict[str, Engine], prompts: list[list[str]], n: int,
                        sampling: Sampling) -> Iterator["TeamProgress"]:
        """`generate`, streamed: yields TeamProgress snapshots (texts[e][i][g] so far, done[e][i][g]
        a Sample or None), the last with every sample done. One engine call (stream) per
        distinct engine, one after the other (a heterogeneous team's engines do not overlap)."""
        if not isinstance(engines, dict):
            engines = {a.name: engines for a in self.agents}
        for e, row in enumerate(prompts):
            if len(row) != self.num_agents:
                raise EngineError(f"example {e}: {len(row)} prompts for {self.num_agents} agents; give one per agent")
        groups: dict[int, tuple[Engine, list[tuple[int, int]]]] = {}  # id(engine) -> (engine, [(e, i)])
        for i, a in enumerate(self.agents):
            if a.name not in engines:
                raise EngineError(f"no engine for agent {a.name!r}; pass one engine or a dict with every agent")
            eng = engines[a.name]
            groups.setdefault(id(eng), (eng, []))[1].extend((e, i) for e in range(len(prompts)))
        from collab_app.engines import stream

        texts = [[[""] * n for _ in range(self.num_agents)] for _ in prompts]
        done: list[list[list[Sample | None]]] = [[[None] * n for _ in range(self.num_agents)] for _ in prompts]
        calls = [(eng, slots, [Request(self.agents[i].name, prompts[e][i], self.agents[i].role_prompt)
                               for e, i in slots]) for eng, slots in groups.values()]
        for eng, slots, reqs in calls:
            for p in stream(eng, reqs, n, sampling):
                for k, (e, i) in enumerate(slots):
                    texts[e][i] = list(p.texts[k])
                    done[e][i] = list(p.done[k])
                yield TeamProgress([[list(r) for r in ex] for ex in texts], [[list(r) for r in ex] for ex in done])


@dataclass
class TeamProgress:
    """A snapshot of `Team.generate_stream`: texts[e][i][g] decoded so far, done[e][i][g] the
    finished Sample or None. The last snapshot has every entry done."""

    texts: list[list[list[str]]]
    done: list[list[list[Sample | None]]]

    @property
    def finished(self) -> bool:
        return all(s is not None for ex in self.done for row in ex for s in row)
