"""Tempered log-probs, recorded sampling: the engine's behaviour log-probs are those of the
distribution that drew the tokens (softmax(logits / T)), every sample records its sampling, the
trainer divides its logits by each sample's own T (so the ratio is 1 on the engine's samples and
the gradient is that of the tempered objective), and groups it cannot reproduce (greedy, top_p <
1) are refused with the reason. On the tiny Qwen2 (helpers/tiny_model.py) in fp32: an exactness
check at T = 0.7, where the untempered log-probs (the old convention) are far outside the band."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from collab_app.engines.engine_types import Request, Sample, Sampling
from trainer import adapters as versions_on_disk
from trainer.config import MAGRPOConfig
from trainer.magrpo import Group, MAGRPOTrainer, adapter_parameters, sequence_logprobs

ROLES = ("helper", "main")
T = 0.7
PROMPT = [5, 300, 77, 640, 9, 12]                  # tiny-vocabulary ids (< 1,027), no special tokens
COMPS = [[421, 88, 19], [55, 56, 990, 17, 31]]


def _trainer(tiny, tmp_path, **kw) -> MAGRPOTrainer:
    task = SimpleNamespace(name="tldr", roles=ROLES, num_agents=2, level_names=())
    cfg = MAGRPOConfig(**{"task": "tldr", "model": tiny, "dtype": "float32", "keep_versions": 0,
                          "micro_batch_size": 16, "learning_rate": 1e-3, "max_grad_norm": 1e9,
                          "temperature": 1.0, **kw})        # cfg's T is not the samples': the samples' must count
    tr = MAGRPOTrainer(cfg, task, str(tmp_path / "adapters"))
    with torch.no_grad():                                   # non-zero B: the adapters change the outputs
        for a in ROLES:
            for p in adapter_parameters(tr.model_of[a], a):
                p.add_(torch.randn_like(p) * 0.2)
    return tr


def _logps(tr, agent, prompts, comps, temperature) -> torch.Tensor:
    model = tr.model_of[agent]
    model.set_adapter(agent)
    with torch.no_grad():
        lp, _ = sequence_logprobs(model, prompts, comps, tr.eos_of[agent], temperature)
    return lp                                                                  # (B, T)


def _group(tr, sampling: dict | None, returns=(1.0, 0.0), gid=None, version=None) -> Group:
    """One group of COMPS for both agents, `sampling` recorded (None: nothing), behaviour log-probs
    the trainer's own at the T it will use (the recorded one, else cfg.temperature)."""
    temp = sampling["temperature"] if sampling and sampling["temperature"] > 0 else tr.cfg.temperature
    samples = []
    for agent in ROLES:
        lp = _logps(tr, agent, [PROMPT] * 2, COMPS, temp)
        samples.append([Sample(agent=agent, adapter_version=tr.versions[agent] if version is None else version,
                               prompt_token_ids=PROMPT, text="x", token_ids=c, logprobs=lp[i, :len(c)].tolist(),
                               meta={} if sampling is None else {"sampling": dict(sampling)})
                        for i, c in enumerate(COMPS)])
    return Group(task="tldr", example_id="e", turn=0, prompts=["x", "y"], samples=samples, joint=[(0, 0), (1, 1)],
                 returns=list(returns), rewards=list(returns), levels=[{}, {}], id=gid)


@pytest.fixture(scope="module")
def peaked(tiny_model_path, tmp_path_factory) -> str:
    """The tiny model with its final norm's weight x 8: logits of std ~1.3 instead of ~0.16, a
    distribution as peaked as a real model's rather than near-uniform, so that temperature matters."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = str(tmp_path_factory.mktemp("tiny-peaked"))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.mul_(8.0)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(folder)
    return folder


@pytest.fixture
def tr(peaked, tmp_path):
    return _trainer(peaked, tmp_path)


def test_engine_logprobs_at_T_are_the_trainers_tempered_ones(tr):
    """The exactness check: the transformers engine samples at T = 0.7 from the trainer's version;
    its behaviour log-probs equal the trainer's teacher-forced log softmax(logits / 0.7) token for
    token (fp32 noise), the untempered ones do not; through update() (the samples stamped with
    another version, so their engine log-probs are the behaviour) every ratio is 1."""
    from collab_app.engines.engine_hf import TransformersEngine

    for a in ROLES:                                                         # the perturbed adapters as version 1
        tr.versions[a] += 1
        tr.save_version(a, {"step": 1, "parent_version": 0, "metrics": {}})
    engine = TransformersEngine(tr.cfg.model, dtype="float32", seed=0)
    for a in ROLES:
        engine.load_adapter(a, tr.adapter_path(a), 7)                       # stamped 7: off-policy for the trainer
    out = engine.generate([Request(a, "Write one sentence about rivers.") for a in ROLES], 4,
                          Sampling(max_new_tokens=16, temperature=T, seed=1))
    for agent, samples in zip(ROLES, out):
        assert all(s.meta["sampling"] == {"temperature": T, "top_p": 1.0} for s in samples)
        prompts, comps = [s.prompt_token_ids for s in samples], [s.token_ids for s in samples]
        tempered = _logps(tr, agent, prompts, comps, T)                     # (4, L)
        untempered = _logps(tr, agent, prompts, comps, 1.0)
        gaps, old_gaps = [], []
        for b, s in enumerate(samples):
            n = len(s.token_ids)
            gaps.append((tempered[b, :n] - torch.tensor(s.logprobs)).abs())
            old_gaps.append((untempered[b, :n] - torch.tensor(s.logprobs)).abs())
        gap, old = torch.cat(gaps), torch.cat(old_gaps)
        assert gap.max() < 1e-4, gap.max().item()                           # exact up to fp32 noise
        assert old.mean() > 0.05, old.mean().item()                         # the untempered ones are far off
    groups = [Group(task="tldr", example_id="e", turn=0, prompts=["x", "y"], samples=[out[0], out[1]],
                    joint=[(g, g) for g in range(4)], returns=[1.0, 0.0, 0.5, 0.2], rewards=[1.0, 0.0, 0.5, 0.2],
                    levels=[{}] * 4, id=1)]
    m = tr.update(groups)
    assert m["group_ids"] == [1] and m["refused_groups"] == {} and m["sampling_unrecorded"] == 0
    for a in ROLES:
        assert m[f"{a}/late_samples"] == 4
        assert abs(m[f"{a}/late_ratio_min"] - 1) < 1e-4 and abs(m[f"{a}/late_ratio_max"] - 1) < 1e-4


def test_the_step_is_the_gradient_of_the_tempered_objective(tr):
    """On-policy samples at T = 0.7: AdamW's first moment after one step is (1 - beta1) * grad of
    -A * sum log pi_0.7 (mean over the group), not of the untempered log pi_1."""
    group = _group(tr, {"temperature": T, "top_p": 1.0})
    expected = {}
    for temp in (T, 1.0):
        model = tr.model_of["helper"]
        model.set_adapter("helper")
        model.zero_grad(set_to_none=True)
        lp, _ = sequence_logprobs(model, [PROMPT] * 2, COMPS, tr.eos_of["helper"], temp)
        (-(0.5 * lp[0].sum() - 0.5 * lp[1].sum()) / 2).backward()            # A = +-0.5, weight 1/2 each
        expected[temp] = torch.cat([p.grad.flatten() for p in adapter_parameters(model, "helper")])
        model.zero_grad(set_to_none=True)
    assert (expected[T] - expected[1.0]).norm() > 0.05 * expected[T].norm()  # the temperature matters here
    m = tr.update([group])
    assert m["helper/ratio_mean"] == 1.0 and m["helper/engine_logprob_gap"] < 1e-5
    params = adapter_parameters(tr.model_of["helper"], "helper")
    got = torch.cat([tr.optimizers["helper"].state[p]["exp_avg"].flatten() for p in params])
    assert (got - 0.1 * expected[T]).norm() <= 1e-3 * (0.1 * expected[T]).norm()


def test_groups_the_trainer_cannot_reproduce_are_refused_with_the_reason(tr, tmp_path):
    """top_p < 1 or greedy: left out of the step and returned in refused_groups (id -> reason),
    never in group_ids; the saved versions' metrics carry the step's ids already."""
    groups = [_group(tr, {"temperature": T, "top_p": 1.0}, gid=10),
              _group(tr, {"temperature": T, "top_p": 0.9}, gid=11),
              _group(tr, {"temperature": 0.0, "top_p": 1.0}, gid=12)]
    m = tr.update(groups)
    assert m["group_ids"] == [10] and m["stale_group_ids"] == [] and m["groups"] == 1
    assert set(m["refused_groups"]) == {11, 12} and m["groups_refused"] == 2
    assert "top_p 0.9" in m["refused_groups"][11] and "greedily" in m["refused_groups"][12]
    for a in ROLES:
        saved = versions_on_disk.read_meta(tr.adapter_path(a))["metrics"]
        assert tr.versions[a] == 1 and saved["group_ids"] == [10] and saved["stale_group_ids"] == []
        assert set(saved["refused_groups"]) == {"11", "12"}                 # JSON: keys as strings
    m = tr.update(groups[1:])                                                # only refused groups: no step
    assert m["group_ids"] == [] and set(m["refused_groups"]) == {11, 12} and tr.versions == {"helper": 1, "main": 1}


def test_samples_without_recorded_sampling_are_taken_at_cfg_temperature_and_counted(peaked, tmp_path):
    """Samples stored before the engines recorded their sampling: the trainer's cfg.temperature,
    counted in `sampling_unrecorded`; their engine log-probs at that T give ratio 1 when late."""
    tr = _trainer(peaked, tmp_path, temperature=0.8)
    group = _group(tr, None, version=5)                                      # late: engine log-probs are the behaviour
    m = tr.update([group])
    assert m["sampling_unrecorded"] == 4 and m["group_ids"] == [None] and m["refused_groups"] == {}
    for a in ROLES:
        assert abs(m[f"{a}/late_ratio_min"] - 1) < 1e-5 and abs(m[f"{a}/late_ratio_max"] - 1) < 1e-5


def test_sequence_logprobs_divides_the_logits_by_the_temperature(tr):
    model = tr.model_of["helper"]
    model.set_adapter("helper")
    ids = torch.tensor([PROMPT + COMPS[1]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(PROMPT) - 1:-1].float()       # (5, V)
    want = torch.log_softmax(logits / T, -1).gather(1, torch.tensor(COMPS[1])[:, None])[:, 0]
    got = _logps(tr, "helper", [PROMPT], [COMPS[1]], T)[0]
    assert torch.allclose(got, want, atol=1e-5)
    with pytest.raises(ValueError, match="temperature > 0"):
        sequence_logprobs(model, [PROMPT], [COMPS[1]], temperature=0.0)
