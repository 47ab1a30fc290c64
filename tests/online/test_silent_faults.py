"""Faults that silently end online learning, each reproduced through the trainer service's own
loop (collab_app/online/service.py) on the embedded model (fake samples: short token ids, no
generation), and kept fixed:

- a group of one answer (what `/v1/chat/completions` stores for n=1, the OpenAI default) beside
  normal groups: it never becomes ready and the loop goes on training the others (it used to make
  every step raise "a group needs >= 2 returns", so nothing trained again);
- a group that makes `update` raise (here: a sample in no joint action) is retried on its own and,
  when it fails on its own between two steps that train, set aside with the reason; the groups
  that were in its step still train, also across a restart of the service (torchrun restarts
  every rank after a failed step);
- a rating that arrives while a step runs: the group stays ready and trains on the new return
  (it used to be marked trained without the rating ever reaching a gradient).

The torchrun fault (a store error on rank 0 outside a step) is in tests/trainer/test_distributed.py, the
store's own side of these in tests/online/test_store.py.
"""
from __future__ import annotations

import threading

import pytest

from collab_app.online.returns import scale_rating
from collab_app.online.service import STATUS_KEY, ServiceConfig, TrainerService
from tasks.base import Reward
from helpers.service import AGENTS, TASK, add_groups, fake_sample


def make_service(store, tmp_path, **kw) -> TrainerService:
    base = dict(adapters_dir=str(tmp_path / "adapters"), return_mode="auto", dtype="float32", learning_rate=1e-3,
                micro_batch_size=4, poll_s=0.05, heartbeat_s=0.5, max_wait_s=0.0, retry_s=0.01)
    return TrainerService(ServiceConfig(**{**base, **kw}), store=store, tasks={TASK.name: TASK})


def add_group(store, G: int, joint) -> int:
    ex = TASK.examples("train")[0]
    gid, _ = store.add_group(task=TASK.name, example=ex, prompts=TASK.agent_prompts(ex, []),
                             samples=[[fake_sample(a, g) for g in range(G)] for a in AGENTS], joint=joint,
                             auto_rewards=[Reward(float(k), {"score": float(k)}, 2.0) for k in range(len(joint))],
                             session_id="api")
    return gid


def test_single_answer_group_beside_normal_groups_training_continues(sqlite_store, tmp_path):
    single = add_group(sqlite_store, G=1, joint=[(0, 0)])          # n=1 through the API: the oldest group
    normal = add_groups(sqlite_store, 4)
    svc = make_service(sqlite_store, tmp_path, min_groups=2, max_groups_per_step=2, max_steps=2)
    runner = threading.Thread(target=svc.run, daemon=True)
    runner.start()
    runner.join(240)
    svc.stop_event.set()                                    # ends a loop stuck retrying (the fault)
    runner.join(30)
    assert svc.steps_done == 2, f"training stopped: {sqlite_store.get_state(STATUS_KEY)}"
    assert [s["group_ids"] for s in sqlite_store.train_steps()] == [normal[:2], normal[2:]]
    assert {sqlite_store.group(g).status for g in normal} == {"trained"}
    assert sqlite_store.group(single).status == "untrainable"      # says why it never trains, in the store
    stats = sqlite_store.stats()
    assert stats["single_sample_groups"] == 1 and stats["groups"]["untrainable"] == 1


def test_a_group_that_makes_its_step_raise_is_set_aside_and_the_others_train(sqlite_store, tmp_path):
    bad = add_group(sqlite_store, G=2, joint=[(0, 0), (0, 0)])     # sample 1 of each agent is in no joint action
    good = add_groups(sqlite_store, 2)
    svc = make_service(sqlite_store, tmp_path, min_groups=3)
    with pytest.raises(ValueError, match="in no joint action"):
        svc.poll_once()                                     # all three in one step: it raises
    assert {sqlite_store.group(g).status for g in (bad, *good)} == {"ready"}

    svc = make_service(sqlite_store, tmp_path, min_groups=3)       # a restart keeps what the failure taught
    with pytest.raises(ValueError, match="in no joint action"):
        svc.poll_once()                                     # the older half of the suspects (bad, good[0]): fails again
    assert sqlite_store.group(bad).status == "ready"        # no step trained around it yet: maybe the machine
    assert svc.poll_once() == "trained"                     # the one tried least (good[1]) trains
    with pytest.raises(ValueError, match="in no joint action"):
        svc.poll_once()                                     # after a step that trained, the rest together: fails
    with pytest.raises(ValueError, match="in no joint action"):
        svc.poll_once()                                     # their older half: the bad one alone, after a failure
    assert svc.poll_once() == "trained"                     # good[0], tried less often, trains alone
    with pytest.raises(ValueError, match="in no joint action"):
        svc.poll_once()                                     # the bad one alone right after a step that trained
    assert sqlite_store.group(bad).status == "ready"        # one failure alone is not enough: the control decides
    assert [s["group_ids"] for s in sqlite_store.train_steps()] == [[good[1]], [good[0]]]
    assert {sqlite_store.group(g).status for g in good} == {"trained"}
    new = add_groups(sqlite_store, 3, seed=5)
    assert svc.poll_once() == "trained"                     # the others train beside it: now it is the group's
    assert sqlite_store.train_steps()[-1]["group_ids"] == new
    assert sqlite_store.group(bad).status == "untrainable"
    assert "in no joint action" in sqlite_store.group(bad).status_reason
    assert [a["group"] for a in sqlite_store.get_state(STATUS_KEY)["set_aside"]] == [bad]
    assert sqlite_store.put_back([bad]) == 1 and sqlite_store.group(bad).status == "ready"   # an admin's call


def test_rating_during_a_step_keeps_the_group_ready(sqlite_store, tmp_path):
    rated, other = add_groups(sqlite_store, 2)                     # returns 0 and 1 (auto), max_reward 2
    svc = make_service(sqlite_store, tmp_path, return_mode="human_first", human_timeout_s=0.0, min_groups=2)
    trainer = svc.trainer_for(TASK.name)
    update = trainer.update

    def update_while_a_person_rates(groups):
        sqlite_store.add_rating(sqlite_store.group(rated).joints[0].id, "person", 5)   # after the step read the groups
        return update(groups)

    trainer.update = update_while_a_person_rates
    assert svc.poll_once() == "trained"
    trainer.update = update
    assert sqlite_store.group(other).status == "trained"
    assert sqlite_store.group(rated).status == "ready"             # its new return has not been trained on yet
    step = sqlite_store.train_steps()[-1]
    assert step["group_ids"] == [rated, other] and step["metrics"]["groups_rerated"] == 1
    (again,) = sqlite_store.ready_groups(svc.rule)
    assert again.group_id == rated and again.returns == [scale_rating(5, 2.0), 1.0]
    svc = make_service(sqlite_store, tmp_path, return_mode="human_first", human_timeout_s=0.0, min_groups=1)
    assert svc.poll_once() == "trained" and sqlite_store.group(rated).status == "trained"
