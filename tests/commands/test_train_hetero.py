"""`collab train --agent-models "" <tiny>` (issue 23): the TLDR team with `summary` on the embedded
SmolLM2 and `detail` on the tiny Qwen2 built in the tests (helpers/tiny_model.py), transformers
engine, one MAGRPO step, one held-out example. Checks the wiring: a TeamEngine serves the rollouts
and the evaluation, each agent's versions record its base, the engine got every version, and a
role the task lacks is refused before a run folder exists. (That both adapters move, each from
its own log-probs, is tests/trainer/test_hetero_team.py's.)"""
from __future__ import annotations

import json

import pytest

from trainer import adapters


@pytest.mark.slow
def test_collab_train_runs_a_team_on_two_bases(model_path, tiny_model_path, tmp_path, served_versions, capsys):
    from collab_app.commands import train_cmd

    out = tmp_path / "run"
    rc = train_cmd.cli_main([
        "--task", "tldr", "--engine", "transformers", "--model", model_path, "--agent-models", "", tiny_model_path,
        "--num-steps", "1", "--num-generations", "2", "--prompts-per-step", "1", "--max-new-tokens", "8",
        "--eval-examples", "1", "--advantage-mode", "raw", "--dtype", "float32", "--output-dir", str(out),
    ])
    assert rc == 0
    assert f"detail on {tiny_model_path}" in capsys.readouterr().out
    assert json.load(open(out / "config.json"))["agent_models"] == [model_path, tiny_model_path]
    records = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1]
    assert [r["step"] for r in records if r["kind"] == "eval"] == [0, 1]
    for agent, base in (("summary", model_path), ("detail", tiny_model_path)):
        versions = adapters.list_versions(str(out / "adapters"), agent)
        assert {adapters.read_meta(p)["base_model"] for _, p in versions} == {base}
        assert served_versions[agent] == versions[-1][0]


def test_collab_train_refuses_a_role_the_task_lacks(tmp_path, capsys):
    from collab_app.commands import train_cmd

    out = tmp_path / "run"
    rc = train_cmd.cli_main(["--task", "tldr", "--agent-models", "deatil=/m", "--output-dir", str(out)])
    assert rc == 2 and not out.exists()
    assert "not roles of tldr" in capsys.readouterr().err
