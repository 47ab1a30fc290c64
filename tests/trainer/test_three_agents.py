"""A team of three through MAGRPO (issue 23, item 3): the brief task's outline / body / conclusion
on the embedded model. The transformers engine serves three adapters in one batched rollout, cross
joint actions are the G^3 combinations, each agent's credit is the mean over the joint actions it
took part in, one step changes all three adapters and writes their next versions, and the engine
then serves all three new versions.

The joint returns are set by hand after the rollout: at 12 new tokens every body fails the brief's
32-word length gate, so the task's rewards are all 0 (tests/tasks/test_brief.py checks the levels).
R(a) = a_outline + 2 a_body + 4 a_conclusion gives every agent a different, non-zero advantage."""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from safetensors.torch import load_file

from collab_app.engines.sampler import EngineSampler
from tasks import load_task
from trainer import adapters
from trainer.config import MAGRPOConfig
from trainer.magrpo import MAGRPOTrainer, advantages, agent_returns, rollout


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # 2 shared cores: OpenMP's spinning threads slow small steps (tests/web/conftest.py)
    yield
    torch.set_num_threads(threads)


def test_three_agents_roll_out_cross_and_all_three_adapters_step(model_path, hf_engine, tmp_path, one_thread):
    task = load_task("brief")
    cfg = MAGRPOConfig(task="brief", model=model_path, num_agents=3, num_generations=2, joint_mode="cross",
                       max_new_tokens=12, dtype="float32", learning_rate=1e-3, keep_versions=0, seed=0)
    trainer = MAGRPOTrainer(cfg, task, str(tmp_path / "adapters"))
    assert trainer.agents == ["outline", "body", "conclusion"]
    sampler = EngineSampler(hf_engine)
    for agent in trainer.agents:
        hf_engine.register_agent(agent)
    trainer.load_into(sampler)

    [group] = rollout(sampler, task, task.examples("train")[:1], cfg, seed=0)
    assert [[s.agent for s in row] for row in group.samples] == [[a] * 2 for a in trainer.agents]
    assert all(s.adapter_version == 0 and s.token_ids for row in group.samples for s in row)
    assert len(group.joint) == 2 ** 3 and len(set(group.joint)) == 8 and len(group.levels) == 8

    group.returns = [float(a[0] + 2 * a[1] + 4 * a[2]) for a in group.joint]
    credit = [agent_returns(group, i) for i in range(3)]
    assert [c[1] - c[0] for c in credit] == [1.0, 2.0, 4.0]       # mean over the 4 joint actions of each sample
    assert all(advantages(c) == [-d / 2, d / 2] for c, d in zip(credit, (1.0, 2.0, 4.0)))

    v0 = {a: load_file(os.path.join(trainer.adapter_path(a), "adapter_model.safetensors")) for a in trainer.agents}
    m = trainer.update([group])
    assert all(m[f"{a}/trained_samples"] == 2 and m[f"{a}/version"] == 1 for a in trainer.agents), m
    for agent in trainer.agents:
        version, path = adapters.latest_version(str(tmp_path / "adapters"), agent)
        assert version == 1
        new = load_file(os.path.join(path, "adapter_model.safetensors"))
        assert any(not torch.equal(v0[agent][k], new[k]) for k in new), f"{agent}'s adapter did not change"

    trainer.load_into(sampler)
    assert [hf_engine.adapter_version(a) for a in trainer.agents] == [1, 1, 1]
    [again] = rollout(sampler, task, task.examples("train")[:1], dataclasses.replace(cfg, joint_mode="aligned"),
                      seed=1)
    assert again.joint == [(0, 0, 0), (1, 1, 1)]
    assert all(s.adapter_version == 1 for row in again.samples for s in row)
