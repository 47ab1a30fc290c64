"""Every task honours the Task contract of tasks/base.py: attributes, prompt and reward shapes,
one feedback text per agent, wrong output counts rejected, `load_task` by name. Cheap outputs
only (no sandbox run: a coding answer without the entry function stops at the structure gate)."""
from __future__ import annotations

import pytest

from tasks import TASKS, load_task
from tasks.base import Reward, Task, Turn, check_prompts, check_reward

PROMPT = 'def add(a: int, b: int) -> int:\n    """Return a + b."""\n'
CASES = [("humaneval", {}), ("humaneval", {"num_agents": 1}),
         ("custom-coding", {"prompt": PROMPT, "tests": "assert add(1, 2) == 3"}),
         ("custom-coding", {"prompt": PROMPT, "tests": "assert add(1, 2) == 3", "num_agents": 1}),
         ("tldr", {}), ("tldr", {"num_agents": 1}), ("expansion", {}), ("expansion", {"num_agents": 1}),
         ("brief", {"num_agents": 3}), ("brief", {"num_agents": 1})]


@pytest.mark.parametrize("name,kw", CASES, ids=[f"{n}-{kw.get('num_agents', 2)}" for n, kw in CASES])
def test_contract(name, kw):
    task = load_task(name, **kw)
    assert isinstance(task, Task)
    assert task.name == name and task.num_agents == kw.get("num_agents", 2)
    assert len(task.roles) == task.num_agents and all(isinstance(r, str) and r for r in task.roles)
    assert task.max_reward in (3.0, 4.0) and len(task.level_names) == 4
    for split in ("train", "eval"):
        exs = task.examples(split)
        assert exs and all(isinstance(e["id"], str) for e in exs)
    ex = task.examples("eval")[0]
    prompts = check_prompts(task, task.agent_prompts(ex, []))
    # turn 1 of a 2048-token model: the prompt must leave room to answer (chars/3 >= tokens for
    # English and code, so 4000 chars stay well under 1500 tokens)
    assert max(len(p) for p in prompts) < 4000
    outputs = ["nothing useful"] * task.num_agents
    check_prompts(task, task.agent_prompts(ex, [Turn(tuple(outputs), tuple(outputs))]))
    check_prompts(task, task.agent_prompts(ex, [], earlier=tuple(outputs[:-1])))
    r = check_reward(task, task.reward(ex, outputs))
    assert isinstance(r, Reward) and r.max_total == task.max_reward and 0 <= r.total <= task.max_reward
    assert list(r.levels) == list(task.level_names)
    fb = task.feedback(ex, outputs)
    assert isinstance(fb, list) and len(fb) == task.num_agents and all(isinstance(f, str) and f for f in fb)
    assert isinstance(task.combine(ex, outputs), str)
    with pytest.raises(TypeError):
        task.reward(ex, outputs + ["one too many"])


def test_every_shipped_prompt_fits():
    for name in ("humaneval", "tldr", "expansion"):
        for n in (1, 2):
            task = load_task(name, num_agents=n)
            for split in ("train", "eval"):
                for ex in task.examples(split):
                    assert max(len(p) for p in task.agent_prompts(ex, [])) < 4000, ex["id"]


def test_load_task_names():
    assert set(TASKS) == {"humaneval", "custom-coding", "tldr", "expansion", "brief"}
    with pytest.raises(ValueError, match="unknown task"):
        load_task("chess")


def test_a_task_says_what_it_is():
    """kind, private and team are the task's own (issue 24): every list of names elsewhere is read from them."""
    from tasks import PRIVATE_TASKS, TASKS, team_of

    for name, cls in TASKS.items():
        assert cls.name == name and cls.kind in ("coding", "writing")
        assert cls.team in TASKS and TASKS[cls.team].kind == cls.kind, f"{name}'s team must be a task of its kind"
        assert TASKS[cls.team].team == cls.team, "a team task is its own team"
    assert PRIVATE_TASKS == ("custom-coding",) and team_of("custom-coding") == "humaneval"
    assert team_of("tldr") == "tldr" and team_of("not-a-task") == "not-a-task"


def test_roles_of_tasks_are_their_agents_once_each_in_order():
    """One agent per distinct role (web/context.py build_context, engine_race.serve_slots)."""
    from tasks import SERVED_BY_DEFAULT, roles_of

    served = [load_task(n) for n in SERVED_BY_DEFAULT]
    assert roles_of(served) == ["helper", "main", "summary", "detail", "background", "method"]
    assert roles_of([load_task("tldr"), load_task("tldr"), load_task("brief")]) == ["summary", "detail", "outline",
                                                                                   "body", "conclusion"]
    assert roles_of([]) == []


def test_the_largest_team_is_the_most_roles_one_task_has():
    """tasks.largest_team sizes a compiled engine's in-graph LoRA lanes (build_context, engine_race.serve_lanes)."""
    from tasks import SERVED_BY_DEFAULT, largest_team

    assert largest_team(load_task(n) for n in SERVED_BY_DEFAULT) == 2
    assert largest_team([load_task("tldr"), load_task("brief")]) == 3
    assert largest_team([]) == 1


@pytest.mark.parametrize("names, agents, lanes", [(None, 6, 2), (("tldr", "brief"), 5, 3), (("tldr",), 2, 2)])
def test_the_app_gives_its_engine_a_slot_per_agent_and_a_lane_per_agent_of_its_largest_team(
        tmp_path, monkeypatch, names, agents, lanes):
    """web/context.py build_context: the engine's `num_agents` is every served role and the
    arena's version slots (engines/version_slots.py: DEFAULT_SLOTS x the largest team), its
    `lora_lanes` (a compiled CPU engine's in-graph LoRA lanes: every forward computes all of them)
    the largest team's agents, since one call holds one team (engines/batcher.py). An explicit
    engine keyword still wins."""
    from collab_app.engines.version_slots import DEFAULT_SLOTS
    from collab_app.engines import team as team_module
    from collab_app.web.context import build_context
    from tasks import SERVED_BY_DEFAULT

    seen = {}

    class Stop(Exception):
        pass

    def fake(kind, model, agent_models, **kw):
        seen.update(kw, agents=sorted(agent_models))
        raise Stop

    monkeypatch.setattr(team_module, "make_team_engine", fake)
    monkeypatch.setattr("collab_app.engines.model.ensure_model", lambda m=None: "/model")
    with pytest.raises(Stop):
        build_context(engine="vllm", store_url=f"sqlite:///{tmp_path}/s.db", home=str(tmp_path / "home"),
                      task_names=names or SERVED_BY_DEFAULT)
    assert (seen["num_agents"], seen["lora_lanes"], len(seen["agents"])) == (agents + DEFAULT_SLOTS * lanes, lanes, agents)
    with pytest.raises(Stop):
        build_context(engine="vllm", store_url=f"sqlite:///{tmp_path}/s.db", home=str(tmp_path / "home"),
                      task_names=("tldr",), lora_lanes=4)
    assert seen["lora_lanes"] == 4
