"""The whole online loop in one test, on CPU: prompts in -> automatic rewards + ratings -> groups
in the store -> a trainer service step -> a new adapter version recorded -> the hot-swap watcher
loads it -> the engine serves it.

It also measures the latency from the moment the K-th group becomes ready (its last rating is
stored) to the new version being served, with the trainer service polling in a thread and the
watcher in another, as in `collab serve` (printed; run with -s to see it).
"""
from __future__ import annotations

import hashlib
import threading
import time

import pytest

from collab_app.web import handlers as H
from collab_app.web.context import AppContext
from collab_app.engines.engine_types import Request, Sampling
from collab_app.online.hotswap import AdapterWatcher
from collab_app.online.service import ServiceConfig, TrainerService, read_status
from collab_app.online.store import Store
from collab_app.engines.team import Agent, Team
from tasks import load_task

K = 2
TEXTS = [
    "The city council voted to extend the bike lane network by twelve kilometres next year, "
    "funded by a parking fee increase that drivers' groups oppose.",
    "A small bakery switched to a four-day week; sales stayed flat while staff turnover fell sharply.",
    "Researchers found that honeybees can learn to count up to four when rewarded with sugar water.",
]
PROBE = "Summarize in one sentence: the museum will stay open late on Fridays this summer."
GREEDY = Sampling(max_new_tokens=16, temperature=0.0)


def greedy(engine, roles):
    out = engine.generate([Request(r, PROBE) for r in roles], 1, GREEDY)
    return [o[0] for o in out]


@pytest.mark.slow
def test_online_loop_end_to_end(tmp_path, model_path, capsys):
    from collab_app.engines.engine_hf import TransformersEngine

    task = load_task("tldr")
    roles = list(task.roles)
    engine = TransformersEngine(model_path, dtype="float32", seed=0)
    team = Team([Agent(r) for r in roles])
    for r in roles:
        engine.register_agent(r)
    store = Store(f"sqlite:///{tmp_path}/collab.db")
    ctx = AppContext(engine=engine, store=store, tasks={"tldr": task}, teams={"tldr": team}, num_generations=2,
                     sampling=Sampling(max_new_tokens=20, temperature=1.0, seed=0), home=str(tmp_path))
    base_out = greedy(engine, roles)
    assert [s.adapter_version for s in base_out] == [None, None]

    # the trainer service (warm: its model loaded, as after its first step) and the watcher
    cfg = ServiceConfig(adapters_dir=str(tmp_path / "adapters"), model=model_path, task="tldr", min_groups=K,
                        max_wait_s=0, max_steps=1, return_mode="human_first", human_timeout_s=3600,
                        dtype="float32", learning_rate=2e-2, max_grad_norm=10.0, micro_batch_size=4,
                        poll_s=0.2, heartbeat_s=0.5)
    service = TrainerService(cfg, store=store)
    service.trainer_for("tldr")                       # writes + records version 0 (LoRA B = 0)
    watcher = AdapterWatcher(engine, store, roles, lock=ctx.engine_lock, interval_s=0.2).start()
    svc_thread = threading.Thread(target=service.run, daemon=True)
    svc_thread.start()

    # prompts in: the app's own handlers generate G=2 candidates, score them, store the group;
    # a person rates both candidates of each group (human_first: ratings are the returns)
    group_ids = []
    for text in TEXTS[:K]:
        ep = H.run_generate(ctx, H.start_writing(ctx, "tldr", text), H.Caller("e2e"))["episode"]
        group_ids.append(ep["group_id"])
        assert all(c["reward"]["max_total"] == task.max_reward for c in ep["candidates"])
        H.rate_candidates(ctx, ep, [5, 1], H.Caller("e2e"), comment="first is better")
    t_ready = time.time()                             # the K-th group just became ready

    deadline = time.time() + 240
    while time.time() < deadline and not all(engine.adapter_version(r) == 1 for r in roles):
        assert svc_thread.is_alive() or store.train_steps(), read_status(store)
        time.sleep(0.02)
    watcher.stop()
    svc_thread.join(30)
    assert [engine.adapter_version(r) for r in roles] == [1, 1], read_status(store)
    served_at = max(s.at for s in watcher.swaps if s.version == 1)
    latency = served_at - t_ready

    # what the store says: one step on exactly these groups, versions recorded after the rename
    (step,) = store.train_steps()
    assert step["group_ids"] == group_ids and step["metrics"]["groups"] == K
    assert {store.group(g).status for g in group_ids} == {"trained"}
    for r in roles:
        assert [(a.version, a.step) for a in store.adapter_versions(r)] == [(0, None), (1, 1)]

    # the engine serves the new version; its answers say so, in the store too
    after = greedy(engine, roles)
    assert [s.adapter_version for s in after] == [1, 1]
    assert [s.token_ids for s in after] != [s.token_ids for s in base_out], \
        "greedy output did not move after a large-learning-rate step"
    ep = H.run_generate(ctx, H.start_writing(ctx, "tldr", TEXTS[2]), H.Caller("e2e"))["episode"]
    grp = store.group(ep["group_id"])
    assert {s.adapter_version for row in grp.samples for s in row} == {1}
    assert {p["adapter_version"] for c in ep["candidates"] for p in c["parts"]} == {1}

    sha = {r: hashlib.sha256(open(f"{store.current_adapter_versions()[r][1]}/adapter_model.safetensors", "rb")
                             .read()).hexdigest()[:12] for r in roles}
    with capsys.disabled():
        print(f"\n[online loop, transformers engine, CPU] K={K} ready groups -> v1 served in {latency:.1f}s "
              f"(update {step['metrics']['time/update_s']:.1f}s, save {step['metrics']['time/save_s']:.2f}s, "
              f"load {max(s.load_s for s in watcher.swaps if s.version == 1):.2f}s); adapters {sha}")
    store.close()
