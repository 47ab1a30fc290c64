"""The Task contract (docs/ARCHITECTURE.md "Contracts") shared by every task file, the trainer and the app.

A task owns its data and its scoring. It knows nothing of engines, stores or UIs: it turns an
example (+ the conversation so far) into one prompt per agent, combines the agents' outputs
into what a person sees, scores them, and writes feedback for the next turn.

One contract, no signature sniffing: every task implements all of `Task`'s methods with these
exact signatures, and a wrong return shape is an error (`check_reward`, `check_prompts`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

Example = dict[str, Any]
"""One problem / text. Always has a string `id`; the rest is task specific."""


@dataclass(frozen=True)
class Turn:
    """One finished turn of a multi-turn episode: what each agent wrote, and the feedback each
    agent gets for the next turn (`Task.feedback`)."""

    outputs: tuple[str, ...]
    feedback: tuple[str, ...]


@dataclass(frozen=True)
class Reward:
    """The shared team reward of one joint action, with its named levels so that the UI and
    the logs can show *why* (e.g. {"structure": 1.0, "syntax": 0.5, "tests": 0.75, ...}).

    `total` is the sum of `levels` (checked), `max_total` the task's best possible total.
    `details` carries free-form diagnostics (failing test, sandbox errors) for display only.
    """

    total: float
    levels: dict[str, float]
    max_total: float
    details: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        s = sum(self.levels.values())
        if abs(s - self.total) > 1e-6:
            raise ValueError(f"Reward.total={self.total} but its levels sum to {s}: {self.levels}")


@runtime_checkable
class Task(Protocol):
    name: str                       # the task's one name: store rows, the app, the API and the CLI use it
    kind: str                       # "coding" (a person gives a problem) or "writing" (a person gives a text);
                                    # a coding task also says `lists_problems` (its examples are problems a
                                    # person picks from) and `title` (how the page names it): tasks/coding.py
    private: bool                   # a person's own data: its groups train the shared team only while an admin allows it
    team: str                       # the task whose team (agents, adapters) works on this one: its own name, or another's
    num_agents: int
    roles: tuple[str, ...]          # one short role name per agent, e.g. ("helper", "main")
    max_reward: float
    level_names: tuple[str, ...]    # the keys of Reward.levels, in display order

    def examples(self, split: str) -> list[Example]:
        """The examples of a split: "train" or "eval" (a fixed, documented split)."""

    def agent_prompts(self, example: Example, history: list[Turn],
                      earlier: tuple[str, ...] = ()) -> list[str]:
        """One user prompt per agent (role instructions included).

        `history`: finished turns (empty on turn 1). `earlier`: outputs of agents that already
        spoke *in this turn*, used only by the `sequential` baseline (agent k sees agents < k);
        the MAGRPO team generates in parallel and passes ().
        """

    def combine(self, example: Example, outputs: list[str]) -> str:
        """The joint result a person sees (e.g. aux + main as one program)."""

    def reward(self, example: Example, outputs: list[str]) -> Reward:
        """Score one joint action (one output per agent)."""

    def feedback(self, example: Example, outputs: list[str]) -> list[str]:
        """Per-agent feedback text for the next turn."""


def check_prompts(task: Task, prompts: list[str]) -> list[str]:
    """Validate `agent_prompts`' return shape: a list of `num_agents` non-empty strings."""
    if not isinstance(prompts, list) or len(prompts) != task.num_agents or not all(
        isinstance(p, str) and p.strip() for p in prompts
    ):
        raise TypeError(f"{task.name}.agent_prompts must return {task.num_agents} non-empty strings, "
                        f"got {prompts!r:.200}")
    return prompts


def check_reward(task: Task, reward: Reward) -> Reward:
    """Validate `reward`'s return: a Reward whose levels are the task's `level_names`."""
    if not isinstance(reward, Reward):
        raise TypeError(f"{task.name}.reward must return a Reward, got {type(reward).__name__}")
    if set(reward.levels) != set(task.level_names):
        raise TypeError(f"{task.name}.reward levels {sorted(reward.levels)} != {sorted(task.level_names)}")
    return reward
