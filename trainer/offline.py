"""Offline MAGRPO (`collab train`): the loop around one step of trainer/magrpo.py.

    for each step, until cfg.num_steps or cfg.max_minutes of rollout + update time:
        lr       = scheduled_learning_rate(...)        warm-up, then linear / cosine decay
        prompts  = prompts_of_step(...)                epochs over the train split, shuffled by seed
        groups   = magrpo.rollout(...)                 (each rank its share; gathered)
        groups   = refill(...)                         dynamic sampling: tied prompts replaced
        metrics  = trainer.update(groups)              advantages, loss, one step, new versions
        trainer.load_into(engine)                      the engine serves the new versions

Every random stream comes from `seed_for(cfg.seed, ...)`, so a resumed run sees the prompts and
samples the uninterrupted run would have. The time budget is kept across a resume (the versions
carry `train_seconds`).
"""
from __future__ import annotations

import math
import random
import time

from tqdm import tqdm

from trainer import distributed
from trainer.config import MAGRPOConfig
from trainer.magrpo import (Group, MAGRPOTrainer, Sampler, gather_groups, group_metrics, is_flat, join_trees,
                            rollout, split_trees)


def seed_for(seed: int, *, epoch: int | None = None, step: int = 0, rank: int = 0, refill: int | None = None,
             what: str = "rollout") -> int:
    """Every random stream of offline training, derived from cfg.seed in one place: the prompt
    shuffle of each `epoch`; the rollout of each `step` on each `rank`; per dynamic-sampling
    `refill` round, the pick of fresh prompts (`what="pick"`) and their rollout. Streams never
    coincide for the step counts a run has, and a resumed run draws what the uninterrupted run
    would have (collab bench comlrl shuffles its epochs with the same stream)."""
    base = seed * 1_000_003
    if epoch is not None:
        return base + epoch
    base += 7919 * step
    if refill is None:
        return base + 104_729 * rank
    return base + (31 * refill + 17 if what == "pick" else 1_009 * (refill + 1))


def prompts_of_step(examples: list[dict], cfg: MAGRPOConfig, step: int) -> list[dict]:
    """The prompts of `step`: epochs over the split, each shuffled by (seed, epoch), so a
    resumed run sees the prompts the uninterrupted run would have."""
    out, P, n = [], cfg.prompts_per_step, len(examples)
    if n == 0:
        raise ValueError(f"task {cfg.task!r} has no train examples")
    for k in range(step * P, step * P + P):
        epoch, i = divmod(k, n)
        order = list(range(n))
        random.Random(seed_for(cfg.seed, epoch=epoch)).shuffle(order)
        out.append(examples[order[i]])
    return out


def scheduled_learning_rate(cfg: MAGRPOConfig, step: int, train_seconds: float) -> float:
    """cfg.learning_rate for step `step` (0-based) after warm-up and the schedule's decay. The
    decay's progress is the larger of steps done / num_steps and minutes trained / max_minutes,
    so a run stopped by its time budget still ends at the bottom of the schedule."""
    lr = cfg.learning_rate
    if step < cfg.warmup_steps:
        return lr * (step + 1) / (cfg.warmup_steps + 1)
    if cfg.lr_schedule == "constant":
        return lr
    progress = (step - cfg.warmup_steps) / max(1, cfg.num_steps - cfg.warmup_steps)
    if cfg.max_minutes:
        progress = max(progress, train_seconds / (60.0 * cfg.max_minutes))
    progress = min(1.0, progress)
    if cfg.lr_schedule == "cosine":
        return lr * 0.5 * (1.0 + math.cos(math.pi * progress))
    return lr * (1.0 - progress)


def refill(engine: Sampler, task, cfg: MAGRPOConfig, step: int, examples: list[dict], groups: list[Group],
           timings: dict) -> tuple[list[Group], dict]:
    """Dynamic sampling (DAPO, Yu et al. 2025): a prompt whose groups all have equal returns
    teaches nothing (advantage 0) and, kept in the step, only dilutes the others' weight.
    Drop such prompts and roll out fresh ones in their place, at most cfg.dynamic_sampling
    more rollouts; train on the prompts with signal. Returns (groups, metrics of the refill)."""
    P = cfg.prompts_per_step
    useful = [t for t in split_trees(groups) if not all(is_flat(g.returns) for g in t)]
    flat_prompts, extra = P - len(useful), 0
    seen = {g.example_id for g in groups if g.parent is None}
    for r in range(cfg.dynamic_sampling):
        missing = P - len(useful)
        if missing <= 0:
            break
        pool = [e for e in examples if str(e["id"]) not in seen]
        fresh = random.Random(seed_for(cfg.seed, step=step, refill=r, what="pick")).sample(
            pool, min(missing, len(pool)))
        if not fresh:
            break
        seen |= {str(e["id"]) for e in fresh}
        extra += len(fresh)
        more = rollout(engine, task, fresh, cfg, timings=timings,
                       seed=seed_for(cfg.seed, step=step, refill=r))
        useful += [t for t in split_trees(more) if not all(is_flat(g.returns) for g in t)]
    return join_trees(useful), {"dynamic/flat_prompts": flat_prompts, "dynamic/extra_prompts": extra,
                                "dynamic/prompts_trained": len(useful)}


def out_of_time(trainer: MAGRPOTrainer) -> bool:
    """The run's time budget (cfg.max_minutes of rollout + update time) is spent."""
    cfg: MAGRPOConfig = trainer.cfg
    return bool(cfg.max_minutes) and trainer.train_seconds >= 60.0 * cfg.max_minutes


def train(trainer: MAGRPOTrainer, engine: Sampler, on_step=None) -> list[dict]:
    """rollout -> update -> new versions -> engine.load_adapter, until cfg.num_steps (or
    cfg.max_minutes of rollout + update time). `on_step(metrics)` runs after each step
    (logging, evaluation; not counted in the time). Returns every step's metrics."""
    cfg = trainer.cfg
    if cfg.dynamic_sampling and distributed.world_size() > 1:
        raise ValueError("dynamic_sampling is not wired under torchrun (each rank would refill its own "
                         "share): use --dynamic-sampling 0 with several ranks")
    examples = trainer.task.examples("train")
    trainer.load_into(engine)
    history = []
    with tqdm(total=cfg.num_steps, initial=trainer.step, desc="MAGRPO", unit="step",
              disable=None if distributed.is_main() else True) as bar:
        while trainer.step < cfg.num_steps and not out_of_time(trainer):
            trainer._step_t0 = time.perf_counter()
            timings: dict[str, float] = {}
            lr = scheduled_learning_rate(cfg, trainer.step, trainer.train_seconds)
            for opt in trainer.optimizers.values():
                for param_group in opt.param_groups:
                    param_group["lr"] = lr
            # data parallel: each rank rolls out its share of the step's prompts with its own
            # engine, then every rank holds all the groups (update() splits the gradient work)
            groups = rollout(engine, trainer.task, distributed.shard(prompts_of_step(examples, cfg, trainer.step)), cfg,
                             seed=seed_for(cfg.seed, step=trainer.step, rank=distributed.rank()),
                             timings=timings)
            groups = gather_groups(groups)
            if cfg.dynamic_sampling:
                rolled = group_metrics(groups, trainer.task.level_names)   # what the policy produced this step
                groups, refilled = refill(engine, trainer.task, cfg, trainer.step, examples, groups, timings)
            metrics = trainer.update(groups)
            del metrics["group_ids"], metrics["stale_group_ids"]   # offline groups have no ids, none waits
            if cfg.dynamic_sampling:
                # return_mean, zero_variance_frac, ... describe the step's first rollout (what the
                # policy produces; refilled prompts are picked for their signal); trained/*: the
                # groups the update saw
                metrics.update({f"trained/{k}": metrics[k] for k in rolled if k in metrics})
                metrics.update(rolled)
                metrics.update(refilled)
            metrics["learning_rate"] = lr
            metrics.update({f"time/{k}": v for k, v in timings.items()})
            trainer.load_into(engine)
            trainer.train_seconds += time.perf_counter() - trainer._step_t0
            trainer._step_t0 = None
            metrics["train_seconds"] = trainer.train_seconds
            history.append(metrics)
            bar.set_postfix(ret=f"{metrics['return_mean']:.3f}",
                            v="/".join(str(trainer.versions[a]) for a in trainer.agents))
            bar.update(1)
            if on_step:
                on_step(metrics)
    return history
