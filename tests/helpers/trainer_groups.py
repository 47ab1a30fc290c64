"""Groups for a trainer's update whose behaviour log-probs are the trainer's own (at temperature 1,
recorded as the samples' sampling)."""
from __future__ import annotations

import torch

from collab_app.engines.engine_types import Sample
from trainer.magrpo import Group, sequence_logprobs


def on_policy_groups(trainer, shift=0.0, returns=(1.0, 0.0), late=False):
    """Two groups (G=2) whose behaviour log-probs are the trainer's own current ones (+ shift),
    stamped with the trainer's current versions (late: the version before, i.e. off-policy)."""
    groups = []
    for e in range(2):
        samples = []
        for agent in trainer.agents:
            prompts = [[1, 504 + e, 3060, 28, 2]] * 2
            comps = [[907 + e, 314, 253], [11 + e, 12, 13, 14, 2]]
            trainer.model.set_adapter(agent)
            with torch.no_grad():
                lp, mask = sequence_logprobs(trainer.model, prompts, comps)
            version = trainer.versions[agent] - (1 if late else 0)
            samples.append([Sample(agent=agent, adapter_version=version, prompt_token_ids=p, text="x", token_ids=c,
                                   logprobs=[v + shift for v in lp[i, :len(c)].tolist()],
                                   meta={"sampling": {"temperature": 1.0, "top_p": 1.0}})
                            for i, (p, c) in enumerate(zip(prompts, comps))])
        groups.append(Group(task="tldr", example_id=f"e{e}", turn=0, prompts=["x", "y"], samples=samples,
                            joint=[(0, 0), (1, 1)], returns=list(returns), rewards=list(returns),
                            levels=[{}, {}]))
    return groups
