"""A small two-agent task for the trainer service's tests, and groups of it in a store."""
from __future__ import annotations

from collab_app.engines.engine_types import Request, Sample, Sampling
from tasks.base import Reward

AGENTS = ("svc_helper", "svc_main")


class TwoAgentTask:
    """A small task for the service's own tests: the service takes returns from the store, so the
    task only names the agents (its roles) and formats prompts."""

    name = "svc-test"
    num_agents = 2
    roles = AGENTS
    max_reward = 1.0
    level_names = ("score",)

    def examples(self, split):
        return [{"id": f"{split}-{i}", "topic": t} for i, t in enumerate(["rivers", "bread", "clocks", "owls"])]

    def agent_prompts(self, example, history, earlier=()):
        return [f"Name one fact about {example['topic']}.", f"Write one sentence about {example['topic']}."]

    def combine(self, example, outputs):
        return "\n".join(outputs)

    def reward(self, example, outputs):
        v = min(len(" ".join(outputs).split()) / 40, 1.0)
        return Reward(v, {"score": v}, 1.0)

    def feedback(self, example, outputs):
        return ["", ""]


TASK = TwoAgentTask()


def fake_sample(agent: str, g: int) -> Sample:
    return Sample(agent=agent, adapter_version=None, prompt_token_ids=[1, 2, 3], text=f"answer {g}",
                  token_ids=[5 + g, 6], logprobs=[-1.0, -0.5], finish_reason="length")


def add_groups(store, n: int, engine=None, G: int = 2, seed: int = 0, flat: bool = False) -> list[int]:
    """n groups of G joint answers. With an engine the samples are real (token ids, behaviour
    log-probs); returns are 0, 1, ..., G-1 so every group carries a learning signal (`flat`: all
    1.0, so none does)."""
    ids = []
    for k in range(n):
        ex = TASK.examples("train")[k % 4]
        prompts = TASK.agent_prompts(ex, [])
        if engine is None:
            samples = [[fake_sample(a, g) for g in range(G)] for a in AGENTS]
        else:
            out = engine.generate([Request(a, p) for a, p in zip(AGENTS, prompts)], G,
                                  Sampling(max_new_tokens=8, temperature=1.0, seed=seed + k))
            samples = [list(o) for o in out]
        rewards = [Reward(r, {"score": r}, float(G)) for r in ([1.0] * G if flat else map(float, range(G)))]
        gid, _ = store.add_group(task=TASK.name, example=ex, prompts=prompts, samples=samples,
                                 joint=[(g, g) for g in range(G)], auto_rewards=rewards, session_id="test")
        ids.append(gid)
    return ids


class FakeTrainer:
    """What the service's train_step needs of MAGRPOTrainer, without a model: records each step's group ids
    (tests of which groups a step takes)."""

    agents: tuple = ()
    versions: dict = {}

    def __init__(self):
        self.steps: list[list[int]] = []

    def update(self, groups):
        ids = [g.id for g in groups]
        self.steps.append(ids)
        return {"group_ids": ids, "stale_group_ids": [], "step": len(self.steps), "return_mean": 0.0}
