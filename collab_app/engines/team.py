"""A team: N >= 1 agents (roles), each with its own LoRA adapter, generating together.

Homogeneous team (every `Agent.model` None): all agents share one engine and one base model, one
adapter each. Heterogeneous team: an agent with `model` set gets its own engine on that base
(`Team.make_engines`). Either way `Team.generate` makes ONE batched call per engine for a whole
batch of examples, and hands back samples indexed [example][agent][g].

`TeamEngine` is a heterogeneous team as ONE Engine (what `collab train --agent-models`, the app
and the trainer's self-play hold): one backend engine per distinct base (`make_team_engine`),
each request routed to its agent's engine, one batched call per engine and base, one after the
other; streaming, hot-swap (`load_adapter` goes to the agent's engine) and the Engine contract
as for one engine. Each base tokenizes with its own tokenizer and chat template, so a Sample's
prompt_token_ids are its agent's base's; `Sample.meta["model"]` names that base.
"""
from __future__ import annotations

from dataclasses import dataclass

from typing import Iterator

import os
import threading

from collab_app.engines.engine_types import Engine, EngineError, Progress, Request, Sample, Sampling


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
        from collab_app.engines.choose import make_engine

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
        from collab_app.engines.requests import stream

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


class TeamEngine:
    """One Engine over one backend engine per distinct base model: `engines[base]`, `base_of[agent]`.
    Requests are routed by agent; an engine's requests are one batched call (stream), the engines'
    calls one after the other (on a CPU they would only contend for the same cores). An agent not
    in `base_of` (registered later) goes on `default`, the team's default base."""

    def __init__(self, engines: dict[str, Engine], base_of: dict[str, str], default: str):
        if default not in engines or any(b not in engines for b in base_of.values()):
            raise EngineError(f"TeamEngine: every base needs an engine; bases {sorted(set(base_of.values()) | {default})}, "
                              f"engines {sorted(engines)}")
        self.engines, self.base_of, self.default = dict(engines), dict(base_of), default
        first = self.engines[default]
        self.name = getattr(first, "name", type(first).__name__)
        self.model_path = getattr(first, "model_path", default)   # the default base (the Team tab lists each agent's)
        lens = [getattr(e, "max_model_len", None) for e in self.engines.values()]
        if all(isinstance(n, int) for n in lens):
            self.max_model_len = min(lens)   # a prompt must fit every agent's engine (web/core.py checks this)
        self._tokenizers: dict[str, object] = {}   # base -> a private copy for prompt_token_counts
        self._tok_lock = threading.Lock()

    def engine_of(self, agent: str) -> Engine:
        return self.engines[self.base_of.get(agent, self.default)]

    def model_of(self, agent: str) -> str:
        """The base model `agent` runs on (its engine's folder)."""
        return self.base_of.get(agent, self.default)

    def register_agent(self, agent: str) -> None:
        self.base_of.setdefault(agent, self.default)
        self.engine_of(agent).register_agent(agent)

    def register_like(self, agent: str, like: str) -> None:
        """Register `agent` on the base of the known agent `like` (the arena's extra agents serve
        another version of `like`'s adapter)."""
        if like not in self.base_of:
            raise EngineError(f"unknown agent {like!r}; known: {sorted(self.base_of)}")
        self.base_of.setdefault(agent, self.base_of[like])
        self.engine_of(agent).register_agent(agent)

    def load_adapter(self, agent: str, path: str | None, version: int | None) -> None:
        if agent not in self.base_of:
            raise EngineError(f"unknown agent {agent!r}; known: {sorted(self.base_of)}: register it first")
        self.engine_of(agent).load_adapter(agent, path, version)

    def adapter_version(self, agent: str) -> int | None:
        if agent not in self.base_of:
            raise EngineError(f"unknown agent {agent!r}; known: {sorted(self.base_of)}")
        return self.engine_of(agent).adapter_version(agent)

    def generate(self, requests: list[Request], n: int, sampling: Sampling) -> list[list[Sample]]:
        last = None
        for last in self.generate_stream(requests, n, sampling):
            pass
        return last.result()  # type: ignore[union-attr]

    def generate_stream(self, requests: list[Request], n: int, sampling: Sampling):
        """Progress over every request (in the caller's order), one engine's stream after another:
        the first base's rows stream while the later bases' rows are still empty."""
        from collab_app.engines.requests import stream

        for i, r in enumerate(requests):
            if r.agent not in self.base_of:
                raise EngineError(f"request {i}: unknown agent {r.agent!r} (known: {sorted(self.base_of)}); "
                                  f"call register_agent({r.agent!r}) first")
        by_base: dict[str, list[int]] = {}
        for i, r in enumerate(requests):
            by_base.setdefault(self.model_of(r.agent), []).append(i)
        texts = [[""] * n for _ in requests]
        done: list[list[Sample | None]] = [[None] * n for _ in requests]
        for base, idx in by_base.items():
            for p in stream(self.engines[base], [requests[i] for i in idx], n, sampling):
                for k, i in enumerate(idx):
                    texts[i], done[i] = list(p.texts[k]), list(p.done[k])
                yield Progress([list(t) for t in texts], [list(d) for d in done])

    def prompt_token_counts(self, requests: list[Request]) -> list[int] | None:
        """Tokens of each request as its agent's engine counts them (its tokenizer and chat
        template), or None if some engine has no local tokenizer. Private tokenizer copies under a
        lock (web/context.py says why)."""
        import copy

        from collab_app.engines.requests import chat_prompt_ids

        counts = []
        with self._tok_lock:
            for r in requests:
                base = self.model_of(r.agent)
                if base not in self._tokenizers:
                    tok = getattr(self.engines[base], "tokenizer", None)
                    if tok is None:
                        return None
                    self._tokenizers[base] = copy.deepcopy(tok)
                counts.append(len(chat_prompt_ids(self._tokenizers[base], r)))
        return counts

    def memory(self) -> dict[str, dict]:
        """Per base: its agents and the bytes of its weights (`base_memory`)."""
        return {base: {"agents": sorted(a for a, b in self.base_of.items() if b == base), **base_memory(eng, base)}
                for base, eng in self.engines.items()}

    def close(self) -> None:
        for eng in self.engines.values():
            eng.close()


def base_memory(engine, path: str) -> dict:
    """{"weights_bytes": ...} of one base: the parameters the engine holds in memory where it exposes
    its torch model (transformers engine: `model`, in its dtype), else the weight files of its folder
    (safetensors / bin: vLLM and remote engines), with "how" saying which."""
    model = getattr(engine, "model", None)
    if model is not None and hasattr(model, "parameters"):
        return {"weights_bytes": sum(p.numel() * p.element_size() for p in model.parameters()), "how": "parameters"}
    size = 0
    if os.path.isdir(path):
        size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
                   if f.endswith((".safetensors", ".bin")))
    return {"weights_bytes": size, "how": "weight files"}


def make_team_engine(kind: str, model: str, agent_models: dict[str, str], **kw) -> Engine:
    """The engine for a team whose agents run on `agent_models[agent]` (a folder / HF id; "" or
    missing = `model`): the plain engine of `make_engine` when every agent is on `model` (a
    homogeneous team: exactly as before), else a TeamEngine with one engine per distinct base.
    `kw` goes to each make_engine; num_agents (vLLM's adapter slots) is each base's own count."""
    from collab_app.engines.choose import make_engine
    from collab_app.engines.model import ensure_model

    model = ensure_model(model or None)
    base_of = {a: ensure_model(m) if m else model for a, m in agent_models.items()}
    if set(base_of.values()) <= {model}:
        return make_engine(kind, model, **kw)
    engines: dict[str, Engine] = {}
    try:
        for base in dict.fromkeys([model, *base_of.values()]):
            sharing = max(1, sum(b == base for b in base_of.values()))
            engines[base] = make_engine(kind, base, **(kw | ({"num_agents": sharing} if "num_agents" in kw else {})))
    except BaseException:
        for eng in engines.values():
            eng.close()
        raise
    return TeamEngine(engines, base_of, model)
