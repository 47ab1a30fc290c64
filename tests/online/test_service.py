"""The trainer service's pieces (collab_app/online/service.py) and the hot-swap watcher
(collab_app/online/hotswap.py), in this process, on the embedded model with the transformers engine."""
from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from collab_app.engines.engine_types import Request, Sampling
from collab_app.online.hotswap import AdapterWatcher
from collab_app.online.service import (STATUS_KEY, ServiceConfig, TrainerService, is_paused, read_status,
                                reconcile, set_paused)
from tasks.base import Reward
from trainer import adapters
from helpers.service import AGENTS, TASK, add_groups, fake_sample

@pytest.fixture(scope="module")
def engine(model_path):
    from collab_app.engines.engine_hf import TransformersEngine

    eng = TransformersEngine(model_path, dtype="float32", seed=0)
    for a in AGENTS:
        eng.register_agent(a)
    return eng


def service(store, tmp_path, **kw) -> TrainerService:
    cfg = ServiceConfig(adapters_dir=str(tmp_path / "adapters"), return_mode="auto", dtype="float32",
                        learning_rate=1e-3, micro_batch_size=4, poll_s=0.1, heartbeat_s=0.5, **kw)
    return TrainerService(cfg, store=store, tasks={TASK.name: TASK})


# ----------------------------------------------------------------------------- config


def test_config_rejects_settings_that_cannot_work():
    with pytest.raises(ValueError, match="min_groups"):
        ServiceConfig(min_groups=0)
    with pytest.raises(ValueError, match="min_groups"):
        ServiceConfig(min_groups=8, max_groups_per_step=4)
    with pytest.raises(ValueError, match="mode"):
        ServiceConfig(return_mode="nope")
    with pytest.raises(ValueError, match="num_generations"):   # MAGRPOConfig's own checks still run
        ServiceConfig(num_generations=1)
    offline_only = {"dynamic_sampling", "max_minutes", "lr_schedule", "warmup_steps"}   # `collab train` options:
    assert not offline_only & {f.name for f in dataclasses.fields(ServiceConfig)}     # nothing online to refill or decay towards
    with pytest.raises(TypeError, match="dynamic_sampling"):
        ServiceConfig(dynamic_sampling=1, lr_schedule="cosine")
    for share in (-0.1, 1.0):
        with pytest.raises(ValueError, match=r"yield_share must be in \[0, 1\)"):
            ServiceConfig(yield_share=share)


def test_cli_is_parsed_from_the_config_dataclass():
    from trainer.configcli import parse_config

    cfg, _ = parse_config(ServiceConfig, ["--min-groups", "3", "--self-play", "--learning-rate", "1e-3",
                                          "--return-mode", "human_first", "--db", "sqlite:///x.db"],
                          description="test")
    assert (cfg.min_groups, cfg.self_play, cfg.learning_rate, cfg.return_mode, cfg.db) == \
        (3, True, 1e-3, "human_first", "sqlite:///x.db")
    for flag in ("--dynamic-sampling", "--max-minutes", "--lr-schedule", "--warmup-steps"):   # offline only
        with pytest.raises(SystemExit):
            parse_config(ServiceConfig, [flag, "1"], description="test")
    assert cfg.rule().mode == "human_first"


def test_default_return_keeps_the_tasks_checks_beside_a_rating():
    """Online training's default return mixes a rating with the task's automatic reward (a rating
    alone teaches a preference at the task's expense: docs/results)."""
    from collab_app.online.returns import ReturnRule, group_returns

    rule = ServiceConfig().rule()
    assert rule == ReturnRule() and (rule.mode, rule.human_weight) == ("weighted", 0.5)
    # max reward 3: rating 5 -> 3.0 and rating 1 -> 0.0, each averaged with the automatic total
    returns, sources = group_returns(rule, [1.0, 2.0], [[("p", 5)], [("p", 1)]], 3.0, age_s=0)
    assert returns == [2.0, 1.0] and sources == ["weighted", "weighted"]


def test_online_multi_turn_is_refused_with_a_way_out():
    with pytest.raises(ValueError, match="collab train --num-turns 2"):
        ServiceConfig(num_turns=2)


# ----------------------------------------------------------------------------- store side, no model


def test_reconcile_records_complete_versions_only(sqlite_store, tmp_path):
    root = str(tmp_path / "adapters")

    def write(d):
        open(f"{d}/adapter_model.safetensors", "wb").write(b"x")

    for v in (0, 1):
        adapters.save_version(root, "svc_helper", v, write, {"step": v})
    (tmp_path / "adapters" / "svc_helper" / ".tmp-v000002-crash").mkdir()   # a save killed mid-write
    (tmp_path / "adapters" / "svc_helper" / "v000003").mkdir()              # no completeness marker
    sqlite_store.record_adapter_version("svc_helper", 0, adapters.version_dir(root, "svc_helper", 0), step=0)

    assert reconcile(sqlite_store, root) == [("svc_helper", 1)]
    assert [a.version for a in sqlite_store.adapter_versions("svc_helper")] == [0, 1]
    assert reconcile(sqlite_store, root) == []   # idempotent


def test_reconcile_warns_of_a_stopped_step_not_of_a_fresh_team(sqlite_store, tmp_path, caplog):
    """A fresh team's version 0 (written by building its trainer, recorded by reconcile) is news
    at every first start; a version > 0 without a row is a step stopped between save and row."""
    import logging

    root = str(tmp_path / "adapters")
    for agent in ("svc_a", "svc_b"):
        adapters.save_version(root, agent, 0, lambda d: open(f"{d}/adapter_model.safetensors", "wb").write(b"x"),
                              {"step": 0})
    with caplog.at_level(logging.INFO, logger="collab_app.online.service"):
        assert reconcile(sqlite_store, root) == [("svc_a", 0), ("svc_b", 0)]
    assert [r.levelname for r in caplog.records] == ["INFO"], caplog.text
    caplog.clear()
    adapters.save_version(root, "svc_a", 1, lambda d: open(f"{d}/adapter_model.safetensors", "wb").write(b"x"),
                          {"step": 1})
    with caplog.at_level(logging.INFO, logger="collab_app.online.service"):
        assert reconcile(sqlite_store, root) == [("svc_a", 1)]
    assert [r.levelname for r in caplog.records] == ["WARNING"] and "svc_a', 1" in caplog.text, caplog.text


def test_due_waits_for_K_groups_or_T_seconds(sqlite_store, tmp_path):
    svc = service(sqlite_store, tmp_path, min_groups=3, max_wait_s=0.0)
    add_groups(sqlite_store, 2)
    rule = svc.rule
    assert svc.due(sqlite_store.ready_groups(rule)) is None              # 2 < K and T off
    add_groups(sqlite_store, 1)
    task, groups = svc.due(sqlite_store.ready_groups(rule))
    assert task == TASK.name and len(groups) == 3

    svc = service(sqlite_store, tmp_path, min_groups=10, max_groups_per_step=10, max_wait_s=0.3)
    assert svc.due(sqlite_store.ready_groups(rule)) is None or \
        time.time() - min(g.created_at.timestamp() for g in sqlite_store.ready_groups(rule)) >= 0.3
    time.sleep(0.35)
    task, groups = svc.due(sqlite_store.ready_groups(rule))               # fewer than K, but waited T
    assert len(groups) == 3


def test_pause_flag_blocks_steps(sqlite_store, tmp_path):
    svc = service(sqlite_store, tmp_path, min_groups=1)
    add_groups(sqlite_store, 1)
    set_paused(sqlite_store, True)
    assert is_paused(sqlite_store)
    assert svc.poll_once() == "paused"
    st = read_status(sqlite_store)
    assert st["state"] == "paused" and st["alive"]
    assert sqlite_store.stats()["groups"]["trained"] == 0


# ----------------------------------------------------------------------------- one real step


@pytest.mark.slow
def test_step_publishes_versions_after_rename_and_marks_groups(sqlite_store, tmp_path, engine):
    svc = service(sqlite_store, tmp_path, min_groups=2)
    assert svc.poll_once() == "idle"
    ids = add_groups(sqlite_store, 2, engine)
    set_paused(sqlite_store, True)
    assert svc.poll_once() == "paused"
    set_paused(sqlite_store, False)

    assert svc.poll_once() == "trained"
    root = svc.cfg.adapters_dir
    for a in AGENTS:
        rows = sqlite_store.adapter_versions(a)
        assert [r.version for r in rows] == [0, 1]           # v0 (fresh adapter) reconciled, v1 by step 1
        assert rows[1].step == 1
        for r in rows:   # every row names a complete version dir
            assert (r.version, r.path) in adapters.list_versions(root, a)
    steps = sqlite_store.train_steps()
    assert [s["step"] for s in steps] == [1] and steps[0]["group_ids"] == ids
    assert steps[0]["metrics"]["groups"] == 2 and steps[0]["metrics"]["task"] == TASK.name
    assert {sqlite_store.group(i).status for i in ids} == {"trained"}
    st = sqlite_store.get_state(STATUS_KEY)
    assert st["state"] == "idle" and st["last_step"]["step"] == 1

    # a second step continues the numbering and the versions; trained groups are not reused
    add_groups(sqlite_store, 2, engine, seed=10)
    assert svc.poll_once() == "trained"
    assert sqlite_store.current_adapter_versions()[AGENTS[0]][0] == 2
    assert [s["step"] for s in sqlite_store.train_steps()] == [1, 2]
    assert svc.poll_once() == "idle"


def test_a_step_without_a_learning_signal_says_so_and_publishes_no_version(sqlite_store, tmp_path, caplog):
    """Every group's returns equal: every advantage is 0, no adapter moves, no version is published,
    and the step's log line says why (a silent no-learning step made visible)."""
    import logging

    svc = service(sqlite_store, tmp_path, min_groups=1)
    (gid,) = add_groups(sqlite_store, 1, flat=True)
    with caplog.at_level(logging.INFO, logger="collab_app.online.service"):
        assert svc.poll_once() == "trained"
    assert [r.version for r in sqlite_store.adapter_versions(AGENTS[0])] == [0]      # v0 only
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("step 1 "))
    assert f"no learning signal for {', '.join(AGENTS)} (advantages all 0: each group's returns were equal): no new version" in line
    assert sqlite_store.group(gid).status == "trained"      # used, not retried forever
    add_groups(sqlite_store, 1, seed=10)                     # a group with a signal: a version again
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="collab_app.online.service"):
        assert svc.poll_once() == "trained"
    assert sqlite_store.current_adapter_versions()[AGENTS[0]][0] == 1
    assert "no learning signal" not in caplog.text


def test_only_groups_in_the_gradient_are_marked_trained_late_ones_are_retired(sqlite_store, tmp_path):
    svc = service(sqlite_store, tmp_path, min_groups=2, max_staleness=0)
    first, second, waiting = add_groups(sqlite_store, 3)
    ready = {g.group_id: g for g in sqlite_store.ready_groups(svc.rule)}
    svc.train_step(TASK.name, [ready[first], ready[second]])        # `waiting` sits out step 1
    assert sqlite_store.group(waiting).status == "ready"                   # not in the gradient: still ready
    assert {sqlite_store.group(i).status for i in (first, second)} == {"trained"}
    # `waiting` arrived before version 1 was written: 1 version late > max_staleness 0
    m = svc.train_step(TASK.name, sqlite_store.ready_groups(svc.rule))
    assert m["groups_dropped_stale"] == 1 and m["groups"] == 0
    assert sqlite_store.group(waiting).status == "expired"                 # retired, never retried
    assert sqlite_store.train_steps()[-1]["group_ids"] == []
    assert sqlite_store.ready_groups(svc.rule) == []


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_stop_during_a_step_abandons_it_at_the_next_layer(sqlite_store, tmp_path, caplog, where):
    """SIGTERM's path (the service's stop_event) in the middle of a step: update() stops at its next
    pause point (a decoder layer's forward, or the backward through one) with StepStopped, run()
    ends, nothing of the step is on disk or in the store, and its group stays ready, not blamed
    (no suspect); the next service trains it."""
    import logging
    import traceback

    from collab_app.online.service import SUSPECTS_KEY

    svc = service(sqlite_store, tmp_path, min_groups=1)
    (gid,) = add_groups(sqlite_store, 1)
    trainer = svc.trainer_for(TASK.name)
    calls = []

    def pause() -> float:   # stands in for the core lease's pause: asks for the stop at the first point in `where`
        backward = any(f.name == "_engine_run_backward" for f in traceback.extract_stack())
        calls.append(backward)
        if backward == (where == "backward"):
            svc.stop_event.set()
        return 0.0

    trainer.hooks.pause = pause
    with caplog.at_level(logging.INFO, logger="collab_app.online.service"):
        assert svc.run() == 0
    assert calls[-1] == (where == "backward")   # stopped in the phase asked for, at the next point: no later one
    assert "the step under way stopped at a pause point; nothing of it was saved; its groups stay ready" in caplog.text
    assert "trainer step failed" not in caplog.text          # not the error path (backoff, blame)
    assert sqlite_store.group(gid).status == "ready"
    assert not (sqlite_store.get_state(SUSPECTS_KEY) or {}).get("groups")
    for a in AGENTS:
        assert [v for v, _ in adapters.list_versions(svc.cfg.adapters_dir, a)] == [0]
        assert [r.version for r in sqlite_store.adapter_versions(a)] == [0]
    assert sqlite_store.train_steps() == [] and read_status(sqlite_store)["state"] == "stopped"

    again = service(sqlite_store, tmp_path, min_groups=1)   # a restart trains the group
    assert again.poll_once() == "trained" and sqlite_store.group(gid).status == "trained"


def test_own_coding_problems_wait_until_an_admin_allows_them(sqlite_store, tmp_path):
    """Groups of a person's own coding problem ("custom-coding") never reach the shared team's
    trainer unless the admin flag allows it; they stay in the store meanwhile."""
    from collab_app.online.returns import CUSTOM_TRAINING_KEY

    svc = service(sqlite_store, tmp_path, min_groups=1)
    ex = TASK.examples("train")[0]
    rewards = [Reward(float(g), {"score": float(g)}, 2.0) for g in range(2)]
    gid, _ = sqlite_store.add_group(task="custom-coding", example=ex, prompts=TASK.agent_prompts(ex, []),
                             samples=[[fake_sample(a, g) for g in range(2)] for a in AGENTS],
                             joint=[(0, 0), (1, 1)], auto_rewards=rewards, session_id="person")
    assert svc.private_tasks_held() == ("custom-coding",)
    assert svc.poll_once() == "idle" and sqlite_store.group(gid).status == "ready"    # held, not trained, not lost
    sqlite_store.set_state(CUSTOM_TRAINING_KEY, {"allowed": True, "by": "admin", "at": 0})
    assert svc.private_tasks_held() == ()
    assert [g.group_id for g in sqlite_store.ready_groups(svc.rule, exclude_tasks=svc.private_tasks_held())] == [gid]


# ----------------------------------------------------------------------------- hot-swap


def test_watcher_follows_newest_honours_pin_and_survives_a_bad_version(sqlite_store, engine, lora_adapter):
    agent = "svc_swap"
    engine.register_agent(agent)
    watcher = AdapterWatcher(engine, sqlite_store, [agent])
    assert watcher.poll_once() == [] and engine.adapter_version(agent) is None   # no rows: base model

    sqlite_store.record_adapter_version(agent, 1, lora_adapter(1))
    sqlite_store.record_adapter_version(agent, 2, lora_adapter(2))
    assert [s.version for s in watcher.poll_once()] == [2]
    out = engine.generate([Request(agent, "Hi")], 1, Sampling(max_new_tokens=4, temperature=0))
    assert out[0][0].adapter_version == 2

    sqlite_store.pin_adapter(agent, 1)                     # admin rollback
    swaps = watcher.poll_once()
    assert [(s.previous, s.version) for s in swaps] == [(2, 1)] and engine.adapter_version(agent) == 1
    assert watcher.poll_once() == []                # nothing new: no reload

    sqlite_store.record_adapter_version(agent, 3, "/nonexistent/adapter")
    assert watcher.poll_once() == [] and engine.adapter_version(agent) == 1   # still pinned
    sqlite_store.pin_adapter(agent, None)
    assert watcher.poll_once() == []                # v3 cannot load: logged, v1 keeps serving
    assert engine.adapter_version(agent) == 1
    out = engine.generate([Request(agent, "Hi")], 1, Sampling(max_new_tokens=4, temperature=0))
    assert out[0][0].adapter_version == 1


@pytest.mark.slow
def test_swap_waits_for_the_request_in_flight(sqlite_store, engine, lora_adapter):
    """A request running during a swap finishes on the version it started with; the next runs on
    the new one. The watcher's thread does the swap, as in `collab serve`."""
    agent = "svc_inflight"
    engine.register_agent(agent)
    sqlite_store.record_adapter_version(agent, 1, lora_adapter(1))
    watcher = AdapterWatcher(engine, sqlite_store, [agent], interval_s=0.05)
    watcher.poll_once()
    result = {}

    def long_request():
        result["out"] = engine.generate([Request(agent, "Tell me a long story about a cat.")], 1,
                                        Sampling(max_new_tokens=96, temperature=0))

    t = threading.Thread(target=long_request)
    t.start()
    deadline = time.time() + 30
    while not engine._lock.locked() and time.time() < deadline:   # the batch is running
        time.sleep(0.005)
    assert t.is_alive(), "the request finished before the swap could overlap it: make it longer"
    sqlite_store.record_adapter_version(agent, 2, lora_adapter(2))
    watcher.start()
    t.join(60)
    deadline = time.time() + 30
    while engine.adapter_version(agent) != 2 and time.time() < deadline:
        time.sleep(0.05)
    watcher.stop()
    assert result["out"][0][0].adapter_version == 1 and len(result["out"][0][0].token_ids) > 0
    assert engine.adapter_version(agent) == 2
    assert watcher.swaps[-1].version == 2 and watcher.swaps[-1].previous == 1
    out = engine.generate([Request(agent, "Hi")], 1, Sampling(max_new_tokens=4, temperature=0))
    assert out[0][0].adapter_version == 2
