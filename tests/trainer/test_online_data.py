"""The trainer on online data (issue 11 item 1): zero-variance groups with float leftovers take no
step, raw advantages stay finite on flat groups, turns weigh the same, an agent's parameters come
from peft's adapter tables (not name substrings), late data is trained (not dropped) and lateness
is counted from a group's arrival, so a pinned old served version never makes new groups stale."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from trainer.config import MAGRPOConfig
from trainer.magrpo import Group, MAGRPOTrainer, adapter_parameters, advantages, sample_weights


# ------------------------------------------------------------------------------- pure pieces
def test_float_leftovers_of_a_flat_group_are_exactly_zero():
    returns = [0.1 + 0.2, 0.3, 0.3, 0.30000000000000004]       # equal up to float noise
    assert statistics_spread(returns) > 0                        # the leftovers really are there
    for mode in ("mean", "rloo", "max"):
        assert advantages(returns, mode) == [0.0] * 4
        assert advantages(returns, mode, normalize_std=True) == [0.0] * 4


def test_a_spread_of_noise_is_no_signal_but_a_small_real_one_is():
    # AdamW would take as large a step on a 1e-6 spread as on a strong signal: noise is flat
    assert advantages([0.5, 0.5 + 1e-6, 0.5], "mean") == [0.0] * 3
    assert advantages([10.0, 10.0 + 5e-4], "mean") == [0.0, 0.0]             # relative to the returns' scale
    assert advantages([0.5, 0.501], "mean") == pytest.approx([-0.0005, 0.0005])


def statistics_spread(xs):
    return max(xs) - min(xs)


def test_raw_advantages_with_std_do_not_explode_on_a_flat_group():
    assert advantages([0.5, 0.5], "raw", normalize_std=True) == [0.5, 0.5]   # not 0.5 / 1e-4
    assert advantages([1.0, 3.0], "raw", normalize_std=True) == pytest.approx([1 / (1 + 1e-4), 3 / (1 + 1e-4)])


def _g(turn, G=2, parent=None):
    return Group(task="t", example_id="e", turn=turn, prompts=["p"], samples=[[None] * G], joint=[(0,), (1,)],
                 returns=[0.0, 1.0], parent=parent)


def test_every_turn_of_a_rollout_tree_weighs_the_same():
    # one root group (G=2) and its two children (2 x G=2 samples): per-sample weights 1/4 and 1/8,
    # so each turn's samples add up to 1/2 (before: 1/6 each, turn 1 diluted to 1/3 of the loss)
    assert sample_weights([_g(0), _g(1, parent=(0, 0)), _g(1, parent=(0, 1))]) == [0.25, 0.125, 0.125]
    assert sample_weights([_g(0), _g(0)]) == [0.25, 0.25]                     # one turn: the plain mean


# ------------------------------------------------------------------------------- with the model
def _task(roles):
    return SimpleNamespace(name="tldr", roles=tuple(roles), num_agents=len(roles), level_names=())


@pytest.fixture(scope="module")
def trainer(model_path, tmp_path_factory):
    cfg = MAGRPOConfig(task="tldr", model=model_path, dtype="float32", learning_rate=1e-3, max_staleness=0,
                       keep_versions=0, micro_batch_size=16)
    # "model" is a substring of every parameter name (base_model.model.model.layers...): the old
    # f".{agent}." filter gave that agent every LoRA parameter of the team
    return MAGRPOTrainer(cfg, _task(["model", "main"]), str(tmp_path_factory.mktemp("adapters")))


def test_agent_parameters_come_from_peft_adapter_tables(trainer):
    lora = [(n, p) for n, p in trainer.model.named_parameters() if "lora_" in n]
    by_agent = {a: {id(p) for p in adapter_parameters(trainer.model, a)} for a in trainer.agents}
    assert by_agent["model"].isdisjoint(by_agent["main"])
    assert len(by_agent["model"]) == len(by_agent["main"]) == len(lora) // 2
    assert {id(p) for n, p in lora if ".main." in n} == by_agent["main"]
    assert len([n for n, _ in lora if ".model." in n]) == len(lora)          # what the substring filter took
    assert {id(p) for g in trainer.optimizers["model"].param_groups for p in g["params"]} == by_agent["model"]


def _groups(trainer, versions, returns=(1.0, 0.0), created_at=None):
    """helpers.trainer_groups' two on-policy groups (G=2, engine log-probs = the trainer's own), stamped with
    `versions` (agent -> adapter version), ids 10 and 11 and, if given, an arrival time."""
    from helpers.trainer_groups import on_policy_groups

    groups = on_policy_groups(trainer, returns=returns)
    for e, g in enumerate(groups):
        for agent, samples in zip(trainer.agents, g.samples):
            for smp in samples:
                smp.adapter_version = versions[agent]
        g.id = 10 + e
        if created_at is not None:
            g.created_at = created_at
    return groups


def test_near_equal_returns_write_no_version(trainer):
    before = dict(trainer.versions)
    m = trainer.update(_groups(trainer, trainer.versions, returns=(0.1 + 0.2, 0.3)))
    assert trainer.versions == before and all(m[f"{a}/trained_samples"] == 0 for a in trainer.agents)
    assert m["group_ids"] == [10, 11]          # used (their gradient is exactly 0), not retried forever


def test_pinned_old_version_trains_under_the_ratio_and_is_not_stale(trainer):
    for _ in range(2):                          # the trainer moves on to version >= 2 ...
        trainer.update(_groups(trainer, trainer.versions))
    assert min(trainer.versions.values()) >= 2
    pinned = {a: 0 for a in trainer.agents}     # ... while the app serves version 0 (an admin pinned it)
    before = dict(trainer.versions)
    m = trainer.update(_groups(trainer, pinned))   # fresh groups: lateness 0 <= max_staleness 0
    assert m["groups_dropped_stale"] == 0 and m["groups"] == 2 and m["late_groups"] == 2
    assert m["group_ids"] == [10, 11] and m["stale_group_ids"] == []
    for a in trainer.agents:
        assert m[f"{a}/late_samples"] == 4 and m[f"{a}/late_ratio_mean"] == pytest.approx(1.0, abs=1e-5)
        assert trainer.versions[a] == before[a] + 1


def test_a_group_that_waited_too_long_is_dropped_and_reported(trainer):
    old = _groups(trainer, trainer.versions, created_at=time.time() - 3600)   # arrived before the last version
    before = dict(trainer.versions)
    m = trainer.update(old)
    assert m["groups_dropped_stale"] == 2 and m["stale_group_ids"] == [10, 11] and m["group_ids"] == []
    assert trainer.versions == before


def test_lateness_counts_versions_since_arrival_not_clock_time():
    """With arrived_versions (the store's newest version per agent when the group arrived) lateness
    is the trainer's version minus that, the most over agents, never negative, and no clock is read:
    a group stamped an hour in the future (a clock stepped back) or past is as late as its versions say."""
    me = SimpleNamespace(agents=["helper", "main"], versions={"helper": 5, "main": 3},
                         saved_at={"helper": [time.time() - 10] * 5, "main": [time.time() - 10] * 3})

    def late(arrived, created_at):
        g = Group(task="t", example_id="e", turn=0, prompts=["p", "q"], samples=[[], []], joint=[], returns=[],
                  created_at=created_at, arrived_versions=arrived)
        return MAGRPOTrainer.lateness(me, g)

    for clock in (time.time() + 3600, time.time() - 3600):
        assert late({"helper": 5, "main": 3}, clock) == 0
        assert late({"helper": 2, "main": 3}, clock) == 3
        assert late({"helper": 4, "main": 1}, clock) == 2
        assert late({"helper": 7, "main": 3}, clock) == 0      # a newer lineage's numbers: not negative
        assert late({"main": 2}, clock) == 5                   # an agent not named had no version yet: 0
        assert late({}, clock) == 5                            # arrived before any version row (the base)
    assert late(None, time.time() - 3600) == 5                 # no versions (offline): by clock, as before
    assert late(None, time.time() + 3600) == 0
