"""`collab eval` (collab_app/commands/evaluate.py) on the real HumanEval task and sandbox, with a scripted
engine whose answers are known: the helper writes a real `aux`, main writes the canonical
solution (calling aux or not, per test). Checks every system's per-level means, pass@1, the
per-example returns, that the sequential baseline shows main the helper's code, and that the
single agent is asked for both functions."""
from __future__ import annotations

import math

import pytest

from collab_app.engines.engine_types import Sample
from collab_app.commands.evaluate import EvalConfig, evaluate, format_table
from tasks import load_task

AUX_SRC = "def aux(x):\n    return x\n"


class ScriptedEngine:
    """Answers by role, read off the prompt: the helper's prompt asks for `aux` only; main's and
    the single agent's for the entry function (full canonical solution; the single agent also
    defines aux). Records every (agent, prompt)."""

    name = "scripted"

    def __init__(self, main_calls_aux: bool):
        self.main_calls_aux = main_calls_aux
        self.requests = []
        self.loaded = {}

    def register_agent(self, agent):
        pass

    def load_adapter(self, agent, path, version):
        self.loaded[agent] = version

    def _answer(self, prompt: str) -> str:
        ex = next(e for e in load_task("humaneval").examples("eval") if e["prompt"].strip() in prompt)
        body = ex["canonical_solution"]
        if self.main_calls_aux:
            # passes its first argument through aux (identity) and goes on with the result: aux runs
            # while the tests pass and its result reaches main's return (the run-time cooperation
            # rule, tasks/coding.py); `_ = aux(0)` would be the ignored-result hack and earn nothing.
            p0 = ex["prompt"].split(f"def {ex['entry_point']}(", 1)[1].split(")", 1)[0].split(",")[0].split(":")[0].strip()
            body = f"    {p0} = aux({p0})\n" + body
        main = ex["prompt"] + body
        if "Write a helper function with this exact signature" in prompt:
            return f"```python\n{AUX_SRC}```"
        if "Write two Python functions" in prompt:  # single agent
            return f"```python\n{AUX_SRC}\n{main}```"
        return f"Here it is:\n```python\n{main}```"

    def generate(self, requests, n, sampling):
        self.requests += [(r.agent, r.prompt) for r in requests]
        return [[Sample(agent=r.agent, adapter_version=self.loaded.get(r.agent), prompt_token_ids=[1],
                        text=self._answer(r.prompt), token_ids=[2], logprobs=[-0.5]) for _ in range(n)]
                for r in requests]


@pytest.mark.parametrize("main_calls_aux", [False, True])
def test_eval_levels_pass_at_1_and_per_example_returns(main_calls_aux, tmp_path):
    engine = ScriptedEngine(main_calls_aux)
    cfg = EvalConfig(task="humaneval", limit=3, batch_size=2, adapters_dir=str(tmp_path))
    result = evaluate(cfg, engine=engine)
    assert set(result["systems"]) == {"team", "naive", "sequential", "single"}
    for name, s in result["systems"].items():
        assert s["examples"] == 3 and math.isclose(s["pass@1"], 1.0), name
        assert s["levels"]["structure"] == pytest.approx(1.0) and s["levels"]["syntax"] == pytest.approx(0.5)
        assert s["levels"]["tests"] == pytest.approx(1.0)
        # canonical main ignores aux: no cooperation; calling it and using the result: +0.5 +1.0
        assert s["levels"]["cooperation"] == pytest.approx(1.5 if main_calls_aux else 0.0)
        k = 3 if main_calls_aux else 0   # every answer cooperated, none as a thin wrapper; or none did
        assert s["cooperation_answers"] == {"calls_aux": k, "aux_reaches_return": k, "thin_wrapper": 0,
                                            "ignores_aux": 0, "rewarded": k}
        assert list(s["returns"]) == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
        assert all(r == pytest.approx(s["mean_return"]) for r in s["returns"].values())
    # team agents are named by role and get no adapter when the adapters dir is empty
    assert result["systems"]["team"]["adapter_versions"] == {"helper": None, "main": None}
    # sequential: main's prompt carries the helper's answer; naive/team: it never does
    seq_main = [p for a, p in engine.requests if a == "base-main" and "teammate's helper" in p]
    assert len(seq_main) == 3 and all(AUX_SRC.strip() in p for p in seq_main)
    assert "team" in format_table(result) and "single" in format_table(result)


def test_eval_rejects_unknown_systems():
    with pytest.raises(ValueError, match="unknown system"):
        EvalConfig(systems=["team", "debate"])


# ------------------------------------------------------------------------------- paired comparison
def test_paired_difference_by_hand():
    from collab_app.commands.evaluate import paired_difference

    a = {"p0": 1.0, "p1": 2.0, "p2": 0.5, "p3": 1.0, "only_a": 4.0}
    b = {"p0": 1.5, "p1": 2.0, "p2": 1.5, "p3": 0.5, "only_b": 0.0}
    c = paired_difference(a, b)
    assert c["problems"] == 4 and c["mean_diff"] == pytest.approx((0.5 + 0 + 1.0 - 0.5) / 4)
    assert (c["b_better"], c["equal"], c["b_worse"], c["only_in_a"], c["only_in_b"]) == (2, 1, 1, 1, 1)
    lo, hi = c["ci95"]
    assert -0.5 <= lo <= c["mean_diff"] <= hi <= 1.0                     # within the smallest / largest difference
    assert paired_difference(a, b) == c                                   # fixed seed: repeatable
    same = paired_difference(a, a)
    assert same["mean_diff"] == 0.0 and same["ci95"] == [0.0, 0.0]
    with pytest.raises(ValueError, match="share no problem"):
        paired_difference({"x": 1.0}, {"y": 1.0})


def test_compare_reads_eval_json_and_run_metrics(tmp_path, capsys):
    import json

    from collab_app.commands.evaluate import cli_main, load_returns

    ev = tmp_path / "eval.json"
    ev.write_text(json.dumps({"systems": {"team": {"returns": {"p0": 1.0, "p1": 0.0}},
                                          "naive": {"returns": {"p0": 0.0, "p1": 0.0}}}}))
    run = tmp_path / "metrics.jsonl"
    run.write_text("\n".join(json.dumps(r) for r in [
        {"kind": "eval", "step": 0, "returns": {"p0": 0.0, "p1": 1.0}},
        {"kind": "train", "step": 1, "return_mean": 1.0},
        {"kind": "eval", "step": 1, "returns": {"p0": 2.0, "p1": 1.0}}]) + "\n")
    assert load_returns(str(run)) == {"p0": 2.0, "p1": 1.0}                # the last eval
    assert load_returns(f"{run}@0") == {"p0": 0.0, "p1": 1.0}
    assert load_returns(str(ev), "naive") == {"p0": 0.0, "p1": 0.0}
    with pytest.raises(ValueError, match="no system 'single'"):
        load_returns(str(ev), "single")
    with pytest.raises(ValueError, match="at step 7"):
        load_returns(f"{run}@7")
    assert cli_main(["--compare", f"{run}@0", str(ev), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["mean_diff"] == pytest.approx(0.0) and (out["b_better"], out["b_worse"]) == (1, 1)
    with pytest.raises(SystemExit):
        cli_main(["--compare", str(ev)])


# ------------------------------------------------------------------------------- single-trained
class AdapterAwareEngine(ScriptedEngine):
    """ScriptedEngine whose single agent, once an adapter is loaded for it, answers with prose and
    no code (return 0): what single-trained evaluates is visibly the loaded adapter, and the paired
    rows have a known value."""

    def __init__(self, main_calls_aux: bool):
        super().__init__(main_calls_aux)
        self.paths = {}

    def load_adapter(self, agent, path, version):
        super().load_adapter(agent, path, version)
        self.paths[agent] = path

    def generate(self, requests, n, sampling):
        out = super().generate(requests, n, sampling)
        for r, samples in zip(requests, out):
            if r.agent == "coder" and "coder" in self.loaded:
                for s in samples:
                    s.text = "I would loop over the list."
        return out


def _version(adapters_dir, agent, version):
    from trainer import adapters

    return adapters.save_version(str(adapters_dir), agent, version,
                                 lambda d: open(f"{d}/adapter_config.json", "w").write("{}"), {"step": version})


def test_single_trained_loads_its_adapter_and_pairs_with_the_team(tmp_path):
    team_dir, single_dir = tmp_path / "team", tmp_path / "single"
    for agent in ("helper", "main"):
        _version(team_dir, agent, 0)
    _version(single_dir, "coder", 0)
    latest = _version(single_dir, "coder", 3)
    engine = AdapterAwareEngine(main_calls_aux=False)
    cfg = EvalConfig(task="humaneval", limit=3, batch_size=2, adapters_dir=str(team_dir),
                     single_adapters_dir=str(single_dir),
                     systems=["naive", "sequential", "single", "single-trained", "team"])
    result = evaluate(cfg, engine=engine)
    systems = result["systems"]
    # the single agent's newest version, from its own folder, under the single role; the team's from theirs
    assert (engine.loaded["coder"], engine.paths["coder"]) == (3, latest)
    assert systems["single-trained"]["adapter_versions"] == {"coder": 3}
    assert systems["team"]["adapter_versions"] == {"helper": 0, "main": 0}
    assert {a for a, _ in engine.requests} == {"helper", "main", "base-helper", "base-main", "base-coder", "coder"}
    # canonical answers: 2.5 of 4 (structure 1 + syntax 0.5 + tests 1, no cooperation); the trained single: 0
    assert systems["team"]["mean_return"] == pytest.approx(2.5) and systems["single"]["mean_return"] == pytest.approx(2.5)
    assert systems["single-trained"]["returns"] == {"HumanEval/0": 0.0, "HumanEval/1": 0.0, "HumanEval/2": 0.0}
    pair = result["paired"]["team - single-trained"]
    assert (pair["problems"], pair["b_better"]) == (3, 3)
    assert pair["mean_diff"] == pytest.approx(2.5) and pair["ci95"] == pytest.approx([2.5, 2.5])
    assert result["paired"]["single-trained - single"]["mean_diff"] == pytest.approx(-2.5)
    assert systems["single-trained"]["vs_naive"]["mean_diff"] == pytest.approx(-2.5)
    table = format_table(result)
    assert "single-trained" in table and "team - single-trained: +2.500 (95% CI +2.500 .. +2.500)" in table


def test_single_trained_without_a_trained_agent_stops_before_evaluating(tmp_path, capsys):
    from collab_app.commands.evaluate import cli_main

    engine = ScriptedEngine(main_calls_aux=False)
    cfg = EvalConfig(task="humaneval", limit=1, adapters_dir=str(tmp_path), systems=["team", "single-trained"])
    with pytest.raises(FileNotFoundError, match="collab train --task humaneval --num-agents 1"):
        evaluate(cfg, engine=engine)
    assert engine.requests == []
    assert cli_main(["--systems", "single-trained", "--single-adapters-dir", str(tmp_path), "--limit", "1"]) == 2
    assert "no version of the single agent 'coder'" in capsys.readouterr().err


def test_eval_config_rules_for_single_trained():
    assert "single-trained" not in EvalConfig().systems          # needs a trained agent: named, never implied
    EvalConfig(systems=["single-trained"], single_adapters_dir="x")
    with pytest.raises(ValueError, match="add single-trained to --systems"):
        EvalConfig(systems=["team", "single"], single_adapters_dir="runs/single/adapters")
    with pytest.raises(ValueError, match="twice"):
        EvalConfig(systems=["team", "team"])
