"""Tasks: data + per-agent prompts + how outputs combine + reward + feedback. Imports nothing of ours.

`load_task(name, **kw)` builds a task by name: TASKS maps names to classes, keyword arguments go
to the class (e.g. `load_task("humaneval", num_agents=1)`, or `load_task("custom-coding",
prompt=..., tests=...)`). What a task is (its `kind`, whether it is `private`, which `team` works
on it) is the class's own: the app, the trainer service and the API read it from there
(`team_of`, `PRIVATE_TASKS`), never from lists of names of their own.
"""
from __future__ import annotations

from tasks.brief import BriefTask
from tasks.coding import CustomCodingTask, HumanEvalTask
from tasks.writing import ExpansionTask, TLDRTask

TASKS: dict[str, type] = {
    HumanEvalTask.name: HumanEvalTask,
    CustomCodingTask.name: CustomCodingTask,
    TLDRTask.name: TLDRTask,
    ExpansionTask.name: ExpansionTask,
    BriefTask.name: BriefTask,
}

SERVED_BY_DEFAULT: tuple[str, ...] = ("humaneval", "tldr", "expansion")
"""the tasks `collab serve` (and `make run`, the Space) offers unless told otherwise."""

PRIVATE_TASKS: tuple[str, ...] = tuple(name for name, cls in TASKS.items() if cls.private)
"""tasks whose groups train the shared team only while an admin allows it (a person's own problems)."""


def team_of(name: str) -> str:
    """The task whose team works on (and learns from) task `name`; an unknown name is its own."""
    cls = TASKS.get(name)
    return cls.team if cls is not None else name


def roles_of(tasks) -> list[str]:
    """The distinct roles of these tasks (loaded tasks), in order: the agents that serve them, one
    per role (tasks with the same roles share agents and adapters). `collab serve` gives its engine
    one agent slot per role, and the engine race builds its contestants with as many."""
    return list(dict.fromkeys(role for task in tasks for role in task.roles))


def largest_team(tasks) -> int:
    """The most agents one of these tasks (loaded tasks) has: one engine call holds one team's
    adapter versions (engines/batcher.py), so a compiled CPU engine serving these tasks computes
    this many in-graph LoRA lanes (`collab serve` and the engine race size their engines by it)."""
    return max((len(task.roles) for task in tasks), default=1)


def load_task(name: str, **kw):
    """The task called `name` (one of TASKS), built with `kw`."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of {sorted(TASKS)}")
    return TASKS[name](**kw)
