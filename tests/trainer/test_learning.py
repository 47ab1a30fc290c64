"""MAGRPO learns: on the real TLDR reward the team's mean return rises above what it was untrained.

Setup (fixed seed, CPU, transformers engine, embedded SmolLM2-135M): one TLDR text (the
shortest train text, so prompts are short), G=8 per agent, cross joint actions (8 x 8 = 64
joint returns per step: each summary is credited with its mean over all 8 details and vice
versa, the low-variance credit the paper motivates cross mode with), 40 new tokens, lr 2e-3,
8 steps. What moves first is the length ratio (detail / summary in 1.6..3.2): the summary agent
learns to stop earlier, which also lifts the distinct-word ratio and the style level.

Claim: the mean return of steps 4-7 (the rollouts of versions 4-7) exceeds, by >= 0.3 (of 3.0),
that of version 0 rolled out with the same steps' seeds (the control: the same draws, no
learning; 4 rollouts, no updates).
Why a control and not the first steps: a step's mean return moves a lot with its draws (one
text, 8 samples per agent), and how much depends on the CPU (`auto` trains and samples in bf16
where bf16 is native, fp32 elsewhere; bf16 kernels differ between CPUs), so the old claim, the last
3 of 5 steps against the first 2, judged one machine's curve: on an AMD EPYC with AVX512_BF16
(no AMX, 2026-11-30) version 0 drew 2.11 at step 0 and 0.83-1.46 at steps 1-4, the test's run read
2.11, 1.93, 1.52, 2.03, 1.54 ("no clear rise") while it learned (steps 1-4 0.69 above version 0's
draws at the same seeds, steps 5-7 2.64, 2.55, 2.22). Measured on that EPYC with the seed
changed (docs/results/learning_runs.py; rise of steps 4-7 over version 0 at their seeds): seed 1
0.64 (1.92 vs 1.28), seed 2 0.44 (1.68 vs 1.24, its last step 0.97); five-step runs with the
seed of the test: native 0.69 (steps 1-4), AVX2 emulated (fp32) 0.75. Earlier machines' five-step
curves with the old claim:
  lr 2e-3, Xeon with AMX (bf16): 1.10, 1.53, 1.64, 2.29, 2.01      -> rise 0.67 (2026-11-27)
  lr 2e-3, AVX2 emulated (fp32): 1.34, 1.47, 2.29, 1.98, 1.72      -> rise 0.59 (2026-11-27)
Version 0's own step means on that EPYC: sd 0.15-0.28 a step, so the control's mean of 4 is good
to ~0.1. Cost: 96 s on that EPYC alone (140 s inside its suite) and 97 s under its AVX2 emulation
(57 s for five steps).
"""
from __future__ import annotations

import statistics

import pytest

from tasks.writing import TLDRTask


STEPS = 8
COMPARED = range(4, 8)   # the steps whose rollouts (versions 4-7) are set against version 0's at the same seeds
MIN_RISE = 0.3


class OneTextTLDR(TLDRTask):
    """The real TLDR task and reward, narrowed to its shortest train text."""

    def examples(self, split):
        return sorted(super().examples("train"), key=lambda e: len(e["text"]))[:1]


def tldr_config(model_path: str, learning_rate: float = 2e-3, num_steps: int = STEPS, seed: int = 0):
    """The test's MAGRPO config (docs/results/learning_runs.py runs it with other values)."""
    from trainer.config import MAGRPOConfig

    return MAGRPOConfig(task="tldr", model=model_path, num_generations=8, joint_mode="cross", prompts_per_step=1,
                        max_new_tokens=40, num_steps=num_steps, learning_rate=learning_rate, seed=seed, keep_versions=0)


@pytest.mark.slow
def test_mean_return_rises_on_tldr(model_path, tmp_path):
    from collab_app.engines import make_engine
    from collab_app.engines.sampler import EngineSampler
    from trainer.magrpo import MAGRPOTrainer, group_metrics, rollout
    from trainer import offline
    from trainer.offline import prompts_of_step, seed_for

    cfg = tldr_config(model_path)
    task = OneTextTLDR()
    trainer = MAGRPOTrainer(cfg, task, str(tmp_path / "adapters"))
    engine = make_engine("transformers", model=model_path, seed=0)
    for role in task.roles:
        engine.register_agent(role)
    sampler = EngineSampler(engine)
    # the control: version 0 (what the team would do without learning) rolled out with the seeds
    # of the steps compared, the same draws the trained versions get at those steps
    trainer.load_into(sampler)
    examples = task.examples("train")
    control = [group_metrics(rollout(sampler, task, prompts_of_step(examples, cfg, step), cfg,
                                     seed=seed_for(cfg.seed, step=step)))["return_mean"] for step in COMPARED]
    history = offline.train(trainer, sampler)
    returns = [m["return_mean"] for m in history]
    rise = statistics.fmean(returns[s] for s in COMPARED) - statistics.fmean(control)
    assert rise >= MIN_RISE, (f"mean return per step {[round(r, 3) for r in returns]}, version 0 at the seeds of "
                              f"steps {list(COMPARED)} {[round(r, 3) for r in control]}: no clear rise ({rise:.3f})")
    assert all(m["summary/trained_samples"] > 0 for m in history)
