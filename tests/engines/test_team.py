"""Team.generate: [example][agent][g] layout, one batched call per engine, role prompts."""
from __future__ import annotations

import pytest

from collab_app.engines.engine_types import EngineError, Sampling
from collab_app.engines.team import Agent, Team

SAMPLING = Sampling(max_new_tokens=8, temperature=0.8, seed=0)


class CountingEngine:
    """The real engine, counting engine calls (a generate or a stream; delegates everything)."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def generate(self, requests, n, sampling):
        self.calls.append([r.agent for r in requests])
        return self.engine.generate(requests, n, sampling)

    def generate_stream(self, requests, n, sampling):
        self.calls.append([r.agent for r in requests])
        yield from self.engine.generate_stream(requests, n, sampling)

    def __getattr__(self, name):
        return getattr(self.engine, name)


def test_default_team_has_two_agents():
    assert [a.name for a in Team().agents] == ["helper", "main"] and Team().num_agents == 2


def test_generate_layout_and_one_call(hf_engine, lora_adapter):
    team = Team([Agent("helper", "You write helper functions."), Agent("main", "You write the main function.")])
    hf_engine.register_agent("helper")
    hf_engine.load_adapter("main", lora_adapter(1), 1)
    eng = CountingEngine(hf_engine)
    prompts = [["help 1", "main 1"], ["help 2", "main 2"], ["help 3", "main 3"]]
    out = team.generate(eng, prompts, 2, SAMPLING)
    assert len(eng.calls) == 1 and len(eng.calls[0]) == 6
    assert len(out) == 3 and all(len(ex) == 2 and all(len(g) == 2 for g in ex) for ex in out)
    for e, ex in enumerate(out):
        for i, (agent, samples) in enumerate(zip(("helper", "main"), ex)):
            prompt = hf_engine.tokenizer.decode(samples[0].prompt_token_ids)
            assert all(s.agent == agent for s in samples)
            assert prompts[e][i] in prompt and team.agents[i].role_prompt in prompt
    assert out[0][1][0].adapter_version == 1 and out[0][0][0].adapter_version is None


def test_single_agent_team(hf_engine):
    team = Team([Agent("solo")])
    hf_engine.register_agent("solo")
    out = team.generate(hf_engine, [["Say hi."]], 3, SAMPLING)
    assert len(out[0]) == 1 and len(out[0][0]) == 3


def test_heterogeneous_team_one_call_per_engine(model_path):
    team = Team([Agent("helper"), Agent("main", model=model_path)])
    engines = team.make_engines("transformers")
    assert engines["helper"] is not engines["main"]
    counted = {k: CountingEngine(v) for k, v in engines.items()}
    out = team.generate(counted, [["a", "b"], ["c", "d"]], 1, SAMPLING)
    assert counted["helper"].calls == [["helper", "helper"]] and counted["main"].calls == [["main", "main"]]
    assert [[g[0].agent for g in ex] for ex in out] == [["helper", "main"]] * 2


def test_bad_team_and_prompts(hf_engine):
    with pytest.raises(EngineError, match="at least one agent"):
        Team([])
    with pytest.raises(EngineError, match="unique"):
        Team([Agent("x"), Agent("x")])
    with pytest.raises(EngineError, match="one per agent"):
        Team().generate(hf_engine, [["only one"]], 1, SAMPLING)
