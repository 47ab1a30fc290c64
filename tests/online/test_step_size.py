"""A backlog makes more steps, not longer ones (ServiceConfig.max_step_s): a step takes at most
as many groups as fit in max_step_s at the task's last step's seconds per group, never under K.
Before, a step took every ready group (up to 32): under an attack on a 2-core AVX2 box a step of
16 groups took 410 s, and the versions people were served aged with it."""
from __future__ import annotations

import time

import pytest

from collab_app.online.service import ServiceConfig, TrainerService
from helpers.service import TASK, FakeTrainer, add_groups


class SlowTrainer(FakeTrainer):
    """A FakeTrainer whose step takes `per_group_s` seconds per group."""

    def __init__(self, per_group_s: float):
        super().__init__()
        self.per_group_s = per_group_s

    def update(self, groups):
        time.sleep(self.per_group_s * len(groups))
        return super().update(groups)


def step_sizes(store, tmp_path, per_group_s: float, **kw) -> list[int]:
    """Groups per step of a service with a SlowTrainer, polled until it has nothing to train."""
    cfg = ServiceConfig(adapters_dir=str(tmp_path / "adapters"), return_mode="auto", human_timeout_s=0.0,
                        poll_s=0.05, heartbeat_s=0.5, max_wait_s=0.0, **kw)
    svc = TrainerService(cfg, store=store, tasks={TASK.name: TASK})
    svc.trainers[TASK.name] = fake = SlowTrainer(per_group_s)
    while svc.poll_once() == "trained":
        pass
    return [len(ids) for ids in fake.steps]


def test_a_backlog_makes_steps_of_what_fits_in_max_step_s(store, tmp_path):
    add_groups(store, 14)
    sizes = step_sizes(store, tmp_path, 0.05, min_groups=2, max_groups_per_step=8, max_step_s=0.2)
    assert sizes[0] == 8                                # nothing measured yet: max_groups_per_step
    assert all(2 <= n <= 4 for n in sizes[1:]), sizes   # 0.2 s / 0.05 s a group (slower under load, never < K)
    assert 14 - sum(sizes) < 2                          # what is left waits for K (max_wait_s 0 here)


def test_steps_never_shrink_below_k_and_zero_turns_it_off(store, tmp_path):
    add_groups(store, 9)
    assert step_sizes(store, tmp_path, 0.01, min_groups=3, max_groups_per_step=6, max_step_s=0.001) == [6, 3]
    add_groups(store, 12)
    assert step_sizes(store, tmp_path, 0.01, min_groups=3, max_groups_per_step=6, max_step_s=0) == [6, 6]
    with pytest.raises(ValueError, match="max_step_s"):
        ServiceConfig(max_step_s=-1)
