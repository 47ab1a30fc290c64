"""`collab train --num-agents 1`: the single-agent GRPO baseline trained by the MAGRPO trainer.

The task is built with num_agents=1 (one agent does every role); a team size the task has no
prompts for is refused before any model loads; the single agent's name never collides with a
team's role or another task's single agent (they name adapter folders). The slow test trains two
real steps on the embedded model (the TLDR single writer: at 48 new tokens about half the answers
pass the length gate, and raw advantages make any passing answer a learning signal) and evaluates
the result with `collab eval --systems single single-trained`."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from tasks import TASKS, load_task
from trainer import adapters


def test_agent_names_of_teams_and_single_agents_never_collide():
    # adapters live under {adapters_dir}/{agent}/: a shared name would resume or serve another's weights
    owners: dict[str, tuple[str, int]] = {}
    for name, cls in TASKS.items():
        if cls.team != name:   # custom-coding is worked on by humaneval's agents, by design
            continue
        for task in (load_task(name), load_task(name, num_agents=1)):   # the team, the single agent
            for role in task.roles:
                assert role not in owners, f"{name} x{task.num_agents} and {owners[role]} both name an agent {role!r}"
                owners[role] = (name, task.num_agents)
    assert owners["coder"] == ("humaneval", 1) and owners["tldr-writer"] == ("tldr", 1)


def test_train_refuses_a_team_size_the_task_lacks(model_path, tmp_path, capsys):
    from collab_app.commands import train_cmd

    rc = train_cmd.cli_main(["--task", "humaneval", "--num-agents", "3", "--model", model_path,
                             "--output-dir", str(tmp_path / "run")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--task humaneval --num-agents 3" in err and "num_agents must be 1" in err
    assert not (tmp_path / "run").exists()   # refused before a run folder (or a model) is made


@pytest.mark.slow
def test_collab_train_single_agent_two_steps_then_eval(model_path, tmp_path, capsys, served_versions):
    from collab_app.commands import evaluate, train_cmd

    served = served_versions
    out = tmp_path / "run"
    rc = train_cmd.cli_main([
        "--task", "tldr", "--num-agents", "1", "--engine", "transformers", "--model", model_path,
        # 128 tokens, G=4: the single writer must fit both parts and the split line into its answer
        # (tasks/writing.py); at 48 tokens and G=2 every return of both steps was 0 with some draws
        # (AVX2, fp32), so no step had a learning signal and no version was trained
        "--num-steps", "2", "--num-generations", "4", "--prompts-per-step", "2", "--max-new-tokens", "128",
        "--eval-examples", "1", "--eval-every", "2", "--advantage-mode", "raw", "--learning-rate", "1e-3",
        "--output-dir", str(out),
    ])
    assert rc == 0
    assert os.listdir(out / "adapters") == ["tldr-writer"]      # one adapter, the single role's
    version, path = adapters.latest_version(str(out / "adapters"), "tldr-writer")
    assert version >= 1 and served["tldr-writer"] == version
    v0 = load_file(os.path.join(adapters.version_dir(str(out / "adapters"), "tldr-writer", 0), "adapter_model.safetensors"))
    new = load_file(os.path.join(path, "adapter_model.safetensors"))
    assert v0.keys() == new.keys() and any(not torch.equal(v0[k], new[k]) for k in v0), "the adapter did not change"
    records = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2]
    evals = [r for r in records if r["kind"] == "eval"]
    # before and after training; eval-every 2 skips step 1 (an evaluation of one example at 128
    # tokens takes 7-11 s here, a tenth of the test)
    assert [r["step"] for r in evals] == [0, 2] and all(len(e["returns"]) == 1 for e in evals)
    assert evals[-1]["versions"] == {"tldr-writer": version}
    assert (out / "summary.png").stat().st_size > 10_000
    assert json.load(open(out / "config.json"))["num_agents"] == 1
    capsys.readouterr()

    # collab eval serves the trained version as single-trained, next to the untrained single agent
    result_path = tmp_path / "eval.json"
    assert evaluate.cli_main([
        "--task", "tldr", "--engine", "transformers", "--model", model_path, "--limit", "1", "--max-new-tokens", "48",
        "--systems", "single", "single-trained", "--single-adapters-dir", str(out / "adapters"),
        "--out", str(result_path)]) == 0
    result = json.load(open(result_path))
    assert result["systems"]["single-trained"]["adapter_versions"] == {"tldr-writer": version}
    assert "adapter_versions" not in result["systems"]["single"]                 # the base model
    pair = result["paired"]["single-trained - single"]
    assert pair["problems"] == 1 and list(result["systems"]["single-trained"]["returns"]) == list(evals[0]["returns"])
    assert "single-trained - single:" in capsys.readouterr().out
