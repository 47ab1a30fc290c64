"""Data-parallel MAGRPO under torchrun (trainer/distributed.py) equals one process.

Two CPU processes (`python -m torch.distributed.run --nproc_per_node 2 --standalone`, gloo,
OMP_NUM_THREADS=1) run this file as their script (`worker` below); the test process computes
the same updates alone and compares:

- trainer: three MAGRPO steps on fixed groups (fixed token ids, returns and behaviour log-probs:
  no generation, nothing random), fp32 embedded model. Step 1: 1 group (rank 1 has nothing to
  do: it adds zeros); step 2: 2 groups, one of turn 0 and one of turn 1 (the turn weights must
  come from the whole step, not a rank's share); step 3: 3 groups (an uneven split: 2
  micro-batches per agent on rank 0, 1 on rank 1) with a late group (clipped ratio). Compared
  per step: the gradient entering AdamW (summed over the ranks, clipped) and the adapter
  version rank 0 publishes; rank 1's weights must equal rank 0's bit for bit;
- the service: `collab trainer`'s loop (TrainerService.run) on a copy of a store holding 3 ready
  groups; rank 0 alone writes the version rows, the step row and the adapter dirs.

AdamW's eps is raised from 1e-8 to 1e-4 here (`smooth_adam`): with 1e-8 the update of a gradient
element near 1e-8 is lr * g / (|g| + eps), which turns float-order noise (1e-10) of such an
element into a sizable fraction of lr, whatever the parallelism (measured with eps 1e-8: the
service step's weights 3.3e-4 of its update apart; 0.26 when the reference ran on 2 threads).
With 1e-4 the update is a smooth function of the gradient, so a tight weight tolerance tests the
data-parallel sum, not Adam's division by ~0. The gradient comparison does not depend on eps,
and the pre-clip gradient norm (metric grad_norm) catches a wrong scale. Measured here: steps 1 and 2 equal one process exactly (a + 0 and a + b are
the same floats in any order), step 3 (a + b) + c vs (a + c) + b: gradients within 1e-7 of their
max, weights within 4e-6 of the update (the tolerances below leave 100x and 25x for other CPUs).
"""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = [dict(groups=1), dict(groups=2), dict(groups=3, late_last=True)]   # see the module doc
SERVICE_GROUPS = 3
GRAD_TOL = 1e-5     # max |2 ranks - 1 process| / max |gradient|
WEIGHT_TOL = 1e-4   # max |2 ranks - 1 process| / max |the step's update|


# ------------------------------------------------------------------------------- shared pieces
def fixed_groups(agents, versions, groups: int, seed: int, late_last: bool = False):
    """`groups` groups of G=3 joint samples, deterministic: random prompt/completion token ids (no EOS),
    returns, engine log-probs; the last group is turn 1 (when n > 1), so turns weigh in; with
    late_last its samples carry an older version (trained under the clipped ratio)."""
    from collab_app.engines.engine_types import Sample
    from trainer.magrpo import Group

    rng = random.Random(seed)
    n, groups = groups, []
    for e in range(n):
        late = late_last and e == n - 1
        samples = []
        for agent in agents:
            prompt = [rng.randrange(100, 40_000) for _ in range(rng.randrange(6, 14))]
            row = []
            for _ in range(3):
                comp = [rng.randrange(100, 40_000) for _ in range(rng.randrange(3, 9))]
                row.append(Sample(agent=agent, adapter_version=versions[agent] - 1 if late else versions[agent],
                                  prompt_token_ids=prompt, text="x", token_ids=comp,
                                  logprobs=[-9.0 - rng.random() for _ in comp]))
            samples.append(row)
        returns = [round(rng.uniform(0, 3), 3) for _ in range(3)]
        groups.append(Group(task="tldr", example_id=f"e{e}", turn=1 if n > 1 and e == n - 1 else 0,
                            prompts=["x"] * len(agents), samples=samples, joint=[(g,) * len(agents) for g in range(3)],
                            returns=returns, rewards=list(returns), levels=[{}] * 3))
    return groups


def smooth_adam(trainer) -> None:
    """AdamW eps 1e-4 instead of 1e-8 (module doc: why)."""
    for opt in trainer.optimizers.values():
        for group in opt.param_groups:
            group["eps"] = 1e-4


def run_steps(model_path: str, adapters_dir: str):
    """A fresh trainer through STEPS. Returns (trainer, metrics per step, {"step/agent": gradient
    entering AdamW (flat)})."""
    from trainer.config import MAGRPOConfig
    from trainer.magrpo import MAGRPOTrainer

    cfg = MAGRPOConfig(task="tldr", model=model_path, dtype="float32", device="cpu", learning_rate=1e-3,
                       keep_versions=0, micro_batch_size=8)
    task = SimpleNamespace(name="tldr", roles=("summary", "detail"), num_agents=2, level_names=())
    trainer = MAGRPOTrainer(cfg, task, adapters_dir)
    smooth_adam(trainer)
    grads: dict[str, torch.Tensor] = {}
    for agent, opt in trainer.optimizers.items():
        opt.register_step_pre_hook(lambda o, args, kw, agent=agent: grads.__setitem__(
            f"{trainer.step + 1}/{agent}", torch.cat([p.grad.reshape(-1) for g in o.param_groups for p in g["params"]])))
    metrics = [trainer.update(fixed_groups(trainer.agents, trainer.versions, seed=k, **step))
               for k, step in enumerate(STEPS)]
    return trainer, metrics, grads


@pytest.fixture
def one_thread():
    """The one-process reference on one thread like each rank: a different thread count changes
    how matmuls block their sums (1e-6 relative through 30 layers), which is not what is tested."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def adapter_state(trainer, agent: str) -> dict[str, torch.Tensor]:
    from peft import get_peft_model_state_dict

    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(trainer.model, adapter_name=agent).items()}


def service(db: str, adapters_dir: str, model_path: str, store=None):
    """The trainer service on `db`, one step on SERVICE_GROUPS groups, AdamW smoothed as above."""
    from collab_app.online.service import ServiceConfig, TrainerService

    class Service(TrainerService):
        def trainer_for(self, task_name):
            new = task_name not in self.trainers
            trainer = super().trainer_for(task_name)
            if new:
                smooth_adam(trainer)
            return trainer

    return Service(ServiceConfig(db=db, adapters_dir=adapters_dir, model=model_path, task="tldr", dtype="float32",
                                 device="cpu", learning_rate=1e-3, micro_batch_size=8, min_groups=SERVICE_GROUPS,
                                 max_groups_per_step=8, max_steps=1, return_mode="auto", poll_s=0.1,
                                 heartbeat_s=0.5), store=store)


# ------------------------------------------------------------------------------- torchrun worker
def worker(out: str, model_path: str, db: str, service_adapters: str) -> None:
    from safetensors.torch import save_file

    from trainer import distributed

    assert distributed.init() == 2
    r = distributed.rank()
    trainer, metrics, grads = run_steps(model_path, os.path.join(out, "adapters"))
    save_file(grads, os.path.join(out, f"rank{r}-grads.safetensors"))
    for agent in trainer.agents:
        save_file(adapter_state(trainer, agent), os.path.join(out, f"rank{r}-{agent}.safetensors"))
    with open(os.path.join(out, f"rank{r}.json"), "w") as f:
        json.dump({"metrics": metrics, "adapters_dir": trainer.adapters_dir,
                   "service_steps": service(db, service_adapters, model_path).run()}, f, default=str)
    distributed.close()


# ------------------------------------------------------------------------------- tests
def add_ready_groups(store, n: int) -> None:
    from tasks.base import Reward

    for g in fixed_groups(["summary", "detail"], {"summary": 0, "detail": 0}, n, seed=7):
        store.add_group(task="tldr", example={"id": g.example_id}, prompts=g.prompts, samples=g.samples,
                        joint=g.joint, auto_rewards=[Reward(total=R, levels={"score": R}, max_total=3.0)
                                                     for R in g.returns], session_id="test", turn=0)


@pytest.fixture(scope="module")
def torchrun(model_path, tmp_path_factory):
    """One torchrun launch (2 ranks): the trainer's STEPS, then the service on a copy of a store."""
    from collab_app.online.store import Store

    out = tmp_path_factory.mktemp("dist")
    db_one, db_dist = out / "one.db", out / "dist.db"
    store = Store(f"sqlite:///{db_one}")
    add_ready_groups(store, SERVICE_GROUPS)
    store.close()
    shutil.copy(db_one, db_dist)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
           os.path.abspath(__file__), str(out), model_path, f"sqlite:///{db_dist}", str(out / "service-adapters")]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    ranks = "\n".join(line for line in done.stderr.splitlines() if line.startswith("[rank"))   # their tracebacks
    assert done.returncode == 0, (ranks or done.stderr)[-6000:]
    return SimpleNamespace(out=out, db_one=f"sqlite:///{db_one}", db_dist=f"sqlite:///{db_dist}")


def gap(dist: torch.Tensor, single: torch.Tensor, reference: torch.Tensor) -> float:
    """max |dist - single| / max |reference|."""
    return float((dist - single).abs().max() / reference.abs().max())


def load_version(adapters_dir, agent: str, version: int) -> torch.Tensor:
    """One flat tensor of a version's LoRA weights (sorted by name)."""
    from safetensors.torch import load_file

    from trainer import adapters

    state = load_file(os.path.join(adapters.version_dir(str(adapters_dir), agent, version), "adapter_model.safetensors"))
    return torch.cat([state[k].reshape(-1) for k in sorted(state)])


@pytest.mark.slow
def test_two_ranks_update_equals_one_process(torchrun, model_path, tmp_path, one_thread):
    from safetensors.torch import load_file

    single, single_metrics, single_grads = run_steps(model_path, str(tmp_path / "adapters"))
    out = torchrun.out
    meta = [json.load(open(out / f"rank{r}.json")) for r in (0, 1)]
    assert meta[0]["adapters_dir"] == str(out / "adapters")              # rank 0 publishes ...
    assert meta[1]["adapters_dir"] != meta[0]["adapters_dir"]            # ... rank 1 keeps private copies
    grads = [load_file(out / f"rank{r}-grads.safetensors") for r in (0, 1)]
    assert set(grads[0]) == set(grads[1]) == set(single_grads) == {f"{k + 1}/{a}" for k in range(len(STEPS))
                                                                    for a in single.agents}
    for key, g in single_grads.items():
        assert torch.equal(grads[0][key], grads[1][key]), f"{key}: the ranks stepped on different gradients"
        print(f"step {key}: gradient max |2 ranks - 1 process| / max |g| = {gap(grads[0][key], g, g):.2g}")
        assert gap(grads[0][key], g, g) <= GRAD_TOL
    for agent in single.agents:
        for k in range(1, len(STEPS) + 1):
            mine, before = load_version(tmp_path / "adapters", agent, k), load_version(tmp_path / "adapters", agent, k - 1)
            dist = load_version(out / "adapters", agent, k)
            g = gap(dist, mine, mine - before)
            print(f"v{k} {agent}: weights max |2 ranks - 1 process| = {float((dist - mine).abs().max()):.3g}, "
                  f"/ max |update| = {g:.2g}")
            assert g <= WEIGHT_TOL
        final = [load_file(out / f"rank{r}-{agent}.safetensors") for r in (0, 1)]
        assert all(torch.equal(final[0][n], final[1][n]) for n in final[0]), "the ranks' adapters differ"
        assert torch.equal(torch.cat([final[0][n].reshape(-1) for n in sorted(final[0])]),
                           load_version(out / "adapters", agent, len(STEPS)))   # rank 0 published its weights
    for step, (m0, m1, m) in enumerate(zip(meta[0]["metrics"], meta[1]["metrics"], single_metrics)):
        same = lambda a, b: a == b or a != a and b != b   # noqa: E731 - NaN (no late tokens) equals NaN
        assert all(same(m0[k], m1[k]) for k in m0 if not k.startswith("time/")), f"step {step + 1}: the ranks' metrics differ"
        assert m0["ranks"] == 2 and m["ranks"] == 1 and m0["late_groups"] == m["late_groups"]
        for agent in single.agents:
            for key in ("trained_samples", "tokens", "late_samples", "version"):
                assert m0[f"{agent}/{key}"] == m[f"{agent}/{key}"], key
            for key in ("loss", "grad_norm", "kl", "ratio_mean", "clip_frac"):   # grad_norm: before clipping
                assert m0[f"{agent}/{key}"] == pytest.approx(m[f"{agent}/{key}"], rel=1e-4, abs=1e-7), key


@pytest.mark.slow
def test_trainer_service_under_torchrun_publishes_once(torchrun, model_path, tmp_path, one_thread):
    from collab_app.online.store import Store
    from trainer import adapters

    assert [json.load(open(torchrun.out / f"rank{r}.json"))["service_steps"] for r in (0, 1)] == [1, 1]
    store_one, store_dist = Store(torchrun.db_one), Store(torchrun.db_dist)
    assert service(torchrun.db_one, str(tmp_path / "adapters"), model_path, store=store_one).run() == 1
    for store in (store_one, store_dist):
        assert [s["step"] for s in store.train_steps()] == [1]
        assert store.stats()["groups"]["trained"] == SERVICE_GROUPS
    for agent in ("summary", "detail"):
        rows = store_dist.adapter_versions(agent)
        assert [a.version for a in rows] == [0, 1]                          # one row per version: rank 0's
        assert rows[1].path == adapters.version_dir(str(torchrun.out / "service-adapters"), agent, 1)
        dist = load_version(torchrun.out / "service-adapters", agent, 1)
        mine, before = load_version(tmp_path / "adapters", agent, 1), load_version(tmp_path / "adapters", agent, 0)
        print(f"service {agent}: weights max |2 ranks - 1 process| / max |update| = {gap(dist, mine, mine - before):.2g}")
        assert gap(dist, mine, mine - before) <= WEIGHT_TOL
    store_one.close()
    store_dist.close()


# ------------------------------------------------------------------------------- trainer on another host
def test_watcher_loads_from_its_own_mount_and_waits_for_dirs_not_visible_yet(hf_engine, lora_adapter, tmp_path):
    """The trainer on another machine writes rows naming its own path of the shared adapters dir
    (absent here); this host mounts the share elsewhere. A row that arrives before its directory
    is visible here (a network filesystem's attribute cache) is retried, not given up."""
    from collab_app.engines.engine_types import Request, Sampling
    from collab_app.online.hotswap import AdapterWatcher
    from collab_app.online.store import Store
    from trainer import adapters

    agent, mount, theirs = "dist_remote", str(tmp_path / "mount"), "/trainer-host/shared/adapters"
    hf_engine.register_agent(agent)
    store = Store(f"sqlite:///{tmp_path}/collab.db")

    def publish(version: int, seed: int) -> None:   # what the trainer's save looks like from here
        adapters.save_version(mount, agent, version,
                              lambda tmp: shutil.copytree(lora_adapter(seed), tmp, dirs_exist_ok=True), {})

    publish(1, seed=1)
    store.record_adapter_version(agent, 1, adapters.version_dir(theirs, agent, 1))
    assert AdapterWatcher(hf_engine, store, [agent]).poll_once() == []     # the row's path alone: not here
    watcher = AdapterWatcher(hf_engine, store, [agent], adapters_dir=mount)
    assert [s.version for s in watcher.poll_once()] == [1] and hf_engine.adapter_version(agent) == 1

    store.record_adapter_version(agent, 2, adapters.version_dir(theirs, agent, 2))   # row first ...
    assert watcher.poll_once() == [] and watcher.poll_once() == []       # ... dir not visible: keep v1, retry
    publish(2, seed=2)                                                   # ... now it shows up
    assert [(s.previous, s.version) for s in watcher.poll_once()] == [(1, 2)]
    out = hf_engine.generate([Request(agent, "Hi")], 1, Sampling(max_new_tokens=2, temperature=0))
    assert out[0][0].adapter_version == 2
    store.close()


# ------------------------------------------------------------------------------- a store fault on rank 0
STORE_FAULT_STEPS = 2


def store_fault_worker(out: str, model_path: str, db: str, adapters_dir: str) -> None:
    """A torchrun rank of `test_store_error_on_rank_0_outside_a_step_keeps_the_ranks_in_step`:
    the service for two steps of SERVICE_GROUPS groups, rank 0's store failing one poll between
    them; each rank saves its final adapter weights."""
    from datetime import timedelta

    from safetensors.torch import save_file

    from collab_app.online.store import Store, StoreError
    from trainer import distributed

    class FlakyStore(Store):
        """Fails its second ready-groups read: after step 1, outside any step."""
        reads = 0

        def ready_groups(self, *args, **kwargs):
            self.reads += 1
            if self.reads == 2:
                raise StoreError("injected: the database went away for one poll")
            return super().ready_groups(*args, **kwargs)

    distributed.TIMEOUT = timedelta(seconds=120)   # a desynchronised collective fails in minutes, not an hour
    assert distributed.init() == 2
    r = distributed.rank()
    svc = service(db, adapters_dir, model_path, store=FlakyStore(db) if r == 0 else None)
    svc.cfg.max_steps = STORE_FAULT_STEPS
    svc.cfg.max_groups_per_step = SERVICE_GROUPS
    steps = svc.run()
    trainer = svc.trainers["tldr"]
    for agent in trainer.agents:
        save_file(adapter_state(trainer, agent), os.path.join(out, f"fault-rank{r}-{agent}.safetensors"))
    with open(os.path.join(out, f"fault-rank{r}.json"), "w") as f:
        json.dump({"steps": steps, "versions": trainer.versions}, f)
    distributed.close()


@pytest.mark.slow
def test_store_error_on_rank_0_outside_a_step_keeps_the_ranks_in_step(model_path, tmp_path):
    """Rank 0's store fails one poll between two steps (no collective is running): the service
    retries, no rank hangs or meets a mismatched collective, both steps run on both ranks, and
    the ranks end with the same weights, which rank 0 published."""
    from safetensors.torch import load_file

    from collab_app.online.store import Store

    db = f"sqlite:///{tmp_path / 'fault.db'}"
    store = Store(db)
    add_ready_groups(store, STORE_FAULT_STEPS * SERVICE_GROUPS)
    store.close()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
           os.path.abspath(__file__), "--store-fault", str(tmp_path), model_path, db, str(tmp_path / "adapters")]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
    ranks = "\n".join(line for line in done.stderr.splitlines() if line.startswith("[rank"))
    assert done.returncode == 0, (ranks or done.stderr)[-6000:]
    assert "injected: the database went away" in done.stderr          # the fault did happen
    meta = [json.load(open(tmp_path / f"fault-rank{r}.json")) for r in (0, 1)]
    assert [m["steps"] for m in meta] == [STORE_FAULT_STEPS] * 2
    assert meta[0]["versions"] == meta[1]["versions"] == {"summary": STORE_FAULT_STEPS, "detail": STORE_FAULT_STEPS}
    for agent in ("summary", "detail"):
        final = [load_file(tmp_path / f"fault-rank{r}-{agent}.safetensors") for r in (0, 1)]
        assert all(torch.equal(final[0][n], final[1][n]) for n in final[0]), "the ranks' adapters differ"
        assert torch.equal(torch.cat([final[0][n].reshape(-1) for n in sorted(final[0])]),
                           load_version(tmp_path / "adapters", agent, STORE_FAULT_STEPS))
    store = Store(db)
    assert [s["step"] for s in store.train_steps()] == list(range(1, STORE_FAULT_STEPS + 1))
    assert store.stats()["groups"]["trained"] == STORE_FAULT_STEPS * SERVICE_GROUPS
    store.close()


if __name__ == "__main__":   # a torchrun rank (the `torchrun` fixture, or the store-fault test)
    if sys.argv[1] == "--store-fault":
        store_fault_worker(*sys.argv[2:6])
    else:
        worker(*sys.argv[1:5])
