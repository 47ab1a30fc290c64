"""Paired in-process A/B of the logged KL estimate's cost in one MAGRPO update (kl_coef 0, the
default). The same rolled-out groups (tldr, 2 agents x G, aligned, NEW_TOKENS new tokens) are
updated again and again, arms alternating A B B A ...:

    THREADS=1 python docs/results/archive/update_ab.py [PAIRS [G [NEW_TOKENS]]]   # PAIRS 5, G 4, 64 tokens

A recomputes both sides of the estimate (the adapter's log-probs and the base's: two forwards of
KL_ESTIMATE_ROWS rows per agent); B takes the adapter's side from the step's own forward
(`MAGRPOTrainer._kl_estimate`: the base's forward only). (The script's version at 61cd938 also
measured completions fed in segments, not kept: docs/results "The KL estimate from the step's own
forward".)

Prints the rollout's lengths, each update's seconds and its logged KL and loss per agent, then each
arm's median and B / A. (Groups never go stale here: max_staleness is lifted; the adapters move
every update, so the KL grows.)
"""
import os
import statistics
import sys
import tempfile
import time

import collab_app  # noqa: F401  (before torch: the OpenMP wait setting)
import torch

from collab_app.engines import make_engine
from collab_app.engines.model import ensure_model
from collab_app.engines.sampler import EngineSampler
from tasks.writing import TLDRTask
from trainer.config import MAGRPOConfig
from trainer.magrpo import MAGRPOTrainer, rollout, sequence_logprobs
from trainer.offline import prompts_of_step, seed_for


@torch.no_grad()
def kl_both_sides(self, agent, prompts, completions, logp=None):
    """A: the estimate as it was, the adapter's side recomputed in a forward of its own."""
    model, eos = self.model_of[agent], self.eos_of[agent]
    own, mask = sequence_logprobs(model, prompts, completions, eos)            # (rows, T')
    with model.disable_adapter():
        ref, _ = sequence_logprobs(model, prompts, completions, eos)          # (rows, T')
    d = ref - own
    return torch.exp(d) - d - 1, mask


def rolled_out(adapters_dir: str, G: int, new_tokens: int) -> tuple[MAGRPOTrainer, list]:
    """A fresh tldr trainer (2 agents, version 0) and one step's groups rolled out by the
    transformers engine (aligned, G samples per agent, seed 0); the engine is closed after.
    (docs/results/archive/passes_ab.py uses it too.)"""
    model = ensure_model()
    cfg = MAGRPOConfig(task="tldr", model=model, num_generations=G, joint_mode="aligned", prompts_per_step=1,
                       max_new_tokens=new_tokens, num_steps=1, learning_rate=2e-3, seed=0, keep_versions=0,
                       max_staleness=1000)
    task = TLDRTask()
    trainer = MAGRPOTrainer(cfg, task, adapters_dir)
    engine = make_engine("transformers", model=model, seed=0)
    for role in task.roles:
        engine.register_agent(role)
    sampler = EngineSampler(engine)
    trainer.load_into(sampler)
    groups = rollout(sampler, task, prompts_of_step(task.examples("train"), cfg, 0), cfg, seed=seed_for(0, step=0))
    engine.close()
    return trainer, groups


def main(pairs: int = 5, G: int = 4, new_tokens: int = 64) -> None:
    own_forward = MAGRPOTrainer._kl_estimate
    torch.set_num_threads(int(os.environ.get("THREADS", "1")))
    with tempfile.TemporaryDirectory() as tmp:
        trainer, groups = rolled_out(os.path.join(tmp, "adapters"), G, new_tokens)
        for g in groups:
            for i, a in enumerate(trainer.agents):
                print(a, "prompt", len(g.samples[i][0].prompt_token_ids), "tokens",
                      [len(s.token_ids) for s in g.samples[i]])
        seconds = {"A": [], "B": []}
        for order in ("AB" if k % 2 == 0 else "BA" for k in range(pairs)):
            for arm in order:
                MAGRPOTrainer._kl_estimate = kl_both_sides if arm == "A" else own_forward
                t = time.perf_counter()
                m = trainer.update(groups)
                seconds[arm].append(time.perf_counter() - t)
                print(arm, f"{seconds[arm][-1]:.2f} s", "kl", [f"{m[f'{a}/kl']:.4g}" for a in trainer.agents],
                      "loss", [f"{m[f'{a}/loss']:.4g}" for a in trainer.agents], flush=True)
        MAGRPOTrainer._kl_estimate = own_forward
    for arm, s in seconds.items():
        print(arm, "median", round(statistics.median(s), 2), [round(x, 2) for x in s])
    print("B / A", round(statistics.median(seconds["B"]) / statistics.median(seconds["A"]), 3))


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:4]))
