"""`EngineSampler`: an Engine as the trainer sees it (trainer.magrpo.Sampler).

The trainer may not import collab_app, where Request and Sampling live, so the conversion
happens here; `collab train` (self-play rollouts) and the trainer service (its own rollouts,
when it has an engine) both use it.
"""
from __future__ import annotations

from collab_app.engines.engine_types import Request, Sampling


class EngineSampler:
    """trainer.magrpo.Sampler over an Engine: (agent, prompt) requests -> Samples per request."""

    def __init__(self, engine):
        self.engine = engine

    def sample(self, requests, n, *, max_new_tokens, temperature, top_p, seed):
        return self.engine.generate([Request(agent=a, prompt=p) for a, p in requests], n,
                                    Sampling(max_new_tokens=max_new_tokens, temperature=temperature,
                                             top_p=top_p, seed=seed))

    def load_adapter(self, agent, path, version):
        self.engine.load_adapter(agent, path, version)
