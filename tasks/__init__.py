"""Tasks: data + per-agent prompts + how outputs combine + reward + feedback. Imports nothing of ours.

`load_task(name, **kw)` builds a task by name: TASKS maps names to classes, keyword arguments go
to the class (e.g. `load_task("humaneval", num_agents=1)`, or `load_task("custom_coding",
prompt=..., tests=...)`).
"""
from __future__ import annotations

from tasks.coding import CustomCodingTask, HumanEvalTask
from tasks.writing import ExpansionTask, TLDRTask

TASKS: dict[str, type] = {
    "humaneval": HumanEvalTask,
    "custom_coding": CustomCodingTask,
    "tldr": TLDRTask,
    "expansion": ExpansionTask,
}


def load_task(name: str, **kw):
    """The task called `name` (one of TASKS), built with `kw`."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of {sorted(TASKS)}")
    return TASKS[name](**kw)
