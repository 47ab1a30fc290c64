"""Loss weights per sample (magrpo.sample_weights): every generation of a step's rollout trees
weighs the same (offline: every turn, comlrl's turn-by-turn update), and online groups, which
arrive one by one whatever their turn, weigh one sample each. Counted by turn, the mix of a step's
turns set the weights: one turn-2 group among 7 turn-1 groups weighed 7x per sample."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from collab_app.engines.engine_types import Sample
from trainer.config import MAGRPOConfig
from trainer.magrpo import Group, MAGRPOTrainer, sample_weights


def _g(turn, G=2, parent=None, returns=(0.0, 1.0), samples=None, gid=None):
    return Group(task="t", example_id="e", turn=turn, prompts=["p"], samples=samples or [[None] * G],
                 joint=[(g,) for g in range(G)], returns=list(returns), parent=parent, id=gid)


def test_online_groups_weigh_one_sample_each_whatever_their_turn():
    # 7 first-turn groups and one second-turn group, each arrived on its own (no parent in the step)
    w = sample_weights([_g(0) for _ in range(7)] + [_g(1)])
    assert w == [1 / 16] * 8                                   # by turn: 1/28 each for turn 0, 1/4 for turn 1
    assert sum(wi * 2 for wi in w) == pytest.approx(1.0)


def test_rollout_trees_keep_every_turn_equal_early_stops_included():
    # two roots; root 0 has 2 children (G=2 each), root 1 stopped early: turn 0 = 4 samples, turn 1 = 4
    groups = [_g(0), _g(1, parent=(0, 0)), _g(1, parent=(0, 1)), _g(0)]
    assert sample_weights(groups) == [1 / 8, 1 / 8, 1 / 8, 1 / 8]
    # a third generation: each of the three weighs 1/3 of the loss
    groups = [_g(0), _g(1, parent=(0, 0)), _g(1, parent=(0, 1)), _g(2, parent=(1, 0)), _g(2, parent=(1, 1)),
              _g(2, parent=(2, 0))]
    w = sample_weights(groups)
    assert w == [1 / 6, 1 / 12, 1 / 12, 1 / 18, 1 / 18, 1 / 18]
    for depth in ([0], [1, 2], [3, 4, 5]):
        assert sum(w[i] * 2 for i in depth) == pytest.approx(1 / 3)


@pytest.fixture(scope="module")
def trainer(tiny_model_path, tmp_path_factory):
    task = SimpleNamespace(name="tldr", roles=("helper", "main"), num_agents=2, level_names=())
    cfg = MAGRPOConfig(task="tldr", model=tiny_model_path, dtype="float32", keep_versions=0, micro_batch_size=16,
                       learning_rate=1e-3)
    return MAGRPOTrainer(cfg, task, str(tmp_path_factory.mktemp("adapters")))


def test_a_steps_loss_weighs_every_online_sample_alike(trainer):
    """Three turn-1 groups (A = +0.5 on the 3-token completion, -0.5 on the 5-token one) and one
    turn-2 group (the other way round), on-policy (ratio 1): the loss is -sum W * A * tokens with
    W = 1/8 a sample, -(3 * -1 + 1) / 8 = 0.25; by turn (W = 1/12 and 1/4) it was 0."""
    prompt, comps = [5, 300, 77, 640, 9, 12], [[421, 88, 19], [55, 56, 990, 17, 31]]

    def group(turn, returns, gid):
        samples = [[Sample(agent=a, adapter_version=trainer.versions[a], prompt_token_ids=prompt, text="x", token_ids=c,
                           logprobs=[0.0] * len(c), meta={"sampling": {"temperature": 1.0, "top_p": 1.0}})
                    for c in comps] for a in trainer.agents]
        return Group(task="tldr", example_id=f"e{gid}", turn=turn, prompts=["x", "y"], samples=samples,
                     joint=[(0, 0), (1, 1)], returns=list(returns), rewards=list(returns), levels=[{}, {}], id=gid)

    m = trainer.update([group(0, (1.0, 0.0), 1), group(0, (1.0, 0.0), 2), group(0, (1.0, 0.0), 3),
                        group(1, (0.0, 1.0), 4)])
    assert m["group_ids"] == [1, 2, 3, 4]
    for a in trainer.agents:
        assert m[f"{a}/ratio_mean"] == 1.0
        assert m[f"{a}/loss"] == pytest.approx(0.25, abs=1e-6)
