"""Issue 22 item 4 on TL;DR: is the G=8 lever (G=8 x 2 prompts per step, the same 16 samples per
agent and step as the default G=4 x 4) at least not worse on the writing task before it becomes
the default? Two 20-minute runs at the same time, one core each of the 2-core AVX2 box (the
protocol of item 3's TL;DR pair), seed 0:

    collab train --task tldr --max-new-tokens 128 --learning-rate 1e-3 --num-steps 200 --max-minutes 20 \\
      --dynamic-sampling 1 --eval-every 10 --eval-examples 5 --keep-versions 0 --seed 0 \\
      {--num-generations 8 --prompts-per-step 2 | --num-generations 4 --prompts-per-step 4}

The default arm ran again beside g8 (`default, rerun`); item 3's default run of the day before
(`tldr-issue22-team-metrics.jsonl`, same command and seed) shows the run-to-run spread.
Held out = the 5 eval texts (greedy, one joint answer each): too few for a CI to resolve much,
so the train returns (16 joint answers per step) are reported too.

    .venv/bin/python docs/results/archive/issue22_tldr_g8.py   # prints the table; writes issue22-tldr-g8.json
"""
import json
import os
import statistics
import sys

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")   # docs/results: the raw files
sys.path.insert(0, os.path.join(HERE, "..", ".."))

from collab_app.commands.evaluate import paired_difference  # noqa: E402
from collab_app.web.plots import load_metrics  # noqa: E402

ARMS = {"default, rerun (G=4 x 4)": "tldr-issue22-lever-default-rerun-metrics.jsonl",
        "g8 (G=8 x 2)": "tldr-issue22-lever-g8-metrics.jsonl",
        "default, item 3 (day before)": "tldr-issue22-team-metrics.jsonl"}


def summary(records: list[dict]) -> dict:
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    rets = [r["return_mean"] for r in train]
    return {"steps": len(train), "train_return_first3": round(statistics.fmean(rets[:3]), 3),
            "train_return_last3": round(statistics.fmean(rets[-3:]), 3),
            "train_return_all": round(statistics.fmean(rets), 3),
            "group_return_std": round(statistics.fmean(r["group_return_std"] for r in train), 3),
            "zero_variance_frac": round(statistics.fmean(r["zero_variance_frac"] for r in train), 3),
            "eval_first": round(evals[0]["return_mean"], 3), "eval_step": evals[-1]["step"],
            "eval_last": round(evals[-1]["return_mean"], 3), "returns": evals[-1]["returns"]}


def main() -> None:
    out = {arm: summary(load_metrics(os.path.join(HERE, f))) for arm, f in ARMS.items()}
    base, g8, old = list(ARMS)
    out["g8 - default rerun, held out"] = paired_difference(out[base]["returns"], out[g8]["returns"])
    out["default rerun - default item 3, held out"] = paired_difference(out[old]["returns"], out[base]["returns"])
    with open(os.path.join(HERE, "issue22-tldr-g8.json"), "w") as f:
        json.dump(out, f, indent=1)
    for arm, s in out.items():
        if "steps" in s:
            print(f"{arm:30s} steps {s['steps']:3d}  train return first3 {s['train_return_first3']:.3f} last3 "
                  f"{s['train_return_last3']:.3f} all {s['train_return_all']:.3f}  group std {s['group_return_std']}  "
                  f"zero-var {s['zero_variance_frac']}  held-out {s['eval_first']:.3f} -> {s['eval_last']:.3f} (step {s['eval_step']})")
        else:
            print(f"{arm}: {s['mean_diff']:+.3f} ({s['ci95'][0]:+.3f} .. {s['ci95'][1]:+.3f}), "
                  f"better {s['b_better']} / equal {s['equal']} / worse {s['b_worse']}")


if __name__ == "__main__":
    main()
