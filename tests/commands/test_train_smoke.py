"""`collab train` end to end on CPU: the transformers engine, the real TLDR task, 2 MAGRPO steps
(G=2, 2 prompts, 24 new tokens) on the tiny base (tests/helpers/tiny_model.py: the command's
plumbing is under test, not what the model writes; the embedded model's training is tested by
tests/trainer/test_learning.py and test_train_single.py, and this test took 95 s on it on an AVX2
CPU against 6 s here). Checks that both agents' adapters changed (weights differ from version 0),
that the engine serves the new versions, and that the run folder has metrics.jsonl, TensorBoard
events and the summary plot; the learning-rate schedule, the time counted for --max-minutes (kept
across a resume) and per-problem eval returns.

advantage_mode=raw: a group's returns are often all equal at 24 tokens, and `mean` advantages
would be 0 (no update, nothing to check); raw advantages are the returns themselves, non-zero
whenever the length level passes."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from trainer import adapters


@pytest.mark.slow
def test_collab_train_two_steps(tiny_model_path, tmp_path, served_versions):
    model_path = tiny_model_path     # module doc
    from collab_app.commands import train_cmd

    served = served_versions
    out = tmp_path / "run"
    rc = train_cmd.cli_main([
        "--task", "tldr", "--engine", "transformers", "--model", model_path, "--num-steps", "2",
        "--num-generations", "2", "--prompts-per-step", "2", "--max-new-tokens", "24", "--eval-examples", "2",
        "--advantage-mode", "raw", "--learning-rate", "1e-3", "--lr-schedule", "linear", "--output-dir", str(out),
    ])
    assert rc == 0
    records = [json.loads(line) for line in open(out / "metrics.jsonl")]
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in train] == [1, 2] and [r["step"] for r in evals] == [0, 2]
    for key in ("return_mean", "level/length", "zero_variance_frac", "time/rollout_s", "time/reward_s",
                "time/update_s", "summary/clip_frac", "detail/kl", "detail/grad_norm"):
        assert key in train[-1], key
    for agent in ("summary", "detail"):
        version, path = adapters.latest_version(str(out / "adapters"), agent)
        assert version >= 1 and served[agent] == version
        v0 = load_file(os.path.join(adapters.version_dir(str(out / "adapters"), agent, 0), "adapter_model.safetensors"))
        new = load_file(os.path.join(path, "adapter_model.safetensors"))
        assert v0.keys() == new.keys()
        assert any(not torch.equal(v0[k], new[k]) for k in v0), f"{agent}'s adapter did not change"
    assert (out / "summary.png").stat().st_size > 10_000
    assert any(n.startswith("events.out.tfevents") for n in os.listdir(out / "tb"))
    assert json.load(open(out / "config.json"))["advantage_mode"] == "raw"
    # the schedule (linear over 2 steps), the time counted, per-problem returns for paired comparisons
    assert [r["learning_rate"] for r in train] == pytest.approx([1e-3, 5e-4])
    assert 0 < train[0]["train_seconds"] < train[1]["train_seconds"]
    assert all(len(e["returns"]) == 2 for e in evals)

    # resumed with a time budget that the first run's time already spent: no step, the clock came back
    versions = {a: adapters.latest_version(str(out / "adapters"), a)[0] for a in ("summary", "detail")}
    rc = train_cmd.cli_main([
        "--task", "tldr", "--engine", "transformers", "--model", model_path, "--num-steps", "5",
        "--num-generations", "2", "--prompts-per-step", "2", "--max-new-tokens", "24", "--eval-examples", "2",
        "--advantage-mode", "raw", "--max-minutes", "0.001", "--output-dir", str(out),
    ])
    assert rc == 0
    records = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2]
    assert {a: adapters.latest_version(str(out / "adapters"), a)[0] for a in versions} == versions
