"""A heterogeneous team in the trainer (issue 23): `helper` on the embedded SmolLM2 (Llama, 49,152
tokens), `main` on the tiny Qwen2 built in the tests (helpers/tiny_model.py: 1,027 tokens, its own
tokenizer). One frozen base per distinct model, each agent's adapter on its own base; one step
changes both adapters, each from its own log-probs only (AdamW's first moment equals that agent's
own gradient, computed independently on its own base); each version records its base, and a
resume onto a base the adapter does not fit is refused with the fix."""
from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

from collab_app.engines.engine_types import Sample
from trainer import adapters as versions_on_disk
from trainer.config import MAGRPOConfig
from trainer.magrpo import Group, MAGRPOTrainer, adapter_parameters, sequence_logprobs

ROLES = ("helper", "main")
# token ids of each agent's own vocabulary: helper's are SmolLM2's, main's the tiny model's (< 1,027)
DATA = {"helper": ([1, 504, 3060, 28, 2], [[907, 314, 253], [11, 12, 13, 14, 2]]),
        "main": ([5, 300, 77, 640, 9, 12], [[421, 88, 19, 300], [55, 56, 990]])}


def test_agent_models_are_checked_and_resolved_per_role():
    with pytest.raises(ValueError, match="1 entries for 2 agents: give one per agent"):
        MAGRPOConfig(agent_models=("/m",))
    with pytest.raises(ValueError, match="mixes ROLE=MODEL entries with plain ones"):
        MAGRPOConfig(agent_models=("main=/m", "/n"))
    with pytest.raises(ValueError, match="each role once"):
        MAGRPOConfig(agent_models=("main=/m", "main=/n"))
    assert MAGRPOConfig(model="/base", agent_models=["", "/m"]).models_for(ROLES) == ["/base", "/m"]
    assert MAGRPOConfig(model="/base", agent_models=("main=/m",)).models_for(ROLES) == ["/base", "/m"]
    assert MAGRPOConfig(model="/base").models_for(("a", "b", "c")) == ["/base"] * 3
    with pytest.raises(ValueError, match="3 agents"):
        MAGRPOConfig(model="/base", agent_models=("", "/m")).models_for(("a", "b", "c"))


def _trainer(model_path, tiny, adapters_dir, **kw):
    task = SimpleNamespace(name="tldr", roles=ROLES, num_agents=2, level_names=())
    cfg = MAGRPOConfig(task="tldr", model=model_path, agent_models=("", tiny), dtype="float32", keep_versions=0,
                       micro_batch_size=16, learning_rate=1e-3, **kw)
    return MAGRPOTrainer(cfg, task, str(adapters_dir))


def _logps(tr, agent) -> list[float]:
    prompt, comps = DATA[agent]
    model = tr.model_of[agent]
    model.set_adapter(agent)
    with torch.no_grad():
        lp, _ = sequence_logprobs(model, [prompt] * len(comps), comps)
    return lp.sum(-1).tolist()


def _group(tr, returns) -> Group:
    samples = []
    for agent in ROLES:
        prompt, comps = DATA[agent]
        lp = _logps(tr, agent)
        samples.append([Sample(agent=agent, adapter_version=tr.versions[agent], prompt_token_ids=prompt, text="x",
                               token_ids=c, logprobs=[lp[i] / len(c)] * len(c),
                               meta={"sampling": {"temperature": 1.0, "top_p": 1.0}})   # the log-probs' own
                        for i, c in enumerate(comps)])
    return Group(task="tldr", example_id="e", turn=0, prompts=["x", "y"], samples=samples, joint=[(0, 0), (1, 1)],
                 returns=list(returns), rewards=list(returns), levels=[{}, {}])


def test_each_agent_trains_on_its_own_base_from_its_own_logprobs(model_path, tiny_model_path, tmp_path):
    tr = _trainer(model_path, tiny_model_path, tmp_path / "adapters", max_grad_norm=1e9)
    helper, main = tr.model_of["helper"], tr.model_of["main"]
    assert helper is not tr.model_of["main"] and len(tr.models) == 2
    assert helper.get_base_model().config.model_type == "llama" and main.get_base_model().config.model_type == "qwen2"
    assert helper.get_base_model().config.vocab_size != main.get_base_model().config.vocab_size
    assert tr.base_of == {"helper": model_path, "main": tiny_model_path}
    with pytest.raises(ValueError, match="no LoRA adapter named"):
        adapter_parameters(main, "helper")                       # each base holds only its own agents' adapters
    for agent in ROLES:                                           # version 0 says which base it is on
        meta = versions_on_disk.read_meta(versions_on_disk.version_dir(str(tmp_path / "adapters"), agent, 0))
        assert meta["base_model"] == tr.base_of[agent]

    with torch.no_grad():                                         # non-zero B: every LoRA matrix gets a gradient
        for a in ROLES:
            for p in adapter_parameters(tr.model_of[a], a):
                p.add_(torch.randn_like(p) * 0.01)
    before = {a: [p.detach().clone() for p in adapter_parameters(tr.model_of[a], a)] for a in ROLES}
    expected = {}
    for a in ROLES:                                               # -A * sum log pi on the agent's own base
        prompt, comps = DATA[a]
        model = tr.model_of[a]
        model.set_adapter(a)
        model.zero_grad(set_to_none=True)
        lp, _ = sequence_logprobs(model, [prompt] * 2, comps)
        (-(0.5 * lp[0].sum() - 0.5 * lp[1].sum()) / 2).backward()
        expected[a] = torch.cat([p.grad.detach().flatten() for p in adapter_parameters(model, a)])
        model.zero_grad(set_to_none=True)
    m = tr.update([_group(tr, [1.0, 0.0])])
    assert tr.versions == {"helper": 1, "main": 1}
    assert m["helper/trained_samples"] == m["main/trained_samples"] == 2
    for a in ROLES:
        after = adapter_parameters(tr.model_of[a], a)
        assert any(not torch.equal(p, q) for p, q in zip(after, before[a])), f"{a}'s adapter did not change"
        got = torch.cat([tr.optimizers[a].state[p]["exp_avg"].flatten() for p in after])
        assert (got - 0.1 * expected[a]).norm() <= 1e-3 * (0.1 * expected[a]).norm(), a   # its own gradient only
        path = versions_on_disk.version_dir(str(tmp_path / "adapters"), a, 1)
        assert versions_on_disk.read_meta(path)["base_model"] == tr.base_of[a]
        assert json.load(open(os.path.join(path, "adapter_config.json")))["r"] == 8


def test_resume_puts_each_agent_back_on_its_base_and_refuses_another(model_path, tiny_model_path, tmp_path):
    tr = _trainer(model_path, tiny_model_path, tmp_path / "adapters")
    with torch.no_grad():
        for p in adapter_parameters(tr.model_of["main"], "main"):
            p.add_(0.01)
    tr.update([_group(tr, [1.0, 0.0])])
    weights = [p.detach().clone() for p in adapter_parameters(tr.model_of["main"], "main")]
    again = _trainer(model_path, tiny_model_path, tmp_path / "adapters")
    assert again.versions == tr.versions and again.step == 1
    assert all(torch.equal(p, q) for p, q in zip(adapter_parameters(again.model_of["main"], "main"), weights))
    task = SimpleNamespace(name="tldr", roles=ROLES, num_agents=2, level_names=())
    with pytest.raises(ValueError, match="does not fit its base now"):   # main's tiny-Qwen2 adapter on SmolLM2
        MAGRPOTrainer(MAGRPOConfig(task="tldr", model=model_path, dtype="float32"), task, str(tmp_path / "adapters"))
