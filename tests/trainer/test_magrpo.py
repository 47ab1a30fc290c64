"""MAGRPO's pieces against hand-computed values: advantages, cross-mode credit, multi-turn
returns and early termination, the rollout's batching, pad masking in the log-probs, the
importance ratio / clipping, staleness, and the config's validation rules."""
from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch

from collab_app.engines.engine_types import Sample
from tasks.base import Reward
from trainer.config import MAGRPOConfig
from trainer.configcli import field_docs, parse_config
from trainer.offline import refill, scheduled_learning_rate
from trainer.magrpo import (Group, MAGRPOTrainer, RewardError, advantages, agent_returns, compute_returns,
                            join_trees, joint_actions, rollout, sequence_logprobs,
                            split_trees)
from helpers.trainer_groups import on_policy_groups


# ------------------------------------------------------------------------------- advantages
@pytest.mark.parametrize("mode, expected", [
    ("mean", [-2.0, -1.0, 0.0, 3.0]),               # R - 3
    ("rloo", [1 - 11 / 3, 2 - 10 / 3, 3 - 9 / 3, 6 - 6 / 3]),  # R - mean of the other three
    ("max", [-5.0, -4.0, -3.0, 0.0]),               # R - 6
    ("raw", [1.0, 2.0, 3.0, 6.0]),
])
def test_advantages_by_hand(mode, expected):
    assert advantages([1.0, 2.0, 3.0, 6.0], mode) == pytest.approx(expected)


def test_advantages_normalized_by_population_std():
    std = math.sqrt((4 + 1 + 0 + 9) / 4)             # pstdev([1, 2, 3, 6])
    got = advantages([1.0, 2.0, 3.0, 6.0], "mean", normalize_std=True)
    assert got == pytest.approx([a / (std + 1e-4) for a in (-2.0, -1.0, 0.0, 3.0)])


def test_zero_variance_group_has_zero_advantage_even_normalized():
    assert advantages([0.5, 0.5, 0.5], "mean", normalize_std=True) == [0.0, 0.0, 0.0]
    assert advantages([0.5, 0.5], "rloo") == [0.0, 0.0]


def test_advantages_need_siblings():
    with pytest.raises(ValueError, match="siblings"):
        advantages([1.0], "mean")


# ------------------------------------------------------------------------------- joint actions
def test_joint_actions_aligned_and_cross():
    assert joint_actions(3, 2, "aligned") == [(0, 0), (1, 1), (2, 2)]
    assert joint_actions(2, 2, "cross") == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert len(joint_actions(3, 3, "cross")) == 27


def _group(joint, returns, G=2, N=2, parent=None, rewards=None):
    return Group(task="t", example_id="e", turn=0, prompts=["p"] * N, samples=[[None] * G for _ in range(N)],
                 joint=joint, returns=list(returns), rewards=list(rewards if rewards is not None else returns),
                 parent=parent)


def test_cross_credit_2x2_by_hand():
    # joint returns: (a0,b0)=1, (a0,b1)=3, (a1,b0)=0, (a1,b1)=4
    g = _group([(0, 0), (0, 1), (1, 0), (1, 1)], [1.0, 3.0, 0.0, 4.0])
    assert agent_returns(g, 0, "mean") == [2.0, 2.0]      # a0: mean(1, 3); a1: mean(0, 4)
    assert agent_returns(g, 1, "mean") == [0.5, 3.5]      # b0: mean(1, 0); b1: mean(3, 4)
    assert agent_returns(g, 0, "max") == [3.0, 4.0]
    assert agent_returns(g, 1, "max") == [1.0, 4.0]
    assert advantages(agent_returns(g, 0), "mean") == [0.0, 0.0]    # agent a's choice did not matter on average
    assert advantages(agent_returns(g, 1), "mean") == [-1.5, 1.5]   # agent b's did


def test_aligned_credit_is_the_joint_return():
    g = _group([(0, 0), (1, 1)], [2.0, 5.0])
    assert agent_returns(g, 0) == agent_returns(g, 1) == [2.0, 5.0]


# ------------------------------------------------------------------------------- returns
def test_multi_turn_returns_by_hand():
    """root -> child A (joint 0), child B (joint 1) -> grandchild of B's joint 1; gamma 0.5."""
    groups = [
        _group([(0, 0), (1, 1)], [], rewards=[1.0, 0.0]),
        _group([(0, 0), (1, 1)], [], rewards=[2.0, 4.0], parent=(0, 0)),
        _group([(0, 0), (1, 1)], [], rewards=[0.0, 1.0], parent=(0, 1)),
        _group([(0, 0), (1, 1)], [], rewards=[3.0, 3.0], parent=(2, 1)),
    ]
    compute_returns(groups, gamma=0.5)
    assert groups[3].returns == [3.0, 3.0]
    assert groups[2].returns == [0.0, 1.0 + 0.5 * 3.0]              # only joint 1 has a child
    assert groups[1].returns == [2.0, 4.0]
    assert groups[0].returns == [1.0 + 0.5 * 3.0, 0.0 + 0.5 * 1.25]  # mean(2, 4) = 3; mean(0, 2.5) = 1.25


# ------------------------------------------------------------------------------- rollout
class ScriptedEngine:
    """Test double of the Sampler: text "<agent><j>d<depth>" where depth = turns in the prompt."""

    def __init__(self):
        self.calls = []

    def sample(self, requests, n, *, max_new_tokens, temperature, top_p, seed):
        self.calls.append((list(requests), n))
        return [[Sample(agent=a, adapter_version=0, prompt_token_ids=[1, 2], text=f"{a}{j}d{p.count('FB')}",
                        token_ids=[5, 6], logprobs=[-1.0, -1.0]) for j in range(n)] for a, p in requests]

    def load_adapter(self, agent, path, version):
        pass


class ScriptedTask:
    """Two agents; reward = sample index j at depth 0, 2.0 at depth 1; feedback 'FB'."""

    name, num_agents, roles, max_reward, level_names = "scripted", 2, ("a", "b"), 2.0, ("score",)

    def __init__(self, fail_on=None):
        self.fail_on = fail_on
        self.seen_histories = []

    def examples(self, split):
        return [{"id": "e0"}, {"id": "e1"}]

    def agent_prompts(self, example, history, earlier=()):
        self.seen_histories.append(history)
        fb = " ".join(t.feedback[0] for t in history)
        return [f"{example['id']} {r} {fb}".strip() for r in self.roles]

    def combine(self, example, outputs):
        return "\n".join(outputs)

    def reward(self, example, outputs):
        if self.fail_on and outputs[0] == self.fail_on:
            raise ZeroDivisionError("boom")
        j, depth = int(outputs[0][1]), int(outputs[0].split("d")[1])
        r = float(j) if depth == 0 else 2.0
        return Reward(total=r, levels={"score": r}, max_total=2.0)

    def feedback(self, example, outputs):
        return ["FB", "FB"]


def _cfg(**kw):
    base = dict(num_generations=2, num_turns=2, gamma=0.5, model="unused")
    return MAGRPOConfig(**{**base, **kw})


def test_rollout_batches_all_agents_and_prompts_in_one_call_per_turn():
    eng, task = ScriptedEngine(), ScriptedTask()
    groups = rollout(eng, task, task.examples("train"), _cfg(num_turns=1))
    assert len(eng.calls) == 1
    requests, n = eng.calls[0]
    assert n == 2 and [a for a, _ in requests] == ["a", "b", "a", "b"]
    assert [g.example_id for g in groups] == ["e0", "e1"]
    assert groups[0].returns == [0.0, 1.0] and groups[0].levels == [{"score": 0.0}, {"score": 1.0}]


def test_rollout_tree_two_turns():
    eng, task = ScriptedEngine(), ScriptedTask()
    groups = rollout(eng, task, task.examples("train")[:1], _cfg())
    assert len(eng.calls) == 2 and len(eng.calls[1][0]) == 2 * 2     # 2 child nodes x 2 agents in one call
    root, c0, c1 = groups
    assert (c0.parent, c1.parent) == ((0, 0), (0, 1)) and (c0.turn, c1.turn) == (1, 1)
    assert c1.prompts[0].endswith("FB")                               # the feedback reached turn 2
    hist = task.seen_histories[-1]
    assert hist[0].outputs == ("a1d0", "b1d0")                        # child of joint action 1
    assert c0.returns == [2.0, 2.0]
    assert root.rewards == [0.0, 1.0]
    assert root.returns == [0.0 + 0.5 * 2.0, 1.0 + 0.5 * 2.0]


def test_rollout_early_termination_is_per_group():
    task = ScriptedTask()
    # root mean reward 0.5 reaches the threshold: no second turn, returns = rewards
    groups = rollout(ScriptedEngine(), task, task.examples("train")[:1], _cfg(early_stop_threshold=0.5))
    assert len(groups) == 1 and groups[0].returns == [0.0, 1.0]
    groups = rollout(ScriptedEngine(), task, task.examples("train")[:1], _cfg(early_stop_threshold=0.6))
    assert len(groups) == 3


def test_rollout_cross_mode_scores_every_combination():
    task = ScriptedTask()
    groups = rollout(ScriptedEngine(), task, task.examples("train")[:1], _cfg(num_turns=1, joint_mode="cross"))
    assert groups[0].joint == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert groups[0].returns == [0.0, 0.0, 1.0, 1.0]                  # reward follows agent a's sample


def test_reward_that_raises_is_an_error_with_the_outputs():
    task = ScriptedTask(fail_on="a1d0")
    with pytest.raises(RewardError, match=r"e0.*ZeroDivisionError.*a1d0"):
        rollout(ScriptedEngine(), task, task.examples("train")[:1], _cfg(num_turns=1))


# ------------------------------------------------------------------------------- dynamic sampling
class FlatTask(ScriptedTask):
    """Six examples; e0, e1 and e2 give every joint action the same reward (no signal)."""

    def examples(self, split):
        return [{"id": f"e{i}"} for i in range(6)]

    def reward(self, example, outputs):
        if example["id"] in ("e0", "e1", "e2"):
            return Reward(total=1.0, levels={"score": 1.0}, max_total=2.0)
        return super().reward(example, outputs)


def test_split_and_join_trees_keep_parents():
    task = ScriptedTask()
    groups = rollout(ScriptedEngine(), task, task.examples("train"), _cfg())   # 2 prompts x (1 + 2 children)
    trees = split_trees(groups)
    assert [len(t) for t in trees] == [3, 3] and all(t[0].parent is None for t in trees)
    assert all(g.example_id == t[0].example_id and g.parent[0] == 0 for t in trees for g in t[1:])
    joined = join_trees(trees[::-1])                                            # order changed: parents follow
    assert [g.parent for g in joined] == [None, (0, 0), (0, 1), None, (3, 0), (3, 1)]


def _refill(task, batch, **kw):
    cfg = _cfg(num_turns=1, prompts_per_step=len(batch), **kw)
    groups = rollout(ScriptedEngine(), task, batch, cfg)
    return refill(ScriptedEngine(), task, cfg, 0, task.examples("train"), groups, {})


def test_dynamic_sampling_replaces_flat_prompts_with_fresh_ones():
    task = FlatTask()
    exs = task.examples("train")
    groups, m = _refill(task, [exs[0], exs[3]], dynamic_sampling=3)
    assert m["dynamic/flat_prompts"] == 1 and m["dynamic/prompts_trained"] == 2
    ids = [g.example_id for g in groups if g.parent is None]
    assert "e0" not in ids and ids[0] == "e3" and len(set(ids)) == 2           # a fresh prompt, never a repeat
    assert all(max(g.returns) > min(g.returns) for g in groups)
    assert 1 <= m["dynamic/extra_prompts"] <= 3                                   # fresh draws may be flat too


def test_dynamic_sampling_stops_after_its_extra_rollouts():
    task = FlatTask()
    exs = task.examples("train")
    groups, m = _refill(task, exs[:3], dynamic_sampling=0)                      # all flat, no refill allowed
    assert groups == [] and m == {"dynamic/flat_prompts": 3, "dynamic/extra_prompts": 0,
                                  "dynamic/prompts_trained": 0}


# ------------------------------------------------------------------------------- learning rate
def test_learning_rate_schedules():
    lr = lambda step, secs=0.0, **kw: scheduled_learning_rate(_cfg(learning_rate=1.0, num_steps=10, **kw), step, secs)  # noqa: E731
    assert [lr(s) for s in (0, 5, 9)] == [1.0, 1.0, 1.0]
    assert [lr(s, lr_schedule="linear") for s in (0, 5, 10)] == [1.0, 0.5, 0.0]
    assert lr(5, lr_schedule="cosine") == pytest.approx(0.5) and lr(10, lr_schedule="cosine") == pytest.approx(0.0)
    assert [lr(s, warmup_steps=3) for s in (0, 1, 2, 3)] == [0.25, 0.5, 0.75, 1.0]
    assert lr(3, warmup_steps=2, lr_schedule="linear") == pytest.approx(1 - 1 / 8)
    # a time budget that ends first drives the decay: 15 of 30 minutes = half way at step 1 of 10
    assert lr(1, 15 * 60.0, lr_schedule="linear", max_minutes=30.0) == pytest.approx(0.5)
    assert lr(1, 40 * 60.0, lr_schedule="linear", max_minutes=30.0) == 0.0


# ------------------------------------------------------------------------------- log-probs
@pytest.fixture(scope="module")
def model_fp32(model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


def test_padding_does_not_change_logprobs(model_fp32):
    short_p, short_c = [1, 504, 3060, 28, 2], [907, 314, 253, 2]
    long_p, long_c = list(range(100, 140)), list(range(300, 330))
    with torch.no_grad():
        alone, m1 = sequence_logprobs(model_fp32, [short_p], [short_c])
        batched, m2 = sequence_logprobs(model_fp32, [long_p, short_p], [long_c, short_c])
    assert m1.sum() == 4 and m2[1].sum() == 4 and m2[0].sum() == 30
    assert torch.allclose(alone[0], batched[1, :4], atol=1e-4)
    assert (batched[1, 4:] == 0).all()                                 # padded positions are 0


def test_tokens_after_eos_are_masked(model_fp32):
    eos = 2
    p, c = [1, 504, 3060, 28], [907, 314, eos]
    with torch.no_grad():
        clean, m_clean = sequence_logprobs(model_fp32, [p], [c], {eos})
        padded, m_pad = sequence_logprobs(model_fp32, [p], [c + [eos, eos, 17, 99]], {eos})
    assert m_clean.sum() == m_pad.sum() == 3
    assert torch.allclose(clean.sum(), padded.sum(), atol=1e-5)
    assert torch.isfinite(clean).all() and (clean[0, :3] < 0).all()


# ------------------------------------------------------------------------------- update
@pytest.fixture(scope="module")
def trainer(model_path, tmp_path_factory):
    from tasks import load_task
    from trainer.magrpo import MAGRPOTrainer

    cfg = MAGRPOConfig(task="tldr", model=model_path, dtype="float32", learning_rate=1e-3, max_staleness=0,
                       keep_versions=0, micro_batch_size=16)
    return MAGRPOTrainer(cfg, load_task("tldr"), str(tmp_path_factory.mktemp("adapters")))


def test_ratio_is_one_when_nothing_moved_then_versions_advance(trainer):
    before = dict(trainer.versions)
    m = trainer.update(on_policy_groups(trainer))
    for agent in trainer.agents:
        assert m[f"{agent}/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
        assert m[f"{agent}/clip_frac"] == 0.0
        assert m[f"{agent}/grad_norm"] > 0 and m[f"{agent}/trained_samples"] == 4
        assert m[f"{agent}/kl"] == pytest.approx(0.0, abs=1e-5)          # version 0 is the base model
        assert trainer.versions[agent] == before[agent] + 1 == m[f"{agent}/version"]
    assert m["zero_variance_frac"] == 0.0 and m["return_mean"] == 0.5


def test_clipping_binds_only_where_it_should(trainer):
    # late samples (one version behind) whose engine log-probs are 1 nat lower: ratio = e > 1 + eps
    # on every token. Positive-advantage samples are clipped (no gradient), negative ones are not:
    # clip_frac = their token share.
    if min(trainer.versions.values()) == 0:
        trainer.update(on_policy_groups(trainer))
    m = trainer.update(on_policy_groups(trainer, shift=-1.0, late=True))
    a = trainer.agents[0]
    assert m["late_groups"] == 2 and m[f"{a}/late_samples"] == 4
    assert m[f"{a}/ratio_mean"] == pytest.approx(math.e, rel=1e-4)
    assert m[f"{a}/late_ratio_mean"] == pytest.approx(math.e, rel=1e-4)
    assert m[f"{a}/late_ratio_min"] == pytest.approx(math.e, rel=1e-4) == m[f"{a}/late_ratio_max"]
    assert m[f"{a}/clip_frac"] == pytest.approx(3 / 8)                    # A>0 on the 3-token completion, A<0 on the 5-token one
    assert m[f"{a}/late_clip_frac"] == pytest.approx(3 / 8)


def test_the_logged_kl_is_k3_to_the_base_on_the_first_micro_batchs_rows(trainer):
    # kl_coef 0: the logged KL takes the adapter's side from the step's own forward and computes
    # only the base's (MAGRPOTrainer._kl_estimate); it must equal both sides computed apart
    if min(trainer.versions.values()) == 0:
        trainer.update(on_policy_groups(trainer))
    groups = on_policy_groups(trainer)
    expected = {}
    for i, agent in enumerate(trainer.agents):
        rows = groups[0].samples[i]              # the first micro-batch: the first prompt's siblings
        prompts, comps = [s.prompt_token_ids for s in rows], [s.token_ids for s in rows]
        trainer.model.set_adapter(agent)
        with torch.no_grad():
            logp, mask = sequence_logprobs(trainer.model, prompts, comps, trainer.eos_token_ids)   # (2, T)
            with trainer.model.disable_adapter():
                ref, _ = sequence_logprobs(trainer.model, prompts, comps, trainer.eos_token_ids)   # (2, T)
        d = ref - logp
        expected[agent] = float(((d.exp() - d - 1) * mask).sum() / mask.sum())
    m = trainer.update(groups)
    for agent in trainer.agents:
        assert expected[agent] > 1e-6, "the adapters have not moved: the check would be vacuous"
        assert m[f"{agent}/kl"] == pytest.approx(expected[agent], rel=1e-4)


def test_on_policy_samples_use_the_trainers_own_logprobs(trainer):
    # engine log-probs 1 nat off (bf16 noise, exaggerated) on samples of the current version:
    # behaviour = the trainer's own log-probs, so the ratio is exactly 1 and nothing is clipped
    m = trainer.update(on_policy_groups(trainer, shift=-1.0))
    for a in trainer.agents:
        assert m[f"{a}/ratio_mean"] == 1.0 and m[f"{a}/clip_frac"] == 0.0
        assert m[f"{a}/late_samples"] == 0 and math.isnan(m[f"{a}/late_ratio_mean"])
        assert m[f"{a}/engine_logprob_gap"] == pytest.approx(1.0, abs=1e-4)
    assert m["late_groups"] == 0


def test_a_step_offers_to_pause_between_its_pieces_and_reports_the_time(trainer):
    """trainer.pause (lending.CoreLease.pause under `collab trainer --core-lease`) is offered after
    every decoder layer's forward and backward, each micro-batch's forward and backward and each
    agent; what it returns adds up to the step's time/paused_s (0 when nothing paused)."""
    import traceback

    model = trainer.model_of[trainer.agents[0]]
    layers = sum(type(m).__name__ in set(model._no_split_modules) for m in model.modules())
    hooks_before = sum(len(m._forward_hooks) for m in model.modules())
    calls = []   # per call: True if offered from inside loss.backward()

    def pause():
        calls.append(any(f.name == "_engine_run_backward" for f in traceback.extract_stack()))
        return 0.25

    done = []   # pieces_done: once, after every pause point and before the versions are saved
    trainer.hooks.pause, trainer.hooks.pieces_done = pause, lambda: done.append((len(calls), dict(trainer.versions)))
    before = dict(trainer.versions)
    try:
        m = trainer.update(on_policy_groups(trainer))
    finally:
        trainer.hooks.pause = trainer.hooks.pieces_done = None
    assert done == [(len(calls), before)] and trainer.versions != before
    assert layers >= 2
    # at least: one micro-batch's forward and backward through every layer, per agent
    assert calls.count(True) >= layers * len(trainer.agents)
    assert calls.count(False) >= (layers + 2) * len(trainer.agents)
    assert m["time/paused_s"] == pytest.approx(0.25 * len(calls))
    assert sum(len(m._forward_hooks) for m in model.modules()) == hooks_before   # nothing left behind
    assert trainer.update(on_policy_groups(trainer))["time/paused_s"] == 0.0


@pytest.mark.whole_machine
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 if hasattr(os, "sched_getaffinity") else True,
                    reason="needs two cores: the trainer's and the engine's")
def test_a_step_works_on_the_idle_engines_cores_and_gives_them_back(trainer, tmp_path):
    """The service's wiring of lending.CoreLease(engine_cores) (pause, pieces_done) around a real
    step: with the engine idle its pieces run on both cores with 2 torch threads; a generate call
    that starts mid-step gets its core at the next pause point (one layer); the step saves on its
    own core; the same step with the engine never idle runs narrow throughout."""
    import threading

    from collab_app.cpu.lending import ENGINE_WAIT_S, CoreLease

    a, b = sorted(os.sched_getaffinity(0))[:2]
    path = str(tmp_path / "cores.lock")
    with open(path + ".engine", "a"):   # the engine takes part (lending.lend_trainer_cores)
        pass
    os.utime(path + ".engine", (0, 0))
    lease, engine = CoreLease(path, yield_share=0.5, engine_cores=(a,)), CoreLease(path)
    now = lambda: (tuple(sorted(os.sched_getaffinity(0))), torch.get_num_threads())   # noqa: E731
    seen, at_save, caller = [], [], []

    def pause():
        paused = lease.pause()
        seen.append(now())
        if len(seen) == 12 and not caller:   # a person's round starts mid-step
            caller.append(threading.Thread(target=engine.begin_call))
            caller[0].start()
        return paused

    save = trainer.save_version
    trainer.hooks.pause, trainer.hooks.pieces_done = pause, lease.narrow
    trainer.save_version = lambda *args: (at_save.append(now()), save(*args))[1]
    before = (os.sched_getaffinity(0), torch.get_num_threads())
    try:
        os.sched_setaffinity(0, {b})
        torch.set_num_threads(1)
        with lease.held(wait_s=5):
            m = trainer.update(on_policy_groups(trainer))
        caller[0].join(5)
        first, seen[:] = list(seen), []
        with lease.held(wait_s=5):   # the call still runs: no widening at all
            trainer.update(on_policy_groups(trainer))
        engine.end_call()
    finally:
        trainer.hooks.pause = trainer.hooks.pieces_done = None
        trainer.save_version = save
        os.sched_setaffinity(0, before[0])
        torch.set_num_threads(before[1])
    assert set(first[:12]) == {((a, b), 2)}               # the engine idle: both cores
    assert first[-1] == ((b,), 1) and ((a, b), 2) not in first[first.index(((b,), 1)):]   # narrow from the call on
    assert m["groups"] == 2 and at_save and set(at_save) == {((b,), 1)}
    assert engine.call_wait_s < ENGINE_WAIT_S    # a pause point came within the wait
    assert set(seen) == {((b,), 1)} and lease.wide_s > 0


def test_zero_variance_groups_do_not_train(trainer):
    before = dict(trainer.versions)
    m = trainer.update(on_policy_groups(trainer, returns=(0.5, 0.5)))
    assert m["zero_variance_frac"] == 1.0
    assert all(m[f"{a}/trained_samples"] == 0 for a in trainer.agents)
    assert trainer.versions == before                                       # nothing changed: no new version


def test_stale_groups_are_dropped(trainer):
    groups = on_policy_groups(trainer)
    trainer.update(groups)                                                  # versions move on by one
    before = dict(trainer.versions)
    for k, g in enumerate(groups):
        g.id = 100 + k
    m = trainer.update(groups)                                              # same data, now 1 version late > max_staleness 0
    assert m["groups_dropped_stale"] == 2 and m["groups"] == 0
    assert m["stale_group_ids"] == [100, 101] and m["group_ids"] == []
    assert trainer.versions == before


# ------------------------------------------------------------------------------- config
def test_defaults_are_valid_and_every_field_is_documented():
    MAGRPOConfig()
    docs = field_docs(MAGRPOConfig)
    assert {f.name for f in dataclasses.fields(MAGRPOConfig)} == set(docs)
    assert "mean (default)" in docs["cross_credit"]


@pytest.mark.parametrize("kw, fragment", [
    (dict(num_generations=1), "a group needs siblings"),
    (dict(num_agents=0), "num_agents"),
    (dict(joint_mode="pairs"), "joint_mode"),
    (dict(cross_credit="min"), "cross_credit"),
    (dict(advantage_mode="std"), "advantage_mode"),
    (dict(engine="tgi"), "engine"),
    (dict(dtype="float16"), "dtype"),
    (dict(device="tpu"), "device must be auto, cpu or cuda"),
    (dict(num_turns=0), "num_turns"),
    (dict(gamma=1.5), "gamma"),
    (dict(joint_mode="cross", num_generations=8, num_agents=3, num_turns=2), "reward calls per prompt"),
    (dict(learning_rate=0.0), "learning_rate"),
    (dict(max_grad_norm=0.0), "max_grad_norm"),
    (dict(lora_r=0), "lora_r"),
    (dict(lora_dropout=1.0), "lora_dropout"),
    (dict(lora_target_modules=[]), "lora_target_modules"),
    (dict(clip_epsilon=0.0), "clip_epsilon"),
    (dict(max_staleness=-1), "max_staleness"),
    (dict(kl_coef=-0.1), "kl_coef"),
    (dict(micro_batch_size=0), "micro_batch_size"),
    (dict(temperature=0.0), "every advantage is 0"),
    (dict(top_p=0.0), "top_p"),
    (dict(eval_temperature=-1.0), "eval_temperature"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(prompts_per_step=0), "prompts_per_step"),
    (dict(num_steps=-1), "num_steps"),
    (dict(eval_every=-1), "eval_every"),
    (dict(keep_versions=-1), "keep_versions"),
    (dict(keep_versions=3, max_staleness=4), "must exceed max_staleness"),
    (dict(max_minutes=-1.0), "max_minutes"),
    (dict(dynamic_sampling=-1), "dynamic_sampling"),
    (dict(lr_schedule="step"), "lr_schedule"),
    (dict(warmup_steps=-2), "warmup_steps"),
])
def test_config_rule(kw, fragment):
    with pytest.raises(ValueError, match=fragment):
        MAGRPOConfig(**kw)


def test_cli_reports_the_rule(capsys):
    with pytest.raises(SystemExit):
        parse_config(MAGRPOConfig, ["--num-generations", "1"], description="x")
    assert "a group needs siblings" in capsys.readouterr().err
    cfg, _ = parse_config(MAGRPOConfig, ["--joint-mode", "cross", "--lora-target-modules", "q_proj", "v_proj",
                                         "--early-stop-threshold", "3.5", "--no-resume"], description="x")
    assert (cfg.joint_mode, cfg.lora_target_modules, cfg.early_stop_threshold, cfg.resume) == \
        ("cross", ["q_proj", "v_proj"], 3.5, False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the no-GPU error")
def test_cuda_device_without_gpu_says_how_to_fix(tmp_path):
    from tasks import load_task
    from trainer.magrpo import MAGRPOTrainer

    with pytest.raises(ValueError, match="--device cpu"):
        MAGRPOTrainer(MAGRPOConfig(task="tldr", model=str(tmp_path), device="cuda"), load_task("tldr"),
                      str(tmp_path / "adapters"))


class _Loaded(Exception):
    """Raised by a fake base model's .to(): the trainer got as far as placing it."""


@pytest.mark.parametrize("cuda, mps, device, want", [
    (False, True, "auto", "mps"), (False, False, "auto", "cpu"), (True, True, "auto", "cuda"),
    (True, True, "cpu", "cpu"), (False, True, "mps", "mps"),
])
def test_trainer_device_follows_resolve_device(monkeypatch, cuda, mps, device, want):
    """auto: cuda > mps > cpu (trainer/dtypes.resolve_device, the transformers engine's rule too)."""
    from types import SimpleNamespace

    import transformers

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    placed = []

    class Base:
        def to(self, dev):
            placed.append(dev)
            raise _Loaded

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: Base())
    task = SimpleNamespace(name="t", num_agents=2, roles=["a", "b"])
    with pytest.raises(_Loaded):
        MAGRPOTrainer(MAGRPOConfig(model="unused", device=device), task, "unused")
    assert placed == [want]


def test_mps_device_without_mps_says_how_to_fix(monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(ValueError, match="MPS backend is not available.*--device cpu"):
        MAGRPOTrainer(MAGRPOConfig(model="unused", device="mps"), SimpleNamespace(name="t", num_agents=2, roles=["a", "b"]),
                      "unused")


def test_reward_threads_count_the_cores_this_process_may_use(monkeypatch):
    """A container's cpuset or `collab serve`'s core split shows in the affinity mask, not in os.cpu_count()."""
    import os

    from trainer import magrpo

    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {2, 3}, raising=False)
    assert magrpo.usable_cpus() == 2

    def unreadable(pid):
        raise OSError("no")

    monkeypatch.setattr(os, "sched_getaffinity", unreadable)
    assert magrpo.usable_cpus() == 64
    monkeypatch.delattr(os, "sched_getaffinity")           # macOS, Windows
    assert magrpo.usable_cpus() == 64
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert magrpo.usable_cpus() == 1


# -- magrpo_loss: the loss alone, on hand-made tensors ------------------------------------------

def _loss_case(ratio, A, W=1.0, eps=0.2):
    import torch

    from trainer.magrpo import magrpo_loss
    logp = torch.tensor([[math.log(r) for r in ratio]], requires_grad=True)       # (1, T); behaviour 0
    behaviour = torch.zeros_like(logp)
    mask = torch.ones_like(logp)
    loss, t = magrpo_loss(logp, behaviour, torch.tensor([[A]]), torch.tensor([[W]]), mask, eps)
    loss.backward()
    return float(loss), logp.grad[0].tolist(), t


def test_magrpo_loss_on_policy_is_minus_advantage_per_token():
    loss, grad, t = _loss_case([1.0, 1.0, 1.0], A=0.5, W=2.0)
    assert loss == pytest.approx(-3.0)                  # -(A * W) per token, 3 tokens
    assert grad == pytest.approx([-1.0, -1.0, -1.0])    # d/dlogp of -W * A * ratio, at ratio 1
    assert float(t["clipped"].sum()) == 0 and t["kl"] is None


def test_magrpo_loss_clips_and_dual_clips():
    _, grad, t = _loss_case([1.5, 0.9], A=1.0)           # ratio > 1 + eps with A > 0: no gradient there
    assert grad[0] == 0.0 and grad[1] == pytest.approx(-0.9) and t["clipped"].tolist() == [[1.0, 0.0]]
    loss, grad, t = _loss_case([10.0], A=-1.0)           # huge ratio, negative advantage: capped at DUAL_CLIP * A
    from trainer.magrpo import DUAL_CLIP
    assert loss == pytest.approx(DUAL_CLIP) and grad == [0.0]
    loss, grad, _ = _loss_case([1.3, 0.7], A=0.0)        # no advantage, no loss, no gradient
    assert loss == 0.0 and grad == [0.0, 0.0]


def test_magrpo_loss_kl_term_is_zero_at_the_reference_and_positive_away():
    import torch

    from trainer.magrpo import magrpo_loss
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ones = torch.ones(1, 1)
    _, t = magrpo_loss(logp, logp.detach(), 0 * ones, ones, torch.ones(1, 2), 0.2, ref_logp=logp.detach(), kl_coef=0.1)
    assert t["kl"].abs().max() == 0
    loss, t = magrpo_loss(logp, logp.detach(), 0 * ones, ones, torch.ones(1, 2), 0.2,
                          ref_logp=torch.tensor([[-1.5, -1.0]]), kl_coef=0.1)
    assert (t["kl"] > 0).all() and float(loss) == pytest.approx(0.1 * float(t["kl"].sum()))


def test_seed_streams_are_those_of_before():
    """seed_for keeps the exact streams the offline loop used (results reproduce across the refactor)."""
    from trainer.offline import seed_for
    s = 7
    assert seed_for(s, epoch=3) == s * 1_000_003 + 3
    assert seed_for(s, step=5, rank=1) == s * 1_000_003 + 7919 * 5 + 104_729
    assert seed_for(s, step=5, refill=2, what="pick") == s * 1_000_003 + 7919 * 5 + 31 * 2 + 17
    assert seed_for(s, step=5, refill=2) == s * 1_000_003 + 7919 * 5 + 1_009 * 3
