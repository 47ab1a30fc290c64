"""An app context on the embedded model (the `engine` fixture of tests/web/conftest.py): real
store (SQLite), the HumanEval and TL;DR teams, each test starting on the base model."""
from __future__ import annotations

from collab_app.engines.engine_types import Sampling
from collab_app.web.context import AppContext

MAX_NEW = 24
TEXT = ("The city council met on Tuesday to discuss the new bicycle lanes. Residents said the lanes "
        "made the streets safer, but shop owners worried about parking. The council agreed to test "
        "the lanes for six months and then decide. A survey of riders will be published in June.")



def make_ctx(engine, store_path, **kw) -> AppContext:
    from collab_app.online.store import Store
    from collab_app.engines.team import Agent, Team
    from tasks import load_task

    tasks = {name: load_task(name) for name in ("humaneval", "tldr")}
    teams = {name: Team([Agent(role) for role in t.roles]) for name, t in tasks.items()}
    for team in teams.values():
        for a in team.agents:
            engine.register_agent(a.name)
            engine.load_adapter(a.name, None, None)   # each test starts on the base model
    kw.setdefault("sampling", Sampling(max_new_tokens=MAX_NEW, temperature=0.8))
    return AppContext(engine=engine, store=Store(f"sqlite:///{store_path}"), tasks=tasks, teams=teams,
                      num_generations=2, home=str(store_path.parent), **kw)


def record_steps(store, roles, lora_adapter, steps: int, first: int = 1) -> None:
    """Training steps `first`..`first + steps - 1` as the trainer records them: each writes a new
    version of every role (version n = step n, the `lora_adapter(n)` fixture's adapter)."""
    for step in range(first, first + steps):
        for role in roles:
            store.record_adapter_version(role, step, lora_adapter(step), step=step)
