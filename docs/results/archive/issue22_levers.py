"""Issue 22 item 4, the training levers: two 30-minute HumanEval runs that change one thing each
against the default team run of item 3 (`humaneval-issue22-team-metrics.jsonl`), compared at their
last held-out evaluation (HumanEval/0..31, greedy), paired per problem with a bootstrap 95% CI.

- g8:  G=8 with 2 prompts per step (the default: G=4 with 4): the same 16 samples per agent and
       step, so the same compute per step, but twice the siblings per group: a rare cooperating
       or passing answer is more likely to have a group to stand out in.
- t10: sampling temperature 1.0 (the default 0.8): more varied answers per group.

Each arm ran on its own core of the same 2-core AVX2 box, the two at the same time (the protocol of
item 3, whose team arm ran beside the single agent the same way):

    collab train --task humaneval --max-new-tokens 128 --learning-rate 5e-4 --num-steps 200 \\
      --max-minutes 30 --dynamic-sampling 1 --eval-every 10 --eval-examples 32 --keep-versions 0 --seed 0 \\
      {--num-generations 8 --prompts-per-step 2 | --num-generations 4 --prompts-per-step 4 --temperature 1.0}

    .venv/bin/python docs/results/archive/issue22_levers.py   # reads the metrics in docs/results; writes JSON + PNG there
"""
import json
import os
import statistics
import sys

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")   # docs/results: the raw files
sys.path.insert(0, os.path.join(HERE, "..", ".."))

from collab_app.commands.evaluate import paired_difference  # noqa: E402
from collab_app.web.plots import eval_minutes, load_metrics, minutes_figure  # noqa: E402

ARMS = {"default (G=4 x 4 prompts, T=0.8)": "humaneval-issue22-team-metrics.jsonl",
        "g8 (G=8 x 2 prompts)": "humaneval-issue22-lever-g8-metrics.jsonl",
        "t10 (temperature 1.0)": "humaneval-issue22-lever-t10-metrics.jsonl"}
# a second seed of the default and of g8 (`--seed 1 --eval-every 100`: evaluated at steps 0 and last),
# the two again at the same time, one core each; used where present
SEED1 = {"default, seed 1": "humaneval-issue22-lever-default-s1-metrics.jsonl",
         "g8, seed 1": "humaneval-issue22-lever-g8-s1-metrics.jsonl"}


def summary(records: list[dict]) -> dict:
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    last = evals[-1]
    coop = [r["level/cooperation"] for r in train if "level/cooperation" in r]
    return {"steps": len(train), "train_cooperation_level": round(statistics.fmean(coop), 4) if coop else None,
            "train_zero_variance_frac": round(statistics.fmean(r["zero_variance_frac"] for r in train), 3),
            "train_group_return_std": round(statistics.fmean(r["group_return_std"] for r in train), 3),
            "eval_step": last["step"], "return": round(last["return_mean"], 3), "pass@1": last["pass@1"],
            "cooperation": last.get("level/cooperation"), "cooperation_answers": last.get("cooperation_answers"),
            "returns": last["returns"]}


def main() -> None:
    runs = {arm: load_metrics(os.path.join(HERE, f)) for arm, f in ARMS.items()}
    out = {arm: summary(rs) for arm, rs in runs.items()}
    base_name = next(iter(ARMS))
    for arm in list(ARMS)[1:]:
        out[arm]["paired_vs_default"] = paired_difference(out[base_name]["returns"], out[arm]["returns"])
    if all(os.path.exists(os.path.join(HERE, f)) for f in SEED1.values()):
        d1, g1 = (summary(load_metrics(os.path.join(HERE, f))) for f in SEED1.values())
        g1["paired_vs_default"] = paired_difference(d1["returns"], g1["returns"])
        out["default, seed 1"], out["g8, seed 1"] = d1, g1
        # both seeds: each problem's return averaged over the two seeds, then paired over problems
        mean2 = lambda x, y: {k: (x[k] + y[k]) / 2 for k in x.keys() & y.keys()}   # noqa: E731
        out["g8 - default, both seeds"] = paired_difference(
            mean2(out[base_name]["returns"], d1["returns"]), mean2(out["g8 (G=8 x 2 prompts)"]["returns"], g1["returns"]))
    with open(os.path.join(HERE, "issue22-levers-train.json"), "w") as f:
        json.dump(out, f, indent=1)
    for arm, s in out.items():
        if "steps" not in s:
            print(f"{arm}: {s['mean_diff']:+.3f} ({s['ci95'][0]:+.3f} .. {s['ci95'][1]:+.3f}), "
                  f"better {s['b_better']} / equal {s['equal']} / worse {s['b_worse']}")
            continue
        pair = s.get("paired_vs_default")
        print(f"{arm:36s} steps {s['steps']:3d}  held-out return {s['return']:.3f}  pass@1 {s['pass@1']:.3f}  "
              f"cooperation {s['cooperation']}  train coop level {s['train_cooperation_level']}  "
              f"zero-var {s['train_zero_variance_frac']}"
              + (f"  vs default {pair['mean_diff']:+.3f} ({pair['ci95'][0]:+.3f} .. {pair['ci95'][1]:+.3f})" if pair else ""))
    curves = {f"{arm}, {out[arm]['steps']} steps": eval_minutes(rs) for arm, rs in runs.items()}
    fig = minutes_figure(curves, "HumanEval/0..31 held out, SmolLM2-135M, one AVX2 core each, 30 min", target=2.0)
    fig.axes[0].set_ylabel("held-out return (of 4)")
    fig.savefig(os.path.join(HERE, "humaneval-issue22-levers-minutes.png"), dpi=110)


if __name__ == "__main__":
    main()
