"""A heterogeneous team through the online loop (issue 23): `svc_helper` on the embedded SmolLM2,
`svc_main` on the tiny Qwen2 with its own tokenizer (helpers/tiny_model.py). Served by one
TeamEngine, its groups stored, one trainer-service step (both adapters change), the version rows
record each agent's base, the watcher hot-swaps both, the next round runs on the new versions,
the export and the Team tab name each part's base. Plus the flags: `collab serve --agent-models
ROLE=MODEL` and what it hands its trainer child."""
from __future__ import annotations

import os
from datetime import datetime, timezone
from types import SimpleNamespace

import pytest

from collab_app.engines.engine_types import Request, Sampling
from collab_app.online.service import ServiceConfig, TrainerService
from helpers.service import AGENTS, TASK, add_groups


def test_serve_flags_name_roles_and_reach_the_trainer_child():
    from collab_app.web.serve import ServeConfig, check_agent_roles, trainer_argv

    with pytest.raises(ValueError, match="ROLE=MODEL"):
        ServeConfig(agent_models=["/some/model"])
    with pytest.raises(ValueError, match="serves one base model"):
        ServeConfig(agent_models=["main=/m"], engine_url="http://127.0.0.1:8000")
    with pytest.raises(ValueError, match=r"no served task has.*roles \['detail', 'summary'\]"):
        check_agent_roles({"mian": "/m"}, ["tldr"])
    argv = trainer_argv(ServeConfig(agent_models=["detail=/m"]), "/a", "/base", {"detail": "/m"})
    assert argv[argv.index("--agent-models") + 1:argv.index("--agent-models") + 2] == ["detail=/m"]
    cfg = ServiceConfig(agent_models=["detail=/m"])                 # the child parses it: every team's `detail`
    assert cfg.models_for(("summary", "detail")) == ["", "/m"] and cfg.models_for(("a", "b", "c")) == [""] * 3


@pytest.mark.slow
def test_rollout_train_hot_swap_and_serve_a_team_on_two_bases(sqlite_store, tmp_path, model_path, tiny_model_path):
    from collab_app.engines.team import make_team_engine
    from collab_app.online.export import group_rows
    from collab_app.online.hotswap import AdapterWatcher
    from collab_app.web.handlers import team_overview

    engine = make_team_engine("transformers", model_path, {AGENTS[0]: "", AGENTS[1]: tiny_model_path},
                              dtype="float32", seed=0)
    try:
        for a in AGENTS:
            engine.register_agent(a)
        ids = add_groups(sqlite_store, 2, engine)          # returns 0, 1: both agents get a signal
        g = sqlite_store.group(ids[0])
        assert [s.meta["model"] for s in g.samples[1]] == [tiny_model_path] * 2
        assert g.samples[0][0].prompt_token_ids != g.samples[1][0].prompt_token_ids   # two tokenizers

        cfg = ServiceConfig(adapters_dir=str(tmp_path / "adapters"), return_mode="auto", dtype="float32",
                            learning_rate=1e-3, micro_batch_size=4, min_groups=2, poll_s=0.1, heartbeat_s=0.5,
                            agent_models=[f"{AGENTS[1]}={tiny_model_path}"])
        svc = TrainerService(cfg, store=sqlite_store, tasks={TASK.name: TASK})
        assert svc.poll_once() == "trained"
        trainer = svc.trainers[TASK.name]
        assert trainer.base_of == {AGENTS[0]: model_path, AGENTS[1]: tiny_model_path}
        for a in AGENTS:                                    # v0 (reconciled from collab.json) and v1 name the base
            rows = sqlite_store.adapter_versions(a)
            assert [r.version for r in rows] == [0, 1] and {r.base_model for r in rows} == {trainer.base_of[a]}

        swaps = AdapterWatcher(engine, sqlite_store, list(AGENTS)).poll_once()
        assert {a: engine.adapter_version(a) for a in AGENTS} == {AGENTS[0]: 1, AGENTS[1]: 1}, swaps
        out = engine.generate([Request(a, "Name one fact about owls.") for a in AGENTS], 2,
                              Sampling(max_new_tokens=4, temperature=1.0, seed=5))
        assert [[s.adapter_version for s in row] for row in out] == [[1, 1], [1, 1]]

        rows = group_rows(g, cfg.rule(), datetime.now(timezone.utc))
        assert rows[0]["base_models"] == [model_path, tiny_model_path]
        ctx = SimpleNamespace(engine=engine, store=sqlite_store, sampling=Sampling(), num_generations=2,
                              teams={TASK.name: SimpleNamespace(agents=[SimpleNamespace(name=a, role_prompt="", model=None)
                                                                        for a in AGENTS])},
                              agent_names=lambda: list(AGENTS))
        tab = team_overview(ctx)
        assert f"| `{AGENTS[1]}` | `{os.path.basename(tiny_model_path)}` |" in tab
        assert f"| `{os.path.basename(tiny_model_path)}` | {AGENTS[1]} |" in tab and "MiB (parameters)" in tab
    finally:
        engine.close()
