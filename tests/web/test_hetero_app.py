"""The app on a heterogeneous team (issue 23: what `collab serve --agent-models detail=<tiny>`
builds): the TL;DR team with `summary` on the embedded SmolLM2 and `detail` on the tiny Qwen2
with its own tokenizer (helpers/tiny_model.py). A round streams and is stored with each part's
base; a version of detail's adapter recorded in the store is hot-swapped in before the next round,
which runs on it; the Team tab lists each agent's base and the memory per base."""
from __future__ import annotations

import os

import pytest

from helpers.tiny_model import make_tiny_lora


@pytest.mark.slow
def test_the_app_serves_and_hot_swaps_a_team_on_two_bases(tmp_path, model_path, tiny_model_path):
    import torch

    from collab_app.engines.team import TeamEngine
    from collab_app.web import handlers as H
    from collab_app.web.context import build_context

    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # the 2-core box is shared (tests/web/conftest.py says why)
    ctx = build_context(model=model_path, engine="transformers", store_url=f"sqlite:///{tmp_path}/store.db",
                        task_names=("tldr",), num_generations=2, max_new_tokens=6, home=str(tmp_path / "home"),
                        agent_models={"detail": tiny_model_path})
    try:
        assert isinstance(ctx.engine, TeamEngine)
        assert [a.model for a in ctx.team_for("tldr").agents] == [None, tiny_model_path]
        text = ctx.tasks["tldr"].examples("eval")[0]["text"]
        caller = H.Caller("session-het")

        events = list(H.generate(ctx, H.start_writing(ctx, "tldr", text), caller))
        assert events[-1]["kind"] == "done" and any(e["kind"] == "progress" for e in events)
        grp = ctx.store.group(events[-1]["episode"]["group_id"])
        assert [s.meta["model"] for s in grp.samples[0]] == [model_path] * 2
        assert [s.meta["model"] for s in grp.samples[1]] == [tiny_model_path] * 2
        assert grp.samples[0][0].prompt_token_ids != grp.samples[1][0].prompt_token_ids

        ctx.store.record_adapter_version("detail", 1, make_tiny_lora(tiny_model_path, tmp_path / "v1"), step=1,
                                         base_model=tiny_model_path)
        events = list(H.generate(ctx, H.start_writing(ctx, "tldr", text), caller))   # the batcher polls the watcher
        parts = events[-1]["episode"]["candidates"][0]["parts"]
        assert [p["adapter_version"] for p in parts] == [None, 1]
        assert ctx.store.adapter_versions("detail")[0].base_model == tiny_model_path

        tab = H.team_overview(ctx)
        assert f"| tldr | `detail` | `{os.path.basename(tiny_model_path)}` |" in tab
        assert f"| `{os.path.basename(tiny_model_path)}` | detail |" in tab and "MiB (parameters)" in tab
    finally:
        ctx.engine.close()
        torch.set_num_threads(threads)
