"""Issue 22 item 3 again, with the trainer's new default G=8 x 2 prompts per step: a MAGRPO team
against a GRPO single agent, 30 minutes each, the two runs at the same time on one core each of
the 2-core AVX2 box (taskset, VLLM_CPU_OMP_THREADS_BIND, one OpenMP thread, autogroup -20), seed 0:

    collab train --task humaneval --max-new-tokens 128 --learning-rate 5e-4 --num-steps 200 \\
      --max-minutes 30 --dynamic-sampling 1 --eval-every 100 --eval-examples 32 --keep-versions 0 \\
      --seed 0 --num-generations 8 --prompts-per-step 2 [--num-agents 1]

Held out = the trainer's final evaluation on HumanEval/0..31 (greedy, one answer each, never
trained on). Beside them, for the spread: the same team command run the day before beside
another lever (humaneval-issue22-lever-g8-metrics.jsonl) and item 3's G=4 x 4 pair
(humaneval-issue22-{team,single}-metrics.jsonl).

    .venv/bin/python docs/results/archive/issue22_team_single_g8.py   # prints the table; writes issue22-team-single-g8.json
"""
import json
import os
import statistics
import sys

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")   # docs/results: the raw files
sys.path.insert(0, os.path.join(HERE, "..", ".."))

from collab_app.commands.evaluate import paired_difference  # noqa: E402
from collab_app.web.plots import load_metrics  # noqa: E402

ARMS = {"team G=8 x 2 (pair)": "humaneval-issue22-pair-g8-team-metrics.jsonl",
        "single G=8 x 2 (pair)": "humaneval-issue22-pair-g8-single-metrics.jsonl",
        "team G=8 x 2 (day before, lever run)": "humaneval-issue22-lever-g8-metrics.jsonl",
        "team G=4 x 4 (item 3 pair)": "humaneval-issue22-team-metrics.jsonl",
        "single G=4 x 4 (item 3 pair)": "humaneval-issue22-single-metrics.jsonl"}


def summary(records: list[dict]) -> dict:
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    last = evals[-1]
    return {"steps": len(train), "minutes": round(train[-1].get("train_seconds", 0) / 60, 1),
            "train_return_first3": round(statistics.fmean(r["return_mean"] for r in train[:3]), 3),
            "train_return_last3": round(statistics.fmean(r["return_mean"] for r in train[-3:]), 3),
            "held_out": round(last["return_mean"], 3), "pass@1": round(last["pass@1"], 3),
            "cooperation": round(last.get("level/cooperation", 0.0), 3), "eval_step": last["step"],
            "returns": last["returns"]}


def main() -> None:
    out = {arm: summary(load_metrics(os.path.join(HERE, f))) for arm, f in ARMS.items()}
    team, single, team_before, team4, single4 = list(ARMS)
    out["team - single, G=8 pair"] = paired_difference(out[single]["returns"], out[team]["returns"])
    out["team G=8 pair - team G=8 day before"] = paired_difference(out[team_before]["returns"], out[team]["returns"])
    out["single G=8 - single G=4"] = paired_difference(out[single4]["returns"], out[single]["returns"])
    out["team G=4 - single G=4 (item 3)"] = paired_difference(out[single4]["returns"], out[team4]["returns"])
    with open(os.path.join(HERE, "issue22-team-single-g8.json"), "w") as f:
        json.dump(out, f, indent=1)
    for arm, s in out.items():   # arms: steps, minutes, train and held-out returns; pairs: B - A with its CI
        print(f"{arm}: {json.dumps({k: v for k, v in s.items() if k != 'returns'})}")

if __name__ == "__main__":
    main()
