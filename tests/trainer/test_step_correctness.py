"""Tests that catch a broken trainer (issue 11 item 6): one step raises log pi where A > 0 and
lowers it where A < 0 (a flipped loss sign fails); an agent without a learning signal keeps its
weights and version bit for bit; each agent's optimizer steps on its OWN gradient (the agents get
different data, so swapped optimizers or mixed-up parameters fail); sequence_logprobs equals a
plain forward + log_softmax + gather; the ratio on an fp32 engine's samples is within 0.02 of 1."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from collab_app.engines.engine_types import Sample
from trainer.config import MAGRPOConfig
from trainer.magrpo import Group, MAGRPOTrainer, adapter_parameters, sequence_logprobs

ROLES = ("helper", "main")
# different data per agent: prompts and completions share no token between the two agents
DATA = {"helper": ([1, 504, 3060, 28, 2], [[907, 314, 253], [11, 12, 13, 14, 2]]),
        "main": ([1, 1200, 77, 640, 9, 2], [[4021, 88, 19, 300], [55, 56, 2]])}


def _trainer(model_path, tmp_path, **kw):
    task = SimpleNamespace(name="tldr", roles=ROLES, num_agents=2, level_names=())
    cfg = MAGRPOConfig(task="tldr", model=model_path, dtype="float32", keep_versions=0, micro_batch_size=16,
                       **{"learning_rate": 1e-3, **kw})
    return MAGRPOTrainer(cfg, task, str(tmp_path / "adapters"))


def _logps(trainer, agent) -> list[float]:
    """Sum of log pi over each of `agent`'s completions under its current adapter."""
    prompt, comps = DATA[agent]
    trainer.model.set_adapter(agent)
    with torch.no_grad():
        lp, _ = sequence_logprobs(trainer.model, [prompt] * len(comps), comps)
    return lp.sum(-1).tolist()


def _group(trainer, joint, returns) -> Group:
    samples = []
    for agent in ROLES:
        prompt, comps = DATA[agent]
        lp = _logps(trainer, agent)
        samples.append([Sample(agent=agent, adapter_version=trainer.versions[agent], prompt_token_ids=prompt,
                               text="x", token_ids=c, logprobs=[lp[i] / len(c)] * len(c),
                               meta={"sampling": {"temperature": 1.0, "top_p": 1.0}})   # the log-probs' own
                        for i, c in enumerate(comps)])
    return Group(task="tldr", example_id="e", turn=0, prompts=["x", "y"], samples=samples, joint=joint,
                 returns=list(returns), rewards=list(returns), levels=[{}] * len(joint))


def test_one_step_raises_logp_where_A_is_positive_and_lowers_it_where_negative(model_path, tmp_path):
    tr = _trainer(model_path, tmp_path)
    tr.update([_group(tr, [(0, 0), (1, 1)], [0.0, 0.0])])       # nothing to learn: B stays 0 ...
    tr.model.set_adapter("helper")
    with torch.no_grad():                                         # ... so give both adapters a non-zero B first
        for p in adapter_parameters(tr.model, "helper") + adapter_parameters(tr.model, "main"):
            p.add_(torch.randn_like(p) * 0.01)
    before = {a: _logps(tr, a) for a in ROLES}
    tr.update([_group(tr, [(0, 0), (1, 1)], [1.0, 0.0])])        # A = +0.5 for completion 0, -0.5 for 1
    for a in ROLES:
        after = _logps(tr, a)
        assert after[0] > before[a][0] + 1e-3, (a, before[a], after)   # A > 0: more likely
        assert after[1] < before[a][1] - 1e-3, (a, before[a], after)   # A < 0: less likely


def test_an_agent_without_signal_keeps_weights_version_and_optimizer(model_path, tmp_path):
    tr = _trainer(model_path, tmp_path)
    b_before = [p.detach().clone() for p in adapter_parameters(tr.model, "main")]
    a_before = [p.detach().clone() for p in adapter_parameters(tr.model, "helper")]
    # cross 2x2: the return depends only on the helper's choice, so main's credit is flat
    m = tr.update([_group(tr, [(0, 0), (0, 1), (1, 0), (1, 1)], [1.0, 1.0, 0.0, 0.0])])
    assert m["helper/trained_samples"] == 2 and m["main/trained_samples"] == 0
    assert tr.versions == {"helper": 1, "main": 0}
    assert all(torch.equal(p, q) for p, q in zip(adapter_parameters(tr.model, "main"), b_before))
    assert not tr.optimizers["main"].state
    assert any(not torch.equal(p, q) for p, q in zip(adapter_parameters(tr.model, "helper"), a_before))


def test_each_agent_steps_on_its_own_gradient(model_path, tmp_path):
    """AdamW's first moment after one step is (1 - beta1) * grad: compare it, per agent, with a
    gradient computed independently (plain -A * sum log pi on that agent's data)."""
    tr = _trainer(model_path, tmp_path, max_grad_norm=1e9)
    with torch.no_grad():                                         # non-zero B so every LoRA matrix gets a gradient
        for a in ROLES:
            for p in adapter_parameters(tr.model, a):
                p.add_(torch.randn_like(p) * 0.01)
    group = _group(tr, [(0, 0), (1, 1)], [1.0, 0.0])
    expected = {}
    for a in ROLES:
        prompt, comps = DATA[a]
        tr.model.set_adapter(a)
        tr.model.zero_grad(set_to_none=True)
        lp, _ = sequence_logprobs(tr.model, [prompt] * 2, comps)
        loss = -(0.5 * lp[0].sum() - 0.5 * lp[1].sum()) / 2       # A = +-0.5, mean over the 2 samples
        loss.backward()
        expected[a] = [p.grad.detach().clone() for p in adapter_parameters(tr.model, a)]
        tr.model.zero_grad(set_to_none=True)
    flat = {a: torch.cat([g.flatten() for g in expected[a]]) for a in ROLES}
    assert not torch.allclose(flat["helper"], flat["main"], atol=1e-6)    # the data really differ
    tr.update([group])
    for a in ROLES:
        moments = [tr.optimizers[a].state[p]["exp_avg"] for p in adapter_parameters(tr.model, a)]
        got = torch.cat([m.flatten() for m in moments])
        other = flat["main" if a == "helper" else "helper"]
        assert (got - 0.1 * flat[a]).norm() <= 1e-3 * (0.1 * flat[a]).norm(), a           # its own gradient
        assert (got - 0.1 * other).norm() >= 0.5 * (0.1 * flat[a]).norm(), a              # not the other's


def test_sequence_logprobs_equals_a_plain_forward(model_path, lora_adapter):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, lora_adapter(3)).eval()
    comps = [[907, 314, 253, 2], [300, 301], list(range(400, 420))]
    for prompts in ([[1, 504, 3060, 28, 2], list(range(100, 131)), [7, 8]],   # padded batch
                    [list(range(100, 131))] * 3):                             # shared prompt: its KV cache reused
        with torch.no_grad():
            got, mask = sequence_logprobs(model, prompts, comps)
            for b, (p, c) in enumerate(zip(prompts, comps)):      # one sequence at a time, no padding
                logits = model(input_ids=torch.tensor([p + c])).logits[0]            # (L, V)
                logp = torch.log_softmax(logits.float(), -1)[len(p) - 1:len(p) + len(c) - 1]   # (T, V)
                want = logp.gather(-1, torch.tensor(c)[:, None]).squeeze(-1)         # (T,)
                assert mask[b].sum() == len(c)
                assert torch.allclose(got[b, :len(c)], want, atol=1e-4), (b, got[b, :len(c)], want)


def test_length_passes_cut_where_padding_costs_more_than_a_pass():
    from trainer.magrpo import length_passes

    assert length_passes([64, 64, 64, 64]) == [[0, 1, 2, 3]]                    # nothing padded: one pass
    assert length_passes([64, 40, 27, 40]) == [[0], [1, 3], [2]]               # 195 positions + passes, not 264
    assert length_passes([64, 28, 64, 64]) == [[0, 2, 3], [1]]
    assert length_passes([30, 29, 28]) == [[0, 1, 2]]                          # 3 padded < one more pass (8)
    assert length_passes([5, 3, 1], pass_cost=0) == [[0], [1], [2]]
    assert length_passes([5, 3, 1], pass_cost=10**6) == [[0, 1, 2]]
    rows = length_passes([7, 1, 33, 2, 2, 19, 64, 1])
    assert sorted(i for p in rows for i in p) == list(range(8))                 # every row once


@pytest.mark.parametrize("comps", [
    [[907, 314, 253, 2], list(range(300, 320)), [5]],      # two passes: 20 | 4, 1
    [[5], list(range(300, 320)), [6], [7]],                # a pass of one-token completions: the prompt's state alone
])
def test_shared_prompt_gradient_equals_separate_sequences(model_path, comps):
    """The shared-prompt path lets gradients flow back through the reused KV cache, in each of
    its passes (`length_passes`), and gives each row its own log-probs in the rows' order."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    prompt = list(range(100, 140))
    weight = model.model.layers[0].self_attn.q_proj.weight
    logp, _ = sequence_logprobs(model, [prompt] * len(comps), comps)                  # (B, T)
    logp.sum().backward()
    shared = weight.grad.clone()
    model.zero_grad()
    alone = [sequence_logprobs(model, [prompt], [c])[0] for c in comps]                # (1, len(c)) each
    sum(a.sum() for a in alone).backward()
    # fp32 sums in another order: 1.0e-4 / 1.8e-4 of the gradient's norm for these two cases, with
    # one pass for all rows as well (the code before length_passes); no gradient through the cache
    # would miss the prompt's part of it
    assert (shared - weight.grad).norm() <= 1e-3 * weight.grad.norm()
    for b, a in enumerate(alone):
        assert torch.allclose(logp[b, :a.shape[1]], a[0], atol=1e-4) and (logp[b, a.shape[1]:] == 0).all()


@pytest.mark.slow
def test_ratio_on_fp32_engine_samples_is_within_002_of_one(model_path, tmp_path):
    from collab_app.engines.engine_hf import TransformersEngine
    from collab_app.engines.engine_types import Request, Sampling

    tr = _trainer(model_path, tmp_path)
    with torch.no_grad():                                         # a version that differs from the base
        for p in adapter_parameters(tr.model, "helper"):
            p.add_(torch.randn_like(p) * 0.05)
    tr.versions["helper"] += 1
    tr.save_version("helper", {"step": 1, "parent_version": 0, "metrics": {}})
    engine = TransformersEngine(model_path, dtype="float32", seed=0)
    engine.register_agent("helper")
    engine.load_adapter("helper", tr.adapter_path("helper"), tr.versions["helper"])
    (samples,) = engine.generate([Request("helper", "Write one sentence about rivers.")], 4,
                                 Sampling(max_new_tokens=24, temperature=1.0, seed=0))
    tr.model.set_adapter("helper")
    with torch.no_grad():
        lp, mask = sequence_logprobs(tr.model, [s.prompt_token_ids for s in samples],
                                     [s.token_ids for s in samples], tr.eos_token_ids)
    for b, s in enumerate(samples):
        n = int(mask[b].sum())
        ratio = torch.exp(lp[b, :n] - torch.tensor(s.logprobs[:n]))
        assert (ratio - 1).abs().max() <= 0.02, ratio
