"""A team of three through the app (issue 23, item 3): the brief task's outline / body / conclusion.

- On the embedded model (transformers engine, G=2, 24 new tokens): a round stores a group with three
  parts per candidate, the page's stars / ranking / pick-the-best rate it, the trainer service
  takes one MAGRPO step from the store on those ratings, all three agents get version 1, and the
  next round is served by those versions.
- The page (scripted engine, no model): the Co-write tab's round view has one column per agent of
  its largest team, and a round of a two-agent team next to it leaves the third column hidden.
"""
from __future__ import annotations

import pytest

from collab_app.engines.engine_types import Sampling
from collab_app.engines.team import Agent, Team
from collab_app.online.store import Store
from collab_app.web import handlers as H
from collab_app.web.context import AppContext
from helpers.model_app import MAX_NEW, TEXT
from tasks import load_task

ROLES = ("outline", "body", "conclusion")
A = H.Caller("session-A")
PLAIN = {"mode": "plain", "network_blocked": False, "read_only_filesystem": False, "separate_uid": False}


def _ctx(engine, tmp_path, names, **kw) -> AppContext:
    tasks = {n: load_task(n) for n in names}
    teams = {n: Team([Agent(r) for r in t.roles]) for n, t in tasks.items()}
    for team in teams.values():
        for a in team.agents:
            engine.register_agent(a.name)
            engine.load_adapter(a.name, None, None)
    return AppContext(engine=engine, store=Store(f"sqlite:///{tmp_path}/store.db"), tasks=tasks, teams=teams,
                      num_generations=2, home=str(tmp_path), adapters_dir=str(tmp_path / "adapters"), **kw)


@pytest.mark.slow   # ~45 s on the 2-core box: two rounds of 3 agents x G=2 and a step of three adapters
def test_three_agents_round_rating_and_step(engine, tmp_path):
    from collab_app.online.service import ServiceConfig, TrainerService

    ctx = _ctx(engine, tmp_path, ["brief"], sampling=Sampling(max_new_tokens=MAX_NEW, temperature=0.8))
    done = H.run_generate(ctx, H.start_writing(ctx, "brief", TEXT), A)
    ep = done["episode"]
    assert [[(p["role"], p["agent"]) for p in c["parts"]] for c in ep["candidates"]] == [list(zip(ROLES, ROLES))] * 2
    md = H.render_candidate(ep["candidates"][0], 0, coding=False)
    assert all(f"**{r}**" in md for r in ROLES)

    grp = ctx.store.group(ep["group_id"])
    assert grp.task == "brief" and grp.num_agents == 3 and len(grp.prompts) == 3 and grp.num_generations == 2
    assert [[s.agent for s in row] for row in grp.samples] == [[r] * 2 for r in ROLES]
    assert [j.joint for j in grp.joints] == [(0, 0, 0), (1, 1, 1)] and all(len(j.sample_ids) == 3 for j in grp.joints)
    task = ctx.tasks["brief"]
    for j, c in zip(grp.joints, ep["candidates"]):
        assert j.combined == task.combine(ep["example"], c["outputs"])

    # every form of rating works for three parts; each replaces the rater's last, the stars come last
    def latest():
        return [(r.kind, r.value) for r in ctx.store.ratings_for(rater="session:session-A")]
    assert "best first: candidate 2 > candidate 1" in H.rank(ctx, ep["group_id"], [2, 1], A)
    assert latest() == [("rank", 1), ("rank", 5)]
    assert "candidate 2 is the best of 2" in H.pick_best(ctx, ep["group_id"], 2, A)
    assert latest() == [("pick_best", 1), ("pick_best", 5)]
    assert "candidate 1: 5/5" in H.rate_candidates(ctx, ep, ["5", "1"], A)
    assert latest() == [("stars", 5), ("stars", 1)]
    assert [r.revision for r in ctx.store.ratings_for(rater="session:session-A")] == [2, 2]

    cfg = ServiceConfig(adapters_dir=ctx.adapters_dir, dtype="float32", learning_rate=1e-3, min_groups=1,
                        micro_batch_size=4, poll_s=0.1, heartbeat_s=0.5)
    svc = TrainerService(cfg, store=ctx.store, tasks=ctx.tasks)
    assert svc.poll_once() == "trained"
    step = ctx.store.train_steps()[-1]
    assert step["group_ids"] == [ep["group_id"]] and ctx.store.group(ep["group_id"]).status == "trained"
    assert all(step["metrics"][f"{r}/trained_samples"] == 2 for r in ROLES), step["metrics"]
    assert {r: ctx.store.current_adapter_versions()[r][0] for r in ROLES} == dict.fromkeys(ROLES, 1)

    H.sync_adapters(ctx)   # what the batcher does before every batch
    ep2 = H.run_generate(ctx, H.start_writing(ctx, "brief", TEXT), A)["episode"]
    assert {p["adapter_version"] for c in ep2["candidates"] for p in c["parts"]} == {1}


def _by_id(demo, elem_id):
    return next((b for b in demo.blocks.values() if getattr(b, "elem_id", None) == elem_id), None)


def test_round_view_has_a_column_per_agent(tmp_path, monkeypatch):
    import gradio as gr

    from collab_app.web import ui
    from helpers.scripted import ScriptedStreamEngine

    ctx = _ctx(ScriptedStreamEngine(), tmp_path, ["humaneval", "tldr", "brief"], isolation=PLAIN,
               sampling=Sampling(max_new_tokens=16))
    demo = ui.build_app(ctx)
    for i in range(ctx.max_generations):
        assert [_by_id(demo, f"write-cand-{i}-part-{a}") is not None for a in range(4)] == [True] * 3 + [False]
        assert [_by_id(demo, f"code-cand-{i}-part-{a}") is not None for a in range(3)] == [True] * 2 + [False]
    assert [c[0] for c in _by_id(demo, "write-task").choices] == ["tldr: summary + detail",
                                                                  "brief: outline + body + conclusion"]

    monkeypatch.setattr(ui, "_caller", lambda request: A)
    with gr.Blocks():
        panel = ui._Panel(ctx, "write", 3)
        state = gr.State()
    for name, n in (("brief", 3), ("tldr", 2)):   # a three-agent round, then a two-agent one in the same view
        shown: dict = {}
        for upd in panel.stream(H.start_writing(ctx, name, TEXT), state, None):
            for comp, value in upd.items():   # a gr.update dict, or a plain value
                update = isinstance(value, dict) and value.get("__type__") == "update"
                shown.setdefault(comp, {}).update(value if update else {"value": value})
        roles = ctx.tasks[name].roles
        for i in range(2):
            parts = [shown[p] for p in panel.parts[i]]
            assert [p.get("visible") for p in parts] == [True] * n + [False] * (3 - n)
            assert [f"**{r}**" in p["value"] for p, r in zip(parts, roles)] == [True] * n
            assert shown[panel.heads[i]]["value"].startswith(f"### Candidate {i + 1} — ")
            assert "Automatic checks" in shown[panel.checks[i]]["value"]
        assert shown[state]["value"]["group_id"] is not None
